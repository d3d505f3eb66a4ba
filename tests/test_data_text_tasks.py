"""TL;DR, GovReport and HotpotQA as registered tasks: their loaders over small real jsonl,
parquet, `save_to_disk` and hub-layout datasets written here, their prompts and references,
their one-line errors, and their rewards through the registry."""
import dataclasses
import json
import re

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_fixtures import write_rows
from trm_jax.data import TASKS, DataFileError, Problem, load_problems, qa_f1, rouge_l, tasks
from trm_jax.data.hotpotqa import INSTRUCTION as HOTPOT_INSTRUCTION
from trm_jax.data.summarization import GOVREPORT_INSTRUCTION, TLDR_INSTRUCTION

TLDR = [
    {"prompt": "SUBREDDIT: r/relationships\n\nTITLE: My friend keeps cancelling plans\n\n"
               "POST: We agreed to meet three times this month and she cancelled each time "
               "an hour before.\n\nTL;DR:",
     "completion": " friend cancels every plan at the last minute, what do I do?"},
    {"prompt": "SUBREDDIT: r/personalfinance\n\nTITLE: Pay off the car or invest?\n\nPOST: "
               "I have $5,000 saved and a 6% car loan.\n\nTL;DR:",
     "completion": " should I pay off a 6% car loan or invest $5k?"},
]
GOVREPORT = [
    {"report": "The Department of Defense (DOD) spent $4.5 billion on spare parts in fiscal "
               "year 2019. GAO found that inventory records were incomplete.",
     "summary": "GAO found DOD's spare-parts inventory records incomplete."},
    {"report": "Federal agencies reported 28,000 security incidents in 2018.",
     "summary": "Agencies reported 28,000 incidents."},
]
# HotpotQA's datasets layout: context = {title: [...], sentences: [[...], ...]}; the sentences
# carry their own leading spaces, as in the dataset.
HOTPOT = [
    {"id": "5a8b57f25542995d1e6f1371",
     "question": "Were Scott Derrickson and Ed Wood of the same nationality?", "answer": "yes",
     "type": "comparison", "level": "hard",
     "supporting_facts": {"title": ["Scott Derrickson", "Ed Wood"], "sent_id": [0, 0]},
     "context": {"title": ["Ed Wood", "Scott Derrickson", "Doctor Strange"],
                 "sentences": [["Edward Davis Wood Jr. was an American filmmaker.",
                                " He made Plan 9 from Outer Space."],
                               ["Scott Derrickson (born July 16, 1966) is an American director."],
                               ["Doctor Strange is a 2016 film.", " It was directed by Scott "
                                                                  "Derrickson."]]}},
    {"id": "5a8c7595554299585d9e36b6",
     "question": "What year was the director of Doctor Strange born?", "answer": "1966",
     "type": "bridge", "level": "medium",
     "supporting_facts": {"title": ["Doctor Strange"], "sent_id": [1]},
     "context": {"title": ["Scott Derrickson", "Doctor Strange"],
                 "sentences": [["Scott Derrickson (born July 16, 1966) is an American director."],
                               ["Doctor Strange is a 2016 film.", " It was directed by Scott "
                                                                  "Derrickson."]]}},
]


def _without_uid(problems):
  return [dataclasses.replace(p, uid="") for p in problems]


def _raises(name, path, message, **kw):
  with pytest.raises(DataFileError) as e:
    load_problems(name, path, **kw)
  assert str(e.value) == message
  return e


# ------------------------------------------------------------------ prompts and references
@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_tldr(tmp_path, ext):
  path = write_rows(tmp_path, f"tldr.{ext}", TLDR)
  probs = load_problems("tldr", path)
  assert probs[0].prompt == TLDR[0]["prompt"] + "\n" + TLDR_INSTRUCTION
  assert [p.answer for p in probs] == [r["completion"].strip() for r in TLDR]
  assert [p.solution for p in probs] == [p.answer for p in probs]   # the SFT target
  assert probs[1].uid == f"tldr.{ext}:1" and probs[1].source == "tldr"
  assert load_problems("tldr", path, instruction=None)[0].prompt == TLDR[0]["prompt"]


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_govreport(tmp_path, ext):
  path = write_rows(tmp_path, f"gov.{ext}", GOVREPORT)
  probs = load_problems("govreport", path)
  assert probs[1].prompt == GOVREPORT[1]["report"] + "\n" + GOVREPORT_INSTRUCTION
  assert [p.answer for p in probs] == [r["summary"] for r in GOVREPORT]
  assert probs[0].prompt.endswith(GOVREPORT_INSTRUCTION)   # the instruction last


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_hotpotqa_prompt_holds_every_sentence_and_ends_with_the_question(tmp_path, ext):
  path = write_rows(tmp_path, f"hotpot.{ext}", HOTPOT)
  probs = load_problems("hotpotqa", path)
  assert [p.answer for p in probs] == ["yes", "1966"]
  assert probs[1].solution == "Answer: 1966" and probs[1].source == "hotpotqa"
  for p, row in zip(probs, HOTPOT):
    for title, sentences in zip(row["context"]["title"], row["context"]["sentences"]):
      assert f"{title}: {sentences[0]}" in p.prompt
      for s in sentences:
        assert s in p.prompt
    # The question last (before the instruction): where SnapKV's observation window looks.
    assert p.prompt.endswith(f"Question: {row['question']}\n{HOTPOT_INSTRUCTION}")
  assert probs[1].prompt == (
      "Scott Derrickson: Scott Derrickson (born July 16, 1966) is an American director.\n\n"
      "Doctor Strange: Doctor Strange is a 2016 film. It was directed by Scott Derrickson.\n\n"
      "Question: What year was the director of Doctor Strange born?\n" + HOTPOT_INSTRUCTION)


