"""Experiment configs: loading, `--config.key=value` overrides, and consistency checks.

Configs are Python files with `get_config(arg=None) -> ml_collections.ConfigDict` (big_vision
style). Every setting a run reads has exactly one default, in the config file (the
dataclasses behind them, `LearnerConfig`, `CacheConfig`, have defaults only for direct library
use; the trainer always passes the config's values). This module adds what
ml-collections does not do well by itself:
  * an unknown or misspelt override key fails *before any work*, naming the key and the
    closest valid keys (ml-collections raises a bare AttributeError deep in absl);
  * `validate(config)` checks cross-field consistency (batch divisible by group size, ...) and
    names the offending keys.
"""
from __future__ import annotations

import difflib
import importlib.util
import json
import math
import os
from typing import Iterable, Optional, Sequence

import ml_collections


class ConfigError(ValueError):
  """A config key is unknown, mistyped or inconsistent with another key."""


# Names of the `model.dtype` / `rollout.dtype` settings (the trainer maps them to jnp dtypes).
DTYPES = ("float32", "bfloat16")


# The shipped configs: one copy, in the repository's top-level `configs/`. A wheel carries the
# same files as the package `trm_jax.configs` (pyproject.toml maps the directory there), so a
# shipped name resolves with or without the repository.
_PKG = os.path.dirname(os.path.abspath(__file__))
_SHIPPED_DIRS = (os.path.join(_PKG, "configs"), os.path.join(os.path.dirname(_PKG), "configs"))


def shipped_dir() -> str:
  """The directory holding the shipped configs (installed package first, then the checkout)."""
  for d in _SHIPPED_DIRS:
    if os.path.isfile(os.path.join(d, "tiny_trm.py")):
      return d
  raise ConfigError(f"no shipped configs found (looked in {', '.join(_SHIPPED_DIRS)})")


def shipped_names() -> list[str]:
  """Names of the shipped configs (`tiny_trm`, ...), usable wherever a config path is."""
  return sorted(f[:-3] for f in os.listdir(shipped_dir())
                if f.endswith(".py") and not f.startswith("_"))


def resolve_config(spec: str) -> str:
  """`path/to/config.py[:arg]`, or a shipped config's name (`tiny_trm[:arg]`) -> `file[:arg]`.

  An existing file wins, so a local `tiny_trm.py` is not shadowed; a name (no directory part,
  `.py` optional) falls back to the shipped config of that name. The one place where `--config`
  values of train, sweep and aot are resolved.
  """
  path, sep, arg = spec.partition(":")
  if os.path.isfile(path):
    return spec
  name = path[:-3] if path.endswith(".py") else path
  if name and os.path.basename(name) == name and not name.startswith("_"):
    file = os.path.join(shipped_dir(), name + ".py")
    if os.path.isfile(file):
      return file + sep + arg
  raise ConfigError(f"config file not found: {path} (give a path, or the name of a shipped "
                    f"config: {', '.join(shipped_names())})")


def resolve_config_flag(argv: Sequence[str], default: Optional[str] = None
                        ) -> tuple[list[str], Optional[str]]:
  """(argv with its `--config` value resolved, that resolved spec or `default`).

  ml_collections' config_flags only loads file paths; rewriting the value before absl parses
  argv lets `--config tiny_trm` name a shipped config.
  """
  argv = list(argv)
  for i, a in enumerate(argv):
    if a.startswith("--config="):
      spec = resolve_config(a.split("=", 1)[1])
      argv[i] = f"--config={spec}"
      return argv, spec
    if a == "--config" and i + 1 < len(argv):
      spec = argv[i + 1] = resolve_config(argv[i + 1])
      return argv, spec
  return argv, default


def define_config_flag(default: Optional[str] = None, flag_values=None):
  """The `--config` flag of every command line (the trainer, `trm_jax.aot`): a config file
  with get_config, `--config.key=value` overrides, locked after parsing. Parse argv with
  `config_argv` first."""
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  kw = {} if flag_values is None else {"flag_values": flag_values}
  return config_flags.DEFINE_config_file(
      "config", default, "experiment config (a python file with get_config, or the name of a "
      "shipped config)", lock_config=True, **kw)


