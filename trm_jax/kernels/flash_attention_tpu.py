"""Visibility-aware flash attention for TPU (Pallas Mosaic): forward and backward, GQA.

Computes what `attention_ref.attention_reference` computes, with the predicate of
`visibility.py`

    query i sees key j  <=>  j <= i  and  seg[b, j] == seg[b, i] != 0  and  i < evicted_at[b, k, j]

evaluated per (query block x key block) tile from segment_ids [B, T] and evicted_at [B, K, T]
(k = kv head of the query head). No [T, T] array (mask, bias, logits) ever exists in HBM;
the largest side arrays are O(B * N * T) (logsumexp, delta) and the block tables below.

Algorithm: FlashAttention-2 as in `flash_attention.py` (the Triton kernel): fp32 online
softmax, row logsumexp saved for the backward, which recomputes probabilities in two kernels,
dk/dv (grid over key blocks) and dq (grid over query blocks), tied with `jax.custom_vjp`.

TPU layout, and why:
  * q/o are viewed as [B, T, N*Hp] and k/v as [B, T, K*Hp]. A q block is (block_q, Gs*Hp):
    Gs query heads of one kv head (Gs = G unless VMEM forces head chunks, below), so each k/v
    tile is fetched once per group (chunk) rather than once per query head, the visibility
    tile is computed once for those heads, and dk/dv accumulate the whole group in VMEM (no
    per-query-head fp32 dk/dv in HBM, unlike the Triton kernel). Hp is H rounded up to 128
    lanes; zero columns change neither q.k nor the output (H = 64 costs a padded copy).
    Under TPU tiled layouts [B, T, N, H] <-> [B, T, N*H] is not a bitcast: XLA inserts
    relayout copies (linear in T) wherever a neighbour wants the [B, T, N, H] tiling. A
    Qwen3-8B-shaped layer (projections, RoPE-like scaling, this kernel, output projection;
    grad w.r.t. x and Wq) compiled for v5e at T=8192 has 275 MiB of HBM temporaries, 160 MiB
    of them relayout copies of q, k, v and one more [T, N, H] array.
  * Side vectors are rows in HBM: segment ids [B, 1, T], evicted_at [B, K, 1, T], logsumexp
    and delta [B, N, 1, T] (the size-1 axis makes a (1, block) tile legal). A kernel that needs
    one as a column (query side in the forward/dq orientation [bq, bk], key side in the dk/dv
    orientation [bk, bq]) expands it in VMEM; dk/dv work on transposed scores s^T = k q^T so
    logsumexp and delta broadcast as rows there. delta = rowsum(dO * O) is computed by the dq
    kernel (which runs first) at its first key step, so the fp32 product never reaches HBM.
  * Grids: forward and dq (B, K*C, query blocks, key blocks); dk/dv (B, K, key blocks, C,
    query blocks); the last axes are "arbitrary" with fp32 accumulators in VMEM scratch, the
    others "parallel" (megacore). C = G / Gs head chunks.
  * VMEM: a step holds Gs * block_q query rows (q, o, dO tiles, accumulators, lane-replicated
    softmax statistics). AOT compiles for v5e (16 MiB default scoped VMEM) fit 2048 rows in
    the forward and 4096 (bf16) / 2048 (fp32) in the dq kernel; `plan_blocks` halves block_q to
    128 and then splits the group into chunks to stay inside (scaled by vmem_limit_bytes when
    given). Qwen3-8B (G=4) keeps the default blocks and whole groups; G=32 runs two chunks.
  * T is padded to a multiple of the largest block; padded positions get segment id 0, so
    they are invisible like any padding, and padded query rows are sliced off.

Block skipping (tables built in `tpu_blocks.py`). Three small int32 tables go to SMEM by
scalar prefetch: per query block and per key block the min/max non-zero segment id, and per
(b, kv head, key block) the max of evicted_at over the block's non-padding keys. A (query
block i, key block j) step is computed only if some pair in it can be visible: j starts at or
before the block's last query (causality), max(evicted_at) > the block's first query, and the
two segment ranges overlap (padding-only blocks have an empty range). Skipped steps are a
`pl.when` that does nothing. Fetches: per (b, kv head, outer block) the first and last inner
block that is computed are prefetched too, and the index_maps clamp the inner block index into
that range, so steps before the first / after the last computed block re-use a tile already
in VMEM and start no DMA (this covers the causal upper triangle, left padding, and fully
evicted leading blocks in the dk/dv kernel's query loop). Skipped blocks *between* two
computed ones (an evicted band with a kept sink block before it) are still fetched but not
computed: a fetch table exact for holes would take O(nq * nk) SMEM. SMEM holds
O(B * K * T / block) words (B = 256, K = 8, T = 4096 compiles for v5p).

Fully masked rows (padding, or every key evicted) give exact zeros, logsumexp -inf, and zero
gradients: probabilities are zeroed with `where(visible, ., 0)` and the row sum is guarded.

Runs on CPU through the Mosaic TPU interpreter (`interpret=True`, tests); on TPU it compiles
through Mosaic. Not yet run on a TPU: it is checked by the interpreter (numerics) and by
ahead-of-time compiles for real chips through libtpu's XLA:TPU and Mosaic compilers
(`tpu_aot.py`, bench/tpu_kernel_aot.py, bench/results/tpu_kernel_aot.json; jax 0.10.2, libtpu
0.0.42.1). Per-chip HBM temporaries (memory_analysis), Qwen3-8B attention shape B=1, N=32,
K=8, H=128, bf16, segment ids + evicted_at, default blocks; "fwd+bwd" is a vjp whose output
and input cotangents are program outputs; XLA keeps small temporaries (logsumexp, delta) in
VMEM on v5e/v6e, where they are not counted:

    chip  T       kernel fwd  kernel fwd+bwd  reference fwd         reference fwd+bwd
    v5e   8192    1.2 MiB     0               8.5 GiB               14.5 GiB
    v5e   32768   4.2 MiB     0               OOM (137 > 15.8 GiB)  OOM (233 > 15.8 GiB)
    v5p   8192    1.5 MiB     2.9 MiB         8.5 GiB               18.6 GiB
    v5p   32768   5.3 MiB     9.6 MiB         OOM (137 > 95.7 GiB)  OOM (242 > 95.7 GiB)
    v6e   8192    1.2 MiB     0               8.5 GiB               16.6 GiB
    v6e   32768   4.2 MiB     0               OOM (137 > 31.3 GiB)  OOM (202 > 31.3 GiB)
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from trm_jax.kernels.tpu_blocks import (LANES, SmemTables, TPUBlockSizes, block_tables,
                                        plan_blocks)
from trm_jax.kernels.flash_common import check_inputs, flash_with_vjp, round_up
from trm_jax.kernels.visibility import LayerVisibility

# Finite stand-in for -inf in the running max (exp(m_prev - m_next) is never inf - inf).
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class _Static:
  """Non-differentiable, hashable configuration of one call."""
  scale: float
  groups: int              # G = N // K
  head_dim: int            # Hp (padded, multiple of 128)
  blocks: TPUBlockSizes    # after clamping to T and fitting VMEM
  heads_fwd: int           # query heads per grid step (a divisor of G), forward
  heads_bwd: int           # the same for the backward kernels
  interpret: bool


# --------------------------------------------------------------------------------------------
# Tile helpers (traced inside the kernels).
# --------------------------------------------------------------------------------------------


def _div(a, n: int):
  """a // n for non-negative int32 scalars. lax.div truncates; `//` floors, which Mosaic
  lowers through `sign`, whose rule asks the local TPU its generation: a host without one
  (AOT compiles) cannot lower it."""
  return lax.div(a, jnp.int32(n))


def _lanes(x, n: int):
  """[rows, 128] lane-replicated -> [rows, n] (n a multiple of 128)."""
  return x if n == LANES else jnp.tile(x, (1, n // LANES))


def _column(row_ref):
  """A (1, n) row tile as an (n, 1) column (a relayout inside VMEM)."""
  return row_ref[0][:, None]


def _visible_qk(q_start, k_start, shape, q_seg, k_seg, k_ev, transposed: bool):
  """bool tile: [bq, bk] (q rows) or, transposed, [bk, bq] (k rows)."""
  q_axis, k_axis = (1, 0) if transposed else (0, 1)
  q_idx = q_start + lax.broadcasted_iota(jnp.int32, shape, q_axis)
  k_idx = k_start + lax.broadcasted_iota(jnp.int32, shape, k_axis)
  vis = (k_idx <= q_idx) & (q_seg == k_seg) & (k_seg != 0)
  if k_ev is not None:
    vis = vis & (q_idx < k_ev)
  return vis


def _precision(dtype):
  # fp32 inputs get fp32 matmuls (the MXU's multi-pass mode), not one bf16 pass.
  return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def _dot_nt(a, b):
  """a [m, d] @ b [n, d]^T -> [m, n] fp32."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_precision(a.dtype),
                         preferred_element_type=jnp.float32)


