"""SMD exactness of compressed-cache rollouts, and a brute-force check of `evicted_at`.

For every registered eviction policy (`rollout.policies.POLICIES`) at 50% and 70%
compression, on prompts of mixed lengths:
  1. the rollout's logp equals a teacher-forced forward of
     `model(tokens, visibility=Visibility(segment_ids, evicted_at))` to 1e-5 (fp32);
  2. `evicted_at` equals a step-by-step re-simulation in plain numpy (Python sets and sorted
     tuples, no slots), driven by the attention probabilities of that teacher-forced forward
     (for the policies `resimulate` knows: a new policy adds its ranking there).

Why one forward suffices for (2): the decision at query i uses attention of queries < i only,
whose visibility depends only on evictions at steps < i. Walking the steps in order, the first
wrong entry of the sampler's record would be reported at the step where it was made, before
any probability it influenced is used.
"""
import functools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trm_jax.kernels.visibility import NEVER_EVICTED, Visibility, visible_mask
from prompt_fixtures import left_padded_prompts
from model_fixtures import make_test_model
from trm_jax.models.decoder import default_positions
from trm_jax.rollout import CacheConfig, SamplingConfig, generate, token_logprobs
from trm_jax.rollout import policies
from trm_jax.rollout.sampler import stream_keys

P, R = 16, 12
LENS = np.array([16, 9, 5, 12], np.int32)
TEMPERATURE = 0.9
KEY = jax.random.key(7)

SETTINGS = {   # per-policy settings of the tests (a policy not named here: its defaults)
    "snapkv": dict(policy="snapkv", window=4, kernel=3),
    "h2o": dict(policy="h2o", recent_frac=0.5),
    "recent": dict(policy="recent", sinks=2),
    "random": dict(policy="random"),
    "recent_prompt": dict(policy="recent", sinks=2, scope="prompt"),
}
RESIMULATED = ("snapkv", "h2o", "recent", "random")


@pytest.fixture(scope="module")
def model():
  return make_test_model(seed=3)


@pytest.fixture(scope="module")
def prompts():
  return left_padded_prompts(LENS, P)


@pytest.fixture(scope="module")
def forward_probs(model):
  """jitted teacher-forced forward returning logits and per-layer attention probabilities."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, tokens, segment_ids, evicted_at):
    m = nnx.merge(graphdef, state)
    vis = Visibility(segment_ids=segment_ids, evicted_at=evicted_at)
    logits = m(tokens, visibility=vis)
    positions = default_positions(tokens, vis)
    x = m.embed(tokens)
    B, T = tokens.shape
    probs = []
    for l, layer in enumerate(m.layers):
      q, k, v = layer.attn.qkv(layer.input_norm(x), positions)
      K, H = k.shape[2], k.shape[3]
      qg = q.reshape(B, T, K, -1, H)
      s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32) * H**-0.5
      mask = visible_mask(vis.layer(l), B, K, T)[:, :, None]
      s = jnp.where(mask, s, -jnp.inf)
      mx = jnp.max(s, axis=-1, keepdims=True)
      p = jnp.exp(s - jnp.where(jnp.isfinite(mx), mx, 0.0))
      p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
      probs.append(p)
      o = jnp.einsum("BKGTS,BSKH->BTKGH", p, v).reshape(q.shape)
      x = x + layer.attn.out(o)
      x = x + layer.mlp(layer.post_attn_norm(x))
    return logits, jnp.stack(probs, axis=1)              # [B, L, K, G, T, S]

  return lambda *a: run(state, *a)


def _keep(n, cc):
  """ceil((1 - ratio) * n) in exact rational arithmetic, or min(capacity, n); at least 1."""
  if cc.capacity is not None:
    return min(cc.capacity, n)
  return max(1, math.ceil((1 - Fraction(str(cc.ratio))) * n))


def resimulate(cc, probs, lens, decode_steps, rand):
  """Plain-numpy re-derivation of evicted_at [B, L, K, T] from the policy's definition."""
  B, L, K, _, T, _ = probs.shape
  ev = np.full((B, L, K, T), NEVER_EVICTED, np.int64)
  scope = cc.resolved_scope
  C = min(_keep(P + R, cc), P + R - 1)
  w = min(cc.window, P)
  for b, l, h in np.ndindex(B, L, K):
    n = int(lens[b])
    start = P - n
    pm = probs[b, l, h].astype(np.float64).sum(0)     # [T(query), T(key)] summed over G
    if scope == "prompt":
      keep, budget = min(_keep(n, cc), n), None
    else:
      budget = min(_keep(n + R, cc), C)
      keep = min(n, budget)
    pooled = None
    if cc.policy == "snapkv":
      s = np.array([pm[P - w:P, j].sum() if start <= j < P - w else 0.0 for j in range(P)])
      r = cc.kernel // 2
      win = [s[max(0, j - r):j + r + 1] for j in range(P)]
      pooled = [max(x) if cc.pooling == "max" else sum(x) / cc.kernel for x in win]

    def rank(j, i):
      if cc.policy == "snapkv":
        return (j >= P - w, pooled[j], j)
      if cc.policy == "h2o":
        recent = int(budget * Fraction(str(cc.recent_frac)))
        return (j >= i - recent, pm[:i, j].sum(), j)
      if cc.policy == "recent":
        return (j < start + cc.sinks, j, j)
      return (False, float(rand(l, i)[b, h, j]), j)

    order = sorted(range(start, P), key=lambda j: rank(j, P))
    for j in order[:n - keep]:
      ev[b, l, h, j] = P
    held = set(order[n - keep:])
    for i in range(P, P + decode_steps):
      if budget is not None and len(held) >= budget:
        victim = min(held, key=lambda j: rank(j, i))
        ev[b, l, h, victim] = i
        held.remove(victim)
      held.add(i)
  return ev


