"""Objectives: on-policy gradients equal REINFORCE, masking, clipping, aggregation, numerics."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trm_jax import trm
from trm_jax.rl import objectives as obj

B, T = 4, 6
HPARAMS = {
    "trm_surrogate": {},
    "ppo_clip": dict(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=3.0),
    "tis": dict(tis_cap=2.0),
    "gspo": dict(clip_eps_low=3e-4, clip_eps_high=4e-4),     # the GSPO paper's
    "cispo": dict(clip_eps_low=1.0, clip_eps_high=4.0),      # MiniMax-M1 / ScaleRL's
}
MAX_LEN = 8


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  logp = jnp.asarray(np.log(rng.uniform(0.05, 0.95, (B, T))), jnp.float32)
  lengths = np.array([6, 3, 1, 4])
  start = np.array([0, 2, 1, 0])                    # prompt tokens before the response
  idx = np.arange(T)[None]
  rm = ((idx >= start[:, None]) & (idx < (start + lengths)[:, None])).astype(np.float32)
  return dict(
      logp=logp,
      advantages=jnp.asarray(rng.normal(size=(B,)), jnp.float32),
      response_mask=jnp.asarray(rm),
      seq_mask=jnp.asarray([1.0, 0.0, 1.0, 1.0]),
  )


def _kw(name, loss_agg):
  return dict(loss_agg=loss_agg, max_len=MAX_LEN if loss_agg.endswith("norm") else None,
              **HPARAMS[name])


def _reinforce(logp_theta, b, loss_agg, normalizer=None):
  """agg(-A log pi_theta) with the same weights: the gradient every objective must match."""
  w = b["response_mask"] * b["seq_mask"][:, None]
  return obj.aggregate(-b["advantages"][:, None] * logp_theta, w, b["response_mask"],
                       loss_agg=loss_agg, normalizer=normalizer,
                       max_len=MAX_LEN if loss_agg.endswith("norm") else None)


CASES = list(itertools.product(sorted(obj.OBJECTIVES), obj.LOSS_AGG_MODES))


@pytest.mark.parametrize("name,loss_agg", CASES)
def test_on_policy_gradient_equals_reinforce_wrt_logp(name, loss_agg):
  b = _batch()
  extra = {"logp_old": b["logp"]} if obj.OBJECTIVES[name].uses_logp_old else {}

  def loss(lt):
    return obj.compute_loss(name, logp_theta=lt, logp_roll=b["logp"], advantages=b["advantages"],
                            response_mask=b["response_mask"], seq_mask=b["seq_mask"],
                            **extra, **_kw(name, loss_agg))[0]

  g = jax.grad(loss)(b["logp"])
  g_ref = jax.grad(lambda lt: _reinforce(lt, b, loss_agg))(b["logp"])
  assert np.abs(np.asarray(g_ref)).max() > 0
  np.testing.assert_array_equal(np.asarray(g), np.asarray(g_ref))


@pytest.mark.parametrize("name,loss_agg", CASES)
def test_on_policy_gradient_equals_reinforce_through_tabular_policy(name, loss_agg):
  b = _batch(1)
  V, C = 5, 3
  rng = np.random.default_rng(2)
  theta0 = jnp.asarray(rng.normal(size=(C, V)), jnp.float32)          # [contexts, V]
  ctx = jnp.asarray(rng.integers(0, C, (B, T)))
  tok = jnp.asarray(rng.integers(0, V, (B, T)))

  def logp_of(theta):
    return jnp.take_along_axis(jax.nn.log_softmax(theta)[ctx], tok[..., None], -1)[..., 0]

  logp_roll = logp_of(theta0)
  kl = dict(logp_ref=logp_roll, kl_beta=0.3)   # pi_ref == pi_theta: zero KL gradient too

  def loss(theta):
    return obj.compute_loss(name, logp_theta=logp_of(theta), logp_roll=logp_roll,
                            advantages=b["advantages"], response_mask=b["response_mask"],
                            seq_mask=b["seq_mask"], **kl, **_kw(name, loss_agg))[0]

  g = jax.grad(loss)(theta0)
  g_ref = jax.grad(lambda th: _reinforce(logp_of(th), b, loss_agg))(theta0)
  assert np.abs(np.asarray(g_ref)).max() > 1e-3
  np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name,loss_agg", CASES)
def test_all_masked_batch_zero_gradient_finite_metrics(name, loss_agg):
  b = _batch()
  lt = b["logp"] + 0.3   # off-policy, so a non-zero gradient would have somewhere to come from

  def f(lt):
    return obj.compute_loss(name, logp_theta=lt, logp_roll=b["logp"], advantages=b["advantages"],
                            response_mask=b["response_mask"], seq_mask=jnp.zeros((B,)),
                            **_kw(name, loss_agg))

  (loss, metrics), g = jax.value_and_grad(f, has_aux=True)(lt)
  assert float(loss) == 0.0
  np.testing.assert_array_equal(np.asarray(g), 0.0)
  for k, v in metrics.items():
    assert np.isfinite(np.asarray(v)).all(), k
  assert float(metrics["seq_kept_frac"]) == 0.0


@pytest.mark.parametrize("name", sorted(obj.OBJECTIVES))
def test_gradients_reach_only_the_policy(name):
  b = _batch()
  rng = np.random.default_rng(3)
  off = jnp.asarray(rng.normal(scale=0.3, size=(B, T)), jnp.float32)
  others = dict(logp_roll=b["logp"] + off, advantages=b["advantages"], logp_ref=b["logp"] - off,
                token_weights=jnp.ones((B, T)) * 0.7, seq_mask=b["seq_mask"])
  if obj.OBJECTIVES[name].uses_logp_old:
    others["logp_old"] = b["logp"] + 0.5 * off

  def f(others, lt):
    return obj.compute_loss(name, logp_theta=lt, response_mask=b["response_mask"], kl_beta=0.1,
                            **others, **_kw(name, "token-mean"))[0]

  g_others, g_theta = jax.grad(f, argnums=(0, 1))(others, b["logp"])
  for k, v in g_others.items():
    np.testing.assert_array_equal(np.asarray(v), 0.0, err_msg=k)
  assert np.abs(np.asarray(g_theta)).max() > 0


def _one_row(log_r, adv):
  """Row 0 of a [B, T] batch holds len(log_r) response tokens; other rows are padding.

  Every test shares the [B, T] shape so eager mode compiles each primitive once.
  """
  L = len(log_r)
  lt = np.full((B, T), np.log(0.3), np.float32)
  lt[0, :L] += np.asarray(log_r, np.float32)
  rm = np.zeros((B, T), np.float32)
  rm[0, :L] = 1.0
  args = dict(logp_roll=jnp.full((B, T), np.log(0.3), jnp.float32),
              advantages=jnp.asarray([adv, 0.0, 0.0, 0.0], jnp.float32),
              response_mask=jnp.asarray(rm), seq_mask=jnp.ones((B,)),
              loss_agg="seq-mean-token-sum")
  return jnp.asarray(lt), args


def test_ppo_clip_on_constructed_ratios():
  ratios = np.array([0.5, 0.9, 1.0, 1.1, 1.5, 5.0])
  hp = dict(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=3.0)
  for adv in (1.0, -1.0):
    lt, args = _one_row(np.log(ratios), adv)
    (loss, m), g = jax.value_and_grad(
        lambda lt: obj.ppo_clip(logp_theta=lt, **args, **hp), has_aux=True)(lt)
    clipped = np.clip(ratios, 0.8, 1.2)
    per_tok = np.maximum(-adv * ratios, -adv * clipped)
    if adv < 0:
      per_tok = np.minimum(per_tok, -adv * 3.0)
    np.testing.assert_allclose(float(loss), per_tok.sum(), rtol=1e-6)
    g = np.asarray(g)[0, :6]
    if adv > 0:   # gradient vanishes only above 1 + eps (r = 1.5, 5.0)
      live = np.array([1, 1, 1, 1, 0, 0], bool)
      assert float(m["clip_frac"]) == pytest.approx(2 / 6)
      assert float(m["dual_clip_frac"]) == 0.0
    else:         # vanishes below 1 - eps (r = 0.5) and past the dual clip c = 3 (r = 5.0)
      live = np.array([0, 1, 1, 1, 1, 0], bool)
      assert float(m["clip_frac"]) == pytest.approx(1 / 6)
      assert float(m["dual_clip_frac"]) == pytest.approx(1 / 6)
    np.testing.assert_array_equal(g[~live], 0.0)
    np.testing.assert_allclose(g[live], -adv * ratios[live], rtol=1e-5)


def test_ppo_ratio_uses_logp_old_when_given():
  lt, args = _one_row(np.zeros(6), 1.0)
  hp = dict(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=None)
  old = args["logp_roll"] - np.log(2.0)          # r = 2 against old: clipped, no gradient
  g = jax.grad(lambda lt: obj.ppo_clip(logp_theta=lt, logp_old=old, **args, **hp)[0])(lt)
  np.testing.assert_array_equal(np.asarray(g), 0.0)
  g = jax.grad(lambda lt: obj.ppo_clip(logp_theta=lt, **args, **hp)[0])(lt)
  np.testing.assert_allclose(np.asarray(g)[0], -1.0)


def test_token_mask_criterion_zeroes_the_right_tokens():
  """Token masking (the baseline the TRM paper argues against) is the criterion "token_mask":
  the learner multiplies the surrogate's token weights by its token mask (rl.learner), giving
  per token -A rho 1[|log rho| <= tau]."""
  log_r = np.array([0.0, 0.49, -0.49, 0.51, -2.0, 3.0])
  lt, args = _one_row(log_r, 2.0)
  stats = trm.token_stats(args["response_mask"], logp_theta=jnp.asarray(lt),
                          logp_roll=args["logp_roll"])
  res = trm.apply_criteria(("token_mask",), {"tau": 0.5}, stats)
  (loss, m), g = jax.value_and_grad(
      lambda lt: obj.trm_surrogate(logp_theta=lt, token_weights=res.token_mask, **args),
      has_aux=True)(lt)
  keep = np.abs(log_r) <= 0.5
  g = np.asarray(g)[0]
  np.testing.assert_array_equal(g[~keep], 0.0)
  np.testing.assert_allclose(g[keep], -2.0 * np.exp(log_r[keep]), rtol=1e-6)
  np.testing.assert_allclose(float(loss), (-2.0 * np.exp(log_r) * keep).sum(), rtol=1e-6)
  assert float(m["token_kept_frac"]) == pytest.approx(3 / 6)
  np.testing.assert_array_equal(res.seq_mask, 1.0)  # no sequence is dropped


def test_tis_weight_is_truncated_and_gradient_free():
  log_r = np.log(np.array([0.5, 1.0, 3.0, 100.0]))
  lt, args = _one_row(log_r, -1.5)
  (loss, m), g = jax.value_and_grad(
      lambda lt: obj.truncated_is(logp_theta=lt, tis_cap=2.0, **args), has_aux=True)(lt)
  w = np.minimum(np.exp(log_r), 2.0)
  np.testing.assert_allclose(np.asarray(g)[0, :4], 1.5 * w, rtol=1e-6)
  np.testing.assert_allclose(float(loss), (1.5 * w * np.asarray(lt)[0, :4]).sum(), rtol=1e-6)
  assert float(m["tis_trunc_frac"]) == pytest.approx(0.5)


def test_trm_surrogate_value_is_masked_mean_of_A_sum_rho():
  b = _batch()
  lt = b["logp"] + 0.1 * jnp.arange(T)[None]
  loss, m = obj.trm_surrogate(logp_theta=lt, logp_roll=b["logp"], advantages=b["advantages"],
                              response_mask=b["response_mask"], seq_mask=b["seq_mask"],
                              loss_agg="seq-mean-token-sum")
  rm, ms, a = (np.asarray(b[k], np.float64) for k in ("response_mask", "seq_mask", "advantages"))
  rho = np.exp(np.asarray(lt, np.float64) - np.asarray(b["logp"], np.float64))
  expected = -np.sum(ms * a * np.sum(rho * rm, 1)) / B
  np.testing.assert_allclose(float(loss), expected, rtol=1e-6)
  np.testing.assert_allclose(float(m["seq_kept_frac"]), 0.75)


def test_aggregation_modes_against_numpy():
  b = _batch()
  rng = np.random.default_rng(4)
  per = rng.normal(size=(B, T))
  rm = np.asarray(b["response_mask"], np.float64)
  rm[1] = 0.0                                  # a padding row: not counted as a sequence
  w = rm * np.asarray(b["seq_mask"])[:, None]
  n_seq = 3.0
  expected = {
      "token-mean": (w * per).sum() / rm.sum(),
      "seq-mean-token-mean": ((w * per).sum(1) / np.maximum(rm.sum(1), 1)).sum() / n_seq,
      "seq-mean-token-sum": (w * per).sum() / n_seq,
      "seq-mean-token-sum-norm": (w * per).sum() / (n_seq * MAX_LEN),
  }
  for mode, e in expected.items():
    got = obj.aggregate(jnp.asarray(per, jnp.float32), jnp.asarray(w, jnp.float32),
                        jnp.asarray(rm, jnp.float32), loss_agg=mode,
                        max_len=MAX_LEN if mode.endswith("norm") else None)
    np.testing.assert_allclose(float(got), e, rtol=1e-6, err_msg=mode)


def test_masking_a_sequence_leaves_other_gradients_unchanged():
  # Normalisers count all rollouts, so M only removes terms: it never rescales the rest.
  b = _batch()
  lt = b["logp"] + 0.2
  for mode in obj.LOSS_AGG_MODES:
    def g_of(seq_mask):
      return jax.grad(lambda lt: obj.trm_surrogate(
          logp_theta=lt, logp_roll=b["logp"], advantages=b["advantages"],
          response_mask=b["response_mask"], seq_mask=seq_mask, loss_agg=mode,
          max_len=MAX_LEN if mode.endswith("norm") else None)[0])(lt)
    g_all, g_masked = g_of(jnp.ones((B,))), g_of(jnp.asarray([1.0, 1.0, 0.0, 1.0]))
    np.testing.assert_array_equal(np.asarray(g_masked)[2], 0.0)
    np.testing.assert_array_equal(np.asarray(g_masked)[[0, 1, 3]], np.asarray(g_all)[[0, 1, 3]])


def test_k3_kl_value_and_gradient():
  lt, args = _one_row(np.zeros(4), 0.0)   # tokens 4, 5 are padding: d there is ignored
  d = np.array([0.0, 0.5, -0.5, 2.0, 0.0, 0.0], np.float32)   # log pi_ref - log pi_theta
  ref = lt + d
  (loss, m), g = jax.value_and_grad(lambda lt: obj.trm_surrogate(
      logp_theta=lt, logp_ref=ref, kl_beta=0.25, **args), has_aux=True)(lt)
  d = d[:4]
  k3 = np.exp(d) - d - 1
  np.testing.assert_allclose(float(loss), 0.25 * k3.sum(), rtol=1e-6)
  np.testing.assert_allclose(float(m["kl_ref"]), k3.mean(), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(g)[0, :4], 0.25 * (1 - np.exp(d)), rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(g)[:, 4:], 0.0)


@pytest.mark.parametrize("name", sorted(obj.OBJECTIVES))
def test_extreme_ratios_and_garbage_padding_stay_finite(name):
  lt = np.full((B, T), -1.0, np.float32)
  lr = np.full((B, T), -1.0, np.float32)
  rm = np.zeros((B, T), np.float32)
  lt[0, :4] = [-1.0, -0.5, 0.0, np.nan]
  lr[0, :4] = [-900.0, -0.5, -1.0, -np.inf]
  lt[1, :4] = [-1e4, -2.0, -np.inf, -3.0]
  lr[1, :4] = [-1.0, -1e4, -2.0, np.nan]
  rm[0, :3] = 1.0
  rm[1, :2] = 1.0
  lt, lr, rm = jnp.asarray(lt), jnp.asarray(lr), jnp.asarray(rm)

  def f(lt):
    return obj.compute_loss(name, logp_theta=lt, logp_roll=lr,
                            advantages=jnp.asarray([1.0, -1.0, 1.0, 1.0]),
                            response_mask=rm, seq_mask=jnp.ones((B,)), logp_ref=lr,
                            kl_beta=0.1, **_kw(name, "token-mean"))
  (loss, m), g = jax.value_and_grad(f, has_aux=True)(lt)
  assert np.isfinite(float(loss))
  assert np.isfinite(np.asarray(g)).all()
  np.testing.assert_array_equal(np.asarray(g)[rm == 0], 0.0)
  for k, v in m.items():
    assert np.isfinite(np.asarray(v)).all(), k
  assert float(m["log_ratio_abs_max"]) == obj.LOG_RATIO_CLAMP


def test_bad_inputs_name_the_culprit():
  b = _batch()
  base = dict(logp_theta=b["logp"], logp_roll=b["logp"], advantages=b["advantages"],
              response_mask=b["response_mask"], seq_mask=b["seq_mask"], loss_agg="token-mean")
  with pytest.raises(ValueError, match="objective"):
    obj.compute_loss("grpo", **base)
  with pytest.raises(ValueError, match="logp_roll"):
    obj.trm_surrogate(**{**base, "logp_roll": b["logp"][:, :3]})
  with pytest.raises(ValueError, match="seq_mask"):
    obj.trm_surrogate(**{**base, "seq_mask": jnp.ones((B + 1,))})
  with pytest.raises(ValueError, match="advantages"):
    obj.trm_surrogate(**{**base, "advantages": jnp.ones((B, T + 1))})
  with pytest.raises(ValueError, match="loss_agg"):
    obj.trm_surrogate(**{**base, "loss_agg": "mean"})
  with pytest.raises(ValueError, match="max_len"):
    obj.trm_surrogate(**{**base, "loss_agg": "seq-mean-token-sum-norm"})
  with pytest.raises(ValueError, match="logp_old"):
    obj.trm_surrogate(**base, logp_old=b["logp"])
  with pytest.raises(ValueError, match="kl_beta"):
    obj.trm_surrogate(**base, logp_ref=b["logp"])
  with pytest.raises(ValueError, match="dual_clip_c"):
    obj.ppo_clip(**base, clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=0.5)


@pytest.mark.parametrize("name", sorted(obj.OBJECTIVES))
def test_token_advantages_and_token_weights(name):
  # [B, T] advantages equal to a broadcast [B] give the same loss; token_weights (Sparse-RL)
  # scale each token's gradient and nothing else.
  b = _batch()
  lt = b["logp"] + 0.05
  w = jnp.asarray(np.random.default_rng(5).uniform(0.5, 1.5, (B, T)), jnp.float32)

  def f(lt, adv, token_weights=None):
    return obj.compute_loss(name, logp_theta=lt, logp_roll=b["logp"], advantages=adv,
                            response_mask=b["response_mask"], seq_mask=b["seq_mask"],
                            token_weights=token_weights, **_kw(name, "seq-mean-token-sum"))[0]

  adv_bt = jnp.broadcast_to(b["advantages"][:, None], (B, T))
  np.testing.assert_array_equal(np.asarray(f(lt, adv_bt)), np.asarray(f(lt, b["advantages"])))
  g = jax.grad(f)(lt, b["advantages"])
  g_w = jax.grad(f)(lt, b["advantages"], w)
  np.testing.assert_allclose(np.asarray(g_w), np.asarray(w * g), rtol=1e-6, atol=1e-8)
  assert np.abs(np.asarray(g)).max() > 0


# --- GSPO and CISPO against numpy references of their papers' definitions -------------------
def _ragged(seed, Bn=16, Tn=12, scale=1e-3):
  """Random policies over a ragged batch: responses of 0-12 tokens after 0-3 prompt tokens
  (row 0 a padding row), NaN / inf garbage at every non-response position of each log-prob
  input, advantages of both signs, two sequences masked by TRM. log r = logp_theta - logp_old
  ~ N(0, scale) per token."""
  rng = np.random.default_rng(seed)
  start = rng.integers(0, 4, Bn)
  length = rng.integers(1, Tn - 3, Bn)
  length[0] = 0
  idx = np.arange(Tn)[None]
  rm = ((idx >= start[:, None]) & (idx < (start + length)[:, None])).astype(np.float32)
  roll = np.log(rng.uniform(0.05, 0.95, (Bn, Tn))).astype(np.float32)
  old = (roll + rng.normal(0, 0.2, (Bn, Tn))).astype(np.float32)
  theta = (old + rng.normal(0, scale, (Bn, Tn))).astype(np.float32)
  garbage = np.where(rng.uniform(size=(Bn, Tn)) < 0.5, np.nan, -np.inf)
  theta, roll, old = (np.where(rm > 0, x, garbage).astype(np.float32) for x in (theta, roll, old))
  seq_mask = np.ones(Bn, np.float32)
  seq_mask[rng.choice(np.arange(1, Bn), 2, replace=False)] = 0.0
  return dict(theta=theta, roll=roll, old=old, rm=rm, seq_mask=seq_mask,
              adv=rng.normal(size=Bn).astype(np.float32))


def _numpy_weights(d, loss_agg):
  """W [B, T]: the aggregation's weight of each token (sum_bt W l = the loss), float64."""
  rm = d["rm"].astype(np.float64)
  w = rm * d["seq_mask"][:, None]
  n_seq = max((rm.sum(1) > 0).sum(), 1)
  if loss_agg == "token-mean":
    return w / max(rm.sum(), 1)
  if loss_agg == "seq-mean-token-mean":
    return w / np.maximum(rm.sum(1, keepdims=True), 1) / n_seq
  if loss_agg == "seq-mean-token-sum":
    return w / n_seq
  return w / (n_seq * MAX_LEN)


