r"""Batch experiments: a grid of config overrides, run as processes, resumable, one CSV.

  python -m trm_jax.sweep --config configs/tiny_trm.py --workdir /tmp/sweep \
      --grid optim.lr=1e-5,3e-5 --grid seed=0,1,2 --set total_steps=40 --parallel 2
  python -m trm_jax.sweep --workdir /tmp/sweep --aggregate   # CSV + plots only
  python -m trm_jax.sweep --workdir /tmp/sweep --archive runs.jsonl.gz   # finished runs, to move
  python -m trm_jax.sweep --config configs/tiny_trm.py --workdir /tmp/other \
      --restore runs.jsonl.gz                                 # ... into another workdir
  python -m trm_jax.sweep --backend slurm --processes 8 --sbatch-arg=--partition=gpu \
      --config configs/tiny_trm.py --workdir /shared/sweep --grid seed=0,1,2   # a job array

Each cell is one `trm_jax.train.run` in its own process and its own workdir
(`WORKDIR/cells/<name>`), so a crash in one cell loses nothing else and cells can run side by
side. A cell is done when its `summary.json` exists; re-running the same command skips done
cells and resumes unfinished ones from their last orbax checkpoint (the trainer's own resume).
The plan (config + cells) is stored in `WORKDIR/sweep.json`; re-running with a different plan
for an existing cell name is an error rather than a silent mix of two experiments. One sweep
runs per workdir (`WORKDIR/.sweep.lock`, a second is refused with exit 2).

SIGTERM or SIGINT (Ctrl-C, `kill`, `docker stop`, a pod's termination) stop a local sweep
without losing steps: no more cells start, the running ones are sent the signal (each finishes
its step and checkpoints it), the sweep waits for them (at most `--stop-timeout` seconds, then
kills the rest and names them), says where each cell stopped, and exits 128 + the signal number
(143, 130). The same command resumes every cell from its checkpoint. `--archive` and
`--restore` move finished runs between workdirs (`trm_jax.run_archive`).

Cells share one persistent XLA compilation cache (`WORKDIR/jax_cache`), so cells that differ
only in data (seeds) or in values that are arrays at run time compile once. The warm-up base
model is built once, in this process, before any cell starts (parallel cells would otherwise
race to build it).

`--backend local` (the default) runs the cells as processes of this machine. `--backend slurm`
submits the cells not done as one SLURM job array (one array task per cell, `--parallel` caps
how many run at once) and returns; each task is one job step of `--processes` tasks, so a
cell is one multi-process trainer. Re-running the command submits only the cells that are not
done and not still queued; `--aggregate` collects whenever you like (`--wait` does both).

Aggregation writes `results.csv`: one row per cell with its overrides, status, the reward
summary (first/last 10 % means), the held-out evaluation, and the mean over steps and final
value of every logged metric. `plot_grouped` draws curves averaged over seeds.
"""
from __future__ import annotations

import argparse
import ast
import csv
import dataclasses
import hashlib
import io
import itertools
import json
import logging
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np

from trm_jax import config as config_lib
from trm_jax import preemption
from trm_jax import workdir as wd
from trm_jax.metrics import RESERVED_KEYS, read_metrics, rolling_mean, series

PLAN = "sweep.json"
RESULTS = "results.csv"
LOCK = ".sweep.lock"  # one sweep runner per workdir (its cells lock their own directories)


# A cell's name is its directory under WORKDIR/cells: the characters `_slug` keeps, so that a
# name read from a plan or an archive cannot reach outside it.
_CELL_NAME = re.compile(r"[A-Za-z0-9_.,=+-]+")


@dataclasses.dataclass(frozen=True)
class Cell:
  """One run of the grid: a name (its directory) and the config overrides that define it."""
  name: str
  overrides: tuple  # ((dotted key, value), ...), in the order they are applied

  def __post_init__(self):
    if not (isinstance(self.name, str) and _CELL_NAME.fullmatch(self.name)
            and self.name not in (".", "..")):
      raise config_lib.ConfigError(
          f"cell name {self.name!r} is not a plain directory name (letters, digits and "
          "_.,=+-, not '.' or '..'): it would be written outside WORKDIR/cells")


def _fmt(v: Any) -> str:
  if isinstance(v, (tuple, list)):
    return "+".join(_fmt(x) for x in v) or "none"
  return str(v)


def _slug(label: str) -> str:
  s = re.sub(r"[^A-Za-z0-9_.,=+-]+", "_", label)
  if len(s) <= 80:
    return s
  return s[:70] + "-" + hashlib.sha1(label.encode()).hexdigest()[:8]


