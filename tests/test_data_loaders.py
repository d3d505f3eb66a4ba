"""Loaders over small real jsonl / parquet files and `datasets` datasets in the three layouts."""
import dataclasses
import json
import re

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_fixtures import write_rows
from trm_jax.data import DEFAULT_INSTRUCTION, DataFileError, load_problems
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


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_gsm8k(tmp_path, ext):
  path = write_rows(tmp_path, f"gsm8k.{ext}", GSM8K)
  probs = load_problems("gsm8k", path)
  assert [p.answer for p in probs] == ["72", "1,200"]
  assert probs[0].prompt == GSM8K[0]["question"] + "\n" + DEFAULT_INSTRUCTION
  assert "<<" not in probs[0].solution and probs[0].solution.endswith("#### 72")
  assert probs[1].uid == f"gsm8k.{ext}:1" and probs[1].source == "gsm8k"
  assert math_reward("so \\boxed{1200}", probs[1].answer) == 1.0


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_dapo_math(tmp_path, ext):
  path = write_rows(tmp_path, f"dapo.{ext}", DAPO)
  probs = load_problems("dapo_math", path)
  assert [p.answer for p in probs] == ["42", "1"]
  assert probs[0].prompt == DAPO[0]["prompt"][0]["content"] and probs[0].system is None
  assert probs[1].system == "Be careful."
  assert probs[1].messages() == [{"role": "system", "content": "Be careful."},
                                 {"role": "user", "content": DAPO[1]["prompt"][1]["content"]}]
  assert math_reward("6*7 is 42.\nAnswer: 42", probs[0].answer) == 1.0


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_aime(tmp_path, ext):
  path = write_rows(tmp_path, f"aime.{ext}", AIME)
  probs = load_problems("aime", path, instruction=None)
  assert [p.answer for p in probs] == ["25", "4"]
  assert probs[0].prompt == AIME[0]["problem"] and probs[0].solution == AIME[0]["solution"]
  # "question" is accepted in place of "problem".
  alt = write_rows(tmp_path, "aime_q.jsonl", [{"question": "Q?", "answer": "7"}])
  assert load_problems("aime", alt)[0].answer == "7"


def test_several_files(tmp_path):
  a = write_rows(tmp_path, "a.jsonl", GSM8K[:1])
  b = write_rows(tmp_path, "b.jsonl", GSM8K[1:])
  probs = load_problems("gsm8k", [a, b])
  assert [p.answer for p in probs] == ["72", "1,200"]


def test_errors_name_the_file_and_column(tmp_path):
  bad = write_rows(tmp_path, "no_answer.jsonl", [{"question": "q", "solution": "s"}])
  with pytest.raises(ValueError, match=r"gsm8k file .*no_answer.jsonl: missing column 'answer'; "
                                       r"found columns: \['question', 'solution'\]"):
    load_problems("gsm8k", bad)
  no_hash = write_rows(tmp_path, "no_hash.jsonl", [{"question": "q", "answer": "42"}])
  with pytest.raises(ValueError, match=r"no_hash.jsonl, line 1: field 'answer' has no '####"):
    load_problems("gsm8k", no_hash)
  no_gt = write_rows(tmp_path, "no_gt.parquet", [
      {"prompt": [{"role": "user", "content": "x"}], "reward_model": {"style": "rule"}}])
  with pytest.raises(ValueError,
                     match=r"no_gt.parquet, row 1: field 'reward_model.ground_truth' is null"):
    load_problems("dapo_math", no_gt)
  no_problem = write_rows(tmp_path, "aime_bad.jsonl", [{"text": "x", "answer": 1}])
  with pytest.raises(ValueError, match=r"aime_bad.jsonl: missing column 'problem'"):
    load_problems("aime", no_problem)
  with pytest.raises(DataFileError) as e:
    load_problems("gsm8k", str(tmp_path / "nope.jsonl"))
  assert str(e.value) == f"data file {tmp_path / 'nope.jsonl'} does not exist"
  csv = tmp_path / "x.csv"
  csv.write_text("a,b\n")
  with pytest.raises(ValueError, match="unsupported extension '.csv'"):
    load_problems("gsm8k", str(csv))
  with pytest.raises(ValueError, match=r"task must be one of \[.*'gsm8k'.*\], got 'math500'"):
    load_problems("math500", bad)
  with pytest.raises(ValueError, match="task 'synthetic' generates its problems"):
    load_problems("synthetic", bad)


