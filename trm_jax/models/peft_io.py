"""PEFT adapters: a LoRA model's adapters as the files `peft` writes and reads.

  save_adapter(model, out_dir, base="/ckpt/Qwen3-8B")   # adapter_config.json +
                                                        #   adapter_model.safetensors
  model = load_adapter(model, adapter_dir)              # a PEFT adapter into the model's

`peft.PeftModel.from_pretrained(transformers_base, out_dir)` reproduces the JAX model's logits
(tests/test_lora.py, fp32), and an adapter trained by PEFT (or by this package) continues
training here (`model.lora.path`). PEFT's LoRA adapts transformers' Linear modules, weights
[out, in]; ours are [*in, r] and [r, *out] (models/lora.py), so

  base_model.model.<module>.lora_A.weight [r, in]  = A.reshape(in, r).T
  base_model.model.<module>.lora_B.weight [out, r] = B.reshape(r, out).T

with <module> the transformers module of the adapted weight (`model.layers.{l}.self_attn.q_proj`,
`model.layers.{l}.mlp.down_proj`: `hf_io`'s names), its scale lora_alpha / r (no rsLoRA, no
DoRA, no biases), stored in float32.

An adapter to import must be what the model's adapters are: LoRA, `r` = the rank,
`lora_alpha` = alpha, `target_modules` the same projections, on every layer, and nothing PEFT
adds beside them (`modules_to_save`, trainable tokens, per-layer rank or alpha patterns); each
difference fails with one line naming the file, the field and the setting it contradicts.
`lora_dropout` is a training setting of PEFT's, not part of the model, and is ignored.
"""
from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import jax
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from trm_jax import workdir as wd
from trm_jax.models import hf_io, lora

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."     # where PeftModel puts the transformers model


class AdapterFileError(ValueError):
  """A PEFT adapter that cannot be read into this model; the message names the file and the
  field or tensor."""


def _modules(cfg) -> Dict[Tuple, str]:
  """(our adapter's path) -> the transformers module of the weight it adapts, for every
  adapter of `cfg.lora` (an adapter's path is its weight's with `_lora` appended)."""
  hf_names = {e.path: e.names[0] for e in hf_io._entries(cfg)}   # pylint: disable=protected-access
  return {("layers", l, block, f"{name}_lora"):
          hf_names[("layers", l, block, name)].removesuffix(".weight")
          for l, target, block, name, _ in lora.projections(cfg) if target in cfg.lora.targets}


def _target_modules(cfg) -> list:
  return sorted({lora.PROJECTIONS[t][1] for t in cfg.lora.targets})


def check_exportable(cfg) -> None:
  """Raises ValueError when peft could not load this model's adapters as they are: on a
  Qwen3-MoE model it reads gate_proj / up_proj / down_proj as the experts' fused tensors
  (its transformers-5 conversion), never as the dense MLPs (`mlp_only_layers`) ours adapt."""
  mlp = [t for t in cfg.lora.targets if lora.PROJECTIONS[t][0] == "mlp"]
  if cfg.num_experts and mlp:
    raise ValueError(
        f"peft loads the targets {', '.join(mlp)} of a {cfg.model_type} model onto its "
        "experts, not onto the dense MLP layers these adapters are on; adapt attention only "
        "(q, k, v, o) to export a PEFT adapter, or export the merged model")


def save_adapter(model: nnx.Module, path: str, *, base: Optional[str] = None) -> str:
  """Writes the model's adapters as a PEFT adapter directory; `base` is recorded as
  base_model_name_or_path (the transformers checkpoint to load it onto). Returns `path`."""
  cfg = model.config
  if cfg.lora is None:
    raise ValueError("save_adapter: the model carries no LoRA adapters")
  check_exportable(cfg)
  path = os.fspath(path)
  tensors = {}
  for adapter_path, module in _modules(cfg).items():
    adapter = lora.at_path(model, adapter_path)
    a = np.asarray(jax.device_get(adapter.a.get_value()), np.float32)    # [*in, r]
    b = np.asarray(jax.device_get(adapter.b.get_value()), np.float32)    # [r, *out]
    r = cfg.lora.rank
    tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, r).T)
    tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b.reshape(r, -1).T)
  config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM",
      "base_model_name_or_path": None if base is None else os.path.abspath(base),
      "r": cfg.lora.rank, "lora_alpha": cfg.lora.alpha, "lora_dropout": 0.0,
      "target_modules": _target_modules(cfg), "bias": "none", "fan_in_fan_out": False,
      "use_rslora": False, "use_dora": False, "lora_bias": False, "init_lora_weights": True,
      "inference_mode": True, "modules_to_save": None, "layers_to_transform": None,
      "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
      "target_parameters": None,
  }
  # Written under a temporary name and renamed (the config atomically too): a reader never
  # sees half an adapter, and a write that fails (a full disk) is one line naming `path`
  # (hf_io.save_pretrained's error) and leaves no temporary file.
  tmp = os.path.join(path, WEIGHTS_FILE + ".tmp")
  try:
    os.makedirs(path, exist_ok=True)
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, WEIGHTS_FILE))
    wd.write_json_atomic(os.path.join(path, CONFIG_FILE), config)
  except (OSError, SafetensorError) as e:
    if os.path.exists(tmp):
      os.remove(tmp)
    cause = e.strerror if isinstance(e, OSError) and e.strerror else str(e).rsplit(": ", 1)[-1]
    raise hf_io.CheckpointFileError(f"{path}: cannot write the adapter ({cause})") from e
  return path


