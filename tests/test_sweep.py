"""The sweep runner: real trainer processes, resumability, one CSV, failures reported.

One grid of two tiny cells (seeds) runs through the CLI with two processes side by side; the
tests then check the CSV against the cells' own metrics, that a re-run starts nothing, that a
cell whose summary is gone re-runs alone and resumes from its checkpoint, and that bad keys,
bad values, conflicting plans and crashing cells are reported by name.
"""
import csv
import gzip
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from trm_jax import config as config_lib
from trm_jax import run_archive, sweep
from trm_jax import workdir as wd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny_trm.py")

pytestmark = pytest.mark.slow


def _tiny(shared) -> list[str]:
  sets = ["total_steps=2", "ckpt_every=1", "eval_problems=4", "eval_every=0",
          "eval_samples=1", "export_hf=False", "rl.batch_size=16", "rl.group_size=4"]
  return sets + [f"{k}={v}" for k, v in shared.overrides().items()]


def _cli(*args, env=None):
  p = subprocess.run([sys.executable, "-m", "trm_jax.sweep", *args], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=900)
  return p.returncode, p.stdout + p.stderr


def _log_sizes(workdir):
  d = os.path.join(workdir, "cells")
  return {n: os.path.getsize(os.path.join(d, n, "log.txt")) for n in os.listdir(d)}


@pytest.fixture(scope="module")
def swept(tmp_path_factory, shared_run):
  tmp = tmp_path_factory.mktemp("sweep")
  workdir = str(tmp / "w")
  sets = [a for s in _tiny(shared_run) for a in ("--set", s)]
  rc, out = _cli("--config", CONFIG, "--workdir", workdir, "--grid", "seed=0,1", *sets,
                 "--parallel", "2", "--threads-per-cell", "1", "--plot", "reward,learner/entropy",
                 env=shared_run.env())
  assert rc == 0, out[-3000:]
  return tmp, workdir, sets, out


def test_grid_runs_and_csv_matches_the_cells(swept):
  _, workdir, _, out = swept
  assert "2 cells, 0 done, 2 to run, 2 at a time" in out
  with open(os.path.join(workdir, "results.csv")) as f:
    rows = list(csv.DictReader(f))
  assert sorted(r["cell"] for r in rows) == ["seed=0", "seed=1"]
  for r in rows:
    assert r["status"] == "ok" and r["total_steps"] == "2"
    with open(os.path.join(workdir, "cells", r["cell"], "metrics.jsonl")) as f:
      recs = [json.loads(line) for line in f]
    rewards = [x["reward"] for x in recs]
    assert [x["step"] for x in recs] == [1, 2]
    assert float(r["mean/reward"]) == pytest.approx(np.mean(rewards), abs=1e-12)
    assert float(r["final/reward"]) == pytest.approx(rewards[-1], abs=1e-12)
    with open(os.path.join(workdir, "cells", r["cell"], "summary.json")) as f:
      assert float(r["eval/greedy_accuracy"]) == json.load(f)["eval"]["greedy_accuracy"]
  # Different seeds, different rollouts: the cells really ran their own overrides.
  a, b = ([json.loads(line) for line in open(os.path.join(workdir, "cells", n,
                                                             "metrics.jsonl"))]
          for n in ("seed=0", "seed=1"))
  assert [x["response_len"] for x in a] != [x["response_len"] for x in b]
  assert os.path.getsize(os.path.join(workdir, "curves.png")) > 0


def test_rerun_skips_done_cells_and_resumes_unfinished(swept, shared_run):
  _, workdir, sets, _ = swept
  before = _log_sizes(workdir)
  rc, out = _cli("--config", CONFIG, "--workdir", workdir, "--grid", "seed=0,1", *sets,
                 env=shared_run.env())
  assert rc == 0 and "2 cells, 2 done, 0 to run" in out, out[-2000:]
  assert _log_sizes(workdir) == before
  # An interrupted cell (no summary.json) runs again, alone, from its last checkpoint.
  os.remove(os.path.join(workdir, "cells", "seed=1", "summary.json"))
  rc, out = _cli("--config", CONFIG, "--workdir", workdir, "--grid", "seed=0,1", *sets,
                 env=shared_run.env())
  assert rc == 0 and "2 cells, 1 done, 1 to run" in out, out[-2000:]
  after = _log_sizes(workdir)
  assert after["seed=0"] == before["seed=0"] and after["seed=1"] > before["seed=1"]
  with open(os.path.join(workdir, "cells", "seed=1", "log.txt")) as f:
    assert "resumed from step 2" in f.read()