def config_argv(argv: Sequence[str], default: Optional[str] = None, *,
                example: str = "configs/tiny_trm.py") -> tuple[list[str], str]:
  """(argv with `--config` resolved, the config spec), after checking every `--config.x=`
  override names a key of that config: a misspelt key fails here with its name, before absl's
  own parsing (which would print a bare AttributeError) and before any work. ConfigError when
  there is no `--config` and no default."""
  argv, spec = resolve_config_flag(argv, default)
  if not spec:
    raise ConfigError(f"--config is required (a config file, e.g. {example})")
  check_override_keys(load_config(spec), argv)
  return argv, spec


def _exec_module(path: str, name: str):
  mod_spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(mod_spec)
  mod_spec.loader.exec_module(module)
  return module


def shipped_module(name: str):
  """A shipped config as a module; configs derived from another one start from it with
  `tiny_trm = config_lib.shipped_module("tiny_trm")`, wherever they live."""
  path = os.path.join(shipped_dir(), name + ".py")
  if not os.path.isfile(path):
    raise ConfigError(f"no shipped config {name!r} (shipped: {', '.join(shipped_names())})")
  return _exec_module(path, f"_trm_config_{name}")


def load_config(spec: str) -> ml_collections.ConfigDict:
  """Loads `path/to/config.py[:arg]` (or a shipped name) and calls its `get_config(arg)`."""
  path, _, arg = resolve_config(spec).partition(":")
  module = _exec_module(path, "_trm_config")
  if not hasattr(module, "get_config"):
    raise ConfigError(f"{path} defines no get_config()")
  return module.get_config(arg) if arg else module.get_config()


def all_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  """Dotted paths of every leaf of `config`."""
  out = []
  for k, v in config.items():
    name = f"{prefix}{k}"
    if isinstance(v, ml_collections.ConfigDict):
      out.extend(all_keys(v, name + "."))
    else:
      out.append(name)
  return out


def check_override_keys(config: ml_collections.ConfigDict, argv: Sequence[str],
                        flag: str = "config") -> None:
  """Fails on `--config.some.key=...` flags whose key the config does not have."""
  keys = set(all_keys(config))
  prefix = f"--{flag}."
  for a in argv:
    if not a.startswith(prefix):
      continue
    key = a[len(prefix):].split("=", 1)[0]
    if key not in keys:
      close = difflib.get_close_matches(key, sorted(keys), n=3, cutoff=0.5)
      hint = f"; did you mean {', '.join(close)}?" if close else ""
      raise ConfigError(f"unknown config key '{key}' (from {a!r}){hint}")


def _require(cond: bool, keys: Iterable[str], msg: str) -> None:
  if not cond:
    keys = list(keys)
    what = "bad config value" if len(keys) == 1 else "inconsistent config"
    raise ConfigError(f"{what} [{', '.join(keys)}]: {msg}")


def require(cond: bool, keys: Iterable[str], msg: str) -> None:
  """ConfigError naming `keys` unless `cond`: for the `check` hooks of registry entries (an
  objective's, a criterion's or a task's own settings, data/tasks.py), so that their errors
  read like validate's."""
  _require(cond, keys, msg)


def _positive_int(c: ml_collections.ConfigDict, *keys: str) -> None:
  for key in keys:
    v = _get(c, key)
    _require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, [key],
             f"must be an integer >= 1, got {v!r}")


def _non_negative(c: ml_collections.ConfigDict, *keys: str) -> None:
  for key in keys:
    v = _get(c, key)
    _require(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0, [key],
             f"must be a finite number >= 0, got {v!r}")


def _one_of(c: ml_collections.ConfigDict, key: str, choices: Sequence[str]) -> None:
  v = _get(c, key)
  _require(v in choices, [key], f"unknown value {v!r}; expected one of {', '.join(choices)}")


def _get(c: ml_collections.ConfigDict, key: str):
  node = c
  for part in key.split("."):
    node = node[part]
  return node


