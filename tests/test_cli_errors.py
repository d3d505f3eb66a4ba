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


def _edit_json(name, **changes):
  def edit(path):
    file = os.path.join(path, name)
    with open(file) as f:
      d = json.load(f)
    d.update(changes)
    with open(file, "w") as f:
      json.dump(d, f)
  return edit


def _write(name, text):
  def edit(path):
    with open(os.path.join(path, name), "w") as f:
      f.write(text)
  return edit


@pytest.mark.parametrize("edit,message", [
    (_edit_json("config.json", model_type="gpt2"),
     "{path}/config.json: unsupported model_type 'gpt2'; supported: qwen3, qwen2, llama, "
     "qwen3_moe"),
    (_edit_json("config.json", hidden_size="big"),
     "{path}/config.json: hidden_size must be an integer, got 'big'"),
    (_edit_json("config.json", num_hidden_layers=100000),   # the build was quadratic in it
     "{path}/config.json: num_hidden_layers=100000 is outside [1, 1024] (SIZE_LIMITS: far "
     "above any released checkpoint's)"),
    (_edit_json("config.json", vocab_size=1 << 30),
     "{path}/config.json: vocab_size=1073741824 is outside [1, 1048576] (SIZE_LIMITS: far "
     "above any released checkpoint's)"),
    (_edit_json("config.json", rope_parameters="fast"),
     "{path}/config.json: rope_parameters must be an object or null, got 'fast'"),
    (_edit_json("config.json", rope_parameters={"rope_type": "default", "rope_theta": "1e6"}),
     "{path}/config.json: rope_theta must be a number, got '1e6'"),
    (lambda path: os.remove(os.path.join(path, WEIGHTS)),
     "{path}: no weights (neither model.safetensors nor model.safetensors.index.json)"),
    (_write("tokenizer.json", '{"version": "1.0", "model": '),
     "{path}/tokenizer.json: not a readable tokenizer (EOF while parsing a value at line 1 "
     "column 28)"),
    (_write("tokenizer.json", "{}"),
     "{path}/tokenizer.json: not a readable tokenizer (Model missing. at line 1 column 2)"),
    (_write("tokenizer_config.json", "{bad"),
     "{path}/tokenizer_config.json: not valid JSON (line 1 column 2: Expecting property name "
     "enclosed in double quotes)"),
    (_write("tokenizer_config.json", "[]"),
     "{path}/tokenizer_config.json: expected a JSON object, got list"),
    (lambda path: os.remove(os.path.join(path, "tokenizer.json")),
     "{path}: no tokenizer (neither tokenizer.json nor tokenizer.model)"),
], ids=["model_type", "hidden_size_type", "layers_bound", "vocab_bound", "rope_type",
        "rope_theta", "no_weights", "tokenizer_truncated", "tokenizer_empty",
        "tokenizer_config", "tokenizer_config_list", "no_tokenizer"])
def test_a_broken_model_directory_is_one_line(checkpoint, gsm8k, tmp_path, edit, message):
  """Each once a raw traceback (a 100000-layer config.json hung the trainer building its
  abstract model); now refused while loading, before anything is built, naming the file."""
  path = _copy(checkpoint, str(tmp_path / "m"))
  edit(path)
  with pytest.raises(train.USER_ERRORS) as e:
    train.run(_config(path, gsm8k), str(tmp_path / "w"), progress=False)
  assert str(e.value) == message.format(path=path)


def test_an_empty_saved_dataset_and_a_misspelt_attn_impl_are_one_line(checkpoint, gsm8k,
                                                                     tmp_path):
  """An empty save_to_disk dataset raised IndexError from inside `datasets`; a misspelt
  attention impl passed validation and failed at step 1 (in a sweep: in every cell, late)."""
  import datasets  # pylint: disable=g-import-not-at-top
  data = str(tmp_path / "empty")
  datasets.Dataset.from_dict({"question": [], "answer": []}).save_to_disk(data)
  with pytest.raises(train.USER_ERRORS) as e:
    train.run(_config(checkpoint, data), str(tmp_path / "w"), progress=False)
  assert str(e.value) == (f"dataset {data}: no rows (save_to_disk wrote no data for the "
                          "dataset; `datasets` cannot load such a directory)")
  c = _config(checkpoint, gsm8k)
  c.model.attn_impl = "flash"
  with pytest.raises(train.USER_ERRORS) as e:
    train.run(c, str(tmp_path / "w2"), progress=False)
  assert str(e.value) == ("bad config value [model.attn_impl]: unknown value 'flash'; "
                          "expected one of auto, reference, pallas, pallas_interpret, "
                          "pallas_tpu, pallas_tpu_interpret")
  assert not os.path.exists(tmp_path / "w2")


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