CASES = [(name, ratio) for name in sorted(policies.POLICIES) for ratio in (0.5, 0.7)]
CASES.append(("recent_prompt", 0.5))   # a decode-time policy used as prompt-only selection


@pytest.mark.parametrize("name,ratio", CASES)
def test_logp_exact_and_evicted_at_resimulated(model, prompts, forward_probs, name, ratio):
  cc = CacheConfig(ratio=ratio, **SETTINGS.get(name, dict(policy=name)))
  r = generate(model, prompts, LENS, max_new_tokens=R, key=KEY, temperature=TEMPERATURE,
               eos_ids=(), cache=cc)
  logits, probs = forward_probs(r.tokens, r.segment_ids, r.evicted_at)
  scfg = SamplingConfig(max_new_tokens=R, temperature=TEMPERATURE)
  tf = np.asarray(token_logprobs(logits[:, :-1], r.tokens[:, 1:], scfg))
  mask = np.asarray(r.response_mask[:, 1:]) == 1
  assert mask.sum() == len(LENS) * R
  np.testing.assert_allclose(np.asarray(r.logp)[:, 1:][mask], tf[mask], atol=1e-5, rtol=0)

  # Something was actually evicted, and it changed the distribution: the dense forward
  # of the same tokens disagrees with the rollout (so the check above could fail).
  ev = np.asarray(r.evicted_at)
  assert (ev < NEVER_EVICTED).sum() > 0
  dense = model(r.tokens, visibility=Visibility(segment_ids=r.segment_ids))
  tf_dense = np.asarray(token_logprobs(dense[:, :-1], r.tokens[:, 1:], scfg))
  assert np.abs(tf_dense[mask] - tf[mask]).max() > 1e-3

  # Memory is set by the budget: fewer slots than the dense cache's P + R - 1.
  assert r.stats.cache_slots < P + R - 1

  if cc.policy not in RESIMULATED:
    pytest.skip(f"no plain-numpy re-simulation of policy {cc.policy!r}")
  k_evict = stream_keys(KEY)[3]
  B, L, K, T = ev.shape
  pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, K, T))
  # One draw per (layer, step), the sampler's; cached, since every ranking of a step asks.
  rand = functools.cache(lambda l, i: np.asarray(policies.random_priority(k_evict, l, i, pos)))
  expected = resimulate(cc, np.asarray(probs), LENS, int(r.stats.decode_steps), rand)
  diff = np.argwhere(ev != expected)
  assert diff.size == 0, (f"first mismatch at [b, l, k, j] = {diff[0].tolist()}: sampler "
                          f"{ev[tuple(diff[0])]}, re-simulation {expected[tuple(diff[0])]}")

