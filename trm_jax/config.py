"""Experiment configs: loading, `--config.key=value` overrides, and consistency checks.

Configs are Python files with `get_config(arg=None) -> ml_collections.ConfigDict` (big_vision
style). Every setting has exactly one default, in the config file. This module adds what
ml-collections does not do well by itself:
  * an unknown or misspelt override key fails *before any work*, naming the key and the
    closest valid keys (ml-collections raises a bare AttributeError deep in absl);
  * `validate(config)` checks cross-field consistency (batch divisible by group size, ...) and
    names the offending keys.
"""
from __future__ import annotations

import difflib
import importlib.util
import os
from typing import Iterable, Sequence

import ml_collections


class ConfigError(ValueError):
  """A config key is unknown, mistyped or inconsistent with another key."""


def load_config(spec: str) -> ml_collections.ConfigDict:
  """Loads `path/to/config.py[:arg]` and calls its `get_config(arg)`."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise ConfigError(f"config file not found: {path}")
  mod_spec = importlib.util.spec_from_file_location("_trm_config", path)
  module = importlib.util.module_from_spec(mod_spec)
  mod_spec.loader.exec_module(module)
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
    raise ConfigError(f"inconsistent config [{', '.join(keys)}]: {msg}")


def validate(c: ml_collections.ConfigDict) -> None:
  """Cross-field checks; each names the keys involved. Call before allocating anything."""
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
  _require(c.total_steps > 0, ["total_steps"], "must be positive")
  _require(c.log_every >= 1, ["log_every"], "must be >= 1")
  _require(c.eval_every >= 0, ["eval_every"], "must be >= 0 (0 = only at the end)")
  _require(c.eval_problems >= 0 and c.eval_samples >= 1, ["eval_problems", "eval_samples"],
           "need eval_problems >= 0 and eval_samples >= 1")
  _require(0.0 <= c.smd.lam, ["smd.lam"], "distillation weight must be >= 0")
  from trm_jax.rl.learner import MODES  # pylint: disable=g-import-not-at-top
  _require(c.smd.mode in MODES, ["smd.mode"],
           f"unknown mode {c.smd.mode!r}; expected {'|'.join(MODES)}")
  if c.smd.mode in ("naive", "sparse_rl", "smd"):
    _require(c.rollout.cache.policy != "none", ["smd.mode", "rollout.cache.policy"],
             f"smd.mode={c.smd.mode!r} needs a compressed rollout cache")
  from trm_jax.trm import CRITERIA  # pylint: disable=g-import-not-at-top
  for name in c.trm.criteria:
    _require(name in CRITERIA, ["trm.criteria"],
             f"unknown criterion {name!r}; known: {', '.join(sorted(CRITERIA))}")
    if {"kl", "tv"} & set(CRITERIA[name].needs):
      _require(c.rollout.keep_full_logprobs or c.rollout.keep_topk_logprobs > 0,
               ["trm.criteria", "rollout.keep_full_logprobs", "rollout.keep_topk_logprobs"],
               f"criterion {name!r} needs the rollout's distribution: keep full or top-k "
               "log-probs")
  _require(0.0 < c.rollout.top_p <= 1.0, ["rollout.top_p"], "must be in (0, 1]")
  _require(0.0 < c.eval_top_p <= 1.0, ["eval_top_p"], "must be in (0, 1]")
  _require(c.eval_temperature > 0.0, ["eval_temperature"], "must be > 0")
  _require(c.rollout.temperature > 0.0, ["rollout.temperature"], "must be > 0")
