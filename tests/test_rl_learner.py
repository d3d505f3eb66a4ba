"""The learner step end to end on a tiny model: on-policy scoring, exact microbatch
accumulation, scoring in row groups, an all-masked batch is a no-op, the reference-policy KL is wired, and a batch
that gets one update is scored inside it (`make_score_update`) as the two passes would."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from model_fixtures import make_test_model
from trm_jax.rl.learner import LearnerBatch, LearnerConfig, make_learner
from trm_jax.rollout import generate

B, P, N = 8, 10, 8


@pytest.fixture(scope="module")
def setup():
  model = make_test_model(vocab_size=64)
  prompts = jax.random.randint(jax.random.key(0), (B, P), 3, 64)
  lens = jnp.array([10, 7, 4, 10, 9, 5, 10, 8])
  ro = generate(model, prompts, lens, max_new_tokens=N, key=jax.random.key(1),
                keep_full_logprobs=True, eos_ids=())
  resp = ro.response_mask.astype(jnp.float32)
  adv = jnp.asarray(np.random.default_rng(0).normal(size=B), jnp.float32)
  batch = LearnerBatch(tokens=ro.tokens, segment_ids=ro.segment_ids, response_mask=resp,
                       logp_roll=ro.logp, advantages=adv, logp_old=ro.logp,
                       token_weights=jnp.ones_like(resp), roll_logp_full=ro.full_logp)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return graphdef, params, rest, batch


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def test_on_policy_scoring_keeps_everything(setup):
  graphdef, params, rest, batch = setup
  cfg = LearnerConfig(criteria=("trm_max_kl", "k3_avg"),
                      thresholds=(("delta", 1e-6), ("delta_k3", 1e-6)))
  score, _ = make_learner(graphdef, optax.sgd(0.1), cfg, response_start=P)
  logp, _, seq_mask, m = score(params, rest, batch)
  mask = batch.response_mask
  np.testing.assert_allclose(np.asarray(logp * mask), np.asarray(batch.logp_roll * mask),
                             atol=1e-5)
  assert float(m["trm/reject_rate"]) == 0.0 and np.all(np.asarray(seq_mask) == 1.0)
  assert abs(float(m["trm/ppl_gap"])) < 1e-5


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_microbatch_accumulation_equals_one_batch(setup, loss_agg):
  graphdef, params, rest, batch = setup
  tx = optax.sgd(0.5)
  out = []
  for n_micro in (1, 4):
    cfg = LearnerConfig(loss_agg=loss_agg, num_microbatches=n_micro)
    _, update = make_learner(graphdef, tx, cfg, response_start=P)
    p = _copy(params)
    new, _, _ = update(p, tx.init(p), rest, batch)
    out.append(new)
  moved = max(float(jnp.max(jnp.abs(a - b)))
              for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(params)))
  assert moved > 1e-4                                    # the step did something
  for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_all_masked_batch_is_a_noop(setup):
  graphdef, params, rest, batch = setup
  tx = optax.adamw(1e-2, weight_decay=0.1)    # weight decay would move params on zero grads
  cfg = LearnerConfig(criteria=("k3_avg",), thresholds=(("delta_k3", -1.0),))
  _, update = make_learner(graphdef, tx, cfg, response_start=P)
  p = _copy(params)
  opt = tx.init(p)
  opt_before = _copy(opt)
  new, new_opt, aux = update(p, opt, rest, batch)
  assert float(aux["learner/kept_seqs"]) == 0.0
  assert all(np.isfinite(float(v)) for v in aux.values())
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(jax.tree.leaves(new_opt), jax.tree.leaves(opt_before)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_reference_kl_is_wired(setup):
  graphdef, params, rest, batch = setup
  tx = optax.sgd(0.1)
  cfg = LearnerConfig(kl_beta=0.5)
  score, update = make_learner(graphdef, tx, cfg, response_start=P)
  with pytest.raises(ValueError, match="logp_ref"):
    update(_copy(params), tx.init(params), rest, batch)
  # Reference = a perturbed copy of the policy: the penalty is positive and changes the step.
  ref = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(3), x.shape), params)
  logp_ref = score(ref, rest, batch)[0]
  b = batch.replace(logp_ref=logp_ref)
  new_kl, _, aux = update(_copy(params), tx.init(params), rest, b)
  _, update0 = make_learner(graphdef, tx, LearnerConfig(), response_start=P)
  new_0, _, _ = update0(_copy(params), tx.init(params), rest, b)
  kl_keys = [k for k in aux if "kl" in k and "distill" not in k]
  assert kl_keys and any(float(aux[k]) > 0 for k in kl_keys), aux.keys()
  diff = max(float(jnp.max(jnp.abs(a - c)))
             for a, c in zip(jax.tree.leaves(new_kl), jax.tree.leaves(new_0)))
  assert diff > 1e-6


def _assert_same_score(a, b):
  logp, weights, seq_mask, metrics = a
  logp_g, weights_g, seq_mask_g, metrics_g = b
  np.testing.assert_allclose(np.asarray(logp_g), np.asarray(logp), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(seq_mask_g), np.asarray(seq_mask))
  np.testing.assert_allclose(np.asarray(weights_g), np.asarray(weights), atol=1e-6)
  assert metrics_g.keys() == metrics.keys()
  for k in metrics:
    np.testing.assert_allclose(np.asarray(metrics_g[k]), np.asarray(metrics[k]), rtol=1e-4,
                               atol=1e-6, err_msg=k)


def test_scoring_in_row_groups_is_scoring_the_batch(setup, groups=4):
  """`score_microbatches`: the forward over groups of rows in turn gives the one-group pass's
  log-probs, token weights, TRM mask and metrics (the mask and metrics see the whole batch), on
  a policy that has moved from pi_roll so that TRM rejects some sequences."""
  graphdef, params, rest, batch = setup
  moved = jax.tree.map(lambda x: x + 0.02 * jax.random.normal(jax.random.key(5), x.shape),
                       params)
  kw = dict(mode="sparse_rl", criteria=("trm_max_kl",), thresholds=(("delta", 0.036),))
  one, _ = make_learner(graphdef, optax.sgd(0.1), LearnerConfig(**kw), response_start=P)
  grouped, _ = make_learner(graphdef, optax.sgd(0.1),
                            LearnerConfig(**kw, score_microbatches=groups), response_start=P)
  ref = one(moved, rest, batch)
  assert 0 < float(ref[3]["trm/reject_rate"]) < 1
  _assert_same_score(ref, grouped(moved, rest, batch))
  with pytest.raises(ValueError, match="score_microbatches=3 must divide the batch's 8 rows"):
    make_learner(graphdef, optax.sgd(0.1), LearnerConfig(**kw, score_microbatches=3),
                 response_start=P)[0](moved, rest, batch)


def test_scoring_in_row_groups_replays_routing_and_eviction_on_a_mesh():
  """The same with every per-row input the scoring pass reads (the experts an MoE model's
  rollout ran, replayed; SMD's eviction record) and the batch's rows split over 8 devices."""
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  model = make_test_model(seed=1, vocab_size=64, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, model_type="qwen3_moe")
  cfg = model.config
  rng = np.random.default_rng(3)
  T = P + N
  tokens = jnp.asarray(rng.integers(3, 64, (B, T)), jnp.int32)
  resp = jnp.asarray(np.arange(T)[None] >= P, jnp.float32) * jnp.ones((B, 1))
  never = 2 ** 30                  # a key never evicted; others at a random decode step
  evicted = np.where(rng.random((B, cfg.num_layers, cfg.num_kv_heads, T)) < 0.3,
                     rng.integers(P, T, (B, cfg.num_layers, cfg.num_kv_heads, T)), never)
  routed = rng.integers(0, 4, (B, cfg.num_layers, T, 2))
  routed[..., 1] = (routed[..., 0] + 1 + rng.integers(0, 3, routed.shape[:-1])) % 4
  batch = LearnerBatch(tokens=tokens, segment_ids=jnp.ones((B, T), jnp.int32),
                       response_mask=resp,
                       logp_roll=jnp.asarray(-2 * rng.random((B, T)), jnp.float32),
                       advantages=jnp.ones((B,)), logp_old=jnp.zeros((B, T)),
                       token_weights=jnp.ones((B, T)),
                       roll_logp_full=jax.nn.log_softmax(
                           jnp.asarray(rng.standard_normal((B, T, 64)), jnp.float32)),
                       evicted_at=jnp.asarray(evicted, jnp.int32),
                       routed_experts=jnp.asarray(routed, jnp.int8))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
  batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data")))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  kw = dict(mode="smd", mode_kwargs=(("lam", 0.1),), criteria=("trm_max_kl",),
            thresholds=(("delta", 1.0),))
  out = [make_learner(graphdef, optax.sgd(0.1), LearnerConfig(**kw, score_microbatches=m),
                      response_start=P)[0](params, rest, batch) for m in (1, 2)]
  assert 0 < float(out[0][3]["moe/replay_flip_rate"]) < 1
  _assert_same_score(*out)


@pytest.mark.parametrize("objective,mode,baseline", [
    ("ppo_clip", "off", "kept"),               # PPO's ratio against logp_old; the mask's baseline
    ("trm_surrogate", "sparse_rl", "all"),     # token weights; ratio against the learner's own
])
def test_score_update_is_the_score_pass_then_the_update(setup, objective, mode, baseline):
  """One update per batch: `make_score_update` computes what scoring the batch, making the
  advantages from its mask and updating once compute separately (up to fp32 rounding of
  another program), on a policy that has moved from pi_roll so that TRM rejects some
  sequences but not all."""
  import functools  # pylint: disable=g-import-not-at-top
  from trm_jax.rl.advantages import group_advantages  # pylint: disable=g-import-not-at-top
  from trm_jax.rl.learner import make_score_update  # pylint: disable=g-import-not-at-top
  graphdef, params, rest, batch = setup
  moved = jax.tree.map(lambda x: x + 0.02 * jax.random.normal(jax.random.key(5), x.shape),
                       params)
  cfg = LearnerConfig(objective=objective, mode=mode, criteria=("trm_max_kl",),
                      thresholds=(("delta", 0.036),),
                      objective_kwargs=(("clip_eps_low", 0.2), ("clip_eps_high", 0.2),
                                        ("dual_clip_c", 3.0)) if objective == "ppo_clip"
                      else ())
  tx = optax.adam(1e-2)
  advantages = functools.partial(group_advantages, group_size=4, normalize_std=True,
                                 baseline=baseline)
  rewards = jnp.asarray([1, 0, 0, 1, 1, 1, 0, 0], jnp.float32)
  score, update = make_learner(graphdef, tx, cfg, response_start=P)
  logp_old, weights, seq_mask, metrics = score(moved, rest, batch)
  assert 0 < float(metrics["trm/reject_rate"]) < 1     # the mask matters to the advantages
  b = batch.replace(logp_old=logp_old, token_weights=weights,
                    advantages=advantages(rewards, seq_mask=seq_mask))
  if cfg.learner_mode.ratio_to_learner:
    b = b.replace(logp_roll=logp_old)
  new, opt, aux = update(_copy(moved), tx.init(moved), rest, b)
  fused = make_score_update(graphdef, tx, cfg, response_start=P, advantages=advantages)
  new_f, opt_f, aux_f, metrics_f = fused(_copy(moved), tx.init(moved), rest, batch, rewards)
  assert sorted(metrics_f) == sorted(metrics) and sorted(aux_f) == sorted(aux)
  for k in metrics:
    np.testing.assert_allclose(float(metrics_f[k]), float(metrics[k]), rtol=1e-4, atol=1e-6,
                               err_msg=k)
  for k in aux:
    np.testing.assert_allclose(float(aux_f[k]), float(aux[k]), rtol=1e-4, atol=1e-6, err_msg=k)
  step = max(float(jnp.max(jnp.abs(a - c))) for a, c in zip(jax.tree.leaves(new),
                                                            jax.tree.leaves(moved)))
  assert step > 1e-3                                   # the update moved the parameters
  for a, c in zip(jax.tree.leaves(new_f) + jax.tree.leaves(opt_f),
                  jax.tree.leaves(new) + jax.tree.leaves(opt)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-4, atol=1e-6)
