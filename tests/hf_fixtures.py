"""Tiny random Hugging Face checkpoints written by transformers itself, and torch reference logits.

The only place (with the tests) that imports torch. Checkpoints are real `save_pretrained`
output, so the loader is tested against the files transformers actually writes (e.g. Qwen3-MoE
experts stored per index, `num_local_experts` in config.json).

Weights are re-drawn with a larger scale than transformers' init (std 0.02 would make every
logit ~0 and parity trivially true): matrices N(0, 0.15^2), norm weights 1 + N(0, 0.1^2),
biases N(0, 0.1^2). Logits then have O(1) spread and a wrong wiring shows up as O(1) errors.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch
import transformers

ARCHS = ("qwen3", "qwen3_tied", "qwen2", "llama3", "qwen3_moe")

_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
               max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)

_ARCH = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3_tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    # original_max_position_embeddings = 64 puts the H=16 frequencies in all three llama3
    # bands (kept, interpolated, stretched), so every branch of the scaling is exercised.
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=64))),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[1])),
}


def make_hf_config(arch: str, **config_overrides):
  if arch not in _ARCH:
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
  config_cls, _, extra = _ARCH[arch]
  kw = {**_COMMON, **extra, **config_overrides}
  return getattr(transformers, config_cls)(**kw)


def make_hf_model(arch: str, *, seed: int = 0, **config_overrides):
  """A seeded random transformers model (fp32, eager attention) with O(1) logits."""
  _, model_cls, _ = _ARCH[arch]
  config = make_hf_config(arch, **config_overrides)
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = getattr(transformers, model_cls)(config).eval()
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in sorted(model.named_parameters()):
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      if "norm" in name:
        p.copy_(1.0 + 0.1 * noise)
      elif name.endswith("bias"):
        p.copy_(0.1 * noise)
      else:
        p.copy_(0.15 * noise)
  return model


def make_hf_checkpoint(path: str, arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                       max_shard_size: Optional[str] = None, **config_overrides) -> str:
  """Writes a tiny random checkpoint with transformers' `save_pretrained`; returns `path`.

  arch in ARCHS; `dtype` is the stored dtype (fp32 or bf16); `max_shard_size` (e.g. "20KB")
  makes transformers write a sharded checkpoint with `model.safetensors.index.json`.
  """
  model = make_hf_model(arch, seed=seed, **config_overrides).to(dtype)
  kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  model.save_pretrained(path, **kw)
  return str(path)


def sample_batch(B: int = 3, T: int = 12, vocab: int = 128, seed: int = 0):
  """tokens [B, T] int32 and right-padding attention_mask [B, T] int32 (row b has T - 3b)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, vocab, size=(B, T)).astype(np.int32)
  lengths = np.maximum(T - 3 * np.arange(B), 1)
  mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int32)
  return np.where(mask == 1, tokens, 0).astype(np.int32), mask


def load_hf_model(path: str, dtype: torch.dtype = torch.float32):
  model = transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=dtype, attn_implementation="eager")
  return model.eval()


def hf_logits(path_or_model, tokens: np.ndarray, attention_mask: Optional[np.ndarray] = None,
              dtype: torch.dtype = torch.float32) -> np.ndarray:
  """Reference logits [B, T, V] as float32 numpy from transformers (torch, CPU)."""
  model = (load_hf_model(os.fspath(path_or_model), dtype)
           if isinstance(path_or_model, (str, os.PathLike)) else path_or_model)
  ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
  mask = None if attention_mask is None else torch.as_tensor(np.asarray(attention_mask),
                                                             dtype=torch.long)
  with torch.no_grad():
    out = model(input_ids=ids, attention_mask=mask)
  return out.logits.float().numpy()


def hf_greedy(path_or_model, tokens: np.ndarray, max_new_tokens: int,
              attention_mask: Optional[np.ndarray] = None) -> np.ndarray:
  """transformers greedy decoding: [B, T] prompts (left-padded if masked) -> [B, T + n] int32.

  Generation runs exactly `max_new_tokens` steps (EOS does not stop it), so rows align.
  """
  model = (load_hf_model(os.fspath(path_or_model))
           if isinstance(path_or_model, (str, os.PathLike)) else path_or_model)
  ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
  mask = (torch.ones_like(ids) if attention_mask is None
          else torch.as_tensor(np.asarray(attention_mask), dtype=torch.long))
  with torch.no_grad():
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         pad_token_id=model.config.pad_token_id)
  return out.numpy().astype(np.int32)
