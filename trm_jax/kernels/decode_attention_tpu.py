"""One decode query per row over a KV cache, reading each row's filled slots only (Pallas TPU).

Computes what `models.kv_cache.attend` computes (fp32 logits, empty slots masked, a row that
sees no key gives zeros) without the attention probabilities, for rows whose caches are filled
to different depths: a continuous batch's slots hold rows that started at different times, so
one row may have 4000 filled slots and its neighbour 40. The XLA path reads every row up to
the sampler's bucket (the longest row's, `rollout.cache.slot_buckets`); this kernel reads row
b's slots [0, extent[b]) and no further, which is what makes a decode step's cost follow the
live length on a TPU.

Layout (the cache's own, no copy): q [B, K, G, H] (G query heads per kv head), k [B, K, H, C]
(keys transposed, slots last), v [B, K, C, H], pos [B, K, C] (-1 = empty), extent [B] int32.
Grid (B, K, C / block); the slot axis is "arbitrary" with an fp32 online softmax (running max,
running sum, output accumulator) in VMEM scratch, the others "parallel". extent goes to SMEM by
scalar prefetch: a step whose block starts at or after extent[b] computes nothing, and the
index maps clamp the block index to the row's last filled block, so those steps re-use the
tile already in VMEM and start no DMA. Slots inside the extent that are empty (evicted holes,
pos -1) are masked, as in the reference.

Numerics: equal to `kv_cache.attend` up to fp32 rounding (online vs one-pass softmax), which is
the same relation the learner's flash kernels have to the reference; the sampler's log-probs
still match the learner's to rounding (tests/test_kernels_decode.py).

Runs on CPU through the Mosaic TPU interpreter (`interpret=True`, tests); compiles for TPU
chips without one through libtpu (`trm_jax.tpu_aot`). Not yet run on a TPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from trm_jax.kernels.flash_attention_tpu import _MASK_VALUE, _div, _dot, _lanes
from trm_jax.kernels.tpu_blocks import LANES

BLOCK = 512          # slots per grid step (a multiple of 128: the key tile's lane dimension)


def filled_extent(pos: jax.Array) -> jax.Array:
  """pos [B, K, C] -> [B] int32: 1 + the highest filled slot of any kv head of the row (0 for
  a row with no key). Every filled slot lies below it."""
  C = pos.shape[-1]
  idx = jnp.arange(1, C + 1, dtype=jnp.int32)
  return jnp.max(jnp.where(pos >= 0, idx, 0), axis=(1, 2)).astype(jnp.int32)


def decode_inputs(q, k, v, pos, extent, scale):
  """What both decode kernels check and default: (G, scale, extent) for q [B, N, H], the
  cache's k [B, K, H, C], v [B, K, C, H], pos [B, K, C]; a shape mismatch names all four."""
  B, N, H = q.shape
  _, K, Hk, C = k.shape
  if N % K or Hk != H or v.shape != (B, K, C, H) or pos.shape != (B, K, C):
    raise ValueError(f"decode attention: q {q.shape}, k {k.shape}, v {v.shape}, pos "
                     f"{pos.shape} are not [B, N, H], [B, K, H, C], [B, K, C, H], [B, K, C] "
                     "with N a multiple of K")
  scale = H ** -0.5 if scale is None else float(scale)
  extent = filled_extent(pos) if extent is None else extent.astype(jnp.int32)
  return N // K, scale, extent


