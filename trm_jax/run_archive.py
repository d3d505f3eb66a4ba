r"""Moving a sweep's finished runs between workdirs: `--archive` and `--restore`.

  python -m trm_jax.sweep --workdir /tmp/sweep --archive runs.jsonl.gz
  python -m trm_jax.sweep --config configs/tiny_trm.py --workdir /tmp/other \
      --restore runs.jsonl.gz [--allow_config_change]

A grid that outlives one machine (a scratch disk, a cluster's job, a laptop that plots the
results) needs its finished runs without their checkpoints: a cell's summary.json and
metrics.jsonl are everything aggregation and the experiments' reports read. An archive is
gzip, one JSON object per finished cell:

  {"cell": name, "overrides": [[key, value], ...], "spec": the sweep's --config,
   "config": the config the run was made under (its config.json), "summary": summary.json,
   "metrics": metrics.jsonl verbatim}

A restore checks every entry before it writes anything, and refuses the whole archive in one
line naming the file, the line and the cell when one entry is bad: a cell name that is not a
plain directory name (it would write outside WORKDIR/cells), an override key the config does
not have or a value of the wrong type, a summary or metrics record of the wrong shape, or a run
made under another config than --config (the settings that differ are named, as a resume
names them; --allow_config_change restores them anyway). Archives written before runs carried
their config are restored unchecked, with a warning.
"""
from __future__ import annotations

import gzip
import json
import os
from typing import Any, Callable, Optional, Sequence

from trm_jax import config as config_lib
from trm_jax import sweep
from trm_jax import workdir as wd


def archive_runs(workdir: str, path: str,
                 cells: Optional[Sequence[sweep.Cell]] = None) -> list[str]:
  """Writes the finished cells of WORKDIR's plan (or of `cells`, so an experiment that restored
  other runs into its workdir archives only its own) to `path`: gzip, one JSON line per cell
  (module docstring), written atomically; returns the cell names. Checkpoints are left out: a
  restored cell is done, not resumable. A done cell without its metrics, or a `path` whose
  directory does not exist, is refused before anything is written."""
  spec, planned = sweep.load_plan(workdir)
  cells = planned if cells is None else cells
  where = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(where):
    raise config_lib.ConfigError(f"--archive {path}: directory {where} does not exist")
  lines = []
  for c in cells:
    if not sweep.is_done(workdir, c):
      continue
    d = sweep.cell_dir(workdir, c)
    try:
      with open(os.path.join(d, "metrics.jsonl")) as g:
        metrics = g.read()
    except OSError as e:
      raise config_lib.ConfigError(
          f"cell {c.name!r} is done (summary.json) but {os.path.join(d, 'metrics.jsonl')} "
          f"cannot be read ({e.strerror or e}): its run cannot be archived") from None
    with open(os.path.join(d, "summary.json")) as g:
      summ = json.load(g)
    config = None
    if os.path.exists(os.path.join(d, wd.CONFIG_FILE)):
      with open(os.path.join(d, wd.CONFIG_FILE)) as g:
        config = json.load(g)
    lines.append(json.dumps({"cell": c.name, "overrides": [list(kv) for kv in c.overrides],
                             "spec": spec, "config": config, "summary": summ,
                             "metrics": metrics}) + "\n")
  tmp = path + ".tmp"
  try:
    # mtime 0: the same runs give the same bytes, so a re-archive does not show as a change.
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
      for line in lines:
        f.write(line.encode())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  return [json.loads(line)["cell"] for line in lines]


def _shape_error(e: dict) -> Optional[str]:
  """What is wrong with the types of an archive entry (what restoring and aggregating read),
  or None."""
  if not isinstance(e, dict):
    return f"expected a JSON object, got {type(e).__name__}"
  for key, kind in (("cell", str), ("overrides", list), ("summary", dict), ("metrics", str)):
    if not isinstance(e.get(key), kind):
      return f"field {key!r} is {type(e.get(key)).__name__}, expected {kind.__name__}"
  for kv in e["overrides"]:
    if not (isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], str)):
      return f"override {kv!r} is not a [key, value] pair"
  if not isinstance(e.get("config"), (dict, type(None))):
    return f"field 'config' is {type(e['config']).__name__}, expected an object"
  s = e["summary"]
  for key in ("summary", "eval"):
    if not isinstance(s.get(key, {}), dict):
      return f"summary field {key!r} is {type(s[key]).__name__}, expected an object"
  evals = s.get("summary", {}).get("evals", {})
  if not isinstance(evals, dict):
    return f"summary evaluations are {type(evals).__name__}, expected an object"
  for name, ev in evals.items():
    if not (isinstance(ev, dict) and "first" in ev and all(
        isinstance(ev.get(k), int) for k in ("first_step", "last_step"))):
      return (f"summary evaluation {name!r} lacks its first value or its integer "
              "first_step / last_step")
  for n, line in enumerate(e["metrics"].splitlines(), 1):
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
    except ValueError:
      return f"metrics line {n} is not JSON"
    if not isinstance(rec, dict):
      return f"metrics line {n} is {type(rec).__name__}, expected an object"
  return None