def test_finished_runs_move_to_another_workdir(swept, tmp_path):
  """--archive writes the finished runs (no checkpoints); --restore rebuilds them in a fresh
  workdir as done cells: the same CSV rows, and a sweep there runs nothing. A damaged archive
  is refused with the file and line named."""
  _, workdir, sets, _ = swept
  path = str(tmp_path / "runs.jsonl.gz")
  rc, out = _cli("--workdir", workdir, "--archive", path)
  assert rc == 0 and "archived 2 finished runs" in out, out
  assert os.path.getsize(path) < 100_000          # summaries and metrics only
  with open(path, "rb") as f:
    first = f.read()
  run_archive.archive_runs(workdir, path)
  with open(path, "rb") as f:
    assert f.read() == first                      # same runs, same bytes
  # `cells` archives a subset (an experiment's own runs beside the ones it restored).
  _, planned = sweep.load_plan(workdir)
  one = str(tmp_path / "one.jsonl.gz")
  assert run_archive.archive_runs(workdir, one, cells=planned[1:]) == [planned[1].name]
  assert gzip.decompress(open(one, "rb").read()).decode().splitlines() == \
      gzip.decompress(first).decode().splitlines()[1:]
  # Each run carries the config it was made under (its config.json).
  entries = [json.loads(line) for line in gzip.decompress(first).decode().splitlines()]
  with open(os.path.join(workdir, "cells", "seed=1", "config.json")) as f:
    assert entries[1]["config"] == json.load(f) and entries[1]["spec"] == CONFIG
  other = str(tmp_path / "other")
  assert sweep.main(["--config", CONFIG, "--workdir", other, "--restore", path]) == 0
  assert all(sweep.is_done(other, sweep.Cell(n, ())) for n in ("seed=0", "seed=1"))
  assert run_archive.restore_runs(path, other, CONFIG) == []   # already there: nothing to do
  rows = lambda w: {r["cell"]: r for r in sweep.aggregate(w)}
  assert rows(other) == rows(workdir)
  # The same grid there runs nothing (no cell is launched, so no log is written).
  cells = sweep.product([("", sweep.parse_sets(sets[1::2]))], sweep.parse_grid_arg("seed=0,1"))
  logs = []
  sweep.run_sweep(CONFIG, cells, other, log=logs.append)
  assert "2 cells, 2 done, 0 to run" in logs[0], logs
  assert not any(os.path.exists(os.path.join(other, "cells", n, "log.txt"))
                 for n in ("seed=0", "seed=1"))
  bad = str(tmp_path / "bad.jsonl.gz")
  with gzip.open(bad, "wt") as f:
    f.write(gzip.decompress(first).decode().splitlines()[0] + "\n{\"cell\": 1}\n")
  with pytest.raises(config_lib.ConfigError, match="bad.jsonl.gz line 2"):
    run_archive.restore_runs(bad, str(tmp_path / "third"), CONFIG)
  # The SMD grid cannot adopt these runs as its own: refused naming both configs.
  smd = os.path.join(ROOT, "configs", "tiny_smd.py")
  rc, out = _cli("--config", smd, "--workdir", str(tmp_path / "smd"), "--restore", path)
  assert rc == 2 and not os.path.exists(tmp_path / "smd"), out
  line = out.strip().splitlines()[-1]
  assert line.startswith(f"error: {path} line 1 (cell 'seed=0') was made under --config "
                         f"{CONFIG}, not under --config {smd}: ")
  assert line.endswith("Restore it under its own config, or pass --allow_config_change to "
                       "count it as a run of this one")
  rc, out = _cli("--config", smd, "--workdir", str(tmp_path / "smd"), "--restore", path,
                 "--allow_config_change")
  assert rc == 0 and "restored 2 runs" in out, out


def test_aggregate_only_and_conflicting_plan(swept):
  _, workdir, sets, _ = swept
  os.remove(os.path.join(workdir, "results.csv"))
  rc, out = _cli("--workdir", workdir, "--aggregate")
  assert rc == 0 and os.path.exists(os.path.join(workdir, "results.csv")), out
  # Same cell name, different overrides: refused, nothing mixed into the old plan.
  cells = sweep.product([("", {"total_steps": 3})], sweep.axis("seed", [0]))
  with pytest.raises(config_lib.ConfigError, match="cell 'seed=0'"):
    sweep.run_sweep(CONFIG, cells, workdir)


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/status") as f:
      return "\nState:\tZ" not in f.read()   # a zombie has exited
  except FileNotFoundError:
    return False


