"""Masking criteria and monitors: identity, monotonicity, AND composition, the extreme-ratio
case of the paper's appendix, fully masked batches, length bias, PPL gap."""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from trm_jax import trm

B, T, V = 3, 6, 4
ALL = tuple(trm.CRITERIA)
THRESHOLDS = dict(delta=0.05, eps=0.1, delta_avg=0.02, delta_k2=0.05, delta_k3=0.02,
                  delta_w=0.1, delta_ser=0.1, tau=0.5, seq_mis_cap=2.0, geo_mean_tau=0.05)


@jax.jit
def per_criterion(stats, th):
  """{name: seq_mask [B]} and {name: token_mask [B, T]} for every criterion alone."""
  res = {n: trm.apply_criteria((n,), th, stats) for n in ALL}
  return {n: r.seq_mask for n, r in res.items()}, {n: r.token_mask for n, r in res.items()}


@jax.jit
def all_and(stats, th):
  return trm.apply_criteria(ALL, th, stats)


@jax.jit
def stats_from_logits(lt, lr, mask, tokens):
  """TokenStats for sampled `tokens` [B, T] under logits lt (theta) and lr (roll)."""
  lp = lambda z: jnp.take_along_axis(jax.nn.log_softmax(z), tokens[..., None], -1)[..., 0]
  return trm.token_stats(mask, logp_theta=lp(lt), logp_roll=lp(lr), logits_theta=lt,
                         logits_roll=lr)


arrays = lambda shape, lo, hi: st.lists(
    st.floats(lo, hi), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))).map(
        lambda x: np.asarray(x, np.float32).reshape(shape))
masks = st.lists(st.booleans(), min_size=B * T, max_size=B * T).map(
    lambda x: np.asarray(x, np.float32).reshape(B, T))


@settings(max_examples=15, deadline=None)
@given(z=arrays((B, T, V), -5.0, 5.0), mask=masks, tok=st.integers(0, V - 1))
def test_identical_policies_keep_everything_at_zero_thresholds(z, mask, tok):
  stats = stats_from_logits(z, z, mask, jnp.full((B, T), tok))
  assert np.all(np.asarray(stats.kl) == 0) and np.all(np.asarray(stats.tv) == 0)
  zero = {k: 0.0 for k in THRESHOLDS}
  zero.update(eps=0.1, delta=0.05)  # ln_trm's weights need a positive trust region
  zero.update(seq_mis_cap=1.0)      # a cap on a ratio: 1 is its tightest (prod rho = 1 here)
  seq, tok_m = per_criterion(stats, zero)
  for n in ALL:
    assert np.all(np.asarray(seq[n]) == 1.0), n
    np.testing.assert_array_equal(tok_m[n], mask)
  res = all_and(stats, zero)
  assert float(res.metrics["trm/reject_rate"]) == 0.0
  assert float(res.metrics["trm/masked_token_frac"]) == 0.0


@settings(max_examples=15, deadline=None)
@given(kl=arrays((B, T), 0.0, 0.2), tv=arrays((B, T), 0.0, 0.3),
       log_rho=arrays((B, T), -1.0, 1.0), mask=masks, scale=st.floats(0.0, 1.0),
       factor=st.floats(1.0, 10.0))
def test_masks_are_monotone_in_their_thresholds(kl, tv, log_rho, mask, scale, factor):
  stats = trm.TokenStats(mask=mask, log_rho=log_rho, kl=kl, tv=tv)
  lo = {k: v * scale for k, v in THRESHOLDS.items()}
  hi = {k: v * scale * factor for k, v in THRESHOLDS.items()}
  # ln_trm's eps and delta shape its weights; only delta_w is its threshold.
  lo.update(eps=0.1, delta=0.05), hi.update(eps=0.1, delta=0.05)
  seq_lo, tok_lo = per_criterion(stats, lo)
  seq_hi, tok_hi = per_criterion(stats, hi)
  for n in ALL:
    assert np.all(np.asarray(seq_lo[n]) <= np.asarray(seq_hi[n])), n
    assert np.all(np.asarray(tok_lo[n]) <= np.asarray(tok_hi[n])), n
  # AND composition: the combined mask is the product of the single ones.
  res = all_and(stats, hi)
  np.testing.assert_array_equal(res.seq_mask, np.prod([seq_hi[n] for n in ALL], axis=0))
  np.testing.assert_array_equal(res.token_mask, np.prod([tok_hi[n] for n in ALL], axis=0))


