"""A run that cannot work fails at load time in one line naming the bad thing, not minutes later
(or never: before these checks a tokenizer past the vocabulary or NaN weights made every update
skip while the run exited 0).

The trainer is started in-process on a tiny checkpoint written by transformers (with the
synthetic task's tokenizer beside it) and a gsm8k file task, each case breaking one thing:
the weights, the checkpoint files, the tokenizer, the data file. Each must raise one of
`train.USER_ERRORS` (what the CLI prints as one `error: ...` line) with exactly the message
below. One case also goes through the real CLI to show the single line.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import hf_fixtures
from trm_jax import train
from trm_jax.data import synthetic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A good tiny Qwen3 checkpoint (vocab 128) with the synthetic tokenizer (31 ids)."""
  path = str(tmp_path_factory.mktemp("ckpt") / "good")
  hf_fixtures.make_hf_checkpoint(path, "qwen3")
  synthetic.make_synthetic_tokenizer(path)
  return path


@pytest.fixture
def gsm8k(tmp_path):
  rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}
          for i in range(12)]
  path = tmp_path / "train.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _copy(checkpoint, dst):
  os.makedirs(dst)
  for f in os.listdir(checkpoint):
    with open(os.path.join(checkpoint, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
      b.write(a.read())
  return dst


def _config(model_path, data_path):
  c = train.config_lib.load_config(train.DEFAULT_CONFIG)
  c.model.path = model_path
  c.task.name, c.task.path = "gsm8k", data_path
  c.task.max_prompt_len, c.task.max_new_tokens = 64, 8
  c.total_steps, c.eval_problems, c.rl.batch_size, c.rl.group_size = 1, 2, 8, 4
  c.rollout.keep_full_logprobs = False          # vocab 128: exact KL would be fine, not needed
  c.trm.criteria = ()
  return c


def test_non_finite_weights(checkpoint, gsm8k, tmp_path):
  path = _copy(checkpoint, str(tmp_path / "nan"))
  tensors = load_file(os.path.join(path, WEIGHTS))
  name = "model.layers.1.mlp.up_proj.weight"
  tensors[name][3, 5] = np.nan
  save_file(tensors, os.path.join(path, WEIGHTS), metadata={"format": "pt"})
  with pytest.raises(train.USER_ERRORS) as e:
    train.run(_config(path, gsm8k), str(tmp_path / "w"), progress=False)
  assert str(e.value) == (f"tensor {name!r} in {path}/{WEIGHTS} holds non-finite weights (1 NaN, "
                          "0 Inf in the block read); refusing to load it")


def test_truncated_weights(checkpoint, gsm8k, tmp_path):
  path = _copy(checkpoint, str(tmp_path / "cut"))
  file = os.path.join(path, WEIGHTS)
  with open(file, "r+b") as f:
    f.truncate(os.path.getsize(file) // 2)
  with pytest.raises(train.USER_ERRORS) as e:
    train.run(_config(path, gsm8k), str(tmp_path / "w"), progress=False)
  assert str(e.value) == (f"{file}: not a readable safetensors file, truncated or corrupt (Error "
                          "while deserializing header: incomplete metadata, file not fully "
                          "covered)")


@pytest.mark.parametrize("content", [None, "{not json"])
def test_missing_or_broken_config_json(checkpoint, gsm8k, tmp_path, content):
  path = _copy(checkpoint, str(tmp_path / "cfg"))
  file = os.path.join(path, "config.json")
  os.remove(file)
  if content is not None:
    with open(file, "w") as f:
      f.write(content)
  with pytest.raises(train.USER_ERRORS) as e:
    train.run(_config(path, gsm8k), str(tmp_path / "w"), progress=False)
  assert str(e.value) == (
      f"{file}: no such file (a Hugging Face checkpoint directory needs config.json)"
      if content is None else
      f"{file}: not valid JSON (line 1 column 2: Expecting property name enclosed in double "
      "quotes)")


def test_tokenizer_past_the_vocabulary(gsm8k, tmp_path):
  path = str(tmp_path / "small_vocab")
  hf_fixtures.make_hf_checkpoint(path, "qwen3", vocab_size=16)
  synthetic.make_synthetic_tokenizer(path)            # ids 0..30
  with pytest.raises(train.USER_ERRORS) as e:
    train.run(_config(path, gsm8k), str(tmp_path / "w"), progress=False)
  assert str(e.value) == (
      f"tokenizer at {path} (tokenizer.json) has largest token id 30, but the model's "
      "vocab_size is 16: ids must be < 16; the tokenizer does not belong to this model")


@pytest.mark.parametrize("content,where", [
    ("", "{data}: no rows (the file is empty)"),
    ('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?", "answer": \n',
     "{data}, line 2: not valid JSON (Expecting value, column 1)"),
    ('{"question": "1+1?", "answer": "#### 2"}\n{"question": null, "answer": "#### 4"}\n',
     "gsm8k file {data}, line 2: field 'question' is null or missing"),
    ('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?", "answer": "####  "}\n',
     "gsm8k file {data}, line 2: field 'answer' has an empty ground truth after '####' (no "
     "completion could match it)"),
])
def test_bad_data_files(checkpoint, tmp_path, content, where):
  data = tmp_path / "bad.jsonl"
  data.write_text(content)
  with pytest.raises(train.USER_ERRORS) as e:
    train.run(_config(checkpoint, str(data)), str(tmp_path / "w"), progress=False)
  assert str(e.value) == where.format(data=data)


def test_the_cli_prints_one_line(checkpoint, tmp_path):
  data = tmp_path / "empty.jsonl"
  data.write_text("")
  p = subprocess.run(
      [sys.executable, "-m", "trm_jax.train", "--workdir", str(tmp_path / "w"),
       f"--config.model.path={checkpoint}", "--config.task.name=gsm8k",
       f"--config.task.path={data}", "--config.task.max_prompt_len=64",
       "--config.task.max_new_tokens=8"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert p.returncode == 1
  assert p.stderr.strip().splitlines()[-1] == f"error: {data}: no rows (the file is empty)"
  assert "Traceback" not in p.stderr