def axis(key: str, values: Iterable[Any]) -> list[tuple[str, dict]]:
  """One grid axis over a single config key: [(label, {key: value}), ...]."""
  return [(f"{key.split('.')[-1]}={_fmt(v)}", {key: v}) for v in values]


def product(*axes: Sequence[tuple[str, Mapping[str, Any]]]) -> list[Cell]:
  """The cartesian product of axes; an axis is a list of (label, overrides) variants.

  A variant may set several keys at once (a "method" = objective + criteria), which a plain
  key=values axis cannot express. Later axes override earlier ones on shared keys.
  """
  cells = []
  for combo in itertools.product(*axes):
    label = ",".join(lbl for lbl, _ in combo if lbl) or "base"
    ov = {}
    for _, o in combo:
      ov.update(o)
    cells.append(Cell(_slug(label), tuple(ov.items())))
  labels: dict[str, list] = {}
  for combo, cell in zip(itertools.product(*axes), cells):
    labels.setdefault(cell.name, []).append(",".join(lbl for lbl, _ in combo if lbl) or "base")
  dup = {n: ls for n, ls in labels.items() if len(ls) > 1}
  if dup:
    name, ls = next(iter(dup.items()))
    raise config_lib.ConfigError(
        f"grid cells {' and '.join(map(repr, ls))} would share the directory name {name!r} "
        "(names keep only letters, digits and _.,=+-); give the variants distinct values")
  return cells


def parse_grid_arg(arg: str) -> list[tuple[str, dict]]:
  """`key=v1,v2,...` (each value a Python literal, else a string) or `key=[literal, ...]`."""
  key, sep, vals = arg.partition("=")
  if not sep or not key:
    raise config_lib.ConfigError(f"--grid {arg!r}: expected key=v1,v2,...")
  if vals.strip().startswith("["):
    values = list(ast.literal_eval(vals))
  else:
    values = [_literal(v) for v in vals.split(",")]
  return axis(key, values)


def _literal(s: str) -> Any:
  try:
    return ast.literal_eval(s)
  except (ValueError, SyntaxError):
    return s


def parse_sets(sets: Iterable[str]) -> dict:
  """`--set KEY=V` flags -> {key: value}, each value a Python literal, else a string."""
  return {k: _literal(v) for k, _, v in (s.partition("=") for s in sets)}


def apply_overrides(c, overrides: Iterable[tuple[str, Any]]):
  """Sets dotted keys on a ConfigDict (in place); unknown keys and wrong types name the key."""
  keys = set(config_lib.all_keys(c))
  for key, value in overrides:
    if key not in keys:
      raise config_lib.ConfigError(f"sweep override: unknown config key '{key}'")
    *parents, leaf = key.split(".")
    node = c
    for p in parents:
      node = node[p]
    if isinstance(node[leaf], tuple) and isinstance(value, list):
      value = tuple(value)
    try:
      node[leaf] = value
    except (TypeError, ValueError) as e:
      raise config_lib.ConfigError(f"sweep override {key}={value!r}: {e}") from e
  return c


def cell_config(spec: str, overrides: Iterable[tuple[str, Any]]):
  c = apply_overrides(config_lib.load_config(spec), overrides)
  config_lib.validate(c)
  config_lib.check_task_files(c.task)
  return c


# --- Running ------------------------------------------------------------------------------------

def cell_dir(workdir: str, cell: Cell) -> str:
  return os.path.join(workdir, "cells", cell.name)


def is_done(workdir: str, cell: Cell) -> bool:
  path = os.path.join(cell_dir(workdir, cell), "summary.json")
  try:
    with open(path) as f:
      json.load(f)
    return True
  except (OSError, ValueError):
    return False


def check_plan(workdir: str, spec: str, cells: Sequence[Cell]) -> None:
  """Merges `cells` into WORKDIR/sweep.json; a cell name already planned differently fails."""
  path = os.path.join(workdir, PLAN)
  new = {c.name: [list(kv) for kv in c.overrides] for c in cells}
  plan = {"config": spec, "cells": {}}
  if os.path.exists(path):
    plan = _read_plan(path)
    if plan["config"] != spec:
      raise config_lib.ConfigError(
          f"{path} was planned with --config {plan['config']!r}, not {spec!r}; use another "
          "--workdir")
  for name, ov in new.items():
    old = plan["cells"].get(name)
    # Same overrides in any order (and tuples read back as lists) are the same cell.
    if old is not None and (json.dumps(dict(old), sort_keys=True) !=
                            json.dumps(dict(ov), sort_keys=True)):
      raise config_lib.ConfigError(
          f"cell {name!r} in {path} has overrides {old}, this sweep gives {ov}")
    plan["cells"][name] = ov
  wd.write_json_atomic(path, plan)