def test_hotpotqa_original_json_layout(tmp_path):
  """The original files' context, [[title, [sentences]], ...], gives the same problems."""
  rows = [dict(r, context=[[t, s] for t, s in zip(r["context"]["title"],
                                                   r["context"]["sentences"])])
          for r in HOTPOT]
  path = tmp_path / "hotpot_dev_distractor_v1.json"
  path.write_text(json.dumps(rows))       # one JSON array, as distributed
  assert _without_uid(load_problems("hotpotqa", str(path))) == \
      _without_uid(load_problems("hotpotqa", write_rows(tmp_path, "h.jsonl", HOTPOT)))


# ------------------------------------------------------------------ datasets
@pytest.mark.parametrize("name,rows", [("tldr", TLDR), ("govreport", GOVREPORT),
                                       ("hotpotqa", HOTPOT)])
def test_save_to_disk_dataset_dict_is_the_jsonl_rows(tmp_path, name, rows):
  disk = str(tmp_path / name)
  datasets.DatasetDict(train=datasets.Dataset.from_list(rows),
                       test=datasets.Dataset.from_list(rows[1:])).save_to_disk(disk)
  train = load_problems(name, disk, split="train")
  assert _without_uid(train) == _without_uid(load_problems(name, write_rows(tmp_path, "r.jsonl",
                                                                         rows)))
  assert [p.uid for p in load_problems(name, disk, split="test")] == [f"{name}/test:0"]


def test_hotpotqa_hub_layout_with_subset(tmp_path, monkeypatch):
  """`hotpot_qa`'s layout (distractor/{train,validation}-*.parquet named by the README's
  configs), as a `--local-dir` download leaves it: read with subset and split."""
  monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
  repo = tmp_path / "hotpot_qa"
  (repo / "distractor").mkdir(parents=True)
  pq.write_table(pa.Table.from_pylist(HOTPOT), repo / "distractor" / "train-00000-of-00001.parquet")
  pq.write_table(pa.Table.from_pylist(HOTPOT[1:]),
                 repo / "distractor" / "validation-00000-of-00001.parquet")
  (repo / "README.md").write_text(
      "---\nconfigs:\n- config_name: distractor\n  data_files:\n  - split: train\n"
      "    path: distractor/train-*\n  - split: validation\n    path: distractor/validation-*\n"
      "---\n")
  val = load_problems("hotpotqa", str(repo), subset="distractor", split="validation")
  assert [p.answer for p in val] == ["1966"] and val[0].uid == "hotpot_qa/distractor/validation:0"
  assert _without_uid(load_problems("hotpotqa", str(repo), subset="distractor",
                                    split="train")) == \
      _without_uid(load_problems("hotpotqa", write_rows(tmp_path, "h.jsonl", HOTPOT)))


def test_hub_id_missing_from_the_offline_cache_is_one_line(tmp_path, monkeypatch):
  monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
  monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
  monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
  with pytest.raises(DataFileError) as e:
    load_problems("govreport", "trm-jax-tests/no-govreport", split="train")
  assert "\n" not in str(e.value)
  assert str(e.value).startswith("dataset trm-jax-tests/no-govreport (split 'train'): ")
  assert str(e.value).endswith("(HF_DATASETS_OFFLINE is set: only the local cache is read)")


