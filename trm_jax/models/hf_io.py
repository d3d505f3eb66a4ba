"""Hugging Face checkpoint import/export: `config.json` + safetensors (single file or sharded).

Loading streams: the model is built abstractly (`nnx.eval_shape`, no weights allocated), then
every parameter is created with `jax.make_array_from_callback` in its target sharding, and the
callback reads only the slice of the on-disk tensor that each device holds
(`safe_open(...).get_slice`). No full host copy of the model (or, on a mesh, of one sharded
tensor) ever exists. Strict by default: a missing tensor, a wrong shape, an unexpected tensor,
a non-float tensor or an unsupported `model_type` raises naming it.

Bad files fail with one line naming the file (`CheckpointFileError`): a missing or non-JSON
config.json or index, a truncated or corrupt safetensors file, and an index `weight_map` entry
that does not resolve (realpath, so symlinks count) inside the checkpoint directory: the
directory is what gets copied, exported and fingerprinted, so every weight must live in it. The
one exception is the Hugging Face hub cache, whose `snapshots/<rev>/` files are symlinks into
the same repository's `blobs/`. Non-finite weights (NaN / Inf, or finite values that overflow
the parameter dtype) are refused while streaming, naming the tensor: one `isfinite`
reduction per block read, on the host, before the block reaches a device.

Layout conversion (torch Linear stores [out, in]; we store einsum layouts):
  q/k/v_proj.weight [N*H, D] -> [D, N, H];  o_proj.weight [D, N*H] -> [N, H, D]
  q/k/v_proj.bias   [N*H]    -> [N, H];     gate/up [F, D] -> [D, F]; down [D, F] -> [F, D]
  Qwen3-MoE experts are stored per index (`mlp.experts.{e}.{gate,up,down}_proj.weight`, what
  transformers 5 writes) and stacked to [E, D, F] / [E, F, D]; `mlp.gate.weight` [E, D] -> [D, E].
Ignored on load: `lm_head.weight` when embeddings are tied (transformers ignores it too) and
`rotary_emb.inv_freq` buffers some older checkpoints carry (RoPE is recomputed from config).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from trm_jax import sharding as shd
from trm_jax import workdir as wd
from trm_jax.models import lora
from trm_jax.models.config import ModelConfig
from trm_jax.models.decoder import Decoder, abstract_model

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_FLOAT_DTYPES = ("F32", "BF16", "F16")


class CheckpointMismatchError(ValueError):
  """The checkpoint's tensors do not match what its config.json describes."""


class CheckpointFileError(ValueError):
  """A checkpoint file is missing, unreadable, outside the checkpoint directory, or holds
  non-finite weights; the message names the file (and the entry or tensor)."""


@dataclasses.dataclass(frozen=True)
class _Entry:
  """How one of our parameters is stored in a HF checkpoint.

  ours = stack_e( reshape( hf_e.T if transpose else hf_e ) ) when `stacked` (experts), else
  ours = reshape( hf.T if transpose else hf ). `groups` says which of our (non-expert) dims
  were merged into each dim of the (transposed) HF tensor, e.g. q_proj: ((0,), (1, 2)).
  """
  path: Tuple
  names: Tuple[str, ...]
  transpose: bool
  groups: Tuple[Tuple[int, ...], ...]
  stacked: bool = False

  def merged_shape(self, dims: Sequence[int]) -> Tuple[int, ...]:
    """Our (non-expert) dims with each group merged: the HF shape before any transpose."""
    return tuple(math.prod(dims[i] for i in g) for g in self.groups)

  def hf_shape(self, ours: Sequence[int]) -> Tuple[int, ...]:
    """Shape of each on-disk tensor for our parameter shape `ours`."""
    merged = self.merged_shape(ours[1:] if self.stacked else ours)
    return merged[::-1] if self.transpose else merged