def check_batch_mesh(c: ml_collections.ConfigDict, mesh, sampler_mesh=None) -> None:
  """The rollout batch and each minibatch split evenly over the mesh axes that shard a batch
  (`sharding.batch_shards`: data x fsdp x expert). Otherwise `sharding.put_batch` replicates
  them and every device computes every row, silently. For every consumer of the trainer's
  meshes (the trainer calls it right after building them; AOT compilation should too)."""
  from trm_jax import sharding as shd  # pylint: disable=g-import-not-at-top
  r = c.rl
  mb = r.batch_size // r.num_minibatches

  def shape(m) -> str:
    return "{" + ", ".join(f"{a}: {n}" for a, n in m.shape.items()) + "}"

  n = shd.batch_shards(mesh)
  _require(r.batch_size % n == 0, ["rl.batch_size", "mesh"],
           f"batch_size={r.batch_size} does not split over the {n} batch shards of the "
           f"learner's mesh {shape(mesh)} (mesh.data x mesh.fsdp x mesh.expert); it would be "
           f"replicated on every device. Use a multiple of {n}")
  _require(mb % n == 0, ["rl.batch_size", "rl.num_minibatches", "mesh"],
           f"minibatch of {mb} sequences (batch_size={r.batch_size} / num_minibatches="
           f"{r.num_minibatches}) does not split over the {n} batch shards of the learner's "
           f"mesh {shape(mesh)}; it would be replicated on every device")
  if sampler_mesh is not None:
    n = shd.batch_shards(sampler_mesh)
    _require(r.batch_size % n == 0, ["rl.batch_size", "mesh.rollout_devices"],
             f"batch_size={r.batch_size} does not split over the sampler's {n} devices "
             f"(mesh.rollout_devices); it would be replicated on each of them")


def check_task_files(t: ml_collections.ConfigDict) -> None:
  """The task's sources exist: a local file or directory, or a name shaped like a Hugging Face
  dataset id (data/loaders.py decides which). Run by the trainer and the sweep right after
  `validate`, before any model loads; kept out of `validate` because configs name files of
  the machine they run on."""
  from trm_jax.data import loaders  # pylint: disable=g-import-not-at-top  (light: os, json)
  for key in ("path", "eval_path"):
    path = t[key]
    _require(not path or loaders._source_kind(path) != "missing", [f"task.{key}"],  # pylint: disable=protected-access
             f"{path} does not exist (neither a local file or directory nor a Hugging Face "
             "dataset id)")