# ------------------------------------------------------------------ one-line errors
def test_errors_name_the_dataset_split_and_row(tmp_path):
  path = write_rows(tmp_path, "tldr.jsonl", [TLDR[0], {"prompt": "POST: x\n\nTL;DR:",
                                                   "completion": "  "}])
  _raises("tldr", path, f"tldr file {path}, line 2: field 'completion' is an empty reference "
                        "summary (every completion would score 0)")
  path = write_rows(tmp_path, "gov.jsonl", [{"report": "r", "abstract": "s"}])
  with pytest.raises(DataFileError, match=r"govreport file .*gov.jsonl: missing column "
                                          r"'summary'; found columns: \['abstract', 'report'\]"):
    load_problems("govreport", path)
  bad = str(tmp_path / "bad_dd")
  datasets.DatasetDict(validation=datasets.Dataset.from_list(
      [HOTPOT[0], dict(HOTPOT[1], answer=None)])).save_to_disk(bad)
  _raises("hotpotqa", bad, f"hotpotqa dataset {bad} (split 'validation'), row 2: field "
                           "'answer' is null or missing", split="validation")
  path = write_rows(tmp_path, "ctx.jsonl", [dict(HOTPOT[0], context={"title": ["a", "b"],
                                                                 "sentences": [["x"]]})])
  _raises("hotpotqa", path, f"hotpotqa file {path}, line 1: field 'context' is dict "
                            "{'title': ['a', 'b'], 'sentences': [[..., expected {title: [T "
                            "titles], sentences: [T lists of sentences]}")
  path = write_rows(tmp_path, "sent.jsonl", [dict(HOTPOT[0], context=[["a", "just a string"]])])
  _raises("hotpotqa", path, f"hotpotqa file {path}, line 1: field 'context' paragraph 0 ('a') "
                            "has sentences str 'just a string', expected a list of strings")
  path = write_rows(tmp_path, "empty_ctx.parquet", [dict(HOTPOT[0], context=[])])
  _raises("hotpotqa", path, f"hotpotqa file {path}, row 1: field 'context' has no paragraphs")


# ------------------------------------------------------------------ rewards through the registry
def test_rewards_and_parts_through_the_registry(tmp_path):
  tldr = load_problems("tldr", write_rows(tmp_path, "t.jsonl", TLDR))
  hotpot = load_problems("hotpotqa", write_rows(tmp_path, "h.jsonl", HOTPOT))
  summary = "my friend cancels plans at the last minute"
  assert not TASKS["tldr"].binary and not TASKS["hotpotqa"].binary and TASKS["gsm8k"].binary
  assert TASKS["tldr"].reward(summary, tldr[0]) == rouge_l(summary, tldr[0].answer)
  scores = tasks.score(TASKS["hotpotqa"], "hotpotqa",
                       ["He was born in 1966.\nAnswer: in 1966", "Answer: no"], hotpot[::-1])
  # "in 1966" against "1966": P = 1/2, R = 1, F1 = 2/3; "no" against "yes": 0.
  np.testing.assert_array_equal(scores["reward"], np.float32([2 / 3, 0.0]))
  np.testing.assert_array_equal(scores["exact_match"], [0.0, 0.0])
  assert scores["reward"][0] == np.float32(qa_f1("in 1966", ["1966"]))
  parts = tasks.score(TASKS["govreport"], "govreport", ["Agencies reported incidents."],
                      [load_problems("govreport", write_rows(tmp_path, "g.jsonl", GOVREPORT))[1]])
  # tokens [agenc, report, incid] vs [agenc, report, 28, 000, incid]: LCS 3, P 1, R 3/5.
  assert parts["rouge_l_precision"][0] == 1.0 and parts["rouge_l_recall"][0] == 0.6
  assert parts["reward"][0] == np.float32(0.75)


def test_a_reward_outside_its_range_is_refused():
  problem = Problem(prompt="q", answer="a", uid="toy:3")
  half = tasks.TaskSpec(load=lambda *a, **k: [], reward=lambda c, p: 0.5, binary=True)
  with pytest.raises(ValueError, match=re.escape("task 'toy': the reward of a completion of "
                                                 "problem 'toy:3' is 0.5, not 0 or 1 (a binary "
                                                 "task)")):
    tasks.score(half, "toy", ["x"], [problem])
  big = dataclasses.replace(half, reward=lambda c, p: 1.5, binary=False)
  with pytest.raises(ValueError, match=r"is 1.5, not in \[0, 1\]"):
    tasks.score(big, "toy", ["x"], [problem])
  with pytest.raises(ValueError, match="exactly one source of problems"):
    tasks.TaskSpec(reward=lambda c, p: 0.0, binary=True)
  with pytest.raises(ValueError, match="parts are for graded tasks"):
    dataclasses.replace(half, parts=lambda c, p: {})