def _raises(kind, path, message, **kw):
  """The loader fails with exactly `message` (one line), which names the file and the row."""
  with pytest.raises(DataFileError) as e:
    load_problems(kind, path, **kw)
  assert str(e.value) == message
  return e


def test_empty_files(tmp_path):
  for name, content in (("empty.jsonl", b""), ("blank.jsonl", b"\n  \n"), ("empty.json", b"[]")):
    path = tmp_path / name
    path.write_bytes(content)
    _raises("gsm8k", str(path), f"{path}: no rows (the file is empty)")
  path = tmp_path / "empty.parquet"
  pq.write_table(pa.table({"question": pa.array([], pa.string()),
                           "answer": pa.array([], pa.string())}), path)
  _raises("gsm8k", str(path), f"{path}: no rows (the file is empty)")


def test_malformed_json(tmp_path):
  path = tmp_path / "bad.jsonl"
  good = json.dumps(GSM8K[0])
  # Line numbers are physical (1-based): the blank line 2 counts.
  path.write_text(f"{good}\n\n{good}\n{{\"question\": \"q\",}}\n{good}\n")
  _raises("gsm8k", str(path), f"{path}, line 4: not valid JSON (Expecting property name "
                              "enclosed in double quotes, column 18)")
  path = tmp_path / "latin1.jsonl"
  path.write_bytes(good.encode() + b"\n" + '{"question": "caf\u00e9"}'.encode("latin-1") + b"\n")
  _raises("gsm8k", str(path), f"{path}, line 2: not UTF-8 (invalid continuation byte at "
                              "byte 17)")
  path = tmp_path / "array.json"
  path.write_text(json.dumps([GSM8K[0], [1, 2]]))
  _raises("gsm8k", str(path), f"{path}, element 2: expected a JSON object with named fields, "
                              "got list")
  path = tmp_path / "broken.json"
  path.write_text("[\n" + good + ",\n" + good + "\n" + good + "\n]")   # a missing comma
  _raises("gsm8k", str(path), f"{path}, line 4: not valid JSON (Expecting ',' delimiter, "
                              "column 1)")
  path = tmp_path / "truncated.parquet"
  pq.write_table(pa.Table.from_pylist(GSM8K), path)
  path.write_bytes(path.read_bytes()[:-20])
  e = _raises_prefix("gsm8k", str(path), f"{path}: not a readable parquet file (")
  assert "\n" not in str(e.value)


def _raises_prefix(kind, path, prefix):
  with pytest.raises(DataFileError) as e:
    load_problems(kind, path)
  assert str(e.value).startswith(prefix), str(e.value)
  return e


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_null_and_non_string_fields(tmp_path, ext):
  at = "line" if ext == "jsonl" else "row"
  path = write_rows(tmp_path, f"null_q.{ext}", [GSM8K[0], {"question": None, "answer": "#### 1"}])
  _raises("gsm8k", path, f"gsm8k file {path}, {at} 2: field 'question' is null or missing")
  path = write_rows(tmp_path, f"null_gt.{ext}", [
      DAPO[0], {"prompt": [{"role": "user", "content": "x"}],
                "reward_model": {"ground_truth": None, "style": "rule"}}])
  _raises("dapo_math", path, f"dapo_math file {path}, {at} 2: field "
                             "'reward_model.ground_truth' is null or missing")
  path = write_rows(tmp_path, f"null_content.{ext}", [
      DAPO[0], {"prompt": [{"role": "user", "content": None}],
                "reward_model": {"ground_truth": "1", "style": "rule"}}])
  _raises("dapo_math", path, f"dapo_math file {path}, {at} 2: field 'prompt[0].content' is "
                             "null or missing")


