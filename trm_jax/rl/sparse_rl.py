"""Sparse-RL baseline: importance weights and rejection for sparse-cache rollouts.

The SMD paper compares against Sparse-RL: rollouts are sampled with a compressed KV cache
(pi_sparse), the learner scores them with full attention (pi_dense), and the mismatch is
corrected by reweighting and rejection. The public configuration we reproduce
(docs/smd.md, "Learner modes"):

  rho_t = pi_dense(y_t | c_t) / pi_sparse(y_t | c_t)     (from log space)
  * sequence veto:    a rollout is dropped if any response token has rho_t < veto (1e-4);
  * token rejection:  tokens with rho_t outside [reject_low, reject_high] = [0.5, 1.5] get 0;
  * truncation:       the remaining weights are min(rho_t, trunc) with trunc = 1.5;
  * normalisation:    weights rescaled to mean 1 over the kept tokens of the whole batch.

With the published numbers the truncation only bites at rho = 1.5 exactly (anything above is
already rejected); it is kept as its own knob because the method defines the two separately.
The defaults below ARE that public configuration (they define the baseline, so they live
here rather than in a trainer config).

How it plugs into the learner: the weights are fixed data of the rollout batch. Compute them
once per rollout batch, on the whole batch (the mean-1 normalisation is batch-wide, so do it
before any microbatch split), from pi_dense at the policy that scored the batch. Then pass
`token_weights` and `seq_mask = seq_keep` to an objective of `trm_jax.rl.objectives` with
logp_roll := logp_dense (the dense learner's own log-probs, so the objective's ratio starts
at 1 and the sparse/dense mismatch is carried by these weights alone).

`wasted_frac` counts the rollouts that contribute nothing: vetoed, or every response token
rejected. The SMD paper reports > 20% for Sparse-RL at 50% compression; SMD's promise is 0.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class SparseRLWeights:
  token_weights: jax.Array     # [B, T] float32, mean 1 over kept tokens, 0 elsewhere
  seq_keep: jax.Array          # [B] float32, 1 = rollout contributes at least one token
  wasted_frac: jax.Array       # [] rollouts with response tokens that contribute none
  veto_frac: jax.Array         # [] rollouts vetoed by a ratio < veto
  token_reject_frac: jax.Array  # [] response tokens of non-vetoed rollouts outside the band


def sparse_rl_weights(logp_dense: jax.Array, logp_sparse: jax.Array,
                      response_mask: jax.Array, *, trunc: float = 1.5,
                      reject_low: float = 0.5, reject_high: float = 1.5,
                      veto: float = 1e-4) -> SparseRLWeights:
  """Sparse-RL token weights, sequence keep mask and waste statistics.

  Args:
    logp_dense: [B, T] log pi_dense of the sampled tokens (learner, full attention).
    logp_sparse: [B, T] log pi_sparse of the same tokens (the sparse-cache sampler's).
    response_mask: [B, T] 1 on generated tokens.
    trunc, reject_low, reject_high, veto: the public configuration, module docstring.
  Returns:
    SparseRLWeights; everything is stop-gradient.
  """
  if jnp.ndim(logp_dense) != 2:
    raise ValueError(f"logp_dense must be [B, T], got shape {jnp.shape(logp_dense)}")
  for name, x in (("logp_sparse", logp_sparse), ("response_mask", response_mask)):
    if jnp.shape(x) != jnp.shape(logp_dense):
      raise ValueError(f"{name} must have logp_dense's shape {jnp.shape(logp_dense)}, got "
                       f"{jnp.shape(x)}")
  if not 0 < veto <= reject_low <= 1.0 <= reject_high or trunc < 1.0:
    raise ValueError("need 0 < veto <= reject_low <= 1 <= reject_high and trunc >= 1, got "
                     f"veto={veto}, reject_low={reject_low}, reject_high={reject_high}, "
                     f"trunc={trunc}")
  sg = jax.lax.stop_gradient
  rm = sg(jnp.asarray(response_mask)).astype(jnp.float32)             # [B, T]
  valid = rm > 0
  # Log-space ratio; invalid positions are 0 before the subtraction (no inf - inf).
  log_rho = (jnp.where(valid, sg(logp_dense).astype(jnp.float32), 0.0)
             - jnp.where(valid, sg(logp_sparse).astype(jnp.float32), 0.0))   # [B, T]
  # Thresholds compared in log space: exp(log_rho) would under/overflow at the extremes that
  # matter most here (a veto is exactly an underflowing ratio).
  vetoed = jnp.any(valid & (log_rho < math.log(veto)), axis=1)        # [B]
  in_band = (log_rho >= math.log(reject_low)) & (log_rho <= math.log(reject_high))
  keep_tok = valid & in_band & ~vetoed[:, None]                       # [B, T]
  raw = jnp.where(keep_tok, jnp.exp(jnp.minimum(log_rho, math.log(trunc))), 0.0)
  n_kept = jnp.sum(keep_tok.astype(jnp.float32))
  mean_w = jnp.sum(raw) / jnp.maximum(n_kept, 1.0)
  # Kept weights are >= reject_low > 0, so mean_w > 0 whenever any token is kept.
  token_weights = jnp.where(keep_tok, raw / jnp.where(n_kept > 0, mean_w, 1.0), 0.0)

  has_tokens = jnp.any(valid, axis=1)                                 # [B]
  seq_keep = jnp.any(keep_tok, axis=1)                                # [B]
  n_seq = jnp.maximum(jnp.sum(has_tokens.astype(jnp.float32)), 1.0)
  live_tok = valid & ~vetoed[:, None]
  return SparseRLWeights(
      token_weights=token_weights,
      seq_keep=seq_keep.astype(jnp.float32),
      wasted_frac=jnp.sum((has_tokens & ~seq_keep).astype(jnp.float32)) / n_seq,
      veto_frac=jnp.sum((has_tokens & vetoed).astype(jnp.float32)) / n_seq,
      token_reject_frac=jnp.sum((live_tok & ~in_band).astype(jnp.float32))
                        / jnp.maximum(jnp.sum(live_tok.astype(jnp.float32)), 1.0),
  )
