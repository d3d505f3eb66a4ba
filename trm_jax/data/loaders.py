"""Rows of a task's data, from files or Hugging Face datasets, and the field checks every
loader shares; the task modules (data/math_tasks.py, data/summarization.py, data/hotpotqa.py)
turn rows into `Problem`s.

A source (`task.path`, `task.eval_path`) is one of:
  * a local file: jsonl read line by line with `json`, .json as one JSON array of objects (or
    as JSON lines), parquet with pyarrow. A file is one split: no split or subset applies.
  * a directory written by `datasets`' `save_to_disk`: a `Dataset`, or a `DatasetDict`, which
    needs its split named (`task.split` / `task.eval_split`); read with `load_from_disk`.
  * a hub id (`openai/gsm8k`) with its subset (`task.subset`, GSM8K's "main") and split, or a
    directory of data files laid out as a hub repository (a `--local-dir` download): read with
    `datasets.load_dataset`, which reads only its local cache under HF_DATASETS_OFFLINE=1.
Which one a path is, is decided in one place (`_source_kind`): a file, a directory with
`save_to_disk`'s markers, any other directory, or a name shaped like a hub id; any other path
is a missing local file.

Bad data fails with one line (`DataFileError`, a ValueError) naming the file or the dataset and
split, and the row: an empty source, a line that is not JSON, a field that is missing, null or
of the wrong type, and an empty ground-truth answer (which no completion could ever match, so
the row would only add zero-reward groups). Rows are named by their 1-based line for jsonl (and
JSON-lines .json), their 1-based element for a .json array, and their 1-based row for parquet
and datasets. `Problem.uid` is "<file name>:<0-based row>" ("<name>/<split>:<row>" for a
dataset split).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Iterator, Optional, Sequence


_FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
# What `save_to_disk` writes at the top of its directory: state.json for a Dataset,
# dataset_dict.json for a DatasetDict (the two files `load_from_disk` itself looks for).
_DISK_MARKERS = ("state.json", "dataset_dict.json")
# A hub dataset id: `name` or `namespace/name` (the hub's repository-name characters).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


class DataFileError(ValueError):
  """A data file is empty or unreadable, or one of its rows is malformed; the message names
  the file and the row."""


@dataclasses.dataclass(frozen=True)
class Row:
  fields: dict[str, Any]  # the row's object
  source: str             # "file <path>" / "dataset <name> (subset 'main', split 'train')"
  name: str               # Problem.uid's prefix: the file's base name, or "<name>/<split>"
  index: int              # 0-based row within the file or split (Problem.uid)
  where: str              # "<source>, line 3" / ", element 3" / ", row 3" (1-based)


def _jsonl_rows(path: str) -> Iterator[tuple[int, Any]]:
  """(1-based line number, parsed value) per non-blank line."""
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, 1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise DataFileError(f"{path}, line {lineno}: not UTF-8 ({e.reason} at byte "
                            f"{e.start})") from None
      if not line.strip():
        continue
      try:
        yield lineno, json.loads(line)
      except json.JSONDecodeError as e:
        raise DataFileError(f"{path}, line {lineno}: not valid JSON ({e.msg}, column "
                            f"{e.colno})") from None


def _read_file(path: str, kind: str) -> list[Row]:
  if kind == "parquet":
    import pyarrow  # pylint: disable=g-import-not-at-top  (only parquet files need it)
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    try:
      values = pq.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as e:
      raise DataFileError(f"{path}: not a readable parquet file ({e})") from None
    located = [(f"row {i + 1}", v) for i, v in enumerate(values)]
  else:
    located = None
    if kind == "json":
      with open(path, "rb") as f:
        data = f.read()
      try:
        text = data.decode("utf-8")
      except UnicodeDecodeError as e:
        raise DataFileError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
      if text.lstrip().startswith("["):
        try:
          values = json.loads(text)
        except json.JSONDecodeError as e:
          raise DataFileError(f"{path}, line {e.lineno}: not valid JSON ({e.msg}, column "
                              f"{e.colno})") from None
        located = [(f"element {i + 1}", v) for i, v in enumerate(values)]
    if located is None:  # jsonl, or a .json file holding JSON lines
      located = [(f"line {n}", v) for n, v in _jsonl_rows(path)]
  if not located:
    raise DataFileError(f"{path}: no rows (the file is empty)")
  rows = []
  for i, (at, value) in enumerate(located):
    if not isinstance(value, dict):
      raise DataFileError(f"{path}, {at}: expected a JSON object with named fields, got "
                          f"{type(value).__name__}")
    rows.append(Row(fields=value, source=f"file {path}", name=os.path.basename(path), index=i,
                    where=f"file {path}, {at}"))
  return rows


def _source_kind(path: str) -> str:
  """"file" | "disk" (save_to_disk) | "load_dataset" (hub id or data directory) | "missing".

  The one place a path's kind is decided. A directory is a dataset: `save_to_disk`'s when it
  holds its markers, else a directory of data files for `load_dataset`. A name that is no local
  path but has a hub id's shape (no data-file extension, not starting with / . ~) is a hub id.
  """
  if os.path.isfile(path):
    return "file"
  if os.path.isdir(path):
    if any(os.path.isfile(os.path.join(path, m)) for m in _DISK_MARKERS):
      return "disk"
    return "load_dataset"
  if _HUB_ID.fullmatch(path) and os.path.splitext(path)[1].lower() not in _FORMATS:
    return "load_dataset"
  return "missing"


def _dataset_label(path: str, subset: str, split: str) -> str:
  details = [f"{k} {v!r}" for k, v in (("subset", subset), ("split", split)) if v]
  return f"dataset {path}" + (f" ({', '.join(details)})" if details else "")


def _read_dataset(path: str, kind: str, split: str, subset: str) -> list[Row]:
  """Rows of one split of a `datasets` dataset (save_to_disk directory, hub id, data dir)."""
  import datasets  # pylint: disable=g-import-not-at-top  (heavy; only datasets need it)
  label = _dataset_label(path, subset, split)
  try:
    if kind == "disk":
      if subset:
        raise DataFileError(f"{label}: a save_to_disk directory has no subsets; leave the "
                            "subset empty")
      empty = _empty_saved_splits(path)
      if empty:
        raise DataFileError(f"{label}: no rows (save_to_disk wrote no data for "
                            f"{', '.join(empty)}; `datasets` cannot load such a directory)")
      ds = datasets.load_from_disk(path)
    else:
      ds = datasets.load_dataset(path, subset or None, split=split or None)
  except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
    if isinstance(e, DataFileError):
      raise
    # datasets' messages run over several lines; the first one says what went wrong.
    msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
    offline = (" (HF_DATASETS_OFFLINE is set: only the local cache is read)"
               if kind == "load_dataset" and not os.path.isdir(path)
               and datasets.config.HF_DATASETS_OFFLINE else "")
    raise DataFileError(f"{label}: {msg}{offline}") from None
  if isinstance(ds, datasets.DatasetDict):
    if not split:
      raise DataFileError(f"{label} has splits {sorted(ds)}: name the one to read "
                          "(task.split / task.eval_split)")
    if split not in ds:
      raise DataFileError(f"{label}: no split {split!r}; its splits are {sorted(ds)}")
    ds = ds[split]
  elif split and kind == "disk" and str(ds.split or "") != split:
    # A saved Dataset is one split; only the split it records (if any) may be asked for.
    raise DataFileError(f"{label}: the directory holds one Dataset (split "
                        f"{str(ds.split) if ds.split else 'not recorded'}), not a DatasetDict; "
                        "leave the split empty or name the recorded one")
  if not isinstance(ds, datasets.Dataset):
    raise DataFileError(f"{label}: expected a Dataset, got {type(ds).__name__}")
  values = ds.to_list()
  if not values:
    raise DataFileError(f"{label}: no rows (the split is empty)")
  name = "/".join(x for x in (os.path.basename(os.path.normpath(path)), subset, split) if x)
  return [Row(fields=v, source=label, name=name, index=i, where=f"{label}, row {i + 1}")
          for i, v in enumerate(values)]


def _empty_saved_splits(path: str) -> list[str]:
  """The parts of a `save_to_disk` directory saved with no rows ("the dataset", or "split
  'x'"): their state.json lists no data files, and `load_from_disk` fails inside `datasets`
  (an IndexError) on the whole directory."""
  def empty(d: str) -> bool:
    try:
      with open(os.path.join(d, "state.json")) as f:
        return json.load(f).get("_data_files") == []
    except (OSError, ValueError, AttributeError):
      return False   # not ours to judge: load_from_disk reports it
  if os.path.isfile(os.path.join(path, "state.json")):
    return ["the dataset"] if empty(path) else []
  try:
    with open(os.path.join(path, "dataset_dict.json")) as f:
      splits = json.load(f).get("splits", [])
  except (OSError, ValueError, AttributeError):
    return []
  return [f"split {s!r}" for s in splits if isinstance(s, str) and empty(os.path.join(path, s))]


def read_rows(paths: str | Sequence[str], *, split: str = "", subset: str = "") -> list[Row]:
  """Every row of a source (module docstring) or of several local files, in order, each with
  its location. `split` / `subset` select within a dataset; files have neither."""
  files = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
  if not files:
    raise ValueError("no data files given")
  files = [os.fspath(f) for f in files]
  kinds = [_source_kind(f) for f in files]
  if len(files) == 1 and kinds[0] in ("disk", "load_dataset"):
    return _read_dataset(files[0], kinds[0], split, subset)
  rows = []
  for f, kind in zip(files, kinds):
    if kind == "missing":
      raise DataFileError(f"data file {f} does not exist")
    if kind != "file":
      raise DataFileError(f"{f}: a dataset directory is read on its own, not in a list of files")
    if split or subset:
      raise DataFileError(f"data file {f}: a file is one split; leave the split and subset "
                          f"empty (got split {split!r}, subset {subset!r})")
    ext = os.path.splitext(f)[1].lower()
    if ext not in _FORMATS:
      raise DataFileError(f"data file {f}: unsupported extension {ext!r}; use one of "
                          f"{sorted(_FORMATS)}")
    rows += _read_file(f, _FORMATS[ext])
  return rows


# ------------------------------------------------------------------------------ field checks
def require_column(rows: list[Row], kind: str, *candidates: str) -> str:
  """The first of `candidates` that some row has; else an error naming the file(s)."""
  found = set().union(*(r.fields for r in rows))
  for c in candidates:
    if c in found:
      return c
  also = f" (also accepted: {list(candidates[1:])})" if len(candidates) > 1 else ""
  sources = ", ".join(dict.fromkeys(r.source for r in rows))
  raise DataFileError(f"{kind} {sources}: missing column {candidates[0]!r}{also}; found "
                      f"columns: {sorted(found)}")


def describe(value: Any) -> str:
  text = repr(value)
  return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def text_field(row: Row, kind: str, name: str, value: Any) -> str:
  if value is None:
    raise DataFileError(f"{kind} {row.where}: field {name!r} is null or missing")
  if not isinstance(value, str):
    raise DataFileError(f"{kind} {row.where}: field {name!r} is {describe(value)}, "
                        "expected a string")
  return value


def answer_field(row: Row, kind: str, name: str, value: Any) -> str:
  """A ground truth: a non-empty string, or an integer (AIME files store ints)."""
  if isinstance(value, int) and not isinstance(value, bool):
    return str(value)
  if value is not None and not isinstance(value, str):
    raise DataFileError(f"{kind} {row.where}: field {name!r} is {describe(value)}, "
                        "expected a string or an integer")
  text = text_field(row, kind, name, value).strip()
  if not text:
    raise DataFileError(f"{kind} {row.where}: field {name!r} is an empty ground-truth "
                        "answer (no completion could match it)")
  return text


def with_instruction(question: str, instruction: Optional[str]) -> str:
  return question if not instruction else f"{question.strip()}\n{instruction}"


def uid_of(row: Row) -> str:
  return f"{row.name}:{row.index}"
