"""KV-cache eviction policies: one class each, registered by name (`rollout.cache.policy`).

Every policy is the same two-level ranking of the keys a (row, kv head) holds:

    (protected, priority, array index)      lowest = evicted first, highest = kept first

A policy says four things: how it scores the prompt's keys from the prefill
(`prompt_scores`), how it ranks the keys a row holds (`priorities`, used to choose what the
prefill keeps and what each decode step evicts), what it carries through decoding (a per-slot
score, updated by `observe` after each query), and its budget rule (`scopes`: the prompt
compressed once, or the whole sequence held to a budget; the first is its default). It also
names the `rollout.cache` settings it reads (`config_fields`, the `CacheConfig` fields of the
same names) and checks them (`check`). `rollout.eviction` applies a policy to the cache, the
same way for every policy; `rollout.cache` sizes the cache from its scope.

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

A new policy is one subclass and one registration (docs/architecture.md shows one):
`register_policy("name", MyPolicy())`, then `rollout.cache.policy = "name"`.
"""
from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from trm_jax import rng
from trm_jax.kernels.attention_ref import guarded_softmax
from trm_jax.models.kv_cache import KVCache
from trm_jax.registry import Registry
from trm_jax.rollout.types import RATIO_GRID, CacheConfig

POOLINGS = ("max", "avg")


class EvictionPolicy:
  """A KV-cache eviction policy; the defaults are those of a policy that scores nothing."""
  scopes: Tuple[str, ...] = ("sequence", "prompt")  # budget rules it supports, default first
  config_fields: Tuple[str, ...] = ()   # the rollout.cache keys it reads, each passed to the
                                        #   CacheConfig field of that name (programs.cache_config)
  keeps_score: bool = False             # carries KVCache.score through decoding (`observe`)

  def check(self, cfg: CacheConfig) -> None:
    """Raises ValueError for settings of `config_fields` this policy cannot use."""

  def prompt_scores(self, cfg: CacheConfig, q: jax.Array, k: jax.Array, valid: jax.Array,
                    scale: float) -> jax.Array:
    """Per-key scores from the prefill: q [B, P, N, H], k [B, P, K, H], valid [B, P] ->
    [B, K, P] fp32 (the `score` that `priorities` gets right after prefill)."""
    B, P = valid.shape
    return jnp.zeros((B, k.shape[2], P), jnp.float32)

  def priorities(self, cfg: CacheConfig, pos: jax.Array, score: jax.Array, *, step,
                 start: jax.Array, budget: jax.Array, prompt_len: int, layer: int,
                 rand_key: Optional[jax.Array], rows: jax.Array
                 ) -> Tuple[jax.Array, jax.Array]:
    """The ranking keys of held keys: (protected [B, K, S] bool, priority [B, K, S] fp32).

    Args:
      pos: [B, K, S] int32 array index of each key (-1 = none).
      score: [B, K, S] fp32 per-key score (`prompt_scores`, then what `observe` kept).
      step: query index about to be served: [] (P right after prefill) or [B, 1, 1] (one per
        row during decoding: the engine's slots hold rows at different indices).
      start: [B] array index of each row's first valid token (P - prompt length).
      budget: [B] keys a row may hold.
      prompt_len: static P.
      layer: the layer's index; rand_key: the sampler's eviction key and rows [B] the rows'
        ids in the whole batch (`random_priority`).
    """
    raise NotImplementedError

  def observe(self, cache: KVCache, probs: jax.Array) -> KVCache:
    """After a decode query attended: probs [B, K, G, C] fp32 (0 on empty slots)."""
    return cache


POLICIES: Registry[EvictionPolicy] = Registry("cache policy", also=("none",))


def register_policy(name: str, policy: EvictionPolicy) -> EvictionPolicy:
  """Adds `policy` under `name` (the value of `rollout.cache.policy` / `CacheConfig.policy`)."""
  return POLICIES.register(name, policy)


def get_policy(name: str) -> EvictionPolicy:
  return POLICIES.get(name)