def _read_plan(path: str) -> dict:
  """WORKDIR/sweep.json; one-line errors for a missing, unreadable or damaged file."""
  try:
    with open(path) as f:
      plan = json.load(f)
  except FileNotFoundError:
    raise config_lib.ConfigError(f"{path} does not exist: no sweep was planned in this "
                                 "--workdir") from None
  except (OSError, UnicodeDecodeError) as e:
    raise config_lib.ConfigError(f"{path} cannot be read: {e}") from None
  except json.JSONDecodeError as e:
    raise config_lib.ConfigError(
        f"{path} is not valid JSON (line {e.lineno} column {e.colno}: {e.msg}); it is the "
        "sweep's plan: restore it, or rerun the sweep in another --workdir") from None
  if not (isinstance(plan, dict) and isinstance(plan.get("config"), str) and
          isinstance(plan.get("cells"), dict)):
    raise config_lib.ConfigError(f"{path} is not a sweep plan (expected an object with "
                                 "'config' and 'cells')")
  return plan


def load_plan(workdir: str) -> tuple[str, list[Cell]]:
  plan = _read_plan(os.path.join(workdir, PLAN))
  return plan["config"], [Cell(n, tuple(tuple(kv) for kv in ov))
                          for n, ov in plan["cells"].items()]


def _env(workdir: str, threads: Optional[int]) -> dict:
  env = dict(os.environ)
  env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(workdir, "jax_cache"))
  env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
  if threads:
    # Parallel cells on a few cores: one XLA intra-op pool each instead of all fighting.
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_cpu_multi_thread_eigen=false"
                        f" intra_op_parallelism_threads={threads}").strip()
  return env


def _write_cell(spec: str, cell: Cell, workdir: str) -> str:
  """The cell's directory with its cell.json: all a cell process needs (`--run-cell DIR`)."""
  d = cell_dir(workdir, cell)
  os.makedirs(d, exist_ok=True)
  wd.write_json_atomic(os.path.join(d, "cell.json"),
                       {"config": spec, "overrides": [list(kv) for kv in cell.overrides]})
  return d


def _launch(spec: str, cell: Cell, workdir: str, env: dict) -> tuple[subprocess.Popen, int]:
  """(the cell's process, the size of its log before it started). The cell runs in a process
  group of its own: signals reach it through the sweep (`preemption.Forward`), not from the
  terminal."""
  d = _write_cell(spec, cell, workdir)
  path = os.path.join(d, "log.txt")
  at = os.path.getsize(path) if os.path.exists(path) else 0
  with open(path, "a") as log:
    proc = subprocess.Popen([sys.executable, "-m", "trm_jax.sweep", "--run-cell", d,
                             "--parent-pid", str(os.getpid())],
                            stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
  return proc, at


def _die_with_parent(parent_pid: int) -> None:
  """Ends this cell process when the sweep that launched it dies, however it dies.

  A cell that outlived a SIGKILLed sweep would keep training while a rerun of the sweep
  starts the same cell again (the workdir lock then refuses the second one, but the orphan
  still finishes a run nobody is watching). Linux delivers SIGKILL on the parent's death
  (PR_SET_PDEATHSIG); elsewhere a watchdog thread polls the parent pid.
  """
  if sys.platform.startswith("linux"):
    import ctypes  # pylint: disable=g-import-not-at-top
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
  # Also covers the race where the parent died before prctl ran, and non-Linux systems.
  def watch():
    while os.getppid() == parent_pid:
      time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)
  if os.getppid() != parent_pid:
    os.kill(os.getpid(), signal.SIGKILL)
  threading.Thread(target=watch, daemon=True).start()


def _ensure_base_models(spec: str, cells: Sequence[Cell]) -> None:
  from trm_jax import warmup  # jax import only when cells are actually run
  seen = set()
  for cell in cells:
    c = cell_config(spec, cell.overrides)
    # The settings that decide the base model are warm-up's own fingerprint.
    key = json.dumps([c.model.path, warmup._fingerprint(c)], sort_keys=True)
    if key not in seen:
      seen.add(key)
      warmup.ensure_base_model(c, log=lambda m: print(m, flush=True))


def plan_sweep(spec: str, cells: Sequence[Cell], workdir: str) -> None:
  """Validates every cell (keys, types, cross-field checks) and records the plan, before any
  cell runs or is submitted."""
  for cell in cells:
    cell_config(spec, cell.overrides)   # fail fast on a bad key or value
  os.makedirs(workdir, exist_ok=True)
  check_plan(workdir, spec, cells)


# How long a stopped sweep waits for its cells to checkpoint the step they are in (the
# trainer finishes it first: a step of a large model takes minutes) before it kills them.
STOP_TIMEOUT_S = 600.0


