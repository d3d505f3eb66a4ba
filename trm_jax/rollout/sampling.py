"""Token sampling with exact log-probs of the distribution actually sampled from.

The sampler and the learner must agree on what "the rollout policy" was: `sampled_logprobs`
turns logits into the exact log-distribution the sampler drew from (temperature, top-k,
top-p), so the learner can replay it on teacher-forced logits (`token_logprobs`). Everything
is fp32. Truncation keeps every token tied with the threshold logit, so the kept set is a
function of the logit values alone (no dependence on sort stability).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from trm_jax.rollout.types import SamplingConfig


def sampled_logprobs(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """logits [..., V] -> log-probs [..., V] fp32 of the sampling distribution (-inf = removed).

  Greedy rows report the untempered, untruncated log-softmax (see `SamplingConfig`).
  """
  x = logits.astype(jnp.float32)
  if cfg.greedy:
    return jax.nn.log_softmax(x, axis=-1)
  x = x / cfg.temperature
  if cfg.truncates:
    x = jnp.where(x >= _threshold(x, cfg), x, -jnp.inf)
  return jax.nn.log_softmax(x, axis=-1)


def _threshold(x: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """[..., 1] smallest logit kept by top-k followed by top-p (nucleus of Holtzman et al.)."""
  V = x.shape[-1]
  s = -jnp.sort(-x, axis=-1)                                   # [..., V] descending
  rank = jnp.arange(V)
  k = V if cfg.top_k <= 0 else min(cfg.top_k, V)
  s_k = jnp.where(rank < k, s, -jnp.inf)
  p = jax.nn.softmax(s_k, axis=-1)
  mass_before = jnp.cumsum(p, axis=-1) - p
  # The nucleus is the shortest prefix whose mass reaches top_p: keep rank r iff the mass of
  # ranks < r is still below top_p. Rank 0 is always kept.
  keep = (rank < k) & ((mass_before < cfg.top_p) | (rank == 0))
  n_keep = jnp.sum(keep, axis=-1, keepdims=True)                # >= 1
  return jnp.take_along_axis(s, n_keep - 1, axis=-1)


def sample(key: jax.Array, logits: jax.Array, cfg: SamplingConfig):
  """Draws one token per row.

  Args:
    key: PRNG key (unused when greedy).
    logits: [B, V] (noise, if any, already added).
  Returns:
    tokens [B] int32, logp [B] fp32 of those tokens, dist [B, V] fp32 log-probs sampled from.
  """
  dist = sampled_logprobs(logits, cfg)
  if cfg.greedy:
    tokens = jnp.argmax(logits.astype(jnp.float32), axis=-1)
  else:
    tokens = jax.random.categorical(key, dist, axis=-1)
  tokens = tokens.astype(jnp.int32)
  logp = jnp.take_along_axis(dist, tokens[:, None], axis=-1)[:, 0]
  return tokens, logp, dist


def token_logprobs(logits: jax.Array, tokens: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """Learner-side replay: logits [..., V], tokens [...] -> [...] log-probs under the sampling
  distribution that `cfg` defines (so rollout logp and teacher-forced logp are comparable)."""
  dist = sampled_logprobs(logits, cfg)
  return jnp.take_along_axis(dist, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def entropy(dist: jax.Array) -> jax.Array:
  """[..., V] log-probs (may hold -inf) -> [...] entropy in nats, fp32."""
  p = jnp.exp(dist)
  return -jnp.sum(jnp.where(p > 0, p * dist, 0.0), axis=-1)
