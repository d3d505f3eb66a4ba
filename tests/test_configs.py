"""Experiment configs: every shipped config validates, the two paper-scale configs are
consistent with their architectures (abstract shapes, nothing allocated), and bad overrides
fail before any work with a message naming the key."""
import dataclasses
import inspect
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from trm_jax import config as config_lib
from trm_jax.kernels import NEVER_EVICTED
from trm_jax.models import Decoder, ModelConfig
from trm_jax.rollout import BatchingConfig, generate
from trm_jax.rl.learner import LearnerBatch, make_learner
from trm_jax import programs, step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(f for f in os.listdir(os.path.join(ROOT, "configs"))
                 if f.endswith(".py") and f != "__init__.py")

# The published config.json architecture fields of the checkpoints the large configs name.
QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096,
                intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                tie_word_embeddings=False, max_position_embeddings=40960)
QWEN3_4B = dict(model_type="qwen3", vocab_size=151936, hidden_size=2560,
                intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=5000000.0,
                tie_word_embeddings=True, max_position_embeddings=262144)


def _load(name):
  return config_lib.load_config(os.path.join(ROOT, "configs", name))


def _with_data_paths(c):
  """The DAPO config leaves its data files to the command line (its docstring says so); the
  GSM8K config names the hub dataset, its subset and both splits."""
  if c.task.name != "synthetic" and not c.task.path:
    with pytest.raises(config_lib.ConfigError, match="task.path"):
      config_lib.validate(c)
    c.task.path = "/data/train.parquet"
    c.task.eval_path = "/data/eval.jsonl" if c.task.eval_name else ""
  return c


def test_gsm8k_config_names_the_hub_dataset():
  t = _load("qwen3_4b_smd_gsm8k.py").task
  assert (t.path, t.subset, t.split, t.eval_path, t.eval_split) == (
      "openai/gsm8k", "main", "train", "", "test")


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_configs_validate(name):
  c = _with_data_paths(_load(name))
  config_lib.validate(c)
  programs.learner_config(c, max_len=c.task.max_new_tokens or 64)
  programs.cache_config(c)


@pytest.mark.parametrize("name,hf", [("qwen3_8b_dapo_trm.py", QWEN3_8B),
                                     ("qwen3_4b_smd_gsm8k.py", QWEN3_4B)])
def test_paper_configs_trace_with_abstract_shapes(name, hf):
  """Model, optimizer state and the learner's score + update steps at the config's real
  shapes, traced with jax.eval_shape: consistent shapes, zero bytes allocated. Two of the
  model's 36 layers are traced (every layer has the same shapes; tracing is linear in the
  layer count), and the parameter count of all 36 is checked from them."""
  c = _with_data_paths(_load(name))
  config_lib.validate(c)
  P, R = c.task.max_prompt_len, c.task.max_new_tokens
  mcfg = ModelConfig.from_hf(dict(hf, num_hidden_layers=2), dtype=jnp.bfloat16,
                             remat=c.model.remat)
  abstract_model = nnx.eval_shape(lambda: Decoder(mcfg, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(abstract_model, nnx.Param, ...)
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  sizes = {jax.tree_util.keystr(p): x.size for p, x in flat}
  per_layer = sum(n for k, n in sizes.items() if "['layers'][0]" in k)
  assert per_layer == sum(n for k, n in sizes.items() if "['layers'][1]" in k)
  n_params = sum(sizes.values()) + (hf["num_hidden_layers"] - 2) * per_layer
  assert n_params > 3e9, n_params     # 4B / 8B class models
  tx = programs.make_optimizer(c)
  opt_state = jax.eval_shape(tx.init, params)
  lcfg = programs.learner_config(c, max_len=R)
  score, update = make_learner(graphdef, tx, lcfg, response_start=P)
  B, T = c.rl.batch_size // c.rl.num_minibatches, P + R
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  batch = LearnerBatch(
      tokens=jax.ShapeDtypeStruct((B, T), jnp.int32),
      segment_ids=jax.ShapeDtypeStruct((B, T), jnp.int32),
      response_mask=f32(B, T), logp_roll=f32(B, T), advantages=f32(B), logp_old=f32(B, T),
      token_weights=f32(B, T),
      evicted_at=(jax.ShapeDtypeStruct((B, mcfg.num_layers, mcfg.num_kv_heads, T), jnp.int32)
                  if lcfg.mode == "smd" else None))
  k = c.rollout.keep_topk_logprobs
  if k:
    batch = batch.replace(roll_topk_logp=f32(B, T, k),
                          roll_topk_ids=jax.ShapeDtypeStruct((B, T, k), jnp.int32))
  out_params, out_opt, aux = jax.eval_shape(update, params, opt_state, rest, batch)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), out_params) == jax.tree.map(
      lambda a: (a.shape, a.dtype), params)
  assert "learner/loss" in aux
  logp, weights, seq_mask, metrics = jax.eval_shape(score, params, rest, batch)
  assert logp.shape == (B, T) and seq_mask.shape == (B,)
  assert "trm/reject_rate" in metrics
  assert NEVER_EVICTED > T