def _read_archive(path: str) -> list[tuple[int, dict]]:
  """(line number, entry) of every entry, each of the right shape, or a one-line error."""
  out = []
  try:
    with gzip.open(path, "rt") as f:
      for i, line in enumerate(f, 1):
        try:
          e = json.loads(line)
        except ValueError as err:
          raise config_lib.ConfigError(f"{path} line {i}: not an archived run (not JSON: "
                                       f"{err})") from None
        why = _shape_error(e)
        if why is not None:
          raise config_lib.ConfigError(f"{path} line {i}: not an archived run ({why})")
        out.append((i, e))
  except (OSError, EOFError) as err:
    raise config_lib.ConfigError(f"{path}: cannot read the run archive ({err})") from None
  return out


def _differences(changes: dict, most: int = 4) -> str:
  shown = wd.describe(dict(list(changes.items())[:most]))
  return shown + (f"; and {len(changes) - most} more" if len(changes) > most else "")


def restore_runs(path: str, workdir: str, spec: str, *, allow_config_change: bool = False,
                 log: Callable[[str], Any] = print) -> list[str]:
  """Unpacks `archive_runs`' file into WORKDIR: each archived cell not done there gets its
  directory (metrics.jsonl and config.json, then summary.json, which marks it done) and joins
  the plan under `spec`; returns the names restored. Every entry is checked first (module
  docstring): one bad entry refuses the whole archive and nothing is written. A cell planned
  there with other overrides fails, as a sweep would."""
  entries = []
  legacy = 0
  cells_root = os.path.realpath(os.path.join(workdir, "cells"))
  for i, e in _read_archive(path):
    where = f"{path} line {i} (cell {e['cell']!r})"
    try:
      cell = sweep.Cell(e["cell"], tuple(tuple(kv) for kv in e["overrides"]))
      c = sweep.apply_overrides(config_lib.load_config(spec), cell.overrides)
    except config_lib.ConfigError as err:
      raise config_lib.ConfigError(f"{where}: {err}") from None
    if os.path.dirname(os.path.realpath(sweep.cell_dir(workdir, cell))) != cells_root:
      raise config_lib.ConfigError(f"{where}: {sweep.cell_dir(workdir, cell)} resolves outside "
                                   f"{cells_root} (a symbolic link)")
    config = json.loads(c.to_json_best_effort())
    if e.get("config") is None:
      legacy += 1
    else:
      changes = wd.config_changes(e["config"], config)
      if changes and not allow_config_change:
        raise config_lib.ConfigError(
            f"{where} was made under --config {e.get('spec', '?')}, not under --config {spec}: "
            f"{_differences(changes)}. Restore it under its own config, or pass "
            "--allow_config_change to count it as a run of this one")
    entries.append((cell, e.get("config"), e["summary"], e["metrics"]))
  if legacy:
    log(f"[sweep] warning: {legacy} runs in {path} record no config (archived before runs "
        f"carried one): restored as runs of --config {spec} without checking")
  os.makedirs(workdir, exist_ok=True)
  sweep.check_plan(workdir, spec, [cell for cell, *_ in entries])
  restored = []
  for cell, config, summ, metrics in entries:
    if sweep.is_done(workdir, cell):
      continue
    d = sweep.cell_dir(workdir, cell)
    os.makedirs(d, exist_ok=True)
    wd.write_text_atomic(os.path.join(d, "metrics.jsonl"), metrics)
    if config is not None:
      wd.write_json_atomic(os.path.join(d, wd.CONFIG_FILE), config)
    wd.write_json_atomic(os.path.join(d, "summary.json"), summ)
    restored.append(cell.name)
  return restored
