"""KV caches for the sampler: one slot array per layer whose size is set by the budget, not T.

A layer's cache holds C slots per (row, kv head): keys, values, the *array index* of the key in
each slot (-1 = empty), and a per-slot score (H2O's accumulated attention). Two layouts share
the structure:

  dense (policy "none"): slot s holds the key at array index s, C = P + N - 1 (every key that a
    decode query can see; the last sampled token is never fed back).
  compressed: the prompt's kept keys sit right-aligned in the first Cp slots; with
    scope="prompt" generated keys go to slot Cp + (i - P), the same slot for every row, so the
    write is one `dynamic_update_slice`; with scope="sequence" the eviction policy names a
    free slot per (row, kv head) and the write is a scatter.

Keys keep their original RoPE rotation (positions are applied before caching and never
re-rotated), so the learner's positions equal the sampler's.

Attention over the cache mirrors `kernels.attention_ref` exactly (fp32 logits, -inf for empty
slots, guarded softmax, probabilities cast to the value dtype), which is what makes the
rollout's log-probs equal a teacher-forced forward with `evicted_at` to float rounding.
"""
from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from trm_jax.rollout.types import RATIO_GRID, CacheConfig


@struct.dataclass
class LayerCache:
  k: jax.Array      # [B, K, C, H] keys (RoPE applied), compute dtype
  v: jax.Array      # [B, K, C, H] values
  pos: jax.Array    # [B, K, C] int32 array index of the key in each slot, -1 = empty
  score: jax.Array  # [B, K, C] fp32 accumulated attention mass (H2O), 0 otherwise


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


def _sequence_budget_static(cfg: CacheConfig, P: int, N: int) -> int:
  # A row never holds more than the P + N - 1 keys ever inserted.
  full = P + max(N - 1, 0)
  n = int(keep_count(P + N, cfg)) if cfg.capacity is None else int(cfg.capacity)
  return max(1, min(n, full))


def prompt_slots(cfg: CacheConfig, P: int, N: int) -> int:
  """Cp: slots holding the compressed prompt (the first Cp slots of the cache)."""
  scope = cfg.resolved_scope
  if scope is None:
    return P
  if scope == "prompt":
    return int(min(keep_count(P, cfg), P))
  return min(P, _sequence_budget_static(cfg, P, N))


def num_slots(cfg: CacheConfig, P: int, N: int) -> int:
  """C: static slot count per (row, kv head) for prompt bucket P and N new tokens."""
  scope = cfg.resolved_scope
  if scope is None or scope == "prompt":
    return prompt_slots(cfg, P, N) + max(N - 1, 0)
  return _sequence_budget_static(cfg, P, N)


def row_budgets(cfg: CacheConfig, prompt_lengths: jax.Array, P: int,
                N: int) -> Tuple[jax.Array, jax.Array]:
  """Per-row (prompt_keep [B], budget [B]) int32.

  prompt_keep: prompt keys kept after prefill. budget: most keys held at once (decode-time
  eviction keeps the count <= budget; never binding for the dense and prompt scopes).
  """
  lens = prompt_lengths.astype(jnp.int32)
  C = num_slots(cfg, P, N)
  scope = cfg.resolved_scope
  if scope is None:
    return lens, jnp.full_like(lens, C)
  if scope == "prompt":
    return jnp.minimum(keep_count(lens, cfg), lens), jnp.full_like(lens, C)
  budget = jnp.minimum(keep_count(lens + N, cfg), C).astype(jnp.int32)
  return jnp.minimum(lens, budget), budget


