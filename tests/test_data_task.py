"""Task: held-out problems training never sees, a separate evaluation format, and the
synthetic task's sampler lengths derived from its own tokenized worst case."""
import dataclasses
import json
import logging
import os

import ml_collections
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from trm_jax import config as config_lib
from trm_jax.data import fingerprint
from trm_jax.data import synthetic
from trm_jax.data.batching import make_prompt_batch
from trm_jax.data import DataFileError
from trm_jax.data.task import Task, holdout_split

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return synthetic.make_synthetic_tokenizer(str(tmp_path_factory.mktemp("syn_tok")))


def _task_config(**kw) -> ml_collections.ConfigDict:
  c = config_lib.load_config(os.path.join(ROOT, "configs", "tiny_trm.py")).task
  c.update(kw)
  return c


def _write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  return str(path)


def _gsm8k_rows(n):
  return [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}
          for i in range(n)]


# ------------------------------------------------------------------------ synthetic sizes
@pytest.mark.parametrize("name,P,R", [("tiny_trm.py", 23, 55), ("tiny_smd.py", 43, 55)])
def test_derived_sizes_of_the_tiny_configs_are_unchanged(tok, name, P, R):
  """The derived lengths equal what the trainer used before they were derived (prompt chars +
  6 template tokens, solution chars + <eos>), so the tiny runs compile the same shapes."""
  c = config_lib.load_config(os.path.join(ROOT, "configs", name))
  task = Task(c.task, c.seed, tok, c.eval_problems)
  syn = synthetic.from_config(c.task.synthetic)
  assert (task.max_prompt_len, task.max_new_tokens) == (P, R)
  assert (P, R) == (synthetic.max_prompt_chars(syn) + 6, synthetic.max_completion_chars(syn) + 1)


SYN = st.builds(
    lambda lo, extra, vmin, vmax_extra, sub, show, fmt, filler, dist: dict(
        min_operands=lo, max_operands=lo + extra, min_value=vmin, max_value=vmin + vmax_extra,
        allow_subtraction=sub, show_every=show, answer_format=fmt, filler=filler,
        distinct=dist and vmax_extra + 1 >= lo + extra),   # distinct needs enough values
    st.integers(2, 4), st.integers(0, 4), st.integers(0, 20), st.integers(0, 990),
    st.booleans(), st.integers(0, 3), st.sampled_from(["####", "boxed"]), st.integers(0, 3),
    st.booleans())


@settings(max_examples=40, deadline=None)
@given(syn=SYN)
def test_longest_synthetic_prompt_fits_exactly(tok, syn):
  """For any synthetic config: the longest drawable prompt fills max_prompt_len with no
  padding (one token less would reject it), every drawn problem fits, and every correct
  solution plus <eos> fits max_new_tokens."""
  task = Task(_task_config(synthetic=syn), 0, tok, 4)
  P, R = task.max_prompt_len, task.max_new_tokens
  cfg = task.settings
  assert dataclasses.asdict(cfg) == syn
  worst = synthetic.longest_prompt_problem(cfg)
  pb = task.prompts([worst], 1)
  assert pb.tokens.shape == (1, P) and int(pb.lengths[0]) == P
  assert int(pb.tokens[0, 0]) != tok.pad_id
  with pytest.raises(ValueError, match=f"more than max_prompt_len={P - 1}"):
    make_prompt_batch(tok, [worst], 1, max_prompt_len=P - 1)
  drawn = task.batch(0, 24) + task.eval_problems(8)
  lengths = task.prompts(drawn, 1).lengths
  assert lengths.max() <= P
  for p in drawn:
    assert len(tok.encode(p.solution)) + 1 <= R
  assert P == synthetic.max_prompt_chars(cfg) + 6   # "<bos>Q:" + "\n" + "A:" around the problem
  assert R == synthetic.max_completion_chars(cfg) + 1


def test_config_lengths_override_derivation(tok):
  task = Task(_task_config(max_prompt_len=64, max_new_tokens=80), 0, tok, 4)
  assert (task.max_prompt_len, task.max_new_tokens) == (64, 80)
  assert task.prompts(task.batch(0, 3), 2).tokens.shape == (6, 64)


def test_synthetic_streams(tok):
  """Training draws stream `seed` by data position, evaluation stream `seed + 2`."""
  task = Task(_task_config(), 7, tok, 4)
  cfg = task.settings
  assert task.batch(5, 3) == synthetic.problem_batch(cfg, 7, 5, 3)
  assert task.eval_problems(4) == synthetic.problem_batch(cfg, 9, 0, 4)
  assert task.eval_problems(4) == task.eval_problems(4)


