"""What the two Pallas flash-attention kernels share: the input contract, the padding
arithmetic and the custom_vjp wiring of a forward that saves the logsumexp.

`flash_attention` (Triton layout, GPU) and `flash_attention_tpu` (Mosaic layout) differ in
their tiles, layouts and kernels, not in what they accept or how their gradient is defined.
"""
from __future__ import annotations

import functools

import jax

from trm_jax.kernels.visibility import LayerVisibility


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def check_inputs(who: str, q, k, v, vis: LayerVisibility) -> None:
  """Raises ValueError, prefixed by the kernel's name `who`, unless q [B, T, N, H] and k, v
  [B, T, K, H] are self-attention over one array with N a multiple of K, and the visibility
  is this layer's (segment ids [B, T], evicted_at [B, K, T])."""
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"{who}: q {q.shape}, k {k.shape}, v {v.shape} must be "
                     "[B, T, N, H], [B, T, K, H], [B, T, K, H]")
  B, T, N, H = q.shape
  K = k.shape[2]
  if k.shape != (B, T, K, H) or v.shape != k.shape:
    raise ValueError(f"{who}: k {k.shape} and v {v.shape} must both be "
                     f"[B={B}, T={T}, K, H={H}] (self-attention over one array)")
  if N % K:
    raise ValueError(f"{who}: query heads N={N} must be a multiple of kv heads K={K}")
  if vis.segment_ids is not None and vis.segment_ids.shape != (B, T):
    raise ValueError(f"{who}: segment_ids {vis.segment_ids.shape} != [B, T] = {(B, T)}")
  if vis.evicted_at is not None and vis.evicted_at.shape != (B, K, T):
    raise ValueError(f"{who}: evicted_at {vis.evicted_at.shape} != [B, K, T] = "
                     f"{(B, K, T)} (pass LayerVisibility, i.e. Visibility.layer(l))")


def flash_with_vjp(forward, backward):
  """`flash(q, k, v, seg, ev, st)`, differentiable in q, k, v, from a kernel's
  `forward(q, k, v, seg, ev, st) -> (o, lse)` and
  `backward(q, k, v, seg, ev, o, lse, do, st) -> (dq, dk, dv)`; `st` is static."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
  def flash(q, k, v, seg, ev, st):
    return forward(q, k, v, seg, ev, st)[0]

  def flash_fwd(q, k, v, seg, ev, st):
    o, lse = forward(q, k, v, seg, ev, st)
    return o, (q, k, v, seg, ev, o, lse)

  def flash_bwd(st, res, do):
    q, k, v, seg, ev, o, lse = res
    dq, dk, dv = backward(q, k, v, seg, ev, o, lse, do, st)
    return dq, dk, dv, None, None   # integer side inputs get no cotangent

  flash.defvjp(flash_fwd, flash_bwd)
  return flash