def validate(c: ml_collections.ConfigDict) -> None:
  """Cross-field checks; each names the keys involved. Call before allocating anything.

  Everything a sweep can get wrong is checked here, before any model loads, so a grid refuses
  a bad cell up front instead of failing minutes into that cell's run.
  """
  # pylint: disable=g-import-not-at-top  (jax-heavy modules; the config module stays light)
  from trm_jax.kernels.attention import IMPLS
  from trm_jax.rl.advantages import BASELINES
  from trm_jax.rl.modes import MODES
  from trm_jax.rl.objectives import LOSS_AGG_MODES, OBJECTIVES
  from trm_jax.rollout.policies import POLICIES
  from trm_jax.rollout.types import DENSE
  from trm_jax.trm import CRITERIA
  e = c.mesh.get("expert", 1)
  _require(isinstance(e, int) and not isinstance(e, bool) and (e >= 1 or e == -1),
           ["mesh.expert"], f"must be an integer >= 1 (or -1 = the remaining devices), got {e!r}")
  for key in ("rl.staleness", "mesh.rollout_devices"):
    v = _get(c, key)
    _require(isinstance(v, int) and not isinstance(v, bool) and v >= 0, [key],
             f"must be an integer >= 0, got {v!r}")
  _require(c.rl.max_staleness == -1 or c.rl.max_staleness >= c.rl.staleness,
           ["rl.max_staleness", "rl.staleness"],
           f"max_staleness={c.rl.max_staleness} would drop every rollout of staleness="
           f"{c.rl.staleness}; use -1 (no bound) or a value >= rl.staleness")
  _positive_int(c, "model.moe_chunk", "total_steps", "log_every", "ckpt_every", "keep_ckpts",
                "rl.batch_size", "rl.group_size", "rl.num_minibatches", "rl.num_microbatches",
                "rl.score_microbatches", "rl.num_epochs", "rl.chunk")
  _non_negative(c, "optim.lr", "optim.warmup_steps", "optim.weight_decay", "optim.clip_norm",
                "optim.min_lr_ratio", "rl.kl_beta", "rl.max_consecutive_skips",
                "rollout.logit_noise", "rollout.router_noise", "smd.lam",
                *(f"trm.{k}" for k in c.trm if k != "criteria"))
  _one_of(c, "rl.objective", sorted(OBJECTIVES))
  OBJECTIVES[c.rl.objective].check(c)    # its own settings (rl/objectives.py)
  _one_of(c, "rl.loss_agg", LOSS_AGG_MODES)
  _one_of(c, "rl.baseline", BASELINES)
  _one_of(c, "rollout.cache.policy", (DENSE, *POLICIES))
  _one_of(c, "smd.mode", MODES)
  _one_of(c, "model.dtype", DTYPES)
  _one_of(c, "rollout.dtype", DTYPES)
  _one_of(c, "model.attn_impl", IMPLS)
  cc = c.rollout.cache
  if cc.policy != DENSE:
    _require((cc.ratio > 0) != (cc.capacity > 0),
             ["rollout.cache.ratio", "rollout.cache.capacity"],
             f"rollout.cache.policy={cc.policy!r} needs exactly one of ratio in (0, 1) or "
             f"capacity >= 1 (got ratio={cc.ratio}, capacity={cc.capacity})")
    _require(0.0 <= cc.ratio < 1.0, ["rollout.cache.ratio"], f"must be in [0, 1), got {cc.ratio}")
  from trm_jax.data import tasks
  tasks.validate(c)       # the task's section, settings and own checks (its registry entry)
  r = c.rl
  _require(r.group_size >= 2, ["rl.group_size"], "GRPO needs at least 2 samples per prompt")
  _require(r.batch_size % r.group_size == 0, ["rl.batch_size", "rl.group_size"],
           f"batch_size={r.batch_size} is not divisible by group_size={r.group_size}")
  _require(r.batch_size % r.num_minibatches == 0, ["rl.batch_size", "rl.num_minibatches"],
           f"batch_size={r.batch_size} is not divisible by num_minibatches={r.num_minibatches}")
  mb = r.batch_size // r.num_minibatches
  _require(mb % r.num_microbatches == 0, ["rl.batch_size", "rl.num_minibatches",
                                          "rl.num_microbatches"],
           f"minibatch of {mb} sequences is not divisible by num_microbatches={r.num_microbatches}")
  _require(r.batch_size % r.score_microbatches == 0, ["rl.batch_size", "rl.score_microbatches"],
           f"batch_size={r.batch_size} is not divisible by score_microbatches="
           f"{r.score_microbatches}")
  _require(c.eval_every >= 0, ["eval_every"], "must be >= 0 (0 = only at the end)")
  _require(c.eval_problems >= 0 and c.eval_samples >= 1, ["eval_problems", "eval_samples"],
           "need eval_problems >= 0 and eval_samples >= 1")
  _require(c.eval_batch_size >= 0, ["eval_batch_size"],
           f"eval_batch_size={c.eval_batch_size} must be >= 0 (0 = all rows at once)")
  if MODES[c.smd.mode].needs_compressed_cache:
    _require(c.rollout.cache.policy != DENSE, ["smd.mode", "rollout.cache.policy"],
             f"smd.mode={c.smd.mode!r} needs a compressed rollout cache")
  for name in c.trm.criteria:
    _require(name in CRITERIA, ["trm.criteria"],
             f"unknown criterion {name!r}; known: {', '.join(sorted(CRITERIA))}")
    CRITERIA[name].check(c)              # its thresholds (trm/masking.py)
    if {"kl", "tv"} & set(CRITERIA[name].needs):
      _require(c.rollout.keep_full_logprobs or c.rollout.keep_topk_logprobs > 0,
               ["trm.criteria", "rollout.keep_full_logprobs", "rollout.keep_topk_logprobs"],
               f"criterion {name!r} needs the rollout's distribution: keep full or top-k "
               "log-probs")
  _require(0.0 < c.rollout.top_p <= 1.0, ["rollout.top_p"], "must be in (0, 1]")
  _require(0.0 < c.eval_top_p <= 1.0, ["eval_top_p"], "must be in (0, 1]")
  _require(c.eval_temperature > 0.0, ["eval_temperature"], "must be > 0")
  _require(c.rollout.temperature > 0.0, ["rollout.temperature"], "must be > 0")
  _validate_values(c)
  _validate_lora(c)
  check_model_fit(c, **_known_model_limits(c))