def test_wrong_types_are_named(tmp_path):
  path = write_rows(tmp_path, "list_q.jsonl", [{"question": ["a", "b"], "answer": "#### 1"}])
  _raises("gsm8k", path, f"gsm8k file {path}, line 1: field 'question' is list ['a', 'b'], "
                         "expected a string")
  path = write_rows(tmp_path, "float_answer.jsonl", [AIME[0], {"problem": "p", "answer": 2.5}])
  _raises("aime", path, f"aime file {path}, line 2: field 'answer' is float 2.5, expected a "
                        "string or an integer")
  path = write_rows(tmp_path, "prompt_int.jsonl", [{"prompt": 7, "reward_model": {
      "ground_truth": "1"}}])
  _raises("dapo_math", path, f"dapo_math file {path}, line 1: field 'prompt' is int 7, "
                             "expected a string or a list of {role, content} messages")
  path = write_rows(tmp_path, "rm_str.jsonl", [{"prompt": "p", "reward_model": "42"}])
  _raises("dapo_math", path, f"dapo_math file {path}, line 1: field 'reward_model' is str "
                             "'42', expected {ground_truth, style}")


def test_empty_ground_truth_is_refused(tmp_path):
  path = write_rows(tmp_path, "gsm8k.jsonl", [GSM8K[0], {"question": "q", "answer": "work\n#### "}])
  _raises("gsm8k", path, f"gsm8k file {path}, line 2: field 'answer' has an empty ground truth "
                         "after '####' (no completion could match it)")
  path = write_rows(tmp_path, "dapo.parquet", [
      DAPO[0], {"prompt": [{"role": "user", "content": "x"}],
                "reward_model": {"ground_truth": "", "style": "rule"}}])
  _raises("dapo_math", path, f"dapo_math file {path}, row 2: field 'reward_model.ground_truth' "
                             "is an empty ground-truth answer (no completion could match it)")
  path = write_rows(tmp_path, "aime.jsonl", [AIME[0], AIME[1], {"problem": "p", "answer": "  "}])
  _raises("aime", path, f"aime file {path}, line 3: field 'answer' is an empty ground-truth "
                        "answer (no completion could match it)")


def test_uid_is_file_and_row(tmp_path):
  """uids stay "<file>:<0-based row>" per file, also across several files and blank lines."""
  a = tmp_path / "a.jsonl"
  a.write_text(json.dumps(GSM8K[0]) + "\n\n" + json.dumps(GSM8K[1]) + "\n")
  b = write_rows(tmp_path, "b.jsonl", GSM8K[:1])
  assert [p.uid for p in load_problems("gsm8k", [str(a), b])] == ["a.jsonl:0", "a.jsonl:1",
                                                                  "b.jsonl:0"]


# ------------------------------------------------------------------ Hugging Face datasets
# Built here, on local disk only: conftest.py sets HF_HUB_OFFLINE, so nothing reaches a network.
def _without_uid(problems):
  return [dataclasses.replace(p, uid="") for p in problems]


@pytest.mark.parametrize("kind,rows,kw", [("gsm8k", GSM8K, {}), ("dapo_math", DAPO, {}),
                                          ("aime", AIME, {"instruction": None})])
def test_save_to_disk_dataset_loads_as_the_same_rows_in_jsonl(tmp_path, kind, rows, kw):
  """A `Dataset.save_to_disk` directory gives the problems the same rows give as a jsonl file
  (nested DAPO messages and AIME's integer answers survive the arrow round trip)."""
  disk = str(tmp_path / kind)
  datasets.Dataset.from_list(rows).save_to_disk(disk)
  from_disk = load_problems(kind, disk, **kw)
  from_jsonl = load_problems(kind, write_rows(tmp_path, f"{kind}.jsonl", rows), **kw)
  assert _without_uid(from_disk) == _without_uid(from_jsonl)
  assert [p.uid for p in from_disk] == [f"{kind}:{i}" for i in range(len(rows))]


