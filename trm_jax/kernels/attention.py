"""One entry point for visibility-aware self-attention; picks an implementation.

`impl="reference"` is the plain-jnp path (default on CPU). Faster implementations register
here and are selected by `impl` or, with `impl="auto"`, by backend.
"""
from __future__ import annotations

from typing import Optional

import jax

from trm_jax.kernels.attention_ref import attention_reference
from trm_jax.kernels.visibility import LayerVisibility

IMPLS = ("auto", "reference")


def attention(q: jax.Array, k: jax.Array, v: jax.Array,
              vis: Optional[LayerVisibility] = None, *, impl: str = "auto",
              scale: Optional[float] = None) -> jax.Array:
  """q [B, T, N, H], k/v [B, T, K, H] -> [B, T, N, H]; see `visibility.py` for semantics."""
  if impl not in IMPLS:
    raise ValueError(f"attention impl={impl!r}; expected one of {IMPLS}")
  return attention_reference(q, k, v, vis, scale=scale)