def _entries(cfg: ModelConfig) -> List[_Entry]:
  """Every parameter of `Decoder(cfg)` and the HF tensor(s) it comes from."""
  vec, mat = ((0,),), ((0,), (1,))
  out = [_Entry(("embed", "embedding"), ("model.embed_tokens.weight",), False, mat),
         _Entry(("final_norm", "scale"), ("model.norm.weight",), False, vec)]
  if not cfg.tie_word_embeddings:
    out.append(_Entry(("lm_head",), ("lm_head.weight",), True, mat))
  for l in range(cfg.num_layers):
    p, o = f"model.layers.{l}.", ("layers", l)
    a, sa = o + ("attn",), p + "self_attn."
    out += [
        _Entry(o + ("input_norm", "scale"), (p + "input_layernorm.weight",), False, vec),
        _Entry(o + ("post_attn_norm", "scale"), (p + "post_attention_layernorm.weight",),
               False, vec),
        _Entry(a + ("q_proj",), (sa + "q_proj.weight",), True, ((0,), (1, 2))),
        _Entry(a + ("k_proj",), (sa + "k_proj.weight",), True, ((0,), (1, 2))),
        _Entry(a + ("v_proj",), (sa + "v_proj.weight",), True, ((0,), (1, 2))),
        _Entry(a + ("o_proj",), (sa + "o_proj.weight",), True, ((0, 1), (2,))),
    ]
    if cfg.qkv_bias:
      out += [_Entry(a + (f"{x}_bias",), (sa + f"{x}_proj.bias",), False, ((0, 1),))
              for x in "qkv"]
    if cfg.o_bias:
      out.append(_Entry(a + ("o_bias",), (sa + "o_proj.bias",), False, vec))
    if cfg.qk_norm:
      out += [_Entry(a + (f"{x}_norm", "scale"), (sa + f"{x}_norm.weight",), False, vec)
              for x in "qk"]
    m, pm = o + ("mlp",), p + "mlp."
    if cfg.is_moe_layer(l):
      out.append(_Entry(m + ("router",), (pm + "gate.weight",), True, mat))
      for x in ("gate_proj", "up_proj", "down_proj"):
        names = tuple(f"{pm}experts.{e}.{x}.weight" for e in range(cfg.num_experts))
        out.append(_Entry(m + (x,), names, True, mat, stacked=True))
    else:
      out += [_Entry(m + (x,), (f"{pm}{x}.weight",), True, mat)
              for x in ("gate_proj", "up_proj", "down_proj")]
  return out


def _ignored(name: str, cfg: ModelConfig) -> bool:
  return (name == "lm_head.weight" and cfg.tie_word_embeddings) or name.endswith(
      "rotary_emb.inv_freq")


# ---------------------------------------------------------------------------------- reading
def _read_json_file(file: str, what: str) -> dict:
  """A JSON object from `file`, or one line naming the file."""
  if not os.path.isfile(file):
    raise CheckpointFileError(f"{file}: no such file ({what})")
  with open(file, "rb") as f:
    data = f.read()
  try:
    out = json.loads(data)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    where = (f"line {e.lineno} column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError)
             else e.reason)
    raise CheckpointFileError(f"{file}: not valid JSON ({where})") from None
  if not isinstance(out, dict):
    raise CheckpointFileError(f"{file}: expected a JSON object, got {type(out).__name__}")
  return out


def _inside(real: str, root: str) -> bool:
  return os.path.commonpath([real, root]) == root


def _allowed_roots(path: str) -> List[str]:
  """Where the files of checkpoint directory `path` may resolve: the directory itself, and for
  a hub-cache snapshot (`models--org--name/snapshots/<rev>`) that repository's `blobs/`."""
  real = os.path.realpath(path)
  roots = [real]
  parent = os.path.dirname(real)
  if os.path.basename(parent) == "snapshots":
    roots.append(os.path.join(os.path.dirname(parent), "blobs"))
  return roots


