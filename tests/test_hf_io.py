"""Checkpoint export/import: round trips through transformers, sharded files, strict errors."""
import json
import os
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from hf_fixtures import hf_logits, make_hf_checkpoint, sample_batch
from trm_jax.kernels import Visibility
from model_fixtures import make_test_model
from trm_jax.models import from_pretrained, save_pretrained
from trm_jax import sharding as shd
from trm_jax.models.hf_io import (INDEX_FILE, SINGLE_FILE, CheckpointFileError,
                                  CheckpointMismatchError)

TOL = 1e-4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  root = tmp_path_factory.mktemp("io")
  return {arch: make_hf_checkpoint(str(root / arch), arch)
          for arch in ("qwen3_tied", "qwen2", "llama3", "qwen3_moe")}


def _params(model):
  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def _tensors(path):
  out = {}
  for fn in sorted(os.listdir(path)):
    if fn.endswith(".safetensors"):
      out.update(load_file(os.path.join(path, fn)))
  return out


@pytest.mark.parametrize("arch", ["qwen3_tied", "qwen2", "llama3", "qwen3_moe"])
def test_export_round_trip_through_transformers(ckpts, tmp_path, arch):
  """HF file -> ours -> save_pretrained -> transformers: bit-identical tensors, same logits."""
  out = save_pretrained(from_pretrained(ckpts[arch]), str(tmp_path / "export"))
  original, exported = _tensors(ckpts[arch]), _tensors(out)
  assert sorted(exported) == sorted(original)
  for name, x in original.items():
    np.testing.assert_array_equal(exported[name], x, err_msg=name)
  tokens, mask = sample_batch(B=2, T=8)
  np.testing.assert_array_equal(hf_logits(out, tokens, mask), hf_logits(ckpts[arch], tokens, mask))


def test_random_model_exports_to_transformers(tmp_path):
  """A model never seen by transformers (MoE + dense layers, biases) exports faithfully."""
  model = make_test_model(seed=1, model_type="qwen3_moe", num_layers=3, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2,
                          qkv_bias=True, o_bias=True, eos_token_id=(2, 3))
  # Random init draws biases as zeros and norms as ones; perturb so they are really tested.
  rng = np.random.default_rng(0)
  for _, v in nnx.to_flat_state(nnx.state(model)):
    x = np.asarray(v.get_value())
    v.set_value(jnp.asarray(x + 0.1 * rng.standard_normal(x.shape, np.float32)))
  path = save_pretrained(model, str(tmp_path / "rand"))
  cfg = json.load(open(os.path.join(path, "config.json")))
  assert cfg["eos_token_id"] == [2, 3] and cfg["decoder_sparse_step"] == 2
  names = _tensors(path)
  assert "model.layers.1.mlp.experts.3.down_proj.weight" in names     # per-expert on disk
  assert "model.layers.0.mlp.gate_proj.weight" in names               # layer 0 is dense
  tokens, mask = sample_batch(B=2, T=8)
  ours = np.asarray(nnx.jit(lambda m, t, s: m(t, visibility=Visibility(segment_ids=s)))(
      model, jnp.asarray(tokens), jnp.asarray(mask)))
  ref = hf_logits(path, tokens, mask)
  np.testing.assert_array_less(np.abs(ours - ref)[mask.astype(bool)].max(), TOL)


def test_bf16_export_keeps_bf16_bits(tmp_path):
  src = make_hf_checkpoint(str(tmp_path / "src"), "qwen3", dtype=torch.bfloat16)
  model = from_pretrained(src, dtype=jnp.bfloat16)
  out = save_pretrained(model, str(tmp_path / "out"))
  with safe_open(os.path.join(out, SINGLE_FILE), "numpy") as f:
    assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
  original, exported = _tensors(src), _tensors(out)
  for name, x in original.items():
    np.testing.assert_array_equal(exported[name].view(np.uint16), x.view(np.uint16))
  assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"


def test_sharded_checkpoint_written_by_transformers_loads(tmp_path, ckpts):
  sharded = make_hf_checkpoint(str(tmp_path / "sharded"), "qwen3_moe", max_shard_size="40KB")
  index = json.load(open(os.path.join(sharded, INDEX_FILE)))
  assert len(set(index["weight_map"].values())) > 2
  assert not os.path.exists(os.path.join(sharded, SINGLE_FILE))
  a, b = _params(from_pretrained(sharded)), _params(from_pretrained(ckpts["qwen3_moe"]))
  assert a.keys() == b.keys()
  for k in a:  # same seed -> same weights, so shard layout is the only difference
    np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


