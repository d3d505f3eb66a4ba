"""Summarisation tasks, the SMD paper's long-context ones: Reddit TL;DR and GovReport, each
rewarded by ROUGE-L F against the reference summary (data/text_rewards.py; graded).

  tldr       trl-lib/tldr: `prompt` (the post: "SUBREDDIT: ... TITLE: ... POST: ... TL;DR:")
             and `completion` (the reference summary). Posts are at most about 550 tokens.
  govreport  ccdv/govreport-summarization: `report` (a U.S. Government Accountability Office
             or Congressional Research Service report, often 5-20K tokens) and `summary`.

The user turn is the document followed by `instruction` (the question last, where a
compressed KV cache's observation window looks: SnapKV keeps the keys the last queries
attend to). `Problem.answer` and `Problem.solution` are the reference summary (the reward's
reference, and the target of a supervised warm-up). The logged parts are ROUGE-L's precision
and recall, which show a policy trading one for the other (longer summaries raise recall).
Sources and their one-line errors are data/loaders.py's.
"""
from __future__ import annotations

from typing import Optional, Sequence

from trm_jax.data import tasks
from trm_jax.data.loaders import (DataFileError, read_rows, require_column, text_field, uid_of,
                                  with_instruction)
from trm_jax.data.problem import Problem
from trm_jax.data.text_rewards import rouge_l_scores

TLDR_INSTRUCTION = "Write a one-sentence summary (TL;DR) of the post above."
GOVREPORT_INSTRUCTION = "Summarize the report above in a few paragraphs."


def _load(name: str, document: str, reference: str, paths: str | Sequence[str],
          instruction: Optional[str], split: str, subset: str) -> list[Problem]:
  """One Problem per row: prompt = the `document` field + instruction, reference summary =
  the `reference` field (stripped; an empty one is an error naming the row)."""
  rows = read_rows(paths, split=split, subset=subset)
  require_column(rows, name, document)
  require_column(rows, name, reference)
  out = []
  for row in rows:
    doc = text_field(row, name, document, row.fields.get(document))
    summary = text_field(row, name, reference, row.fields.get(reference)).strip()
    if not doc.strip():
      raise DataFileError(f"{name} {row.where}: field {document!r} is empty (nothing to "
                          "summarise)")
    if not summary:
      raise DataFileError(f"{name} {row.where}: field {reference!r} is an empty reference "
                          "summary (every completion would score 0)")
    out.append(Problem(prompt=with_instruction(doc, instruction), answer=summary,
                       solution=summary, source=name, uid=uid_of(row)))
  return out


def load_tldr(paths: str | Sequence[str], *, instruction: Optional[str] = TLDR_INSTRUCTION,
              split: str = "", subset: str = "") -> list[Problem]:
  """TL;DR posts (`prompt`) and reference summaries (`completion`)."""
  return _load("tldr", "prompt", "completion", paths, instruction, split, subset)


def load_govreport(paths: str | Sequence[str], *,
                   instruction: Optional[str] = GOVREPORT_INSTRUCTION, split: str = "",
                   subset: str = "") -> list[Problem]:
  """GovReport reports (`report`) and reference summaries (`summary`)."""
  return _load("govreport", "report", "summary", paths, instruction, split, subset)


def _reward(completion: str, problem: Problem) -> float:
  return rouge_l_scores(completion, problem.answer)[2]


def _parts(completion: str, problem: Problem) -> dict[str, float]:
  precision, recall, _ = rouge_l_scores(completion, problem.answer)
  return {"rouge_l_precision": precision, "rouge_l_recall": recall}


tasks.register_task("tldr", tasks.TaskSpec(load=load_tldr, reward=_reward, parts=_parts,
                                           binary=False))
tasks.register_task("govreport", tasks.TaskSpec(load=load_govreport, reward=_reward,
                                                parts=_parts, binary=False))
