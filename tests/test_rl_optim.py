"""Optimizer against a numpy AdamW, accumulation == one big batch, the non-finite guard."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trm_jax.rl import objectives as obj
from trm_jax.rl import optim

OPT = dict(lr=0.1, warmup_steps=2, total_steps=6, weight_decay=0.5, b1=0.9, b2=0.95, eps=1e-6,
           clip_norm=1.0, min_lr_ratio=0.1)


def test_schedule_warmup_then_cosine():
  s = optim.make_schedule(lr=2.0, warmup_steps=4, total_steps=12, min_lr_ratio=0.25)
  lrs = np.asarray(s(jnp.arange(13)))
  np.testing.assert_allclose(lrs[:5], [0.0, 0.5, 1.0, 1.5, 2.0], rtol=1e-6)
  np.testing.assert_allclose(lrs[8], 0.5 * (2.0 + 0.5), rtol=1e-6)    # cosine midpoint
  np.testing.assert_allclose(lrs[12], 0.5, rtol=1e-6)                  # min_lr_ratio * lr
  assert np.all(np.diff(lrs[4:]) < 0)


def _numpy_adamw(params, grads_seq, cfg):
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  mu = {k: np.zeros_like(v) for k, v in p.items()}
  nu = {k: np.zeros_like(v) for k, v in p.items()}
  s = optim.make_schedule(lr=cfg["lr"], warmup_steps=cfg["warmup_steps"],
                          total_steps=cfg["total_steps"], min_lr_ratio=cfg["min_lr_ratio"])
  for step, g in enumerate(grads_seq, start=1):
    g = {k: np.asarray(v, np.float64) for k, v in g.items()}
    norm = np.sqrt(sum((v**2).sum() for v in g.values()))
    scale = min(1.0, cfg["clip_norm"] / norm)
    lr = float(s(step - 1))
    for k in p:
      gk = g[k] * scale
      mu[k] = cfg["b1"] * mu[k] + (1 - cfg["b1"]) * gk
      nu[k] = cfg["b2"] * nu[k] + (1 - cfg["b2"]) * gk**2
      mh, nh = mu[k] / (1 - cfg["b1"]**step), nu[k] / (1 - cfg["b2"]**step)
      wd = cfg["weight_decay"] if p[k].ndim >= 2 else 0.0      # matrices only
      p[k] = p[k] - lr * (mh / (np.sqrt(nh) + cfg["eps"]) + wd * p[k])
  return p


def test_make_optimizer_matches_numpy_adamw_with_clipping_and_decay_mask():
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(2,)), jnp.float32)}
  # Step sizes differ by 100x so clipping changes Adam's moments (Adam alone is scale-free).
  grads_seq = [{k: jnp.asarray(rng.normal(size=v.shape) * s, jnp.float32)
                for k, v in params.items()} for s in (30.0, 0.3, 3.0, 0.03)]
  tx = optim.make_optimizer(**OPT)

  @jax.jit
  def run(params, grads_seq):
    state, p = tx.init(params), params
    for g in grads_seq:
      u, state = tx.update(g, state, p)
      p = jax.tree.map(lambda a, b: a + b, p, u)
    return p

  p = run(params, grads_seq)
  ref = _numpy_adamw(params, grads_seq, OPT)
  for k in params:
    np.testing.assert_allclose(np.asarray(p[k]), ref[k], rtol=2e-5, atol=1e-6, err_msg=k)
  assert not np.allclose(ref["w"], _numpy_adamw(params, grads_seq, {**OPT, "clip_norm": 1e9})["w"])


def test_make_optimizer_rejects_bad_config():
  for key, bad in (("warmup_steps", 7), ("min_lr_ratio", 1.5), ("clip_norm", 0.0), ("lr", -1e-3),
                   ("b2", 1.0)):
    with pytest.raises(ValueError, match=key):
      optim.make_optimizer(**{**OPT, key: bad})


def test_lr_zero_freezes_the_parameters_exactly():
  # The frozen-policy control run: AdamW with weight decay and clipping must leave every
  # parameter bitwise unchanged, and the schedule count still moves.
  tx = optim.make_optimizer(**{**OPT, "lr": 0.0})
  params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.arange(4.0)}
  state = tx.init(params)
  p = params
  for i in range(3):
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.5 + i), params)
    updates, state = tx.update(grads, state, p)
    p = optax.apply_updates(p, updates)
  for k in params:
    assert np.asarray(p[k]).tobytes() == np.asarray(params[k]).tobytes(), k


# --- accumulation -----------------------------------------------------------------------------
B, T, V, C = 8, 5, 4, 3


def _policy_batch():
  rng = np.random.default_rng(1)
  # Ragged, with an empty row: per-microbatch token AND sequence counts differ.
  lengths = np.array([5, 1, 2, 5, 3, 0, 4, 2])
  rm = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
  theta = jnp.asarray(rng.normal(size=(C, V)), jnp.float32)
  batch = dict(ctx=jnp.asarray(rng.integers(0, C, (B, T))),
               tok=jnp.asarray(rng.integers(0, V, (B, T))),
               advantages=jnp.asarray(rng.normal(size=(B,)), jnp.float32),
               response_mask=jnp.asarray(rm),
               seq_mask=jnp.asarray([1, 1, 0, 1, 1, 1, 0, 1], jnp.float32))
  batch["logp_roll"] = _logp(theta + 0.3 * rng.normal(size=(C, V)), batch)
  return theta, batch


def _logp(theta, b):
  return jnp.take_along_axis(jax.nn.log_softmax(theta)[b["ctx"]], b["tok"][..., None], -1)[..., 0]


def _loss_fn(objective, loss_agg):
  def loss_fn(theta, b, normalizer):
    extra = {"ppo_clip": dict(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=3.0),
             "gspo": dict(clip_eps_low=3e-4, clip_eps_high=4e-4),
             "cispo": dict(clip_eps_low=1.0, clip_eps_high=4.0)}.get(objective, {})
    return obj.compute_loss(objective, logp_theta=_logp(theta, b), logp_roll=b["logp_roll"],
                            advantages=b["advantages"], response_mask=b["response_mask"],
                            seq_mask=b["seq_mask"], loss_agg=loss_agg, normalizer=normalizer,
                            max_len=T if loss_agg.endswith("norm") else None, **extra)
  return loss_fn


@pytest.mark.parametrize("objective,loss_agg",
                         [("trm_surrogate", m) for m in obj.LOSS_AGG_MODES]
                         + [("ppo_clip", "token-mean"), ("gspo", "seq-mean-token-mean"),
                            ("cispo", "token-mean")])
def test_accumulation_equals_one_big_batch(objective, loss_agg):
  theta, batch = _policy_batch()
  vg = jax.value_and_grad(_loss_fn(objective, loss_agg), has_aux=True)
  n = obj.loss_normalizer(batch["response_mask"], loss_agg=loss_agg,
                          max_len=T if loss_agg.endswith("norm") else None)

  (loss_big, _), g_big = vg(theta, batch, None)        # normaliser from the whole batch

  def both(p, mb, n):
    # Gradient with the global normaliser, and (what it prevents) with the microbatch's own.
    (loss, aux), g = vg(p, mb, n)
    return (loss, aux), (g, vg(p, mb, None)[1])

  # 4 microbatches of 2 rows: tokens 6, 7, 3, 6 and sequences 2, 2, 1, 2.
  loss, (g, g_naive), aux = jax.jit(lambda th, b, n: optim.accumulate_gradients(
      both, th, b, num_microbatches=4, normalizer=n))(theta, batch, n)
  np.testing.assert_allclose(float(loss), float(loss_big), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(g), np.asarray(g_big), rtol=1e-6, atol=1e-7)
  assert set(aux) >= {"loss", "seq_kept_frac"}
  assert np.abs(np.asarray(g_big)).max() > 1e-3
  # The check above can fail: averaging locally normalised microbatches is wrong in every mode.
  assert np.abs(np.asarray(g_naive / 4 - g_big)).max() > 1e-4


def test_accumulation_rejects_bad_split():
  theta, batch = _policy_batch()
  vg = jax.value_and_grad(_loss_fn("trm_surrogate", "token-mean"), has_aux=True)
  with pytest.raises(ValueError, match="num_microbatches=3"):
    optim.accumulate_gradients(vg, theta, batch, num_microbatches=3, normalizer=1.0)
  with pytest.raises(ValueError, match="seq_mask"):
    optim.accumulate_gradients(vg, theta, {**batch, "seq_mask": jnp.ones((B + 1,))},
                               num_microbatches=2, normalizer=1.0)


# --- non-finite guard -------------------------------------------------------------------------
def test_apply_if_finite_skips_non_finite_and_applies_finite():
  params = {"w": jnp.ones((2, 2)), "b": jnp.zeros((2,))}
  tx = optim.make_optimizer(**{**OPT, "warmup_steps": 0})
  state = tx.init(params)
  step = jax.jit(lambda p, s, g, l: optim.apply_if_finite(tx, p, s, g, l))
  good = {"w": jnp.full((2, 2), 0.5), "b": jnp.ones((2,))}

  p1, s1, ok = step(params, state, good, jnp.float32(1.0))
  u, s_ref = jax.jit(tx.update)(good, state, params)
  assert bool(ok)
  np.testing.assert_array_equal(np.asarray(p1["w"]), np.asarray(params["w"] + u["w"]))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), s1, s_ref)

  for grads, loss in (({**good, "b": jnp.asarray([0.0, jnp.nan])}, 1.0),
                      ({**good, "w": good["w"].at[0, 1].set(jnp.inf)}, 1.0),
                      (good, jnp.nan)):
    p2, s2, ok = step(p1, s1, grads, jnp.float32(loss))
    assert not bool(ok)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 (p2, s2), (p1, s1))
