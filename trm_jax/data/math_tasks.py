"""GSM8K, DAPO-Math-17k and AIME-style problems as registered tasks: loaders, prompt format
and the binary math reward (data/rewards.py).

Expected fields:
  * GSM8K: `question`, `answer` whose last line is `#### <n>` (the ground truth). The text before
    it, with the `<<48/2=24>>` calculator annotations removed, becomes `Problem.solution`.
  * DAPO-Math-17k (verl layout): `prompt` = list of {role, content} messages (or a plain string),
    `reward_model` = {ground_truth, style}. The prompt already carries DAPO's instruction
    ("... the last line of your response should be of the form Answer: $Answer"), so it is kept
    verbatim; `math_reward` reads `Answer:` lines.
  * AIME-style: `problem` (or `question`), `answer` (int or string), optional `solution`.
GSM8K and AIME questions get `instruction` appended (default: reason step by step, answer in
\\boxed{}), since their files carry no instruction of their own.

Sources (files, `save_to_disk` directories, hub ids) and the one-line errors that name a bad
row are data/loaders.py's.
"""
from __future__ import annotations

import re
from typing import Any, Optional, Sequence

from trm_jax.data import tasks
from trm_jax.data.loaders import (DataFileError, Row, answer_field, describe, read_rows,
                                  require_column, text_field, uid_of, with_instruction)
from trm_jax.data.problem import Problem
from trm_jax.data.rewards import math_reward

DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def load_gsm8k(paths: str | Sequence[str], *,
               instruction: Optional[str] = DEFAULT_INSTRUCTION, split: str = "",
               subset: str = "") -> list[Problem]:
  rows = read_rows(paths, split=split, subset=subset)
  require_column(rows, "gsm8k", "question")
  require_column(rows, "gsm8k", "answer")
  out = []
  for row in rows:
    question = text_field(row, "gsm8k", "question", row.fields.get("question"))
    text = text_field(row, "gsm8k", "answer", row.fields.get("answer"))
    if "####" not in text:
      raise DataFileError(f"gsm8k {row.where}: field 'answer' has no '#### <n>' line")
    worked, final = text.rsplit("####", 1)
    if not final.strip():
      raise DataFileError(f"gsm8k {row.where}: field 'answer' has an empty ground truth "
                          "after '####' (no completion could match it)")
    solution = re.sub(r"<<[^>]*>>", "", text).strip()
    out.append(Problem(prompt=with_instruction(question, instruction), answer=final.strip(),
                       solution=solution if worked.strip() else "", source="gsm8k",
                       uid=uid_of(row)))
  return out


def _dapo_messages(row: Row, prompt: Any) -> tuple[str, Optional[str]]:
  """(user turn, system turn or None) of a DAPO `prompt`: a string or a list of messages."""
  if isinstance(prompt, str):
    return prompt, None
  if not isinstance(prompt, list):
    raise DataFileError(f"dapo_math {row.where}: field 'prompt' is "
                        f"{'null or missing' if prompt is None else describe(prompt)}, "
                        "expected a string or a list of {role, content} messages")
  users, systems = [], []
  for k, m in enumerate(prompt):
    if not isinstance(m, dict):
      raise DataFileError(f"dapo_math {row.where}: field 'prompt' message {k} is "
                          f"{describe(m)}, expected {{role, content}}")
    content = text_field(row, "dapo_math", f"prompt[{k}].content", m.get("content"))
    role = m.get("role")
    if role == "user":
      users.append(content)
    elif role == "system":
      systems.append(content)
  if not users:
    raise DataFileError(f"dapo_math {row.where}: field 'prompt' has no user message")
  return users[-1], (systems[0] if systems else None)


def load_dapo_math(paths: str | Sequence[str], *, split: str = "",
                   subset: str = "") -> list[Problem]:
  rows = read_rows(paths, split=split, subset=subset)
  require_column(rows, "dapo_math", "prompt")
  require_column(rows, "dapo_math", "reward_model")
  out = []
  for row in rows:
    reward_model = row.fields.get("reward_model")
    if not isinstance(reward_model, dict):
      raise DataFileError(f"dapo_math {row.where}: field 'reward_model' is "
                          f"{describe(reward_model)}, expected {{ground_truth, style}}")
    answer = answer_field(row, "dapo_math", "reward_model.ground_truth",
                          reward_model.get("ground_truth"))
    prompt, system = _dapo_messages(row, row.fields.get("prompt"))
    out.append(Problem(prompt=prompt, answer=answer, system=system, source="dapo_math",
                       uid=uid_of(row)))
  return out


def load_aime(paths: str | Sequence[str], *,
              instruction: Optional[str] = DEFAULT_INSTRUCTION, split: str = "",
              subset: str = "") -> list[Problem]:
  rows = read_rows(paths, split=split, subset=subset)
  q_col = require_column(rows, "aime", "problem", "question", "Problem")
  a_col = require_column(rows, "aime", "answer", "Answer")
  out = []
  for row in rows:
    question = text_field(row, "aime", q_col, row.fields.get(q_col))
    answer = answer_field(row, "aime", a_col, row.fields.get(a_col))
    solution = row.fields.get("solution")
    solution = "" if solution is None else text_field(row, "aime", "solution", solution)
    out.append(Problem(prompt=with_instruction(question, instruction), answer=answer,
                       solution=solution, source="aime", uid=uid_of(row)))
  return out


def _reward(completion: str, problem: Problem) -> float:
  return math_reward(completion, problem.answer)


tasks.register_task("gsm8k", tasks.TaskSpec(load=load_gsm8k, reward=_reward, binary=True))
tasks.register_task("dapo_math", tasks.TaskSpec(load=load_dapo_math, reward=_reward,
                                                binary=True))
tasks.register_task("aime", tasks.TaskSpec(load=load_aime, reward=_reward, binary=True))
