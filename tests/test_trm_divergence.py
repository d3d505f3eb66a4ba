"""Per-token divergences: exactness, truncated distributions, the top-k lower bound, sample
estimators (k1/k2/k3), chunking and its memory, per-sequence reductions."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from trm_jax import trm

B, T, V = 2, 6, 5  # fixed shapes so hypothesis examples reuse one compilation


def _np_log_softmax(z):
  z = np.asarray(z, np.float64)
  return (z - np.logaddexp.reduce(z, axis=-1, keepdims=True)).astype(np.float32)


def _np_kl_tv(lt, lr):
  """float64 reference with 0 log 0 = 0."""
  lt, lr = np.asarray(lt, np.float64), np.asarray(lr, np.float64)
  lpt = lt - np.logaddexp.reduce(lt, axis=-1, keepdims=True)
  lpr = lr - np.logaddexp.reduce(lr, axis=-1, keepdims=True)
  pr, pt = np.exp(lpr), np.exp(lpt)
  with np.errstate(invalid="ignore"):
    terms = np.where(pr > 0, pr * (lpr - lpt), 0.0)
  return terms.sum(-1), 0.5 * np.abs(pt - pr).sum(-1)


logits = st.lists(st.floats(-4.0, 4.0), min_size=B * T * V, max_size=B * T * V).map(
    lambda x: np.asarray(x, np.float32).reshape(B, T, V))
masks = st.lists(st.booleans(), min_size=B * T, max_size=B * T).map(
    lambda x: np.asarray(x, np.float32).reshape(B, T))


@settings(max_examples=20, deadline=None)
@given(lt=logits, lr=logits, mask=masks)
def test_kl_tv_exact_pinsker_and_identity(lt, lr, mask):
  kl, tv = trm.token_divergences(lt, lr, mask, chunk_size=4)
  ref_kl, ref_tv = _np_kl_tv(lt, lr)
  np.testing.assert_allclose(kl, ref_kl * mask, rtol=1e-4, atol=2e-6)
  np.testing.assert_allclose(tv, ref_tv * mask, rtol=1e-4, atol=2e-6)
  assert np.all(np.asarray(kl) >= 0)
  # Pinsker per token: TV <= sqrt(KL / 2) (float32 slack).
  assert np.all(np.asarray(tv) <= np.sqrt(np.asarray(kl) / 2) + 1e-6)
  # Identical policies: exactly zero, masked or not.
  kl0, tv0 = trm.token_divergences(lt, lt, mask, chunk_size=4)
  assert np.all(np.asarray(kl0) == 0) and np.all(np.asarray(tv0) == 0)


def test_chunking_is_invisible():
  rng = np.random.default_rng(0)
  lt = rng.normal(size=(2, 7, 11)).astype(np.float32)
  lr = rng.normal(size=(2, 7, 11)).astype(np.float32)
  mask = np.ones((2, 7), np.float32)
  ref = trm.token_divergences(lt, lr, mask, chunk_size=7)
  for c in (3, 100):  # ragged tail (7 = 2*3 + 1); chunk > T
    got = trm.token_divergences(lt, lr, mask, chunk_size=c)
    for g, r in zip(got, ref):
      np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-7)
  with pytest.raises(ValueError, match="chunk_size"):
    trm.token_divergences(lt, lr, mask, chunk_size=0)


def test_chunked_memory_does_not_grow_with_T():
  """No third [B, T, V] temporary: XLA's temp allocation is the same at T and 4T and below
  one input array (the unchunked log-softmax formulation needs two of them)."""
  Bm, Vm, C = 1, 4096, 64
  temps = []
  for Tm in (512, 2048):
    a = jax.ShapeDtypeStruct((Bm, Tm, Vm), jnp.float32)
    m = jax.ShapeDtypeStruct((Bm, Tm), jnp.float32)
    c = jax.jit(lambda x, y, z: trm.token_divergences(x, y, z, chunk_size=C)).lower(
        a, a, m).compile()
    temps.append(c.memory_analysis().temp_size_in_bytes)
  full = 4 * Bm * 512 * Vm
  assert temps[1] <= temps[0] * 1.05 + 4096 and temps[0] < full, (temps, full)


def test_truncated_rollout_distribution():
  # top-k style rollout: -inf logits have zero probability, 0 log 0 = 0.
  lr = np.array([[[2.0, 1.0, -np.inf, -np.inf]]], np.float32)
  lt = np.array([[[1.0, 1.0, 0.0, -1.0]]], np.float32)
  mask = np.ones((1, 1), np.float32)
  kl, tv = trm.token_divergences(lt, lr, mask)
  ref_kl, ref_tv = _np_kl_tv(lt, lr)
  assert np.isfinite(kl).all()
  np.testing.assert_allclose(kl, ref_kl, rtol=1e-5)
  np.testing.assert_allclose(tv, ref_tv, rtol=1e-5)
  # Usable as a loss: the gradient w.r.t. theta's logits is finite despite the -inf.
  g = jax.grad(lambda z: jnp.sum(trm.token_divergences(z, lr, mask)[0]))(jnp.asarray(lt))
  assert np.isfinite(g).all() and np.abs(g).sum() > 0
  # theta truncated where roll is not: KL(roll || theta) = +inf by design, TV stays finite.
  kl, tv = trm.token_divergences(lr[..., ::-1], lr, mask)
  assert np.isposinf(kl).all() and np.isfinite(tv).all()
  # Both truncated on the same tokens: finite; masked positions are exactly zero.
  kl, tv = trm.token_divergences(lr, lr, np.zeros((1, 1), np.float32))
  assert float(kl[0, 0]) == 0.0 and float(tv[0, 0]) == 0.0


def test_topk_tail_is_a_lower_bound_and_exact_for_topk_rollouts():
  rng = np.random.default_rng(1)
  Bk, Tk, Vk = 2, 5, 9
  lt = rng.normal(0, 2, (Bk, Tk, Vk)).astype(np.float32)
  lr = (lt + rng.normal(0, 1, (Bk, Tk, Vk))).astype(np.float32)
  mask = np.ones((Bk, Tk), np.float32)
  kl, tv = trm.token_divergences(lt, lr, mask)
  logp_r = _np_log_softmax(lr)
  order = np.argsort(-lr, axis=-1)
  for k in (3, Vk):
    ids = order[..., :k]
    lp = np.take_along_axis(logp_r, ids, -1)
    kl_lb, tv_lb = trm.topk_tail_divergences(lt, lp, ids, mask)
    assert np.all(np.asarray(kl_lb) <= np.asarray(kl) + 1e-5)
    assert np.all(np.asarray(tv_lb) <= np.asarray(tv) + 1e-6)
    assert np.all(np.asarray(kl_lb) >= 0)
    if k == Vk:
      np.testing.assert_allclose(kl_lb, kl, rtol=1e-4, atol=1e-6)
      np.testing.assert_allclose(tv_lb, tv, rtol=1e-4, atol=1e-6)
  # A top-k sampler (rollout truncated to its top 3): the top-3 + tail route is exact.
  ids = order[..., :3]
  keep = np.zeros_like(lr, bool)
  np.put_along_axis(keep, ids, True, -1)
  lr_trunc = np.where(keep, lr, -np.inf).astype(np.float32)
  kl_t, tv_t = trm.token_divergences(lt, lr_trunc, mask)
  lp = np.take_along_axis(_np_log_softmax(lr_trunc), ids, -1).astype(np.float32)
  kl_lb, tv_lb = trm.topk_tail_divergences(lt, lp, ids, mask)
  np.testing.assert_allclose(kl_lb, kl_t, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(tv_lb, tv_t, rtol=1e-4, atol=1e-6)
  with pytest.raises(ValueError, match="roll_topk_ids"):
    trm.topk_tail_divergences(lt, lp, ids[..., :2], mask)


@settings(max_examples=20, deadline=None)
@given(lt=logits, lr=logits, seed=st.integers(0, 2**31 - 1))
def test_k3_nonnegative_exact_in_expectation_and_converges(lt, lr, seed):
  lt, lr = lt[0, 0], lr[0, 0]                                    # one context, V tokens
  lpt, lpr = _np_log_softmax(lt), _np_log_softmax(lr)
  kl = float(_np_kl_tv(lt, lr)[0])
  # Exact expectation over pi_roll: sum_v p_roll k3(rho_v) = KL(roll || theta) (App. E).
  k3_all = np.asarray(trm.k3(jnp.asarray(lpt - lpr)), np.float64)
  assert np.all(k3_all >= 0)
  np.testing.assert_allclose(np.sum(np.exp(lpr.astype(np.float64)) * k3_all), kl, rtol=1e-4,
                             atol=1e-6)
  # Monte Carlo from pi_roll: the sample mean converges to KL (within 6 standard errors).
  N = 20000
  p_roll = np.exp(lpr.astype(np.float64))
  v = np.random.default_rng(seed).choice(V, size=(1, N), p=p_roll / p_roll.sum())  # [1, N]
  est = trm.sample_estimators(lpt[v], lpr[v], np.ones((1, N), np.float32))
  k3s = np.asarray(est["k3"], np.float64)
  se = k3s.std() / np.sqrt(N)
  assert abs(k3s.mean() - kl) <= 6 * se + 1e-5
  assert np.all(k3s >= 0)
  # Sign conventions: log rho = logp_theta - logp_roll, k1 = -log rho, k2 = (log rho)^2 / 2.
  np.testing.assert_allclose(est["log_rho"], lpt[v] - lpr[v], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(est["k1"], -est["log_rho"])
  np.testing.assert_allclose(est["k2"], 0.5 * np.square(est["log_rho"]), rtol=1e-6)


def test_k3_extreme_and_near_one():
  log_rho = jnp.array([np.log(0.001 / 0.9), np.log(900.0), 1e-6, 0.0, -1e-6])
  k = np.asarray(trm.k3(log_rho), np.float64)
  lr = np.asarray(log_rho, np.float64)
  ref = np.exp(lr) - 1 - lr
  assert np.isfinite(k).all() and k[3] == 0.0
  np.testing.assert_allclose(k[:2], ref[:2], rtol=1e-5)
  np.testing.assert_allclose(k[2:], 0.5 * lr[2:] ** 2, rtol=1e-3, atol=1e-18)


def test_sequence_reductions_and_empty_rows():
  x = jnp.array([[1.0, -2.0, 5.0], [3.0, jnp.inf, jnp.nan]])
  mask = jnp.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
  np.testing.assert_array_equal(trm.seq_sum(x, mask), [-1.0, 0.0])
  np.testing.assert_array_equal(trm.seq_mean(x, mask), [-0.5, 0.0])
  np.testing.assert_array_equal(trm.seq_max(x, mask), [1.0, 0.0])
  est = trm.batch_estimates(jnp.zeros((2, 3)), kl=jnp.zeros((2, 3)), tv=jnp.zeros((2, 3)),
                            log_rho=jnp.zeros((2, 3)))
  for leaf in jax.tree_util.tree_leaves(est):
    assert np.isfinite(leaf).all()


def test_batch_estimates_by_hand():
  mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])   # row 3: padding row
  kl = jnp.array([[0.1, 0.3, 0.2], [0.4, 9.0, 9.0], [7.0, 7.0, 7.0]])
  tv = jnp.array([[0.2, 0.1, 0.0], [0.3, 9.0, 9.0], [7.0, 7.0, 7.0]])
  log_rho = jnp.array([[0.5, -0.5, 0.0], [np.log(2.0), 3.0, 3.0], [1.0, 1.0, 1.0]])
  e = trm.batch_estimates(mask, kl=kl, tv=tv, log_rho=log_rho)
  np.testing.assert_allclose(e.delta_hat, 0.4)
  np.testing.assert_allclose(e.eps_hat, 0.3)
  np.testing.assert_allclose(e.kl_seq_hat, (0.6 + 0.4) / 2, rtol=1e-6)
  np.testing.assert_allclose(e.dbar_hat, [(0.2 + 0.3) / 2, 0.1 / 2, 0.0], rtol=1e-6)
  # 1/2 E|1 - prod rho|: row 1 prod = 1, row 2 prod = 2.
  np.testing.assert_allclose(e.tv_seq_hat, 0.5 * (0.0 + 1.0) / 2, rtol=1e-6)
  with pytest.raises(ValueError, match="seq_weights"):
    trm.batch_estimates(mask, kl=kl, seq_weights=jnp.ones(2))