def _int_at_least(c: ml_collections.ConfigDict, lo: int, *keys: str) -> None:
  for key in keys:
    v = _get(c, key)
    _require(isinstance(v, int) and not isinstance(v, bool) and v >= lo, [key],
             f"must be an integer >= {lo}, got {v!r}")


def _validate_values(c: ml_collections.ConfigDict) -> None:
  """The values that the sampler, the optimizer, the objectives and the warm-up would reject
  only once the model has loaded or the first step compiles (their own checks stay: they
  guard the library API; these name the config key)."""
  _int_at_least(c, 0, "seed", "rollout.top_k", "rollout.keep_topk_logprobs", "rollout.slots",
                "rollout.refill")
  _int_at_least(c, 1, "rollout.chunk", "rollout.bucket", "rollout.tail")
  o = c.optim
  for key in ("optim.b1", "optim.b2"):
    v = _get(c, key)
    _require(isinstance(v, (int, float)) and 0.0 <= v < 1.0, [key],
             f"must be in [0, 1) (an Adam moment decay), got {v!r}")
  _require(o.eps > 0, ["optim.eps"], f"must be > 0, got {o.eps!r}")
  _require(o.min_lr_ratio <= 1.0, ["optim.min_lr_ratio"],
           f"must be in [0, 1], got {o.min_lr_ratio!r}")
  _require(o.clip_norm > 0, ["optim.clip_norm"],
           f"must be > 0 (the global-norm clip), got {o.clip_norm!r}")
  r = c.rl
  _int_at_least(c, 1, "rl.dynamic_sampling_max_rounds")
  _int_at_least(c, 0, "rl.overlong_buffer")
  _non_negative(c, "rl.overlong_penalty")
  for key in ("rl.dynamic_sampling", "rl.mask_truncated"):
    _require(isinstance(_get(c, key), bool), [key], f"must be True or False, got {_get(c, key)!r}")
  if not c.model.path:   # the warm-up builds the base model, on task.synthetic (warmup.py)
    from trm_jax.data import synthetic
    synthetic.from_config(c.task.synthetic)
    _positive_int(c, "warmup.steps", "warmup.batch_size")
    _non_negative(c, "warmup.lr")
    f = c.warmup.answer_only_frac
    _require(isinstance(f, (int, float)) and 0.0 <= f <= 1.0, ["warmup.answer_only_frac"],
             f"must be in [0, 1], got {f!r}")


def _validate_lora(c: ml_collections.ConfigDict) -> None:
  """The `model.lora` section (models/lora.py; the settings' meaning: docs/lora.md)."""
  from trm_jax.models.config import BASE_QUANTS, LORA_TARGETS  # pylint: disable=g-import-not-at-top
  _int_at_least(c, 0, "model.lora.rank")
  lc = c.model.lora
  _require(isinstance(lc.alpha, (int, float)) and math.isfinite(lc.alpha) and lc.alpha > 0,
           ["model.lora.alpha"], f"must be a finite number > 0, got {lc.alpha!r}")
  targets = tuple(lc.targets) if isinstance(lc.targets, (tuple, list)) else (lc.targets,)
  _require(bool(targets) and all(t in LORA_TARGETS for t in targets)
           and len(set(targets)) == len(targets), ["model.lora.targets"],
           f"{lc.targets!r}: must be distinct names of {', '.join(LORA_TARGETS)}")
  _require(lc.base_quant in BASE_QUANTS, ["model.lora.base_quant"],
           f"unknown value {lc.base_quant!r}; expected one of {', '.join(BASE_QUANTS)}")
  _require(lc.export in ("adapter", "merged"), ["model.lora.export"],
           f"unknown value {lc.export!r}; expected adapter or merged")
  _require(lc.sampler in ("auto", "merged", "unmerged"), ["model.lora.sampler"],
           f"unknown value {lc.sampler!r}; expected auto, merged or unmerged")
  if lc.rank == 0:
    _require(lc.base_quant == "none", ["model.lora.rank", "model.lora.base_quant"],
             f"base_quant={lc.base_quant!r} quantizes the frozen base under LoRA adapters; "
             "with rank 0 every weight is trained (set model.lora.rank >= 1)")
    _require(not lc.path, ["model.lora.rank", "model.lora.path"],
             f"path={lc.path!r} is a LoRA adapter to start from; with rank 0 there are no "
             "adapters (set model.lora.rank to the adapter's r)")


