"""GSM8K, DAPO-Math-17k and AIME-style files (jsonl / json / parquet, local paths) -> `Problem`s.

Files are read directly: jsonl line by line with `json`, .json as one JSON array of objects (or
as JSON lines), parquet with pyarrow. Nothing is downloaded or cached. Expected fields:
  * GSM8K: `question`, `answer` whose last line is `#### <n>` (the ground truth). The text before
    it, with the `<<48/2=24>>` calculator annotations removed, becomes `Problem.solution`.
  * DAPO-Math-17k (verl layout): `prompt` = list of {role, content} messages (or a plain string),
    `reward_model` = {ground_truth, style}. The prompt already carries DAPO's instruction
    ("... the last line of your response should be of the form Answer: $Answer"), so it is kept
    verbatim; `math_reward` reads `Answer:` lines.
  * AIME-style: `problem` (or `question`), `answer` (int or string), optional `solution`.
GSM8K and AIME questions get `instruction` appended (default: reason step by step, answer in
\\boxed{}), since their files carry no instruction of their own.

Bad data fails with one line (`DataFileError`, a ValueError) naming the file and the row: an
empty file, a line that is not JSON, a field that is missing, null or of the wrong type, and an
empty ground-truth answer (which no completion could ever match, so the row would only add
zero-reward groups). Rows are named by their 1-based line for jsonl (and JSON-lines .json),
their 1-based element for a .json array, and their 1-based row for parquet.
`Problem.uid` is "<file name>:<0-based row>".
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Callable, Iterator, Optional, Sequence

from trm_jax.data.problem import Problem

DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
_FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}


class DataFileError(ValueError):
  """A data file is empty or unreadable, or one of its rows is malformed; the message names
  the file and the row."""


@dataclasses.dataclass(frozen=True)
class Row:
  fields: dict[str, Any]  # the row's object
  file: str               # the file it came from
  index: int              # 0-based row within the file (Problem.uid)
  where: str              # "<file>, line 3" / "<file>, element 3" / "<file>, row 3" (1-based)


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
    rows.append(Row(fields=value, file=path, index=i, where=f"{path}, {at}"))
  return rows


def read_rows(paths: str | Sequence[str]) -> list[Row]:
  """Every row of local jsonl / json / parquet files, in order, each with its location."""
  files = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
  if not files:
    raise ValueError("no data files given")
  rows = []
  for f in files:
    f = os.fspath(f)
    if not os.path.isfile(f):
      raise FileNotFoundError(f"data file {f} does not exist")
    ext = os.path.splitext(f)[1].lower()
    if ext not in _FORMATS:
      raise DataFileError(f"data file {f}: unsupported extension {ext!r}; use one of "
                          f"{sorted(_FORMATS)}")
    rows += _read_file(f, _FORMATS[ext])
  return rows


# ------------------------------------------------------------------------------ field checks
def _require(rows: list[Row], kind: str, *candidates: str) -> str:
  """The first of `candidates` that some row has; else an error naming the file(s)."""
  found = set().union(*(r.fields for r in rows))
  for c in candidates:
    if c in found:
      return c
  also = f" (also accepted: {list(candidates[1:])})" if len(candidates) > 1 else ""
  files = ", ".join(dict.fromkeys(r.file for r in rows))
  raise DataFileError(f"{kind} file {files}: missing column {candidates[0]!r}{also}; found "
                      f"columns: {sorted(found)}")


def _describe(value: Any) -> str:
  text = repr(value)
  return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _text(row: Row, kind: str, name: str, value: Any) -> str:
  if value is None:
    raise DataFileError(f"{kind} file {row.where}: field {name!r} is null or missing")
  if not isinstance(value, str):
    raise DataFileError(f"{kind} file {row.where}: field {name!r} is {_describe(value)}, "
                        "expected a string")
  return value


def _answer(row: Row, kind: str, name: str, value: Any) -> str:
  """A ground truth: a non-empty string, or an integer (AIME files store ints)."""
  if isinstance(value, int) and not isinstance(value, bool):
    return str(value)
  if value is not None and not isinstance(value, str):
    raise DataFileError(f"{kind} file {row.where}: field {name!r} is {_describe(value)}, "
                        "expected a string or an integer")
  text = _text(row, kind, name, value).strip()
  if not text:
    raise DataFileError(f"{kind} file {row.where}: field {name!r} is an empty ground-truth "
                        "answer (no completion could match it)")
  return text


def _with_instruction(question: str, instruction: Optional[str]) -> str:
  return question if not instruction else f"{question.strip()}\n{instruction}"


def _uid(row: Row) -> str:
  return f"{os.path.basename(row.file)}:{row.index}"


# ------------------------------------------------------------------------------ loaders
def load_gsm8k(paths: str | Sequence[str], *,
               instruction: Optional[str] = DEFAULT_INSTRUCTION) -> list[Problem]:
  rows = read_rows(paths)
  _require(rows, "gsm8k", "question")
  _require(rows, "gsm8k", "answer")
  out = []
  for row in rows:
    question = _text(row, "gsm8k", "question", row.fields.get("question"))
    text = _text(row, "gsm8k", "answer", row.fields.get("answer"))
    if "####" not in text:
      raise DataFileError(f"gsm8k file {row.where}: field 'answer' has no '#### <n>' line")
    worked, final = text.rsplit("####", 1)
    if not final.strip():
      raise DataFileError(f"gsm8k file {row.where}: field 'answer' has an empty ground truth "
                          "after '####' (no completion could match it)")
    solution = re.sub(r"<<[^>]*>>", "", text).strip()
    out.append(Problem(prompt=_with_instruction(question, instruction), answer=final.strip(),
                       solution=solution if worked.strip() else "", source="gsm8k",
                       uid=_uid(row)))
  return out


def _dapo_messages(row: Row, prompt: Any) -> tuple[str, Optional[str]]:
  """(user turn, system turn or None) of a DAPO `prompt`: a string or a list of messages."""
  if isinstance(prompt, str):
    return prompt, None
  if not isinstance(prompt, list):
    raise DataFileError(f"dapo_math file {row.where}: field 'prompt' is "
                        f"{'null or missing' if prompt is None else _describe(prompt)}, "
                        "expected a string or a list of {role, content} messages")
  users, systems = [], []
  for k, m in enumerate(prompt):
    if not isinstance(m, dict):
      raise DataFileError(f"dapo_math file {row.where}: field 'prompt' message {k} is "
                          f"{_describe(m)}, expected {{role, content}}")
    content = _text(row, "dapo_math", f"prompt[{k}].content", m.get("content"))
    role = m.get("role")
    if role == "user":
      users.append(content)
    elif role == "system":
      systems.append(content)
  if not users:
    raise DataFileError(f"dapo_math file {row.where}: field 'prompt' has no user message")
  return users[-1], (systems[0] if systems else None)


def load_dapo_math(paths: str | Sequence[str]) -> list[Problem]:
  rows = read_rows(paths)
  _require(rows, "dapo_math", "prompt")
  _require(rows, "dapo_math", "reward_model")
  out = []
  for row in rows:
    reward_model = row.fields.get("reward_model")
    if not isinstance(reward_model, dict):
      raise DataFileError(f"dapo_math file {row.where}: field 'reward_model' is "
                          f"{_describe(reward_model)}, expected {{ground_truth, style}}")
    answer = _answer(row, "dapo_math", "reward_model.ground_truth",
                     reward_model.get("ground_truth"))
    prompt, system = _dapo_messages(row, row.fields.get("prompt"))
    out.append(Problem(prompt=prompt, answer=answer, system=system, source="dapo_math",
                       uid=_uid(row)))
  return out


def load_aime(paths: str | Sequence[str], *,
              instruction: Optional[str] = DEFAULT_INSTRUCTION) -> list[Problem]:
  rows = read_rows(paths)
  q_col = _require(rows, "aime", "problem", "question", "Problem")
  a_col = _require(rows, "aime", "answer", "Answer")
  out = []
  for row in rows:
    question = _text(row, "aime", q_col, row.fields.get(q_col))
    answer = _answer(row, "aime", a_col, row.fields.get(a_col))
    solution = row.fields.get("solution")
    solution = "" if solution is None else _text(row, "aime", "solution", solution)
    out.append(Problem(prompt=_with_instruction(question, instruction), answer=answer,
                       solution=solution, source="aime", uid=_uid(row)))
  return out


LOADERS: dict[str, Callable[..., list[Problem]]] = {
    "gsm8k": load_gsm8k, "dapo_math": load_dapo_math, "aime": load_aime}


def load_problems(kind: str, paths: str | Sequence[str], **kwargs) -> list[Problem]:
  """Dispatch by task name (the config's `task.name` / `task.eval_name`)."""
  if kind not in LOADERS:
    raise ValueError(f"unknown problem source {kind!r}; expected one of {sorted(LOADERS)}")
  return LOADERS[kind](paths, **kwargs)
