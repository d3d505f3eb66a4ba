"""Plain-jnp attention reference that honours a `LayerVisibility`.

This is the path CPU runs by default and the ground truth the Pallas kernel is tested against.
It materialises [B, K, G, T, T] logits (fine at test sizes; the kernel exists to avoid it).
Logits and softmax are computed in fp32 whatever the input dtype.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from trm_jax.kernels.visibility import LayerVisibility, visible_mask


def guarded_softmax(logits: jax.Array) -> jax.Array:
  """Softmax over the last axis of fp32 logits that may be -inf (masked keys).

  A fully masked row has max = -inf; 0 is used there so exp() gives 0, not NaN, and the row's
  probabilities are all 0. The cached decode (`models.kv_cache.attend`) and the eviction
  scores (`rollout.policies`) use this same function, so their probabilities are the
  reference's op for op.
  """
  m = jnp.max(logits, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(logits - m)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  return p / jnp.where(denom > 0, denom, 1.0)


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array,
                        vis: Optional[LayerVisibility] = None, *,
                        scale: Optional[float] = None) -> jax.Array:
  """Self-attention over one sequence array.

  Args:
    q: [B, T, N, H] queries (RoPE already applied).
    k, v: [B, T, K, H] keys and values; N must be a multiple of K (GQA).
    vis: padding / segment / eviction visibility; None means plain causal.
    scale: logit scale, default 1/sqrt(H).
  Returns:
    [B, T, N, H] in q.dtype. Queries that can see no key (padding rows) get zeros.
  """
  B, T, N, H = q.shape
  K = k.shape[2]
  if N % K:
    raise ValueError(f"query heads N={N} must be a multiple of kv heads K={K}")
  G = N // K
  scale = H ** -0.5 if scale is None else scale
  qg = q.reshape(B, T, K, G, H)
  logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k,
                      preferred_element_type=jnp.float32) * scale   # [B, K, G, T, S]
  mask = visible_mask(vis or LayerVisibility(), B, K, T)[:, :, None]  # [B, K, 1, T, S]
  p = guarded_softmax(jnp.where(mask, logits, -jnp.inf))
  o = jnp.einsum("BKGTS,BSKH->BTKGH", p.astype(v.dtype), v,
                 preferred_element_type=jnp.float32)
  return o.reshape(B, T, N, H).astype(q.dtype)
