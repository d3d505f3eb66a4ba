"""Continuous batching and shared prompts (`generate(..., slots=, group_size=)`).

The claims: a row's draws are its own (sampling, logit noise, router jitter and random
eviction are keyed by (key, row, array index)), so decoding S rows at a time, refilling slots
as rows finish, cutting the caches to their live part and packing the last rows into fewer
slots give every row the tokens of the
all-at-once sampler, with log-probs equal to fp32 rounding and the same retention record and
expert choices; a group's prompt is prefilled once; the learner still replays every row.
"""
import dataclasses
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from model_fixtures import assert_learner_replays, make_test_model
from trm_jax.aot.tpu import libtpu_available
from trm_jax.rollout import BatchingConfig, CacheConfig
from trm_jax.rollout import cache as rollout_cache
from trm_jax.rollout import sampler as sampler_lib

P, R, G, B = 20, 22, 2, 12
KEY = jax.random.key(4)
EOS = (7, 8, 9)   # three stop ids: rows of the random model finish at different steps
POLICIES = {
    "none": CacheConfig(),
    "snapkv": CacheConfig(policy="snapkv", ratio=0.5, window=3, kernel=3),
    "h2o": CacheConfig(policy="h2o", capacity=12),
    "recent": CacheConfig(policy="recent", capacity=10, sinks=2),
    "random": CacheConfig(policy="random", ratio=0.4),
}
# 5 slots over 12 rows, refilled 2 at a time between chunks of 3 steps, caches cut to 16-slot
# buckets (prompts of up to P = 20 tokens: longer than a bucket), the last 2 decoding rows
# packed into 2 slots: every mechanism of the slotted loop runs.
SLOTTED = BatchingConfig(slots=5, group_size=G, chunk=3, refill=2, bucket=16, tail=2)


