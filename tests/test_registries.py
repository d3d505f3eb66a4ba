"""A new objective, learner mode, cache policy, model family or task is one definition plus a
registration (docs/architecture.md).

The toys below are defined and registered here, in the test file, and nowhere in the package:
  * a cache policy runs through the sampler and the learner: it decides what is evicted, and
    the learner in SMD mode, replaying the rollout's `evicted_at`, scores its tokens with the
    sampler's log-probs (a ratio of 1);
  * the trainer's `rl_step` runs with a toy objective (one setting of its own in `config.rl`)
    and a toy learner mode (SMD's replay and distillation plus token weights of its own) on
    rollouts of the toy cache policy: the config reaches all three through their registry
    entries alone, and the update moves the parameters;
  * a model family (a `models.config.FAMILIES` row with a combination no shipped family has:
    Qwen3's q/k norms with Qwen2's fixed q/k/v biases) goes through a safetensors checkpoint,
    the loader, the sampler, the learner's exact scoring and one `rl_step`;
  * a task with a graded reward (closeness of the answer, exact match as a part) and a check
    hook of its own trains end to end through `train.run`: its rewards reach the advantages,
    its held-out metrics (mean reward and parts, no accuracy or pass@k) reach metrics.jsonl,
    summary.json and the sweep's CSV.
Each fixture removes its entry again, so no other test sees it.
"""
import csv
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from prompt_fixtures import left_padded_prompts
from trm_jax import config as config_lib
from trm_jax import step as step_lib
from trm_jax import programs, sweep, train, warmup
from trm_jax.data import Task, synthetic, tasks
from trm_jax.data.rewards import extract_answer
from trm_jax.metrics import read_metrics
from trm_jax.kernels import NEVER_EVICTED
from model_fixtures import make_test_model
from trm_jax.models import Decoder, from_pretrained, save_pretrained
from trm_jax.models import config as model_config
from trm_jax.rl import modes, objectives
from trm_jax.rl.learner import LearnerBatch, LearnerConfig, make_learner
from trm_jax.rollout import CacheConfig, EvictionPolicy, generate, policies


class KeepEven(EvictionPolicy):
  """Toy: keys at even array indices are protected; among the others the newest goes first."""
  traced = 0

  def priorities(self, cfg, pos, score, **_):
    KeepEven.traced += 1
    return pos % 2 == 0, -pos.astype(jnp.float32)


def toy_reinforce(*, logp_theta, logp_roll, advantages, response_mask, seq_mask, loss_agg,
                  toy_scale, token_weights=None, normalizer=None, max_len=None,
                  logp_old=None):
  """Toy: -toy_scale * log pi_theta per kept token (a gradient whatever the advantages)."""
  del logp_roll, advantages, logp_old
  w = response_mask * seq_mask[:, None] * (1.0 if token_weights is None else token_weights)
  loss = objectives.aggregate(-toy_scale * logp_theta, w, response_mask, loss_agg=loss_agg,
                              normalizer=normalizer, max_len=max_len)
  return loss, {"toy/scale": jnp.float32(toy_scale)}


def half_weights(logp, logp_roll, response_mask):
  """Toy score-pass token weights: every response token counts half."""
  del logp, logp_roll
  return 0.5 * response_mask, {"toy/weight_sum": jnp.sum(0.5 * response_mask)}


@pytest.fixture
def toy_mode():
  modes.register_mode("toy_shadow", modes.LearnerMode(
      needs_compressed_cache=True, replays_eviction=True, distills=True,
      token_weights=half_weights, config_fields=("lam",)))
  yield "toy_shadow"
  del modes.MODES["toy_shadow"]


@pytest.fixture
def keep_even():
  policies.register_policy("keep_even", KeepEven())
  yield "keep_even"
  del policies.POLICIES["keep_even"]


@pytest.fixture
def toy_objective():
  def check(c):   # the toy's own setting, checked by its entry (config.validate runs it)
    config_lib.require(c.rl.toy_scale > 0, ["rl.toy_scale"],
                       f"must be > 0 (rl.objective='toy_reinforce'), got {c.rl.toy_scale!r}")
  objectives.register_objective("toy_reinforce", toy_reinforce, config_fields=("toy_scale",),
                                check=check)
  yield "toy_reinforce"
  del objectives.OBJECTIVES["toy_reinforce"]


