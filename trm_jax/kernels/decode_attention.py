"""One decode query per row over a KV cache, reading each row's filled slots only (Pallas
Triton, the GPU's counterpart of `decode_attention_tpu.py`).

Computes what `models.kv_cache.attend` computes (fp32 logits, empty slots masked, a row that
sees no key gives zeros) without the attention probabilities. The XLA decode reads every row
up to the sampler's bucket (the longest row's); here program (b, kv head) loops over the
blocks [0, ceil(extent[b] / block)) of its own row and stops, so a row with 40 filled slots
next to one with 4000 reads 40 (rounded up to a block), not 4000: a decode step's cost follows
each row's live length.

Layout (the cache's own, no copy when the capacity is a multiple of the block): q [B, K, G, H],
k [B, K, H, C] (keys transposed, slots last), v [B, K, C, H], pos [B, K, C] (-1 = empty),
extent [B] int32. Grid (B, K): one program per row and kv head computes its G query heads
together, so each key block is read once for the group (GQA). fp32 online softmax (running
max, sum and output) over the row's blocks, as in `flash_attention.py`'s forward.

Triton's dot needs operands of at least 16 in every dimension and power-of-two tiles: G and H
are zero-padded to powers of two >= 16 (zero query heads are sliced off; zero head columns add
nothing to q.k), and the block is the largest power of two <= `block` that divides C. The
cache is read in place when H is already such a power (64 and 128: Qwen3, Qwen2, Llama) and C
has a power-of-two factor >= 16; otherwise k, v and pos are padded, a copy of the cache in
every decode step.

One program walks its row's blocks in sequence, so a step has B x K programs: at a few rows
with long caches (8 rows x 8 kv heads = 64 programs on a 132-SM H200) the GPU is under-filled.
Splitting the slot axis over programs and merging their partial softmaxes (flash-decoding) is
the known remedy; it is not done here.

Runs on CPU through the Pallas interpreter (`interpret=True`, tests); lowers for "cuda"
without a GPU (`jax.export`, tests). Not yet run on a GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from trm_jax.kernels.decode_attention_tpu import decode_inputs
from trm_jax.kernels.flash_attention import _MASK_VALUE, _pow2_at_least

BLOCK = 128          # slots per loop step at most
MIN_BLOCK = 16       # Triton's smallest dot operand


def slot_block(C: int, block: int = BLOCK) -> int:
  """The largest power of two <= block (and >= MIN_BLOCK) dividing C; MIN_BLOCK if none does
  (the caller then pads C)."""
  b = MIN_BLOCK
  while b * 2 <= block and C % (b * 2) == 0:
    b *= 2
  return b


def _kernel(extent_ref, q_ref, k_ref, v_ref, pos_ref, o_ref, *, scale: float, block: int):
  """Program (b, h). Refs: extent_ref [B]; q_ref [G, H]; k_ref [H, C]; v_ref [C, H];
  pos_ref [C]; o_ref [G, H]."""
  b = pl.program_id(0)
  G, H = q_ref.shape
  q = q_ref[...]                                                        # [G, H]

  def body(j, carry):
    o, m, l = carry                    # [G, H] f32, [G] f32, [G] f32
    ks = pl.ds(j * block, block)
    k = k_ref[:, ks]                                                    # [H, block]
    v = v_ref[ks, :]                                                    # [block, H]
    vis = (pos_ref[ks] >= 0)[None, :]                                   # [1, block]
    s = jnp.where(vis, jnp.dot(q, k, preferred_element_type=jnp.float32) * scale,
                  _MASK_VALUE)                                          # [G, block] f32
    m_next = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp(m - m_next)
    p = jnp.where(vis, jnp.exp(s - m_next[:, None]), 0.0)               # exact 0 if empty
    l_next = alpha * l + jnp.sum(p, axis=-1)
    o_next = alpha[:, None] * o + jnp.dot(p.astype(v.dtype), v,
                                          preferred_element_type=jnp.float32)
    return o_next, m_next, l_next

  o = jnp.zeros((G, H), jnp.float32)
  m = jnp.full((G,), _MASK_VALUE, jnp.float32)
  l = jnp.zeros((G,), jnp.float32)
  # The row's filled blocks only: blocks at or past extent[b] hold no key of this row.
  n_blocks = lax.div(extent_ref[b] + (block - 1), block)
  o, m, l = lax.fori_loop(0, n_blocks, body, (o, m, l))
  o_ref[...] = (o / jnp.where(l > 0.0, l, 1.0)[:, None]).astype(o_ref.dtype)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, pos: jax.Array,
                     extent: jax.Array | None = None, *, scale: float | None = None,
                     block: int = BLOCK, num_warps: int = 4,
                     interpret: bool = False) -> jax.Array:
  """q [B, N, H], the cache's k [B, K, H, C], v [B, K, C, H], pos [B, K, C] -> o [B, N, H].

  Args:
    extent: [B] int32 slots to read per row (default `filled_extent(pos)`); slots at or after
      it must be empty.
    block: slots per loop step at most (see `slot_block`).
    interpret: run the Pallas interpreter (CPU); False compiles for the GPU (Triton).
  """
  B, N, H = q.shape
  _, K, _, C = k.shape
  G, scale, extent = decode_inputs(q, k, v, pos, extent, scale)
  bk = slot_block(C, block)
  Cp = -(-C // bk) * bk
  Gp, Hp = _pow2_at_least(G, 16), _pow2_at_least(H, 16)
  q = jnp.pad(q.reshape(B, K, G, H), ((0, 0), (0, 0), (0, Gp - G), (0, Hp - H)))
  if Cp != C or Hp != H:   # padded slots are empty (pos -1); padded head columns are zeros
    k = jnp.pad(k, ((0, 0), (0, 0), (0, Hp - H), (0, Cp - C)))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, Cp - C), (0, Hp - H)))
    pos = jnp.pad(pos, ((0, 0), (0, 0), (0, Cp - C)), constant_values=-1)
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=g-import-not-at-top
  row = lambda b, h: (b, h, 0, 0)
  o = pl.pallas_call(
      functools.partial(_kernel, scale=scale, block=bk),
      out_shape=jax.ShapeDtypeStruct((B, K, Gp, Hp), q.dtype), grid=(B, K),
      in_specs=[pl.BlockSpec((B,), lambda b, h: (0,)),                  # extent
                pl.BlockSpec((None, None, Gp, Hp), row),                # q
                pl.BlockSpec((None, None, Hp, Cp), row),                # k
                pl.BlockSpec((None, None, Cp, Hp), row),                # v
                pl.BlockSpec((None, None, Cp), lambda b, h: (b, h, 0))],  # pos
      out_specs=pl.BlockSpec((None, None, Gp, Hp), row),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
      interpret=interpret, name="decode_attention")(extent, q, k, v, pos)
  return o[:, :, :G, :H].reshape(B, N, H)