def _kernel(extent_ref, q_ref, k_ref, v_ref, pos_ref, o_ref, m_scr, l_scr, acc_scr, *,
            scale: float, block: int, nc: int):
  b, c = pl.program_id(0), pl.program_id(2)

  @pl.when(c == 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, _MASK_VALUE, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  @pl.when(c * block < extent_ref[b])
  def _compute():
    q = q_ref[...]                                                   # [G, H]
    k = k_ref[...]                                                   # [H, block]
    vis = pos_ref[...] >= 0                                          # [1, block]
    s = _dot(q, k) * scale                                           # [G, block] fp32
    s = jnp.where(vis, s, _MASK_VALUE)
    m_prev = m_scr[...]                                              # [G, 128]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(vis, jnp.exp(s - _lanes(m_next, block)), 0.0)     # exact 0 on empty slots
    l_scr[...] = alpha * l_scr[...] + jnp.sum(p, axis=1, keepdims=True)
    m_scr[...] = m_next
    v = v_ref[...]                                                   # [block, H]
    acc_scr[...] = alpha[:, :1] * acc_scr[...] + _dot(p.astype(v.dtype), v)

  @pl.when(c == nc - 1)
  def _finish():
    l = l_scr[...][:, :1]                                            # [G, 1]
    o_ref[...] = (acc_scr[...] / jnp.where(l > 0.0, l, 1.0)).astype(o_ref.dtype)


def decode_attention_tpu(q: jax.Array, k: jax.Array, v: jax.Array, pos: jax.Array,
                         extent: jax.Array | None = None, *, scale: float | None = None,
                         block: int = BLOCK, interpret: bool = False) -> jax.Array:
  """q [B, N, H], the cache's k [B, K, H, C], v [B, K, C, H], pos [B, K, C] -> o [B, N, H].

  Args:
    extent: [B] int32 slots to read per row (default `filled_extent(pos)`); slots at or after
      it must be empty.
    block: slots per grid step; clamped to C (rounded up to 128, the cache padded with empty
      slots when C is not a multiple).
    interpret: run the Mosaic TPU interpreter (CPU); False compiles for the TPU.
  """
  B, N, H = q.shape
  _, K, _, C = k.shape
  G, scale, extent = decode_inputs(q, k, v, pos, extent, scale)
  block = min(block, -(-C // LANES) * LANES)
  if block % LANES:
    raise ValueError(f"decode attention block={block} must be a multiple of {LANES}")
  Cp = -(-C // block) * block
  if Cp != C:   # padded slots are empty (pos -1), so they are masked like any empty slot
    k = jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, Cp - C)))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, Cp - C), (0, 0)))
    pos = jnp.pad(pos, ((0, 0), (0, 0), (0, Cp - C)), constant_values=-1)
  nc = Cp // block
  # The row's last block that holds a filled slot; steps after it fetch that block again
  # (an unchanged block index starts no DMA) and compute nothing.
  last = lambda b, ext: jnp.maximum(_div(ext[b] + (block - 1), block) - 1, 0)
  clamp = lambda b, c, ext: jnp.minimum(c, last(b, ext))
  q_spec = pl.BlockSpec((None, None, G, H), lambda b, h, c, ext: (b, h, 0, 0))
  k_spec = pl.BlockSpec((None, None, H, block), lambda b, h, c, ext: (b, h, 0, clamp(b, c, ext)))
  v_spec = pl.BlockSpec((None, None, block, H), lambda b, h, c, ext: (b, h, clamp(b, c, ext), 0))
  pos_spec = pl.BlockSpec((None, None, 1, block),
                          lambda b, h, c, ext: (b, h, 0, clamp(b, c, ext)))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(B, K, nc), in_specs=[q_spec, k_spec, v_spec, pos_spec],
      out_specs=q_spec,
      scratch_shapes=[pltpu.VMEM((G, LANES), jnp.float32),     # running max (lane-replicated)
                      pltpu.VMEM((G, LANES), jnp.float32),     # running sum
                      pltpu.VMEM((G, H), jnp.float32)])        # output accumulator
  kernel = functools.partial(_kernel, scale=scale, block=block, nc=nc)
  o = pl.pallas_call(
      kernel, grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((B, K, G, H), q.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="decode_attention_tpu")(extent, q.reshape(B, K, G, H), k, v, pos[:, :, None, :])
  return o.reshape(B, N, H)
