"""The sampler draws from the distribution whose log-probs it records: statistical tests.

Each test has a stated false-alarm probability: the chance that a correct sampler fails it.
The keys are fixed, so every run draws the same numbers; the probability is what a fresh key
would give, and it bounds how unlucky the fixed draw could be. Each test also checks that the
same statistic rejects a wrong distribution, so it could fail.

  - `inverse_cdf` against float64 searchsorted, and at the ends of [0, 1) (exact);
  - chi-square goodness of fit of 200k draws from fixed 10-token logits, for temperature,
    top-k, top-p and both: p-value > 1e-3 each (false alarm <= 1e-3 per case, 5e-3 in all);
  - the decode loop itself (`generate`): the randomised probability integral transform of each
    sampled token under the recorded per-row distribution is Uniform(0, 1); chi-square over 10
    bins of 8192 draws, p-value > 1e-3 (false alarm 1e-3).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.special import gammaincc

from model_fixtures import make_test_model
from trm_jax.rollout import SamplingConfig, generate
from trm_jax.rollout import sampling

ALPHA = 1e-3                      # false-alarm probability of each goodness-of-fit test


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
  """Pearson chi-square goodness of fit of counts to probs (entries with probs > 0)."""
  n = counts.sum()
  expected = n * probs
  stat = float(np.sum((counts - expected) ** 2 / expected))
  return float(gammaincc((len(counts) - 1) / 2.0, stat / 2.0))


def test_inverse_cdf_matches_float64_search_and_never_draws_removed_tokens():
  rng = np.random.default_rng(0)
  V = 300                                                     # not a multiple of the block
  p = rng.exponential(size=(64, V)).astype(np.float32)
  p[rng.random((64, V)) < 0.5] = 0.0                          # removed tokens, scattered
  p[:, 100:260] = 0.0                                         # whole empty blocks
  p[:, -1] = 0.0                                              # the last token removed
  u = rng.integers(0, 1 << 24, 64).astype(np.float32) / (1 << 24)
  got = np.asarray(sampling.inverse_cdf(jnp.asarray(p), jnp.asarray(u), block=32))
  c = np.cumsum(p.astype(np.float64), axis=1)
  want = np.array([np.searchsorted(c[b], u[b] * c[b, -1], side="right") for b in range(64)])
  np.testing.assert_array_equal(got, want)
  # The ends of [0, 1): the first and the last token with mass, never one without.
  live = p > 0
  first = np.argmax(live, axis=1)
  last = V - 1 - np.argmax(live[:, ::-1], axis=1)
  for u_end, want_end in ((0.0, first), (1.0 - 2.0 ** -24, last)):
    got = np.asarray(sampling.inverse_cdf(jnp.asarray(p), jnp.full((64,), u_end, jnp.float32),
                                          block=32))
    np.testing.assert_array_equal(got, want_end)


LOGITS = np.array([2.0, 1.5, 1.5, 0.7, 0.0, -0.4, -1.0, -1.8, -2.5, -4.0], np.float32)


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, top_k=6, top_p=0.9)], ids=["t1", "topk", "topp", "both"])
def test_draws_follow_the_recorded_distribution(kw):
  n = 200_000
  cfg = SamplingConfig(max_new_tokens=1, **kw)
  logits = jnp.broadcast_to(jnp.asarray(LOGITS), (n, LOGITS.size))
  tok, logp, dist = jax.jit(lambda k, x: sampling.sample(k, x, cfg))(jax.random.key(17), logits)
  tok, logp, dist = np.asarray(tok), np.asarray(logp), np.asarray(dist[0])
  np.testing.assert_array_equal(logp, dist[tok])              # the recorded log-prob is exact
  probs = np.exp(dist.astype(np.float64))
  counts = np.bincount(tok, minlength=LOGITS.size)
  kept = probs > 0
  assert counts[~kept].sum() == 0                             # removed tokens never drawn
  if kw.get("top_k") or kw.get("top_p"):
    assert (~kept).any()
  assert chi2_pvalue(counts[kept], probs[kept]) > ALPHA
  # Power: the same draws against the kept tokens' softmax at 1.15x the temperature (a 15%
  # temperature error) are rejected outright.
  x = LOGITS[kept].astype(np.float64) / (1.15 * kw["temperature"])
  wrong = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
  assert chi2_pvalue(counts[kept], wrong) < 1e-12


def test_decode_loop_draws_follow_the_recorded_distributions():
  """Through `generate`: rows of one prompt diverge after their first token, so every step
  samples a different distribution per row; each draw's randomised PIT
  F(tok - 1) + w * p(tok) (w ~ U(0, 1) independent) is exactly Uniform(0, 1) iff tok is drawn
  from p."""
  model = make_test_model(seed=4)
  # Peaked distributions (logit std ~3 instead of ~0.2), so tempering matters (power check).
  model.lm_head[...] = model.lm_head[...] * 20.0
  B, P, R = 2048, 4, 4
  prompt = np.tile(np.array([[5, 9, 17, 33]], np.int32), (B, 1))
  r = generate(model, prompt, np.full((B,), P, np.int32), max_new_tokens=R,
               key=jax.random.key(23), temperature=1.2, top_p=0.95, eos_ids=(),
               keep_full_logprobs=True)
  full = np.asarray(r.full_logp[:, P:], np.float64)             # [B, R, V]
  tok = np.asarray(r.tokens[:, P:])
  p = np.exp(full)
  cdf_before = np.cumsum(p, axis=-1) - p
  pick = lambda a: np.take_along_axis(a, tok[..., None], axis=-1)[..., 0]
  w = np.random.default_rng(5).random(tok.shape)
  pit = (pick(cdf_before) + w * pick(p)).ravel()
  counts = np.bincount(np.minimum((pit * 10).astype(int), 9), minlength=10)
  assert chi2_pvalue(counts, np.full(10, 0.1)) > ALPHA
  assert len(np.unique(tok[:, -1])) > 20                       # the rows did diverge
  # Power: the same tokens against each row's distribution one step off (what a misaligned
  # record would give) are rejected outright.
  q = np.roll(p, 1, axis=1)
  pit_q = (pick(np.cumsum(q, axis=-1) - q) + w * pick(q)).ravel()
  counts_q = np.bincount(np.minimum((pit_q * 10).astype(int), 9), minlength=10)
  assert chi2_pvalue(counts_q, np.full(10, 0.1)) < 1e-12


def test_gaussian_noise_is_standard_normal_and_keyed():
  """Kolmogorov-Smirnov against N(0, 1) on 2^18 draws: sqrt(n) * D > 1.95 has probability
  1e-3 under the null (false alarm 1e-3); two keys' draws uncorrelated (|r| < 4.4 / sqrt(n):
  false alarm 1e-5); the same key replays the same noise."""
  from jax.scipy.stats import norm
  n = 1 << 18
  key = jax.random.key(9)
  z = sampling.gaussian_noise(key, (8, n // 8))
  np.testing.assert_array_equal(z, sampling.gaussian_noise(key, (8, n // 8)))
  def ks(x):
    x = np.sort(np.asarray(x, np.float64).ravel())
    cdf = np.asarray(norm.cdf(jnp.asarray(x)), np.float64)
    i = np.arange(1, n + 1)
    return np.sqrt(n) * max(np.max(i / n - cdf), np.max(cdf - (i - 1) / n))
  assert ks(z) < 1.95
  assert ks(z * 1.02) > 1.95                            # power: a 2% scale error is rejected
  other = np.asarray(sampling.gaussian_noise(jax.random.fold_in(key, 1), (8, n // 8)))
  r = np.corrcoef(np.asarray(z).ravel(), other.ravel())[0, 1]
  assert abs(r) < 4.4 / np.sqrt(n)
  assert float(jnp.max(jnp.abs(z))) < 5.5


def test_gaussian_noise_is_finite_and_symmetric_at_every_extreme_of_its_bits():
  """The largest and smallest 24-bit draws map inside (-5.5, 5.5) and mirror each other
  (a = 2^24 - 1 once gave erfinv(1) = inf: a NaN sampling distribution one draw in 2^24)."""
  h = jnp.asarray([0, 0xFF, 0x100, 0x7FFFFFFF, 0x80000000, 0xFFFFFF00, 0xFFFFFFFF], jnp.uint32)
  z = np.asarray(sampling.normal_from_bits(h))
  assert np.all(np.isfinite(z)) and np.max(np.abs(z)) < 5.5
  assert z[0] == z[1] == -z[-1] == -z[-2]              # a = 0 and a = 2^24 - 1
  assert z[3] == -z[4] and z[2] < z[3] < 0 < z[4]      # the two middle cells straddle 0