def _prompts(group=G):
  """B rows in groups of `group` identical left-padded prompts of different lengths."""
  rng = np.random.default_rng(0)
  ids = np.zeros((B, P), np.int32)
  lens = np.zeros((B,), np.int32)
  for g in range(B // group):
    n = int(rng.integers(2, P + 1))
    row = rng.integers(8, 128, n)
    ids[g * group:(g + 1) * group, P - n:], lens[g * group:(g + 1) * group] = row, n
  return ids, lens


def _generate(model, cache, batching, *, noise=False, ids=None, lens=None):
  if ids is None:
    ids, lens = _prompts(batching.group_size)
  kw = {}
  if noise:
    kw = dict(logit_noise=0.7, router_noise_scale=1.0 if model.moe_layers else 0.0,
              record_routing=bool(model.moe_layers))
  # The public entry point, every BatchingConfig field passed as its keyword argument.
  return sampler_lib.generate(model, ids, lens, max_new_tokens=R, key=KEY, eos_ids=EOS,
                              cache=cache, **dataclasses.asdict(batching), **kw)


# One layer: every mechanism is per layer, and compiling 20 sampler programs is this file's cost.
@pytest.fixture(scope="module")
def dense():
  return make_test_model(seed=3, num_layers=1)


@pytest.fixture(scope="module")
def moe():
  return make_test_model(seed=6, num_layers=1, model_type="qwen3_moe", num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32)


def _assert_same_rows(got, ref):
  np.testing.assert_array_equal(got.tokens, ref.tokens)
  np.testing.assert_array_equal(got.response_mask, ref.response_mask)
  np.testing.assert_array_equal(got.segment_ids, ref.segment_ids)
  np.testing.assert_array_equal(got.evicted_at, ref.evicted_at)
  np.testing.assert_array_equal(got.stats.finished, ref.stats.finished)
  np.testing.assert_allclose(got.logp, ref.logp, atol=1e-6, rtol=0)
  np.testing.assert_allclose(got.stats.entropy, ref.stats.entropy, atol=1e-5, rtol=0)
  if ref.routed_experts is not None:
    np.testing.assert_array_equal(got.routed_experts, ref.routed_experts)


@pytest.mark.parametrize("noise", [False, True], ids=["exact", "noisy"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_slots_give_every_row_the_all_at_once_draws(dense, moe, policy, noise):
  """Noisy: logit noise, and for the MoE model router jitter (recorded for replay)."""
  model = moe if noise and policy in ("none", "random") else dense
  ref = _generate(model, POLICIES[policy], BatchingConfig(group_size=G), noise=noise)
  got = _generate(model, POLICIES[policy], SLOTTED, noise=noise)
  lengths = np.asarray(ref.response_lengths)
  assert lengths.min() < R and lengths.min() < lengths.max(), (
      "rows must finish at different times (EOS) for the slots to be refilled")
  assert int(got.stats.decode_steps) > int(ref.stats.decode_steps)   # 5 rows at a time
  _assert_same_rows(got, ref)


@pytest.mark.parametrize("policy", ["none", "random"])
def test_one_prefill_per_group_gives_the_rows_of_separate_prefills(dense, policy):
  """Rows that share a prompt start from one prefill: the same rollout as prefilling every
  row (fp32 rounding), and random eviction after it still differs row by row."""
  ids, lens = _prompts(4)
  shared = _generate(dense, POLICIES[policy], BatchingConfig(group_size=4), ids=ids, lens=lens)
  separate = _generate(dense, POLICIES[policy], BatchingConfig(), ids=ids, lens=lens)
  _assert_same_rows(shared, separate)
  if policy == "random":
    ev = np.asarray(shared.evicted_at)
    assert any((ev[g * 4] != ev[g * 4 + 1]).any() for g in range(B // 4))


def test_the_prefill_runs_once_per_group(dense):
  """The compiled sampler's prefill embeds U = B / G prompts, never all B rows."""
  scfg = sampler_lib.sampling_config(dense.config, max_new_tokens=R, eos_ids=EOS)
  graphdef, state = nnx.split(dense)
  ids, lens = _prompts(4)
  D = dense.config.hidden_size

  def hlo(group):
    return sampler_lib.make_generate(graphdef, scfg, batching=BatchingConfig(
        group_size=group)).lower(state, ids, lens, KEY).as_text()
  for group in (4, 1):
    text = hlo(group)
    shapes = set(re.findall(rf"tensor<(\d+)x{P}x{D}x", text))   # [rows, P, D] activations
    assert shapes == {str(B // group)}, (group, shapes)


def test_the_learner_replays_slotted_rollouts_exactly(dense):
  """SMD's exact replay for rows that were decoded in refilled slots: the learner's
  log-probs under the recorded visibility equal the sampler's."""
  ro = _generate(dense, POLICIES["h2o"], SLOTTED)
  assert_learner_replays(dense, ro, max_new_tokens=R, eos_ids=EOS, atol=2e-5)


def test_prompts_longer_than_the_default_bucket(dense):
  """Prompts of 136 tokens against the default 128-slot bucket: the loop's first stage holds
  the prompt (a stage below it once padded a loaded prompt's record to a negative width), and
  slotted rows still equal the all-at-once rows."""
  rng = np.random.default_rng(1)
  ids = np.repeat(rng.integers(8, 128, (2, 136)).astype(np.int32), 2, axis=0)
  lens = np.array([136, 136, 130, 130], np.int32)
  ids[2:, :6] = 0
  run = lambda **kw: sampler_lib.generate(dense, ids, lens, max_new_tokens=6, key=KEY,
                                          eos_ids=EOS, group_size=2, **kw)
  ref = run()
  _assert_same_rows(run(slots=2, chunk=2), ref)
  assert rollout_cache.slot_buckets(141, least=138) == (141,)


def test_the_first_stage_holds_a_loaded_prompt():
  """The 8B paper config with slots=64: P = 1024 prompt slots, C = 5119, 640-slot blocks. The
  stages start at the first block that holds a loaded prompt and one chunk of keys."""
  assert rollout_cache.slot_buckets(5119) == (640, 1280, 1920, 2560, 3200, 3840, 4480, 5119)
  assert rollout_cache.slot_buckets(5119, least=1024 + 16) == (
      1280, 1920, 2560, 3200, 3840, 4480, 5119)
  assert rollout_cache.slot_buckets(20, block=1, least=5) == (6, 9, 12, 15, 18, 20)


@pytest.mark.skipif(not libtpu_available(), reason="libtpu not installed: no TPU lowering")
def test_the_8b_paper_config_with_64_slots_lowers_its_rollout():
  """The README's `--config.rollout.slots=64` on the 8B paper config (P = 1024 against a first
  640-slot block) traces and lowers its rollout program for a v5p:4x4x4 slice (the compile
  itself is `python -m trm_jax.aot ... --programs rollout`)."""
  from trm_jax import config as config_lib, sweep  # pylint: disable=g-import-not-at-top
  from trm_jax.aot import compiler as aot, tpu as tpu_aot  # pylint: disable=g-import-not-at-top
  c = config_lib.load_config(os.path.join(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))), "configs", "qwen3_8b_dapo_trm.py"))
  c = sweep.apply_overrides(c, [("rollout.slots", 64)])
  hf, _ = aot.resolve_model(c)
  s = aot.build(c, hf, tpu_aot.topology_devices("v5p:4x4x4"))
  assert s.P == 1024 and "while" in s.programs["rollout"].lower().as_text()


def test_bad_groups_and_batching_are_named(dense):
  ids, lens = _prompts(2)
  with pytest.raises(ValueError, match=r"rows 0\.\.3 \(group 0\) do not share one prompt"):
    _generate(dense, POLICIES["none"], BatchingConfig(group_size=4), ids=ids, lens=lens)
  with pytest.raises(ValueError, match="not a multiple of group_size=5"):
    _generate(dense, POLICIES["none"], BatchingConfig(group_size=5), ids=ids, lens=lens)
  with pytest.raises(ValueError, match="chunk=0"):
    BatchingConfig(chunk=0)


@pytest.mark.slow
def test_exactness_holds_at_the_default_optimisation_level():
  """The suite compiles at XLA:CPU's optimisation level 0 (tests/conftest.py); the trainer at
  the default, which rounds differently. Two of this file's claims again, in a pytest process
  at the default level: slotted rows equal all-at-once rows with router and logit noise and
  H2O eviction, and the learner replays slotted rollouts exactly."""
  here = os.path.abspath(__file__)
  env = dict(os.environ, TRM_TEST_XLA_OPT="default",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  p = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
       f"{here}::test_slots_give_every_row_the_all_at_once_draws[h2o-noisy]",
       f"{here}::test_the_learner_replays_slotted_rollouts_exactly"],
      cwd=os.path.dirname(os.path.dirname(here)), env=env, capture_output=True, text=True,
      timeout=600)
  assert p.returncode == 0 and "2 passed" in p.stdout, (p.stdout + p.stderr)[-4000:]