def _dot(a, b):
  """a [m, d] @ b [d, n] -> [m, n] fp32."""
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_precision(a.dtype),
                         preferred_element_type=jnp.float32)


def _params(st: _Static, n_parallel: int, n_arbitrary: int = 1):
  sem = ("parallel",) * n_parallel + ("arbitrary",) * n_arbitrary
  return pltpu.CompilerParams(dimension_semantics=sem,
                              vmem_limit_bytes=st.blocks.vmem_limit_bytes)


def _interpret(st: _Static):
  return pltpu.InterpretParams() if st.interpret else False


# --------------------------------------------------------------------------------------------
# Forward: grid (B, K * C, nq, nk); axis 1 is (kv head, chunk of Gs = G / C query heads).
# --------------------------------------------------------------------------------------------


def _fwd_kernel(*refs, st: _Static, K: int, nq: int, nk: int, has_ev: bool):
  """Query block i of head chunk hc against key block j: online softmax into VMEM scratch,
  normalised output and logsumexp rows written at the last key step."""
  tabs, refs = refs[:7], refs[7:]
  q_ref, k_ref, v_ref, segq_ref, segk_ref = refs[:5]
  ev_ref = refs[5] if has_ev else None
  o_ref, lse_ref, m_scr, l_scr, acc_scr = refs[6 if has_ev else 5:]
  bq, bk, Hp = st.blocks.block_q, st.blocks.block_k, st.head_dim
  Gs = st.heads_fwd
  b, hc, i, j = (pl.program_id(a) for a in range(4))
  kh = _div(hc, st.groups // Gs)
  smem = SmemTables(tabs, K=K, nq=nq, nk=nk, n_outer=nq)

  @pl.when(j == 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, _MASK_VALUE, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  @pl.when(smem.live(b, kh, i, j, bq, bk))
  def _compute():
    vis = _visible_qk(i * bq, j * bk, (bq, bk), _column(segq_ref), segk_ref[...],
                      None if ev_ref is None else ev_ref[...], transposed=False)
    k = k_ref[...]                                                    # [bk, Hp]
    v = v_ref[...]
    for g in range(Gs):                                               # this step's heads
      hs = slice(g * Hp, (g + 1) * Hp)
      s = jnp.where(vis, _dot_nt(q_ref[:, hs], k) * st.scale, _MASK_VALUE)   # [bq, bk]
      m_prev = m_scr[g]                                               # [bq, 128]
      m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
      alpha = jnp.exp(m_prev - m_next)
      p = jnp.where(vis, jnp.exp(s - _lanes(m_next, bk)), 0.0)       # exact 0 if hidden
      l_scr[g] = alpha * l_scr[g] + jnp.sum(p, axis=1, keepdims=True)
      m_scr[g] = m_next
      pv = _dot(p.astype(v.dtype), v)                                 # [bq, Hp]
      acc_scr[:, hs] = _lanes(alpha, Hp) * acc_scr[:, hs] + pv

  @pl.when(j == nk - 1)
  def _finish():
    for g in range(Gs):
      hs = slice(g * Hp, (g + 1) * Hp)
      l = l_scr[g]
      seen = l > 0.0                                                  # False: row saw no key
      l_safe = jnp.where(seen, l, 1.0)
      o_ref[:, hs] = (acc_scr[:, hs] / _lanes(l_safe, Hp)).astype(o_ref.dtype)
      lse = jnp.where(seen, m_scr[g] + jnp.log(l_safe), -jnp.inf)    # [bq, 128]
      lse_ref[g] = lse.T[:1, :]                                       # row [1, bq]


def _forward(q, k, v, seg, ev, st: _Static):
  """Padded q [B, T, N*Hp], k/v [B, T, K*Hp], seg [B, T], ev [B, K, T] | None
  -> (o [B, T, N*Hp], lse [B, N, 1, T] f32)."""
  B, T, _ = q.shape
  G, Hp, Gs = st.groups, st.head_dim, st.heads_fwd
  C = G // Gs
  K = k.shape[-1] // Hp
  N = K * G
  bq, bk = st.blocks.block_q, st.blocks.block_k
  nq, nk = T // bq, T // bk
  tabs = block_tables(seg, ev, K, bq, bk, outer="q")
  smem = lambda refs: SmemTables(refs, K=K, nq=nq, nk=nk, n_outer=nq)
  jf = lambda b, hc, i, j, refs: smem(refs).fetch(b, _div(hc, C), i, j)

  # q/o column block hc holds query heads hc*Gs .. hc*Gs + Gs - 1, all of kv head _div(hc, C).
  q_spec = pl.BlockSpec((None, bq, Gs * Hp), lambda b, hc, i, j, *r: (b, i, hc))
  kv_spec = pl.BlockSpec((None, bk, Hp),
                         lambda b, hc, i, j, *r: (b, jf(b, hc, i, j, r), _div(hc, C)))
  segq_spec = pl.BlockSpec((None, 1, bq), lambda b, hc, i, j, *r: (b, 0, i))
  segk_spec = pl.BlockSpec((None, 1, bk), lambda b, hc, i, j, *r: (b, 0, jf(b, hc, i, j, r)))
  ev_spec = pl.BlockSpec((None, None, 1, bk),
                         lambda b, hc, i, j, *r: (b, _div(hc, C), 0, jf(b, hc, i, j, r)))
  lse_spec = pl.BlockSpec((None, Gs, 1, bq), lambda b, hc, i, j, *r: (b, hc, 0, i))
  seg3 = seg[:, None, :]
  in_specs = [q_spec, kv_spec, kv_spec, segq_spec, segk_spec]
  args = [q, k, v, seg3, seg3]
  if ev is not None:
    in_specs.append(ev_spec)
    args.append(ev[:, :, None, :])
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=7, grid=(B, K * C, nq, nk), in_specs=in_specs,
      out_specs=[q_spec, lse_spec],
      scratch_shapes=[pltpu.VMEM((Gs, bq, LANES), jnp.float32),    # running max
                      pltpu.VMEM((Gs, bq, LANES), jnp.float32),    # running sum
                      pltpu.VMEM((bq, Gs * Hp), jnp.float32)])     # output accumulator
  kernel = functools.partial(_fwd_kernel, st=st, K=K, nq=nq, nk=nk, has_ev=ev is not None)
  return pl.pallas_call(
      kernel, grid_spec=grid_spec,
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((B, N, 1, T), jnp.float32)],
      compiler_params=_params(st, 3), interpret=_interpret(st),
      name="vis_flash_tpu_fwd")(*tabs.args(), *args)


