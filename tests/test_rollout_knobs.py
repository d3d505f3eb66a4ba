"""Rollout-side outputs and mismatch knobs: truncated sampling with logit noise replayed
exactly, kept top-k / full log-probs, bf16 sampling of an fp32 model, MoE router jitter."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trm_jax.kernels.visibility import Visibility
from model_fixtures import make_test_model
from trm_jax.rollout import CacheConfig, SamplingConfig, generate, run_phase, token_logprobs
from trm_jax.rollout.sampler import stream_keys
from trm_jax import rng
from trm_jax.rollout.sampling import row_noise

P, R = 8, 6
LENS = np.array([8, 3], np.int32)
KEY = jax.random.key(11)


def _prompts():
  ids = np.zeros((2, P), np.int32)
  for b, n in enumerate(LENS):
    ids[b, P - n:] = np.random.default_rng(b).integers(3, 128, n)
  return ids


@pytest.fixture(scope="module")
def model():
  return make_test_model(seed=5)


def test_noisy_truncated_sampling_is_replayed_exactly(model):
  kw = dict(temperature=0.8, top_k=40, top_p=0.9, logit_noise=0.5)
  r = generate(model, _prompts(), LENS, max_new_tokens=R, key=KEY, eos_ids=(),
               keep_topk_logprobs=3, keep_full_logprobs=True,
               cache=CacheConfig(policy="h2o", ratio=0.5), **kw)
  scfg = SamplingConfig(max_new_tokens=R, **kw)
  logits = model(r.tokens, visibility=Visibility(segment_ids=r.segment_ids,
                                                 evicted_at=r.evicted_at))
  # The sampler drew token i + 1 of row b from logits[b, i] + noise(b, i): keyed by the
  # row and the query index, nothing else.
  s_noise = rng.seed(stream_keys(KEY)[1])
  idx = np.arange(P - 1, P + R - 1)
  rows = jnp.arange(2, dtype=jnp.int32)
  noise = jnp.stack([row_noise(s_noise, rows, jnp.full((2,), i, jnp.int32), 128) for i in idx],
                    axis=1)                                               # [B, R, V]
  noisy = logits[:, idx] + 0.5 * noise
  want = token_logprobs(noisy, r.tokens[:, idx + 1], scfg)
  np.testing.assert_allclose(r.logp[:, P:], want, atol=1e-5, rtol=0)
  without = token_logprobs(logits[:, idx], r.tokens[:, idx + 1], scfg)
  assert float(jnp.abs(without - want).max()) > 1e-2                    # the noise mattered

  full = np.asarray(r.full_logp[:, P:])                                   # [B, R, V]
  np.testing.assert_allclose(jax.nn.logsumexp(full, axis=-1), 0.0, atol=1e-5)
  assert np.isneginf(full).any()                                          # truncation shows
  got = np.take_along_axis(full, np.asarray(r.tokens[:, P:, None]), axis=-1)[..., 0]
  np.testing.assert_allclose(got, r.logp[:, P:], atol=0, rtol=0)
  top = np.sort(full, axis=-1)[..., ::-1][..., :3]
  np.testing.assert_allclose(r.topk_logp[:, P:], top, atol=0, rtol=0)
  np.testing.assert_array_equal(
      np.take_along_axis(full, np.asarray(r.topk_ids[:, P:]), axis=-1), top)
  assert (np.asarray(r.full_logp[:, :P]) == 0).all()
  ent = -np.sum(np.exp(full) * np.where(np.isfinite(full), full, 0.0), axis=-1)
  np.testing.assert_allclose(r.stats.entropy[:, P:], ent, atol=1e-5)


def test_bf16_sampler_of_fp32_model_differs_slightly(model):
  r32 = generate(model, _prompts(), LENS, max_new_tokens=R, key=KEY, greedy=True, eos_ids=())
  r16 = generate(model, _prompts(), LENS, max_new_tokens=R, key=KEY, greedy=True, eos_ids=(),
                 compute_dtype=jnp.bfloat16)
  assert r16.stats.cache_bytes * 2 == r32.stats.cache_bytes
  # Score the bf16 rollout with the fp32 learner: a real but small mismatch.
  logits = model(r16.tokens, visibility=Visibility(segment_ids=r16.segment_ids))
  tf = token_logprobs(logits[:, P - 1:-1], r16.tokens[:, P:],
                      SamplingConfig(max_new_tokens=R, greedy=True))
  gap = float(jnp.abs(tf - r16.logp[:, P:]).max())
  assert 1e-4 < gap < 0.5
  assert model.config.dtype == "float32"                       # the model itself is untouched


def test_router_jitter_changes_moe_rollouts():
  moe = make_test_model(seed=2, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32)
  kw = dict(max_new_tokens=R, key=KEY, temperature=1.0, eos_ids=())
  a = generate(moe, _prompts(), LENS, router_noise_scale=0.0, **kw)
  b = generate(moe, _prompts(), LENS, router_noise_scale=1.0, **kw)
  assert np.isfinite(np.asarray(b.logp)).all()
  assert float(jnp.abs(a.logp - b.logp).max()) > 1e-3


def test_run_phase_halves_compose_to_generate(model):
  """The bench times `run_phase("decode")`; it must be the same computation as `generate`."""
  scfg = SamplingConfig(max_new_tokens=R, temperature=0.8, eos_ids=())
  cc = CacheConfig(policy="snapkv", ratio=0.5, window=2)
  graphdef, state = nnx.split(model)
  kw = dict(key=KEY, sampling_config=scfg, cache_config=cc)
  carry = run_phase("prefill", graphdef, state, _prompts(), LENS, **kw)
  r = run_phase("decode", graphdef, state, _prompts(), LENS, carry=carry, **kw)
  g = generate(model, _prompts(), LENS, max_new_tokens=R, key=KEY, temperature=0.8,
               eos_ids=(), cache=cc)
  np.testing.assert_array_equal(r.tokens, g.tokens)
  np.testing.assert_array_equal(r.evicted_at, g.evicted_at)
  np.testing.assert_allclose(r.logp, g.logp, atol=1e-6, rtol=0)
  with pytest.raises(ValueError, match="carry"):
    run_phase("decode", graphdef, state, _prompts(), LENS, **kw)