def test_sharded_export_loads_in_transformers(tmp_path, ckpts):
  out = save_pretrained(from_pretrained(ckpts["llama3"]), str(tmp_path / "sh"),
                        max_shard_bytes=60_000)
  index = json.load(open(os.path.join(out, INDEX_FILE)))
  files = set(index["weight_map"].values())
  assert len(files) > 2 and all(os.path.exists(os.path.join(out, f)) for f in files)
  assert not any(f.endswith(".tmp") for f in os.listdir(out))
  assert index["metadata"]["total_size"] == sum(x.nbytes for x in _tensors(out).values())
  tokens, mask = sample_batch(B=2, T=8)
  np.testing.assert_array_equal(hf_logits(out, tokens, mask),
                                hf_logits(ckpts["llama3"], tokens, mask))


# ------------------------------------------------------------------------- strict errors
def _rewrite(src, dst, edit):
  """Copies a single-file checkpoint, letting `edit(tensors)` change the tensor dict."""
  os.makedirs(dst)
  tensors = load_file(os.path.join(src, SINGLE_FILE))
  edit(tensors)
  save_file(tensors, os.path.join(dst, SINGLE_FILE), metadata={"format": "pt"})
  with open(os.path.join(src, "config.json")) as f:
    cfg = json.load(f)
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(cfg, f)
  return dst


def test_missing_tensor_is_named(ckpts, tmp_path):
  name = "model.layers.1.self_attn.k_norm.weight"
  bad = _rewrite(ckpts["qwen3_tied"], str(tmp_path / "bad"), lambda t: t.pop(name))
  with pytest.raises(CheckpointMismatchError,
                     match=f"missing tensor '{name}'.*expected shape \\(16,\\)"):
    from_pretrained(bad)


def test_missing_expert_is_named(ckpts, tmp_path):
  name = "model.layers.0.mlp.experts.3.up_proj.weight"
  bad = _rewrite(ckpts["qwen3_moe"], str(tmp_path / "bad"), lambda t: t.pop(name))
  with pytest.raises(CheckpointMismatchError, match=f"missing tensor '{name}'"):
    from_pretrained(bad)


def test_wrong_shape_names_expected_and_found(ckpts, tmp_path):
  name = "model.layers.0.self_attn.q_proj.weight"

  def edit(t):
    t[name] = t[name][:32]
  bad = _rewrite(ckpts["qwen3_tied"], str(tmp_path / "bad"), edit)
  with pytest.raises(CheckpointMismatchError,
                     match=f"'{name}' has shape \\(32, 64\\), expected \\(64, 64\\)"):
    from_pretrained(bad)


def test_unexpected_tensor_is_named(ckpts, tmp_path):
  name = "model.layers.0.self_attn.o_proj.bias"  # qwen2 has no o bias

  def edit(t):
    t[name] = np.zeros(64, np.float32)
  bad = _rewrite(ckpts["qwen2"], str(tmp_path / "bad"), edit)
  with pytest.raises(CheckpointMismatchError, match=f"unexpected tensor '{name}'"):
    from_pretrained(bad)


def test_tied_checkpoint_may_carry_lm_head(ckpts, tmp_path):
  """transformers ignores lm_head.weight of tied models; so do we (and only then)."""
  def edit(t):
    t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
  ok = _rewrite(ckpts["qwen3_tied"], str(tmp_path / "ok"), edit)
  model = from_pretrained(ok)
  assert model.config.tie_word_embeddings and not hasattr(model, "lm_head")


def test_unsupported_model_type_lists_supported(ckpts, tmp_path):
  bad = str(tmp_path / "bad")
  os.makedirs(bad)
  cfg = json.load(open(os.path.join(ckpts["qwen2"], "config.json")))
  cfg["model_type"] = "mistral"
  json.dump(cfg, open(os.path.join(bad, "config.json"), "w"))
  with pytest.raises(ValueError, match="unsupported model_type 'mistral'.*qwen3, qwen2, llama, "
                                       "qwen3_moe"):
    from_pretrained(bad)


def test_qwen2_checkpoint_with_null_attention_bias_loads(ckpts, tmp_path):
  dst = _rewrite(ckpts["qwen2"], str(tmp_path / "nullbias"), lambda t: None)
  cfg_path = os.path.join(dst, "config.json")
  cfg = json.load(open(cfg_path))
  cfg["attention_bias"] = None
  json.dump(cfg, open(cfg_path, "w"))
  a, b = _params(from_pretrained(dst)), _params(from_pretrained(ckpts["qwen2"]))
  np.testing.assert_array_equal(a[("layers", 0, "attn", "q_bias")],
                                b[("layers", 0, "attn", "q_bias")])


