"""Parity with transformers (torch, CPU) on tiny random checkpoints written by save_pretrained."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from hf_fixtures import (ARCHS, hf_greedy, hf_logits, load_hf_model, make_hf_checkpoint,
                         sample_batch)
from trm_jax.kernels import Visibility
from trm_jax.models import from_pretrained

TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp("ckpt")
  return {arch: make_hf_checkpoint(str(root / arch), arch) for arch in ARCHS}


@nnx.jit
def _forward(model, tokens, segment_ids):
  return model(tokens, visibility=Visibility(segment_ids=segment_ids))


def _ours(model, tokens, mask):
  # jit: op-by-op eager dispatch compiles every primitive separately (10x slower on CPU).
  return np.asarray(_forward(model, jnp.asarray(tokens), jnp.asarray(mask)))


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_parity_with_right_padding(checkpoints, arch):
  tokens, mask = sample_batch(B=3, T=12)
  assert mask.sum(1).tolist() == [12, 9, 6]  # the batch really is padded
  ref = hf_logits(checkpoints[arch], tokens, mask)
  out = _ours(from_pretrained(checkpoints[arch]), tokens, mask)
  valid = mask.astype(bool)
  assert out.dtype == np.float32 and out.shape == ref.shape
  assert ref[valid].std() > 0.5  # logits are O(1): a wiring error could not hide below TOL
  np.testing.assert_array_less(np.abs(out - ref)[valid].max(), TOL)


def test_left_padding_matches_unpadded(checkpoints):
  """Default positions count valid tokens, so a left-padded row equals the same row unpadded."""
  model = from_pretrained(checkpoints["qwen3"])
  tokens, _ = sample_batch(B=1, T=8, seed=3)
  pad = 3
  padded = np.concatenate([np.zeros((1, pad), np.int32), tokens], axis=1)
  vis = Visibility.from_lengths(jnp.array([8]), 8 + pad, left_pad=True)
  out = _ours(model, padded, vis.segment_ids)[:, pad:]
  ref = _ours(model, tokens, np.ones_like(tokens))
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)


def test_bf16_checkpoint_matches_torch_bf16(tmp_path):
  """A bf16 checkpoint run in bf16 agrees with transformers in bf16 to bf16 precision."""
  path = make_hf_checkpoint(str(tmp_path / "bf16"), "qwen3_tied", dtype=torch.bfloat16)
  tokens, mask = sample_batch(B=2, T=10)
  valid = mask.astype(bool)
  ref16 = hf_logits(path, tokens, mask, dtype=torch.bfloat16)
  ref32 = hf_logits(path, tokens, mask, dtype=torch.float32)
  model = from_pretrained(path, dtype=jnp.bfloat16)
  assert model.embed.embedding[...].dtype == jnp.bfloat16
  out = _ours(model, tokens, mask)
  # Two bf16 implementations differ by rounding order; the bound is a few bf16 ulps of the
  # logit scale (2^-8 relative), and both must stay as close to the fp32 result as torch is.
  scale = np.abs(ref32[valid]).max()
  ours_err = np.abs(out - ref32)[valid].max()
  torch_err = np.abs(ref16 - ref32)[valid].max()
  assert np.abs(out - ref16)[valid].max() < 8 * 2**-8 * scale
  assert ours_err < 2 * torch_err + 2**-8 * scale
  # And the fp32 load of the same bf16 file matches torch fp32 exactly up to TOL.
  out32 = _ours(from_pretrained(path), tokens, mask)
  np.testing.assert_array_less(np.abs(out32 - ref32)[valid].max(), TOL)


def test_moe_parity_without_topk_renormalisation_with_attention_bias(tmp_path):
  """norm_topk_prob=False, every layer sparse, top-3, and q/k/v/o biases (attention_bias)."""
  path = make_hf_checkpoint(str(tmp_path / "moe"), "qwen3_moe", norm_topk_prob=False,
                            mlp_only_layers=[], num_experts_per_tok=3, attention_bias=True)
  tokens, mask = sample_batch(B=2, T=9)
  ref = hf_logits(path, tokens, mask)
  out = _ours(from_pretrained(path), tokens, mask)
  np.testing.assert_array_less(np.abs(out - ref)[mask.astype(bool)].max(), TOL)


def test_hf_model_really_is_the_fixture_arch(checkpoints):
  """Guards the fixtures: each checkpoint exercises the feature it is named after."""
  qwen2 = load_hf_model(checkpoints["qwen2"])
  assert qwen2.model.layers[0].self_attn.q_proj.bias is not None
  llama = load_hf_model(checkpoints["llama3"])
  assert llama.config.rope_parameters["rope_type"] == "llama3"
  moe = load_hf_model(checkpoints["qwen3_moe"])
  assert type(moe.model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"
  assert type(moe.model.layers[1].mlp).__name__ == "Qwen3MoeMLP"
  tied = load_hf_model(checkpoints["qwen3_tied"])
  assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()


def test_hf_greedy_continuation_is_our_argmax(checkpoints):
  """Teacher-forced check of the greedy helper the rollout tests use: every token transformers
  generated (left-padded prompts, KV cache) is our argmax at the position before it."""
  path = checkpoints["qwen3_moe"]
  prompts, _ = sample_batch(B=2, T=6, seed=5)
  mask = np.ones_like(prompts)
  mask[1, :2] = 0                                      # row 1: 4-token prompt, left-padded
  prompts = np.where(mask == 1, prompts, 0)
  n = 5
  seq = hf_greedy(path, prompts, n, attention_mask=mask)
  assert seq.shape == (2, 6 + n)
  seg = np.concatenate([mask, np.ones((2, n), np.int32)], axis=1)
  logits = _ours(from_pretrained(path), seq, seg)
  np.testing.assert_array_equal(np.argmax(logits[:, 5:-1], axis=-1), seq[:, 6:])