def test_dataset_dict_needs_its_split(tmp_path):
  disk = str(tmp_path / "gsm8k_dd")
  datasets.DatasetDict(train=datasets.Dataset.from_list(GSM8K),
                       test=datasets.Dataset.from_list(GSM8K[:1])).save_to_disk(disk)
  _raises("gsm8k", disk, f"dataset {disk} has splits ['test', 'train']: name the one to read "
                         "(task.split / task.eval_split)")
  _raises("gsm8k", disk, f"dataset {disk} (split 'dev'): no split 'dev'; its splits are "
                         "['test', 'train']", split="dev")
  test = load_problems("gsm8k", disk, split="test")
  assert [p.answer for p in test] == ["72"] and test[0].uid == "gsm8k_dd/test:0"
  assert [p.answer for p in load_problems("gsm8k", disk, split="train")] == ["72", "1,200"]
  # Field errors name the dataset, the split and the row.
  bad = str(tmp_path / "bad_dd")
  datasets.DatasetDict(test=datasets.Dataset.from_list(
      [GSM8K[0], {"question": "q", "answer": None}])).save_to_disk(bad)
  _raises("gsm8k", bad, f"gsm8k dataset {bad} (split 'test'), row 2: field 'answer' is null "
                        "or missing", split="test")
  _raises("gsm8k", bad, f"dataset {bad} (subset 'main'): a save_to_disk directory has no "
                        "subsets; leave the subset empty", subset="main")


def test_a_saved_dataset_and_a_file_are_one_split(tmp_path):
  disk = str(tmp_path / "one")
  datasets.Dataset.from_list(GSM8K, split="train").save_to_disk(disk)
  assert len(load_problems("gsm8k", disk, split="train")) == 2   # the split it records
  _raises("gsm8k", disk, f"dataset {disk} (split 'test'): the directory holds one Dataset "
                         "(split train), not a DatasetDict; leave the split empty or name the "
                         "recorded one", split="test")
  path = write_rows(tmp_path, "gsm8k.jsonl", GSM8K)
  _raises("gsm8k", path, f"data file {path}: a file is one split; leave the split and subset "
                         "empty (got split 'train', subset '')", split="train")
  empty = str(tmp_path / "empty")
  datasets.Dataset.from_dict({"question": [], "answer": []}).save_to_disk(empty, num_shards=1)
  _raises("gsm8k", empty, f"dataset {empty}: no rows (the split is empty)")


def test_hub_layout_with_subset_and_split(tmp_path, monkeypatch):
  """A hub repository's layout (GSM8K's: main/{train,test}-*.parquet named by the README's
  `configs`), as a `--local-dir` download leaves it: read by `load_dataset` with subset and
  split, the same call a hub id takes."""
  monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
  repo = tmp_path / "gsm8k_repo"
  (repo / "main").mkdir(parents=True)
  pq.write_table(pa.Table.from_pylist(GSM8K), repo / "main" / "train-00000-of-00001.parquet")
  pq.write_table(pa.Table.from_pylist(GSM8K[1:]), repo / "main" / "test-00000-of-00001.parquet")
  (repo / "README.md").write_text(
      "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n"
      "    path: main/train-*\n  - split: test\n    path: main/test-*\n---\n")
  test = load_problems("gsm8k", str(repo), subset="main", split="test")
  assert [p.answer for p in test] == ["1,200"] and test[0].uid == "gsm8k_repo/main/test:0"
  assert _without_uid(load_problems("gsm8k", str(repo), subset="main", split="train")) == \
      _without_uid(load_problems("gsm8k", write_rows(tmp_path, "g.jsonl", GSM8K)))
  _raises("gsm8k", str(repo), f"dataset {repo} (subset 'main') has splits ['test', 'train']: "
                              "name the one to read (task.split / task.eval_split)",
          subset="main")
  with pytest.raises(DataFileError, match=re.escape(
      f"dataset {repo} (subset 'socratic', split 'train'): BuilderConfig 'socratic' not "
      "found. Available: ['main']")):
    load_problems("gsm8k", str(repo), subset="socratic", split="train")


def test_hub_id_missing_from_the_offline_cache_is_one_line(tmp_path, monkeypatch):
  monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
  monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
  monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
  with pytest.raises(DataFileError) as e:
    load_problems("gsm8k", "trm-jax-tests/no-such-dataset", subset="main", split="train")
  msg = str(e.value)
  assert "\n" not in msg
  assert msg.startswith("dataset trm-jax-tests/no-such-dataset (subset 'main', split 'train'): ")
  assert msg.endswith("(HF_DATASETS_OFFLINE is set: only the local cache is read)")
  # A path shaped like a local file is a missing file, never a hub id.
  with pytest.raises(DataFileError, match="data/train.jsonl does not exist"):
    load_problems("gsm8k", "data/train.jsonl")
