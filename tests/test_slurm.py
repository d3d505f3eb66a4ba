"""A real SLURM scheduler (Debian's slurm-wlm) on this machine: the tiny trainer as a 2-task
`srun` step is one 2-process run, resumable after `scancel`; the sweep's SLURM backend submits
its grid as a job array, skips done cells, does not resubmit queued ones, runs a cell that asks
for several processes as one multi-task step, and `--aggregate` reports the failed cell.

The cluster (tests/slurm_cluster.py) starts once for this file and stops after it; where its
daemons cannot start (not installed, not root, the node not idle within a minute) the tests
skip with that reason. `.ci/run` installs the packages; docs/architecture.md says how these
tests were run.
"""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from slurm_cluster import SlurmCluster, SlurmUnavailable
from test_distributed import TRAINER_SETTINGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 600
STEPS = 10   # of the srun run; scancel lands a few steps after its first checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  c = SlurmCluster(str(tmp_path_factory.mktemp("slurm")))
  try:
    c.start()
  except SlurmUnavailable as e:
    c.stop()
    pytest.skip(f"no SLURM cluster: {e}")
  print(f"[slurm] one-node cluster idle after {c.start_s:.1f}s")
  yield c
  c.stop()


def _job_env(cluster, shared_run, devices=1):
  """What the job steps inherit from sbatch (--export=ALL): one CPU device per process, gloo
  collectives across processes, the shared base model's compilation cache."""
  env = cluster.env(shared_run.env(devices=devices, JAX_PLATFORMS="cpu",
                                   JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
                                   PYTHONPATH=os.pathsep.join(
                                       [ROOT, os.environ.get("PYTHONPATH", "")])))
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(k, None)   # the processes must find each other from SLURM's variables alone
  return env


def _sbatch(cluster, env, *args):
  p = subprocess.run(["sbatch", "--parsable", *args], env=env, capture_output=True, text=True,
                     cwd=ROOT, timeout=60)
  assert p.returncode == 0, p.stderr
  return p.stdout.strip().split(";")[0]


def _log(path: str) -> str:
  """A job's output file. A step's tasks write it together, and their writes can interleave
  inside a multi-byte character (the progress bar's blocks), so undecodable bytes are
  replaced; what the tests look for in it is ASCII."""
  with open(path, errors="replace") as f:
    return f.read()


def _steps(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r["step"] for r in map(json.loads, f) if "reward" in r]


def test_srun_two_tasks_are_one_two_process_run_resumed_after_scancel(cluster, shared_run,
                                                                      tmp_path):
  workdir, out = str(tmp_path / "run"), str(tmp_path / "job_%j.out")
  # test_distributed.py's two-process settings (one device per process, fsdp = 2).
  train = ["srun", "--ntasks=2", sys.executable, "-m", "trm_jax.train", "--config", "tiny_trm",
           "--workdir", workdir, f"--config.total_steps={STEPS}", "--config.ckpt_every=1",
           *TRAINER_SETTINGS, "--config.export_hf=False", *shared_run.cli_args()]
  env = _job_env(cluster, shared_run)
  job = _sbatch(cluster, env, "--ntasks=2", f"--output={out}", "--wrap",
                subprocess.list2cmdline(train))
  # Cancelled once the first checkpoint is written: the steps after it (a fraction of a second
  # each) leave scancel time to land before the last one.
  ckpt = os.path.join(workdir, "ckpt")
  t0 = time.time()
  while not (os.path.isdir(ckpt) and any(d.isdigit() and int(d) >= 1 for d in os.listdir(ckpt))):
    assert time.time() - t0 < TIMEOUT, _log(out.replace("%j", job))[-3000:]
    time.sleep(0.5)
  subprocess.run(["scancel", job], env=env, check=True, timeout=30)
  cluster.wait_job(job, 120)
  first = _log(out.replace("%j", job))
  assert "2 processes" in first, first[-3000:]          # one run of two processes
  assert not os.path.exists(os.path.join(workdir, "summary.json"))
  done_before = _steps(workdir)
  assert done_before and done_before[-1] < STEPS

  job2 = _sbatch(cluster, env, "--ntasks=2", f"--output={out}", "--wrap",
                 subprocess.list2cmdline(train))
  cluster.wait_job(job2, TIMEOUT)
  second = _log(out.replace("%j", job2))
  assert os.path.exists(os.path.join(workdir, "summary.json")), second[-3000:]
  assert "resumed from step" in second and "2 processes" in second
  steps = _steps(workdir)
  assert steps[-1] == STEPS and sorted(set(steps)) == list(range(1, STEPS + 1))