def _jax_loss_and_grad(name, d, loss_agg, **hp):
  def f(lt):
    return obj.compute_loss(name, logp_theta=lt, logp_roll=jnp.asarray(d["roll"]),
                            logp_old=jnp.asarray(d["old"]), advantages=jnp.asarray(d["adv"]),
                            response_mask=jnp.asarray(d["rm"]),
                            seq_mask=jnp.asarray(d["seq_mask"]), loss_agg=loss_agg,
                            max_len=MAX_LEN if loss_agg.endswith("norm") else None, **hp)
  (loss, m), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(d["theta"]))
  return float(loss), np.asarray(g), m


def _gspo_numpy(d, eps_low, eps_high):
  """GSPO's sequence definition in float64: (per-sequence loss l_b, its derivative with
  respect to each of the sequence's log pi_theta(y_t) times |y_b|, log s_b)."""
  rm = d["rm"] > 0
  lr = np.where(rm, d["theta"], 0.0).astype(np.float64) - np.where(rm, d["old"], 0.0)
  n = np.maximum(rm.sum(1), 1)
  log_s = lr.sum(1) / n
  s, a = np.exp(log_s), d["adv"].astype(np.float64)
  unclipped, clipped = -a * s, -a * np.clip(s, 1 - eps_low, 1 + eps_high)
  l = np.maximum(unclipped, clipped)
  # d l / d log pi_theta(y_t) = (-A s) / |y| where the unclipped term is the max, else 0.
  dl = np.where(unclipped >= clipped, -a * s, 0.0)
  return l, dl, log_s


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_matches_the_papers_sequence_objective(seed):
  """compute_loss("gspo") with the paper's aggregation (seq-mean-token-mean) is
  sum_b M_b l_b / N_seq, l_b = max(-A s_b, -A clip(s_b, 1 - 3e-4, 1 + 4e-4)),
  s_b = exp(mean_t log r_bt): value and gradient to 1e-5 relative, on random inputs whose
  sequence ratios fall on both sides of the clip range."""
  d = _ragged(seed)
  l, dl, log_s = _gspo_numpy(d, 3e-4, 4e-4)
  keep = (d["rm"].sum(1) > 0) & (d["seq_mask"] > 0)
  out = (log_s < np.log1p(-3e-4)) | (log_s > np.log1p(4e-4))
  assert 0 < out[keep].sum() < keep.sum()           # both sides of the clip range occur
  assert np.min(np.abs(np.concatenate([log_s - np.log1p(-3e-4), log_s - np.log1p(4e-4)]))) > 1e-6
  n_seq = (d["rm"].sum(1) > 0).sum()
  want_loss = (l * keep).sum() / n_seq
  want_grad = np.where(d["rm"] > 0, (keep * dl / np.maximum(d["rm"].sum(1), 1))[:, None] / n_seq,
                       0.0)
  loss, g, m = _jax_loss_and_grad("gspo", d, "seq-mean-token-mean", clip_eps_low=3e-4,
                                  clip_eps_high=4e-4)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  np.testing.assert_allclose(g, want_grad, rtol=1e-5, atol=0)
  np.testing.assert_allclose(float(m["gspo_clip_frac"]), out[keep].mean(), rtol=1e-6)