def _cli(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "trm_jax.train", "--config",
                         os.path.join(ROOT, "configs", "tiny_trm.py"), *args],
                        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


def test_shipped_name_resolves_to_the_shipped_file(tmp_path, monkeypatch):
  """`tiny_trm`, `tiny_trm.py` and `tiny_smd:arg` name the files in configs/ from any
  directory; an existing local file of that name wins; an unknown name lists the shipped."""
  monkeypatch.chdir(tmp_path)
  shipped = os.path.join(ROOT, "configs", "tiny_trm.py")
  assert config_lib.shipped_dir() == os.path.join(ROOT, "configs")
  assert config_lib.resolve_config("tiny_trm") == shipped
  assert config_lib.resolve_config("tiny_trm.py") == shipped
  assert config_lib.resolve_config("tiny_smd:x") == os.path.join(ROOT, "configs", "tiny_smd.py:x")
  assert config_lib.shipped_names() == [f[:-3] for f in CONFIGS]
  # One copy of each config: nothing under trm_jax/ duplicates configs/ in a checkout.
  # (A directory may linger there with a stale __pycache__ from before the move.)
  old = os.path.join(ROOT, "trm_jax", "configs")
  assert not (os.path.isdir(old) and any(f.endswith(".py") for f in os.listdir(old)))
  (tmp_path / "tiny_trm.py").write_text("def get_config():\n  return 'local'\n")
  assert config_lib.resolve_config("tiny_trm.py") == "tiny_trm.py"
  assert config_lib.load_config("tiny_trm.py") == "local"
  # A derived config starts from the shipped tiny_trm even beside a local tiny_trm.py.
  assert config_lib.load_config("tiny_smd").task.synthetic.filler == 2
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.resolve_config("tiny_trn")
  assert str(e.value) == ("config file not found: tiny_trn (give a path, or the name of a "
                          "shipped config: " + ", ".join(f[:-3] for f in CONFIGS) + ")")
  with pytest.raises(config_lib.ConfigError, match="config file not found: sub/tiny_trm.py"):
    config_lib.resolve_config("sub/tiny_trm.py")   # a path is a path: no fallback


