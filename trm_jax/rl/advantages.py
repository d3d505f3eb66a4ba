"""GRPO group-normalised advantages (and the Dr.GRPO variant) from per-rollout rewards.

A rollout batch holds `num_groups` prompts with `G` sampled responses each, laid out
contiguously: rows [g * G, (g + 1) * G) share one prompt, so B = num_groups * G.

  GRPO (Shao et al. 2024):  A_i = (r_i - mean_g r) / (std_g r + eps)
  without std:              A_i =  r_i - mean_g r
  Dr.GRPO (Liu et al. 2025) removes two normalisations, and they live in different places:
    * the per-group std in the advantage        -> here (`normalize_std=False`);
    * the per-sequence 1/|y| length normaliser  -> in the loss aggregation
      (`objectives` loss_agg="seq-mean-token-sum-norm": a constant max length instead).
  `drgrpo_advantages` is only the first half; pair it with that loss_agg.

The std is the unbiased sample std (ddof = 1, as in verl and TRL), with a denominator guarded
at 1 so a group of one kept sequence gives A = 0 instead of 0/0.

TRM's sequence mask M and the group baseline (`baseline=`):
  "all" (the default): mean and std over all G rollouts of the group, masked or not.
    The TRM paper's masked surrogate is L_masked = E_roll[M * A * sum_t rho_t] (Sec. 4.2),
    with A measured against the baseline b = J(pi_roll) (Sec. 2.2: b = J(pi_roll) makes
    L = L'). Every rollout is an unbiased sample of J(pi_roll), accepted or not, so the group
    mean over all G is the estimator of b the paper's analysis assumes. M is a property of the
    policy pair (pi_theta vs pi_roll), not of the reward; restricting the baseline to accepted
    rollouts would estimate E[R | accepted] instead, which is biased towards short responses
    (TRM-max accepts with probability (1 - p)^T) and moves whenever M changes.
    Practically, "all" lets the learner compute advantages once per rollout batch, before any
    mask exists, and keep them fixed across minibatches and epochs while M is recomputed
    from the current pi_theta at every step. Masked rollouts still leave the loss: the
    objectives multiply every per-token term by M.
  "kept": mean and std over the rollouts with seq_mask = 1 only; masked rollouts get A = 0.
    Needs the mask up front, so advantages must be recomputed whenever M changes. Offered
    for ablations (e.g. a mask computed once at rollout time).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

BASELINES = ("all", "kept")


def group_advantages(rewards: jax.Array, *, group_size: int, normalize_std: bool,
                     eps: float = 1e-6, seq_mask: Optional[jax.Array] = None,
                     baseline: str = "all") -> jax.Array:
  """Group-relative advantages.

  Args:
    rewards: [B] scalar reward per rollout, groups of `group_size` contiguous rows.
    group_size: G, responses per prompt; B must be a multiple of it.
    normalize_std: divide by the group's std (GRPO) or not (Dr.GRPO / plain mean baseline).
    eps: added to the std so that a group with equal rewards gives A = 0, not 0/0.
    seq_mask: [B] TRM sequence mask (1 = keep); only read when baseline="kept".
    baseline: "all" or "kept", see the module docstring.
  Returns:
    [B] float32 advantages.
  """
  rewards = jnp.asarray(rewards)
  if rewards.ndim != 1:
    raise ValueError(f"rewards must be [B], got shape {rewards.shape}")
  if not isinstance(group_size, int) or group_size < 1:
    raise ValueError(f"group_size must be a positive int, got {group_size!r}")
  B = rewards.shape[0]
  if B % group_size:
    raise ValueError(f"rewards batch B={B} is not a multiple of group_size={group_size}")
  if baseline not in BASELINES:
    raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")
  if baseline == "kept":
    if seq_mask is None:
      raise ValueError('baseline="kept" needs seq_mask [B]')
    if jnp.shape(seq_mask) != (B,):
      raise ValueError(f"seq_mask must be [B]=({B},), got shape {jnp.shape(seq_mask)}")
    member = jax.lax.stop_gradient(jnp.asarray(seq_mask)).astype(jnp.float32)
  else:
    member = jnp.ones((B,), jnp.float32)

  r = rewards.astype(jnp.float32).reshape(-1, group_size)          # [B/G, G]
  w = member.reshape(-1, group_size)                               # [B/G, G]
  n = jnp.sum(w, axis=1, keepdims=True)                            # [B/G, 1]
  mean = jnp.sum(w * r, axis=1, keepdims=True) / jnp.maximum(n, 1.0)
  centred = (r - mean) * w   # non-members get A = 0 (they have no baseline to compare with)
  if normalize_std:
    var = jnp.sum(centred**2, axis=1, keepdims=True) / jnp.maximum(n - 1.0, 1.0)
    centred = centred / (jnp.sqrt(var) + eps)
  return centred.reshape(B)


def drgrpo_advantages(rewards: jax.Array, *, group_size: int,
                      seq_mask: Optional[jax.Array] = None,
                      baseline: str = "all") -> jax.Array:
  """Dr.GRPO's advantage: r - group mean, no std (Liu et al. 2025, "Understanding R1-Zero").

  Only half of Dr.GRPO: the other half is the loss aggregation without per-sequence length
  normalisation, loss_agg="seq-mean-token-sum-norm" in `trm_jax.rl.objectives`.
  """
  return group_advantages(rewards, group_size=group_size, normalize_std=False,
                          seq_mask=seq_mask, baseline=baseline)
