"""Token sampling with exact log-probs of the distribution actually sampled from.

The sampler and the learner must agree on what "the rollout policy" was: `sampled_logprobs`
turns logits into the exact log-distribution the sampler drew from (temperature, top-k,
top-p), so the learner can replay it on teacher-forced logits (`token_logprobs`). Everything
is fp32. Truncation keeps every token tied with the threshold logit, so the kept set is a
function of the logit values alone (no dependence on sort stability).

Drawing: one uniform per row, mapped through the inverse CDF of that distribution
(`inverse_cdf`). It samples the same distribution as Gumbel-max (`jax.random.categorical`)
without drawing V Gumbel variables per row: at the bench shape ([8, 32000] logits) the
Gumbel draw cost more per decode step than the 4 layers' matmuls. The resolution of a draw is
2^-24 of the mass (a token of probability p is drawn with probability p to within 2^-24;
Gumbel-max with 23-bit uniforms has a comparable tail cutoff), and a token the distribution
removed (log-prob -inf) is never drawn, whatever the rounding of the cumulative sum.

Logit noise (the mismatch knob) is a counter-based hash mapped to a Gaussian (`trm_jax.rng`):
a third of the cost of threefry's normal on [B, V]. The sampler keys it, like its uniforms, by
(row, array index, vocabulary entry) (`row_noise`), so anyone can replay it and no other row
changes it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from trm_jax import rng
from trm_jax.rollout.types import SamplingConfig

fmix32 = rng.fmix32                  # (re-exported: the hash lives in trm_jax.rng)
normal_from_bits = rng.normal_from_bits


def sampled_logprobs(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """logits [..., V] -> log-probs [..., V] fp32 of the sampling distribution (-inf = removed).

  Greedy rows report the untempered, untruncated log-softmax (see `SamplingConfig`).
  """
  return _log_softmax(_scaled(logits, cfg))[0]


def _scaled(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """The logits of the sampling distribution: tempered and truncated (-inf), fp32."""
  x = logits.astype(jnp.float32)
  if cfg.greedy:
    return x
  x = x / cfg.temperature
  if cfg.truncates:
    thr = _threshold(x, cfg)                                    # [..., 1]
    # The token the threshold came from is kept by its index as well as by value: XLA may
    # compute x twice, in the sort's fusion and in this one, and the two can differ in the
    # last bit (seen on XLA:CPU at optimisation level 0 on an Intel Xeon), which dropped that
    # token from the sampler's distribution and not from the learner's. It is the token
    # nearest the threshold (a reduction; a sort carrying indices cost 20 % more).
    at = jnp.argmin(jnp.abs(x - thr), axis=-1, keepdims=True)
    vocab = jax.lax.broadcasted_iota(at.dtype, x.shape, x.ndim - 1)
    x = jnp.where((x >= thr) | (vocab == at), x, -jnp.inf)
  return x


def _log_softmax(x: jax.Array):
  """(log_softmax(x), e = exp(x - max), sum(e)): the op sequence of `jax.nn.log_softmax`,
  with its exponentials kept for the draw and the entropy."""
  shifted = x - jnp.max(x, axis=-1, keepdims=True)
  e = jnp.exp(shifted)
  z = jnp.sum(e, axis=-1, keepdims=True)
  return shifted - jnp.log(z), e, z


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
  tokens, logp, dist, _ = draw(logits, cfg, uniform24(key, logits.shape[:-1]))
  return tokens, logp, dist


def draw(logits: jax.Array, cfg: SamplingConfig, u: jax.Array):
  """`sample` from given uniforms u [B] in [0, 1) (the sampler's are keyed per row and
  index: `rng.uniform`), plus the entropy [B] of each row's distribution."""
  with jax.named_scope("sample"):
    dist, e, z = _log_softmax(_scaled(logits, cfg))          # e = 0 where truncated
    if cfg.greedy:
      tokens = jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)
    else:
      tokens = inverse_cdf(e, u)
    logp = jnp.take_along_axis(dist, tokens[..., None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.where(e > 0, e * dist, 0.0), axis=-1) / z[..., 0]
  return tokens, logp, dist, ent


def uniform24(key: jax.Array, shape) -> jax.Array:
  """Uniform draws on the grid {0, 1, ..., 2^24 - 1} * 2^-24 (exact in fp32), threefry."""
  bits = jax.random.bits(key, shape, jnp.uint32)
  return (bits >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def inverse_cdf(p: jax.Array, u: jax.Array, *, block: int = 128) -> jax.Array:
  """The token of each row whose CDF interval holds u: p [..., V] unnormalised probabilities
  (>= 0, at least one > 0 per row), u [...] in [0, 1) -> [...] int32.

  Token j is returned iff c[j-1] <= u * c[V-1] < c[j] (c the cumulative sum of p), i.e. with
  probability p[j] / sum(p). Two levels, so no length-V cumulative sum is formed (XLA:CPU
  computes one as a reduce-window costing more than the rest of the draw): the masses of
  blocks of `block` tokens locate the block, and the cumulative sum of that block's p locates
  the token. Rounding can move a boundary by an ulp but never selects a token with p = 0: at
  each level only entries with positive mass are candidates, and the target is kept below the
  largest cumulative value among them, which therefore always qualifies.
  """
  V = p.shape[-1]
  nb = -(-V // block)
  lead = p.shape[:-1]
  pb = jnp.pad(p, [(0, 0)] * len(lead) + [(0, nb * block - V)]).reshape(*lead, nb, block)

  def first_crossing(mass, cum, target):
    """Index of the first entry with mass > 0 whose cumulative value exceeds target (clamped
    below the largest such value), and that clamped target."""
    live = mass > 0
    top = jnp.max(jnp.where(live, cum, 0.0), axis=-1, keepdims=True)
    target = jnp.clip(target, 0.0, jnp.nextafter(top, jnp.zeros_like(top)))
    n = mass.shape[-1]
    idx = jax.lax.broadcasted_iota(jnp.int32, mass.shape, mass.ndim - 1)
    return jnp.min(jnp.where(live & (cum > target), idx, n), axis=-1), target

  s = jnp.sum(pb, axis=-1)                                        # [..., nb] block masses
  cs = jnp.cumsum(s, axis=-1)
  total = cs[..., -1:]
  b, target = first_crossing(s, cs, u[..., None] * total)         # [...], [..., 1]
  b1 = b[..., None]
  before = jnp.take_along_axis(cs - s, b1, axis=-1)               # mass before block b
  row = jnp.take_along_axis(pb, b1[..., None], axis=-2)[..., 0, :]  # [..., block]
  j, _ = first_crossing(row, jnp.cumsum(row, axis=-1), target - before)
  return (b * block + j).astype(jnp.int32)


def gaussian_noise(key: jax.Array, shape) -> jax.Array:
  """Standard normal fp32 noise of `shape`, a pure function of (key, element index):
  `rng.normal` of each element's flat index (|z| < 5.5)."""
  with jax.named_scope("logit_noise"):
    n = int(np.prod(shape)) if len(shape) else 1
    return rng.normal(rng.seed(key), jax.lax.iota(jnp.uint32, n).reshape(shape))


def row_noise(s: jax.Array, rows: jax.Array, index: jax.Array, V: int) -> jax.Array:
  """The logit noise [B, V] of rows [B] at array indices index [B] under stream seed s:
  entry (b, v) is `rng.normal(s, rows[b], index[b], v)`, whatever batch computes it."""
  with jax.named_scope("logit_noise"):
    return rng.normal(s, rows[:, None], index[:, None], jax.lax.iota(jnp.uint32, V)[None])


def token_logprobs(logits: jax.Array, tokens: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """Learner-side replay: logits [..., V], tokens [...] -> [...] log-probs under the sampling
  distribution that `cfg` defines (so rollout logp and teacher-forced logp are comparable)."""
  dist = sampled_logprobs(logits, cfg)
  return jnp.take_along_axis(dist, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def entropy(dist: jax.Array) -> jax.Array:
  """[..., V] log-probs (may hold -inf) -> [...] entropy in nats, fp32."""
  p = jnp.exp(dist)
  return -jnp.sum(jnp.where(p > 0, p * dist, 0.0), axis=-1)