# ------------------------------------------------------------------------ file tasks
def test_held_out_rows_are_never_trained_on(tok, tmp_path):
  path = _write_jsonl(tmp_path / "train.jsonl", _gsm8k_rows(10))
  task = Task(_task_config(name="gsm8k", path=path, max_prompt_len=400, max_new_tokens=8),
              0, tok, 3)
  held = task.eval_problems(3)
  assert len(held) == 3 and task.eval_problems(50) == held
  seen = {p.uid for pos in range(0, 40, 4) for p in task.batch(pos, 4)}
  assert seen == {p.uid for p in task.train_set} and len(seen) == 7
  assert not seen & {p.uid for p in held}
  assert seen | {p.uid for p in held} == {f"train.jsonl:{i}" for i in range(10)}
  # Training cycles through the kept rows in file order.
  order = [int(p.uid.split(":")[1]) for p in task.batch(0, 7)]
  assert order == sorted(order) and task.batch(7, 7) == task.batch(0, 7)
  # The split depends on neither the run seed nor anything but (rows, eval_problems).
  other = Task(_task_config(name="gsm8k", path=path, max_prompt_len=400, max_new_tokens=8),
               123, tok, 3)
  assert other.eval_problems(3) == held
  train_rows, eval_rows = holdout_split(10, 3)
  assert [p.uid for p in held] == [f"train.jsonl:{i}" for i in eval_rows]
  assert sorted([*train_rows, *eval_rows]) == list(range(10))
  assert set(holdout_split(10, 5)[1]) > set(eval_rows)   # a larger slice is a superset


def test_no_evaluation_trains_on_every_row(tok, tmp_path):
  path = _write_jsonl(tmp_path / "train.jsonl", _gsm8k_rows(4))
  task = Task(_task_config(name="gsm8k", path=path, max_prompt_len=400, max_new_tokens=8),
              0, tok, 0)
  assert [p.uid for p in task.batch(0, 4)] == [f"train.jsonl:{i}" for i in range(4)]
  assert task.eval_problems(4) == []


def test_file_too_small_to_hold_out(tok, tmp_path):
  path = _write_jsonl(tmp_path / "small.jsonl", _gsm8k_rows(3))
  with pytest.raises(config_lib.ConfigError,
                     match=f"task.path={path} has 3 problems; holding out eval_problems=3 .* "
                           "leaves none to train on"):
    Task(_task_config(name="gsm8k", path=path, max_prompt_len=400, max_new_tokens=8),
         0, tok, 3)


def test_evaluation_file_has_its_own_format(tok, tmp_path):
  """DAPO-Math training, AIME evaluation (task.eval_name)."""
  dapo = _write_jsonl(tmp_path / "dapo.jsonl", [
      {"prompt": [{"role": "user", "content": f"Compute {i}*2."}],
       "reward_model": {"ground_truth": str(2 * i), "style": "rule"}} for i in range(1, 5)])
  aime = _write_jsonl(tmp_path / "aime.jsonl", [
      {"problem": "Find 1+1.", "answer": 2}, {"problem": "Find 2+3.", "answer": 5}])
  kw = dict(name="dapo_math", path=dapo, eval_path=aime, max_prompt_len=400,
            max_new_tokens=8)
  task = Task(_task_config(eval_name="aime", **kw), 0, tok, 30)
  assert [p.answer for p in task.eval_problems(30)] == ["2", "5"]
  assert {p.source for p in task.eval_problems(30)} == {"aime"}
  assert [p.answer for p in task.batch(0, 4)] == ["2", "4", "6", "8"]   # all of the train file
  with pytest.raises(ValueError, match="aime.jsonl: missing column 'prompt'"):
    Task(_task_config(**kw), 0, tok, 30)     # eval_name "" reads AIME as DAPO


def test_file_task_config_errors(tok, tmp_path):
  path = _write_jsonl(tmp_path / "train.jsonl", _gsm8k_rows(4))
  with pytest.raises(config_lib.ConfigError, match="task.name='gsm8k' needs task.path"):
    Task(_task_config(name="gsm8k", max_prompt_len=400, max_new_tokens=8), 0, tok, 0)
  with pytest.raises(config_lib.ConfigError,
                     match="needs task.max_prompt_len and task.max_new_tokens"):
    Task(_task_config(name="gsm8k", path=path, max_new_tokens=8), 0, tok, 0)
  with pytest.raises(config_lib.ConfigError,
                     match=r"\[task.eval_name\]: unknown value 'math500'; expected '' or a task "
                           r"that reads files: 'aime', 'dapo_math'"):
    Task(_task_config(name="gsm8k", path=path, eval_name="math500", max_prompt_len=400,
                      max_new_tokens=8), 0, tok, 0)
  with pytest.raises(config_lib.ConfigError,
                     match="task.eval_name='aime' is the format of task.eval_path, which is "
                           "empty"):
    Task(_task_config(name="gsm8k", path=path, eval_name="aime", max_prompt_len=400,
                      max_new_tokens=8), 0, tok, 0)
  with pytest.raises(config_lib.ConfigError,
                     match=r"\[task.name\]: unknown value 'math500'; expected one of 'aime', "
                           r"'dapo_math', 'govreport'"):
    Task(_task_config(name="math500", path=path), 0, tok, 0)