def closeness(completion, problem):
  """Toy graded reward: 1 / (1 + |answer - truth|) for an integer answer, else 0."""
  try:
    return 1.0 / (1.0 + abs(int(extract_answer(completion)) - int(problem.answer)))
  except (TypeError, ValueError):
    return 0.0


def toy_check(c):
  """Toy check hook: the task's answers must stay below 100 (two digits)."""
  s = c.task.synthetic
  config_lib.require(s.max_operands * s.max_value < 100,
                     ["task.synthetic.max_operands", "task.synthetic.max_value"],
                     "the toy task's sums must stay below 100")


@pytest.fixture
def toy_task():
  """The synthetic task's problems with a graded reward, a logged part and a check hook."""
  tasks.register_task("toy_closeness", tasks.TaskSpec(
      generator=tasks.TASKS["synthetic"].generator, reward=closeness, binary=False,
      parts=lambda completion, p: {"exact": float(closeness(completion, p) == 1.0)},
      check=toy_check))
  yield "toy_closeness"
  del tasks.TASKS["toy_closeness"]


@pytest.fixture
def toy_family(monkeypatch):
  monkeypatch.setitem(model_config.FAMILIES, "toy_qk_bias", model_config.Family(
      "ToyQkBiasForCausalLM", qk_norm=True, fixed_bias=True))
  return "toy_qk_bias"


