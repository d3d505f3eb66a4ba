"""Stale rollouts (rl.staleness = k) and a sampler on its own devices (mesh.rollout_devices).

In-process on the session's shared tiny base model, through the step API the trainer uses:

  * batch t is sampled with parameter version max(t - 1 - k, 0): its log-probs equal the
    teacher-forced log-probs of the sampled tokens under exactly those parameters (kept aside
    after every step), and differ from the current ones, while the learner's ratios are taken
    against the current parameters;
  * a sampler on devices 0-3 and a learner on 4-7 receive the weights bitwise (same dtype) and
    train like the colocated run with the same k;
  * a batch older than rl.max_staleness is dropped and counted, leaving the parameters alone.

fp32 sampler without logit noise, so pi_roll == pi_theta of the version that sampled.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trm_jax import step as step_lib
from trm_jax import train
from trm_jax.data import Task, load_tokenizer
from trm_jax.models import from_pretrained

pytestmark = pytest.mark.slow
LR = 1e-3


def _setup(shared_run, *, k, rollout_devices=0, steps=5, dtype="float32", logit_noise=0.0):
  c = shared_run.config()
  c.total_steps, c.rl.staleness = steps, k
  c.rl.batch_size, c.rl.group_size = 32, 4
  c.rollout.dtype, c.rollout.logit_noise = dtype, logit_noise
  c.optim.lr, c.optim.warmup_steps = LR, 0   # big steps: versions differ visibly
  c.mesh.rollout_devices = rollout_devices
  mesh, sampler_mesh = train.make_mesh(c)
  with jax.set_mesh(mesh):
    model = from_pretrained(str(shared_run.base_dir), dtype=jnp.float32, mesh=mesh)
    tok = load_tokenizer(str(shared_run.base_dir))
    task = Task(c.task, seed=c.seed, tokenizer=tok, eval_problems=0)
    ctx, state = step_lib.make_context(c, mesh, model, tok, task, sampler_mesh)
  return ctx, state, mesh


def _copy(tree):
  return jax.tree.map(lambda x: np.array(x), tree)


def _score(ctx, params, ro, param_sh):
  """Teacher-forced log-probs of the rollout's tokens under `params` (the learner's pass)."""
  batch = step_lib.LearnerBatch(
      tokens=ro.tokens, segment_ids=ro.segment_ids,
      response_mask=ro.response_mask.astype(jnp.float32), logp_roll=ro.logp,
      advantages=jnp.zeros(ro.tokens.shape[:1]), logp_old=ro.logp,
      token_weights=jnp.ones(ro.tokens.shape, jnp.float32), roll_logp_full=ro.full_logp)
  batch = step_lib.shd.put_batch(batch, ctx.mesh)
  params = jax.device_put(params, param_sh)
  logp, _, _, metrics = ctx.score(params, ctx.rest, batch)
  return np.asarray(logp), metrics


def test_rollouts_come_from_the_version_they_claim(shared_run, k=2):
  """k = 2: the sampler lags by one update at step 2 and by two after, so both the first
  stale version and the ring of k parameter copies are exercised."""
  ctx, state, mesh = _setup(shared_run, k=k)
  param_sh = jax.tree.map(lambda x: x.sharding, state.params)
  versions = {0: _copy(state.params)}
  stale_and_moved = 0
  with jax.set_mesh(mesh):
    for t in range(1, ctx.c.total_steps + 1):
      fl = state.pending if state.pending is not None else step_lib.dispatch_rollout(ctx, state)
      assert fl.version == max(t - 1 - k, 0)
      np.testing.assert_array_equal(fl.ro.policy_version, fl.version)
      mask = np.asarray(fl.ro.response_mask) > 0
      logp_v, _ = _score(ctx, versions[fl.version], fl.ro, param_sh)
      np.testing.assert_allclose(logp_v[mask], np.asarray(fl.ro.logp)[mask], rtol=1e-5,
                                 atol=1e-5)
      logp_now, score_metrics = _score(ctx, _copy(state.params), fl.ro, param_sh)
      if fl.version != state.step and _differ(versions[fl.version], versions[state.step]):
        # A stale batch whose version really is older: the current policy scores it otherwise.
        assert np.abs(logp_now[mask] - np.asarray(fl.ro.logp)[mask]).max() > 1e-4
        stale_and_moved += 1
      state = dataclasses.replace(state, pending=fl)
      state, metrics = step_lib.rl_step(ctx, state)
      assert metrics["rollout/staleness"] == min(k, t - 1)
      # The learner's ratios are against the current parameters (its k3 of log rho).
      assert metrics["learner/k3_mean"] == pytest.approx(
          float(score_metrics["learner/k3_mean"]), rel=1e-5, abs=1e-9)
      versions[t] = _copy(state.params)
      assert len(state.history) == k
  assert stale_and_moved >= 2, "no stale batch came from parameters that had moved"


def _differ(a, b) -> bool:
  return any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_disaggregated_sampler_matches_colocated(shared_run):
  runs = {}
  for n in (0, 4):
    ctx, state, mesh = _setup(shared_run, k=1, rollout_devices=n, steps=3)
    if n:
      # The weights arrive bitwise, in the same dtype, on the sampler's own devices.
      sent = step_lib.to_sampler(ctx, state.params)
      for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(sent)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
        assert {d.id for d in b.devices()} <= {d.id for d in jax.devices()[:4]}
        assert {d.id for d in a.devices()} <= {d.id for d in jax.devices()[4:]}
    records = []
    with jax.set_mesh(mesh):
      while state.step < ctx.c.total_steps:
        state, m = step_lib.rl_step(ctx, state)
        records.append(m)
    if n:
      assert all(r["sync/bytes"] == sum(x.nbytes for x in jax.tree.leaves(state.params))
                 and r["sync/seconds"] > 0 for r in records)
    runs[n] = (_copy(state.params), records)
  (p0, r0), (p4, r4) = runs[0], runs[4]
  # The learner's data axis is 8 devices colocated and 4 disaggregated, so gradient sums
  # differ in their last bits. Adam divides by the gradient's running scale, which turns a
  # last-bit difference of a near-zero gradient coordinate into up to one step (lr) of
  # parameter change: almost every parameter agrees to 1e-5, and none differs by more than
  # the updates could move it.
  lr, steps = LR, 3
  diff = np.concatenate([np.abs(a - b).ravel() for a, b in zip(jax.tree.leaves(p0),
                                                                jax.tree.leaves(p4))])
  assert (diff > 1e-5).mean() < 1e-3 and diff.max() <= 2 * lr * steps, (diff.max(),
                                                                         (diff > 1e-5).mean())
  for a, b in zip(r0, r4):   # same rollouts (rewards), same learning signal
    assert a["reward"] == b["reward"] and a["response_len"] == b["response_len"]
    assert a["learner/loss"] == pytest.approx(b["learner/loss"], rel=1e-4, abs=1e-6)


def test_a_batch_older_than_the_bound_is_dropped(shared_run):
  ctx, state, mesh = _setup(shared_run, k=1, steps=6)
  with jax.set_mesh(mesh):
    state, _ = step_lib.rl_step(ctx, state)
    state, _ = step_lib.rl_step(ctx, state)
    # A lag the fixed schedule never produces (as an asynchronous sampler falling behind
    # would): the pending batch claims version 0 while the learner is at version 2.
    stale = dataclasses.replace(state.pending, version=0)
    before = _copy(state.params)
    ctx = dataclasses.replace(ctx, c=ctx.c.copy_and_resolve_references())
    ctx.c.rl.max_staleness = 1
    state, metrics = step_lib.rl_step(ctx, dataclasses.replace(state, pending=stale))
  assert metrics["rollout/dropped_stale"] == 1.0 and metrics["rollout/staleness"] == 2.0
  assert "reward" not in metrics and state.step == 3
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(_copy(state.params))):
    np.testing.assert_array_equal(a, b)
  assert state.pending is not None and state.pending.version == 2   # the pipeline goes on


def test_a_bf16_sampler_receives_bf16_weights_and_samples_the_same_tokens(shared_run):
  """The disaggregated copy is narrowed to the sampler's dtype before it travels: half the
  bytes of fp32, and the rollout is bitwise the rollout from the learner's fp32 weights."""
  ctx, state, _ = _setup(shared_run, k=0, rollout_devices=4, dtype="bfloat16", logit_noise=0.1)
  task = ctx.task
  sent = step_lib.to_sampler(ctx, state.params)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(sent)):
    assert a.dtype == jnp.float32 and b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a.astype(jnp.bfloat16)))
  pb = task.prompts(task.batch(0, 8), 4)
  key = jax.random.key(3)
  narrowed = step_lib.sample(ctx, sent, pb, key)
  wide = step_lib.sample(ctx, jax.device_put(state.params, ctx.sampler_param_sh), pb, key)
  for name in ("tokens", "logp", "response_mask"):
    np.testing.assert_array_equal(np.asarray(getattr(narrowed, name)),
                                  np.asarray(getattr(wide, name)), err_msg=name)
