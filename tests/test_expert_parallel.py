"""Expert parallelism (`mesh.expert`): with the experts split over 2, 4 and 8 simulated CPU
devices, every result equals the replicated layout's to fp32 rounding: the MoE layer's output
and gradients (router jitter, partly replayed routing, bf16, tokens sent in chunks), the
decoder's logits, routing and gradients under remat, a rollout's tokens, log-probs and
recorded experts, the learner's replayed log-probs, and two trainer steps' metrics (rollout,
score, update).

The model's weights are drawn N(0, 0.15^2) (as in test_routing_replay) so that router
probabilities are far apart: a top-k near-tie could flip on a rounding difference between
layouts, which would say nothing about the dispatch.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from model_fixtures import make_test_model
from prompt_fixtures import left_padded_prompts
from trm_jax import sharding as shd
from trm_jax.kernels import Visibility
from trm_jax.models import expert_parallel

MOE = dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=32, norm_topk_prob=True)
# (mesh.expert, the other axes): every expert split 2, 4 and 8 ways, beside data, fsdp and
# tensor axes (tensor splits each expert's F, whose partial sums the layer adds).
MESHES = [dict(expert=2, data=2, fsdp=2), dict(expert=4, tensor=2), dict(expert=8)]
IDS = ["expert2_data2_fsdp2", "expert4_tensor2", "expert8"]


def _model(seed: int = 0, **overrides):
  model = make_test_model(seed=seed, **MOE, **overrides)
  rng = np.random.default_rng(seed)
  for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    if "norm" not in "/".join(map(str, path)):
      v.set_value(jnp.asarray(0.15 * rng.standard_normal(v.get_value().shape),
                              v.get_value().dtype))
  return model


def _close(got, want, rtol=2e-5, atol=2e-6):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * max(1.0, np.abs(b).max()))


def test_padded_exchange_follows_the_ragged_all_to_all_contract():
  """The CPU transport against the example of `jax.lax.ragged_all_to_all`'s docstring."""
  mesh = shd.make_mesh({"expert": 2}, jax.devices()[:2])
  args = [np.array(a, np.int32) for a in (
      [[1, 2, 2], [3, 4, 0]], [[0] * 4, [0] * 4], [[0, 1], [0, 1]], [[1, 2], [1, 1]],
      [[0, 0], [1, 2]], [[1, 1], [2, 1]])]

  def local(*a):
    a = [x[0] for x in a]
    return expert_parallel.ragged_all_to_all_padded(*a, axis_name=shd.EXPERT, capacity=2)[None]
  got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(shd.EXPERT), out_specs=P(shd.EXPERT)))(
      *args)
  np.testing.assert_array_equal(np.asarray(got), [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_megablox_matmul_equals_ragged_dot():
  """The TPU grouped matmul (Pallas megablox, here in the interpreter) in the experts' SwiGLU
  against ragged_dot: the grouped rows' outputs and every gradient, with rows past the groups
  (which the layer never reads) and an empty group."""
  layer = _model().layers[0].mlp
  rng = np.random.default_rng(3)
  sizes = jnp.asarray([7, 0, 12, 11], jnp.int32)                     # 30 rows of 40
  xs = jnp.asarray(rng.standard_normal((40, 64)), jnp.float32)
  w = [p[...][:4] for p in (layer.gate_proj, layer.up_proj, layer.down_proj)]
  dy = jnp.asarray(rng.standard_normal((40, 64)), jnp.float32).at[30:].set(0.0)

  def run(matmul):
    y, vjp = jax.vjp(lambda xs, *w: layer.ffn(xs, sizes, *w, matmul=matmul), xs, *w)
    dx, *dw = vjp(dy)
    return y[:30], dx[:30], dw
  want = jax.jit(lambda: run(None))()
  got = jax.jit(lambda: run(expert_parallel.grouped_matmul("cpu", interpret=True)))()
  _close(got, want)


def _layer_and_grads(model, x, routing, key):
  """The first MoE layer on x [B, T, D] with jitter and a partly replayed routing: output and
  gradients with respect to x and every parameter of the layer."""
  graphdef, params = nnx.split(model.layers[0].mlp, nnx.Param)

  def loss(params, x):
    y = nnx.merge(graphdef, params)(x, key, 0.5, routing=routing)
    return jnp.sum(jnp.sin(y.astype(jnp.float32))), y
  (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
  return y, grads


def _decoder(model, tokens, vis, key):
  """Logits, routing (chosen and own) and parameter gradients of the whole decoder."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params):
    m = nnx.merge(graphdef, params, rest)
    h, routing = m.hidden_states(tokens, visibility=vis, router_noise_key=key,
                                 router_noise_scale=0.5, with_routing=True)
    logits = m.unembed(h)
    return jnp.sum(jax.nn.log_softmax(logits)[..., 5]), (logits, routing)
  (_, (logits, routing)), grads = jax.value_and_grad(loss, has_aux=True)(params)
  return logits, routing, grads


@pytest.mark.parametrize("sizes", MESHES, ids=IDS)
def test_layer_and_decoder_equal_the_replicated_layout(sizes):
  B, T = 4, 6
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((B, T, 64)), jnp.float32)
  # Replay two rows' experts, leave the others to the (jittered) router.
  routing = jnp.asarray(np.where(np.arange(B)[:, None, None] < 2,
                                 rng.permuted(np.tile(np.arange(8), (B, T, 1)), axis=-1)[..., :2],
                                 -1), jnp.int32)
  lens = np.array([6, 3, 5, 4], np.int32)
  tokens = jnp.asarray(left_padded_prompts(lens, T))
  vis = Visibility.from_lengths(jnp.asarray(lens), T, left_pad=True)
  key = jax.random.key(3)
  layer, decoder = jax.jit(_layer_and_grads), jax.jit(_decoder)
  model = _model(remat=True)
  want_layer, want_dec = layer(model, x, routing, key), decoder(model, tokens, vis, key)
  mesh = shd.make_mesh(sizes)
  # 2 tokens per exchange: every device (3 or 6 tokens) sends its tokens in chunks.
  sharded = shd.shard_model(_model(remat=True, moe_chunk=2), mesh)
  gate = sharded.layers[0].mlp.gate_proj[...]
  assert gate.sharding.spec[0] == shd.EXPERT
  assert {s.data.shape[0] for s in gate.addressable_shards} == {8 // sizes["expert"]}
  with jax.set_mesh(mesh):
    got_layer, got_dec = layer(sharded, x, routing, key), decoder(sharded, tokens, vis, key)
  _close(got_layer, want_layer)
  (logits, routing_got, grads), (logits0, routing_want, grads0) = got_dec, want_dec
  _close(logits, logits0)
  np.testing.assert_array_equal(np.asarray(routing_got.chosen), np.asarray(routing_want.chosen))
  np.testing.assert_array_equal(np.asarray(routing_got.own), np.asarray(routing_want.own))
  _close(grads, grads0)


def test_bf16_layer_equals_the_replicated_layout():
  """In bf16 the pairs travel and are multiplied in bf16 exactly as on one device."""
  x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 6, 64)), jnp.bfloat16)
  model = _model(dtype="bfloat16", param_dtype="bfloat16")
  layer = jax.jit(_layer_and_grads)
  want = layer(model, x, None, jax.random.key(0))
  mesh = shd.make_mesh({"expert": 4, "data": 2})
  with jax.set_mesh(mesh):
    got = layer(shd.shard_model(_model(dtype="bfloat16", param_dtype="bfloat16"), mesh), x, None,
                jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
  _close(got[1], want[1], rtol=2e-2, atol=2e-2)


def test_layer_with_the_tpu_grouped_matmul_equals_the_replicated_layout(monkeypatch):
  """The TPU composition, the megablox kernel (in the Pallas interpreter) inside the layer's
  shard_map over 4 devices: output and gradients as the replicated layout's."""
  grouped_matmul = expert_parallel.grouped_matmul
  monkeypatch.setattr(expert_parallel, "grouped_matmul",
                      lambda platform: grouped_matmul(platform, interpret=True))
  x = jnp.asarray(np.random.default_rng(4).standard_normal((4, 6, 64)), jnp.float32)
  layer = jax.jit(_layer_and_grads)
  want = layer(_model(), x, None, jax.random.key(0))
  mesh = shd.make_mesh({"expert": 4}, jax.devices()[:4])
  with jax.set_mesh(mesh):
    got = layer(shd.shard_model(_model(), mesh), x, None, jax.random.key(0))
  _close(got, want)


def _train(sizes, steps: int = 2):
  """`steps` trainer steps (trm_jax.step) of the MoE model with router jitter and routing
  replay on the 8-device mesh `sizes`: (the first rollout, the score pass's replayed
  log-probs of it, each step's metrics). The reward is the response's share of even token
  ids, so that GRPO advantages (and the updates) are not zero for a random model."""
  import os  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  from trm_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from trm_jax import step as step_lib  # pylint: disable=g-import-not-at-top
  from trm_jax import train  # pylint: disable=g-import-not-at-top
  from trm_jax.data import Task, make_synthetic_tokenizer  # pylint: disable=g-import-not-at-top
  c = config_lib.load_config(train.DEFAULT_CONFIG)
  c.rl.batch_size, c.rl.group_size, c.total_steps = 8, 4, steps
  c.rollout.dtype, c.rollout.logit_noise, c.rollout.router_noise = "float32", 0.0, 0.5
  c.rollout.routing_replay = True
  c.task.synthetic.max_operands, c.task.synthetic.max_value = 3, 9
  for axis in shd.MESH_AXES:
    c.mesh[axis] = sizes.get(axis, 1)
  c.optim.eps = 1e-3   # as test_train_sharding: a rounding-level gradient moves no weight a step
  tok = make_synthetic_tokenizer(os.path.join(tempfile.mkdtemp(), "tok"))
  mesh, _ = train.make_mesh(c)
  config_lib.check_batch_mesh(c, mesh)
  metrics = []
  with pytest.MonkeyPatch.context() as mp, jax.set_mesh(mesh):
    mp.setattr(step_lib, "rewards_of", lambda ctx, ro, problems, ids, **_: {"reward": np.mean(
        np.asarray(ro.tokens)[:, ctx.task.max_prompt_len:] % 2 == 0, axis=1).astype(np.float32)})
    model = shd.shard_model(_model(), mesh)
    task = Task(c.task, seed=0, tokenizer=tok, eval_problems=0)
    ctx, state = step_lib.make_context(c, mesh, model, tok, task)
    state.pending = step_lib.dispatch_rollout(ctx, state)    # the step's own rollout
    ro = jax.tree.map(np.asarray, state.pending.ro)
    replayed = np.asarray(step_lib.score_rollout(ctx, state.params, state.pending.ro)[0].logp_old)
    for _ in range(steps):
      state, m = step_lib.rl_step(ctx, state)
      metrics.append(m)
  return ro, replayed, metrics


@pytest.fixture(scope="module")
def replicated():
  return _train(dict(data=8))


@pytest.mark.slow
@pytest.mark.parametrize("sizes", MESHES, ids=IDS)
def test_trainer_equals_the_replicated_layout(replicated, sizes):
  """The sampler's prefill and decode steps (router jitter, routing record), the learner's
  score with routing replay and two updates: tokens and experts identical, log-probs and
  every metric to fp32 rounding."""
  (ro0, replayed0, want), (ro, replayed, got) = replicated, _train(sizes)
  np.testing.assert_array_equal(ro.tokens, ro0.tokens)
  np.testing.assert_array_equal(ro.routed_experts, ro0.routed_experts)
  _close(ro.logp, ro0.logp)
  _close(replayed, replayed0)
  m = ro.response_mask > 0   # replay is exact under the mesh: pi_theta's log-probs = pi_roll's
  np.testing.assert_allclose(replayed[m], ro.logp[m], atol=1e-5)
  assert want[0]["moe/replay_flip_rate"] > 0 and want[0]["moe/expert_load_max_over_mean"] > 1
  assert want[1]["learner/skipped"] == 0 and want[1]["learner/grad_norm"] > 0
  # Replayed, the rollout/learner mismatch is rounding-level: its divergences, TRM bounds and
  # monitors (1e-5 and below here) are rounding noise themselves and compare absolutely.
  for w, g in zip(want, got):
    assert set(w) == set(g)
    for k, v in w.items():
      if not k.startswith(("time/", "sync/", "throughput/")):
        assert g[k] == pytest.approx(v, rel=1e-4, abs=1e-4), k


def test_expert_axis_is_refused_unless_it_divides_the_experts():
  from trm_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from trm_jax import programs, train  # pylint: disable=g-import-not-at-top
  c = config_lib.load_config("tiny_moe_mismatch")
  c.mesh.data, c.mesh.expert = -1, 3
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c)
  assert str(e.value) == ("bad config value [mesh.expert]: mesh.expert=3 does not divide the "
                          "model's 8 experts (each device of an expert group holds "
                          "num_experts / mesh.expert of them)")
  c.mesh.expert = 0
  with pytest.raises(config_lib.ConfigError, match=r"^bad config value \[mesh.expert\]: must "
                     "be an integer >= 1"):
    config_lib.validate(c)
  # Resolved from -1 (here 8 devices) against a model of 4 experts: refused where the
  # programs are built, for the trainer and trm_jax.aot alike.
  c.mesh.data, c.mesh.expert = 1, -1
  mesh, _ = train.make_mesh(c)
  model = nnx.eval_shape(lambda: make_test_model(**dict(MOE, num_experts=4)))
  with pytest.raises(config_lib.ConfigError, match=r"^bad config value \[mesh.expert\]: "
                     "mesh.expert=8 does not divide the model's 4 experts"):
    programs.build(c, model, mesh, None, programs.Sizes(P=4, R=4))