@pytest.mark.parametrize("loss_agg", obj.LOSS_AGG_MODES)
def test_gspo_token_form_under_every_aggregation(loss_agg):
  """Another loss_agg weights GSPO-token's per-token terms (each the sequence's l_b, with the
  gradient dl_b / d log pi_theta(y_t) * |y_b|) as it weights every objective's."""
  d = _ragged(3)
  l, dl, _ = _gspo_numpy(d, 3e-4, 4e-4)
  W = _numpy_weights(d, loss_agg)
  loss, g, _ = _jax_loss_and_grad("gspo", d, loss_agg, clip_eps_low=3e-4, clip_eps_high=4e-4)
  np.testing.assert_allclose(loss, (W * l[:, None]).sum(), rtol=1e-5)
  np.testing.assert_allclose(g, W * dl[:, None], rtol=1e-5, atol=0)


@pytest.mark.parametrize("loss_agg", obj.LOSS_AGG_MODES)
@pytest.mark.parametrize("eps_low,eps_high", [(1.0, 4.0), (0.2, 0.28)])
def test_cispo_matches_its_definition(loss_agg, eps_low, eps_high):
  """compute_loss("cispo"): per token -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_theta,
  r = pi_theta / pi_old, under every loss_agg; value and gradient (clip(r) A times the
  aggregation's weight: never zero where the weight is not) to 1e-5 relative, with ratios on
  both sides of each clip range. (1.0, 4.0): the paper's, no lower bound and a cap of 5."""
  d = _ragged(4, scale=0.8)
  rm = d["rm"] > 0
  lt = np.where(rm, d["theta"], 0.0).astype(np.float64)
  r = np.exp(lt - np.where(rm, d["old"], 0.0))
  c = np.clip(r, 1 - eps_low, 1 + eps_high)
  assert (r[rm] > 1 + eps_high).any() and (eps_low == 1.0 or (r[rm] < 1 - eps_low).any())
  a = d["adv"].astype(np.float64)[:, None]
  W = _numpy_weights(d, loss_agg)
  loss, g, m = _jax_loss_and_grad("cispo", d, loss_agg, clip_eps_low=eps_low,
                                  clip_eps_high=eps_high)
  np.testing.assert_allclose(loss, (W * -c * a * lt).sum(), rtol=1e-5)
  np.testing.assert_allclose(g, W * -c * a, rtol=1e-5, atol=0)
  kept = rm & (d["seq_mask"][:, None] > 0)
  np.testing.assert_allclose(float(m["cispo_clip_frac"]), (c != r)[kept].mean(), rtol=1e-6)


def test_gspo_and_cispo_clip_ranges_are_checked():
  d = _ragged(0)
  with pytest.raises(ValueError, match="clip_eps_low must be in \\[0, 1\\)"):
    _jax_loss_and_grad("gspo", d, "token-mean", clip_eps_low=1.0, clip_eps_high=4e-4)
  with pytest.raises(ValueError, match="clip_eps_low must be in \\[0, 1\\]"):
    _jax_loss_and_grad("cispo", d, "token-mean", clip_eps_low=1.5, clip_eps_high=4.0)
  with pytest.raises(ValueError, match="clip_eps_high >= 0"):
    _jax_loss_and_grad("cispo", d, "token-mean", clip_eps_low=1.0, clip_eps_high=-1.0)
