"""Loaders over small real jsonl / parquet files in the three layouts."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trm_jax.data.loaders import DEFAULT_INSTRUCTION, load_problems
from trm_jax.data.rewards import math_reward

GSM8K = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
     "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nTotal 48+24 = <<48+24=72>>72.\n"
               "#### 72"},
    {"question": "A shop sells 1,200 pens.", "answer": "It is 1,200.\n#### 1,200"},
]
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response "
               "should be of the form Answer: $Answer (without quotes) where $Answer is the "
               "answer to the problem.\n\n")
DAPO = [
    {"data_source": "math_dapo", "ability": "MATH",
     "prompt": [{"role": "user", "content": DAPO_PREFIX + "Compute 6*7."}],
     "reward_model": {"ground_truth": "42", "style": "rule-lighteval/MATH_v2"},
     "extra_info": {"index": "a1"}},
    {"data_source": "math_dapo", "ability": "MATH",
     "prompt": [{"role": "system", "content": "Be careful."},
                {"role": "user", "content": DAPO_PREFIX + "Compute 3/4 + 1/4."}],
     "reward_model": {"ground_truth": "1", "style": "rule-lighteval/MATH_v2"},
     "extra_info": {"index": "a2"}},
]
AIME = [
    {"id": 0, "problem": "Find the remainder when 2025 is divided by 1000.", "answer": 25,
     "solution": "2025 = 2*1000 + 25."},
    {"id": 1, "problem": "How many primes are below 10?", "answer": 4, "solution": "2,3,5,7."},
]


def _write(tmp_path, name, rows):
  path = tmp_path / name
  if name.endswith(".parquet"):
    pq.write_table(pa.Table.from_pylist(rows), path)
  else:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  return str(path)


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_gsm8k(tmp_path, ext):
  path = _write(tmp_path, f"gsm8k.{ext}", GSM8K)
  probs = load_problems("gsm8k", path, cache_dir=str(tmp_path / "cache"))
  assert [p.answer for p in probs] == ["72", "1,200"]
  assert probs[0].prompt == GSM8K[0]["question"] + "\n" + DEFAULT_INSTRUCTION
  assert "<<" not in probs[0].solution and probs[0].solution.endswith("#### 72")
  assert probs[1].uid == f"gsm8k.{ext}:1" and probs[1].source == "gsm8k"
  assert math_reward("so \\boxed{1200}", probs[1].answer) == 1.0


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_dapo_math(tmp_path, ext):
  path = _write(tmp_path, f"dapo.{ext}", DAPO)
  probs = load_problems("dapo_math", path, cache_dir=str(tmp_path / "cache"))
  assert [p.answer for p in probs] == ["42", "1"]
  assert probs[0].prompt == DAPO[0]["prompt"][0]["content"] and probs[0].system is None
  assert probs[1].system == "Be careful."
  assert probs[1].messages() == [{"role": "system", "content": "Be careful."},
                                 {"role": "user", "content": DAPO[1]["prompt"][1]["content"]}]
  assert math_reward("6*7 is 42.\nAnswer: 42", probs[0].answer) == 1.0


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_aime(tmp_path, ext):
  path = _write(tmp_path, f"aime.{ext}", AIME)
  probs = load_problems("aime", path, instruction=None, cache_dir=str(tmp_path / "cache"))
  assert [p.answer for p in probs] == ["25", "4"]
  assert probs[0].prompt == AIME[0]["problem"] and probs[0].solution == AIME[0]["solution"]
  # "question" is accepted in place of "problem".
  alt = _write(tmp_path, "aime_q.jsonl", [{"question": "Q?", "answer": "7"}])
  assert load_problems("aime", alt, cache_dir=str(tmp_path / "cache"))[0].answer == "7"


def test_several_files(tmp_path):
  a = _write(tmp_path, "a.jsonl", GSM8K[:1])
  b = _write(tmp_path, "b.jsonl", GSM8K[1:])
  probs = load_problems("gsm8k", [a, b], cache_dir=str(tmp_path / "cache"))
  assert [p.answer for p in probs] == ["72", "1,200"]


def test_errors_name_the_file_and_column(tmp_path):
  cache = str(tmp_path / "cache")
  bad = _write(tmp_path, "no_answer.jsonl", [{"question": "q", "solution": "s"}])
  with pytest.raises(ValueError, match=r"gsm8k file .*no_answer.jsonl: missing column 'answer'"):
    load_problems("gsm8k", bad, cache_dir=cache)
  no_hash = _write(tmp_path, "no_hash.jsonl", [{"question": "q", "answer": "42"}])
  with pytest.raises(ValueError, match=r"no_hash.jsonl, row 0: column 'answer' has no '####"):
    load_problems("gsm8k", no_hash, cache_dir=cache)
  no_gt = _write(tmp_path, "no_gt.parquet", [
      {"prompt": [{"role": "user", "content": "x"}], "reward_model": {"style": "rule"}}])
  with pytest.raises(ValueError, match=r"no_gt.parquet.*'reward_model.ground_truth'"):
    load_problems("dapo_math", no_gt, cache_dir=cache)
  no_problem = _write(tmp_path, "aime_bad.jsonl", [{"text": "x", "answer": 1}])
  with pytest.raises(ValueError, match=r"aime_bad.jsonl: missing column 'problem'"):
    load_problems("aime", no_problem, cache_dir=cache)
  with pytest.raises(FileNotFoundError, match="nope.jsonl does not exist"):
    load_problems("gsm8k", str(tmp_path / "nope.jsonl"))
  csv = tmp_path / "x.csv"
  csv.write_text("a,b\n")
  with pytest.raises(ValueError, match="unsupported extension '.csv'"):
    load_problems("gsm8k", str(csv))
  with pytest.raises(ValueError, match="unknown problem source 'math500'"):
    load_problems("math500", bad)