def _sweep(env, *args):
  p = subprocess.run([sys.executable, "-m", "trm_jax.sweep", *args], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=TIMEOUT)
  return p.returncode, p.stdout + p.stderr


def test_sweep_backend_slurm_job_array(cluster, shared_run, tmp_path):
  workdir = str(tmp_path / "w")
  env = _job_env(cluster, shared_run)
  sets = ["total_steps=2", "ckpt_every=1", "eval_problems=0", "export_hf=False",
          "rl.batch_size=8", "rl.group_size=4"]
  sets = [a for s in sets for a in ("--set", s)] + shared_run.cli_args(flag="")
  bad = str(tmp_path / "no_such_checkpoint")
  grid = ["--config", "tiny_trm", "--workdir", workdir, "--grid", f"model.path=,{bad}", *sets]
  rc, log = _sweep(env, "--backend", "slurm", "--wait", *grid)
  assert "2 cells, 0 done, 0 queued, 2 to submit, 1 process(es) each" in log, log
  assert "submitted job array" in log
  assert rc == 1 and "not ok: ['path=" in log, log             # the bad cell, by name
  rows = {r["cell"]: r["status"] for r in _aggregate(env, workdir)}
  assert sorted(rows.values()) == ["failed", "ok"], rows
  ok_cell = next(n for n, s in rows.items() if s == "ok")
  bad_cell = next(n for n, s in rows.items() if s == "failed")
  assert _steps(os.path.join(workdir, "cells", ok_cell)) == [1, 2]
  bad_log = os.path.join(workdir, "cells", bad_cell, "log.txt")
  assert _log(bad_log).count("no_such_checkpoint") >= 1
  assert os.path.exists(os.path.join(workdir, "results.csv"))

  # Re-run as two processes per cell: the done cell is skipped, the failed one resubmitted as
  # one 2-task step (both tasks write its log), and a third run while it is queued submits
  # nothing.
  def errors():   # the cell's own one-line error, once per process that ran it
    return [l for l in _log(bad_log).splitlines()
            if l.startswith("error: ") and "no_such_checkpoint" in l]
  before = len(errors())
  # The partition is down while the two sweeps run, so the submitted cell is still queued when
  # the third looks (it fails within seconds once it runs: a race the test would otherwise be).
  _partition(env, "DOWN")
  try:
    rc, log = _sweep(env, "--backend", "slurm", "--processes", "2", *grid)
    assert rc == 0 and "2 cells, 1 done, 0 queued, 1 to submit, 2 process(es) each" in log, log
    job = json.load(open(os.path.join(workdir, "slurm", "jobs.json")))[bad_cell].split("_")[0]
    rc, log = _sweep(env, "--backend", "slurm", "--processes", "2", *grid)
    assert rc == 0 and "1 queued, 0 to submit" in log, log
  finally:
    _partition(env, "UP")
  cluster.wait_job(job, TIMEOUT)
  assert len(errors()) == before + 2
  # srun runs cells with --kill-on-bad-exit: both tasks fail on their own, and which of them
  # srun sees exit first decides whether it reports "tasks 0-1: Exited" or one task exited and
  # the other terminated; either way the step failed with a task's exit code 1.
  assert re.search(r"srun: error: localhost: tasks? [0-9-]+: Exited with exit code 1",
                   _log(bad_log))
  rc, log = _sweep(env, "--workdir", workdir, "--aggregate")
  assert rc == 1 and f"not ok: ['{bad_cell}']" in log, log


def _partition(env, state):
  subprocess.run(["scontrol", "update", "PartitionName=debug", f"State={state}"], env=env,
                 check=True, timeout=30)


def _aggregate(env, workdir):
  import csv  # pylint: disable=g-import-not-at-top
  rc, log = _sweep(env, "--workdir", workdir, "--aggregate")
  with open(os.path.join(workdir, "results.csv")) as f:
    return list(csv.DictReader(f))