def _heard_signal(workdir: str, cell: Cell, offset: int) -> Callable[[], bool]:
  """Whether the cell's log shows it took a stop request after byte `offset` (where the log
  was when the cell was launched)."""
  def heard() -> bool:
    try:
      with open(os.path.join(cell_dir(workdir, cell), "log.txt"), "rb") as f:
        f.seek(offset)
        return preemption.HEARD.encode() in f.read()
    except OSError:
      return False
  return heard


def checkpoint_step(workdir: str, cell: Cell) -> Optional[int]:
  """The newest finalized checkpoint step in the cell's ckpt/ (orbax names a finished step's
  directory by its number), or None."""
  try:
    steps = [int(n) for n in os.listdir(os.path.join(cell_dir(workdir, cell), "ckpt"))
             if n.isdigit()]
  except OSError:
    return None
  return max(steps) if steps else None


def _stopped(workdir: str, cell: Cell, rc: Optional[int]) -> str:
  """How a cell ended after the sweep's stop request, for the log."""
  step = checkpoint_step(workdir, cell)
  at = "no checkpoint yet" if step is None else f"resumes from step {step}"
  if rc == 0 and is_done(workdir, cell):
    return "finished"
  if rc is None:
    return f"did not checkpoint in time, killed ({at})"
  if rc in (preemption.exit_code(s) for s in preemption.SIGNALS):
    return f"stopped ({at})"
  return f"failed (exit {rc}; {at})"


def run_sweep(spec: str, cells: Sequence[Cell], workdir: str, *, parallel: int = 1,
              threads_per_cell: Optional[int] = None, log=print,
              on_done: Optional[Callable[[Cell, str], None]] = None,
              stop_timeout_s: float = STOP_TIMEOUT_S) -> list[dict]:
  """Runs every cell not yet done, `parallel` at a time; returns the aggregated rows.

  Cells are validated (keys, types, cross-field checks) before anything runs. A failed cell
  is reported in its row (`status=failed`, log in its directory); the others still run.
  `on_done(cell, status)` is called as each launched cell ends ("ok" or "failed (exit N)"),
  so a grid of hours can copy its finished runs somewhere safe (`run_archive.archive_runs`)
  as it goes rather than only at the end, which a lost machine never reaches.

  SIGTERM / SIGINT (`preemption.Forward`) stop the sweep: the running cells checkpoint their
  step (within `stop_timeout_s`, else they are killed), and `preemption.Preempted` says where
  each stopped; the same command resumes them.
  """
  if parallel < 1:
    raise config_lib.ConfigError(f"--parallel {parallel}: must be >= 1")
  with preemption.Forward("cell") as stop:
    plan_sweep(spec, cells, workdir)
    todo = [c for c in cells if not is_done(workdir, c)]
    log(f"[sweep] {len(cells)} cells, {len(cells) - len(todo)} done, {len(todo)} to run, "
        f"{parallel} at a time")
    if todo:
      _ensure_base_models(spec, todo)
    env = _env(workdir, threads_per_cell if parallel > 1 else None)
    running: dict = {}   # cell -> (process, start time, whether it heard a signal itself)
    ended: dict = {}     # cell -> how it ended after the stop request
    t0 = time.time()
    stop.armed = True
    while (todo and stop.signum is None) or running:
      while todo and len(running) < parallel and stop.signum is None:
        cell = todo.pop(0)
        proc, log_at = _launch(spec, cell, workdir, env)
        running[cell] = (proc, time.time(), _heard_signal(workdir, cell, log_at))
      time.sleep(0.5)
      stop.forward({cell: (proc, heard) for cell, (proc, _, heard) in running.items()})
      late = stop.signum is not None and time.time() > stop.at + stop_timeout_s
      for cell, (proc, started, _) in list(running.items()):
        rc, killed = proc.poll(), False
        if rc is None:
          if not late:
            continue
          proc.kill()
          proc.wait()
          killed = True
        del running[cell]
        status = "ok" if rc == 0 and is_done(workdir, cell) else f"failed (exit {rc})"
        if stop.signum is None:
          log(f"[sweep] {cell.name}: {status} in {time.time() - started:.0f}s "
              f"(sweep {time.time() - t0:.0f}s)")
        else:
          ended[cell] = _stopped(workdir, cell, None if killed else rc)
          log(f"[sweep] {cell.name}: {ended[cell]}")
        if on_done is not None and (stop.signum is None or status == "ok"):
          on_done(cell, status)
  if stop.signum is not None:
    name = signal.Signals(stop.signum).name
    said = "; ".join(f"{c.name} {ended[c]}" for c in cells if c in ended) or (
        "no cell was running")
    lost = [c.name for c in cells if ended.get(c, "").startswith("did not")]
    raise preemption.Preempted(
        f"[sweep] stopped by {name}: {said}" + (f"; {len(todo)} cells not started" if todo
                                                else "")
        + (f". Not saved within {stop_timeout_s:.0f}s: {', '.join(lost)}" if lost else "")
        + ". Rerun the same command to resume", stop.signum)
  return aggregate(workdir)