# --------------------------------------------------------------------------------------------
# Backward (FlashAttention-2, Alg. 2):  p = exp(s - lse),  dv = p^T dO,  dp = dO v^T,
# ds = p * (dp - delta),  dq = scale ds k,  dk = scale ds^T q,  delta = rowsum(dO * O).
# --------------------------------------------------------------------------------------------


def _dkdv_kernel(*refs, st: _Static, K: int, nq: int, nk: int, has_ev: bool):
  """Grid (B, K, nk, C, nq): key block j of kv head kh against query blocks i of head chunk
  c; dk and dv accumulate over (c, i), i.e. over every query head of the group."""
  tabs, refs = refs[:7], refs[7:]
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, segq_ref, segk_ref = refs[:8]
  ev_ref = refs[8] if has_ev else None
  dk_ref, dv_ref, dk_scr, dv_scr = refs[9 if has_ev else 8:]
  bq, bk, Hp = st.blocks.block_q_bwd, st.blocks.block_k_bwd, st.head_dim
  Gs = st.heads_bwd
  b, kh, j, c, i = (pl.program_id(a) for a in range(5))
  smem = SmemTables(tabs, K=K, nq=nq, nk=nk, n_outer=nk)

  @pl.when((c == 0) & (i == 0))
  def _init():
    dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
    dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

  @pl.when(smem.live(b, kh, i, j, bq, bk))
  def _compute():
    # Transposed orientation [bk, bq]: key-side vectors are columns, query-side rows.
    vis = _visible_qk(i * bq, j * bk, (bk, bq), segq_ref[...], _column(segk_ref),
                      None if ev_ref is None else _column(ev_ref), transposed=True)
    k = k_ref[...]                                                    # [bk, Hp]
    v = v_ref[...]
    for g in range(Gs):
      hs = slice(g * Hp, (g + 1) * Hp)
      q = q_ref[:, hs]                                                # [bq, Hp]
      do = do_ref[:, hs]
      s_t = _dot_nt(k, q) * st.scale                                  # [bk, bq]
      p_t = jnp.where(vis, jnp.exp(s_t - lse_ref[g]), 0.0)           # lse row [1, bq]
      dv_scr[...] += _dot(p_t.astype(do.dtype), do)
      dp_t = _dot_nt(v, do)                                           # [bk, bq]
      ds_t = p_t * (dp_t - delta_ref[g])
      dk_scr[...] += _dot(ds_t.astype(q.dtype), q)

  @pl.when((c == st.groups // Gs - 1) & (i == nq - 1))
  def _finish():
    dk_ref[...] = (dk_scr[...] * st.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _dq_kernel(*refs, st: _Static, K: int, nq: int, nk: int, has_ev: bool):
  """Grid (B, K*C, nq, nk): query block i of head chunk hc against key blocks j.

  Also computes delta = rowsum(dO * O) (at j == 0, as a column, which is what dq needs) and
  writes it as a row for the dk/dv kernel, so delta never exists as an fp32 [B, T, N, H]
  product in HBM (XLA:TPU materialised it for the equivalent jnp expression).
  """
  tabs, refs = refs[:7], refs[7:]
  q_ref, k_ref, v_ref, do_ref, o_ref, lse_ref, segq_ref, segk_ref = refs[:8]
  ev_ref = refs[8] if has_ev else None
  dq_ref, delta_ref, dq_scr, delta_scr = refs[9 if has_ev else 8:]
  bq, bk, Hp = st.blocks.block_q_bwd, st.blocks.block_k_bwd, st.head_dim
  Gs = st.heads_bwd
  b, hc, i, j = (pl.program_id(a) for a in range(4))
  kh = _div(hc, st.groups // Gs)
  smem = SmemTables(tabs, K=K, nq=nq, nk=nk, n_outer=nq)

  @pl.when(j == 0)
  def _init():
    dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)
    for g in range(Gs):
      hs = slice(g * Hp, (g + 1) * Hp)
      prod = do_ref[:, hs].astype(jnp.float32) * o_ref[:, hs].astype(jnp.float32)
      delta_scr[g] = jnp.broadcast_to(jnp.sum(prod, axis=1, keepdims=True), (bq, LANES))

  @pl.when(smem.live(b, kh, i, j, bq, bk))
  def _compute():
    vis = _visible_qk(i * bq, j * bk, (bq, bk), _column(segq_ref), segk_ref[...],
                      None if ev_ref is None else ev_ref[...], transposed=False)
    k = k_ref[...]
    v = v_ref[...]
    for g in range(Gs):
      hs = slice(g * Hp, (g + 1) * Hp)
      s = _dot_nt(q_ref[:, hs], k) * st.scale                        # [bq, bk]
      p = jnp.where(vis, jnp.exp(s - _column(lse_ref.at[g])), 0.0)
      dp = _dot_nt(do_ref[:, hs], v)
      ds = p * (dp - _lanes(delta_scr[g], bk))
      dq_scr[:, hs] += _dot(ds.astype(k.dtype), k)

  @pl.when(j == nk - 1)
  def _finish():
    dq_ref[...] = (dq_scr[...] * st.scale).astype(dq_ref.dtype)
    for g in range(Gs):
      delta_ref[g] = delta_scr[g].T[:1, :]                            # row [1, bq]


def _backward(q, k, v, seg, ev, o, lse, do, st: _Static):
  """Padded residuals and dO [B, T, N*Hp] -> (dq, dk, dv) in the input dtypes."""
  B, T, _ = q.shape
  G, Hp, Gs = st.groups, st.head_dim, st.heads_bwd
  C = G // Gs
  K = k.shape[-1] // Hp
  N = K * G
  bq, bk = st.blocks.block_q_bwd, st.blocks.block_k_bwd
  nq, nk = T // bq, T // bk
  seg3 = seg[:, None, :]
  ev4 = None if ev is None else ev[:, :, None, :]
  has_ev = ev is not None

  # dq (and delta): outer over query blocks i, inner over key blocks j, like the forward.
  tabs = block_tables(seg, ev, K, bq, bk, outer="q")
  smem = lambda refs: SmemTables(refs, K=K, nq=nq, nk=nk, n_outer=nq)
  jf = lambda b, hc, i, j, refs: smem(refs).fetch(b, _div(hc, C), i, j)
  qrow = pl.BlockSpec((None, bq, Gs * Hp), lambda b, hc, i, j, *r: (b, i, hc))
  kvb = pl.BlockSpec((None, bk, Hp),
                     lambda b, hc, i, j, *r: (b, jf(b, hc, i, j, r), _div(hc, C)))
  stat = pl.BlockSpec((None, Gs, 1, bq), lambda b, hc, i, j, *r: (b, hc, 0, i))
  segq = pl.BlockSpec((None, 1, bq), lambda b, hc, i, j, *r: (b, 0, i))
  segk = pl.BlockSpec((None, 1, bk), lambda b, hc, i, j, *r: (b, 0, jf(b, hc, i, j, r)))
  evk = pl.BlockSpec((None, None, 1, bk),
                     lambda b, hc, i, j, *r: (b, _div(hc, C), 0, jf(b, hc, i, j, r)))
  in_specs = [qrow, kvb, kvb, qrow, qrow, stat, segq, segk] + ([evk] if has_ev else [])
  args = [q, k, v, do, o, lse, seg3, seg3] + ([ev4] if has_ev else [])
  dq, delta = pl.pallas_call(
      functools.partial(_dq_kernel, st=st, K=K, nq=nq, nk=nk, has_ev=has_ev),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=7, grid=(B, K * C, nq, nk), in_specs=in_specs,
          out_specs=[qrow, stat],
          scratch_shapes=[pltpu.VMEM((bq, Gs * Hp), jnp.float32),
                          pltpu.VMEM((Gs, bq, LANES), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((B, N, 1, T), jnp.float32)],
      compiler_params=_params(st, 3), interpret=_interpret(st),
      name="vis_flash_tpu_bwd_dq")(*tabs.args(), *args)

  # dk, dv: outer over key blocks j, inner over query blocks i (fetch clamped to live i's).
  tabs = block_tables(seg, ev, K, bq, bk, outer="k")
  smem = lambda refs: SmemTables(refs, K=K, nq=nq, nk=nk, n_outer=nk)
  if_ = lambda b, kh, j, i, refs: smem(refs).fetch(b, kh, j, i)
  qrow = pl.BlockSpec((None, bq, Gs * Hp),
                      lambda b, kh, j, c, i, *r: (b, if_(b, kh, j, i, r), kh * C + c))
  kvb = pl.BlockSpec((None, bk, Hp), lambda b, kh, j, c, i, *r: (b, j, kh))
  stat = pl.BlockSpec((None, Gs, 1, bq),
                      lambda b, kh, j, c, i, *r: (b, kh * C + c, 0, if_(b, kh, j, i, r)))
  segq = pl.BlockSpec((None, 1, bq), lambda b, kh, j, c, i, *r: (b, 0, if_(b, kh, j, i, r)))
  segk = pl.BlockSpec((None, 1, bk), lambda b, kh, j, c, i, *r: (b, 0, j))
  evk = pl.BlockSpec((None, None, 1, bk), lambda b, kh, j, c, i, *r: (b, kh, 0, j))
  in_specs = [qrow, kvb, kvb, qrow, stat, stat, segq, segk] + ([evk] if has_ev else [])
  args = [q, k, v, do, lse, delta, seg3, seg3] + ([ev4] if has_ev else [])
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, st=st, K=K, nq=nq, nk=nk, has_ev=has_ev),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=7, grid=(B, K, nk, C, nq), in_specs=in_specs,
          out_specs=[kvb, kvb],
          scratch_shapes=[pltpu.VMEM((bk, Hp), jnp.float32)] * 2),
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_params(st, 3, 2), interpret=_interpret(st),
      name="vis_flash_tpu_bwd_dkdv")(*tabs.args(), *args)
  return dq, dk, dv


# --------------------------------------------------------------------------------------------
# Public entry point (validation, padding, layout).
# --------------------------------------------------------------------------------------------



def _padded_length(T: int, blocks: TPUBlockSizes) -> int:
  return round_up(T, max(blocks.block_q, blocks.block_k, blocks.block_q_bwd,
                          blocks.block_k_bwd))


def _side_inputs(vis: LayerVisibility, B: int, T: int, T_pad: int):
  """(seg [B, T_pad] int32, ev [B, K, T_pad] int32 | None). Padding (segment 0 or the
  T_pad - T tail) is invisible to and from everything."""
  seg = (jnp.ones((B, T), jnp.int32) if vis.segment_ids is None
         else vis.segment_ids.astype(jnp.int32))
  seg = jnp.pad(seg, ((0, 0), (0, T_pad - T)))
  ev = vis.evicted_at
  if ev is not None:
    ev = jnp.pad(ev.astype(jnp.int32), ((0, 0), (0, 0), (0, T_pad - T)))
  return seg, ev


def flash_attention_tpu(q: jax.Array, k: jax.Array, v: jax.Array,
                        vis: Optional[LayerVisibility] = None, *,
                        scale: Optional[float] = None,
                        block_sizes: TPUBlockSizes = TPUBlockSizes(),
                        interpret: bool = False) -> jax.Array:
  """Visibility-aware self-attention on TPU; same contract as `attention_reference`.

  Args:
    q: [B, T, N, H] queries (RoPE applied), bf16 or fp32.
    k, v: [B, T, K, H]; N a multiple of K (GQA: query head n reads kv head n // (N // K)).
    vis: segment ids [B, T] and this layer's evicted_at [B, K, T]; None = plain causal.
    scale: logit scale, default 1/sqrt(H).
    block_sizes: tiles (`TPUBlockSizes`); T is padded up to a multiple of the largest.
    interpret: run the Mosaic TPU interpreter (CPU); False compiles for the TPU.
  Returns:
    [B, T, N, H] in q.dtype; query rows that see no key are zeros. Differentiable in q, k, v.
  """
  vis = vis or LayerVisibility()
  check_inputs("flash_attention_tpu", q, k, v, vis)
  B, T, N, H = q.shape
  K = k.shape[2]
  blocks, heads_fwd, heads_bwd = plan_blocks(block_sizes, T, N // K,
                                             jnp.dtype(q.dtype).itemsize)
  T_pad = _padded_length(T, blocks)
  Hp = round_up(H, LANES)
  st = _Static(scale=H ** -0.5 if scale is None else float(scale), groups=N // K,
               head_dim=Hp, blocks=blocks, heads_fwd=heads_fwd, heads_bwd=heads_bwd,
               interpret=interpret)
  pad4 = ((0, 0), (0, T_pad - T), (0, 0), (0, Hp - H))
  q, k, v = (jnp.pad(x, pad4).reshape(B, T_pad, -1) for x in (q, k, v))
  seg, ev = _side_inputs(vis, B, T, T_pad)
  o = _flash(q, k, v, seg, ev, st)
  return o.reshape(B, T_pad, N, Hp)[:, :T, :, :H]


# Padded q [B, T, N*Hp], k/v [B, T, K*Hp], seg [B, T], ev [B, K, T] | None.
_flash = flash_with_vjp(_forward, _backward)
