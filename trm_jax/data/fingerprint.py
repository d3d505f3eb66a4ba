"""The identity of the data a run reads, stored with every checkpoint.

A resume checks the config (workdir.config_changes), but the config names a file, not its
contents: a file rewritten under the same path (other rows, other answers) would continue
the run on other data, silently. So the trainer records, per config key that names a source
(`task.path`, `task.eval_path`, or `task.eval_split` for a held-out split of `task.path`),
what was read:

  {"path", "split", "subset", "rows", "sha256", "size", "mtime"}

`sha256` hashes the rows the task uses, after parsing (prompt, answer, solution, system, in
order), so it is what decides: a resume whose hash or row count differs is refused
(`changes`). Size and modification time are recorded to describe the change; on their own
they do not refuse a resume, since copying the same file to a new machine changes the mtime
and reformatting it (whitespace, unused columns) can change the size without changing a row.

The synthetic task reads no file: its problems are a pure function of the config, which the
config check already covers. Hashing the parsed rows covers every kind of source alike (a
file, a `save_to_disk` directory, a hub id read from the local cache); `datasets`' own
`_fingerprint` could be recorded beside it, but it is a hash of how a dataset was built,
not of its rows, so it would not change the decision.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Mapping, Sequence

from trm_jax.data.problem import Problem

DECIDING = ("rows", "sha256")   # the fields whose change refuses a resume


def rows_sha256(problems: Sequence[Problem]) -> str:
  """sha256 of the parsed rows: what the trainer trains and evaluates on, in order."""
  h = hashlib.sha256()
  for p in problems:
    h.update(json.dumps([p.prompt, p.answer, p.solution, p.system], ensure_ascii=False)
             .encode("utf-8"))
    h.update(b"\n")
  return h.hexdigest()


def source_fingerprint(path: str, problems: Sequence[Problem], *, split: str = "",
                       subset: str = "") -> dict:
  """The record of one data source (a file, a `datasets` directory or a hub id: loaders.py)
  and the problems parsed from it. Size and mtime: the file's, a directory's total and newest
  over its files, absent for a hub id (its local cache is not ours to describe)."""
  rec = {"path": os.path.abspath(path) if os.path.exists(path) else path, "split": split,
         "subset": subset, "rows": len(problems), "sha256": rows_sha256(problems)}
  if os.path.isfile(path):
    st = os.stat(path)
    rec.update(size=st.st_size, mtime=st.st_mtime)
  elif os.path.isdir(path):
    stats = [os.stat(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs]
    rec.update(size=sum(st.st_size for st in stats),
               mtime=max((st.st_mtime for st in stats), default=0.0))
  return rec


def changes(old: Mapping[str, dict], new: Mapping[str, dict]) -> dict[str, tuple]:
  """{config key: (old record, new record)} for every source whose rows differ."""
  out = {}
  for key in sorted(set(old) | set(new)):
    a, b = old.get(key), new.get(key)
    if a is None or b is None or any(a.get(f) != b.get(f) for f in DECIDING):
      out[key] = (a, b)
  return out


def _brief(rec) -> str:
  if rec is None:
    return "no file"
  when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec["mtime"])) \
      if "mtime" in rec else "?"
  return (f"{rec['rows']} rows, sha256 {rec['sha256'][:12]}, {rec.get('size', '?')} bytes, "
          f"modified {when}")


def _where(rec: dict) -> str:
  split = f" (split {rec['split']!r})" if rec.get("split") else ""
  return f"{rec['path']}{split}"


def describe(diff: Mapping[str, tuple]) -> str:
  return "; ".join(f"{key}={_where(b or a)}: {_brief(a)} -> {_brief(b)}"
                   for key, (a, b) in diff.items())