# --- The SLURM backend ---------------------------------------------------------------------
# The grid is one job array: array task i runs cell i of the submission's list, as one job step
# of `processes` tasks (`srun --ntasks`), so a multi-process cell is one multi-host trainer
# whose processes find each other from SLURM's variables (train.init_distributed). The sweep
# process only submits; the cells write the same cell directories as the local backend, so
# skipping done cells, resuming unfinished ones and `--aggregate` are the same code. Cells of
# an earlier submission still queued or running are not submitted again.
SLURM_DIR = "slurm"
SLURM_JOBS = "jobs.json"   # {cell name: "ARRAYJOB_INDEX"} of the latest submission of each cell

_BATCH_SCRIPT = """#!/bin/bash
# Written by trm_jax.sweep: array task i runs line i+1 of {cells} as one job step.
set -euo pipefail
cell="$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" {cells})"
exec srun --ntasks={processes} --kill-on-bad-exit=1 {python} -m trm_jax.sweep --run-cell "$cell" \\
    >> "$cell/log.txt" 2>&1
"""


def _slurm(argv: Sequence[str], env: Optional[dict] = None) -> str:
  try:
    p = subprocess.run(list(argv), capture_output=True, text=True, env=env, timeout=120)
  except FileNotFoundError:
    raise config_lib.ConfigError(f"--backend slurm: {argv[0]} not found (SLURM's client "
                                 "commands must be on PATH)") from None
  if p.returncode != 0:
    raise config_lib.ConfigError(f"{argv[0]} failed (exit {p.returncode}): "
                                 f"{(p.stderr or p.stdout).strip()}")
  return p.stdout


def _queued(workdir: str, cells: Sequence[Cell]) -> dict:
  """{cell name: array task id} of the cells whose latest submission is still in the queue."""
  path = os.path.join(workdir, SLURM_DIR, SLURM_JOBS)
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    jobs = json.load(f)
  mine = {c.name: jobs[c.name] for c in cells if c.name in jobs}
  if not mine:
    return {}
  arrays = sorted({j.split("_")[0] for j in mine.values()})
  # -r: one line per array task ("123_4"), pending ones included.
  out = _slurm(["squeue", "-h", "-r", "-o", "%i", "--jobs", ",".join(arrays)])
  live = set(out.split())
  return {n: j for n, j in mine.items() if j in live}


def submit_slurm(spec: str, cells: Sequence[Cell], workdir: str, *, processes: int = 1,
                 parallel: int = 0, sbatch_args: Sequence[str] = (), wait: bool = False,
                 env: Optional[dict] = None, log=print) -> Optional[str]:
  """Submits the cells not done (and not queued) as one job array; returns its job id.

  With `wait`, returns after every array task left the queue. `parallel` > 0 caps the
  array tasks running at once (`--array=...%parallel`); `sbatch_args` go to sbatch as they
  are (partition, time, gres, account).
  """
  if processes < 1:
    raise ValueError(f"processes={processes}; must be >= 1")
  queued = _queued(workdir, cells)
  todo = [c for c in cells if not is_done(workdir, c) and c.name not in queued]
  log(f"[sweep] {len(cells)} cells, {sum(is_done(workdir, c) for c in cells)} done, "
      f"{len(queued)} queued, {len(todo)} to submit, {processes} process(es) each")
  if not todo:
    return None
  _ensure_base_models(spec, todo)
  d = os.path.join(workdir, SLURM_DIR)
  os.makedirs(d, exist_ok=True)
  stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
  listing = os.path.join(d, f"cells-{stamp}.txt")
  for cell in todo:
    _write_cell(spec, cell, workdir)
  with open(listing, "w") as f:
    f.write("".join(os.path.abspath(cell_dir(workdir, c)) + "\n" for c in todo))
  script = os.path.join(d, f"array-{stamp}.sh")
  with open(script, "w") as f:
    f.write(_BATCH_SCRIPT.format(cells=shlex.quote(listing), processes=processes,
                                 python=shlex.quote(sys.executable)))
  array = f"0-{len(todo) - 1}" + (f"%{parallel}" if parallel else "")
  argv = ["sbatch", "--parsable", f"--array={array}", f"--ntasks={processes}",
          "--job-name=trm_sweep", f"--output={d}/%A_%a.out", *sbatch_args, script]
  job = _slurm(argv, env=env).strip().split(";")[0]   # --parsable: "jobid[;cluster]"
  path = os.path.join(d, SLURM_JOBS)
  jobs = {}
  if os.path.exists(path):
    with open(path) as f:
      jobs = json.load(f)
  jobs.update({c.name: f"{job}_{i}" for i, c in enumerate(todo)})
  wd.write_json_atomic(path, jobs)
  log(f"[sweep] submitted job array {job} ({len(todo)} tasks: {script})")
  if wait:
    # Polled rather than `sbatch --wait`, which exits non-zero when a task failed: a failed
    # cell is a status in the CSV here, not a submission error.
    while _slurm(["squeue", "-h", "-r", "-o", "%i", "--jobs", job]).strip():
      time.sleep(1.0)
    log(f"[sweep] job array {job} ended")
  return job


