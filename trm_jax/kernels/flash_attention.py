"""Visibility-aware flash attention in Pallas (forward and backward, GQA).

Computes exactly what `attention_ref.attention_reference` computes, without ever building a
[T, S] mask, bias or logits array: the visibility predicate of `visibility.py`

    query i sees key j  <=>  j <= i  and  seg[b, j] == seg[b, i] != 0  and  i < evicted_at[b, k, j]

is evaluated per (block_q x block_k) tile from two small int32 side inputs, segment_ids [B, T]
and evicted_at [B, K, T], that reach the kernel through BlockSpecs. This is the memory claim of
SMD (docs/smd.md, "The learner"): the masked track costs the same
memory as plain causal attention.

Algorithm: FlashAttention-2 (Dao 2023, Alg. 1) for the forward, with an fp32 online softmax and
the row logsumexp saved for the backward; the backward (Alg. 2) recomputes the probabilities
from q, k and the saved logsumexp, with delta = rowsum(dO * O), in two kernels: one over key
blocks (dk, dv) and one over query blocks (dq). `jax.grad` cannot go through a raw
`pallas_call`, so the pair is tied together with `jax.custom_vjp`.

Deviations from the textbook kernel, and why:
  * Fully masked rows (padding, or a query whose every key was evicted) must give zeros, not
    the uniform average a finite mask value would give. Probabilities are therefore zeroed with
    `where(visible, exp(s - m), 0)` rather than relying on exp(mask_value - m) underflowing,
    and the row sum is guarded before the division. Their logsumexp is stored as -inf.
  * Natural exp rather than the exp2 trick: clarity over a few percent of speed.
  * GQA: the kernels run one program per *query* head and read the kv head n // G. dk and dv
    are written per query head in fp32 and summed over the G heads of a group outside the
    kernel ([B, S, N, H] fp32, linear in T) instead of accumulating across programs, which
    Triton could only do with atomics.
  * Causal block skipping: the forward and dq kernels stop at the diagonal block, the dk/dv
    kernel starts at it. The dk/dv kernel additionally stops at the first query block past
    max(evicted_at) of its key block (no later query can see any of those keys).
  * T is padded internally up to a multiple of the block sizes and the head dim up to a power
    of two >= 16 (the Triton lowering needs power-of-two tiles and dot operands of at least
    16). Padded keys sit at j >= T, so causality hides them from every real query; padded
    query rows are sliced off, and their zero cotangents contribute nothing to dk, dv.

On CPU the kernel runs with `interpret=True` (tests, memory benchmark); on GPU it lowers to
Triton. Written against jax 0.10.2's Pallas Triton backend. Mosaic (TPU) cannot tile this
layout (squeezed head dims in the minor block dims); TPU has its own kernel with the same
predicate, `flash_attention_tpu.py`, which `attention(impl="auto")` picks there.

tokamax (evaluated on CPU by `bench/tokamax_attention.py`, tokamax 0.0.17 + jax 0.11.1
and 0.0.12 + jax 0.10.2) as the GPU path instead: its Triton attention has no segment ids; the
predicate fits only its private `Mask` (causal, k_start = segment start for contiguous segments,
q_end = evicted_at repeated over the G query heads, since q_end's head axis is the query-head
axis; a [B, K, T] q_end is rejected). On rows that see a key it is as exact as this kernel
(B=2, T=256, N=8, K=2, fp32: out 6e-7, dq/dk/dv <= 5.3e-6 vs <= 4.8e-6 here), but rows that see
no key give 0.42 rather than 0, and with a non-zero cotangent there dv is off by 0.82. It does
not run with interpret=True (it calls program_id inside loops); in the Mosaic TPU interpreter
its forward+backward took 0.63-0.64x this kernel's time in that interpreter (this kernel in
the HLO interpreter: 1/41-1/48 of tokamax's time; interpreter times on a loaded 2-core machine, not
GPU times). It lowers for cuda (under jax 0.11.1 only with an abstract GPU device), but a
non-scalar q_end, and k_start in its backward, reach the kernels as dense [B, N, T, T] /
[B, 1, T, T] bool masks: O(T^2) memory, the cost this kernel exists to avoid. So it does not
replace this kernel as the GPU path.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from trm_jax.kernels.flash_common import check_inputs, flash_with_vjp, round_up
from trm_jax.kernels.visibility import LayerVisibility

# Finite stand-in for -inf in the running max, so that exp(m_prev - m_next) is never
# exp(-inf + inf) = NaN for rows that have not seen a visible key yet.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes; powers of two >= 16 (Triton). Tune per GPU and head dim."""
  block_q: int = 64       # forward: query rows per program
  block_k: int = 64       # forward: keys per inner-loop step
  block_q_bwd: int = 32   # backward: query rows per tile (program in dq, loop step in dk/dv)
  block_k_bwd: int = 32   # backward: keys per tile (program in dk/dv, loop step in dq)
  num_warps: Optional[int] = None  # Triton only; None = 4 for H <= 64 else 8
  num_stages: int = 2               # Triton only: software pipelining depth

  def __post_init__(self):
    for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
      b = getattr(self, name)
      if b < 16 or b & (b - 1):
        raise ValueError(f"BlockSizes.{name}={b} must be a power of two >= 16 "
                         "(Triton tiles are powers of two; tl.dot needs >= 16)")


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything the custom_vjp treats as non-differentiable and hashable."""
  scale: float
  groups: int           # G = N // K
  blocks: BlockSizes
  interpret: bool


# --------------------------------------------------------------------------------------------
# Shared tile helpers (traced inside the kernels).
# --------------------------------------------------------------------------------------------


def _visible(q_idx, k_idx, q_seg, k_seg, k_ev):
  """bool [bq, bk]: causal & same non-zero segment & not yet evicted (visibility.py)."""
  vis = q_idx[:, None] >= k_idx[None, :]
  if q_seg is not None:
    vis = vis & (q_seg[:, None] == k_seg[None, :]) & (k_seg[None, :] != 0)
  if k_ev is not None:
    vis = vis & (q_idx[:, None] < k_ev[None, :])
  return vis


def _dot_nt(a, b):
  """a [m, d] @ b[n, d]^T -> [m, n] in fp32."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_tn(a, b):
  """a [d, m]^T @ b [d, n] -> [m, n] in fp32."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _compiler_params(blocks: BlockSizes, head_dim: int):
  num_warps = blocks.num_warps or (4 if head_dim <= 64 else 8)
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=blocks.num_stages)


# --------------------------------------------------------------------------------------------
# Forward.
# --------------------------------------------------------------------------------------------


def _fwd_kernel(q_ref, k_ref, v_ref, seg_ref, ev_ref, o_ref, lse_ref, *,
                scale: float, block_q: int, block_k: int):
  """One program: query block `i` of (batch b, query head n) against all visible key blocks.

  Refs: q_ref [bq, H]; k_ref, v_ref [S, H] (kv head n // G); seg_ref [S] or None;
  ev_ref [S] or None (kv head n // G); o_ref [bq, H]; lse_ref [bq].
  """
  i = pl.program_id(0)
  H = q_ref.shape[-1]
  q = q_ref[...]                                                        # [bq, H]
  q_idx = i * block_q + jnp.arange(block_q)                             # [bq]
  q_seg = None if seg_ref is None else seg_ref[pl.ds(i * block_q, block_q)]

  def body(j, carry):
    o, m, l = carry                    # [bq, H] f32, [bq] f32, [bq] f32
    ks = pl.ds(j * block_k, block_k)
    k = k_ref[ks, :]                                                    # [bk, H]
    v = v_ref[ks, :]                                                    # [bk, H]
    k_idx = j * block_k + jnp.arange(block_k)
    vis = _visible(q_idx, k_idx, q_seg,
                   None if seg_ref is None else seg_ref[ks],
                   None if ev_ref is None else ev_ref[ks])              # [bq, bk]
    s = jnp.where(vis, _dot_nt(q, k) * scale, _MASK_VALUE)              # [bq, bk] f32
    m_next = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp(m - m_next)                                         # rescale old sums
    p = jnp.where(vis, jnp.exp(s - m_next[:, None]), 0.0)               # exact 0 if hidden
    l_next = alpha * l + jnp.sum(p, axis=-1)
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    o_next = alpha[:, None] * o + pv
    return o_next, m_next, l_next

  o = jnp.zeros((block_q, H), jnp.float32)
  m = jnp.full((block_q,), _MASK_VALUE, jnp.float32)
  l = jnp.zeros((block_q,), jnp.float32)
  # Causal: key blocks past the last query of this block are never visited. lax.div rather
  # than // because program ids are int32 scalars the Triton lowering handles this way.
  n_kv = lax.div((i + 1) * block_q + block_k - 1, block_k)
  o, m, l = lax.fori_loop(0, n_kv, body, (o, m, l))
  seen = l > 0.0                                          # False on fully masked rows
  o_ref[...] = (o / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


def _forward(q, k, v, seg, ev, st: _Static):
  """Padded inputs -> (o [B, T, N, H], lse [B, N, T] f32)."""
  B, T, N, H = q.shape
  bq, bk, G = st.blocks.block_q, st.blocks.block_k, st.groups
  kv_map = lambda i, b, n: (b, 0, lax.div(n, G), 0)
  in_specs = [
      pl.BlockSpec((None, bq, None, H), lambda i, b, n: (b, i, n, 0)),   # q
      pl.BlockSpec((None, T, None, H), kv_map),                          # k
      pl.BlockSpec((None, T, None, H), kv_map),                          # v
      None if seg is None else pl.BlockSpec((None, T), lambda i, b, n: (b, 0)),
      None if ev is None else pl.BlockSpec((None, None, T),
                                           lambda i, b, n: (b, lax.div(n, G), 0)),
  ]
  out_specs = [
      pl.BlockSpec((None, bq, None, H), lambda i, b, n: (b, i, n, 0)),   # o
      pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i)),         # lse
  ]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
               jax.ShapeDtypeStruct((B, N, T), jnp.float32)]
  kernel = functools.partial(_fwd_kernel, scale=st.scale, block_q=bq, block_k=bk)
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=(T // bq, B, N), in_specs=in_specs,
      out_specs=out_specs, compiler_params=_compiler_params(st.blocks, H),
      interpret=st.interpret, name="vis_flash_fwd")(q, k, v, seg, ev)


# --------------------------------------------------------------------------------------------
# Backward (FlashAttention-2, Alg. 2): recompute p = exp(s - lse) tile by tile.
#   dv = p^T dO,   dp = dO v^T,   ds = p * (dp - delta),   dq = scale ds k,   dk = scale ds^T q
# with delta = rowsum(dO * O). Hidden pairs have p = 0 exactly, so ds = 0 there and fully
# masked rows (lse = -inf) contribute nothing.
# --------------------------------------------------------------------------------------------


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_ref, ev_ref,
                 dk_ref, dv_ref, *, scale: float, block_q: int, block_k: int):
  """One program: key block `j` of (batch b, kv head n // G), against query head n.

  Refs: q_ref, do_ref [T, H]; k_ref, v_ref [bk, H]; lse_ref, delta_ref [T];
  seg_ref [T] or None; ev_ref [bk] or None; dk_ref, dv_ref [bk, H] f32 (per query head).
  """
  j = pl.program_id(0)
  T, H = q_ref.shape
  k = k_ref[...]                                                        # [bk, H]
  v = v_ref[...]                                                        # [bk, H]
  k_idx = j * block_k + jnp.arange(block_k)
  k_seg = None if seg_ref is None else seg_ref[pl.ds(j * block_k, block_k)]
  k_ev = None if ev_ref is None else ev_ref[...]

  def body(i, carry):
    dk, dv = carry                                                      # [bk, H] f32 each
    qs = pl.ds(i * block_q, block_q)
    q = q_ref[qs, :]                                                    # [bq, H]
    do = do_ref[qs, :]                                                  # [bq, H]
    q_idx = i * block_q + jnp.arange(block_q)
    vis = _visible(q_idx, k_idx, None if seg_ref is None else seg_ref[qs], k_seg, k_ev)
    s = _dot_nt(q, k) * scale                                           # [bq, bk] f32
    p = jnp.where(vis, jnp.exp(s - lse_ref[qs][:, None]), 0.0)
    dv = dv + _dot_tn(p.astype(do.dtype), do)
    dp = _dot_nt(do, v)                                                 # [bq, bk] f32
    ds = p * (dp - delta_ref[qs][:, None])
    dk = dk + _dot_tn(ds.astype(q.dtype), q)
    return dk, dv

  # Causal: queries before this key block see none of it. Eviction: a query i >= every
  # evicted_at of the block sees none of it either, so stop at the block holding max(ev).
  first = lax.div(j * block_k, block_q)
  last = T // block_q
  if ev_ref is not None:
    last = jnp.minimum(last, lax.div(jnp.max(k_ev) + block_q - 1, block_q))
  zeros = jnp.zeros((block_k, H), jnp.float32)
  dk, dv = lax.fori_loop(first, last, body, (zeros, zeros))
  dk_ref[...] = dk * scale
  dv_ref[...] = dv


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_ref, ev_ref, dq_ref, *,
               scale: float, block_q: int, block_k: int):
  """One program: query block `i` of (batch b, query head n) against its visible keys.

  Refs: q_ref, do_ref, dq_ref [bq, H]; k_ref, v_ref [S, H]; lse_ref, delta_ref [bq];
  seg_ref [S] or None; ev_ref [S] or None.
  """
  i = pl.program_id(0)
  H = q_ref.shape[-1]
  q = q_ref[...]
  do = do_ref[...]
  lse = lse_ref[...]
  delta = delta_ref[...]
  q_idx = i * block_q + jnp.arange(block_q)
  q_seg = None if seg_ref is None else seg_ref[pl.ds(i * block_q, block_q)]

  def body(j, dq):
    ks = pl.ds(j * block_k, block_k)
    k = k_ref[ks, :]
    v = v_ref[ks, :]
    k_idx = j * block_k + jnp.arange(block_k)
    vis = _visible(q_idx, k_idx, q_seg,
                   None if seg_ref is None else seg_ref[ks],
                   None if ev_ref is None else ev_ref[ks])
    s = _dot_nt(q, k) * scale
    p = jnp.where(vis, jnp.exp(s - lse[:, None]), 0.0)
    ds = p * (_dot_nt(do, v) - delta[:, None])
    return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  n_kv = lax.div((i + 1) * block_q + block_k - 1, block_k)
  dq = lax.fori_loop(0, n_kv, body, jnp.zeros((block_q, H), jnp.float32))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _backward(q, k, v, seg, ev, o, lse, do, st: _Static):
  """Padded residuals and dO [B, T, N, H] -> (dq, dk, dv) in the input dtypes."""
  B, T, N, H = q.shape
  K, G = k.shape[2], st.groups
  bq, bk = st.blocks.block_q_bwd, st.blocks.block_k_bwd
  # delta_i = sum_h dO_ih O_ih (FlashAttention-2, Alg. 2 line 4), fp32, [B, N, T].
  delta = jnp.einsum("BTNH,BTNH->BNT", do.astype(jnp.float32), o.astype(jnp.float32))
  params = _compiler_params(st.blocks, H)
  kv_head = lambda n: lax.div(n, G)

  # dk, dv: grid over key blocks; per query head, summed over the group below.
  full_q = pl.BlockSpec((None, T, None, H), lambda j, b, n: (b, 0, n, 0))
  row = pl.BlockSpec((None, None, T), lambda j, b, n: (b, n, 0))
  kv_blk = pl.BlockSpec((None, bk, None, H), lambda j, b, n: (b, j, kv_head(n), 0))
  out_blk = pl.BlockSpec((None, bk, None, H), lambda j, b, n: (b, j, n, 0))
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, scale=st.scale, block_q=bq, block_k=bk),
      out_shape=[jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)] * 2,
      grid=(T // bk, B, N),
      in_specs=[full_q, kv_blk, kv_blk, full_q, row, row,
                None if seg is None else pl.BlockSpec((None, T), lambda j, b, n: (b, 0)),
                None if ev is None else pl.BlockSpec(
                    (None, None, bk), lambda j, b, n: (b, kv_head(n), j))],
      out_specs=[out_blk, out_blk], compiler_params=params, interpret=st.interpret,
      name="vis_flash_bwd_dkdv")(q, k, v, do, lse, delta, seg, ev)
  dk = dk.reshape(B, T, K, G, H).sum(axis=3).astype(k.dtype)          # [B, T, K, H]
  dv = dv.reshape(B, T, K, G, H).sum(axis=3).astype(v.dtype)

  # dq: grid over query blocks, like the forward.
  q_blk = pl.BlockSpec((None, bq, None, H), lambda i, b, n: (b, i, n, 0))
  row_blk = pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i))
  full_kv = pl.BlockSpec((None, T, None, H), lambda i, b, n: (b, 0, kv_head(n), 0))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, scale=st.scale, block_q=bq, block_k=bk),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(T // bq, B, N),
      in_specs=[q_blk, full_kv, full_kv, q_blk, row_blk, row_blk,
                None if seg is None else pl.BlockSpec((None, T), lambda i, b, n: (b, 0)),
                None if ev is None else pl.BlockSpec(
                    (None, None, T), lambda i, b, n: (b, kv_head(n), 0))],
      out_specs=q_blk, compiler_params=params, interpret=st.interpret,
      name="vis_flash_bwd_dq")(q, k, v, do, lse, delta, seg, ev)
  return dq, dk, dv


# --------------------------------------------------------------------------------------------
# Public entry point (padding, validation).
# --------------------------------------------------------------------------------------------



def _pow2_at_least(x: int, lo: int) -> int:
  p = lo
  while p < x:
    p *= 2
  return p


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                    vis: Optional[LayerVisibility] = None, *,
                    scale: Optional[float] = None,
                    block_sizes: BlockSizes = BlockSizes(),
                    interpret: bool = False) -> jax.Array:
  """Visibility-aware self-attention; same contract as `attention_reference`.

  Args:
    q: [B, T, N, H] queries (RoPE applied).
    k, v: [B, T, K, H]; N a multiple of K (GQA, query head n reads kv head n // (N // K)).
    vis: segment ids [B, T] and this layer's evicted_at [B, K, T]; None = plain causal.
    scale: logit scale, default 1/sqrt(H).
    block_sizes: tile sizes (see `BlockSizes`); T is padded up to a multiple of them.
    interpret: run the Pallas interpreter (CPU); False compiles for the GPU.
  Returns:
    [B, T, N, H] in q.dtype; query rows that see no key are zeros. Differentiable in q, k, v.
  """
  vis = vis or LayerVisibility()
  check_inputs("flash_attention", q, k, v, vis)
  B, T, N, H = q.shape
  K = k.shape[2]
  scale = H ** -0.5 if scale is None else float(scale)
  st = _Static(scale=scale, groups=N // K, blocks=block_sizes, interpret=interpret)
  T_pad = round_up(T, max(block_sizes.block_q, block_sizes.block_k,
                           block_sizes.block_q_bwd, block_sizes.block_k_bwd))
  H_pad = _pow2_at_least(H, 16)
  pad4 = ((0, 0), (0, T_pad - T), (0, 0), (0, H_pad - H))
  # Zero-padding H leaves q.k unchanged and adds zero output columns; padded keys j >= T are
  # hidden from every real query by causality, so the side inputs may pad with anything.
  q, k, v = (jnp.pad(x, pad4) for x in (q, k, v))
  seg = vis.segment_ids
  ev = vis.evicted_at
  if seg is not None:
    seg = jnp.pad(seg.astype(jnp.int32), ((0, 0), (0, T_pad - T)))
  if ev is not None:
    ev = jnp.pad(ev.astype(jnp.int32), ((0, 0), (0, 0), (0, T_pad - T)))
  o = _flash(q, k, v, seg, ev, st)
  return o[:, :T, :, :H]


# Padded q [B, T, N, H], k/v [B, T, K, H], seg [B, T] | None, ev [B, K, T] | None.
_flash = flash_with_vjp(_forward, _backward)