def test_cli_resolves_a_shipped_name_from_another_directory(tmp_path):
  """`python -m trm_jax.train --config tiny_trm` outside the repository reaches the override
  check of the shipped config (a misspelt key fails there, before any work)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
  r = subprocess.run([sys.executable, "-m", "trm_jax.train", "--config", "tiny_trm",
                      "--workdir", str(tmp_path / "w"), "--config.rl.group_sise=4"],
                     capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
  assert r.returncode != 0
  assert "unknown config key 'rl.group_sise'" in r.stderr, r.stderr
  r = subprocess.run([sys.executable, "-m", "trm_jax.train", "--config=tiny_trn",
                      "--workdir", str(tmp_path / "w")],
                     capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
  assert r.returncode != 0
  assert r.stderr.strip().splitlines()[-1].startswith("error: config file not found: tiny_trn")
  assert not (tmp_path / "w").exists()


def test_cli_rejects_misspelt_key_before_any_work(tmp_path):
  r = _cli("--workdir", str(tmp_path / "w"), "--config.rl.group_sise=4")
  assert r.returncode != 0
  assert "unknown config key 'rl.group_sise'" in r.stderr
  assert "rl.group_size" in r.stderr           # the suggestion
  assert not (tmp_path / "w").exists()         # nothing was written


def test_cli_rejects_inconsistent_batch_before_any_work(tmp_path):
  r = _cli("--workdir", str(tmp_path / "w"), "--config.rl.batch_size=60",
           "--config.rl.group_size=8")
  assert r.returncode != 0
  assert "rl.batch_size, rl.group_size" in r.stderr
  assert "not divisible" in r.stderr
  assert not (tmp_path / "w" / "metrics.jsonl").exists()


@pytest.mark.parametrize("key,value,msg", [
    ("smd.mode", "smdd", "bad config value [smd.mode]: unknown value 'smdd'; expected one of "
     "off, dense, naive, sparse_rl, smd"),
    ("rollout.top_p", 0.0, "bad config value [rollout.top_p]: must be in (0, 1]"),
    ("rl.num_microbatches", 3, "inconsistent config [rl.batch_size, rl.num_minibatches, "
     "rl.num_microbatches]: minibatch of 64 sequences is not divisible by num_microbatches=3"),
    ("rl.score_microbatches", 3, "inconsistent config [rl.batch_size, rl.score_microbatches]: "
     "batch_size=64 is not divisible by score_microbatches=3"),
    ("rl.score_microbatches", 0, "bad config value [rl.score_microbatches]: must be an integer "
     ">= 1, got 0"),
    ("trm.criteria", ("trm_max_kl_typo",), "unknown criterion 'trm_max_kl_typo'"),
    ("eval_top_p", 1.5, "bad config value [eval_top_p]: must be in (0, 1]"),
    ("eval_every", -1, "bad config value [eval_every]: must be >= 0"),
    ("log_every", 0, "bad config value [log_every]: must be an integer >= 1, got 0"),
    # Everything a sweep can get wrong fails in validate(), before any model loads.
    ("optim.lr", -1e-4, "bad config value [optim.lr]: must be a finite number >= 0, got -0.0001"),
    ("optim.lr", float("nan"), "bad config value [optim.lr]: must be a finite number >= 0, "
     "got nan"),
    ("rl.objective", "grpo", "bad config value [rl.objective]: unknown value 'grpo'; expected "
     "one of cispo, gspo, ppo_clip, tis, trm_surrogate"),
    ("rl.objective", "token_mask", "unknown value 'token_mask'"),   # a trm.criteria entry now
    ("rl.loss_agg", "mean", "bad config value [rl.loss_agg]: unknown value 'mean'; expected "
     "one of token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm"),
    ("rl.baseline", "kept_only", "bad config value [rl.baseline]: unknown value 'kept_only'"),
    ("rollout.cache.policy", "lru", "bad config value [rollout.cache.policy]: unknown value "
     "'lru'; expected one of none, snapkv, h2o, recent, random"),
    ("ckpt_every", 0, "bad config value [ckpt_every]: must be an integer >= 1, got 0"),
    ("keep_ckpts", 0, "bad config value [keep_ckpts]: must be an integer >= 1, got 0"),
    ("rl.num_minibatches", 0, "bad config value [rl.num_minibatches]: must be an integer >= 1, "
     "got 0"),
    ("rl.num_microbatches", 0, "bad config value [rl.num_microbatches]: must be an integer "
     ">= 1, got 0"),
    ("rl.num_epochs", 0, "bad config value [rl.num_epochs]: must be an integer >= 1, got 0"),
    ("trm.delta", -0.02, "bad config value [trm.delta]: must be a finite number >= 0, "
     "got -0.02"),
    ("trm.tau", -1.0, "bad config value [trm.tau]: must be a finite number >= 0, got -1.0"),
    ("rl.max_consecutive_skips", -1, "bad config value [rl.max_consecutive_skips]: must be a "
     "finite number >= 0, got -1"),
    ("model.dtype", "fp16", "bad config value [model.dtype]: unknown value 'fp16'; expected "
     "one of float32, bfloat16"),
    ("task.name", "math500", "bad config value [task.name]: unknown value 'math500'"),
    ("rl.staleness", -1, "bad config value [rl.staleness]: must be an integer >= 0, got -1"),
    ("mesh.rollout_devices", -2, "bad config value [mesh.rollout_devices]: must be an "
     "integer >= 0, got -2"),
    ("rl.max_staleness", 0, None),   # fine at staleness 0 (below: with staleness 2)
])
def test_validate_names_the_key(key, value, msg):
  c = _load("tiny_trm.py")
  *parents, field = key.split(".")
  node = c
  for p in parents:
    node = node[p]
  node[field] = value
  if msg is None:
    config_lib.validate(c)
    return
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c)
  assert msg in str(e.value)


@pytest.mark.parametrize("overrides,msg", [
    # Each of these was accepted by validate() and failed only once the model had loaded or
    # the first step compiled, with a message naming no key (issue 22, items 7, 8 and 12).
    ({"rollout.top_k": -3}, "bad config value [rollout.top_k]: must be an integer >= 0, got -3"),
    ({"rollout.keep_full_logprobs": False, "rollout.keep_topk_logprobs": 64},
     "bad config value [rollout.keep_topk_logprobs]: 64 is more than the model's "
     "vocab_size=31"),
    ({"task.synthetic.min_operands": 5, "task.synthetic.max_operands": 3},
     "inconsistent config [task.synthetic.min_operands, task.synthetic.max_operands]: "
     "min_operands=5 > max_operands=3"),
    ({"seed": -1}, "bad config value [seed]: must be an integer >= 0, got -1"),
    ({"optim.b1": 1.5}, "bad config value [optim.b1]: must be in [0, 1) (an Adam moment "
     "decay), got 1.5"),
    ({"rl.objective": "ppo_clip", "rl.clip_eps_low": -0.2},
     "bad config value [rl.clip_eps_low]: must be in [0, 1) (rl.objective='ppo_clip'), got "
     "-0.2"),
    ({"rl.objective": "tis", "rl.tis_cap": 0.0},
     "bad config value [rl.tis_cap]: must be >= 1 (rl.objective='tis'; a cap below 1 "
     "down-weights on-policy tokens), got 0.0"),
    # Each registry entry checks its own settings (its `check`), named by their keys.
    ({"rl.objective": "gspo", "rl.gspo_clip_eps_low": 1.0},
     "bad config value [rl.gspo_clip_eps_low]: must be in [0, 1) (rl.objective='gspo'), got 1.0"),
    ({"rl.objective": "cispo", "rl.cispo_clip_eps_high": -0.5},
     "bad config value [rl.cispo_clip_eps_high]: must be >= 0 (rl.objective='cispo'), got -0.5"),
    ({"trm.criteria": ("seq_mis",), "trm.seq_mis_cap": 0.5},
     "bad config value [trm.seq_mis_cap]: must be >= 1 (trm.criteria has 'seq_mis'; a cap "
     "below 1 rejects on-policy sequences, whose ratio is 1), got 0.5"),
    ({"warmup.steps": 0}, "bad config value [warmup.steps]: must be an integer >= 1, got 0"),
    ({"warmup.answer_only_frac": 1.5},
     "bad config value [warmup.answer_only_frac]: must be in [0, 1], got 1.5"),
    ({"rollout.tail": 0}, "bad config value [rollout.tail]: must be an integer >= 1, got 0"),
    ({"rollout.refill": -1}, "bad config value [rollout.refill]: must be an integer >= 0, got -1"),
    ({"task.max_new_tokens": 100000},
     "bad config value [task.max_new_tokens]: 100000 tokens alone are more than the model's "
     "max_position_embeddings=512"),
    ({"task.max_prompt_len": 300, "task.max_new_tokens": 300},
     "inconsistent config [task.max_prompt_len, task.max_new_tokens]: prompts of 300 tokens "
     "+ 300 new tokens need 600 positions, more than the model's max_position_embeddings=512"),
    ({"eval_problems": 100000000},
     "bad config value [eval_problems]: 100000000 held-out problems, but task.synthetic can "
     "draw only 49659521 distinct problems; lower eval_problems"),
])
def test_validate_refuses_what_the_trainer_would_reject_later(overrides, msg):
  c = _load("tiny_trm.py")
  for key, value in overrides.items():
    *parents, field = key.split(".")
    node = c
    for p in parents:
      node = node[p]
    node[field] = value
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c)
  assert str(e.value) == msg


def test_the_trainers_rollouts_are_scheduled_as_the_config_says():
  c = _load("tiny_trm.py")
  c.rollout.update(slots=8, chunk=4, refill=3, bucket=32, tail=2)
  got = programs.rollout_batching(c)
  assert (got.slots, got.group_size, got.chunk, got.refill, got.bucket, got.tail) == (
      8, c.rl.group_size, 4, 3, 32, 2)


def test_the_configs_batching_defaults_are_the_samplers():
  # Written twice (the config file does not import the sampler): the library's defaults
  # (BatchingConfig, generate's keywords) and the trainer's must not drift apart.
  c = _load("tiny_trm.py").rollout
  lib = {f.name: f.default for f in dataclasses.fields(BatchingConfig)}
  for key in ("chunk", "refill", "bucket", "tail"):
    assert c[key] == lib[key] == inspect.signature(generate).parameters[key].default, key


def test_positions_are_checked_against_model_path_config_json(tmp_path):
  """With model.path the limits come from its config.json, before any weight is read."""
  (tmp_path / "config.json").write_text('{"max_position_embeddings": 64, "vocab_size": 40}')
  c = _load("tiny_trm.py")
  c.model.path = str(tmp_path)
  c.task.max_new_tokens = 65
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c)
  assert str(e.value) == ("bad config value [task.max_new_tokens]: 65 tokens alone are more "
                          "than the model's max_position_embeddings=64")
  c.task.max_new_tokens = 0
  config_lib.validate(c)


def test_max_staleness_below_staleness_is_refused():
  c = _load("tiny_trm.py")
  c.rl.staleness, c.rl.max_staleness = 2, 1
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c)
  assert str(e.value) == (
      "inconsistent config [rl.max_staleness, rl.staleness]: max_staleness=1 would drop every "
      "rollout of staleness=2; use -1 (no bound) or a value >= rl.staleness")
  c.rl.max_staleness = 2
  config_lib.validate(c)


def test_compressed_cache_needs_one_budget():
  c = _load("tiny_trm.py")
  c.rollout.cache.policy = "h2o"
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c)
  assert str(e.value) == (
      "inconsistent config [rollout.cache.ratio, rollout.cache.capacity]: "
      "rollout.cache.policy='h2o' needs exactly one of ratio in (0, 1) or capacity >= 1 "
      "(got ratio=0.0, capacity=0)")


def test_smd_mode_needs_a_compressed_cache():
  c = _load("tiny_smd.py")
  c.rollout.cache.policy = "none"
  with pytest.raises(config_lib.ConfigError, match="rollout.cache.policy"):
    config_lib.validate(c)


def test_divergence_criteria_need_rollout_distribution():
  c = _load("tiny_trm.py")
  c.rollout.keep_full_logprobs = False
  c.rollout.keep_topk_logprobs = 0
  with pytest.raises(config_lib.ConfigError, match="rollout.keep_full_logprobs"):
    config_lib.validate(c)


def test_truncated_rollouts_under_trm_are_warned_about(caplog):
  # The learner scores the untruncated pi_theta: a nucleus cut of 0.95 alone can reach
  # -log(0.95) = 0.0513 nats per token, above the 8B config's trm.delta = 0.05.
  c = _load("qwen3_8b_dapo_trm.py")
  assert c.rollout.top_p == 1.0 and c.eval_top_p == 0.95  # the paper's 0.95 is for evaluation
  with caplog.at_level(logging.WARNING, logger="trm_jax.step"):
    step.warn_truncation(c)
    assert not caplog.records
    c.rollout.top_p = 0.95
    step.warn_truncation(c)
  assert len(caplog.records) == 1
  msg = caplog.records[0].getMessage()
  assert "top_p=0.95 (up to 0.0513 nats per token)" in msg and "trm.delta=0.05" in msg
  caplog.clear()
  c.trm.criteria = ()
  step.warn_truncation(c)  # no TRM: nothing measures the truncation, nothing to warn about
  assert not caplog.records