def test_the_final_lines_say_what_happened(gsm8k, tmp_path):
  """An eval_path of 10 rows with eval_problems=50 warned, then the final line said "eval on
  50 held-out problems"."""
  from trm_jax.data.task import Task  # pylint: disable=g-import-not-at-top
  held = tmp_path / "held.jsonl"
  held.write_text("".join(json.dumps({"question": f"What is {i} + 2?",
                                      "answer": f"#### {i + 2}"}) + "\n" for i in range(10)))
  c = _config("unused", gsm8k)
  c.task.eval_path, c.eval_problems, c.task.max_prompt_len = str(held), 50, 128
  task = Task(c.task, seed=0, tokenizer=synthetic.make_synthetic_tokenizer(str(tmp_path)),
              eval_problems=c.eval_problems)
  assert train.eval_line(c, task, {"greedy_accuracy": 0.5}) == (
      "eval on 10 held-out problems (eval_problems=50: the held-out set has only 10): "
      "greedy_accuracy=0.500")
  c.eval_problems = 10
  assert train.eval_line(c, task, {"greedy_accuracy": 0.5}) == (
      "eval on 10 held-out problems: greedy_accuracy=0.500")
  # trm.delta=0 masked every sequence and the run exited 0 without a word (the console
  # line of a run that finishes; one that stalls stops naming why, test_train_resume.py).
  c.trm.criteria, c.trm.delta = ("trm_max_kl",), 0.0
  assert train.skip_line(c, {"steps": 5, "nonfinite": 1, "masked": 3}) == (
      "updates skipped at 4 of the 5 steps run: 3 had every sequence masked (trm.criteria="
      "('trm_max_kl',) with trm.delta=0); 1 had a non-finite loss or gradient. The policy "
      "changed only at the other steps")


# --- refused before the model loads ---------------------------------------------------------
@pytest.mark.parametrize("which", ["path", "eval_path"])
def test_a_missing_data_path_names_the_key(checkpoint, gsm8k, tmp_path, which):
  """Refused before the workdir is touched (before: a FileNotFoundError once the model had
  loaded). A directory is a `datasets` source (data/loaders.py), not an error here."""
  c = _config(checkpoint, gsm8k)
  bad = tmp_path / "nope.jsonl"
  c.task[which] = str(bad)
  with pytest.raises(train.USER_ERRORS) as e:
    train.run(c, str(tmp_path / "w"), progress=False)
  assert str(e.value) == (f"bad config value [task.{which}]: {bad} does not exist (neither a "
                          "local file or directory nor a Hugging Face dataset id)")
  assert not os.path.exists(tmp_path / "w")


def test_a_batch_the_mesh_does_not_divide_is_refused(checkpoint, gsm8k, tmp_path):
  """12 rows on the 8-way data mesh were replicated on every device, silently."""
  c = _config(checkpoint, gsm8k)
  c.rl.batch_size, c.rl.group_size = 12, 4
  with pytest.raises(train.USER_ERRORS) as e:
    train.run(c, str(tmp_path / "w"), progress=False)
  assert str(e.value) == (
      "inconsistent config [rl.batch_size, mesh]: batch_size=12 does not split over the 8 "
      "batch shards of the learner's mesh {data: 8, fsdp: 1, expert: 1, tensor: 1} (mesh.data "
      "x mesh.fsdp x mesh.expert); it would be replicated on every device. Use a multiple of 8")
  c.rl.batch_size, c.rl.num_minibatches = 8, 2   # minibatches of 4 on 8 shards
  with pytest.raises(train.USER_ERRORS, match=r"\[rl.batch_size, rl.num_minibatches, mesh\]: "
                     "minibatch of 4 sequences"):
    train.run(c, str(tmp_path / "w"), progress=False)


