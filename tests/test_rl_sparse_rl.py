"""Sparse-RL weights on constructed ratios: band rejection, truncation, veto, mean-1 weights."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trm_jax.rl.sparse_rl import sparse_rl_weights

# One compiled graph per shape is cheaper on CPU than eager dispatch of every primitive.
_jitted = functools.partial(jax.jit, static_argnames=("trunc", "reject_low", "reject_high",
                                                      "veto"))(sparse_rl_weights)


def _weights(ratios, response_mask=None, **kw):
  ratios = np.asarray(ratios, np.float64)
  logp_sparse = np.full(ratios.shape, np.log(0.2))
  with np.errstate(divide="ignore"):
    logp_dense = logp_sparse + np.log(ratios)
  rm = np.ones(ratios.shape) if response_mask is None else np.asarray(response_mask)
  return _jitted(jnp.asarray(logp_dense, jnp.float32),
                           jnp.asarray(logp_sparse, jnp.float32), jnp.asarray(rm, jnp.float32),
                           **kw)


def test_constructed_ratios():
  # Band edges are not probed exactly: fp32 log-ratios put 0.5 and 1.5 within rounding of them.
  ratios = [[1.0, 0.501, 1.499, 1.2, 0.8],  # all in band
            [0.49, 1.51, 1.0, 1.0, 10.0],   # three tokens rejected, two kept
            [1.0, 1.0, 5e-5, 1.0, 1.0],     # vetoed: one ratio < 1e-4
            [0.3, 2.0, 0.1, 3.0, 0.2]]      # nothing in band: wasted, but not vetoed
  w = _weights(ratios)
  kept = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 0], [0] * 5, [0] * 5], bool)
  raw = np.where(kept, np.minimum(np.asarray(ratios), 1.5), 0.0)
  expected = raw / raw[kept].mean()
  np.testing.assert_allclose(np.asarray(w.token_weights), expected, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(w.token_weights)[kept].mean(), 1.0, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(w.seq_keep), [1, 1, 0, 0])
  assert float(w.wasted_frac) == 0.5
  assert float(w.veto_frac) == 0.25
  assert float(w.token_reject_frac) == pytest.approx(8 / 15)   # rows 0, 1, 3: 0 + 3 + 5 of 15


def test_truncation_applies_below_the_rejection_edge():
  # A looser band shows truncation on its own: ratio 1.8 is kept and truncated to 1.5.
  w = _weights([[1.8, 1.0]], reject_high=2.0)
  raw = np.array([1.5, 1.0])
  np.testing.assert_allclose(np.asarray(w.token_weights)[0], raw / raw.mean(), rtol=1e-6)


def test_padding_is_ignored_and_zero_ratio_vetoes():
  ratios = [[1.0, 1.2, 0.0, 0.0],       # the zeros are padding: no veto
            [1.0, 0.0, 1.0, 1.0],       # a real zero ratio (log = -inf): vetoed
            [1.0, 1.0, 1.0, 1.0]]       # an all-padding row: not a rollout
  rm = [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
  w = _weights(ratios, rm)
  np.testing.assert_array_equal(np.asarray(w.seq_keep), [1, 0, 0])
  assert np.isfinite(np.asarray(w.token_weights)).all()
  np.testing.assert_array_equal(np.asarray(w.token_weights)[1:], 0.0)
  assert float(w.wasted_frac) == 0.5 and float(w.veto_frac) == 0.5


def test_on_policy_rollouts_waste_nothing_and_everything_vetoed_is_finite():
  w = _weights(np.ones((3, 4)))
  np.testing.assert_array_equal(np.asarray(w.token_weights), 1.0)
  assert float(w.wasted_frac) == 0.0
  w = _weights(np.full((2, 3), 1e-6))
  np.testing.assert_array_equal(np.asarray(w.token_weights), 0.0)
  assert float(w.wasted_frac) == 1.0 and float(w.veto_frac) == 1.0


def test_bad_inputs():
  with pytest.raises(ValueError, match="logp_sparse"):
    sparse_rl_weights(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.ones((2, 3)))
  with pytest.raises(ValueError, match="reject_low"):
    sparse_rl_weights(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones((2, 3)), reject_low=1.2)