def test_no_weights_file_is_named(tmp_path):
  d = str(tmp_path / "empty")
  os.makedirs(d)
  json.dump(make_test_model().config.to_hf(), open(os.path.join(d, "config.json"), "w"))
  with pytest.raises(CheckpointFileError, match=f"{d}: no weights .neither model.safetensors"):
    from_pretrained(d)


def test_non_float_tensor_is_named(ckpts, tmp_path):
  name = "model.norm.weight"

  def edit(t):
    t[name] = t[name].astype(np.int32)
  bad = _rewrite(ckpts["qwen3_tied"], str(tmp_path / "bad"), edit)
  with pytest.raises(CheckpointMismatchError, match=f"'{name}' has dtype I32"):
    from_pretrained(bad)


# ------------------------------------------------------------------------- unsafe / bad files
def _raises_exactly(message, path, **kw):
  with pytest.raises(CheckpointFileError) as e:
    from_pretrained(path, **kw)
  assert str(e.value) == message
  assert "\n" not in message


@pytest.fixture(scope="module")
def sharded_src(tmp_path_factory):
  """A sharded checkpoint written by transformers (several files + index)."""
  return make_hf_checkpoint(str(tmp_path_factory.mktemp("sh") / "src"), "qwen3",
                            max_shard_size="40KB")


def _index(path):
  with open(os.path.join(path, INDEX_FILE)) as f:
    return json.load(f)


def _point(path, name, target):
  """Rewrites the index so tensor `name` (and its file's other tensors) map to `target`."""
  index = _index(path)
  old = index["weight_map"][name]
  index["weight_map"] = {k: (target if v == old else v) for k, v in index["weight_map"].items()}
  with open(os.path.join(path, INDEX_FILE), "w") as f:
    json.dump(index, f)
  return old


def test_index_entries_outside_the_checkpoint_are_refused(sharded_src, tmp_path):
  name = "model.layers.1.mlp.down_proj.weight"
  shard = _index(sharded_src)["weight_map"][name]
  outside = tmp_path / "outside"
  outside.mkdir()
  shutil.copy(os.path.join(sharded_src, shard), outside / "x.safetensors")  # a real file
  real_out = os.path.realpath(outside / "x.safetensors")
  cases = {"dotdot": "../outside/x.safetensors", "absolute": real_out,
           "symlink": "link.safetensors"}
  for case, target in cases.items():
    d = str(tmp_path / case)
    shutil.copytree(sharded_src, d)
    if case == "symlink":
      os.symlink(real_out, os.path.join(d, "link.safetensors"))
    _point(d, name, target)
    first = next(k for k, v in _index(d)["weight_map"].items() if v == target)
    _raises_exactly(f"{os.path.join(d, INDEX_FILE)}: weight_map entry {first!r} -> "
                    f"{target!r} resolves to {real_out}, outside the checkpoint directory "
                    f"{os.path.realpath(d)}", d)


def test_index_entries_in_subdirectories_and_the_hub_cache_load(sharded_src, tmp_path):
  """What the containment check must not refuse: a shard in a subdirectory, and a hub-cache
  snapshot whose files are symlinks into the repository's blobs/."""
  want = _params(from_pretrained(sharded_src))
  d = str(tmp_path / "subdir")
  shutil.copytree(sharded_src, d)
  name = "model.layers.1.mlp.down_proj.weight"
  os.makedirs(os.path.join(d, "shards"))
  old = _index(d)["weight_map"][name]
  os.replace(os.path.join(d, old), os.path.join(d, "shards", old))
  _point(d, name, f"shards/{old}")
  got = _params(from_pretrained(d))
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))

  repo = tmp_path / "hub" / "models--org--tiny"
  snap = repo / "snapshots" / "0123abcd"
  os.makedirs(repo / "blobs")
  os.makedirs(snap)
  for i, fn in enumerate(sorted(os.listdir(sharded_src))):
    blob = repo / "blobs" / f"blob{i}"
    shutil.copy(os.path.join(sharded_src, fn), blob)
    os.symlink(os.path.join("..", "..", "blobs", f"blob{i}"), snap / fn)
  got = _params(from_pretrained(str(snap)))
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))


