"""MoE routing replay: the sampler records which experts every token ran through, the learner
runs exactly those (gated by its own router probabilities, so the router still learns).

With an fp32 sampler, no logit noise and router jitter sigma = 0.5 (the TRM paper's routing
flips, App. A.2), replay makes the learner's log-probs of the sampled tokens equal the
rollout's to 1e-5 on every row; without it the same rollouts carry flip-induced divergence
spikes. Replaying the router's own choice is bitwise the plain forward. Also on an 8-device
mesh, and together with SMD's eviction replay.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prompt_fixtures import left_padded_prompts
from trm_jax import sharding as shd
from trm_jax.kernels import Visibility
from model_fixtures import make_test_model
from trm_jax.rollout import CacheConfig, generate

MOE = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=32, norm_topk_prob=True)
SIGMA = 0.5
P, R = 12, 16


def _moe_model(seed: int = 0):
  """The tiny MoE test model with weights drawn N(0, 0.15^2) instead of 0.02^2 (norms stay 1),
  so logits spread over O(1) and an expert flip changes the next-token distribution visibly,
  as in a trained model."""
  model = make_test_model(seed=seed, **MOE)
  rng = np.random.default_rng(seed)
  for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    if "norm" not in "/".join(map(str, path)):
      v.set_value(jnp.asarray(0.15 * rng.standard_normal(v.get_value().shape), jnp.float32))
  return model


def _rollout(model, *, cache=CacheConfig(), seed=0, B=6):
  lens = np.random.default_rng(seed).integers(3, P + 1, B).astype(np.int32)
  ids = left_padded_prompts(lens, P, seed=seed)
  return generate(model, ids, lens, max_new_tokens=R, key=jax.random.key(seed),
                  router_noise_scale=SIGMA, record_routing=True, keep_full_logprobs=True,
                  cache=cache)


@nnx.jit(static_argnames=("replay", "evict"))
def _learner_logp(model, ro, replay: bool, evict: bool = False):
  """Teacher-forced log-probs [B, T] of the rollout's tokens (token t scored at t - 1) and
  their full distributions."""
  vis = Visibility(segment_ids=ro.segment_ids, evicted_at=ro.evicted_at if evict else None)
  logits = model(ro.tokens, visibility=vis, routing=ro.routed_experts if replay else None)
  logq = jax.nn.log_softmax(logits, axis=-1)[:, :-1]                  # predicts t + 1
  lp = jnp.take_along_axis(logq, ro.tokens[:, 1:, None], axis=-1)[..., 0]
  return jnp.pad(lp, ((0, 0), (1, 0))), jnp.pad(logq, ((0, 0), (1, 0), (0, 0)))


def _gap(ro, lp):
  m = np.asarray(ro.response_mask) > 0
  return np.abs(np.asarray(lp) - np.asarray(ro.logp))[m], m


def _max_token_kl(ro, logq):
  """max over response tokens of KL(pi_roll || pi_theta), from the rollout's full log-probs."""
  roll = np.asarray(ro.full_logp)
  p = np.exp(roll)
  kl = np.sum(np.where(p > 0, p * (roll - np.asarray(logq)), 0.0), axis=-1)
  return float(kl[np.asarray(ro.response_mask) > 0].max())


def test_replay_equals_the_sampler_and_no_replay_shows_the_flips():
  model = _moe_model()
  ro = _rollout(model)
  L_moe = model.config.num_layers
  assert ro.routed_experts.shape == (6, L_moe, P + R, 2)
  assert ro.routed_experts.dtype == jnp.int8        # E = 4 <= 127: one byte per choice
  assert ro.routed_experts.nbytes == 6 * L_moe * (P + R) * 2
  rec = np.asarray(ro.routed_experts)
  assert (rec[:, :, :-1] >= 0).all() and (rec[:, :, -1] == -1).all()

  lp, logq = _learner_logp(model, ro, True)
  gap, m = _gap(ro, lp)
  assert gap.max() <= 1e-5, gap.max()
  for b in range(m.shape[0]):                       # every row, not just on average
    assert np.abs(np.asarray(lp)[b] - np.asarray(ro.logp)[b])[m[b]].max() <= 1e-5

  lp0, logq0 = _learner_logp(model, ro, False)
  gap0, _ = _gap(ro, lp0)
  kl_replay, kl_plain = _max_token_kl(ro, logq), _max_token_kl(ro, logq0)
  assert kl_replay < 1e-6 and kl_plain > 1e-2, (kl_replay, kl_plain)
  assert gap0.max() > 1e-2


def test_replaying_the_routers_own_choice_is_the_plain_forward_and_trains_the_router():
  model = _moe_model()
  lens = np.array([5, 12, 9], np.int32)
  tokens = jnp.asarray(left_padded_prompts(lens, P))
  vis = Visibility.from_lengths(jnp.asarray(lens), P, left_pad=True)

  @nnx.jit
  def own_and_forwards(model):
    _, routing = model.hidden_states(tokens, visibility=vis, with_routing=True)
    return (routing.own, model(tokens, visibility=vis),
            model(tokens, visibility=vis, routing=routing.own))
  own, plain, replayed = own_and_forwards(model)
  np.testing.assert_array_equal(np.asarray(replayed), np.asarray(plain))   # bitwise

  graphdef, params = nnx.split(model, nnx.Param)

  def loss(params):
    logits = nnx.merge(graphdef, params)(tokens, visibility=vis, routing=own)
    return jnp.sum(jax.nn.log_softmax(logits)[..., 0])
  grads = jax.grad(loss)(params)
  for l in range(model.config.num_layers):
    g = np.asarray(grads["layers"][l]["mlp"]["router"][...])
    assert np.abs(g).max() > 0, f"layer {l}: no gradient reaches the router"