def _weight_files(path: str, index: str) -> List[str]:
  """The safetensors files an index names, each checked to resolve inside the checkpoint."""
  weight_map = _read_json_file(index, "the sharded checkpoint's index").get("weight_map")
  if not isinstance(weight_map, dict) or not weight_map:
    raise CheckpointFileError(f"{index}: no 'weight_map' object mapping tensor names to files")
  roots = _allowed_roots(path)
  for name, fn in weight_map.items():
    if not isinstance(fn, str) or not fn:
      raise CheckpointFileError(f"{index}: weight_map entry {name!r} -> {fn!r} is not a file "
                                "name")
    real = os.path.realpath(os.path.join(path, fn))
    if os.path.isabs(fn) or not any(_inside(real, r) for r in roots):
      raise CheckpointFileError(
          f"{index}: weight_map entry {name!r} -> {fn!r} resolves to {real}, outside the "
          f"checkpoint directory {roots[0]}")
  return sorted(set(weight_map.values()))


class _Checkpoint:
  """Open safetensors file(s) of one checkpoint directory: name -> (handle, shape, dtype)."""

  def __init__(self, path: str):
    self.path = path
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
      files = _weight_files(path, index)
    elif os.path.exists(os.path.join(path, SINGLE_FILE)):
      files = [SINGLE_FILE]
    else:
      raise CheckpointFileError(f"{path}: no weights (neither {SINGLE_FILE} nor {INDEX_FILE})")
    self.tensors: Dict[str, Tuple[object, Tuple[int, ...], str]] = {}
    self.files: Dict[str, str] = {}   # tensor name -> the file holding it (error messages)
    for fn in files:
      file = os.path.join(path, fn)
      if not os.path.isfile(file):
        raise CheckpointFileError(f"{file}: no such file (named by {INDEX_FILE})")
      try:
        h = safe_open(file, framework="numpy")
      except (SafetensorError, OSError) as e:
        raise CheckpointFileError(f"{file}: not a readable safetensors file, truncated or "
                                  f"corrupt ({e})") from None
      for name in h.keys():
        sl = h.get_slice(name)
        self.tensors[name] = (h, tuple(sl.get_shape()), sl.get_dtype())
        self.files[name] = file

  def read(self, name: str, index: Tuple[slice, ...]) -> np.ndarray:
    handle = self.tensors[name][0]
    return handle.get_slice(name)[index]


def _ours_from_hf(ckpt: _Checkpoint, entry: _Entry, ours_shape: Tuple[int, ...],
                  index: Tuple[slice, ...], dtype) -> np.ndarray:
  """The block `index` of our parameter, read from disk slice by slice."""
  index = tuple(slice(*s.indices(n)) for s, n in zip(index, ours_shape))
  if entry.stacked:
    e_sl, index, dims = index[0], index[1:], ours_shape[1:]
    names = entry.names[e_sl]
  else:
    dims, names = ours_shape, entry.names
  # Per HF dim: a contiguous merged range covering the requested block of its grouped dims.
  # Only the first dim of a group may be a proper sub-range for the merged range to be exact;
  # inner dims are read whole and sliced after the reshape (tensor-parallel shards split the
  # head dim N, never H, so this costs nothing in practice).
  merged, block_shape, post = [], [], []
  for g in entry.groups:
    inner = math.prod(dims[i] for i in g[1:])
    first = index[g[0]]
    merged.append(slice(first.start * inner, first.stop * inner))
    block_shape += [first.stop - first.start] + [dims[i] for i in g[1:]]
    post += [slice(None)] + [index[i] for i in g[1:]]
  hf_index = tuple(merged[::-1]) if entry.transpose else tuple(merged)
  blocks = []
  for name in names:
    x = ckpt.read(name, hf_index)
    x = x.T if entry.transpose else x
    with np.errstate(over="ignore"):   # an overflowing cast is reported just below
      y = x.reshape(block_shape)[tuple(post)].astype(dtype)
    if not np.isfinite(y).all():   # the one reduction per block; the rest only on failure
      raise CheckpointFileError(_non_finite_message(ckpt, name, x, dtype))
    blocks.append(y)
  return np.stack(blocks) if entry.stacked else blocks[0]