def test_killed_sweep_takes_its_cells_with_it(swept, shared_run):
  """SIGKILL of the sweep must not leave its cell training as an orphan (a rerun would then
  start the same cell beside it)."""
  tmp, _, sets, _ = swept
  workdir = str(tmp / "killed")
  proc = subprocess.Popen([sys.executable, "-m", "trm_jax.sweep", "--config", CONFIG,
                           "--workdir", workdir, "--grid", "seed=0", *sets,
                           "--set", "total_steps=500"], cwd=ROOT, env=shared_run.env(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  lock = os.path.join(workdir, "cells", "seed=0", wd.LOCK_FILE)
  cell_pid = None
  deadline = time.time() + 300
  while time.time() < deadline and cell_pid is None and proc.poll() is None:
    try:
      with open(lock) as f:
        cell_pid = json.load(f)["pid"]      # the cell's trainer holds its workdir lock
    except (OSError, ValueError, KeyError):
      time.sleep(0.2)
  assert cell_pid is not None, "the cell never started"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  deadline = time.time() + 15
  while time.time() < deadline and (_alive(cell_pid) or not _lock_free(os.path.dirname(lock))):
    time.sleep(0.1)
  assert not _alive(cell_pid), "the cell outlived its sweep"
  assert _lock_free(os.path.dirname(lock)), "the cell's workdir lock outlived it"


def _wait_for(what, timeout=300):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if what():
      return True
    time.sleep(0.2)
  return False


def _last_step(workdir, name):
  try:
    with open(os.path.join(workdir, "cells", name, "metrics.jsonl")) as f:
      return max([json.loads(line)["step"] for line in f if line.strip()], default=0)
  except (OSError, ValueError):
    return 0


def test_a_stopped_sweep_checkpoints_its_cells_and_the_rerun_resumes_them(swept, shared_run):
  """SIGTERM to the sweep's own process (what `docker stop` and a pod's termination send),
  then SIGINT to its rerun (Ctrl-C): each time the running cell gets the signal once,
  checkpoints the step it is in (ckpt_every is far off), and the sweep exits with the signal's
  code and one line naming where the cell stopped; the rerun resumes it from there. Before,
  cells were SIGKILLed with the sweep (up to ckpt_every steps lost, or a save cut short)."""
  tmp, _, sets, _ = swept
  workdir = str(tmp / "stopped")
  names = ("seed=0",)    # one cell: the forwarding loops over every running one alike
  cmd = [sys.executable, "-m", "trm_jax.sweep", "--config", CONFIG, "--workdir", workdir,
         "--grid", "seed=0", *sets, "--set", "total_steps=500", "--set", "ckpt_every=400"]
  reached = {}
  for sig, expect in ((signal.SIGTERM, "stopped by SIGTERM"), (signal.SIGINT,
                                                                 "stopped by SIGINT")):
    before = dict(reached)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=shared_run.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert _wait_for(lambda: all(_last_step(workdir, n) > before.get(n, 0) for n in names)), (
        "the cells never stepped")
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + sig, (out + err)[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    reached = {n: _last_step(workdir, n) for n in names}
    said = "; ".join(f"{n} stopped (resumes from step {reached[n]})" for n in names)
    assert err.strip().splitlines()[-1] == (f"[sweep] {expect}: {said}. Rerun the same "
                                            f"command to resume (exit code {128 + sig})")
    for n in names:
      assert reached[n] > before.get(n, 0)
      ckpt = os.listdir(os.path.join(workdir, "cells", n, "ckpt"))
      assert str(reached[n]) in ckpt and not [d for d in ckpt if "tmp" in d], ckpt
      with open(os.path.join(workdir, "cells", n, "log.txt")) as f:
        log = f.read()
      # The signal reached the cell once (a second one would have ended it without saving).
      assert log.count(f"{signal.Signals(sig).name} received: finishing") == 1
      if before:
        assert f"resumed from step {before[n]}" in log


def _lock_free(workdir: str) -> bool:
  try:
    wd.WorkdirLock(workdir).release()
    return True
  except wd.WorkdirError:
    return False


def test_bad_overrides_fail_before_anything_runs(tmp_path):
  workdir = str(tmp_path / "w")
  with pytest.raises(config_lib.ConfigError, match="unknown config key 'optim.learning_rate'"):
    sweep.run_sweep(CONFIG, [sweep.Cell("a", (("optim.learning_rate", 1e-4),))], workdir)
  with pytest.raises(config_lib.ConfigError, match="rl.batch_size"):
    sweep.run_sweep(CONFIG, [sweep.Cell("a", (("rl.batch_size", "many"),))], workdir)
  with pytest.raises(config_lib.ConfigError, match="rl.batch_size"):   # validate(): 10 % 8
    sweep.run_sweep(CONFIG, [sweep.Cell("a", (("rl.batch_size", 10),))], workdir)
  assert not os.path.exists(os.path.join(workdir, "cells"))
  rc, out = _cli("--config", CONFIG, "--workdir", workdir, "--grid", "optim.lr")
  assert rc == 2 and "expected key=v1,v2" in out


@pytest.mark.parametrize("aggregate", [False, True])
def test_a_corrupt_plan_is_one_line(tmp_path, capsys, aggregate):
  workdir = tmp_path / "w"
  workdir.mkdir()
  (workdir / sweep.PLAN).write_text('{"config": "x", "cells": {"a": [[')   # torn write
  args = ["--aggregate"] if aggregate else ["--config", CONFIG, "--grid", "seed=0"]
  assert sweep.main(["--workdir", str(workdir), *args]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [f"error: {workdir / sweep.PLAN} is not valid JSON (line 1 column 34: Expecting "
                 "value); it is the sweep's plan: restore it, or rerun the sweep in another "
                 "--workdir"]
  assert not (workdir / "cells").exists()


def test_a_second_sweep_on_one_workdir_is_refused(tmp_path, capsys):
  """Before, each cell of the second sweep was refused by the cell's own lock, and the
  second sweep exited 0 as if it had run them."""
  workdir = str(tmp_path / "w")
  os.makedirs(workdir)
  with wd.WorkdirLock(workdir, name=sweep.LOCK, holder="sweep"):   # the first sweep
    rc = sweep.main(["--config", CONFIG, "--workdir", workdir, "--grid", "seed=0,1"])
  assert rc == 2
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert err.startswith(f"error: another sweep is running in {workdir} (pid {os.getpid()} on ")
  assert err.endswith("); wait for it to finish or stop it, or use another --workdir")
  assert not os.path.exists(os.path.join(workdir, sweep.PLAN))   # nothing planned or run


def test_crashing_cell_is_reported_and_others_unaffected(tmp_path):
  workdir = str(tmp_path / "w")
  cells = [sweep.Cell("missing", (("model.path", str(tmp_path / "no_such_checkpoint")),))]
  ended = []
  rows = sweep.run_sweep(CONFIG, cells, workdir, log=lambda _: None,
                         on_done=lambda c, status: ended.append((c.name, status)))
  assert rows[0]["status"] == "failed"
  assert ended == [("missing", "failed (exit 1)")]   # told as it ends, with its status
  with open(os.path.join(workdir, "cells", "missing", "log.txt")) as f:
    assert "no_such_checkpoint" in f.read()


def test_grid_construction():
  assert sweep.parse_grid_arg("optim.lr=1e-5,3e-5") == [
      ("lr=1e-05", {"optim.lr": 1e-5}), ("lr=3e-05", {"optim.lr": 3e-5})]
  crit = sweep.parse_grid_arg('trm.criteria=[("ser",), ("trm_max_kl", "trm_avg_kl")]')
  assert [lbl for lbl, _ in crit] == ["criteria=ser", "criteria=trm_max_kl+trm_avg_kl"]
  assert sweep.parse_grid_arg("rl.objective=tis,ppo_clip")[1][1] == {"rl.objective": "ppo_clip"}
  methods = [("m=a", {"rl.objective": "tis", "trm.criteria": ()}), ("m=b", {"rl.objective": "x"})]
  cells = sweep.product(methods, sweep.axis("seed", [0, 1]))
  assert [c.name for c in cells] == ["m=a,seed=0", "m=a,seed=1", "m=b,seed=0", "m=b,seed=1"]
  assert dict(cells[1].overrides) == {"rl.objective": "tis", "trm.criteria": (), "seed": 1}
  with pytest.raises(config_lib.ConfigError, match="share the directory"):
    sweep.product([("x", {}), ("x", {"seed": 1})])
  groups = sweep.group_cells(cells)
  assert sorted(groups) == ["objective=tis", "objective=x"] and all(len(g) == 2 for g in groups.values())


def test_span_counts_overlaps_once_and_not_the_pause_between_sessions():
  # Two runs at a time (0-10, 5-12), then the grid is stopped and resumed an hour later
  # (3600-3610 inside 3600-3620): 12 + 20 seconds of training, not 3620.
  spans = [(3600.0, 3620.0), (0.0, 10.0), (5.0, 12.0), (3600.0, 3610.0)]
  assert sweep.union_length(spans) == 32.0
  assert sweep.union_length([]) == 0.0
  assert sweep.union_length([(1.0, 2.0), (2.0, 3.0)]) == 2.0


def test_a_run_resumed_mid_grid_counts_its_steps_not_the_pause():
  # Steps of 2 s, an evaluation of 3 s at step 2; the run stops after step 2 and resumes an
  # hour later (the restore and start-up are not training either).
  run = [{"step": 0, "wall_time": 3.0, "eval/avg@4": 0.5, "time/eval_s": 3.0},
         {"step": 1, "wall_time": 5.0, "time/step_s": 2.0},
         {"step": 2, "wall_time": 10.0, "time/step_s": 2.0, "eval/avg@4": 0.6,
          "time/eval_s": 3.0},
         {"step": 3, "wall_time": 3612.0, "time/step_s": 2.0}]
  assert sweep.record_spans(run) == [(0.0, 3.0), (3.0, 5.0), (5.0, 10.0), (3610.0, 3612.0)]
  assert sweep.union_length(sweep.record_spans(run)) == 12.0
  # A log from before time/eval_s: an evaluation record stands for the time since the last.
  old = [{k: v for k, v in r.items() if k != "time/eval_s"} for r in run]
  assert sweep.record_spans(old)[2] == (5.0, 10.0) and sweep.record_spans(old)[0] == (3.0, 3.0)


def test_span_and_rows_of_some_cells_are_only_theirs(tmp_path):
  # Two phases planned in one workdir (the plan merges them): each phase's span and CSV rows
  # are its own runs', and the default is every planned cell's.
  workdir = str(tmp_path)
  a, b = sweep.Cell("a", (("seed", 0),)), sweep.Cell("b", (("seed", 1),))
  sweep.check_plan(workdir, "configs/tiny_trm.py", [a])
  sweep.check_plan(workdir, "configs/tiny_trm.py", [b])
  for c, (t0, t1) in ((a, (0.0, 10.0)), (b, (100.0, 130.0))):
    d = sweep.cell_dir(workdir, c)
    os.makedirs(d)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
      f.write(json.dumps({"step": 1, "wall_time": t1, "time/step_s": t1 - t0}) + "\n")
    with open(os.path.join(d, "summary.json"), "w") as f:
      json.dump({}, f)
  assert sweep.span_seconds(workdir, [a]) == 10.0
  assert sweep.span_seconds(workdir, [b]) == 30.0
  assert sweep.span_seconds(workdir) == 40.0
  out = str(tmp_path / "b.csv")
  assert [r["cell"] for r in sweep.aggregate(workdir, out, [b])] == ["b"]
  with open(out) as f:
    assert [r["cell"] for r in csv.DictReader(f)] == ["b"]
  assert [r["cell"] for r in sweep.aggregate(workdir)] == ["a", "b"]


# --- archives that cannot escape or lie, and the sweep's command line -------------------------
def _archive(path, *entries):
  """An archive of synthetic runs: each entry's fields over a valid run of tiny_trm."""
  base = {"overrides": [["seed", 0]], "spec": CONFIG,
          "config": json.loads(config_lib.load_config(CONFIG).to_json_best_effort()),
          "summary": {"summary": {}, "eval": {}}, "metrics": '{"step": 1, "reward": 0.5}\n'}
  with gzip.open(path, "wt") as f:
    for e in entries:
      f.write(json.dumps({**base, **e}) + "\n")
  return str(path)


@pytest.mark.parametrize("entry,why", [
    ({"cell": "../../victim"}, "cell name '../../victim' is not a plain directory name"),
    ({"cell": "/tmp/victim"}, "cell name '/tmp/victim' is not a plain directory name"),
    ({"cell": "a", "overrides": [["optim.learning_rate", 1e-4]]},
     "sweep override: unknown config key 'optim.learning_rate'"),
    ({"cell": "a", "overrides": [["rl.batch_size", "many"]]}, "sweep override rl.batch_size="),
    ({"cell": "a", "summary": ["not", "a", "summary"]}, "field 'summary' is list"),
    ({"cell": "a", "summary": {"eval": 0.5}}, "summary field 'eval' is float"),
    ({"cell": "a", "metrics": {"step": 1}}, "field 'metrics' is dict"),
    ({"cell": "a", "metrics": "[1, 2]\n"}, "metrics line 1 is list"),
])
def test_a_bad_archive_entry_refuses_the_whole_restore(tmp_path, capsys, entry, why):
  """An escaping name once replaced another run's metrics and marked it finished; here the
  good first entry is not written either: nothing is."""
  path = _archive(tmp_path / "a.jsonl.gz", {"cell": "good"}, entry)
  workdir = tmp_path / "w"
  assert sweep.main(["--config", CONFIG, "--workdir", str(workdir), "--restore", path]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"error: {path} line 2") and why in err[0], err
  assert not workdir.exists() and not (tmp_path / "victim").exists()


def test_a_symlinked_cell_directory_is_refused_and_old_archives_warn(tmp_path):
  workdir, elsewhere = tmp_path / "w", tmp_path / "elsewhere"
  (workdir / "cells").mkdir(parents=True)
  elsewhere.mkdir()
  os.symlink(elsewhere, workdir / "cells" / "a")
  path = _archive(tmp_path / "a.jsonl.gz", {"cell": "a"})
  with pytest.raises(config_lib.ConfigError, match="resolves outside"):
    run_archive.restore_runs(path, str(workdir), CONFIG)
  assert os.listdir(elsewhere) == []
  # An archive written before runs carried their config restores, saying it was not checked.
  logs = []
  old = _archive(tmp_path / "old.jsonl.gz", {"cell": "b", "config": None, "spec": None})
  assert run_archive.restore_runs(old, str(tmp_path / "v"), CONFIG, log=logs.append) == ["b"]
  assert logs == [f"[sweep] warning: 1 runs in {old} record no config (archived before runs "
                  f"carried one): restored as runs of --config {CONFIG} without checking"]


def test_sweep_command_line_mistakes_are_one_line(tmp_path, capsys):
  workdir = tmp_path / "w"
  for n in ("0", "-1"):
    with pytest.raises(SystemExit) as e:   # argparse's usage error: exit 2, one line after usage
      sweep.main(["--config", CONFIG, "--workdir", str(workdir), "--grid", "seed=0",
                  "--parallel", n])
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"argument --parallel: must be >= 1, got {n}")
  workdir.mkdir()
  assert sweep.main(["--config", CONFIG, "--workdir", str(workdir), "--grid",
                     "task.name=a b,a_b"]) == 2
  assert capsys.readouterr().err.strip() == (
      "error: grid cells 'name=a b' and 'name=a_b' would share the directory name 'name=a_b' "
      "(names keep only letters, digits and _.,=+-); give the variants distinct values")
  # --archive into a missing directory, and of a done cell whose metrics are gone.
  cell = sweep.Cell("seed=0", (("seed", 0),))
  sweep.check_plan(str(workdir), CONFIG, [cell])
  d = sweep.cell_dir(str(workdir), cell)
  os.makedirs(d)
  with open(os.path.join(d, "summary.json"), "w") as f:
    json.dump({}, f)
  missing = tmp_path / "no" / "runs.jsonl.gz"
  assert sweep.main(["--workdir", str(workdir), "--archive", str(missing)]) == 2
  assert capsys.readouterr().err.strip() == (
      f"error: --archive {missing}: directory {missing.parent} does not exist")
  out = tmp_path / "runs.jsonl.gz"
  assert sweep.main(["--workdir", str(workdir), "--archive", str(out)]) == 2
  assert capsys.readouterr().err.strip() == (
      f"error: cell 'seed=0' is done (summary.json) but {d}/metrics.jsonl cannot be read (No "
      "such file or directory): its run cannot be archived")
  assert not out.exists() and not os.path.exists(f"{out}.tmp")
