"""ModelConfig parsing of HF config.json dicts: both RoPE spellings, quirks, strict errors."""
import jax.numpy as jnp
import numpy as np
import pytest

from hf_fixtures import make_hf_config
from trm_jax.models import SUPPORTED_MODEL_TYPES, ModelConfig
from trm_jax.models.layers import rope_inv_freq

BASE = dict(model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def test_rope_theta_top_level_and_rope_parameters_agree():
  old = ModelConfig.from_hf({**BASE, "rope_theta": 1e6})
  new = ModelConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "default",
                                                          "rope_theta": 1e6}})
  assert old.rope_theta == new.rope_theta == 1e6
  assert old == new


def test_llama3_rope_scaling_old_spelling_equals_transformers5():
  scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                 original_max_position_embeddings=64)
  old = ModelConfig.from_hf({**BASE, "model_type": "llama", "rope_theta": 500000.0,
                             "rope_scaling": {"rope_type": "llama3", **scaling}})
  new = ModelConfig.from_hf({**BASE, "model_type": "llama", "rope_parameters": {
      "rope_type": "llama3", "rope_theta": 500000.0, **scaling}})
  assert old == new and new.rope_type == "llama3" and new.rope_factor == 8.0
  default = new.replace(rope_type="default")
  inv, inv0 = rope_inv_freq(new), rope_inv_freq(default)
  # highest frequency untouched, lowest stretched by exactly `factor`
  assert inv[0] == inv0[0]
  np.testing.assert_allclose(inv[-1], inv0[-1] / 8.0, rtol=1e-6)


def test_qwen2_has_qkv_bias_even_when_config_says_null():
  cfg = ModelConfig.from_hf({**BASE, "model_type": "qwen2", "attention_bias": None})
  assert cfg.qkv_bias and not cfg.o_bias and not cfg.qk_norm


def test_qwen3_moe_reads_num_local_experts_written_by_transformers5():
  hf = make_hf_config("qwen3_moe").to_dict()
  assert "num_local_experts" in hf  # what transformers 5.24 writes, not num_experts
  cfg = ModelConfig.from_hf(hf)
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
  assert cfg.is_moe_layer(0) and not cfg.is_moe_layer(1)  # mlp_only_layers=[1]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_tied", "qwen2", "llama3", "qwen3_moe"])
def test_to_hf_round_trips(arch):
  cfg = ModelConfig.from_hf(make_hf_config(arch).to_dict())
  assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_dtypes_are_separate():
  cfg = ModelConfig.from_hf(BASE, dtype=jnp.bfloat16, param_dtype=jnp.float32)
  assert cfg.compute_dtype == jnp.bfloat16 and cfg.weight_dtype == jnp.float32


def test_unsupported_model_type_lists_supported():
  with pytest.raises(ValueError) as e:
    ModelConfig.from_hf({**BASE, "model_type": "gpt2"})
  assert "'gpt2'" in str(e.value)
  for t in SUPPORTED_MODEL_TYPES:
    assert t in str(e.value)


@pytest.mark.parametrize("key,value,needle", [
    ("hidden_act", "gelu", "hidden_act"),
    ("use_sliding_window", True, "use_sliding_window"),
    ("mlp_bias", True, "mlp_bias"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}, "yarn"),
])
def test_unsupported_options_raise_naming_the_key(key, value, needle):
  with pytest.raises(ValueError, match=needle):
    ModelConfig.from_hf({**BASE, key: value})


def test_missing_required_key_is_named():
  hf = dict(BASE)
  del hf["vocab_size"]
  with pytest.raises(ValueError, match="'vocab_size'"):
    ModelConfig.from_hf(hf)


def test_attention_flags_follow_model_type_and_must_agree():
  assert (ModelConfig(model_type="qwen2").qkv_bias, ModelConfig(model_type="qwen2").o_bias) == (
      True, False)
  assert not ModelConfig(model_type="llama").qk_norm and ModelConfig(model_type="qwen3").qk_norm
  assert ModelConfig(model_type="llama", qkv_bias=True).o_bias  # one attention_bias flag
  with pytest.raises(ValueError, match="qk_norm=True is not a llama architecture"):
    ModelConfig(model_type="llama", qk_norm=True)
  with pytest.raises(ValueError, match="o_bias=False is not a qwen3 architecture"):
    ModelConfig(model_type="qwen3", qkv_bias=True, o_bias=False)


def test_the_abstract_model_walks_no_traced_program(monkeypatch):
  """Building a model's shapes under `nnx.eval_shape` with `nnx.Rngs` read the traced draw
  counter's `sharding` at every parameter, an error message JAX builds by walking every
  equation traced so far: quadratic in the layer count (25 / 100 / 200 layers took 1.4 / 21 /
  69 s). `abstract_model` builds the same shapes and walks nothing."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jax._src.interpreters import partial_eval as pe  # pylint: disable=g-import-not-at-top
  from trm_jax.models import Decoder, abstract_model  # pylint: disable=g-import-not-at-top
  walks = []
  walk = pe.JaxprStackFrame.find_progenitors
  monkeypatch.setattr(pe.JaxprStackFrame, "find_progenitors",
                      lambda self, t: walks.append(1) or walk(self, t))
  cfg = ModelConfig.from_hf({**BASE, "num_hidden_layers": 3})
  got = nnx.state(abstract_model(Decoder, cfg))
  assert walks == []
  want = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
  assert len(walks) > 3 * 7          # the old way: a walk per parameter
  shapes = lambda s: jax.tree.map(lambda x: (x.shape, x.dtype), s)
  assert shapes(got) == shapes(want)