def _run_cell(d: str, parent_pid: Optional[int]) -> int:
  if parent_pid is not None:
    _die_with_parent(parent_pid)
  with open(os.path.join(d, "cell.json")) as f:
    spec = json.load(f)
  c = cell_config(spec["config"], [tuple(kv) for kv in spec["overrides"]])
  # As `python -m trm_jax.train` does: the trainer's progress (warm-up, resume) goes to the log.
  # Configured before the trainer is imported (absl would install its own root handler).
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
  logging.getLogger("absl").setLevel(logging.WARNING)
  from trm_jax import train  # pylint: disable=g-import-not-at-top
  try:
    # A cell run as a multi-task SLURM step is one multi-process trainer (a no-op otherwise).
    train.init_distributed()
    train.run(c, d, progress=False)
  except train.USER_ERRORS as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  except train.preemption.Preempted as e:   # checkpointed; the sweep's rerun resumes it
    print(str(e), file=sys.stderr)
    return e.code
  return 0


# --- Aggregation -------------------------------------------------------------------------------

def span_seconds(workdir: str, cells: Optional[Sequence[Cell]] = None) -> float:
  """Training span of the finished `cells` (default: every cell the workdir's plan holds,
  which is the union of every grid run in it: an experiment whose phases share a workdir
  passes each phase's cells, or a phase's span counts the others' runs): the time during
  which at least one of them was training, from the steps' own clocks, so a later
  re-aggregation or re-evaluation does not count, nor does the pause of a grid stopped on one
  machine and resumed later, even inside a cell that was stopped mid-run. Each metrics
  record stands for the interval [wall_time - time/step_s - time/eval_s, wall_time] (the step
  and its held-out evaluation); the union of all intervals is counted once. Excludes process
  start-up, checkpoint restore and the one-off base-model warm-up.

  Records written before the trainer logged `time/eval_s` that carry an evaluation stand
  for the whole interval since the previous record (the step and its evaluation then, but
  also any pause that ended there)."""
  if cells is None:
    _, cells = load_plan(workdir)
  return union_length([span for c in cells if is_done(workdir, c) for span in record_spans(
      read_metrics(os.path.join(cell_dir(workdir, c), "metrics.jsonl")))])


def record_spans(records) -> list[tuple[float, float]]:
  """One run's metrics records -> the (start, end) interval each stands for (`span_seconds`)."""
  spans, prev = [], None
  for r in records:
    if "wall_time" not in r:
      continue
    end = r["wall_time"]
    if prev is not None and "time/eval_s" not in r and any(k.startswith("eval/") for k in r):
      spans.append((prev, end))                       # written before time/eval_s existed
    else:
      spans.append((end - (r.get("time/step_s") or 0.0) - (r.get("time/eval_s") or 0.0), end))
    prev = end
  return spans


def union_length(spans) -> float:
  """Total length covered by [start, end] intervals (overlaps counted once)."""
  total, reach = 0.0, -math.inf
  for start, end in sorted(spans):
    if end > reach:
      total += end - max(start, reach)
      reach = end
  return total


def cell_row(workdir: str, cell: Cell) -> dict:
  """One CSV row: overrides, status, reward summary, evaluation, mean/final of each metric."""
  row = {"cell": cell.name}
  row.update({k: _fmt(v) for k, v in cell.overrides})
  d = cell_dir(workdir, cell)
  if not is_done(workdir, cell):
    row["status"] = "failed" if os.path.exists(os.path.join(d, "log.txt")) else "pending"
    return row
  with open(os.path.join(d, "summary.json")) as f:
    summ = json.load(f)
  row["status"] = "ok"
  row["wall_s"] = summ.get("wall_s")
  s = summ.get("summary", {})
  for k in ("first_mean", "last_mean", "delta"):
    row[f"reward/{k}"] = s.get(k)
  for k, v in summ.get("eval", {}).items():
    row[f"eval/{k}"] = v
  for k, e in s.get("evals", {}).items():  # with eval_every > 0: the step-0 evaluation too
    if e["first_step"] < e["last_step"]:
      row[f"eval_first/{k}"] = e["first"]
  records = read_metrics(os.path.join(d, "metrics.jsonl"))
  keys = sorted({k for r in records for k in r if k not in RESERVED_KEYS})
  for k in keys:
    vals = np.array([r[k] for r in records if isinstance(r.get(k), (int, float))], float)
    vals = vals[np.isfinite(vals)]
    row[f"mean/{k}"] = float(vals.mean()) if len(vals) else None
    row[f"final/{k}"] = float(vals[-1]) if len(vals) else None
  return row