def _known_model_limits(c: ml_collections.ConfigDict) -> dict:
  """What `check_model_fit` can check before the model loads: the warm-up model's positions
  and vocabulary (model.arch, the synthetic tokenizer), or the ones in model.path's
  config.json if it is there and readable (a broken one is reported, with the file named,
  when the model loads)."""
  from trm_jax.data import tasks  # pylint: disable=g-import-not-at-top
  if not c.model.path and tasks.reads_files(c.task.name):
    # The warm-up model would be trained on a file task, which no config intends (the paper
    # configs say model.path must be set) and `trm_jax.aot` validates such configs with a
    # model of its own: the limits are checked once the model is loaded.
    return {"max_positions": None, "vocab_size": None, "num_experts": None}
  if not c.model.path:
    from trm_jax.data import synthetic  # pylint: disable=g-import-not-at-top
    # The warm-up model's vocabulary is the synthetic tokenizer's (warmup.build_base_model).
    vocab = len(synthetic.SPECIAL_TOKENS) + len(dict.fromkeys(synthetic.ALPHABET))
    return {"max_positions": c.model.arch.max_position_embeddings, "vocab_size": vocab,
            "num_experts": c.model.arch.get("num_experts", 0)}
  try:
    with open(os.path.join(os.path.expanduser(c.model.path), "config.json")) as f:
      hf = json.load(f)
    hf = hf if isinstance(hf, dict) else {}
    # Sizes of another type are the loader's to report (it names the file and the key).
    size = lambda v: v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None
    return {"max_positions": size(hf.get("max_position_embeddings")),
            "vocab_size": size(hf.get("vocab_size")),
            "num_experts": size(hf.get("num_experts"))}
  except (OSError, ValueError):
    return {"max_positions": None, "vocab_size": None, "num_experts": None}


def check_model_fit(c: ml_collections.ConfigDict, *, max_positions, vocab_size,
                    prompt_len: int = 0, new_tokens: int = 0, num_experts=None) -> None:
  """Prompt + new tokens against the model's positions, the rollout's top-k sizes against
  its vocabulary, DAPO's overlong buffer against the new tokens, mesh.expert against its
  experts. Run by `validate` with what the config alone tells (explicit lengths, the warm-up
  arch or model.path's config.json), and by the trainer again once the model is loaded and
  the task has derived its lengths. None = not known yet (skipped)."""
  check_expert_mesh(c.mesh.get("expert", 1), num_experts)
  P = prompt_len or c.task.max_prompt_len
  R = new_tokens or c.task.max_new_tokens
  if R:
    _require(c.rl.overlong_buffer < R, ["rl.overlong_buffer", "task.max_new_tokens"],
             f"overlong_buffer={c.rl.overlong_buffer} must be below the {R} new tokens (the "
             "penalty ramps over the last overlong_buffer tokens before the limit)")
  if max_positions and P + R > max_positions:
    if P and R:
      _require(False, ["task.max_prompt_len", "task.max_new_tokens"],
               f"prompts of {P} tokens + {R} new tokens need {P + R} positions, more than "
               f"the model's max_position_embeddings={max_positions}")
    key = "task.max_prompt_len" if P else "task.max_new_tokens"
    _require(False, [key], f"{P or R} tokens alone are more than the model's "
             f"max_position_embeddings={max_positions}")
  if vocab_size:
    for key in ("rollout.top_k", "rollout.keep_topk_logprobs"):
      v = _get(c, key)
      _require(v <= vocab_size, [key],
               f"{v} is more than the model's vocab_size={vocab_size}")


def check_expert_mesh(expert: int, num_experts) -> None:
  """mesh.expert (resolved, or as configured; -1 is checked once resolved) divides the
  model's experts: each device of an expert group holds num_experts / mesh.expert of them. A
  dense model (0 experts) takes any size: there the axis only splits the batch."""
  if num_experts and expert > 1:
    _require(num_experts % expert == 0, ["mesh.expert"],
             f"mesh.expert={expert} does not divide the model's {num_experts} experts (each "
             "device of an expert group holds num_experts / mesh.expert of them)")