def _non_finite_message(ckpt: _Checkpoint, name: str, x: np.ndarray, dtype) -> str:
  where = f"tensor {name!r} in {ckpt.files[name]}"
  bad = ~np.isfinite(x)
  if bad.any():
    n_nan = int(np.isnan(x).sum())
    return (f"{where} holds non-finite weights ({n_nan} NaN, {int(bad.sum()) - n_nan} Inf in "
            f"the block read); refusing to load it")
  return (f"{where} holds values up to {float(np.abs(x.astype(np.float32)).max()):.4g}, which "
          f"overflow the parameter dtype {np.dtype(dtype).name}; load with a wider param_dtype")


def _validate(ckpt: _Checkpoint, cfg: ModelConfig, entries: List[_Entry], shapes: Dict) -> None:
  """Strict check of the checkpoint against config.json before anything is allocated."""
  wanted = set()
  for entry in entries:
    expected = entry.hf_shape(shapes[entry.path])
    for name in entry.names:
      wanted.add(name)
      if name not in ckpt.tensors:
        raise CheckpointMismatchError(
            f"checkpoint {ckpt.path} is missing tensor {name!r} (expected shape {expected}) "
            f"required by {cfg.model_type}")
      _, found, dtype = ckpt.tensors[name]
      if found != expected:
        raise CheckpointMismatchError(
            f"tensor {name!r} has shape {found}, expected {expected} from config.json")
      if dtype not in _FLOAT_DTYPES:
        raise CheckpointMismatchError(
            f"tensor {name!r} has dtype {dtype}, expected one of {_FLOAT_DTYPES}")
  extra = sorted(n for n in ckpt.tensors if n not in wanted and not _ignored(n, cfg))
  if extra:
    more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
    raise CheckpointMismatchError(
        f"checkpoint {ckpt.path} has unexpected tensor {extra[0]!r}{more}: not part of a "
        f"{cfg.model_type} model with this config.json")


def from_pretrained(path: str, dtype=jnp.float32, *, param_dtype=None,
                    mesh: Optional[jax.sharding.Mesh] = None,
                    rules: Optional[shd.Rules] = None, remat: bool = False,
                    moe_chunk: int = 4096) -> Decoder:
  """Loads a HF checkpoint directory into a `Decoder`.

  Args:
    path: directory with config.json and model.safetensors or model.safetensors.index.json.
    dtype: compute dtype; param_dtype: storage dtype (default: same as dtype).
    mesh: place every parameter sharded by its logical axes (`trm_jax.sharding`); None puts
      everything on jax.devices()[0].
    rules: logical-axis rules (default `sharding.DEFAULT_RULES`).
    remat: rematerialise each block in the backward pass.
    moe_chunk: expert parallelism's tokens per device per all-to-all (`ModelConfig`).
  """
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise CheckpointFileError(f"{path}: no such checkpoint directory")
  config_file = os.path.join(path, "config.json")
  hf_config = _read_json_file(config_file, "a Hugging Face checkpoint directory needs config.json")
  try:   # sizes, types and options, checked before anything is built
    cfg = ModelConfig.from_hf(hf_config, dtype=dtype, param_dtype=param_dtype, remat=remat,
                              moe_chunk=moe_chunk)
  except ValueError as e:
    raise CheckpointFileError(f"{config_file}: {e}") from None
  graphdef, state = nnx.split(abstract_model(Decoder, cfg))
  flat = nnx.to_flat_state(state)
  by_path = {p: v for p, v in flat}
  entries = _entries(cfg)
  mapped = {e.path for e in entries}
  if mapped != set(by_path):  # a bug in _entries, not in the checkpoint
    raise AssertionError(f"parameter map mismatch: {sorted(mapped ^ set(by_path), key=str)}")
  shapes = {p: tuple(v.get_value().shape) for p, v in by_path.items()}
  ckpt = _Checkpoint(path)
  _validate(ckpt, cfg, entries, shapes)
  np_dtype = np.dtype(cfg.weight_dtype)
  for entry in entries:
    var = by_path[entry.path]
    shape = shapes[entry.path]
    if mesh is None:
      sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    else:
      sharding = shd.named_sharding(mesh, shd.param_axes(var), shape, rules)
    arr = jax.make_array_from_callback(
        shape, sharding,
        lambda idx, entry=entry, shape=shape: _ours_from_hf(ckpt, entry, shape, idx, np_dtype))
    var.set_value(arr)
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ---------------------------------------------------------------------------------- writing
def _hf_from_ours(entry: _Entry, ours: np.ndarray) -> List[np.ndarray]:
  parts = list(ours) if entry.stacked else [ours]
  out = []
  for x in parts:
    x = x.reshape(entry.merged_shape(x.shape))
    out.append(np.ascontiguousarray(x.T if entry.transpose else x))
  return out


