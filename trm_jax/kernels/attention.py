"""One entry point for visibility-aware self-attention; picks an implementation.

  impl="reference"         plain-jnp path, materialises [B, K, G, T, S] logits (attention_ref).
  impl="pallas"            the flash kernel compiled for the accelerator (Triton on GPU).
  impl="pallas_interpret"  the same kernel through the Pallas interpreter (CPU tests, memory
                           benchmarks); slow, but numerically the kernel.
  impl="auto"              "pallas" on GPU, "reference" elsewhere. The kernel's block layout is
                           written for the Triton backend; TPU (Mosaic) takes the reference
                           until a TPU layout exists.
"""
from __future__ import annotations

from typing import Optional

import jax

from trm_jax.kernels.attention_ref import attention_reference
from trm_jax.kernels.flash_attention import BlockSizes, flash_attention
from trm_jax.kernels.visibility import LayerVisibility

IMPLS = ("auto", "reference", "pallas", "pallas_interpret")


def resolve_impl(impl: str) -> str:
  """Maps "auto" to a concrete implementation for the default backend."""
  if impl not in IMPLS:
    raise ValueError(f"attention impl={impl!r}; expected one of {IMPLS}")
  if impl == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "reference"
  return impl


def attention(q: jax.Array, k: jax.Array, v: jax.Array,
              vis: Optional[LayerVisibility] = None, *, impl: str = "auto",
              scale: Optional[float] = None,
              block_sizes: Optional[BlockSizes] = None) -> jax.Array:
  """q [B, T, N, H], k/v [B, T, K, H] -> [B, T, N, H]; see `visibility.py` for semantics.

  `block_sizes` tunes the Pallas kernel and is ignored by the reference.
  """
  impl = resolve_impl(impl)
  if impl == "reference":
    return attention_reference(q, k, v, vis, scale=scale)
  return flash_attention(q, k, v, vis, scale=scale, block_sizes=block_sizes or BlockSizes(),
                         interpret=impl == "pallas_interpret")