def test_a_dense_model_refuses_routing():
  dense = make_test_model()
  tokens = jnp.zeros((2, 5), jnp.int32)
  with pytest.raises(ValueError, match="routing replay needs MoE layers; this qwen3 model has "
                     "none"):
    dense(tokens, routing=jnp.zeros((2, 1, 5, 2), jnp.int8))
  moe = _moe_model()
  with pytest.raises(ValueError, match=r"expected \[B, L_moe, T, k\] = \(2, 2, 5, 2\)"):
    moe(tokens, routing=jnp.zeros((2, 2, 5, 3), jnp.int8))
  lens = np.array([3, 4], np.int32)
  ids = left_padded_prompts(lens, 5)
  with pytest.raises(ValueError, match="record_routing=True needs a model with MoE layers"):
    generate(dense, ids, lens, max_new_tokens=2, key=jax.random.key(0), record_routing=True)


def test_replay_on_an_8_device_mesh():
  mesh = shd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  model = shd.shard_model(_moe_model(), mesh)
  with jax.set_mesh(mesh):
    ro = _rollout(model, B=8)
    lp, _ = _learner_logp(model, ro, True)
  gap, _ = _gap(ro, lp)
  assert gap.max() <= 1e-5, gap.max()
  ref = _rollout(_moe_model(), B=8)        # the same rollout on one device
  np.testing.assert_array_equal(np.asarray(ro.routed_experts), np.asarray(ref.routed_experts))


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_routing_and_eviction_replayed_together(policy):
  """SMD's shadow mask (evicted_at) and routing replay compose: the learner equals the
  sampler exactly only with both."""
  model = _moe_model()
  ro = _rollout(model, cache=CacheConfig(policy=policy, ratio=0.5))
  both, _ = _learner_logp(model, ro, True, True)
  gap, _ = _gap(ro, both)
  assert gap.max() <= 1e-5, gap.max()
  for replay, evict in ((True, False), (False, True)):
    lp, _ = _learner_logp(model, ro, replay, evict)
    assert _gap(ro, lp)[0].max() > 1e-3, (replay, evict)


def _trainer_step(routing_replay: bool):
  """One trainer step (trm_jax.step) on the MoE model under router jitter: fp32 sampler, no
  logit noise, TRM-max with exact KL from the rollout's full log-probs."""
  import os  # pylint: disable=g-import-not-at-top
  from trm_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from trm_jax import step as step_lib  # pylint: disable=g-import-not-at-top
  from trm_jax import train  # pylint: disable=g-import-not-at-top
  from trm_jax.data import Task, make_synthetic_tokenizer  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  c = config_lib.load_config(train.DEFAULT_CONFIG)
  c.rl.batch_size, c.rl.group_size, c.total_steps = 8, 4, 1
  c.rollout.dtype, c.rollout.logit_noise, c.rollout.router_noise = "float32", 0.0, SIGMA
  c.rollout.routing_replay = routing_replay
  c.task.synthetic.max_operands, c.task.synthetic.max_value = 3, 9
  c.trm.delta = 1e-3
  tok = make_synthetic_tokenizer(os.path.join(tempfile.mkdtemp(), "tok"))
  mesh, _ = train.make_mesh(c)
  with jax.set_mesh(mesh):
    model = shd.shard_model(_moe_model(), mesh)
    task = Task(c.task, seed=0, tokenizer=tok, eval_problems=0)
    ctx, state = step_lib.make_context(c, mesh, model, tok, task)
    return step_lib.rl_step(ctx, state)[1]


def test_trainer_replays_routing_and_trm_sees_only_what_remains():
  with_replay, without = _trainer_step(True), _trainer_step(False)
  assert with_replay["trm/delta_hat"] < 1e-6, with_replay["trm/delta_hat"]   # max token KL
  assert with_replay["trm/reject_rate"] == 0.0
  assert 0.05 < with_replay["moe/replay_flip_rate"] < 1.0
  assert without["trm/delta_hat"] > 1e-2 and without["trm/reject_rate"] > 0
  assert "moe/replay_flip_rate" not in without


def test_routing_replay_needs_an_moe_model():
  from trm_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from trm_jax import step as step_lib  # pylint: disable=g-import-not-at-top
  from trm_jax import train  # pylint: disable=g-import-not-at-top
  c = config_lib.load_config(train.DEFAULT_CONFIG)
  c.rollout.routing_replay = True

  class _Task:
    max_new_tokens, max_prompt_len = 4, 4

    def eval_problems(self, n):
      return [None] * n
  mesh, _ = train.make_mesh(c)
  with pytest.raises(config_lib.ConfigError) as e:
    step_lib.make_context(c, mesh, make_test_model(), None, _Task())
  assert str(e.value) == ("bad config value [rollout.routing_replay]: routing replay needs MoE "
                          "layers; this qwen3 model has none")