def aggregate(workdir: str, out_csv: Optional[str] = None,
              cells: Optional[Sequence[Cell]] = None) -> list[dict]:
  """Writes `out_csv` (default WORKDIR/results.csv, atomically) with a row per cell; returns
  the rows. `cells` defaults to every cell the workdir's plan holds, the union of every grid
  run there: an experiment whose phases share a workdir passes each phase's own (as for
  `span_seconds`)."""
  if cells is None:
    _, cells = load_plan(workdir)
  rows = [cell_row(workdir, c) for c in cells]
  cols = []
  for r in rows:
    cols += [k for k in r if k not in cols]
  text = io.StringIO(newline="")
  w = csv.DictWriter(text, fieldnames=cols)
  w.writeheader()
  w.writerows(rows)
  wd.write_text_atomic(out_csv or os.path.join(workdir, RESULTS), text.getvalue())
  return rows


def curves(workdir: str, cell: Cell, key: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps, values) of one metric of one cell, over the steps that logged it (null -> NaN;
  a leading NaN for the step-0 evaluation line would blank every seed-mean curve's start)."""
  return series(read_metrics(os.path.join(cell_dir(workdir, cell), "metrics.jsonl")), key)


def group_cells(cells: Sequence[Cell], over: str = "seed") -> dict[str, list[Cell]]:
  """Groups cells that differ only in the `over` key (e.g. seeds of one method)."""
  # Keys every cell sets to the same value say nothing about the groups: leave them out.
  values: dict[str, set] = {}
  for cell in cells:
    for k, v in cell.overrides:
      values.setdefault(k, set()).add(_fmt(v))
  shown = {k for k, vs in values.items() if len(vs) > 1 and k != over}
  groups: dict[str, list[Cell]] = {}
  for cell in cells:
    label = ",".join(f"{k.split('.')[-1]}={_fmt(v)}" for k, v in cell.overrides if k in shown)
    groups.setdefault(label or "all", []).append(cell)
  return groups


def plot_grouped(workdir: str, keys: Sequence[str], out_png: str, *,
                 groups: Optional[Mapping[str, Sequence[Cell]]] = None,
                 window: int = 5) -> None:
  """One panel per metric; per group the seed-mean rolling curve with a min-max band
  (`eval/*` keys unsmoothed)."""
  # A bare Figure (Agg canvas) leaves pyplot's backend alone: notebooks keep inline plots.
  from matplotlib.figure import Figure
  if groups is None:
    _, cells = load_plan(workdir)
    groups = group_cells([c for c in cells if is_done(workdir, c)])
  fig = Figure(figsize=(5 * len(keys), 3.6))
  axes = fig.subplots(1, len(keys), squeeze=False)
  for ax, key in zip(axes[0], keys):
    for label, members in groups.items():
      runs = [curves(workdir, c, key) for c in members if is_done(workdir, c)]
      if not runs:
        continue
      n = min(len(s) for s, _ in runs)
      # Evaluations are few and already averaged over problems: plotted as they are.
      w = 1 if key.startswith("eval/") else window
      ys = np.stack([rolling_mean(v[:n], w) for _, v in runs])
      with np.errstate(all="ignore"):
        mean = np.nanmean(ys, axis=0)
      x = runs[0][0][:n]
      line, = ax.plot(x, mean, lw=1.6, label=label)
      if len(runs) > 1:
        ax.fill_between(x, np.nanmin(ys, 0), np.nanmax(ys, 0), color=line.get_color(),
                        alpha=0.15)
    ax.set_title(key)
    ax.set_xlabel("step")
    ax.set_ylabel(key.rsplit("/", 1)[-1])
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
  fig.savefig(out_png, dpi=100)


# --- CLI ---------------------------------------------------------------------------------------

def _at_least_one(text: str) -> int:
  """argparse type of the counts (--parallel, --processes, --threads-per-cell)."""
  try:
    n = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
  if n < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
  return n


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = argparse.ArgumentParser(prog="python -m trm_jax.sweep", description=__doc__.split("\n")[0])
  p.add_argument("--config", help="experiment config: a file (path[:arg]) or a shipped name")
  p.add_argument("--workdir", required=False)
  p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                 help="one grid axis; repeat for a product")
  p.add_argument("--set", action="append", default=[], metavar="KEY=V",
                 help="an override applied to every cell")
  p.add_argument("--parallel", type=_at_least_one, default=1, help="cells run at once")
  p.add_argument("--threads-per-cell", type=_at_least_one, default=None,
                 help="XLA CPU threads per cell when --parallel > 1")
  p.add_argument("--stop-timeout", type=float, default=STOP_TIMEOUT_S, metavar="SECONDS",
                 help="on SIGTERM / SIGINT, how long the running cells may take to checkpoint "
                      "their step before they are killed")
  p.add_argument("--aggregate", action="store_true", help="only rewrite results.csv + plots")
  p.add_argument("--archive", metavar="PATH",
                 help="write the finished runs (summaries and metrics, no checkpoints) to PATH "
                      "(gzip JSON lines) and exit")
  p.add_argument("--restore", metavar="PATH",
                 help="with --config: add the runs of an --archive file to --workdir as done "
                      "cells, then exit")
  p.add_argument("--allow_config_change", "--allow-config-change", action="store_true",
                 help="--restore: accept runs made under other settings than --config")
  p.add_argument("--backend", choices=("local", "slurm"), default="local",
                 help="local: cells as processes here; slurm: one job array (sbatch)")
  p.add_argument("--processes", type=_at_least_one, default=1,
                 help="slurm: processes (srun tasks) per cell, one multi-process trainer each")
  p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                 help="slurm: passed to sbatch as it is, e.g. --sbatch-arg=--partition=gpu")
  p.add_argument("--wait", action="store_true",
                 help="slurm: wait until the array ended, then aggregate")
  p.add_argument("--plot", default="reward,trm/reject_rate,trm/ppl_gap",
                 help="comma-separated metrics for WORKDIR/curves.png")
  p.add_argument("--run-cell", help=argparse.SUPPRESS)
  p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.run_cell:
    return _run_cell(a.run_cell, a.parent_pid)
  if not a.workdir:
    p.error("--workdir is required")
  try:
    if a.archive:
      from trm_jax import run_archive  # pylint: disable=g-import-not-at-top
      names = run_archive.archive_runs(a.workdir, a.archive)
      print(f"[sweep] archived {len(names)} finished runs to {a.archive}")
      return 0
    if a.restore:
      if not a.config:
        p.error("--restore needs --config (the plan the runs join)")
      from trm_jax import run_archive  # pylint: disable=g-import-not-at-top
      names = run_archive.restore_runs(a.restore, a.workdir, a.config,
                                       allow_config_change=a.allow_config_change)
      print(f"[sweep] restored {len(names)} runs into {a.workdir}")
      return 0
    if not a.aggregate:
      if not a.config:
        p.error("--config is required to run a sweep")
      fixed = [("", parse_sets(a.set))]
      cells = product(fixed, *[parse_grid_arg(g) for g in a.grid])
      os.makedirs(a.workdir, exist_ok=True)
      # A second sweep on the same workdir would launch the same cells: each cell's own lock
      # refuses its duplicate, but that sweep would then exit as if it had run them.
      with wd.WorkdirLock(a.workdir, name=LOCK, holder="sweep"):
        if a.backend == "slurm":
          plan_sweep(a.config, cells, a.workdir)
          job = submit_slurm(a.config, cells, a.workdir, processes=a.processes,
                             parallel=a.parallel if a.parallel > 1 else 0,
                             sbatch_args=a.sbatch_arg, wait=a.wait,
                             env=_env(a.workdir, None))
          if not a.wait:
            if job:
              print(f"[sweep] collect with: python -m trm_jax.sweep --workdir {a.workdir} "
                    "--aggregate")
            return 0
        else:
          run_sweep(a.config, cells, a.workdir, parallel=a.parallel,
                    threads_per_cell=a.threads_per_cell, stop_timeout_s=a.stop_timeout)
    rows = aggregate(a.workdir)
  except (config_lib.ConfigError, wd.WorkdirError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except preemption.Preempted as e:
    print(f"{e} (exit code {e.code})", file=sys.stderr)
    return e.code
  except KeyboardInterrupt:   # outside the cells' loop: nothing running, nothing to save
    print("[sweep] interrupted by SIGINT (no cell was running)", file=sys.stderr)
    return preemption.exit_code(signal.SIGINT)
  plot_grouped(a.workdir, a.plot.split(","), os.path.join(a.workdir, "curves.png"))
  bad = [r["cell"] for r in rows if r["status"] != "ok"]
  print(f"[sweep] wrote {os.path.join(a.workdir, RESULTS)} ({len(rows)} rows)"
        + (f"; not ok: {bad}" if bad else ""))
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
