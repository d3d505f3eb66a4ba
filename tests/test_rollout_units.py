"""Pure parts of the rollout engine: sampling distributions, budgets, cache layout, eviction.

No model here: small arrays, exact expectations.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trm_jax.kernels.visibility import NEVER_EVICTED
from trm_jax.models import kv_cache
from trm_jax.rollout import CacheConfig, SamplingConfig, sampled_logprobs, token_logprobs
from trm_jax.rollout import cache as kv
from trm_jax.rollout import eviction, policies, sampling


# ----------------------------------------------------------------------------- sampling
def _np_truncated(logits, temperature, top_k, top_p):
  """Brute-force reference: keep the top_k, then the shortest prefix with mass >= top_p."""
  x = logits / temperature
  order = np.argsort(-x, kind="stable")
  keep = np.zeros_like(x, bool)
  k = len(x) if top_k == 0 else top_k
  p = np.exp(x[order[:k]] - x[order[:k]].max())
  p /= p.sum()
  mass = 0.0
  for r, j in enumerate(order[:k]):
    if r > 0 and mass >= top_p:
      break
    keep[j] = True
    mass += p[r]
  y = np.where(keep, x, -np.inf)
  return y - (np.log(np.sum(np.exp(y[keep] - y[keep].max()))) + y[keep].max())


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.8, 7, 0.6), (1.0, 0, 0.05)])
def test_sampled_logprobs_match_bruteforce(temperature, top_k, top_p):
  logits = np.random.default_rng(0).normal(size=(4, 32)).astype(np.float32) * 2
  cfg = SamplingConfig(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
  got = np.asarray(sampled_logprobs(jnp.asarray(logits), cfg))
  for b in range(4):
    want = _np_truncated(logits[b].astype(np.float64), temperature, top_k, top_p)
    assert np.array_equal(np.isfinite(got[b]), np.isfinite(want))
    np.testing.assert_allclose(got[b][np.isfinite(want)], want[np.isfinite(want)], atol=1e-5)


def test_truncation_keeps_all_ties_and_greedy_reports_model_logprobs():
  logits = jnp.array([[3.0, 1.0, 1.0, 1.0, -2.0]])
  d = sampled_logprobs(logits, SamplingConfig(max_new_tokens=1, top_k=2))
  assert np.isfinite(np.asarray(d)).tolist() == [[True, True, True, True, False]]
  g = SamplingConfig(max_new_tokens=1, greedy=True, temperature=0.5, top_k=1)
  tok, logp, dist = sampling.sample(jax.random.key(0), logits, g)
  assert int(tok[0]) == 0
  np.testing.assert_allclose(dist, jax.nn.log_softmax(logits), rtol=0, atol=0)
  np.testing.assert_allclose(logp, token_logprobs(logits, tok, g), rtol=0, atol=0)


def test_sample_frequencies_follow_the_reported_distribution():
  logits = jnp.tile(jnp.array([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]), (40_000, 1))
  cfg = SamplingConfig(max_new_tokens=1, temperature=0.8, top_p=0.9)
  tok, logp, dist = jax.jit(lambda k, x: sampling.sample(k, x, cfg))(jax.random.key(3), logits)
  freq = np.bincount(np.asarray(tok), minlength=6) / tok.shape[0]
  np.testing.assert_allclose(freq, np.exp(np.asarray(dist[0])), atol=0.01)
  assert freq[-1] == 0 and np.isneginf(np.asarray(dist[0, -1]))     # truncated: never drawn
  np.testing.assert_allclose(logp, dist[0][tok], rtol=0, atol=0)


@pytest.mark.parametrize("kw,name", [
    (dict(temperature=0.0), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(logit_noise=-1.0), "logit_noise")])
def test_sampling_config_rejects_bad_values(kw, name):
  with pytest.raises(ValueError, match=name):
    SamplingConfig(**{"max_new_tokens": 4, **kw})


@pytest.mark.parametrize("kw,name", [
    (dict(policy="lru"), "policy"), (dict(policy="h2o"), "ratio"),
    (dict(policy="h2o", ratio=0.5, capacity=4), "capacity"),
    (dict(policy="h2o", ratio=1.0), "ratio"),
    (dict(policy="snapkv", ratio=0.5, scope="sequence"), "scope"),
    (dict(policy="snapkv", ratio=0.5, kernel=4), "kernel"), (dict(ratio=0.5), "none")])
def test_cache_config_rejects_bad_values(kw, name):
  with pytest.raises(ValueError, match=name):
    CacheConfig(**kw)


# ----------------------------------------------------------------------------- budgets
def test_budgets_and_slot_counts():
  snap = CacheConfig(policy="snapkv", ratio=0.7)
  assert kv.keep_count(10, snap) == 3 and kv.keep_count(11, snap) == 4   # ceil(0.3 n)
  assert kv.prompt_slots(snap, 16, 8) == 5 and kv.num_slots(snap, 16, 8) == 5 + 7
  keep, budget = kv.row_budgets(snap, jnp.array([16, 10, 1]), 16, 8)
  assert keep.tolist() == [5, 3, 1]
  h2o = CacheConfig(policy="h2o", ratio=0.5)
  assert kv.num_slots(h2o, 16, 8) == 12                                  # ceil(0.5 * 24)
  keep, budget = kv.row_budgets(h2o, jnp.array([16, 10, 1]), 16, 8)
  assert budget.tolist() == [12, 9, 5] and keep.tolist() == [12, 9, 1]
  cap = CacheConfig(policy="recent", capacity=100)
  assert kv.num_slots(cap, 16, 8) == 23                                  # never above P+N-1
  assert kv.num_slots(CacheConfig(), 16, 8) == 23


# ----------------------------------------------------------------------------- cache
def test_from_prompt_right_aligns_kept_keys():
  B, P, K, H = 1, 6, 2, 1
  k = jnp.arange(P, dtype=jnp.float32)[None, :, None, None] * jnp.ones((B, P, K, H))
  keep = jnp.array([[[0, 1, 0, 1, 1, 0], [1, 0, 0, 0, 0, 1]]], bool)
  c = kv.from_prompt(k, k, keep, jnp.zeros((B, K, P)), num_prompt_slots=3, num_total_slots=5)
  assert c.pos.tolist() == [[[1, 3, 4, -1, -1], [-1, 0, 5, -1, -1]]]
  assert c.k[0, 0, 0, :3].tolist() == [1.0, 3.0, 4.0]                  # k is [B, K, H, C]
  c = kv_cache.write(c, jnp.int32(3), jnp.full((B, K, H), 9.0), jnp.full((B, K, H), 9.0),
                     jnp.int32(6))
  assert c.pos[0, :, 3].tolist() == [6, 6] and c.k[0, 1, 0, 3] == 9.0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("slot", [5, [[1, 8], [0, 7], [11, 2]]], ids=["scalar", "per_row"])
def test_cache_write_puts_the_same_bits_in_every_dtype(dtype, slot):
  """16-bit caches are written through their uint16 bits (`kv_cache._update`): every dtype
  gets the new key and value bitwise at their slot, a slot >= C drops the row's write, and
  every other slot keeps its bits."""
  B, K, H, C = 3, 2, 4, 8
  r = np.random.default_rng(0)
  c = kv_cache.empty(B, K, H, C, 10, dtype, keeps_score=False, never=10)
  c = c.replace(k=jnp.asarray(r.normal(size=c.k.shape), dtype),
                v=jnp.asarray(r.normal(size=c.v.shape), dtype))
  kn, vn = (jnp.asarray(r.normal(size=(B, K, H)), dtype) for _ in range(2))
  got = jax.jit(kv_cache.write)(c, jnp.asarray(slot, jnp.int32), kn, vn, jnp.int32(4))
  k, v = np.array(c.k.astype(jnp.float32)), np.array(c.v.astype(jnp.float32))
  for (b, h), s in np.ndenumerate(np.broadcast_to(np.asarray(slot), (B, K))):
    if s < C:
      k[b, h, :, s], v[b, h, s] = np.asarray(kn[b, h], np.float32), np.asarray(vn[b, h], np.float32)
  assert got.k.dtype == got.v.dtype == jnp.dtype(dtype)
  np.testing.assert_array_equal(np.asarray(got.k.astype(jnp.float32)), k)
  np.testing.assert_array_equal(np.asarray(got.v.astype(jnp.float32)), v)


def _cache(pos, score, T):
  pos = jnp.asarray(pos, jnp.int32)[None, None]                          # [1, 1, C]
  C = pos.shape[-1]
  z = jnp.zeros((1, 1, C, 1))
  return kv_cache.KVCache(k=jnp.zeros((1, 1, 1, C)), v=z, pos=pos,
                          score=jnp.asarray(score, jnp.float32)[None, None],
                          evicted_at=jnp.full((1, 1, T), NEVER_EVICTED, jnp.int32))


@pytest.mark.parametrize("policy,extra,pos,score,victim", [
    # recent: sinks (first 2 valid tokens, start=1 -> indices 1, 2) stay; the oldest other goes.
    ("recent", dict(sinks=2), [5, 1, 2, 3, 4], [0] * 5, 3),
    # h2o: budget 5 -> 2 recent keys (>= step - 2 = 8) protected; lowest score among the rest;
    # tie between indices 3 and 6 (score 0.1) resolved to the older.
    ("h2o", dict(recent_frac=0.4), [6, 3, 9, 8, 2], [0.1, 0.1, 0.0, 0.0, 0.5], 3),
])
def test_evict_picks_the_documented_victim(policy, extra, pos, score, victim):
  cfg = CacheConfig(policy=policy, capacity=5, **extra)
  c = _cache(pos, score, 12)
  c2, slot = eviction.evict(cfg, c, layer=1, step=10, start=jnp.array([1]),
                            budget=jnp.array([5]), prompt_len=6)
  assert int(c.pos[0, 0, slot[0, 0]]) == victim and int(c2.pos[0, 0, slot[0, 0]]) == -1
  ev2 = np.asarray(c2.evicted_at)
  assert ev2[0, 0, victim] == 10 and (ev2 == 10).sum() == 1


def test_evict_uses_an_empty_slot_below_budget():
  cfg = CacheConfig(policy="h2o", capacity=5)
  c = _cache([4, -1, 2, -1, 3], [1, 0, 1, 0, 1], 8)
  c2, slot = eviction.evict(cfg, c, layer=0, step=5, start=jnp.array([2]),
                            budget=jnp.array([5]), prompt_len=5)
  assert int(slot[0, 0]) == 1 and (np.asarray(c2.evicted_at) == NEVER_EVICTED).all()
  assert np.array_equal(c2.pos, c.pos)


def test_random_priorities_are_fresh_per_step_and_slot_independent():
  key = jax.random.key(0)
  pos = jnp.array([[[3, 7, 5]]], jnp.int32)
  a = policies.random_priority(key, 0, 10, pos)
  b = policies.random_priority(key, 0, 10, pos[..., ::-1])
  np.testing.assert_array_equal(a, b[..., ::-1])                     # depends on index, not slot
  assert not np.array_equal(a, policies.random_priority(key, 0, 11, pos))
  assert not np.array_equal(a, policies.random_priority(key, 1, 10, pos))
  u = policies.random_priority(key, 0, 3, jnp.arange(20_000, dtype=jnp.int32)[None, None])
  assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01


def test_snapkv_keeps_window_and_pooled_heavy_hitters():
  # One row, one head, P = 8, window 2 (indices 6, 7), kernel 1 (no pooling): the two prefix
  # keys with the largest window attention stay.
  cfg = CacheConfig(policy="snapkv", capacity=4, window=2, kernel=1)
  score = jnp.array([[[0.1, 0.5, 0.0, 0.05, 0.3, 0.2, 0.0, 0.0]]])
  valid = jnp.ones((1, 8), bool)
  kept = eviction.select_prompt(cfg, valid, score, jnp.array([4]), start=jnp.array([0]),
                                budget=jnp.array([11]), layer=0, rand_key=None)
  assert np.flatnonzero(np.asarray(kept[0, 0])).tolist() == [1, 4, 6, 7]