def test_masks_are_stop_gradient_and_float():
  stats = trm.TokenStats(mask=jnp.ones((1, 2)), log_rho=jnp.array([[0.3, -0.2]]))
  g = jax.jit(jax.grad(lambda lr: jnp.sum(trm.apply_criteria(
      ("ser", "token_mask"), THRESHOLDS, stats.replace(log_rho=lr)).token_mask)))(
          stats.log_rho)
  assert np.all(np.asarray(g) == 0)
  res = jax.jit(lambda s: trm.apply_criteria(("ser",), THRESHOLDS, s))(stats)
  assert res.seq_mask.dtype == jnp.float32 and res.token_mask.dtype == jnp.float32


@pytest.mark.parametrize("p_roll,p_theta", [(0.9, 0.001), (0.001, 0.9)])
def test_extreme_ratio_is_finite_and_rejected(p_roll, p_theta):
  """MoE routing flip of App. A: pi_roll(v) = 0.9, pi_theta(v) = 0.001 (and the reverse,
  rho = 900). Row 0: one bad token at position 1 of a 4-token response; rows 1-2: identical
  policies (kept). Token 0 is sampled everywhere."""
  dist = lambda p: np.log([p] + [(1 - p) / (V - 1)] * (V - 1))
  lr = np.tile(np.log(np.full(V, 1 / V)), (B, T, 1))
  lt = lr.copy()
  lr[0, 0], lt[0, 0] = dist(p_roll), dist(p_theta)
  mask = np.ones((B, T), np.float32)
  mask[0, 4:] = 0.0
  stats = stats_from_logits(jnp.asarray(lt, jnp.float32), jnp.asarray(lr, jnp.float32), mask,
                            jnp.zeros((B, T), jnp.int32))
  np.testing.assert_allclose(stats.log_rho[0, 0], np.log(p_theta / p_roll), rtol=1e-5)
  for leaf in (stats.kl, stats.tv, stats.log_rho):
    assert np.isfinite(leaf).all()
  seq, tok = per_criterion(stats, THRESHOLDS)
  for n in ALL:
    np.testing.assert_array_equal(seq[n][1:], 1.0)
    if n == "token_mask":  # the baseline drops the token but keeps the sequence
      assert float(seq[n][0]) == 1.0
      np.testing.assert_array_equal(tok[n][0], [0.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    elif n == "seq_mis":   # a cap from above only (masked IS): rho = 1/900 passes, 900 does not
      assert float(seq[n][0]) == float(p_theta < p_roll), n
    else:
      assert float(seq[n][0]) == 0.0, n
  res = all_and(stats, THRESHOLDS)
  assert all(np.isfinite(v) for v in res.metrics.values())
  np.testing.assert_allclose(res.metrics["trm/reject_rate"], 1 / 3)


def test_fully_masked_and_fully_rejected_batches_give_finite_metrics():
  z = jnp.asarray(np.random.default_rng(0).normal(0, 3, (B, T, V)), jnp.float32)
  for mask in (jnp.zeros((B, T)), jnp.ones((B, T))):
    stats = stats_from_logits(z, -z, mask, jnp.zeros((B, T), jnp.int32))
    res = all_and(stats, THRESHOLDS)
    est = trm.batch_estimates(mask, kl=stats.kl, tv=stats.tv, log_rho=stats.log_rho)
    mon = jax.jit(lambda s, e: trm.trm_monitors(
        seq_keep=s, mask=mask, T=T, logp_theta=stats.log_rho, logp_roll=jnp.zeros((B, T)),
        est=e))(res.seq_mask, est)
    for k, v in {**res.metrics, **mon}.items():
      assert np.isfinite(v), k
    if float(mask.sum()) == 0:
      np.testing.assert_array_equal(res.seq_mask, 1.0)   # nothing to reject
      np.testing.assert_array_equal(res.token_mask, 0.0)
      assert float(res.metrics["trm/reject_rate"]) == 0.0
    else:
      assert float(res.metrics["trm/reject_rate"]) == 1.0


def test_registry_errors_name_the_bad_thing():
  stats = trm.TokenStats(mask=jnp.ones((1, 2)), log_rho=jnp.zeros((1, 2)))
  with pytest.raises(ValueError, match="TRM criterion must be one of .*got 'trm_maxkl'"):
    trm.apply_criteria(("trm_maxkl",), THRESHOLDS, stats)
  with pytest.raises(ValueError, match="needs threshold 'delta_ser'"):
    trm.apply_criteria(("ser",), {"tau": 1.0}, stats)
  with pytest.raises(ValueError, match="needs TokenStats.kl"):
    trm.apply_criteria(("trm_max_kl",), THRESHOLDS, stats)
  with pytest.raises(ValueError, match="sequence of names"):
    trm.apply_criteria("ser", THRESHOLDS, stats)
  with pytest.raises(ValueError, match="logp_roll"):
    trm.token_stats(jnp.ones((1, 2)), logp_theta=jnp.zeros((1, 2)))
  # Config-driven use: names from a tuple, thresholds from a ConfigDict.
  cfg = ml_collections.ConfigDict(dict(criteria=("ser", "k3_avg"), thresholds=THRESHOLDS))
  res = jax.jit(lambda s: trm.apply_criteria(cfg.criteria, cfg.thresholds, s))(stats)
  assert set(res.metrics) >= {"trm/ser/reject_rate", "trm/k3_avg/reject_rate"}


def test_ln_trm_weights_by_hand_and_prompt_offset():
  eps, delta = 0.1, 0.02
  mask = jnp.array([[1.0, 1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0, 1.0]])
  w = np.asarray(trm.ln_trm_weights(mask, eps, delta))
  # T_i = 4, t = 1..4: T - t = 3, 2, 1, 0 -> min(1, h eps, sqrt(h delta / 2)).
  want = [min(1, h * eps, np.sqrt(h * delta / 2)) for h in (3, 2, 1, 0)]
  np.testing.assert_allclose(w[0, :4], want, rtol=1e-6)
  np.testing.assert_allclose(w[1, 1:], want, rtol=1e-6)   # a prompt in front shifts nothing
  assert w[0, 4] == 0 and w[1, 0] == 0


def test_rejection_by_length_and_ppl_gap_by_hand():
  lengths = np.array([3, 10, 10, 300, 0])
  mask = jnp.asarray(np.arange(400)[None, :] < lengths[:, None], jnp.float32)
  keep = jnp.array([1.0, 0.0, 1.0, 0.0, 0.0])
  m = trm.rejection_by_length(keep, mask, edges=(0, 8, 256))
  np.testing.assert_allclose(m["trm/reject_rate/len_0_8"], 0.0)
  np.testing.assert_allclose(m["trm/reject_rate/len_8_256"], 0.5)
  np.testing.assert_allclose(m["trm/reject_rate/len_256_inf"], 1.0)
  assert int(m["trm/reject_rate/len_8_256/count"]) == 2
  np.testing.assert_allclose(trm.rejection_rate(keep, mask), 2 / 4)  # empty row left out
  with pytest.raises(ValueError, match="edges"):
    trm.rejection_by_length(keep, mask, edges=(8, 8))
  lt = jnp.array([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
  lr = jnp.array([[-1.5, -1.0, 9.0], [-1.0, 0.0, 0.0]])
  pm = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
  np.testing.assert_allclose(trm.ppl_gap(lt, lr, pm), ((0.5 - 1.0) / 2 + 0.5) / 2, rtol=1e-6)


def test_trm_max_has_length_bias_and_ser_does_not():
  """P[accept] = (1 - p)^T for TRM-max (App. F.1); SER's per-token average does not grow."""
  rng = np.random.default_rng(0)
  n, lens = 400, (8, 128)
  Tm = max(lens)
  mask = np.concatenate([np.arange(Tm)[None] < L for L in lens for _ in range(n)]).astype(
      np.float32)                                                       # [2n, Tm]
  bad = rng.uniform(size=mask.shape) < 0.01                             # p = 1% bad tokens
  kl = np.where(bad, 1.0, 1e-4).astype(np.float32)
  log_rho = np.where(bad, 0.5, 0.01).astype(np.float32)
  stats = trm.TokenStats(mask=jnp.asarray(mask), kl=jnp.asarray(kl),
                         log_rho=jnp.asarray(log_rho))
  th = dict(delta=0.01, delta_ser=0.05)
  for name, grows in (("trm_max_kl", True), ("ser", False)):
    m = jax.jit(lambda s: trm.rejection_by_length(
        trm.apply_criteria((name,), th, s).seq_mask, s.mask, edges=(0, 64)))(stats)
    short, long = float(m["trm/reject_rate/len_0_64"]), float(m["trm/reject_rate/len_64_inf"])
    if grows:
      assert long > 0.6 and short < 0.15                  # 1 - 0.99^128 = 0.72, 1 - 0.99^8 = 0.08
    else:
      assert long < short                                 # longer averages concentrate


def test_seq_mis_and_geo_mean_against_numpy():
  """seq_mis keeps sum_t log rho_t <= log C, geo_mean keeps |mean_t log rho_t| <= tau; their
  rejection rates and statistics are the monitors every criterion reports."""
  rng = np.random.default_rng(0)
  Bn, Tn = 64, 40
  lengths = rng.integers(0, Tn, Bn)
  mask = (np.arange(Tn)[None] < lengths[:, None]).astype(np.float32)
  log_rho = rng.normal(0, 0.15, (Bn, Tn)).astype(np.float32)
  stats = trm.TokenStats(mask=jnp.asarray(mask), log_rho=jnp.asarray(log_rho))
  th = dict(seq_mis_cap=2.0, geo_mean_tau=0.03)
  lr = np.where(mask > 0, log_rho, 0.0).astype(np.float64)
  valid = lengths > 0
  want = {"seq_mis": (lr.sum(1) <= np.log(2.0)) | ~valid,
          "geo_mean": (np.abs(lr.sum(1) / np.maximum(lengths, 1)) <= 0.03) | ~valid}
  stat = {"seq_mis": ("log_seq_ratio", lr.sum(1)),
          "geo_mean": ("abs_mean_log_rho", np.abs(lr.sum(1) / np.maximum(lengths, 1)))}
  for n, keep in want.items():
    res = jax.jit(lambda s, n=n: trm.apply_criteria((n,), th, s))(stats)
    assert 0 < (~keep).sum() < valid.sum(), n        # some rejected, some kept
    np.testing.assert_array_equal(res.seq_mask, keep.astype(np.float32), err_msg=n)
    np.testing.assert_allclose(res.metrics[f"trm/{n}/reject_rate"],
                               (~keep[valid]).mean(), rtol=1e-6)
    key, v = stat[n]
    np.testing.assert_allclose(res.metrics[f"trm/{n}/{key}_mean"], v[valid].mean(),
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(res.metrics[f"trm/{n}/{key}_max"], v[valid].max(), rtol=1e-5)


def test_seq_mis_compares_in_log_space():
  """A 600-token sequence whose ratio is 1 (300 tokens at rho = e^0.5, then 300 at e^-0.5):
  the running product overflows fp32 (e^150), its log does not; kept. Its mirror, all tokens
  at e^0.5 (ratio e^300), is rejected, and all at e^-0.5 (e^-300) kept under a cap from above."""
  Tn = 600
  up = np.full(Tn, 0.5, np.float32)
  log_rho = np.stack([np.concatenate([up[:300], -up[:300]]), up, -up])
  with np.errstate(over="ignore"):
    assert not np.isfinite(np.prod(np.exp(log_rho[0, :300])))        # fp32 product: inf
  stats = trm.TokenStats(mask=jnp.ones((3, Tn)), log_rho=jnp.asarray(log_rho))
  res = trm.apply_criteria(("seq_mis",), {"seq_mis_cap": 2.0}, stats)
  np.testing.assert_array_equal(res.seq_mask, [1.0, 0.0, 1.0])
  assert all(np.isfinite(np.asarray(v)).all() for v in res.metrics.values())
  geo = trm.apply_criteria(("geo_mean",), {"geo_mean_tau": 0.1}, stats)
  np.testing.assert_array_equal(geo.seq_mask, [1.0, 0.0, 0.0])      # |mean| = 0, .5, .5
