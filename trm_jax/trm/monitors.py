"""TRM monitors: rejection rates (overall, per criterion, by response length), the PPL gap, the
batch's empirical bound B* and the precondition-free term r + D_TV^seq.

Why these (TRM paper Sec. 4.4-4.5 and App. F-G; docs/trm.md, "Monitors"):
  * the rejection rate r enters the precondition-free guarantee linearly,
    J(theta) - J(roll) >= L'_masked - B_A - (r + D_TV^seq), so it must be watched;
  * TRM-max rejects a sequence with P = 1 - (1 - p)^T: bucketing r by response length makes
    this length bias visible (LN-TRM and SER should flatten it);
  * Delta_PPL (Sec. 5) is the paper's stability signal;
  * B* from batch estimates says whether the certified trust region is still non-vacuous. It is
    an estimate: the maxima are over sampled contexts only.

All functions are jit-compatible and return finite values for fully masked batches.
"""
from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from trm_jax.trm import bounds as bounds_lib
from trm_jax.trm import divergence

DEFAULT_LENGTH_EDGES = (0, 256, 1024, 4096)


def _row_valid(mask: jax.Array) -> jax.Array:
  return jnp.any(mask > 0, axis=-1)                                    # [B]


def rejection_rate(seq_keep: jax.Array, mask: jax.Array) -> jax.Array:
  """Fraction of sequences with at least one response token that `seq_keep` [B] rejects."""
  valid = _row_valid(mask)
  rejected = jnp.sum(jnp.where(valid, seq_keep <= 0, False))
  return rejected / jnp.maximum(jnp.sum(valid), 1)


def masked_token_fraction(token_keep: jax.Array, mask: jax.Array) -> jax.Array:
  """Fraction of response tokens that `token_keep` [B, T] removes from the loss."""
  valid = mask > 0
  removed = jnp.sum(jnp.where(valid, token_keep <= 0, False))
  return removed / jnp.maximum(jnp.sum(valid), 1)


def rejection_by_length(seq_keep: jax.Array, mask: jax.Array,
                        edges: Sequence[int] = DEFAULT_LENGTH_EDGES,
                        prefix: str = "trm/reject_rate") -> dict:
  """Rejection rate per response-length bucket [edges[i], edges[i+1]) (last one open).

  Returns `{prefix}/len_{lo}_{hi}` rates and `{prefix}/len_{lo}_{hi}/count` sequence counts;
  an empty bucket has rate 0 and count 0.
  """
  edges = tuple(int(e) for e in edges)
  if not edges or any(b <= a for a, b in zip(edges, edges[1:])):
    raise ValueError(f"length bucket `edges` must be non-empty and increasing, got {edges}")
  lengths = jnp.sum(mask > 0, axis=-1)                                 # [B]
  valid = lengths > 0
  rejected = valid & (seq_keep <= 0)
  out = {}
  for i, lo in enumerate(edges):
    hi = edges[i + 1] if i + 1 < len(edges) else None
    in_b = valid & (lengths >= lo) & (True if hi is None else lengths < hi)
    n = jnp.sum(in_b)
    key = f"{prefix}/len_{lo}_{'inf' if hi is None else hi}"
    out[key] = jnp.sum(rejected & in_b) / jnp.maximum(n, 1)
    out[key + "/count"] = n
  return out


def ppl_gap(logp_theta: jax.Array, logp_roll: jax.Array, mask: jax.Array) -> jax.Array:
  """Delta_PPL = 1/N sum_i 1/T_i sum_t [log pi_theta(y_t) - log pi_roll(y_t)] (TRM Sec. 5).

  The average is over the N sequences with at least one response token (0 when there is none).
  Args are [B, T] sampled-token log-probs and the response mask.
  """
  d = divergence.seq_mean(logp_theta.astype(jnp.float32) - logp_roll.astype(jnp.float32), mask)
  valid = _row_valid(mask)
  return jnp.sum(jnp.where(valid, d, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def empirical_bounds(est: divergence.BatchEstimates, T: int, prefix: str = "bound/") -> dict:
  """`compute_bounds` on the batch estimates: every bound they allow, plus `{prefix}unified`.

  T is the padded response length (static); est.dbar_hat must be [T].
  """
  return {prefix + k: v for k, v in bounds_lib.compute_bounds(T, **est.bound_inputs()).items()}


def precondition_free_term(reject_rate: jax.Array, tv_seq: jax.Array) -> jax.Array:
  """r + D_TV^seq, the price of dropping the global precondition (TRM Sec. 4.5, App. G)."""
  return reject_rate + tv_seq


def trm_monitors(*, seq_keep: jax.Array, mask: jax.Array, T: int,
                 logp_theta: Optional[jax.Array] = None, logp_roll: Optional[jax.Array] = None,
                 est: Optional[divergence.BatchEstimates] = None,
                 length_edges: Sequence[int] = DEFAULT_LENGTH_EDGES) -> dict:
  """Every monitor the inputs allow, as one flat metrics dict.

  Args:
    seq_keep: [B] final sequence mask (AND of all criteria), e.g. `MaskResult.seq_mask`.
    mask: [B, T] response mask.
    T: padded response length (static) for the bounds.
    logp_theta, logp_roll: [B, T] sampled-token log-probs -> `trm/ppl_gap`.
    est: batch estimates -> `bound/*` and, with tv_seq_hat, `trm/r_plus_tv_seq`.
    length_edges: response-length bucket edges for the length-bias view.
  """
  r = rejection_rate(seq_keep, mask)
  out = {"trm/reject_rate": r}
  out.update(rejection_by_length(seq_keep, mask, length_edges))
  if logp_theta is not None and logp_roll is not None:
    out["trm/ppl_gap"] = ppl_gap(logp_theta, logp_roll, mask)
  if est is not None:
    out.update(empirical_bounds(est, T))
    if est.tv_seq_hat is not None:
      out["trm/r_plus_tv_seq"] = precondition_free_term(r, est.tv_seq_hat)
    for name in ("delta_hat", "eps_hat", "kl_seq_hat", "tv_seq_hat"):
      if getattr(est, name) is not None:
        out[f"trm/{name}"] = getattr(est, name)
  return out