# --- resume checks, on real orbax checkpoints of a small state -------------------------------
def _tiny_state(history: int = 0):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from trm_jax import step as step_lib  # pylint: disable=g-import-not-at-top
  sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  w = {"w": jax.device_put(jnp.arange(4.0), sh)}
  return step_lib.TrainState(params=w, opt_state={"count": jax.device_put(jnp.zeros(()), sh)},
                             step=0, history=(w,) * history)


def _save(ckpt_dir, state, meta):
  from trm_jax.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top
  with Checkpointer(ckpt_dir, save_every=1, keep=2) as ck:
    assert ck.maybe_save(2, train.checkpointed(state), meta=meta)


def _resume(ckpt_dir, state, config_json, data, **kw):
  from trm_jax.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top
  with Checkpointer(ckpt_dir, save_every=1, keep=2) as ck:
    return train.resume(ck, state, config_json, os.path.dirname(ckpt_dir), data=data, **kw)


def test_resume_on_changed_data_is_refused_naming_the_path(tmp_path):
  """Issue 22, item 3: the same path, other rows and answers."""
  from trm_jax.data import fingerprint  # pylint: disable=g-import-not-at-top
  from trm_jax.data import load_problems  # pylint: disable=g-import-not-at-top
  data = tmp_path / "train.jsonl"
  rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(6)]
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  fp = {"task.path": fingerprint.source_fingerprint(str(data), load_problems("gsm8k", str(data)))}
  config_json = {"task": {"path": str(data)}}
  ckpt_dir = str(tmp_path / "w" / "ckpt")
  _save(ckpt_dir, _tiny_state(), {"step": 2, "data_pos": 4, "config": config_json,
                                  "data": fp, "metrics": None})
  assert _resume(ckpt_dir, _tiny_state(), config_json, fp,
                 allow_config_change=False)[0].step == 2           # unchanged data resumes
  rows[3] = {"question": "What is 7 * 7?", "answer": "#### 49"}
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  new = {"task.path": fingerprint.source_fingerprint(str(data), load_problems("gsm8k", str(data)))}
  with pytest.raises(train.USER_ERRORS) as e:
    _resume(ckpt_dir, _tiny_state(), config_json, new, allow_config_change=False)
  msg = str(e.value)
  assert msg.startswith(f"the data changed since checkpoint step 2 in {tmp_path / 'w'}: "
                        f"task.path={data}: 6 rows, sha256 {fp['task.path']['sha256'][:12]}")
  assert msg.endswith("Use another --workdir, or pass --allow_config_change to continue this "
                      "run on the new data")
  state, meta = _resume(ckpt_dir, _tiny_state(), config_json, new, allow_config_change=True)
  assert state.step == 2 and meta["data"] == fp


@pytest.mark.parametrize("old_k,new_k", [(0, 2), (2, 0)])
@pytest.mark.parametrize("allow", [False, True])
def test_a_changed_staleness_is_refused_naming_it(tmp_path, old_k, new_k, allow):
  """Issue 22, item 6: the checkpoint holds rl.staleness parameter versions; before, orbax's
  'does not match abstract_state ... ['history'][0]' came first, with or without
  --allow_config_change."""
  ckpt_dir = str(tmp_path / "w" / "ckpt")
  old = {"rl": {"staleness": old_k}}
  _save(ckpt_dir, _tiny_state(old_k), {"step": 2, "data_pos": 4, "config": old, "data": {},
                                       "metrics": None})
  with pytest.raises(train.USER_ERRORS) as e:
    _resume(ckpt_dir, _tiny_state(new_k), {"rl": {"staleness": new_k}}, {},
            allow_config_change=allow)
  assert str(e.value) == (
      f"{tmp_path / 'w'} holds a run (checkpoint step 2) whose saved state does not fit the "
      f"new settings: rl.staleness: {old_k} -> {new_k}. These change what a checkpoint holds "
      "(rl.staleness: the parameter versions of the rollout pipeline; model and optimizer "
      "settings: the arrays), so the run cannot continue with them, not even with "
      "--allow_config_change; use another --workdir")
