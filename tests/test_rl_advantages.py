"""GRPO / Dr.GRPO advantages on hand-computed groups, and the two baseline choices."""
import jax.numpy as jnp
import numpy as np
import pytest

from trm_jax.rl.advantages import drgrpo_advantages, group_advantages

REWARDS = np.array([1.0, 0.0, 0.0, 1.0,   0.5, 0.5, 0.5, 0.5,   1.0, 0.0, 0.0, 0.0],
                   np.float32)


def test_grpo_with_std_matches_numpy():
  a = group_advantages(jnp.asarray(REWARDS), group_size=4, normalize_std=True, eps=1e-6)
  r = REWARDS.reshape(3, 4).astype(np.float64)
  expected = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(np.asarray(a), expected.reshape(-1), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(a)[4:8], 0.0)   # equal rewards: 0, not 0/0
  assert a.dtype == jnp.float32


def test_no_std_and_drgrpo_are_mean_centred_rewards():
  r = REWARDS.reshape(3, 4)
  expected = (r - r.mean(1, keepdims=True)).reshape(-1)
  for a in (group_advantages(jnp.asarray(REWARDS), group_size=4, normalize_std=False),
            drgrpo_advantages(jnp.asarray(REWARDS), group_size=4)):
    np.testing.assert_allclose(np.asarray(a), expected, rtol=1e-6)


def test_baseline_all_ignores_the_mask_kept_uses_it():
  mask = jnp.asarray([1, 1, 1, 0,   1, 1, 1, 1,   1, 0, 0, 0], jnp.float32)
  a_all = group_advantages(jnp.asarray(REWARDS), group_size=4, normalize_std=False,
                           seq_mask=mask)
  a_ref = group_advantages(jnp.asarray(REWARDS), group_size=4, normalize_std=False)
  np.testing.assert_array_equal(np.asarray(a_all), np.asarray(a_ref))
  a_kept = group_advantages(jnp.asarray(REWARDS), group_size=4, normalize_std=False,
                            seq_mask=mask, baseline="kept")
  # group 0 kept rewards [1, 0, 0] -> mean 1/3; the masked row gets 0; a lone kept row gets 0.
  expected = [2 / 3, -1 / 3, -1 / 3, 0.0,   0, 0, 0, 0,   0, 0, 0, 0]
  np.testing.assert_allclose(np.asarray(a_kept), expected, rtol=1e-6, atol=1e-7)
  a_kept_std = group_advantages(jnp.asarray(REWARDS), group_size=4, normalize_std=True,
                                seq_mask=mask, baseline="kept")
  assert np.isfinite(np.asarray(a_kept_std)).all()
  np.testing.assert_allclose(np.asarray(a_kept_std)[:3],
                             np.array([2, -1, -1]) / 3 / (np.std([1, 0, 0], ddof=1) + 1e-6),
                             rtol=1e-6)


def test_bad_inputs_name_the_culprit():
  with pytest.raises(ValueError, match="group_size=5"):
    group_advantages(jnp.asarray(REWARDS), group_size=5, normalize_std=True)
  with pytest.raises(ValueError, match="rewards"):
    group_advantages(jnp.zeros((4, 2)), group_size=2, normalize_std=True)
  with pytest.raises(ValueError, match="seq_mask"):
    group_advantages(jnp.asarray(REWARDS), group_size=4, normalize_std=True, baseline="kept")
  with pytest.raises(ValueError, match="baseline"):
    group_advantages(jnp.asarray(REWARDS), group_size=4, normalize_std=True, baseline="mean")
