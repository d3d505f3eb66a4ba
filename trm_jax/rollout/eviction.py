"""Eviction as pure functions, per layer and per KV head, for any registered cache policy.

A policy (`rollout.policies`) ranks the keys a (row, kv head) holds by (protected,
priority, array index), lowest evicted first. Two moments use the ranking: after prefill
(`select_prompt`: keep the top `keep` prompt keys; the others get evicted_at = P, the first
generated query) and, with scope="sequence", before each decode query i that would overflow
the budget (`evict`: drop the lowest key, evicted_at = i). Deviation from H2O's description:
H2O evicts after attending with budget + 1 keys; we evict before inserting key i, so no query
ever sees more than `budget` keys. The decision uses the same information (scores through
query i - 1).

Two `trm_jax.models.CachePolicy`s plug this into the model's cached attention: the prefill's
`PromptRecorder` keeps each prompt's keys, values and scores (a group's shared prompt is
prefilled once), and `CacheEviction` loads a row's cache from its prompt (`load`: the per-row
`select_prompt`) and evicts during `decode_step`; each layer's retention record lives in its
cache (`KVCache.evicted_at`, [S, K, T] per decoding slot).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from flax import struct

from trm_jax.kernels.visibility import NEVER_EVICTED
from trm_jax.models.kv_cache import KVCache
from trm_jax.rollout import cache as kv
from trm_jax.rollout.types import CacheConfig


def select_prompt(cfg: CacheConfig, valid: jax.Array, score: jax.Array, keep: jax.Array, *,
                  start: jax.Array, budget: jax.Array, layer: int,
                  rand_key: Optional[jax.Array], rows: Optional[jax.Array] = None
                  ) -> jax.Array:
  """Which prompt keys stay after prefill.

  Args:
    valid: [B, P] bool non-padding prompt positions.
    score: [B, K, P] from the policy's `prompt_scores`.
    keep: [B] int32 keys to keep per row (<= valid count).
    rows: [B] int32 the rows' ids in the whole batch (the random policy's draws; default
      0..B-1).
  Returns:
    [B, K, P] bool, exactly keep[b] True entries per (b, kv head), all on valid positions.
  """
  B, K, P = score.shape
  rows = jnp.arange(B, dtype=jnp.int32) if rows is None else rows
  if not cfg.compresses:
    return jnp.broadcast_to(valid[:, None], (B, K, P))
  pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, K, P))
  prot, prio = cfg.eviction_policy.priorities(
      cfg, pos, score, step=P, start=start, budget=budget, prompt_len=P, layer=layer,
      rand_key=rand_key, rows=rows)
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
          budget: jax.Array, prompt_len: int, rows: Optional[jax.Array] = None,
          active: Optional[jax.Array] = None, rand_key: Optional[jax.Array] = None
          ) -> Tuple[KVCache, jax.Array]:
  """Frees one slot per (row, kv head) for the key at array index `step` ([] or [B]).

  Where a row already holds `budget` keys, the lowest-ranked key leaves and
  cache.evicted_at[b, h, its index] = step[b] (query step[b] is the first that cannot see
  it); otherwise an empty slot is used and nothing is evicted. Rows that are not `active`
  (finished, or a slot waiting for its next row) change nothing: their slot is C (the write
  drops).

  Args:
    cache: layer `layer`'s cache (scores accumulated through query step - 1), with its
      retention record evicted_at [B, K, T].
    rows: [B] the rows' ids in the whole batch (default 0..B-1); active: [B] bool (default
      all).
  Returns:
    (cache with the slot emptied and the eviction recorded, slot [B, K] int32 to write into).
  """
  B, K, C = cache.pos.shape
  T = cache.evicted_at.shape[-1]
  step = jnp.broadcast_to(jnp.asarray(step, jnp.int32), (B,))
  rows = jnp.arange(B, dtype=jnp.int32) if rows is None else rows
  active = jnp.ones((B,), bool) if active is None else active
  valid = cache.pos >= 0
  full = jnp.sum(valid, axis=-1) >= budget[:, None]                     # [B, K]
  prot, prio = cfg.eviction_policy.priorities(
      cfg, cache.pos, cache.score, step=step[:, None, None], start=start, budget=budget,
      prompt_len=prompt_len, layer=layer, rand_key=rand_key, rows=rows)
  victim = _lex_argmin(valid, prot, prio, cache.pos)
  empty = jnp.argmax(~valid, axis=-1).astype(jnp.int32)
  on = active[:, None]
  slot = jnp.where(on, jnp.where(full, victim, empty), C)               # C: dropped write
  gone = jnp.take_along_axis(cache.pos, victim[..., None], axis=-1)[..., 0]
  gone = jnp.where(full & on, gone, T)                                   # T: dropped write
  b = jnp.arange(B)[:, None]
  h = jnp.arange(K)[None, :]
  evicted_at = cache.evicted_at.at[b, h, gone].set(
      jnp.broadcast_to(step[:, None], (B, K)), mode="drop")
  pos = cache.pos.at[b, h, slot].set(-1, mode="drop")
  return cache.replace(pos=pos, evicted_at=evicted_at), slot


@struct.dataclass
class PromptKV:
  """One layer's record of the prefilled prompts: what every row decoding from one of them
  starts its cache from (`CacheEviction.load`). U prompts (one per group of rows)."""
  k: jax.Array          # [U, P, K, H] keys (RoPE applied)
  v: jax.Array          # [U, P, K, H]
  score: jax.Array      # [U, K, P] fp32 the policy's `prompt_scores` (0 for the dense cache)


@dataclasses.dataclass(frozen=True)
class PromptRecorder:
  """The `trm_jax.models.CachePolicy` of the prefill: keeps each layer's prompt keys, values
  and the policy's prompt scores (`PromptKV`); which keys a row keeps is decided per row when
  the row is loaded into a decoding slot (`CacheEviction.load`)."""
  cfg: CacheConfig
  valid: jax.Array                 # [U, P] bool non-padding prompt positions

  def prefill(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array) -> PromptKV:
    policy = self.cfg.eviction_policy
    U, P, K, H = k.shape
    score = (jnp.zeros((U, K, P), jnp.float32) if policy is None else
             policy.prompt_scores(self.cfg, q, k, self.valid, H ** -0.5))   # [U, K, P]
    return PromptKV(k=k, v=v, score=score)


@dataclasses.dataclass(frozen=True)
class CacheEviction:
  """The sampler's `trm_jax.models.CachePolicy` during decoding: a cache per layer and
  decoding slot, evicted by `cfg`. Built inside the jitted sampler; the per-slot arrays
  (which row a slot holds, its prompt start, budget, whether it is decoding) are the current
  step's (`with_slots`).
  """
  cfg: CacheConfig
  length: int                      # T = P + R, the retention record's length
  prompt_len: int                  # P
  prompt_slots: int                # Cp: slots of the compressed prompt (`cache.prompt_slots`)
  total_slots: int                 # C (`cache.num_slots`)
  rand_key: Optional[jax.Array]    # the random policy's key (`policies.random_priority`)
  rows: Optional[jax.Array] = None     # [S] int32 row (of the whole batch) each slot holds
  start: Optional[jax.Array] = None    # [S] int32 array index of its first valid token
  keep: Optional[jax.Array] = None     # [S] int32 prompt keys it keeps (read by `load`)
  budget: Optional[jax.Array] = None   # [S] int32 most keys it may hold at once
  active: Optional[jax.Array] = None   # [S] bool the slot is decoding (else: no writes)

  def with_slots(self, **arrays) -> "CacheEviction":
    return dataclasses.replace(self, **arrays)

  def load(self, layer: int, rec: PromptKV, valid: jax.Array) -> KVCache:
    """The first Cp slots of the caches of slots that start rows decoding from their
    prompts' records `rec` (one per slot: k, v [S, P, K, H]; valid [S, P] their rows'
    non-padding positions; the rows, starts, keeps and budgets are this policy's): the kept
    prompt keys right-aligned in index order, and the retention record [S, K, T] with the
    dropped prompt keys evicted at P (the first generated query cannot see them)."""
    cfg, policy, P = self.cfg, self.cfg.eviction_policy, self.prompt_len
    score = rec.score                                                      # [S, K, P]
    kept = select_prompt(cfg, valid, score, self.keep, start=self.start, budget=self.budget,
                         layer=layer, rand_key=self.rand_key, rows=self.rows)  # [S, K, P]
    S, K = kept.shape[:2]
    dropped = valid[:, None, :] & ~kept
    evicted_at = jnp.full((S, K, self.length), NEVER_EVICTED, jnp.int32)
    evicted_at = evicted_at.at[:, :, :P].set(jnp.where(dropped, P, NEVER_EVICTED))
    # Only a policy that keeps a score (H2O) carries one per slot through decoding.
    keeps = policy is not None and policy.keeps_score
    cache = kv.from_prompt(rec.k, rec.v, kept, score if keeps else None,
                           num_prompt_slots=self.prompt_slots,
                           num_total_slots=self.prompt_slots)
    return cache.replace(evicted_at=evicted_at)

  def prefill(self, layer, q, k, v):
    raise TypeError("CacheEviction decodes; the prefill's policy is PromptRecorder")

  def free_slot(self, layer: int, cache: KVCache, index: jax.Array
                ) -> Tuple[KVCache, jax.Array]:
    """Dense: slot = index; scope "prompt": the next slot after the prompt's; scope
    "sequence": `evict`. index [S]; slots that are not decoding get slot C (no write)."""
    scope = self.cfg.resolved_scope
    if scope == "sequence":
      return evict(self.cfg, cache, layer=layer, step=index, start=self.start,
                   budget=self.budget, prompt_len=self.prompt_len, rows=self.rows,
                   active=self.active, rand_key=self.rand_key)
    slot = index if scope is None else self.prompt_slots + (index - self.prompt_len)
    slot = jnp.where(self.active, slot, self.total_slots)
    return cache, jnp.broadcast_to(slot[:, None], cache.pos.shape[:2])

  @property
  def observes_attention(self) -> bool:
    """Whether `observe` reads the attention probabilities: only a policy that keeps a score
    (H2O); the others let the layer attend with a kernel that never forms them."""
    policy = self.cfg.eviction_policy
    return policy is not None and policy.keeps_score

  def observe(self, layer: int, cache: KVCache, probs: Optional[jax.Array]) -> KVCache:
    """The policy's update of the per-slot score (H2O: accumulated attention mass); slots
    that are not decoding observe nothing."""
    if not self.observes_attention:
      return cache
    policy = self.cfg.eviction_policy
    return policy.observe(cache, jnp.where(self.active[:, None, None, None], probs, 0.0))

  def filled_bound(self, index: jax.Array) -> jax.Array:
    """[] int32: every slot a row can have filled by the time its query `index` [S] has
    written its key is below min(C, Cp + (i - P) + 1), i the largest index of a decoding
    slot (dense: slot i holds the key at i; compressed: Cp prompt slots, then at most one
    new slot per step)."""
    i = jnp.max(jnp.where(self.active, index, self.prompt_len))
    return jnp.minimum(self.prompt_slots + (i - self.prompt_len) + 1, self.total_slots)
