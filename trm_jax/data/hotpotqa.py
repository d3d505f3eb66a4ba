"""HotpotQA (distractor setting), the SMD paper's multi-hop QA task: the answer needs facts
from two of ten paragraphs, eight of them distractors. Rewarded by SQuAD token F1 of the
extracted answer against the reference (graded); exact match is logged beside it.

Fields (the Hugging Face `hotpot_qa` dataset, config "distractor", and the original JSON):
`question`, `answer`, `context` = the paragraphs, either {"title": [T], "sentences": [[S]]}
(the datasets / parquet layout) or [[title, [sentence, ...]], ...] (the original files).
Other fields (`supporting_facts`, `type`, `level`, `id`) are not read.

Prompt (the user turn): every paragraph as "<title>: <its sentences joined as given>" (the
sentences carry their own leading spaces), one per block, then "Question: <question>" and
`instruction`, the question last where a compressed KV cache's observation window looks.
The instruction asks for a final line "Answer: <short answer>"; the reward reads the last such
line (`extract_answer`), or the whole completion when there is none. `Problem.answer` is the
reference answer, `Problem.solution` the line "Answer: <reference>" (a supervised target in the
same format).
"""
from __future__ import annotations

import re
from typing import Any, Optional, Sequence

from trm_jax.data import tasks
from trm_jax.data.loaders import (DataFileError, Row, answer_field, describe, read_rows,
                                  require_column, text_field, uid_of)
from trm_jax.data.problem import Problem
from trm_jax.data.text_rewards import qa_exact_match, qa_f1

INSTRUCTION = ("Answer the question using the paragraphs above. End your response with a line "
               "of the form \"Answer: <answer>\", where <answer> is a few words from the "
               "paragraphs, or yes or no.")
_ANSWER_LINE = re.compile(r"(?i)answer\s*:[ \t]*([^\n]*)")


def extract_answer(completion: str) -> str:
  """The text after the last "Answer:" (to the end of its line), else the whole completion."""
  found = _ANSWER_LINE.findall(completion)
  return found[-1].strip() if found else completion.strip()


def _paragraphs(row: Row, context: Any) -> list[tuple[str, list[str]]]:
  """[(title, sentences)] of a `context` field in either layout (module docstring)."""
  if isinstance(context, dict):
    titles, sentences = context.get("title"), context.get("sentences")
    if not isinstance(titles, list) or not isinstance(sentences, list) \
        or len(titles) != len(sentences):
      raise DataFileError(f"hotpotqa {row.where}: field 'context' is {describe(context)}, "
                          "expected {title: [T titles], sentences: [T lists of sentences]}")
    pairs = list(zip(titles, sentences))
  elif isinstance(context, list):
    if not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in context):
      raise DataFileError(f"hotpotqa {row.where}: field 'context' is {describe(context)}, "
                          "expected a list of [title, [sentences]] pairs")
    pairs = [tuple(p) for p in context]
  else:
    raise DataFileError(f"hotpotqa {row.where}: field 'context' is "
                        f"{'null or missing' if context is None else describe(context)}, "
                        "expected {title, sentences} or a list of [title, [sentences]]")
  if not pairs:
    raise DataFileError(f"hotpotqa {row.where}: field 'context' has no paragraphs")
  out = []
  for k, (title, sentences) in enumerate(pairs):
    title = text_field(row, "hotpotqa", f"context title {k}", title)
    if not isinstance(sentences, list):
      raise DataFileError(f"hotpotqa {row.where}: field 'context' paragraph {k} ({title!r}) "
                          f"has sentences {describe(sentences)}, expected a list of strings")
    out.append((title, [text_field(row, "hotpotqa", f"context paragraph {k} sentence {j}", s)
                        for j, s in enumerate(sentences)]))
  return out


def format_prompt(question: str, paragraphs: Sequence[tuple[str, Sequence[str]]],
                  instruction: Optional[str] = INSTRUCTION) -> str:
  """The user turn: the paragraphs, then the question, then the instruction."""
  blocks = [f"{title}: {''.join(sentences).strip()}" for title, sentences in paragraphs]
  tail = f"Question: {question.strip()}" + (f"\n{instruction}" if instruction else "")
  return "\n\n".join([*blocks, tail])


def load_hotpotqa(paths: str | Sequence[str], *, instruction: Optional[str] = INSTRUCTION,
                  split: str = "", subset: str = "") -> list[Problem]:
  rows = read_rows(paths, split=split, subset=subset)
  for column in ("question", "answer", "context"):
    require_column(rows, "hotpotqa", column)
  out = []
  for row in rows:
    question = text_field(row, "hotpotqa", "question", row.fields.get("question"))
    answer = answer_field(row, "hotpotqa", "answer", row.fields.get("answer"))
    prompt = format_prompt(question, _paragraphs(row, row.fields.get("context")), instruction)
    out.append(Problem(prompt=prompt, answer=answer, solution=f"Answer: {answer}",
                       source="hotpotqa", uid=uid_of(row)))
  return out


def _reward(completion: str, problem: Problem) -> float:
  return qa_f1(extract_answer(completion), [problem.answer])


def _parts(completion: str, problem: Problem) -> dict[str, float]:
  return {"exact_match": qa_exact_match(extract_answer(completion), [problem.answer])}


tasks.register_task("hotpotqa", tasks.TaskSpec(load=load_hotpotqa, reward=_reward, parts=_parts,
                                               binary=False))
