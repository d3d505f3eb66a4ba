"""Shadow Mask Distillation through the learner: exactness, TRM on top, gradients, baselines.

One set of compressed-cache rollouts (every registered policy, `rollout.POLICIES`: SnapKV, H2O,
recent, random, at 50% and 70% compression, prompts of mixed lengths, tiny fp32 model,
temperature 0.9) drives every test:

  * the learner's masked track (`score` in mode "smd") reproduces the rollout's log-probs to
    1e-5, so the importance ratio is 1 to rounding; also through the Pallas kernel (interpret);
    in bf16 (sampler and learner) the gap is measured, printed and bounded;
  * TRM at one threshold (trm_max_kl, exact KL from the rollout's full log-probs) keeps every
    SMD rollout and rejects every naive-sparse one, with orders of magnitude on both sides;
  * the distillation gradient is that of lambda * KL(sg(teacher) || student), not of the
    un-stopped KL (gradients reach only the policy);
  * naive mode scores with dense visibility; Sparse-RL mode reports its wasted fraction.

Runtime (~100 s CPU, ~45 s of it the eight sampler compiles the acceptance matrix needs): the
rollouts are generated once per module and each learner variant is compiled once and reused
across the 8 rollout settings.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from trm_jax.kernels.visibility import NEVER_EVICTED, Visibility
from prompt_fixtures import left_padded_prompts
from model_fixtures import make_test_model
from trm_jax.models.decoder import Decoder
from trm_jax.rl.learner import LearnerBatch, LearnerConfig, make_learner
from trm_jax.rollout import POLICIES, CacheConfig, generate

P, N = 16, 12
LENS = np.array([16, 9, 5, 12], np.int32)
KEY = jax.random.key(7)
TEMPERATURE = 0.9          # sampler and learner (LearnerConfig.temperature) alike
CHUNK = 8                  # several vocabulary-projection chunks over T - 1 = 27 positions
SHARPEN = 3.0
# One TRM threshold for SMD and naive. SMD's exact per-token KL is rounding (~1e-6); naive
# sparse with this model has max-token KL >= 4e-2 in every rollout (the smallest, SnapKV at
# 50%), so 1e-3 sits >= 10x below every naive rollout and >= 100x above SMD (asserted).
DELTA = 1e-3
# bf16 sampler vs bf16 learner: both round activations to 8 mantissa bits, but the cached
# decode and the full-sequence forward round at different places (per-step [1, C] attention vs
# [T, T] blocks), so log-probs agree to bf16 precision of logits of magnitude ~5, not to 1e-5.
BF16_BOUND = 0.1

# Every test shares the module's rollouts and compiled learners; with `pytest -n 2
# --dist loadgroup` they stay on one worker instead of generating the rollouts twice.
pytestmark = pytest.mark.xdist_group("smd")

OPTIONS = {   # per-policy settings (a registered policy not named here: its defaults)
    "snapkv": dict(policy="snapkv", window=4, kernel=3),
    "h2o": dict(policy="h2o", recent_frac=0.5),
    "recent": dict(policy="recent", sinks=2),
    "random": dict(policy="random"),
}
SETTINGS = [(name, ratio) for name in sorted(POLICIES) for ratio in (0.5, 0.7)]
IDS = [f"{n}-{int(r * 100)}" for n, r in SETTINGS]


@pytest.fixture(scope="module")
def model():
  """The tiny test model with 3x sharper attention (q_norm scales) and 3x sharper output
  logits (lm_head): a policy that depends strongly on which keys it sees, so naive sparse
  scoring has a clear mismatch. Exactness of the masked track holds for any weights."""
  m = make_test_model(seed=3)
  m.lm_head[...] = m.lm_head[...] * SHARPEN
  for layer in m.layers:
    layer.attn.q_norm.scale[...] = layer.attn.q_norm.scale[...] * SHARPEN
  return m


@pytest.fixture(scope="module")
def split(model):
  return nnx.split(model, nnx.Param, ...)


@pytest.fixture(scope="module")
def prompts():
  return left_padded_prompts(LENS, P)


def _batch(ro) -> LearnerBatch:
  B, T = ro.tokens.shape
  return LearnerBatch(
      tokens=ro.tokens, segment_ids=ro.segment_ids,
      response_mask=ro.response_mask.astype(jnp.float32), logp_roll=ro.logp,
      advantages=jnp.zeros((B,), jnp.float32), logp_old=ro.logp,
      token_weights=jnp.ones((B, T), jnp.float32), evicted_at=ro.evicted_at,
      roll_logp_full=ro.full_logp)


@pytest.fixture(scope="module")
def rollouts(model, prompts):
  """(policy, ratio) -> (Rollout, LearnerBatch), sampled at TEMPERATURE."""
  out = {}
  for name, ratio in SETTINGS:
    ro = generate(model, prompts, LENS, max_new_tokens=N, key=KEY, eos_ids=(),
                  temperature=TEMPERATURE, cache=CacheConfig(ratio=ratio, **OPTIONS.get(name, dict(policy=name))),
                  keep_full_logprobs=True)
    out[name, ratio] = (ro, _batch(ro))
  return out


@pytest.fixture(scope="module")
def scorer(split):
  """scorer(mode, attn_impl="reference", g=graphdef) -> jitted `score`, built once per key."""
  graphdef = split[0]

  @functools.lru_cache(maxsize=None)
  def build(mode, attn_impl="reference", g=None):
    cfg = LearnerConfig(mode=mode, mode_kwargs=(("lam", 0.1),) if mode == "smd" else (),
                        criteria=("trm_max_kl",), thresholds=(("delta", DELTA),), chunk=CHUNK,
                        attn_impl=attn_impl, temperature=TEMPERATURE)
    return make_learner(g or graphdef, optax.sgd(0.0), cfg, response_start=P)[0]
  return build


@pytest.fixture(scope="module")
def dense_forward(split):
  """Independent teacher-forced tempered log-softmax [B, T, V] (target-indexed), jitted once
  per visibility structure."""
  graphdef, _, rest = split

  @jax.jit
  def run(params, tokens, vis):
    logits = nnx.merge(graphdef, params, rest)(tokens, visibility=vis)
    logq = jax.nn.log_softmax(logits / TEMPERATURE)
    return jnp.pad(logq[:, :-1], ((0, 0), (1, 0), (0, 0)))
  return run


def _resp_max(x, ro):
  return float(jnp.max(jnp.abs(x) * ro.response_mask))


# --- (1) exactness: masked track == rollout ------------------------------------------------

@pytest.mark.parametrize("name,ratio", SETTINGS, ids=IDS)
def test_masked_track_equals_rollout(split, rollouts, scorer, name, ratio):
  _, params, rest = split
  ro, batch = rollouts[name, ratio]
  # Not vacuous: keys were evicted and they changed what the sampler saw.
  assert int(jnp.sum(ro.evicted_at < NEVER_EVICTED)) > 0
  logp, _, _, met = scorer("smd")(params, rest, batch)
  diff = _resp_max(logp - ro.logp, ro)
  print(f"{name} {ratio}: max |logp_smd - logp_roll| = {diff:.2e}")
  assert diff <= 1e-5
  rho = jnp.exp((logp - ro.logp) * ro.response_mask)
  assert _resp_max(rho - 1.0, ro) <= 2e-5
  assert abs(float(met["trm/ppl_gap"])) <= 1e-5


def test_masked_track_through_kernel_interpret(split, rollouts, scorer):
  _, params, rest = split
  for key in (("h2o", 0.7), ("snapkv", 0.5)):
    ro, batch = rollouts[key]
    logp, _, seq_mask, _ = scorer("smd", "pallas_interpret")(params, rest, batch)
    diff = _resp_max(logp - ro.logp, ro)
    print(f"{key} through pallas_interpret: max |diff| = {diff:.2e}")
    assert diff <= 1e-5
    np.testing.assert_array_equal(np.asarray(seq_mask), 1.0)


def test_masked_track_bf16(model, split, prompts, rollouts, scorer):
  """Sampler and learner both compute in bf16 (fp32 parameters): the figure is reported."""
  _, params, rest = split
  g16 = nnx.split(nnx.eval_shape(lambda: Decoder(model.config.replace(dtype="bfloat16"),
                                                 rngs=nnx.Rngs(0))), nnx.Param, ...)[0]
  ro = generate(model, prompts, LENS, max_new_tokens=N, key=KEY, eos_ids=(),
                temperature=TEMPERATURE, cache=CacheConfig(ratio=0.5, **OPTIONS["h2o"]),
                keep_full_logprobs=True,
                compute_dtype=jnp.bfloat16)
  logp, _, _, _ = scorer("smd", "reference", g16)(params, rest, _batch(ro))
  diff = _resp_max(logp - ro.logp, ro)
  # The eviction mismatch SMD removes, on the fp32 rollouts of the same setting.
  ro32, batch32 = rollouts["h2o", 0.5]
  naive = _resp_max(scorer("naive")(params, rest, batch32)[0] - ro32.logp, ro32)
  print(f"bf16 h2o 0.5: max |logp_smd - logp_roll| = {diff:.3e} "
        f"(fp32 naive sparse: {naive:.3e}; bound {BF16_BOUND})")
  assert diff <= BF16_BOUND
  assert diff < naive / 4


# --- (2) TRM on top: same threshold keeps SMD, rejects naive sparse --------------------------

@pytest.mark.parametrize("name,ratio", SETTINGS, ids=IDS)
def test_trm_keeps_smd_rejects_naive(split, rollouts, scorer, dense_forward, name, ratio):
  _, params, rest = split
  ro, batch = rollouts[name, ratio]
  _, _, keep_smd, met_smd = scorer("smd")(params, rest, batch)
  _, _, keep_naive, met_naive = scorer("naive")(params, rest, batch)
  np.testing.assert_array_equal(np.asarray(keep_smd), 1.0)
  np.testing.assert_array_equal(np.asarray(keep_naive), 0.0)
  assert float(met_smd["trm/reject_rate"]) == 0.0
  assert float(met_naive["trm/reject_rate"]) == 1.0
  # Margins, from an independent dense forward: the smallest per-rollout max-token KL of
  # naive sparse is >= 10 delta; SMD's largest is <= delta / 100.
  logq = dense_forward(params, ro.tokens, Visibility(segment_ids=ro.segment_ids))
  roll = ro.full_logp
  kl = jnp.sum(jnp.where(jnp.isfinite(roll), jnp.exp(roll) * (roll - logq), 0.0), axis=-1)
  naive_min = float(jnp.min(jnp.max(kl * ro.response_mask, axis=1)))
  smd_max = float(met_smd["trm/trm_max_kl/max_kl_max"])
  print(f"{name} {ratio}: SMD max KL {smd_max:.1e}, naive min-over-rollouts max KL "
        f"{naive_min:.2e}, delta {DELTA}")
  assert smd_max <= DELTA / 100
  assert naive_min >= DELTA * 10


# --- (3) gradients reach only the policy -----------------------------------------------------

def _grad_capture() -> optax.GradientTransformation:
  """An 'optimizer' whose state after one update is exactly the gradient it was given."""
  def update(updates, state, params=None):
    del state, params
    return jax.tree.map(jnp.zeros_like, updates), updates
  return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), update)


def test_distillation_gradient_stops_at_teacher(split, rollouts):
  graphdef, params, rest = split
  ro, batch = rollouts["h2o", 0.7]
  lam = 0.5
  tx = _grad_capture()
  cfg = LearnerConfig(mode="smd", mode_kwargs=(("lam", lam),), chunk=CHUNK, num_microbatches=2,
                      attn_impl="reference", temperature=TEMPERATURE)
  _, update = make_learner(graphdef, tx, cfg, response_start=P)
  # advantages = 0: the policy-gradient term has zero gradient, only distillation remains.
  batch = batch.replace(advantages=jnp.zeros_like(batch.advantages))
  copy = lambda t: jax.tree.map(jnp.copy, t)
  _, grads, aux = update(copy(params), tx.init(copy(params)), rest, batch)

  mask = ro.response_mask.astype(jnp.float32)

  def hand_loss(params, stop):
    m = nnx.merge(graphdef, params, rest)
    shadow = Visibility(ro.segment_ids, ro.evicted_at)
    student = jax.nn.log_softmax(m(ro.tokens, visibility=shadow) / TEMPERATURE)
    teacher = jax.nn.log_softmax(m(ro.tokens, visibility=Visibility(ro.segment_ids))
                                 / TEMPERATURE)
    if stop:
      teacher = jax.lax.stop_gradient(teacher)
    # position t-1 predicts token t; KL of the tempered policies over the full vocabulary,
    # token mean.
    kl = jnp.sum(jnp.exp(teacher) * (teacher - student), axis=-1)[:, :-1] * mask[:, 1:]
    return lam * jnp.sum(kl) / jnp.maximum(jnp.sum(mask), 1.0)

  # One program for both hand gradients (they share the forward passes).
  (loss_sg, g_sg), (_, g_full) = jax.jit(lambda p: (
      jax.value_and_grad(hand_loss)(p, stop=True),
      jax.value_and_grad(hand_loss)(p, stop=False)))(params)
  assert float(loss_sg) > 1e-4            # the eviction makes teacher and student differ
  np.testing.assert_allclose(float(aux["learner/loss"]), float(loss_sg), rtol=1e-5)

  leaves = lambda t: jax.tree.leaves(t)
  scale = max(float(jnp.max(jnp.abs(g))) for g in leaves(g_sg))
  err_sg = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(leaves(grads), leaves(g_sg)))
  err_full = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(leaves(grads), leaves(g_full)))
  print(f"grad scale {scale:.3e}; |g - g(sg teacher)| {err_sg:.2e}; "
        f"|g - g(teacher not stopped)| {err_full:.2e}")
  assert err_sg <= 1e-4 * scale
  assert err_full >= 1e-2 * scale


# --- (4) the baselines: naive is dense, Sparse-RL reports waste ------------------------------

@pytest.mark.parametrize("name,ratio", [("recent", 0.7), ("snapkv", 0.5)])
def test_naive_scores_with_dense_visibility(split, rollouts, scorer, dense_forward, name,
                                            ratio):
  _, params, rest = split
  ro, batch = rollouts[name, ratio]
  logp, _, _, _ = scorer("naive")(params, rest, batch)
  logq = dense_forward(params, ro.tokens, Visibility(segment_ids=ro.segment_ids))
  dense = jnp.take_along_axis(logq, ro.tokens[..., None], axis=-1)[..., 0]
  assert _resp_max(logp - dense, ro) <= 1e-5
  assert _resp_max(logp - ro.logp, ro) >= 1e-2


def _sparse_rl_numpy(logp_dense, logp_sparse, mask):
  """Plain-numpy re-derivation of the public Sparse-RL configuration (docs/smd.md)."""
  valid = np.asarray(mask) > 0
  log_rho = np.where(valid, np.asarray(logp_dense) - np.asarray(logp_sparse), 0.0)
  vetoed = np.any(valid & (log_rho < math.log(1e-4)), axis=1)
  keep = valid & (log_rho >= math.log(0.5)) & (log_rho <= math.log(1.5)) & ~vetoed[:, None]
  raw = np.where(keep, np.exp(np.minimum(log_rho, math.log(1.5))), 0.0)
  weights = np.where(keep, raw / (raw.sum() / max(keep.sum(), 1)), 0.0)
  wasted = np.mean(valid.any(axis=1) & ~keep.any(axis=1))
  return weights, wasted, vetoed.mean(), keep.sum(), valid.sum()


def test_sparse_rl_reports_wasted_fraction(split, rollouts, scorer):
  _, params, rest = split
  cases = [(f"{n} {r}", ro, batch) for (n, r), (ro, batch) in rollouts.items()]
  # The tiny model's rollouts waste nothing (some tokens of every rollout stay in the band), so
  # one real rollout also gets an injected sampler mismatch: row 0 three times less likely
  # under pi_sparse on every token (all rho = 3, outside [0.5, 1.5]: wasted), row 1 one token
  # e^12 times more likely (rho < 1e-4: vetoed, wasted).
  ro, batch = rollouts["h2o", 0.5]
  shift = jnp.zeros_like(ro.logp).at[0].set(-math.log(3.0)).at[1, P + 2].set(12.0)
  cases.append(("h2o 0.5 + injected", ro, batch.replace(
      logp_roll=ro.logp + shift * batch.response_mask)))
  outside = []
  for label, ro, batch in cases:
    logp_dense, _, _, _ = scorer("naive")(params, rest, batch)
    _, weights, _, met = scorer("sparse_rl")(params, rest, batch)
    w, wasted, veto, kept, n = _sparse_rl_numpy(logp_dense, batch.logp_roll, ro.response_mask)
    print(f"{label}: Sparse-RL wasted {float(met['sparse_rl/wasted_frac']):.2f}, "
          f"veto {float(met['sparse_rl/veto_frac']):.2f}, tokens kept {kept}/{n}")
    assert float(met["sparse_rl/wasted_frac"]) == pytest.approx(wasted, abs=1e-7)
    assert float(met["sparse_rl/veto_frac"]) == pytest.approx(veto, abs=1e-7)
    np.testing.assert_allclose(np.asarray(weights), w, rtol=1e-5, atol=1e-6)
    outside.append(kept < n)
  # The mismatch is real: in the real rollouts (whether a given draw leaves the band depends on
  # the tokens sampled) and in the injected case, some token fell outside [0.5, 1.5].
  assert any(outside[:-1]) and outside[-1]
  assert wasted >= 0.5 and veto >= 0.25          # the injected case exercises both counters