def _check_config(file: str, got: dict, cfg) -> None:
  """The adapter_config.json of an adapter to import against the model's adapters."""
  def bad(field: str, want: str) -> AdapterFileError:
    return AdapterFileError(f"{file}: {field} = {got.get(field)!r}, but {want}")

  if got.get("peft_type") != "LORA":
    raise bad("peft_type", "only LoRA adapters are read")
  if got.get("r") != cfg.lora.rank:
    raise bad("r", f"the model's adapters have rank {cfg.lora.rank} (model.lora.rank)")
  if got.get("lora_alpha") is None or float(got["lora_alpha"]) != cfg.lora.alpha:
    raise bad("lora_alpha", f"the model's adapters have alpha {cfg.lora.alpha} "
              "(model.lora.alpha)")
  targets = got.get("target_modules")
  if not isinstance(targets, list) or sorted(set(targets)) != _target_modules(cfg):
    raise bad("target_modules", f"the model adapts {_target_modules(cfg)} (model.lora.targets"
              " names them q, k, v, o, gate, up, down)")
  for field, ok in (("use_rslora", False), ("use_dora", False), ("bias", "none"),
                    ("lora_bias", False), ("fan_in_fan_out", False)):
    if got.get(field, ok) != ok:
      raise bad(field, f"only {field} = {ok!r} is read")
  for field in ("modules_to_save", "layers_to_transform", "layers_pattern", "rank_pattern",
                "alpha_pattern", "target_parameters", "trainable_token_indices"):
    if got.get(field):
      raise bad(field, "the model's adapters are the same rank and alpha on every layer "
                "and nothing else is trained")


def load_adapter(model: nnx.Module, path: str) -> nnx.Module:
  """Sets the model's adapters to the PEFT adapter in directory `path` (in place, each array
  placed as the adapter it replaces); returns the model."""
  cfg = model.config
  if cfg.lora is None:
    raise ValueError("load_adapter: the model carries no LoRA adapters to load into")
  path = os.fspath(path)
  config_file, weights_file = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
  _check_config(config_file, hf_io._read_json_file(config_file, "a PEFT adapter directory needs "  # pylint: disable=protected-access
                                                   "adapter_config.json"), cfg)
  if not os.path.isfile(weights_file):
    raise AdapterFileError(f"{weights_file}: no such file (a PEFT adapter directory needs "
                           f"{WEIGHTS_FILE})")
  try:
    handle = safe_open(weights_file, framework="numpy")
    names = set(handle.keys())
  except (SafetensorError, OSError) as e:
    raise AdapterFileError(f"{weights_file}: not a readable safetensors file, truncated or "
                           f"corrupt ({e})") from None
  wanted, r = set(), cfg.lora.rank
  for adapter_path, module in _modules(cfg).items():
    adapter = lora.at_path(model, adapter_path)
    for part, var in (("lora_A", adapter.a), ("lora_B", adapter.b)):
      name = f"{PREFIX}{module}.{part}.weight"
      wanted.add(name)
      shape = tuple(var.shape)              # A [*in, r], B [r, *out]
      want = (r, int(np.prod(shape[:-1]))) if part == "lora_A" else (int(np.prod(shape[1:])), r)
      if name not in names:
        raise AdapterFileError(f"{weights_file} lacks tensor {name!r} (expected shape {want})")
      x = handle.get_tensor(name)
      if tuple(x.shape) != want:
        raise AdapterFileError(f"{weights_file}: tensor {name!r} has shape {tuple(x.shape)}, "
                               f"expected {want}")
      x = np.asarray(x, np.float32).T.reshape(shape)
      if not np.isfinite(x).all():
        raise AdapterFileError(f"{weights_file}: tensor {name!r} holds non-finite values")
      sharding = var.get_value().sharding
      var.set_value(jax.make_array_from_callback(shape, sharding, lambda idx, x=x: x[idx]))
  extra = sorted(names - wanted)
  if extra:
    more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
    raise AdapterFileError(f"{weights_file} has unexpected tensor {extra[0]!r}{more}: not an "
                           "adapter of this model's targets")
  return model
