"""Flax NNX decoders (Qwen3, Qwen2, Llama, Qwen3-MoE) and Hugging Face checkpoint import/export.

  model = from_pretrained(path, dtype=jnp.float32, param_dtype=None, mesh=None, rules=None)
  logits = model(tokens)                       # [B, T] int32 -> [B, T, V] float32
  h, caches = model.prefill(prompt, policy)    # cached decoding; `KVCache`, `CachePolicy`
  h, caches = model.decode_step(tok, caches, policy, positions=pos, index=i)
  save_pretrained(model, out_dir)              # config.json + safetensors for transformers
"""
from trm_jax.models.config import FAMILIES, SUPPORTED_MODEL_TYPES, Family, ModelConfig
from trm_jax.models.decoder import Decoder, abstract_model, default_positions
from trm_jax.models.hf_io import from_pretrained, save_pretrained
from trm_jax.models.kv_cache import CachePolicy, KVCache
from trm_jax.models.protocol import CausalLM

__all__ = ["FAMILIES", "SUPPORTED_MODEL_TYPES", "CachePolicy", "CausalLM", "Decoder", "Family",
           "KVCache", "ModelConfig",
           "abstract_model", "default_positions", "from_pretrained", "save_pretrained"]
