"""DAPO's batch shaping: the overlong penalty at its boundaries, dynamic sampling's plan, and the
trainer's step with both (in-process on the session's shared tiny base, through `rl_step`):

  * dynamic sampling never trains on a group whose rewards are all equal: every group of the
    batch the update receives either has a non-zero advantage or is out of the loss, the
    fill rate is logged, top-up rounds happen and advance the data position by their prompts;
  * the step is a function of (parameters, optimizer state, step, data position) alone, so a
    run resumed from a checkpoint of those repeats it bitwise;
  * rl.mask_truncated takes the responses cut at the limit out of the loss and keeps their
    rewards in the group's baseline;
  * `--config.rl.dynamic_sampling=True` on the command line logs dapo/fill_rate.
"""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trm_jax import step as step_lib
from trm_jax import train
from trm_jax.data import Task, load_tokenizer
from trm_jax.models import from_pretrained
from trm_jax.rl import dapo
from trm_jax.rl.advantages import group_advantages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- the pure pieces ----------------------------------------------------------------------------
def test_overlong_penalty_at_its_boundaries():
  R, buf, pen = 80, 16, 1.0
  lengths = np.array([1, 63, 64, 65, 72, 79, 80])
  got = dapo.overlong_penalty(lengths, max_new_tokens=R, buffer=buf, penalty=pen)
  # 0 up to R - buffer = 64 tokens; one token more costs penalty / buffer; -penalty at R.
  np.testing.assert_allclose(got, [0, 0, 0, -1 / 16, -8 / 16, -15 / 16, -1.0], rtol=1e-6)
  assert got.dtype == np.float32
  np.testing.assert_allclose(dapo.overlong_penalty(lengths, max_new_tokens=R, buffer=buf,
                                                   penalty=0.5), got / 2, rtol=1e-6)
  # buffer 0: off. The ramp needs at least one token before the limit.
  np.testing.assert_array_equal(dapo.overlong_penalty(lengths, max_new_tokens=R, buffer=0,
                                                      penalty=pen), 0.0)
  np.testing.assert_allclose(dapo.overlong_penalty(np.array([78, 79, 80]), max_new_tokens=R,
                                                   buffer=R - 1, penalty=pen)[-1], -1.0)
  with pytest.raises(ValueError, match=r"rl.overlong_buffer=80 .* task.max_new_tokens=80"):
    dapo.overlong_penalty(lengths, max_new_tokens=R, buffer=R, penalty=pen)
  with pytest.raises(ValueError, match="rl.overlong_penalty"):
    dapo.overlong_penalty(lengths, max_new_tokens=R, buffer=buf, penalty=-1.0)


def test_group_signal_and_topup_sizes():
  np.testing.assert_array_equal(
      dapo.group_signal(np.array([1, 1, 1, 0, 1, 0, 0.5, 0.5, 0.5001]), 3), [False, True, True])
  kw = dict(batch_prompts=16, group_size=4)
  assert dapo.topup_prompts(0, 3, 16, **kw) == 0
  assert dapo.topup_prompts(5, 0, 16, **kw) == 16        # no signal seen yet: a full batch
  assert dapo.topup_prompts(3, 8, 16, **kw) == 8         # 3 at a rate of 1/2: 6 -> 8
  assert dapo.topup_prompts(1, 16, 16, **kw) == 1
  assert dapo.topup_prompts(12, 2, 16, **kw) == 16       # capped at the batch
  assert dapo.topup_prompts(1, 16, 16, batch_prompts=16, group_size=2, shards=8) == 4
  for missing in range(1, 17):       # a power of two (at most log2(16) + 1 sizes to compile)
    for seen in range(1, 17):        # enough at the rate seen so far, unless a full batch
      n = dapo.topup_prompts(missing, seen, 16, **kw)
      assert n in (1, 2, 4, 8, 16) and (n == 16 or n * seen / 16 >= missing)


