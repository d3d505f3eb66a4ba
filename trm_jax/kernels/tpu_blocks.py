"""Block sizes, VMEM fitting and block-skipping tables of the TPU flash kernel.

`flash_attention_tpu.py` runs a grid of (query block, key block) steps. This module decides
how big the blocks are (`TPUBlockSizes`, `plan_blocks`) and which steps can hold a visible
pair at all (`block_tables`): small int32 tables built in XLA (O(B * K * T / block)) that the
kernels read from SMEM (`SmemTables`) to skip compute and DMA. `block_live` is the one block
predicate, shared by the table builder and the kernels.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from trm_jax.kernels.visibility import NEVER_EVICTED

LANES = 128
EMPTY_LO = 2**30   # segment range of a block with no valid position: lo > hi, overlaps nothing
EMPTY_HI = -1


@dataclasses.dataclass(frozen=True)
class TPUBlockSizes:
  """Tile sizes of the TPU kernel: powers of two >= 128 (lanes). Clamped down for short T."""
  block_q: int = 512       # forward: query rows per step
  block_k: int = 512       # forward: keys per step
  block_q_bwd: int = 256   # backward: query rows per step (dk/dv inner loop, dq outer)
  block_k_bwd: int = 512   # backward: keys per step (dk/dv outer, dq inner loop)
  vmem_limit_bytes: Optional[int] = None   # Mosaic scoped-VMEM limit; None = chip default

  def __post_init__(self):
    for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
      b = getattr(self, name)
      if b < LANES or b & (b - 1):
        raise ValueError(f"TPUBlockSizes.{name}={b} must be a power of two >= {LANES} "
                         "(TPU tiles: the key and query block are lane dimensions)")

  def clamped(self, T: int) -> "TPUBlockSizes":
    """Blocks no larger than T rounded up to a power of two (>= 128)."""
    cap = max(LANES, 1 << max(0, (T - 1).bit_length()))
    return dataclasses.replace(self, **{n: min(getattr(self, n), cap) for n in
                                        ("block_q", "block_k", "block_q_bwd", "block_k_bwd")})


# Query rows (heads per step x block_q) one grid step may hold within the 16 MiB default
# scoped VMEM of v5e/v5p. Found by AOT-compiling for v5e over G in {2, 4, 8, 16}, blocks
# 128..512, bf16 and fp32 (bench/tpu_kernel_aot.py's topologies): the forward fits 2048 rows
# in either dtype (4096 overflows); the dq kernel, which holds q, dO, O and dq tiles, fits
# 4096 rows in bf16 and 2048 in fp32. Scaled by vmem_limit_bytes / 16 MiB when that is set.
DEFAULT_SCOPED_VMEM = 16 * 2**20
FWD_ROWS = 2048
BWD_ROW_BYTES = 8192      # rows = BWD_ROW_BYTES // itemsize


def fit_rows(block_q: int, groups: int, rows: int):
  """(block_q, heads per step): shrink the block to 128 first, then split the group."""
  while groups * block_q > rows and block_q > LANES:
    block_q //= 2
  heads = max((d for d in range(1, groups + 1) if groups % d == 0 and d * block_q <= rows),
              default=1)
  return block_q, heads


def plan_blocks(blocks: TPUBlockSizes, T: int, groups: int, itemsize: int):
  """Blocks clamped to T and fitted to VMEM, and the heads per step of each pass."""
  blocks = blocks.clamped(T)
  scale = (blocks.vmem_limit_bytes or DEFAULT_SCOPED_VMEM) / DEFAULT_SCOPED_VMEM
  bq, heads_fwd = fit_rows(blocks.block_q, groups, int(FWD_ROWS * scale))
  bq_bwd, heads_bwd = fit_rows(blocks.block_q_bwd, groups,
                               int(BWD_ROW_BYTES // itemsize * scale))
  return dataclasses.replace(blocks, block_q=bq, block_q_bwd=bq_bwd), heads_fwd, heads_bwd


# --------------------------------------------------------------------------------------------
# Block tables (XLA side, O(B * K * T / block)) and the shared block predicate.
# --------------------------------------------------------------------------------------------


def block_live(i, j, q_lo, q_hi, k_lo, k_hi, k_ev, bq: int, bk: int):
  """Can any pair of query block i and key block j be visible? Conservative, never wrong.

  Works on arrays (table building) and on SMEM scalars (inside the kernels) alike.
  """
  causal = j * bk <= (i + 1) * bq - 1
  alive = k_ev > i * bq
  overlap = jnp.maximum(q_lo, k_lo) <= jnp.minimum(q_hi, k_hi)
  return causal & alive & overlap


@dataclasses.dataclass(frozen=True)
class BlockTables:
  """Flattened int32 tables for scalar prefetch (SMEM), for one (block_q, block_k) pair."""
  q_lo: jax.Array     # [B * nq] min non-zero segment id of the query block (EMPTY_LO if none)
  q_hi: jax.Array     # [B * nq] max non-zero segment id (EMPTY_HI if none)
  k_lo: jax.Array     # [B * nk]
  k_hi: jax.Array     # [B * nk]
  k_ev: jax.Array     # [B * K * nk] max evicted_at over the block's valid keys (0 if none)
  f_lo: jax.Array     # [B * K * n_outer] first live inner block of each outer block
  f_hi: jax.Array     # [B * K * n_outer] last live inner block (both 0 if none is live)

  def args(self):
    return (self.q_lo, self.q_hi, self.k_lo, self.k_hi, self.k_ev, self.f_lo, self.f_hi)


def seg_ranges(seg, block):
  s = seg.reshape(seg.shape[0], -1, block)
  valid = s != 0
  lo = jnp.where(valid, s, EMPTY_LO).min(-1)
  hi = jnp.where(valid, s, EMPTY_HI).max(-1)
  return lo, hi, valid


def block_summaries(seg, ev, K: int, bq: int, bk: int):
  """Per-block summaries and the [B, K, nq, nk] bool `live` they imply (XLA, tiny)."""
  B, T = seg.shape
  nq, nk = T // bq, T // bk
  q_lo, q_hi, _ = seg_ranges(seg, bq)                          # [B, nq]
  k_lo, k_hi, k_valid = seg_ranges(seg, bk)                    # [B, nk], [B, nk, bk]
  if ev is None:
    k_ev = jnp.where(k_valid.any(-1), jnp.int32(NEVER_EVICTED), 0)[:, None, :]
    k_ev = jnp.broadcast_to(k_ev, (B, K, nk))
  else:
    evb = ev.reshape(B, K, nk, bk)
    k_ev = jnp.where(k_valid[:, None], evb, 0).max(-1)          # [B, K, nk]
  i = jnp.arange(nq)[:, None]
  j = jnp.arange(nk)[None, :]
  live = block_live(i, j, q_lo[:, None, :, None], q_hi[:, None, :, None],
                     k_lo[:, None, None, :], k_hi[:, None, None, :], k_ev[:, :, None, :],
                     bq, bk)                                      # [B, K, nq, nk]
  return (q_lo, q_hi, k_lo, k_hi, k_ev), live


def block_tables(seg, ev, K: int, bq: int, bk: int, outer: str) -> BlockTables:
  """Tables for a kernel whose outer grid axis runs over `outer` ("q" or "k") blocks."""
  (q_lo, q_hi, k_lo, k_hi, k_ev), live = block_summaries(seg, ev, K, bq, bk)
  if outer == "k":
    live = jnp.swapaxes(live, -1, -2)                            # [B, K, nk, nq]
  n_in = live.shape[-1]
  any_live = live.any(-1)
  first = jnp.where(any_live, jnp.argmax(live, -1), 0)
  last = jnp.where(any_live, n_in - 1 - jnp.argmax(live[..., ::-1], -1), 0)
  i32 = lambda x: x.astype(jnp.int32).reshape(-1)
  return BlockTables(i32(q_lo), i32(q_hi), i32(k_lo), i32(k_hi), i32(k_ev), i32(first), i32(last))


class SmemTables:
  """Reads the scalar-prefetched tables inside a kernel or an index_map."""

  def __init__(self, refs, *, K: int, nq: int, nk: int, n_outer: int):
    self.q_lo, self.q_hi, self.k_lo, self.k_hi, self.k_ev, self.f_lo, self.f_hi = refs
    self.K, self.nq, self.nk, self.n_outer = K, nq, nk, n_outer

  def live(self, b, kh, i, j, bq: int, bk: int):
    return block_live(i, j, self.q_lo[b * self.nq + i], self.q_hi[b * self.nq + i],
                       self.k_lo[b * self.nk + j], self.k_hi[b * self.nk + j],
                       self.k_ev[(b * self.K + kh) * self.nk + j], bq, bk)

  def fetch(self, b, kh, outer, inner):
    """Inner block to hold in VMEM at this step: `inner` clamped to the live range."""
    f = (b * self.K + kh) * self.n_outer + outer
    return jnp.minimum(jnp.maximum(inner, self.f_lo[f]), self.f_hi[f])
