"""KV eviction policies as pure functions, per layer and per KV head.

Every policy is the same two-level ranking of the keys a (row, kv head) holds:

    (protected, priority, array index)      lowest = evicted first, highest = kept first

  snapkv  protected: the observation window (last `window` prompt positions); priority: the
          window queries' attention to each key, summed over the window and the GQA group,
          pooled over neighbouring keys (SnapKV, Li et al. 2024, Sec. 4). Prompt only.
  h2o     protected: the most recent `recent_frac * budget` keys; priority: attention mass
          accumulated over every query that saw the key (H2O, Zhang et al. 2023, Alg. 1).
  recent  protected: the first `sinks` valid tokens; priority: the array index, so the
          oldest goes first (StreamingLLM, Xiao et al. 2024). RoPE positions are kept, not
          re-assigned inside the window (deviation from StreamingLLM's cache-relative
          positions: the learner must see the sampler's positions).
  random  priority: fresh uniform draws per (layer, step, key) (`random_priority`);
          nothing protected.

Ties fall back to the array index (older evicted first), which makes every decision a function
of positions and scores only, not of slot layout, and lets `tests/test_rollout_resim.py`
re-derive it in plain numpy.

Two moments use the ranking: after prefill (`select_prompt`: keep the top `keep` prompt keys;
the others get evicted_at = P, the first generated query) and, with scope="sequence", before
each decode query i that would overflow the budget (`evict`: drop the lowest key, evicted_at =
i). Deviation from H2O's description: H2O evicts after attending with budget + 1 keys; we
evict before inserting key i, so no query ever sees more than `budget` keys. The decision uses
the same information (scores through query i - 1).

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
from trm_jax.rollout.types import RATIO_GRID, CacheConfig


def _fmix32(x: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finaliser: a cheap bijective mixer on uint32."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def random_priority(key: jax.Array, layer: int, step, pos: jax.Array) -> jax.Array:
  """Uniform [0, 1) draws [B, K, S] for the keys at array indices pos [B, K, S].

  A hash of (key, layer, step, row, kv head, array index): fresh at every step, and indexed
  by array position rather than slot, so a re-simulation can reproduce it. A counter hash
  instead of `jax.random` draws because only the C held keys need a value per step, and
  threefry per step would dominate compile time of the decode loop.
  """
  B, K, S = pos.shape
  seed = jax.random.bits(key, (), jnp.uint32)
  row = (jnp.arange(B, dtype=jnp.uint32)[:, None] * jnp.uint32(K)
         + jnp.arange(K, dtype=jnp.uint32)[None, :])[:, :, None]                  # [B, K, 1]
  h = _fmix32(seed ^ (jnp.uint32(layer) * jnp.uint32(0x9E3779B9)))
  h = _fmix32(h ^ jnp.asarray(step).astype(jnp.uint32))
  h = _fmix32(h ^ row)
  h = _fmix32(h ^ pos.astype(jnp.uint32))
  return (h >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def _masked_probs(q: jax.Array, k: jax.Array, q_idx: jax.Array, valid: jax.Array,
                  scale: float) -> jax.Array:
  """Attention probabilities of queries q [B, W, N, H] at array indices q_idx [W] over the
  prompt keys k [B, P, K, H] with validity valid [B, P] -> [B, K, G, W, P] fp32."""
  B, W, N, H = q.shape
  P, K = k.shape[1], k.shape[2]
  qg = q.reshape(B, W, K, N // K, H)
  logits = jnp.einsum("BWKGH,BSKH->BKGWS", qg, k,
                      preferred_element_type=jnp.float32) * scale
  j = jnp.arange(P)
  mask = (j[None, :] <= q_idx[:, None])[None] & valid[:, None, :]           # [B, W, P]
  mask = mask & jnp.take(valid, q_idx, axis=1)[:, :, None]                    # query valid
  logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(logits - m)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  return p / jnp.where(denom > 0, denom, 1.0)


def prompt_scores(cfg: CacheConfig, q: jax.Array, k: jax.Array, valid: jax.Array, *,
                  scale: Optional[float] = None) -> jax.Array:
  """Per-key scores from the prefill: q [B, P, N, H], k [B, P, K, H], valid [B, P] ->
  [B, K, P] fp32 (SnapKV: pooled window attention; H2O: accumulated attention; else 0)."""
  B, P, N, H = q.shape
  K = k.shape[2]
  scale = H ** -0.5 if scale is None else scale
  if cfg.policy == "h2o":
    q_idx = jnp.arange(P)
    return _masked_probs(q, k, q_idx, valid, scale).sum(axis=(2, 3))
  if cfg.policy != "snapkv":
    return jnp.zeros((B, K, P), jnp.float32)
  w = min(cfg.window, P)
  q_idx = jnp.arange(P - w, P)
  s = _masked_probs(q[:, P - w:], k, q_idx, valid, scale).sum(axis=(2, 3))  # [B, K, P]
  # SnapKV pools the prefix scores only: window keys are kept anyway and must not lend their
  # (large, self-attention) mass to neighbours.
  in_prefix = (jnp.arange(P) < P - w)[None, None] & valid[:, None, :]
  s = jnp.where(in_prefix, s, 0.0)
  pad = ((0, 0), (0, 0), (cfg.kernel // 2, cfg.kernel // 2))
  if cfg.pooling == "max":
    return jax.lax.reduce_window(s, -jnp.inf, jax.lax.max, (1, 1, cfg.kernel), (1, 1, 1), pad)
  # avg pooling counts the padding, like torch's avg_pool1d default.
  return jax.lax.reduce_window(s, 0.0, jax.lax.add, (1, 1, cfg.kernel), (1, 1, 1),
                               pad) / cfg.kernel


def priorities(cfg: CacheConfig, pos: jax.Array, score: jax.Array, *, step, start: jax.Array,
               budget: jax.Array, prompt_len: int, layer: int,
               rand_key: Optional[jax.Array]) -> Tuple[jax.Array, jax.Array]:
  """The ranking keys of held keys.

  Args:
    pos: [B, K, S] int32 array index of each key (-1 = none).
    score: [B, K, S] fp32 per-key score (H2O accumulated attention, SnapKV pooled score).
    step: [] query index about to be served (P right after prefill).
    start: [B] array index of each row's first valid token (P - prompt length).
    budget: [B] keys a row may hold.
    prompt_len: static P (SnapKV's window is the last `window` prompt positions).
    rand_key: PRNG key of the random policy (see `random_priority`), else None.
  Returns:
    protected [B, K, S] bool and priority [B, K, S] fp32.
  """
  if cfg.policy == "snapkv":
    return pos >= prompt_len - min(cfg.window, prompt_len), score
  if cfg.policy == "h2o":
    recent = (budget * int(round(cfg.recent_frac * RATIO_GRID))) // RATIO_GRID   # [B]
    return pos >= step - recent[:, None, None], score
  if cfg.policy == "recent":
    return pos < start[:, None, None] + cfg.sinks, pos.astype(jnp.float32)
  if cfg.policy == "random":
    return jnp.zeros(pos.shape, bool), random_priority(rand_key, layer, step, pos)
  raise ValueError(f"policy {cfg.policy!r} has no eviction ranking")


def select_prompt(cfg: CacheConfig, valid: jax.Array, score: jax.Array, keep: jax.Array, *,
                  start: jax.Array, budget: jax.Array, layer: int,
                  rand_key: Optional[jax.Array]) -> jax.Array:
  """Which prompt keys stay after prefill.

  Args:
    valid: [B, P] bool non-padding prompt positions.
    score: [B, K, P] from `prompt_scores`.
    keep: [B] int32 keys to keep per row (<= valid count).
  Returns:
    [B, K, P] bool, exactly keep[b] True entries per (b, kv head), all on valid positions.
  """
  B, K, P = score.shape
  if cfg.policy == "none":
    return jnp.broadcast_to(valid[:, None], (B, K, P))
  pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, K, P))
  prot, prio = priorities(cfg, pos, score, step=P, start=start, budget=budget,
                          prompt_len=P, layer=layer, rand_key=rand_key)
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
  prot, prio = priorities(cfg, cache.pos, cache.score, step=step, start=start,
                          budget=budget, prompt_len=prompt_len, layer=layer,
                          rand_key=rand_key)
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
  rand_key: Optional[jax.Array]    # the random policy's key (`random_priority`)

  def prefill(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
    """Prompt q [B, P, N, H], k/v [B, P, K, H] -> the layer's cache; dropped prompt keys get
    evicted_at = P (the first generated query cannot see them)."""
    cfg, valid = self.cfg, self.valid
    P = valid.shape[1]
    score = prompt_scores(cfg, q, k, valid)                                  # [B, K, P]
    kept = select_prompt(cfg, valid, score, self.keep, start=self.start, budget=self.budget,
                         layer=layer, rand_key=self.rand_key)                # [B, K, P]
    dropped = valid[:, None, :] & ~kept
    B, K = kept.shape[:2]
    evicted_at = jnp.full((B, K, self.length), NEVER_EVICTED, jnp.int32)
    evicted_at = evicted_at.at[:, :, :P].set(jnp.where(dropped, P, NEVER_EVICTED))
    # Only H2O reads a per-slot score during decoding; other policies carry none.
    cache = kv.from_prompt(k, v, kept, score if cfg.policy == "h2o" else None,
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
    """H2O accumulates each key's attention mass, summed over the GQA group."""
    if self.cfg.policy == "h2o":
      return cache.replace(score=cache.score + probs.sum(axis=2))
    return cache