# ------------------------------------------------------------------------------ shared parts
def random_priority(key: jax.Array, layer: int, step, pos: jax.Array,
                    rows: Optional[jax.Array] = None) -> jax.Array:
  """Uniform [0, 1) draws [B, K, S] for the keys at array indices pos [B, K, S].

  A hash (`trm_jax.rng`) of (key, layer, step, row, kv head, array index): fresh at every
  step, indexed by array position rather than slot, and by the row's id in the whole batch
  (`rows` [B], default 0..B-1) rather than its place in the decoding slots, so neither a
  re-simulation nor continuous batching changes it. `step` is [] or [B, 1, 1] (per row). A
  counter hash instead of `jax.random` draws because only the C held keys need a value per
  step, and threefry per step would dominate compile time of the decode loop.
  """
  B, K, S = pos.shape
  rows = jnp.arange(B, dtype=jnp.int32) if rows is None else rows
  head = (rows.astype(jnp.uint32)[:, None] * jnp.uint32(K)
          + jnp.arange(K, dtype=jnp.uint32)[None, :])[:, :, None]                 # [B, K, 1]
  return rng.uniform(rng.seed(key), layer, step, head, pos)


def masked_probs(q: jax.Array, k: jax.Array, q_idx: jax.Array, valid: jax.Array,
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
  return guarded_softmax(jnp.where(mask[:, None, None], logits, -jnp.inf))


# ------------------------------------------------------------------------------ the policies
class SnapKV(EvictionPolicy):
  scopes = ("prompt",)
  config_fields = ("window", "kernel")   # `pooling` has no config key (SnapKV's max)

  def check(self, cfg):
    if cfg.window < 1 or cfg.kernel < 1 or cfg.kernel % 2 == 0:
      raise ValueError(f"CacheConfig.window={cfg.window} must be >= 1 and kernel="
                       f"{cfg.kernel} odd and >= 1")
    if cfg.pooling not in POOLINGS:
      raise ValueError(f"CacheConfig.pooling={cfg.pooling!r}; expected one of {POOLINGS}")

  def prompt_scores(self, cfg, q, k, valid, scale):
    P = q.shape[1]
    w = min(cfg.window, P)
    q_idx = jnp.arange(P - w, P)
    s = masked_probs(q[:, P - w:], k, q_idx, valid, scale).sum(axis=(2, 3))  # [B, K, P]
    # SnapKV pools the prefix scores only: window keys are kept anyway and must not lend
    # their (large, self-attention) mass to neighbours.
    in_prefix = (jnp.arange(P) < P - w)[None, None] & valid[:, None, :]
    s = jnp.where(in_prefix, s, 0.0)
    pad = ((0, 0), (0, 0), (cfg.kernel // 2, cfg.kernel // 2))
    if cfg.pooling == "max":
      return jax.lax.reduce_window(s, -jnp.inf, jax.lax.max, (1, 1, cfg.kernel), (1, 1, 1),
                                   pad)
    # avg pooling counts the padding, like torch's avg_pool1d default.
    return jax.lax.reduce_window(s, 0.0, jax.lax.add, (1, 1, cfg.kernel), (1, 1, 1),
                                 pad) / cfg.kernel

  def priorities(self, cfg, pos, score, *, prompt_len, **_):
    return pos >= prompt_len - min(cfg.window, prompt_len), score


class H2O(EvictionPolicy):
  config_fields = ("recent_frac",)
  keeps_score = True

  def check(self, cfg):
    if not 0.0 <= cfg.recent_frac <= 1.0:
      raise ValueError(f"CacheConfig.recent_frac={cfg.recent_frac} must be in [0, 1]")

  def prompt_scores(self, cfg, q, k, valid, scale):
    return masked_probs(q, k, jnp.arange(q.shape[1]), valid, scale).sum(axis=(2, 3))

  def priorities(self, cfg, pos, score, *, step, budget, **_):
    recent = (budget * int(round(cfg.recent_frac * RATIO_GRID))) // RATIO_GRID   # [B]
    return pos >= step - recent[:, None, None], score

  def observe(self, cache, probs):
    """Each key's attention mass, summed over the GQA group, accumulates."""
    return cache.replace(score=cache.score + probs.sum(axis=2))


class Recent(EvictionPolicy):
  config_fields = ("sinks",)

  def check(self, cfg):
    if cfg.sinks < 0:
      raise ValueError(f"CacheConfig.sinks={cfg.sinks} must be >= 0")

  def priorities(self, cfg, pos, score, *, start, **_):
    return pos < start[:, None, None] + cfg.sinks, pos.astype(jnp.float32)


class Random(EvictionPolicy):

  def priorities(self, cfg, pos, score, *, step, layer, rand_key, rows, **_):
    return jnp.zeros(pos.shape, bool), random_priority(rand_key, layer, step, pos, rows)


register_policy("snapkv", SnapKV())
register_policy("h2o", H2O())
register_policy("recent", Recent())
register_policy("random", Random())
