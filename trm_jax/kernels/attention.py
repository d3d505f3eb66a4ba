"""One entry point for visibility-aware self-attention; picks an implementation.

  impl="reference"             plain-jnp path, materialises [B, K, G, T, S] logits
                               (attention_ref); any backend.
  impl="pallas"                the Triton flash kernel (flash_attention.py), compiled for GPU.
  impl="pallas_interpret"      the same Triton-layout kernel through the generic Pallas
                               interpreter (CPU tests, memory benchmarks); slow, but
                               numerically the kernel.
  impl="pallas_tpu"            the Mosaic TPU flash kernel (flash_attention_tpu.py).
  impl="pallas_tpu_interpret"  the TPU kernel through the Mosaic TPU interpreter
                               (`pltpu.InterpretParams`) on CPU.
  impl="auto"                  "pallas" on GPU, "pallas_tpu" on TPU, "reference" elsewhere.

`block_sizes` is a `BlockSizes` for the Triton impls and a `TPUBlockSizes` for the TPU ones.

Cached decoding (one query per row over a KV cache) takes the same `impl`: `decode_kernel`
gives the Pallas impls' decode kernel, in which each row reads its filled slots only
(`decode_attention.py`, Triton, for "pallas*"; `decode_attention_tpu.py`, Mosaic, for
"pallas_tpu*"); "reference" decodes with `models.kv_cache.attend`'s XLA einsums.

Under a mesh of more than one device (`jax.set_mesh`, as the trainer and `trm_jax.aot` run
every program) both Pallas kernels run per device through `shard_map` over rows and kv heads
(`kernels.partition`): XLA cannot partition a Pallas call itself. The reference is plain jnp
and is partitioned by XLA.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import jax

from trm_jax.kernels.attention_ref import attention_reference
from trm_jax.kernels.decode_attention import decode_attention
from trm_jax.kernels.decode_attention_tpu import decode_attention_tpu, filled_extent
from trm_jax.kernels.flash_attention import BlockSizes, flash_attention
from trm_jax.kernels.flash_attention_tpu import TPUBlockSizes, flash_attention_tpu
from trm_jax.kernels.partition import partitioned, partitioned_decode
from trm_jax.kernels.visibility import LayerVisibility

IMPLS = ("auto", "reference", "pallas", "pallas_interpret", "pallas_tpu",
         "pallas_tpu_interpret")
_AUTO = {"gpu": "pallas", "tpu": "pallas_tpu"}


def resolve_impl(impl: str, backend: Optional[str] = None) -> str:
  """Maps "auto" to a concrete implementation for `backend` (default: jax's default)."""
  if impl not in IMPLS:
    raise ValueError(f"attention impl={impl!r}; expected one of {IMPLS}")
  if impl == "auto":
    return _AUTO.get(backend or jax.default_backend(), "reference")
  return impl


def attention(q: jax.Array, k: jax.Array, v: jax.Array,
              vis: Optional[LayerVisibility] = None, *, impl: str = "auto",
              scale: Optional[float] = None,
              block_sizes: Optional[Union[BlockSizes, TPUBlockSizes]] = None) -> jax.Array:
  """q [B, T, N, H], k/v [B, T, K, H] -> [B, T, N, H]; see `visibility.py` for semantics.

  `block_sizes` tunes the Pallas kernel of the chosen impl (`BlockSizes` for "pallas*",
  `TPUBlockSizes` for "pallas_tpu*") and is ignored by the reference.
  """
  impl = resolve_impl(impl)
  if impl == "reference":
    return attention_reference(q, k, v, vis, scale=scale)
  tpu = impl.startswith("pallas_tpu")
  want = TPUBlockSizes if tpu else BlockSizes
  if block_sizes is not None and not isinstance(block_sizes, want):
    raise ValueError(f"attention impl={impl!r} takes block_sizes={want.__name__}(...), got "
                     f"{type(block_sizes).__name__}")
  kernel = flash_attention_tpu if tpu else flash_attention
  return partitioned(kernel, q, k, v, vis, scale=scale, block_sizes=block_sizes or want(),
                     interpret=impl.endswith("_interpret"))


def decode_kernel(impl: str) -> Optional[Callable[..., jax.Array]]:
  """The decode kernel of `impl` ("auto" resolved for the default backend): `f(q [B, N, H],
  k [B, K, H, C], v [B, K, C, H], pos [B, K, C], scale=None) -> o [B, N, H]`, run per device
  under a mesh; None where `impl` has none (decode with the XLA einsums)."""
  impl = resolve_impl(impl)
  if impl == "reference":
    return None
  interpret = impl.endswith("_interpret")
  kernel = decode_attention_tpu if impl.startswith("pallas_tpu") else decode_attention

  def run(q, k, v, pos, *, scale=None):
    return partitioned_decode(kernel, q, k, v, pos, filled_extent(pos), scale=scale,
                              interpret=interpret)
  return run