def save_pretrained(model: Decoder, path: str, *, max_shard_bytes: Optional[int] = None,
                    adapter: bool = False, base: Optional[str] = None) -> str:
  """Writes config.json + safetensors that transformers' `from_pretrained` loads back.

  Parameters are fetched to host one at a time and written in their parameter dtype. With
  `max_shard_bytes`, tensors are split over `model-0000i-of-0000n.safetensors` files with a
  `model.safetensors.index.json` (host memory then holds at most one shard). Shards are
  written as temporary files and renamed once all are written: a write that fails (a full
  disk) raises `CheckpointFileError` naming `path` and the cause and removes the temporary
  files; an earlier checkpoint in `path` stays whole unless the failure came while renaming.

  A model with LoRA adapters (models/lora.py) is written merged (each adapted weight
  W + (alpha / r) A B, a quantized base dequantized), or with `adapter=True` as a PEFT
  adapter that `peft` loads onto the transformers checkpoint `base` (models/peft_io.py).
  """
  path = os.fspath(path)
  if adapter:
    from trm_jax.models import peft_io  # pylint: disable=g-import-not-at-top  (imports hf_io)
    return peft_io.save_adapter(model, path, base=base)
  model = lora.merged(model)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise CheckpointFileError(f"{path}: cannot write the checkpoint ({e.strerror or e})") from e
  cfg = model.config
  by_path = {p: v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  written: List[Tuple[str, List[str]]] = []   # (temporary file name, tensor names)
  shard: Dict[str, np.ndarray] = {}
  shard_bytes = total = 0

  def flush():
    tmp = f"model-{len(written) + 1:05d}.safetensors.tmp"
    written.append((tmp, list(shard)))
    save_file(shard, os.path.join(path, tmp), metadata={"format": "pt"})

  try:
    for entry in _entries(cfg):
      ours = np.asarray(jax.device_get(by_path[entry.path].get_value()))
      for name, x in zip(entry.names, _hf_from_ours(entry, ours)):
        if max_shard_bytes is not None and shard and shard_bytes + x.nbytes > max_shard_bytes:
          flush()
          shard, shard_bytes = {}, 0
        shard[name] = x
        shard_bytes += x.nbytes
        total += x.nbytes
    flush()
    if len(written) == 1:
      os.replace(os.path.join(path, written[0][0]), os.path.join(path, SINGLE_FILE))
    else:
      weight_map = {}
      for i, (tmp, names) in enumerate(written):
        final = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        os.replace(os.path.join(path, tmp), os.path.join(path, final))
        weight_map.update({name: final for name in names})
      wd.write_json_atomic(os.path.join(path, INDEX_FILE),
                           {"metadata": {"total_size": total}, "weight_map": weight_map})
    wd.write_json_atomic(os.path.join(path, "config.json"), cfg.to_hf())
  except (OSError, SafetensorError) as e:
    for tmp, _ in written:
      if os.path.exists(os.path.join(path, tmp)):
        os.remove(os.path.join(path, tmp))
    cause = e.strerror if isinstance(e, OSError) and e.strerror else str(e).rsplit(": ", 1)[-1]
    raise CheckpointFileError(f"{path}: cannot write the checkpoint ({cause})") from e
  return path
