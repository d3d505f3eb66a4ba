"""Checkpoint export/import: round trips through transformers, sharded files, strict errors."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from hf_fixtures import hf_logits, make_hf_checkpoint, sample_batch
from trm_jax.kernels import Visibility
from trm_jax.models import from_pretrained, make_test_model, save_pretrained
from trm_jax.models.hf_io import INDEX_FILE, SINGLE_FILE, CheckpointMismatchError

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
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    from_pretrained(d)


def test_non_float_tensor_is_named(ckpts, tmp_path):
  name = "model.norm.weight"

  def edit(t):
    t[name] = t[name].astype(np.int32)
  bad = _rewrite(ckpts["qwen3_tied"], str(tmp_path / "bad"), edit)
  with pytest.raises(CheckpointMismatchError, match=f"'{name}' has dtype I32"):
    from_pretrained(bad)
