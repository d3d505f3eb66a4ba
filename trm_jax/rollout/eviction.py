"""Eviction as pure functions, per layer and per KV head, for any registered cache policy.

A policy (`rollout.policies`) ranks the keys a (row, kv head) holds by (protected,
priority, array index), lowest evicted first. Two moments use the ranking: after prefill
(`select_prompt`: keep the top `keep` prompt keys; the others get evicted_at = P, the first
generated query) and, with scope="sequence", before each decode query i that would overflow
the budget (`evict`: drop the lowest key, evicted_at = i). Deviation from H2O's description:
H2O evicts after attending with budget + 1 keys; we evict before inserting key i, so no query
ever sees more than `budget` keys. The decision uses the same information (scores through
query i - 1).

`CacheEviction` plugs all of this into the model's cached attention (it is the
`trm_jax.models.CachePolicy` the sampler passes to `Decoder.prefill` / `decode_step`); each
layer's retention record lives in its cache (`KVCache.evicted_at`, [B, K, T]).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from trm_jax.kernels.visibility import NEVER_EVICTED
from trm_jax.models.kv_cache import KVCache
from trm_jax.rollout import cache as kv
from trm_jax.rollout.types import CacheConfig


def select_prompt(cfg: CacheConfig, valid: jax.Array, score: jax.Array, keep: jax.Array, *,
                  start: jax.Array, budget: jax.Array, layer: int,
                  rand_key: Optional[jax.Array]) -> jax.Array:
  """Which prompt keys stay after prefill.

  Args:
    valid: [B, P] bool non-padding prompt positions.
    score: [B, K, P] from the policy's `prompt_scores`.
    keep: [B] int32 keys to keep per row (<= valid count).
  Returns:
    [B, K, P] bool, exactly keep[b] True entries per (b, kv head), all on valid positions.
  """
  B, K, P = score.shape
  if not cfg.compresses:
    return jnp.broadcast_to(valid[:, None], (B, K, P))
  pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, K, P))
  prot, prio = cfg.eviction_policy.priorities(
      cfg, pos, score, step=P, start=start, budget=budget, prompt_len=P, layer=layer,
      rand_key=rand_key)
  v = jnp.broadcast_to(valid[:, None], (B, K, P))
  order = jnp.lexsort((pos, prio, prot, v), axis=-1)     # ascending: evicted first
  rank = jnp.argsort(order, axis=-1)                      # rank of each key in that order
  return rank >= P - keep[:, None, None]


def _lex_argmin(valid, prot, prio, pos) -> jax.Array:
  """[B, K] slot of the lowest (protected, priority, pos) among valid slots."""
  p0 = jnp.where(valid, prot.astype(jnp.int32), 2)
  cand = valid & (p0 == jnp.min(p0, axis=-1, keepdims=True))
  pr = jnp.where(cand, prio, jnp.inf)
  cand = cand & (pr == jnp.min(pr, axis=-1, keepdims=True))
  return jnp.argmin(jnp.where(cand, pos, jnp.iinfo(jnp.int32).max), axis=-1).astype(jnp.int32)


def evict(cfg: CacheConfig, cache: KVCache, *, layer: int, step, start: jax.Array,
          budget: jax.Array, prompt_len: int, rand_key: Optional[jax.Array] = None
          ) -> Tuple[KVCache, jax.Array]:
  """Frees one slot per (row, kv head) for the key at array index `step`.

  Where a row already holds `budget` keys, the lowest-ranked key leaves and
  cache.evicted_at[b, h, its index] = step (query `step` is the first that cannot see it);
  otherwise an empty slot is used and nothing is evicted.

  Args:
    cache: layer `layer`'s cache (scores accumulated through query step - 1), with its
      retention record evicted_at [B, K, T].
  Returns:
    (cache with the slot emptied and the eviction recorded, slot [B, K] int32 to write into).
  """
  B, K, C = cache.pos.shape
  T = cache.evicted_at.shape[-1]
  valid = cache.pos >= 0
  full = jnp.sum(valid, axis=-1) >= budget[:, None]                     # [B, K]
  prot, prio = cfg.eviction_policy.priorities(
      cfg, cache.pos, cache.score, step=step, start=start, budget=budget,
      prompt_len=prompt_len, layer=layer, rand_key=rand_key)
  victim = _lex_argmin(valid, prot, prio, cache.pos)
  empty = jnp.argmax(~valid, axis=-1).astype(jnp.int32)
  slot = jnp.where(full, victim, empty)
  gone = jnp.take_along_axis(cache.pos, victim[..., None], axis=-1)[..., 0]
  gone = jnp.where(full, gone, T)                                        # T: dropped write
  b = jnp.arange(B)[:, None]
  h = jnp.arange(K)[None, :]
  evicted_at = cache.evicted_at.at[b, h, gone].set(step, mode="drop")
  pos = cache.pos.at[b, h, slot].set(-1)
  return cache.replace(pos=pos, evicted_at=evicted_at), slot


@dataclasses.dataclass(frozen=True)
class CacheEviction:
  """The sampler's `trm_jax.models.CachePolicy`: a cache per layer, evicted by `cfg`.

  Built inside the jitted sampler (the arrays are traced values of one `generate` call).
  """
  cfg: CacheConfig
  valid: jax.Array                 # [B, P] bool non-padding prompt positions
  start: jax.Array                 # [B] int32 array index of each row's first valid token
  keep: jax.Array                  # [B] int32 prompt keys kept after prefill
  budget: jax.Array                # [B] int32 most keys a row may hold at once
  length: int                      # T = P + R, the retention record's length
  prompt_slots: int                # Cp: slots of the compressed prompt (`cache.prompt_slots`)
  total_slots: int                 # C (`cache.num_slots`)
  rand_key: Optional[jax.Array]    # the random policy's key (`policies.random_priority`)

  def prefill(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
    """Prompt q [B, P, N, H], k/v [B, P, K, H] -> the layer's cache; dropped prompt keys get
    evicted_at = P (the first generated query cannot see them)."""
    cfg, valid, policy = self.cfg, self.valid, self.cfg.eviction_policy
    B, P, K, H = k.shape
    score = (jnp.zeros((B, K, P), jnp.float32) if policy is None else
             policy.prompt_scores(cfg, q, k, valid, H ** -0.5))             # [B, K, P]
    kept = select_prompt(cfg, valid, score, self.keep, start=self.start, budget=self.budget,
                         layer=layer, rand_key=self.rand_key)                # [B, K, P]
    dropped = valid[:, None, :] & ~kept
    evicted_at = jnp.full((B, K, self.length), NEVER_EVICTED, jnp.int32)
    evicted_at = evicted_at.at[:, :, :P].set(jnp.where(dropped, P, NEVER_EVICTED))
    # Only a policy that keeps a score (H2O) carries one per slot through decoding.
    keeps = policy is not None and policy.keeps_score
    cache = kv.from_prompt(k, v, kept, score if keeps else None,
                           num_prompt_slots=self.prompt_slots, num_total_slots=self.total_slots)
    return cache.replace(evicted_at=evicted_at)

  def free_slot(self, layer: int, cache: KVCache, index: jax.Array
                ) -> Tuple[KVCache, jax.Array]:
    """Dense: slot = index; scope "prompt": the next slot after the prompt's, the same for
    every row; scope "sequence": `evict`."""
    scope = self.cfg.resolved_scope
    if scope == "sequence":
      return evict(self.cfg, cache, layer=layer, step=index, start=self.start,
                   budget=self.budget, prompt_len=self.valid.shape[1], rand_key=self.rand_key)
    if scope is None:
      return cache, index
    return cache, self.prompt_slots + (index - self.valid.shape[1])

  def observe(self, layer: int, cache: KVCache, probs: jax.Array) -> KVCache:
    """The policy's update of the per-slot score (H2O: accumulated attention mass)."""
    policy = self.cfg.eviction_policy
    return cache if policy is None else policy.observe(cache, probs)