# ------------------------------------------------------------------------------ building
def from_prompt(k: jax.Array, v: jax.Array, keep: jax.Array, score: jax.Array, *,
                num_prompt_slots: int, num_total_slots: int) -> LayerCache:
  """Builds a layer cache from the prefill's keys and the keep decision.

  Args:
    k, v: [B, P, K, H] prompt keys/values.
    keep: [B, K, P] bool, the keys that stay (at most num_prompt_slots per row and head).
    score: [B, K, P] fp32 per-key score carried into the cache (H2O), else zeros.
  Returns:
    LayerCache with C = num_total_slots; kept keys right-aligned in the first Cp slots in
    array-index order, remaining slots empty.
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
  pos = jnp.where(kept, sel, -1).astype(jnp.int32)
  sc = jnp.where(kept, jnp.take_along_axis(score, sel, axis=-1), 0.0)
  pad = C - Cp
  return LayerCache(
      k=jnp.pad(ks, ((0, 0), (0, 0), (0, pad), (0, 0))),
      v=jnp.pad(vs, ((0, 0), (0, 0), (0, pad), (0, 0))),
      pos=jnp.pad(pos, ((0, 0), (0, 0), (0, pad)), constant_values=-1),
      score=jnp.pad(sc.astype(jnp.float32), ((0, 0), (0, 0), (0, pad))))


def insert(cache: LayerCache, slot: jax.Array, k_new: jax.Array, v_new: jax.Array,
           index: jax.Array, *, uniform: bool) -> LayerCache:
  """Writes the key at array index `index` into `slot`.

  Args:
    slot: [B, K] int32 target slot per row and head (with uniform=True, slot[0, 0] is used
      for all: one dynamic_update_slice instead of a scatter).
    k_new, v_new: [B, K, H].
    index: [] int32 array index of the new key.
  """
  if uniform:
    s = slot[0, 0]
    B, K = slot.shape
    return LayerCache(
        k=jax.lax.dynamic_update_slice(cache.k, k_new[:, :, None].astype(cache.k.dtype),
                                       (0, 0, s, 0)),
        v=jax.lax.dynamic_update_slice(cache.v, v_new[:, :, None].astype(cache.v.dtype),
                                       (0, 0, s, 0)),
        pos=jax.lax.dynamic_update_slice(
            cache.pos, jnp.full((B, K, 1), index, jnp.int32), (0, 0, s)),
        score=jax.lax.dynamic_update_slice(
            cache.score, jnp.zeros((B, K, 1), jnp.float32), (0, 0, s)))
  B, K = slot.shape
  b = jnp.arange(B)[:, None]
  h = jnp.arange(K)[None, :]
  return LayerCache(
      k=cache.k.at[b, h, slot].set(k_new.astype(cache.k.dtype)),
      v=cache.v.at[b, h, slot].set(v_new.astype(cache.v.dtype)),
      pos=cache.pos.at[b, h, slot].set(index.astype(jnp.int32)),
      score=cache.score.at[b, h, slot].set(0.0))


# ------------------------------------------------------------------------------ attention
def attend(q: jax.Array, cache: LayerCache, *, scale=None):
  """One decode query per row over the cache.

  Args:
    q: [B, N, H] query (RoPE applied).
  Returns:
    o [B, N, H] in q.dtype and probs [B, K, G, C] fp32 (0 on empty slots).
  """
  B, N, H = q.shape
  K = cache.k.shape[1]
  G = N // K
  scale = H ** -0.5 if scale is None else scale
  qg = q.reshape(B, K, G, H)
  logits = jnp.einsum("BKGH,BKCH->BKGC", qg, cache.k,
                      preferred_element_type=jnp.float32) * scale   # [B, K, G, C]
  logits = jnp.where((cache.pos >= 0)[:, :, None, :], logits, -jnp.inf)
  # Same guarded softmax as attention_ref (a row always sees at least its own key here).
  m = jnp.max(logits, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(logits - m)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom > 0, denom, 1.0)
  o = jnp.einsum("BKGC,BKCH->BKGH", p.astype(cache.v.dtype), cache.v,
                 preferred_element_type=jnp.float32)
  return o.reshape(B, N, H).astype(q.dtype), p


def nbytes(caches) -> int:
  """Bytes of a pytree of cache arrays (static: shapes and dtypes only)."""
  return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(caches)))