def _assert_learner_scores_as_sampled(model, ro, P: int, *, mode: str):
  """The learner's scoring pass (in `mode`; "smd" replays the rollout's evicted_at) gives the
  sampler's log-probs of every response token: a ratio of 1."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  score, _ = make_learner(graphdef, optax.sgd(0.0), LearnerConfig(
      mode=mode, mode_kwargs=(("lam", 0.1),) if mode == "smd" else (), chunk=8),
                          response_start=P)
  B, T = ro.tokens.shape
  replays = modes.get_mode(mode).replays_eviction
  batch = LearnerBatch(tokens=ro.tokens, segment_ids=ro.segment_ids,
                       response_mask=ro.response_mask.astype(jnp.float32), logp_roll=ro.logp,
                       advantages=jnp.zeros((B,)), logp_old=ro.logp,
                       token_weights=jnp.ones((B, T)),
                       evicted_at=ro.evicted_at if replays else None)
  logp = np.asarray(score(params, rest, batch)[0])
  resp = np.asarray(ro.response_mask) == 1
  np.testing.assert_allclose(logp[resp], np.asarray(ro.logp)[resp], atol=1e-5, rtol=0)


def test_toy_cache_policy_through_sampler_and_learner(keep_even):
  P, R, lens = 8, 6, np.array([8, 5], np.int32)
  model = make_test_model(seed=1, num_layers=1)
  cc = CacheConfig(policy=keep_even, ratio=0.5)
  ro = generate(model, left_padded_prompts(lens, P), lens, max_new_tokens=R,
                key=jax.random.key(0), eos_ids=(), cache=cc)
  assert KeepEven.traced > 0
  ev = np.asarray(ro.evicted_at)
  gone = np.argwhere(ev < NEVER_EVICTED)
  assert gone.size and (gone[:, -1] % 2 == 1).all()          # only odd indices ever leave

  # The learner in SMD mode replays `evicted_at` (a teacher-forced forward under the
  # rollout's visibility): its log-probs are the sampler's, a ratio of 1.
  _assert_learner_scores_as_sampled(model, ro, P, mode="smd")


def _tiny_config():
  """tiny_trm at one small rollout batch (8 rows) of an exact sampler, a smaller model."""
  c = config_lib.load_config("tiny_trm")
  c.rl.batch_size, c.rl.group_size, c.eval_problems, c.total_steps = 8, 2, 0, 1
  c.trm.criteria, c.rollout.dtype, c.rollout.logit_noise = (), "float32", 0.0
  c.task.synthetic.max_operands, c.task.synthetic.max_value = 2, 5
  c.model.arch.hidden_size, c.model.arch.intermediate_size = 32, 64
  config_lib.validate(c)
  return c


def test_toy_objective_mode_and_policy_in_rl_step(keep_even, toy_objective, toy_mode,
                                                  tmp_path):
  c = _tiny_config()
  c.rl.objective, c.rl.toy_scale = toy_objective, -0.5     # the toy's own setting
  with pytest.raises(config_lib.ConfigError, match=r"\[rl.toy_scale\]: must be > 0"):
    config_lib.validate(c)
  c.rl.toy_scale = 0.5
  c.rollout.cache.policy, c.rollout.cache.ratio, c.smd.mode = keep_even, 0.5, toy_mode
  config_lib.validate(c)
  tok = synthetic.make_synthetic_tokenizer(str(tmp_path))
  mesh, _ = train.make_mesh(c)
  with jax.set_mesh(mesh):
    model = Decoder(warmup.base_model_config(c, tok), rngs=nnx.Rngs(0))
    task = Task(c.task, seed=c.seed, tokenizer=tok, eval_problems=0)
    ctx, state = step_lib.make_context(c, mesh, model, tok, task)
    assert ctx.programs.cache.policy == keep_even
    assert ctx.lcfg.objective_kwargs == (("toy_scale", 0.5),)
    assert ctx.lcfg.mode_kwargs == (("lam", c.smd.lam),)
    before = jax.tree.map(np.asarray, state.params)
    KeepEven.traced = 0
    state, metrics = step_lib.rl_step(ctx, state)
  assert KeepEven.traced > 0
  assert metrics["toy/scale"] == 0.5 and metrics["learner/skipped"] == 0.0
  assert metrics["smd/distill_kl"] >= 0.0 and metrics["toy/weight_sum"] > 0.0
  moved = jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), before, state.params)
  assert any(jax.tree.leaves(moved))


def test_a_mode_receives_only_the_settings_it_declares():
  c = _tiny_config()

  def lcfg(mode, lam):
    c.smd.mode, c.smd.lam = mode, lam
    return programs.learner_config(c, 16)

  # smd.lam is the smd mode's; the dense learner's static config (its program) ignores it.
  assert lcfg("off", 0.1) == lcfg("off", 0.7) and lcfg("off", 0.1).mode_kwargs == ()
  c.rollout.cache.policy, c.rollout.cache.ratio = "h2o", 0.5
  assert lcfg("smd", 0.7).mode_kwargs == (("lam", 0.7),)
  with pytest.raises(ValueError, match=r"reads smd settings \['lam'\]"):
    LearnerConfig(mode="smd")
  with pytest.raises(ValueError, match="config_fields must include 'lam'"):
    modes.LearnerMode(distills=True)


def test_toy_model_family_from_checkpoint_through_rl_step(toy_family, tmp_path):
  c = _tiny_config()
  tok = synthetic.make_synthetic_tokenizer(str(tmp_path / "tok"))
  mcfg = dataclasses.replace(warmup.base_model_config(c, tok), model_type=toy_family,
                             qk_norm=True, qkv_bias=True, o_bias=False)
  model = Decoder(mcfg, rngs=nnx.Rngs(2))
  # Non-zero biases, so that the loader must carry them (a zero bias survives being dropped).
  q_bias = model.layers[0].attn.q_bias
  q_bias[...] = jax.random.normal(jax.random.key(3), q_bias[...].shape)
  save_pretrained(model, str(tmp_path / "ckpt"))
  with open(tmp_path / "ckpt" / "config.json") as f:
    hf = json.load(f)
  # The row decides what config.json says: its architecture, no attention_bias (fixed).
  assert hf["architectures"] == ["ToyQkBiasForCausalLM"] and hf["model_type"] == toy_family
  assert "attention_bias" not in hf

  loaded = from_pretrained(str(tmp_path / "ckpt"))
  assert loaded.config == mcfg
  same = jax.tree.map(np.array_equal, nnx.state(model, nnx.Param), nnx.state(loaded, nnx.Param))
  assert all(jax.tree.leaves(same))

  # The sampler and the learner see it through the CausalLM protocol alone: exact scoring.
  P, R, lens = 8, 6, np.array([8, 5], np.int32)
  ro = generate(loaded, left_padded_prompts(lens, P, high=mcfg.vocab_size), lens,
                max_new_tokens=R, key=jax.random.key(0), eos_ids=())
  _assert_learner_scores_as_sampled(loaded, ro, P, mode="off")

  # One trainer step on the model loaded as the trainer loads it (sharded on its mesh). The
  # random model earns no reward, so the gradient comes from SMD's distillation term (an
  # evicting cache whose record the learner replays, and the dense teacher).
  c.rollout.cache.policy, c.rollout.cache.ratio, c.smd.mode = "snapkv", 0.5, "smd"
  config_lib.validate(c)
  mesh, _ = train.make_mesh(c)
  with jax.set_mesh(mesh):
    sharded = from_pretrained(str(tmp_path / "ckpt"), mesh=mesh)
    task = Task(c.task, seed=c.seed, tokenizer=tok, eval_problems=0)
    ctx, state = step_lib.make_context(c, mesh, sharded, tok, task)
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = step_lib.rl_step(ctx, state)
  assert metrics["learner/skipped"] == 0.0 and metrics["smd/distill_kl"] > 0.0
  moved = jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), before, state.params)
  assert any(jax.tree.leaves(moved))


def test_toy_graded_task_trains_end_to_end(toy_task, shared_run, tmp_path):
  c = shared_run.config()
  c.task.name = toy_task
  c.rl.batch_size, c.rl.group_size, c.total_steps, c.log_every = 8, 2, 2, 1
  c.eval_problems, c.eval_samples, c.eval_every, c.ckpt_every = 8, 1, 2, 2
  c.export_hf, c.rollout.slots = False, 0    # every row at once: one rollout program
  c.task.synthetic.max_value = 40                  # its check hook, through config.validate
  with pytest.raises(config_lib.ConfigError, match=r"inconsistent config \[task.synthetic."
                     r"max_operands, task.synthetic.max_value\]: the toy task's sums"):
    config_lib.validate(c)
  c.task.synthetic.max_value = 9
  cell = sweep.Cell("toy", ())
  workdir = sweep.cell_dir(str(tmp_path), cell)
  train.run(c, workdir, progress=False)

  records = read_metrics(f"{workdir}/metrics.jsonl")
  evals = [r for r in records if "eval/greedy_reward" in r]
  assert [r["step"] for r in evals] == [0, 2]
  for r in evals:      # the mean reward and its part (no accuracy, no pass@k)
    assert {k for k in r if k.startswith("eval/")} == {"eval/greedy_reward", "eval/greedy_exact"}
    assert 0.0 <= r["eval/greedy_exact"] <= r["eval/greedy_reward"] <= 1.0  # reward 1 if exact
  steps = [r for r in records if r["step"] > 0]
  assert len(steps) == 2 and all("accuracy" not in r and 0 <= r["task/exact"] <= r["reward"]
                                 for r in steps)
  # A graded reward is not a 0/1 one: somewhere a rollout is close without being exact.
  assert any(r["reward"] > r["task/exact"] for r in steps) or any(
      r["eval/greedy_reward"] > r["eval/greedy_exact"] for r in evals)

  with open(f"{workdir}/summary.json") as f:
    summ = json.load(f)
  assert summ["eval"] == {k[5:]: v for k, v in evals[-1].items() if k.startswith("eval/")}
  assert summ["summary"]["final"]["task/exact"] == steps[-1]["task/exact"]
  assert summ["summary"]["evals"]["greedy_reward"]["first"] == evals[0]["eval/greedy_reward"]
  row, = sweep.aggregate(str(tmp_path), cells=[cell])
  assert row["eval/greedy_reward"] == evals[-1]["eval/greedy_reward"]
  assert row["eval_first/greedy_exact"] == evals[0]["eval/greedy_exact"]
  assert row["final/task/exact"] == steps[-1]["task/exact"]
  with open(tmp_path / sweep.RESULTS, newline="") as f:
    written, = csv.DictReader(f)      # the file the sweep writes: the same columns and values
  assert {k: float(written[k]) for k in ("eval/greedy_reward", "eval_first/greedy_exact",
                                          "final/task/exact")} == {
      k: row[k] for k in ("eval/greedy_reward", "eval_first/greedy_exact", "final/task/exact")}
