"""End-to-end trainer faults, each in real `python -m trm_jax.train` subprocesses (tiny config,
2 simulated CPU devices from shared_run.env(), so the trainer runs on a 2-way data mesh):

  * SIGKILL mid-run, resume: final parameters and optimizer state bitwise identical to an
    uninterrupted run, and metrics.jsonl holds each step exactly once with the same values;
  * the newest checkpoint's files corrupted: the run falls back to the one before, says so,
    and still ends bitwise identical;
  * held-out evaluations (`eval_every`) land at step 0 and every k steps, once each, with the
    same values after a resume;
  * NaN gradients at one step (`debug.nan_step`): that update is skipped (parameters and
    optimizer state untouched, `learner/skipped` = 1) and the run finishes;
  * a rerun with another trajectory config is refused naming each key, unless
    --allow_config_change; a longer total_steps extends the run and says so;
  * a run whose every update is skipped stops after rl.max_consecutive_skips steps, saying why.

The base model is the session's shared one (shared_run.py: rewards vary within groups, so
the gradients are not zero and a resume bug must be able to change the parameters), and all
runs share the session's persistent XLA compilation cache.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 900  # seconds per trainer run; the machine is shared and heavily loaded
STEPS = 6
# Clock readings and process memory: allowed to differ between a run and its resumption.
VOLATILE = ("time/", "throughput/", "wall_time", "memory/")

pytestmark = pytest.mark.slow


def _args(shared, workdir, *overrides):
  return [sys.executable, "-m", "trm_jax.train", "--config", "configs/tiny_trm.py",
          "--workdir", workdir,
          f"--config.total_steps={STEPS}", "--config.ckpt_every=2", "--config.keep_ckpts=2",
          "--config.rl.batch_size=16", "--config.rl.group_size=4",
          "--config.eval_problems=8", "--config.eval_every=2", *shared.cli_args(), *overrides]


def _train(shared, workdir, *overrides, ok: bool = True) -> str:
  p = subprocess.run(_args(shared, workdir, *overrides), cwd=ROOT, env=shared.env(),
                     capture_output=True, text=True, timeout=TIMEOUT)
  assert (p.returncode == 0) == ok, p.stderr[-4000:]
  return p.stderr


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _state(workdir, step):
  """The raw orbax state of checkpoint `step` as {path: numpy array}."""
  import jax  # pylint: disable=g-import-not-at-top
  tree = ocp.StandardCheckpointer().restore(os.path.join(workdir, "ckpt", str(step), "state"))
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat}


def _assert_bitwise_equal(a: dict, b: dict):
  assert sorted(a) == sorted(b)
  for k in a:
    assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
    assert a[k].tobytes() == b[k].tobytes(), f"{k} differs"


def _assert_same_run(workdir, ref):
  _assert_bitwise_equal(_state(workdir, STEPS), _state(ref, STEPS))
  _assert_bitwise_equal(load_file(os.path.join(workdir, "hf", "model.safetensors")),
                        load_file(os.path.join(ref, "hf", "model.safetensors")))
  got, want = _metrics(workdir), _metrics(ref)
  # Each step exactly once; step 0 holds the evaluation of the starting policy.
  assert [r["step"] for r in got] == list(range(0, STEPS + 1))
  # Held-out evaluations at step 0 and every eval_every = 2 steps, the same after a resume.
  assert [r["step"] for r in got if "eval/greedy_accuracy" in r] == list(range(0, STEPS + 1, 2))
  for g, w in zip(got, want):
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(VOLATILE)}
    assert strip(g) == strip(w), g["step"]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
  return str(tmp_path_factory.mktemp("train"))


@pytest.fixture(scope="module")
def reference(tmp, shared_run):
  """An uninterrupted run (also fills the shared compilation cache)."""
  workdir = os.path.join(tmp, "reference")
  _train(shared_run, workdir)
  recs = _metrics(workdir)
  # The runs below can only show a difference if the updates do something.
  assert any(r.get("learner/grad_norm") for r in recs), "all gradients zero: the test is vacuous"
  assert sorted(os.listdir(os.path.join(workdir, "ckpt"))) == ["4", "6"]
  return workdir


def _run_and_kill(shared, workdir, *overrides) -> bool:
  """Starts a run and SIGKILLs it once a checkpoint is finalized; False if it ended first."""
  ckpt = os.path.join(workdir, "ckpt")
  proc = subprocess.Popen(_args(shared, workdir, *overrides), cwd=ROOT, env=shared.env(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + TIMEOUT
  try:
    # A finalized step is a directory named by its number (orbax renames it from *.tmp last).
    while time.time() < deadline and proc.poll() is None:
      if os.path.isdir(ckpt) and any(d.isdigit() for d in os.listdir(ckpt)):
        os.kill(proc.pid, signal.SIGKILL)
        break
      time.sleep(0.01)
  finally:
    if proc.poll() is None and time.time() >= deadline:
      proc.kill()
    proc.wait()
  return proc.returncode == -signal.SIGKILL


def test_sigkill_then_resume_is_bitwise_identical(tmp, reference, shared_run):
  _kill_and_resume(tmp, shared_run, "killed", reference)


def test_sigkill_with_stale_rollouts_resumes_bitwise(tmp, shared_run):
  """rl.staleness = 2: the parameter versions the next rollouts need are in the checkpoint,
  so a run killed mid-way resumes onto the same pipeline and ends bitwise identical."""
  stale = ("--config.rl.staleness=2",)
  reference = os.path.join(tmp, "stale_reference")
  _train(shared_run, reference, *stale)
  recs = _metrics(reference)
  assert [r["rollout/staleness"] for r in recs if "reward" in r] == [0, 1, 2, 2, 2, 2]
  assert _state(reference, STEPS)["['history'][1]['embed']['embedding']['value']"].size > 0
  _kill_and_resume(tmp, shared_run, "stale_killed", reference, *stale)


def _kill_and_resume(tmp, shared_run, name, reference, *overrides):
  for attempt in range(3):  # the kill must land between the first checkpoint and the end
    workdir = os.path.join(tmp, f"{name}{attempt}")
    if _run_and_kill(shared_run, workdir, *overrides) and not os.path.exists(
        os.path.join(workdir, "ckpt", str(STEPS))):
      break
  else:
    pytest.fail("could not kill the run between its first checkpoint and its end")
  done = max(r["step"] for r in _metrics_safe(os.path.join(workdir, "metrics.jsonl")))
  assert done < STEPS

  log = _train(shared_run, workdir, *overrides)
  resumed = [int(d) for d in os.listdir(os.path.join(workdir, "ckpt")) if d.isdigit()]
  assert "resumed from step " in log, log[-3000:]
  assert STEPS in resumed
  _assert_same_run(workdir, reference)


def _metrics_safe(path):
  """metrics.jsonl lines that parse (the process may be mid-write)."""
  out = []
  with open(path) as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        pass
  return out


def test_preempted_at_several_moments_then_resumed_is_bitwise_identical(tmp, reference,
                                                                         shared_run):
  """SIGTERM / SIGINT, delivered for real by the trainer to itself at named moments
  (preemption.debug_point, TRM_DEBUG_SIGNAL): SIGTERM while the async save of step 2 is
  written, then, in the resumed run, SIGINT in the middle of step 4's evaluation. Each run
  finishes its step, checkpoints it, keeps its metrics and exits 128 + signal with one line
  (no KeyboardInterrupt traceback); the chain of resumes ends bitwise equal to the
  uninterrupted run. Mid-rollout and mid-update, a forced save of a step that is not a
  ckpt_every step, and processes agreeing on the step: tests/test_distributed.py (one run
  there covers them, which keeps this suite's time down)."""
  workdir = os.path.join(tmp, "preempted")
  env = shared_run.env(TRM_DEBUG_SIGNAL="save@2,eval@4:INT")
  for step, sig in ((2, signal.SIGTERM), (4, signal.SIGINT)):
    p = subprocess.run(_args(shared_run, workdir), cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=TIMEOUT)
    name, code = signal.Signals(sig).name, 128 + sig
    assert p.returncode == code, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == (
        f"preempted by {name} after step {step} of {STEPS}: checkpoint step {step} is saved "
        f"in {workdir}/ckpt; rerun the same command to resume (exit code {code})")
    assert "Traceback" not in p.stderr and "KeyboardInterrupt" not in p.stderr
    assert f"{name} received: finishing the current step" in p.stderr
    assert str(step) in os.listdir(os.path.join(workdir, "ckpt"))
    assert [r["step"] for r in _metrics(workdir)] == list(range(step + 1))  # flushed
    assert not os.path.exists(os.path.join(workdir, "summary.json"))
  log = _train(shared_run, workdir)
  assert "resumed from step 4 " in log, log[-3000:]
  _assert_same_run(workdir, reference)


def test_corrupt_newest_checkpoint_falls_back_with_a_warning(tmp, reference, shared_run):
  workdir = os.path.join(tmp, "corrupt")
  shutil.copytree(reference, workdir)
  newest = os.path.join(workdir, "ckpt", str(STEPS))
  rng = np.random.default_rng(0)
  n = 0
  for root, _, files in os.walk(os.path.join(newest, "state")):
    for name in files:
      path = os.path.join(root, name)
      size = os.path.getsize(path)
      with open(path, "wb") as f:  # same size, garbage content
        f.write(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
      n += 1
  assert n > 0

  log = _train(shared_run, workdir)
  assert f"checkpoint step {STEPS} in" in log and "is unusable" in log, log[-3000:]
  assert "falling back to an older one" in log
  # The fallback's warning is all: no tracebacks of orbax's abandoned reads.
  assert "Traceback" not in log and "Event loop is closed" not in log, log[-3000:]
  assert f"resumed from checkpoint step {STEPS - 2}" in log
  assert f"resumed from step {STEPS - 2} " in log
  _assert_same_run(workdir, reference)


def test_nan_gradients_skip_the_update_and_the_run_goes_on(tmp, reference, shared_run):
  del reference  # only for the base model and the compilation cache
  workdir = os.path.join(tmp, "nan")
  p = subprocess.run(_args(shared_run, workdir, "--config.total_steps=3", "--config.ckpt_every=1",
                           "--config.eval_every=0", "--config.keep_ckpts=3",
                           "--config.debug.nan_step=2"),
                     cwd=ROOT, env=shared_run.env(), capture_output=True, text=True,
                     timeout=TIMEOUT)
  assert p.returncode == 0, p.stderr[-4000:]
  # Said at the end, not only in the metrics.
  assert ("updates skipped at 1 of the 3 steps run: 1 had a non-finite loss or gradient. The "
          "policy changed only at the other steps") in p.stdout.splitlines(), p.stdout
  recs = {r["step"]: r for r in _metrics(workdir)}
  assert sorted(recs) == [1, 2, 3]
  assert [s for s in recs if "eval/greedy_accuracy" in recs[s]] == [3]  # eval_every=0: the end
  assert [recs[s]["learner/skipped"] for s in (1, 2, 3)] == [0.0, 1.0, 0.0]
  assert recs[2]["learner/grad_norm"] is None  # NaN: logged as null
  assert os.path.exists(os.path.join(workdir, "summary.json"))
  s1, s2, s3 = (_state(workdir, s) for s in (1, 2, 3))
  # Step 2 left params and the whole optimizer state (moments and schedule count) untouched...
  _assert_bitwise_equal(s2, s1)
  # ... while step 1 and step 3 applied updates (the schedule count moved).
  counts = [k for k in s1 if k.endswith("['count']")]
  assert counts and all(int(s1[k]) == 1 for k in counts)
  assert all(int(s3[k]) == 2 for k in counts)


def test_resume_refuses_a_changed_config_naming_each_key(tmp, reference, shared_run):
  workdir = os.path.join(tmp, "changed")
  shutil.copytree(reference, workdir)
  with open(os.path.join(workdir, "config.json")) as f:
    before = f.read()
  log = _train(shared_run, workdir, "--config.optim.lr=1e-4", "--config.rollout.logit_noise=0.2",
               "--config.eval_every=3", f"--config.total_steps={STEPS + 1}", ok=False)
  line = log.strip().splitlines()[-1]
  assert line == (f"error: {workdir} holds a run (checkpoint step {STEPS}) with other settings: "
                  "optim.lr: 3e-05 -> 0.0001; rollout.logit_noise: 0.1 -> 0.2. Use another "
                  "--workdir, or pass --allow_config_change to continue this run with the new "
                  "settings (both configs are kept)"), line   # eval_every, total_steps may change
  with open(os.path.join(workdir, "config.json")) as f:
    assert f.read() == before                    # the run's record is untouched

  # Asked for, the change is made, said, and both configs are kept.
  log = _train(shared_run, workdir, "--config.optim.lr=1e-4", f"--config.total_steps={STEPS + 1}",
               "--allow_config_change")
  assert f"--allow_config_change: continuing from step {STEPS} with optim.lr: 3e-05 -> 0.0001" \
      in log, log[-3000:]
  with open(os.path.join(workdir, f"config.before_step_{STEPS}.json")) as f:
    assert json.load(f)["optim"]["lr"] == 3e-5
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["optim"]["lr"] == 1e-4

  # The longer total_steps (not a changed setting, above) extends the run and says so; each
  # step is logged once.
  assert (f"total_steps {STEPS} -> {STEPS + 1}: extending the run from step {STEPS}; the "
          "learning-rate schedule now spans") in log, log[-3000:]
  assert [r["step"] for r in _metrics(workdir)] == list(range(0, STEPS + 2))
  # Shortening below the steps done cannot resume.
  log = _train(shared_run, workdir, "--config.total_steps=3", ok=False)
  assert log.strip().splitlines()[-1] == (
      f"error: total_steps=3, but the run in {workdir} is at step {STEPS + 1} already; use "
      "another --workdir")


def test_a_run_that_cannot_learn_stops_naming_why(tmp, reference, shared_run):
  """trm.delta = 0 masks every sequence (bf16 + noise always diverge a little): no update can
  happen, so after rl.max_consecutive_skips steps the run stops instead of exiting 0."""
  del reference  # only for the base model and the compilation cache
  workdir = os.path.join(tmp, "stalled")
  log = _train(shared_run, workdir, "--config.trm.delta=0.0", "--config.rl.max_consecutive_skips=2",
               "--config.eval_every=0", ok=False)
  assert ("trm.delta=0: trm_max_kl keeps only sequences with no divergence at all, so with any "
          "mismatch between sampler and learner every sequence is masked and every update "
          "skipped") in log                          # said before the first step
  assert log.strip().splitlines()[-1] == (
      "error: stopping at step 2: every update of the last 2 steps was skipped "
      "(rl.max_consecutive_skips=2): 0 steps had a non-finite loss or gradient, 2 had every "
      "sequence masked. The run cannot learn: check the weights and the tokenizer, lower "
      "optim.lr, or loosen trm.* thresholds; the last good checkpoint is kept")
  recs = _metrics(workdir)
  assert [r["step"] for r in recs] == [1, 2]
  assert all(r["learner/skipped"] == 1.0 and r["learner/skipped_all_masked"] == 1.0 and
             r["trm/reject_rate"] == 1.0 for r in recs)
  assert not os.path.exists(os.path.join(workdir, "summary.json"))


def test_a_full_disk_at_the_export_loses_nothing(tmp, reference, shared_run):
  """The HF export of a finished run onto a full disk (a 64 kB tmpfs at workdir/hf, as root)
  raised a SafetensorError traceback. Now: one line, the run's checkpoint and metrics are
  kept, no partial file is left, and once the disk has room the same command exports it."""
  if os.geteuid() != 0:
    pytest.skip("needs root to mount a full tmpfs")
  workdir = os.path.join(tmp, "full_export")
  shutil.copytree(reference, workdir)
  os.remove(os.path.join(workdir, "summary.json"))      # the run as it stood before its export
  shutil.rmtree(os.path.join(workdir, "hf"))
  hf = os.path.join(workdir, "hf")
  os.makedirs(hf)
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", hf]).returncode != 0:
    pytest.skip("cannot mount a tmpfs here")
  try:
    log = _train(shared_run, workdir, ok=False)
    assert os.listdir(hf) == []
  finally:
    subprocess.run(["umount", hf], check=True)
  assert log.strip().splitlines()[-1] == (
      f"error: exporting the policy failed: {hf}: cannot write the checkpoint (No space left on "
      f"device (os error 28)). The run is kept (checkpoint step {STEPS} in {workdir}/ckpt); "
      f"rerun the same command once {hf} can be written, to export it")
  assert "Traceback" not in log
  assert _metrics(workdir) == _metrics(reference)
  assert not os.path.exists(os.path.join(workdir, "summary.json"))
  _train(shared_run, workdir)
  assert os.path.exists(os.path.join(hf, "model.safetensors"))
  assert os.path.exists(os.path.join(workdir, "summary.json"))