def test_truncated_safetensors_is_named(ckpts, tmp_path):
  d = str(tmp_path / "trunc")
  shutil.copytree(ckpts["qwen2"], d)
  file = os.path.join(d, SINGLE_FILE)
  data = open(file, "rb").read()
  open(file, "wb").write(data[:len(data) // 2])
  _raises_exactly(f"{file}: not a readable safetensors file, truncated or corrupt (Error while "
                  "deserializing header: incomplete metadata, file not fully covered)", d)
  open(file, "wb").write(data[:4])
  _raises_exactly(f"{file}: not a readable safetensors file, truncated or corrupt (Error while "
                  "deserializing header: header too small)", d)


def test_index_naming_a_missing_file_is_named(sharded_src, tmp_path):
  d = str(tmp_path / "missing")
  shutil.copytree(sharded_src, d)
  shard = _index(d)["weight_map"]["model.norm.weight"]
  os.remove(os.path.join(d, shard))
  _raises_exactly(f"{os.path.join(d, shard)}: no such file (named by {INDEX_FILE})", d)
  with open(os.path.join(d, INDEX_FILE), "w") as f:
    f.write('{"weight_map": ')
  _raises_exactly(f"{os.path.join(d, INDEX_FILE)}: not valid JSON (line 1 column 16: "
                  "Expecting value)", d)


def test_config_json_missing_or_not_json_is_named(ckpts, tmp_path):
  d = str(tmp_path / "cfg")
  shutil.copytree(ckpts["qwen2"], d)
  cfg = os.path.join(d, "config.json")
  os.remove(cfg)
  _raises_exactly(f"{cfg}: no such file (a Hugging Face checkpoint directory needs "
                  "config.json)", d)
  with open(cfg, "w") as f:
    f.write("{'model_type': 'qwen2'}")
  _raises_exactly(f"{cfg}: not valid JSON (line 1 column 2: Expecting property name enclosed "
                  "in double quotes)", d)
  with open(cfg, "w") as f:
    f.write("[1, 2]")
  _raises_exactly(f"{cfg}: expected a JSON object, got list", d)
  _raises_exactly(f"{tmp_path / 'nope'}: no such checkpoint directory", str(tmp_path / "nope"))


def test_nan_weight_is_named(ckpts, tmp_path):
  name = "model.layers.1.mlp.down_proj.weight"

  def edit(t):
    t[name][3, 5] = np.nan
  bad = _rewrite(ckpts["qwen3_tied"], str(tmp_path / "nan"), edit)
  _raises_exactly(f"tensor {name!r} in {os.path.join(bad, SINGLE_FILE)} holds non-finite "
                  "weights (1 NaN, 0 Inf in the block read); refusing to load it", bad)


def test_inf_expert_weight_is_named_on_a_mesh(tmp_path):
  """bf16 MoE checkpoint, loaded sharded over 8 devices: the stacked-expert path names the
  expert's own tensor."""
  src = make_hf_checkpoint(str(tmp_path / "src"), "qwen3_moe", dtype=torch.bfloat16)
  name = "model.layers.0.mlp.experts.2.up_proj.weight"
  d = str(tmp_path / "inf")
  shutil.copytree(src, d)
  with safe_open(os.path.join(d, SINGLE_FILE), "pt") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  tensors[name][0, :2] = float("inf")
  from safetensors.torch import save_file as save_torch  # pylint: disable=g-import-not-at-top
  save_torch(tensors, os.path.join(d, SINGLE_FILE), metadata={"format": "pt"})
  mesh = shd.make_mesh({"fsdp": 2, "tensor": 4})
  with pytest.raises(CheckpointFileError,
                     match=re.escape(f"tensor {name!r} in {os.path.join(d, SINGLE_FILE)} holds "
                                     "non-finite weights (0 NaN, ") + r"\d+ Inf in the block "):
    from_pretrained(d, dtype=jnp.bfloat16, mesh=mesh)


def test_weights_overflowing_the_param_dtype_are_named(ckpts, tmp_path):
  name = "model.embed_tokens.weight"

  def edit(t):
    t[name][0, 0] = 1e5
  bad = _rewrite(ckpts["qwen3_tied"], str(tmp_path / "big"), edit)
  from_pretrained(bad)   # fine in float32
  _raises_exactly(f"tensor {name!r} in {os.path.join(bad, SINGLE_FILE)} holds values up to "
                  "1e+05, which overflow the parameter dtype float16; load with a wider "
                  "param_dtype", bad, param_dtype=jnp.float16)
