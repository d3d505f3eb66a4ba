"""Sizes and prompt layout of the sampler's KV caches: C slots per layer, set by the budget, not T.

The cache itself (`trm_jax.models.KVCache`: keys, values, the *array index* of the key in each
slot, -1 = empty, a per-slot score and the retention record) is the model's: `Attention`
writes and reads it. This module decides how many slots there are and where the prompt's kept
keys sit. Two layouts (R = new tokens, T = P + R):

  dense (policy "none"): slot s holds the key at array index s, C = P + R - 1 (every key that a
    decode query can see; the last sampled token is never fed back).
  compressed: the prompt's kept keys sit right-aligned in the first Cp slots; with
    scope="prompt" generated keys go to slot Cp + (i - P), the same slot for every row, so the
    write is one `dynamic_update_slice`; with scope="sequence" the eviction policy names a
    free slot per (row, kv head) and the write is a scatter.
"""
from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

from trm_jax.models import kv_cache
from trm_jax.models.kv_cache import KVCache
from trm_jax.rollout.types import RATIO_GRID, CacheConfig


# ------------------------------------------------------------------------------ budgets
def keep_count(n, cfg: CacheConfig):
  """Keys kept out of n (int or int array): ceil((1 - ratio) * n), or min(capacity, n); >= 1.

  Integer arithmetic on the RATIO_GRID, so numpy (static sizes) and jnp (per-row budgets)
  agree exactly (int32 is exact for n < 2**31 / RATIO_GRID, about 214k tokens).
  """
  xp = np if isinstance(n, (int, np.integer)) else jnp
  if cfg.capacity is not None:
    kept = xp.minimum(cfg.capacity, n)
  else:
    kept = (n * cfg.keep_num + RATIO_GRID - 1) // RATIO_GRID
  return xp.maximum(kept, 1)


def _sequence_budget_static(cfg: CacheConfig, P: int, R: int) -> int:
  # A row never holds more than the P + R - 1 keys ever inserted.
  full = P + max(R - 1, 0)
  n = int(keep_count(P + R, cfg)) if cfg.capacity is None else int(cfg.capacity)
  return max(1, min(n, full))


def prompt_slots(cfg: CacheConfig, P: int, R: int) -> int:
  """Cp: slots holding the compressed prompt (the first Cp slots of the cache)."""
  scope = cfg.resolved_scope
  if scope is None:
    return P
  if scope == "prompt":
    return int(min(keep_count(P, cfg), P))
  return min(P, _sequence_budget_static(cfg, P, R))


def num_slots(cfg: CacheConfig, P: int, R: int) -> int:
  """C: static slot count per (row, kv head) for prompt bucket P and R new tokens."""
  scope = cfg.resolved_scope
  if scope is None or scope == "prompt":
    return prompt_slots(cfg, P, R) + max(R - 1, 0)
  return _sequence_budget_static(cfg, P, R)


def row_budgets(cfg: CacheConfig, prompt_lengths: jax.Array, P: int,
                R: int) -> Tuple[jax.Array, jax.Array]:
  """Per-row (prompt_keep [B], budget [B]) int32.

  prompt_keep: prompt keys kept after prefill. budget: most keys held at once (decode-time
  eviction keeps the count <= budget; never binding for the dense and prompt scopes).
  """
  lens = prompt_lengths.astype(jnp.int32)
  C = num_slots(cfg, P, R)
  scope = cfg.resolved_scope
  if scope is None:
    return lens, jnp.full_like(lens, C)
  if scope == "prompt":
    return jnp.minimum(keep_count(lens, cfg), lens), jnp.full_like(lens, C)
  budget = jnp.minimum(keep_count(lens + R, cfg), C).astype(jnp.int32)
  return jnp.minimum(lens, budget), budget


def slot_buckets(C: int, *, block: int = 128, most: int = 8, least: int = 1) -> Tuple[int, ...]:
  """The slot counts the decode loop cuts the caches to: multiples of a block (at least
  `block` slots, grown so that there are at most `most`), ending at C, from the first that
  holds `least` slots. A chunk of decode steps runs on the smallest bucket that holds every
  slot it can fill, so a step reads at most one block (about C / most) more than the filled
  part: linear in the live length, not the capacity. Each bucket is one stage of the
  sampler's decode loop (its own compiled decode and refill bodies), so fewer buckets compile
  faster and read more per step. `least` is what a row just loaded fills in its first chunk
  (its prompt's slots and one chunk's keys): a smaller bucket could never run a chunk, and
  could not even hold the prompt it would be loaded with."""
  per = -(-C // most)                                   # ceil(C / most)
  blk = max(block, -(-per // block) * block)            # rounded up to a block
  return tuple(n for n in range(blk, C, blk) if n >= least) + (C,)


# ------------------------------------------------------------------------------ building
def from_prompt(k: jax.Array, v: jax.Array, keep: jax.Array, score: jax.Array, *,
                num_prompt_slots: int, num_total_slots: int) -> KVCache:
  """Builds a layer cache from the prefill's keys and the keep decision.

  Args:
    k, v: [B, P, K, H] prompt keys/values.
    keep: [B, K, P] bool, the keys that stay (at most num_prompt_slots per row and head).
    score: [B, K, P] fp32 per-key score carried into the cache (H2O), or None (no score kept).
  Returns:
    KVCache with C = num_total_slots; kept keys right-aligned in the first Cp slots in
    array-index order, remaining slots empty; no retention record (the policy adds it).
  """
  B, P, K, H = k.shape
  Cp, C = num_prompt_slots, num_total_slots
  kt = jnp.swapaxes(k, 1, 2)                                     # [B, K, P, H]
  vt = jnp.swapaxes(v, 1, 2)
  idx = jnp.arange(P, dtype=jnp.int32)
  if Cp == P:
    sel = jnp.broadcast_to(idx, (B, K, P))
  else:
    # Kept keys sort last (in index order): the last Cp entries hold all of them.
    order = jnp.argsort(keep.astype(jnp.int32) * P + idx, axis=-1)  # [B, K, P]
    sel = order[..., P - Cp:]                                       # [B, K, Cp]
  kept = jnp.take_along_axis(keep, sel, axis=-1)
  ks = jnp.take_along_axis(kt, sel[..., None], axis=2)
  vs = jnp.take_along_axis(vt, sel[..., None], axis=2)
  pos = jnp.where(kept, sel, -1).astype(jnp.int32)                 # [B, K, Cp]
  sc = None
  if score is not None:
    sc = jnp.where(kept, jnp.take_along_axis(score, sel, axis=-1), 0.0).astype(jnp.float32)
  return kv_cache.pad_slots(KVCache(k=jnp.swapaxes(ks, 2, 3), v=vs, pos=pos, score=sc), C)


def nbytes(caches) -> int:
  """Bytes of a pytree of cache arrays (static: shapes and dtypes only)."""
  return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(caches)))