def test_fill_plan_moves_whole_groups_into_empty_slots():
  take, from_round, filled = dapo.fill_plan(np.array([True, False, True, False]),
                                            np.array([False, True, True]), 2)
  np.testing.assert_array_equal(filled, [True, True, True, True])
  np.testing.assert_array_equal(from_round, [0, 0, 1, 1, 0, 0, 1, 1])
  np.testing.assert_array_equal(take[from_round], [2, 3, 4, 5])   # groups 1 and 2 of the round
  take, from_round, filled = dapo.fill_plan(np.array([False, False, True]),
                                            np.array([True, False]), 1)
  np.testing.assert_array_equal(filled, [True, False, True])        # one slot left empty
  np.testing.assert_array_equal(from_round, [1, 0, 0])


# --- the trainer's step -------------------------------------------------------------------------
def _context(shared_run, new_tokens=0, **rl):
  c = shared_run.config()
  c.rl.batch_size, c.rl.group_size, c.eval_problems = 16, 4, 0
  c.task.max_new_tokens = new_tokens
  c.rl.update(rl)
  mesh, _ = train.make_mesh(c)
  with jax.set_mesh(mesh):
    model = from_pretrained(str(shared_run.base_dir), dtype=jnp.float32, mesh=mesh)
    tok = load_tokenizer(str(shared_run.base_dir))
    task = Task(c.task, seed=c.seed, tokenizer=tok, eval_problems=0)
    ctx, state = step_lib.make_context(c, mesh, model, tok, task)
  return ctx, state, mesh


def _recording(monkeypatch, ctx):
  """Records each step's Filled batch and what its update receives: the rows in the loss and
  the advantages. With one update per batch the update is the one score_update program,
  which takes the rewards and computes GRPO's advantages inside (over every row of a group,
  as the separate path does): recorded from the rewards it receives."""
  seen = []
  fill, updates = step_lib.fill_batch, step_lib.run_updates

  def fill_batch(ctx, state, fl):
    seen.append({"filled": fill(ctx, state, fl), "data_pos": state.data_pos})
    return seen[-1]["filled"]

  def run_updates(ctx, state, batch, k_perm, step):
    seen[-1]["adv"] = np.asarray(batch.advantages)
    seen[-1]["rows"] = np.asarray(batch.response_mask).sum(1)
    return updates(ctx, state, batch, k_perm, step)
  monkeypatch.setattr(step_lib, "fill_batch", fill_batch)
  monkeypatch.setattr(step_lib, "run_updates", run_updates)
  if "score_update" in ctx.programs.programs:
    fused = ctx.programs.programs["score_update"]

    def score_update(params, opt_state, rest, batch, rewards):
      seen[-1]["rewards"] = np.asarray(rewards)
      seen[-1]["adv"] = np.asarray(group_advantages(rewards, group_size=ctx.c.rl.group_size,
                                                    normalize_std=ctx.c.rl.normalize_std))
      seen[-1]["rows"] = np.asarray(batch.response_mask).sum(1)
      return fused(params, opt_state, rest, batch, rewards)
    monkeypatch.setitem(ctx.programs.programs, "score_update", score_update)
  return seen