def test_file_task_prompts_have_the_configured_width(tok, tmp_path):
  path = _write_jsonl(tmp_path / "train.jsonl", _gsm8k_rows(6))
  task = Task(_task_config(name="gsm8k", path=path, max_prompt_len=400, max_new_tokens=8),
              0, tok, 2)
  pb = task.prompts(task.batch(0, 2), 3)
  assert pb.tokens.shape == (6, 400)
  np.testing.assert_array_equal(pb.problem_ids, [0, 0, 0, 1, 1, 1])


def test_held_out_split_of_a_dataset(tok, tmp_path):
  """A DatasetDict's test split is the held-out set (task.eval_split, no eval_path); training
  cycles through all of its train split and never draws a test problem."""
  import datasets  # pylint: disable=g-import-not-at-top
  rows = _gsm8k_rows(7)
  disk = str(tmp_path / "gsm8k")
  datasets.DatasetDict(train=datasets.Dataset.from_list(rows[:5]),
                       test=datasets.Dataset.from_list(rows[5:])).save_to_disk(disk)
  kw = dict(name="gsm8k", path=disk, split="train", max_prompt_len=400, max_new_tokens=8)
  task = Task(_task_config(eval_split="test", **kw), 0, tok, 30)
  assert [p.answer for p in task.eval_problems(30)] == ["6", "7"]
  assert [p.answer for p in task.batch(0, 5)] == ["1", "2", "3", "4", "5"]
  assert task.batch(5, 5) == task.batch(0, 5)
  # Without eval_split the held-out rules for one split apply: rows of `train` held out.
  task = Task(_task_config(**kw), 0, tok, 2)
  assert {p.uid for p in task.eval_problems(2)} == {f"gsm8k/train:{i}"
                                                    for i in holdout_split(5, 2)[1]}
  with pytest.raises(config_lib.ConfigError,
                     match=r"\[task.split, task.eval_split\]: task.eval_split='train' is the "
                           "training split of task.path"):
    Task(_task_config(eval_split="train", **kw), 0, tok, 2)
  with pytest.raises(config_lib.ConfigError, match="task.eval_subset='main' selects within "
                                                   "task.eval_path, which is empty"):
    Task(_task_config(eval_subset="main", **kw), 0, tok, 2)
  with pytest.raises(config_lib.ConfigError, match="task.name=.synthetic. reads no dataset"):
    Task(_task_config(split="train"), 0, tok, 2)


# ------------------------------------------------------------- what the trainer checks up front
def test_a_prompt_longer_than_max_prompt_len_names_the_file_and_row(tok, tmp_path):
  rows = _gsm8k_rows(6)
  rows[4]["question"] = "What is " + " + ".join(["1"] * 30) + "?"
  path = _write_jsonl(tmp_path / "train.jsonl", rows)
  task = Task(_task_config(name="gsm8k", path=path, max_prompt_len=120, max_new_tokens=8),
              seed=0, tokenizer=tok, eval_problems=0)
  with pytest.raises(DataFileError) as e:   # a user error: the CLI prints this one line
    task.check_prompts(eval_problems=0)
  assert str(e.value) == (f"{path}, problem train.jsonl:4: the prompt is 203 tokens, more than "
                          "task.max_prompt_len=120; raise it (or drop the row, or set "
                          "task.drop_long_prompts)")


