"""GSM8K, DAPO-Math-17k and AIME-style files (jsonl / json / parquet, local paths) -> `Problem`s.

Files are read through `datasets.load_dataset("json" | "parquet", data_files=...)`; nothing is
downloaded. Expected columns:
  * GSM8K: `question`, `answer` whose last line is `#### <n>` (the ground truth). The text before
    it, with the `<<48/2=24>>` calculator annotations removed, becomes `Problem.solution`.
  * DAPO-Math-17k (verl layout): `prompt` = list of {role, content} messages (or a plain string),
    `reward_model` = {ground_truth, style}. The prompt already carries DAPO's instruction
    ("... the last line of your response should be of the form Answer: $Answer"), so it is kept
    verbatim; `math_reward` reads `Answer:` lines.
  * AIME-style: `problem` (or `question`), `answer` (int or string), optional `solution`.
GSM8K and AIME questions get `instruction` appended (default: reason step by step, answer in
\\boxed{}), since their files carry no instruction of their own.
A missing column or a malformed row raises an error naming the file and the column (or row).
"""
from __future__ import annotations

import os
import re
from typing import Any, Callable, Optional, Sequence

from trm_jax.data.problem import Problem

DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def read_rows(paths: str | Sequence[str], *, cache_dir: Optional[str] = None) -> Any:
  """A `datasets.Dataset` over local jsonl/json/parquet files (one format per call)."""
  import datasets  # pylint: disable=g-import-not-at-top  (heavy; only loaders need it)
  files = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
  if not files:
    raise ValueError("no data files given")
  kinds = set()
  for f in files:
    f = str(f)
    if not os.path.isfile(f):
      raise FileNotFoundError(f"data file {f} does not exist")
    ext = os.path.splitext(f)[1].lower()
    if ext not in _FORMATS:
      raise ValueError(f"data file {f}: unsupported extension {ext!r}; use one of "
                       f"{sorted(_FORMATS)}")
    kinds.add(_FORMATS[ext])
  if len(kinds) > 1:
    raise ValueError(f"data files mix formats {sorted(kinds)}: {files}")
  return datasets.load_dataset(kinds.pop(), data_files=[str(f) for f in files], split="train",
                               cache_dir=cache_dir)


def _require(ds: Any, where: str, *columns: str) -> None:
  missing = [c for c in columns if c not in ds.column_names]
  if missing:
    raise ValueError(f"{where}: missing column {missing[0]!r} (found columns: "
                     f"{sorted(ds.column_names)})")


def _first_column(ds: Any, where: str, candidates: Sequence[str]) -> str:
  for c in candidates:
    if c in ds.column_names:
      return c
  raise ValueError(f"{where}: missing column {candidates[0]!r} (also accepted: "
                   f"{list(candidates[1:])}; found columns: {sorted(ds.column_names)})")


def _where(paths: str | Sequence[str]) -> str:
  return str(paths) if isinstance(paths, (str, os.PathLike)) else ", ".join(map(str, paths))


def _with_instruction(question: str, instruction: Optional[str]) -> str:
  return question if not instruction else f"{question.strip()}\n{instruction}"


def load_gsm8k(paths: str | Sequence[str], *, instruction: Optional[str] = DEFAULT_INSTRUCTION,
               cache_dir: Optional[str] = None) -> list[Problem]:
  where = _where(paths)
  ds = read_rows(paths, cache_dir=cache_dir)
  _require(ds, f"gsm8k file {where}", "question", "answer")
  out = []
  for i, row in enumerate(ds):
    text = row["answer"] or ""
    if "####" not in text:
      raise ValueError(f"gsm8k file {where}, row {i}: column 'answer' has no '#### <n>' line")
    worked, final = text.rsplit("####", 1)
    solution = re.sub(r"<<[^>]*>>", "", text).strip()
    out.append(Problem(prompt=_with_instruction(row["question"], instruction),
                       answer=final.strip(), solution=solution if worked.strip() else "",
                       source="gsm8k", uid=f"{os.path.basename(where)}:{i}"))
  return out


def load_dapo_math(paths: str | Sequence[str], *,
                   cache_dir: Optional[str] = None) -> list[Problem]:
  where = _where(paths)
  ds = read_rows(paths, cache_dir=cache_dir)
  _require(ds, f"dapo_math file {where}", "prompt", "reward_model")
  out = []
  for i, row in enumerate(ds):
    reward_model = row["reward_model"] or {}
    if reward_model.get("ground_truth") is None:
      raise ValueError(f"dapo_math file {where}, row {i}: missing column "
                       "'reward_model.ground_truth'")
    prompt, system = row["prompt"], None
    if not isinstance(prompt, str):
      users = [m["content"] for m in prompt if m.get("role") == "user"]
      systems = [m["content"] for m in prompt if m.get("role") == "system"]
      if not users:
        raise ValueError(f"dapo_math file {where}, row {i}: column 'prompt' has no user message")
      prompt, system = users[-1], (systems[0] if systems else None)
    out.append(Problem(prompt=prompt, answer=str(reward_model["ground_truth"]).strip(),
                       system=system, source="dapo_math",
                       uid=f"{os.path.basename(where)}:{i}"))
  return out


def load_aime(paths: str | Sequence[str], *, instruction: Optional[str] = DEFAULT_INSTRUCTION,
              cache_dir: Optional[str] = None) -> list[Problem]:
  where = _where(paths)
  ds = read_rows(paths, cache_dir=cache_dir)
  q_col = _first_column(ds, f"aime file {where}", ("problem", "question", "Problem"))
  a_col = _first_column(ds, f"aime file {where}", ("answer", "Answer"))
  has_solution = "solution" in ds.column_names
  out = []
  for i, row in enumerate(ds):
    if row[a_col] is None:
      raise ValueError(f"aime file {where}, row {i}: column {a_col!r} is empty")
    out.append(Problem(prompt=_with_instruction(row[q_col], instruction),
                       answer=str(row[a_col]).strip(),
                       solution=(row["solution"] or "") if has_solution else "",
                       source="aime", uid=f"{os.path.basename(where)}:{i}"))
  return out


LOADERS: dict[str, Callable[..., list[Problem]]] = {
    "gsm8k": load_gsm8k, "dapo_math": load_dapo_math, "aime": load_aime}


def load_problems(kind: str, paths: str | Sequence[str], **kwargs) -> list[Problem]:
  """Dispatch by task name (the config's `data.kind`)."""
  if kind not in LOADERS:
    raise ValueError(f"unknown problem source {kind!r}; expected one of {sorted(LOADERS)}")
  return LOADERS[kind](paths, **kwargs)