@pytest.mark.slow
def test_dynamic_sampling_never_trains_on_a_group_without_signal(shared_run, monkeypatch):
  ctx, state, mesh = _context(shared_run, dynamic_sampling=True, dynamic_sampling_max_rounds=3)
  seen = _recording(monkeypatch, ctx)
  G, U = 4, 4
  with jax.set_mesh(mesh):
    for _ in range(2):
      state, m = step_lib.rl_step(ctx, state)
      rec = seen[-1]
      f = rec["filled"]
      trained = (rec["rows"] > 0).reshape(U, G).any(1)
      signal = (np.abs(rec["adv"]).reshape(U, G) > 0).any(1)
      assert not (trained & ~signal).any()               # the claim
      np.testing.assert_array_equal(trained, dapo.group_signal(f.rewards, G))
      np.testing.assert_array_equal(rec["rows"] > 0, f.learn)
      assert m["dapo/fill_rate"] == trained.mean()
      assert state.data_pos == rec["data_pos"] + m["dapo/prompts"] == rec["data_pos"] + f.prompts
    # Keep the state after step 2 aside: step 3 from it, rebuilt as a checkpoint holds it
    # (params, optimizer state, step, data position), must repeat bitwise.
    saved = (jax.tree.map(jnp.copy, state.params), jax.tree.map(jnp.copy, state.opt_state),
             state.step, state.data_pos)
    state, m3 = step_lib.rl_step(ctx, state)
    again, m3b = step_lib.rl_step(ctx, step_lib.TrainState(
        params=saved[0], opt_state=saved[1], step=saved[2], data_pos=saved[3]))
  rounds = [r["filled"].prompts > U for r in seen]
  assert any(rounds), "no step needed a top-up round: the test is vacuous"
  assert again.data_pos == state.data_pos
  same = jax.tree.map(lambda a, b: np.asarray(a).tobytes() == np.asarray(b).tobytes(),
                      state.params, again.params)
  assert all(jax.tree.leaves(same))
  strip = lambda m: {k: v for k, v in m.items() if not k.startswith(("time/", "throughput/"))}
  assert strip(m3) == strip(m3b)


@pytest.mark.slow
def test_mask_truncated_leaves_the_loss_not_the_baseline(shared_run, monkeypatch):
  # 10 new tokens: the shared base's longer worked solutions are cut at the limit.
  ctx, state, mesh = _context(shared_run, new_tokens=10, mask_truncated=True, overlong_buffer=3,
                              overlong_penalty=0.5)
  seen = _recording(monkeypatch, ctx)
  with jax.set_mesh(mesh):
    _, m = step_lib.rl_step(ctx, state)
  rec = seen[0]
  f = rec["filled"]
  finished = np.asarray(f.ro.stats.finished).astype(bool)
  assert 0 < finished.sum() < len(finished)             # both kinds in the batch
  np.testing.assert_array_equal(f.learn, finished)
  np.testing.assert_array_equal(rec["rows"] > 0, finished)
  # Advantages over every row of a group, truncated or not (with the overlong penalty).
  lengths = np.asarray(f.ro.response_lengths)
  raw = f.rewards - dapo.overlong_penalty(lengths, max_new_tokens=10, buffer=3, penalty=0.5)
  assert (f.rewards < raw).any()
  want = np.asarray(group_advantages(jnp.asarray(f.rewards), group_size=4, normalize_std=True))
  np.testing.assert_allclose(rec["adv"], want, rtol=1e-6, atol=1e-7)
  assert m["rollout/truncated_frac"] == pytest.approx(1 - finished.mean())


@pytest.mark.slow
def test_dynamic_sampling_from_the_command_line_logs_the_fill_rate(tmp_path, shared_run):
  # tiny_trm at test_train_resume's batch shape: its programs are in the shared cache.
  args = [sys.executable, "-m", "trm_jax.train", "--config", "tiny_trm",
          "--workdir", str(tmp_path / "w"), "--config.total_steps=2",
          "--config.rl.batch_size=16", "--config.rl.group_size=4", "--config.eval_problems=0",
          "--config.export_hf=False", "--config.rl.dynamic_sampling=True",
          "--config.rl.overlong_buffer=8", *shared_run.cli_args()]
  p = subprocess.run(args, cwd=ROOT, env=shared_run.env(), capture_output=True, text=True,
                     timeout=900)
  assert p.returncode == 0, p.stderr[-3000:]
  with open(tmp_path / "w" / "metrics.jsonl") as f:
    recs = [json.loads(l) for l in f if l.strip()]
  steps = [r for r in recs if r.get("step", 0) > 0]
  assert len(steps) == 2
  for r in steps:
    assert 0.0 < r["dapo/fill_rate"] <= 1.0 and r["dapo/rounds"] >= 1
    assert "dapo/overlong_penalty" in r and "rollout/truncated_frac" in r