def test_drop_long_prompts_leaves_out_the_rows_that_do_not_fit(tok, tmp_path, caplog):
  """task.drop_long_prompts: a training row and a held-out row too long for max_prompt_len
  are left out (one warning per source, naming the longest); the rest train and evaluate."""
  rows = _gsm8k_rows(8)
  long_question = "What is " + " + ".join(["1"] * 30) + "?"
  rows[1]["question"] = rows[4]["question"] = long_question   # row 4 is held out
  path = _write_jsonl(tmp_path / "train.jsonl", rows)
  kw = dict(name="gsm8k", path=path, max_prompt_len=120, max_new_tokens=8,
            drop_long_prompts=True)
  task = Task(_task_config(**kw), seed=0, tokenizer=tok, eval_problems=3)
  held = {p.uid for p in task.eval_problems(3)}
  with caplog.at_level(logging.WARNING, logger="trm_jax.data.task"):
    task.check_prompts(eval_problems=3)
  assert "train.jsonl:1" not in {p.uid for p in task.batch(0, 10)}
  assert "train.jsonl:4" in held and "train.jsonl:4" not in {p.uid for p in task.eval_problems(3)}
  assert len(task.train_set) + len(task.eval_set) == 6
  assert {p.uid for p in task.eval_set} == held - {"train.jsonl:4"}
  dropped = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
  assert len(dropped) == 2 and all("left out 1 of" in m and "problem train.jsonl:" in m and
                                   "is 203 tokens" in m for m in dropped)
  # Nothing fits: an error, not an empty task.
  path = _write_jsonl(tmp_path / "long.jsonl", [{"question": long_question, "answer": "#### 30"}])
  task = Task(_task_config(**{**kw, "path": path}), seed=0, tokenizer=tok, eval_problems=0)
  with pytest.raises(DataFileError, match=r"long.jsonl: every prompt is longer than "
                                          r"task.max_prompt_len=120 \(the longest, problem "
                                          r"long.jsonl:0, is 203 tokens\); raise it"):
    task.check_prompts(eval_problems=0)


def test_a_tokenizer_that_cannot_spell_the_prompts_is_warned_about_once(tok, tmp_path, caplog):
  """Issue 22, item 4: gsm8k-style prose through the synthetic tokenizer (digits and
  operators only) is mostly <unk>."""
  rows = [{"question": f"Natalia sold clips to {i} of her friends. How many?",
           "answer": f"#### {i}"} for i in range(5)]
  path = _write_jsonl(tmp_path / "words.jsonl", rows)
  task = Task(_task_config(name="gsm8k", path=path, max_prompt_len=200, max_new_tokens=8),
              seed=0, tokenizer=tok, eval_problems=0)
  with caplog.at_level(logging.WARNING, logger="trm_jax.data.task"):
    task.check_prompts(eval_problems=0)
  assert len(caplog.records) == 1
  msg = caplog.records[0].getMessage()
  assert msg.startswith(f"5 of 5 sampled prompts are mostly unknown tokens to the tokenizer at "
                        f"{tok.path} (problem words.jsonl:0: ")
  assert "tokens are <unk>): the model cannot read them" in msg
  caplog.clear()
  task = Task(_task_config(), seed=0, tokenizer=tok, eval_problems=0)   # its own tokenizer
  with caplog.at_level(logging.WARNING, logger="trm_jax.data.task"):
    task.check_prompts(eval_problems=0)
  assert not caplog.records


def test_more_eval_problems_than_the_eval_file_holds_is_said_once(tok, tmp_path, caplog):
  train = _write_jsonl(tmp_path / "train.jsonl", _gsm8k_rows(6))
  held = _write_jsonl(tmp_path / "test.jsonl", _gsm8k_rows(3))
  with caplog.at_level(logging.WARNING, logger="trm_jax.data.task"):
    task = Task(_task_config(name="gsm8k", path=train, eval_path=held, max_prompt_len=120,
                             max_new_tokens=8), seed=0, tokenizer=tok, eval_problems=100000000)
    assert len(task.eval_problems(100000000)) == 3
  assert [r.getMessage() for r in caplog.records] == [
      f"eval_problems=100000000, but task.eval_path={held} has 3 problems: evaluating on all 3"]


def test_the_data_fingerprint_sees_changed_rows_not_a_touched_file(tok, tmp_path):
  path = tmp_path / "train.jsonl"
  _write_jsonl(path, _gsm8k_rows(6))
  cfg = _task_config(name="gsm8k", path=str(path), max_prompt_len=120, max_new_tokens=8)
  before = Task(cfg, seed=0, tokenizer=tok, eval_problems=2).fingerprint
  assert sorted(before) == ["task.path"] and before["task.path"]["rows"] == 6
  os.utime(path, (1, 1))                                  # touched (or copied): same rows
  touched = Task(cfg, seed=0, tokenizer=tok, eval_problems=2).fingerprint
  assert touched["task.path"]["mtime"] != before["task.path"]["mtime"]
  assert fingerprint.changes(before, touched) == {}
  rows = _gsm8k_rows(6)
  rows[2]["answer"] = "#### 99"                           # one answer rewritten
  _write_jsonl(path, rows)
  after = Task(cfg, seed=0, tokenizer=tok, eval_problems=2).fingerprint
  assert list(fingerprint.changes(before, after)) == ["task.path"]
  assert Task(_task_config(), seed=0, tokenizer=tok, eval_problems=2).fingerprint == {}
