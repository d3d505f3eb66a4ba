"""Policy-gradient objectives for LLM RL, each taking TRM's sequence mask as an input.

Every objective is a keyword-only pure function returning (loss, metrics), where `loss` is the
scalar to *minimise* (minus the surrogate) and `metrics` a dict of fp32 scalars. Inputs:

  logp_theta     [B, T]  log pi_theta(y_t | c_t) of the sampled tokens; the ONLY input that
                         gradients flow into (every other input is stop-gradient'ed here).
  logp_roll      [B, T]  the rollout policy's log-probs of the same tokens.
  advantages     [B] or [B, T]  (one per sequence, e.g. GRPO, or one per token).
  response_mask  [B, T]  1 on generated tokens, 0 on prompt and padding.
  seq_mask       [B]     TRM's M(x, y) in {0, 1}, 1 = keep (computed by `trm_jax.trm`).
  logp_old       [B, T]  PPO's behaviour policy; only objectives registered with
                         `uses_logp_old` (ppo_clip, gspo, cispo) take it; defaults to
                         logp_roll.
  logp_ref, kl_beta      optional k3 KL penalty to a reference policy (both or neither).
  token_weights  [B, T]  optional fixed per-token weights on the policy-gradient term
                         (Sparse-RL's, `trm_jax.rl.sparse_rl`; token-level TRM criteria).
  loss_agg, normalizer, max_len   aggregation, below.

Per-token terms (rho = pi_theta / pi_roll, r = pi_theta / pi_old, both from log space):
  trm_surrogate  -A rho                         TRM paper Sec. 4.2: L_masked = E[M A sum_t rho_t]
  ppo_clip       max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), and for A < 0 at most
                 -A c (dual clip, Ye et al. 2020)
  tis            -sg(min(rho, C)) A log pi_theta   (truncated IS, Yao et al. 2025: a REINFORCE
                 term re-weighted by the truncated, gradient-free ratio; its gradient is
                 min(rho, C) A grad log pi_theta. -A min(rho, C) has the same gradient below C
                 but none above it: truncated tokens would drop out instead of counting C)
  cispo          -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_theta   (CISPO, MiniMax-M1,
                 Chen et al. 2025, Eq. 4: the clipped IS weight is a gradient-free coefficient,
                 so unlike PPO no token's gradient is ever zeroed, only bounded)
  gspo           max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high)) with the sequence ratio
                 s_b = exp(mean_t log r_bt) (GSPO, Zheng et al. 2025, Eq. 5-7), written per
                 token as GSPO-token (their Eq. 13): s_bt = sg(s_b) pi_theta(y_t) /
                 sg(pi_theta(y_t)) has the value s_b at every token and the gradient
                 s_b grad log pi_theta(y_t), so with loss_agg="seq-mean-token-mean" the loss
                 and its gradient are exactly the paper's sum_b M_b l_b / N_seq
Token masking (-A rho 1[|log rho| <= tau], the baseline the TRM paper argues against: it
changes the loss, not the policy pair, so the trust region stays violated) is not an objective
here but the `trm_jax.trm` criterion "token_mask", whose token mask the learner multiplies into
token_weights of any objective.
Each is then multiplied by M[b] (masked sequences leave the loss entirely, the KL term too),
by response_mask and by token_weights, and aggregated.

Aggregation (`loss_agg`), with w[b, t] those multipliers and N the normaliser:
  "token-mean"               sum_bt w l / N_tok,          N_tok = number of response tokens
  "seq-mean-token-mean"      sum_b (sum_t w l / |y_b|) / N_seq
  "seq-mean-token-sum"       sum_bt w l / N_seq           (the paper's E_roll[M A sum_t rho_t])
  "seq-mean-token-sum-norm"  sum_bt w l / (N_seq max_len) (Dr.GRPO: constant length normaliser)
  N_seq counts sequences with at least one response token (padding rows do not count).
Normalisers count ALL rollouts, masked or not, because the paper's surrogate is an expectation
over pi_roll with M inside: dividing by the kept count would instead estimate E[. | accepted],
silently scaling the step by 1 / (1 - rejection rate). A useful consequence: N depends only on
response_mask, so the learner can compute it for the whole batch before the forward pass and
pass it as `normalizer` to every microbatch; summing microbatch losses then equals the one big
batch loss exactly, for every mode (`trm_jax.rl.optim.accumulate_gradients`). All
denominators are clipped at 1.

Numerics: log-ratios are formed in fp32 and clamped to +-LOG_RATIO_CLAMP before `exp`, so
ratios and their gradients stay finite in fp32 (exp overflows near 88.7); beyond e^20 the
ratio is held constant (no gradient), a regime far outside any trust region, whose sequences
TRM masks. Non-response positions are zeroed *before* the subtraction, so garbage (even inf or
NaN) at prompt or padding positions never reaches the loss or the gradient.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from trm_jax import config as config_lib
from trm_jax.registry import Registry, no_check

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm")

# |log ratio| cap before exp: e^20 ~ 4.9e8 keeps rho * A * T and its gradient far below the
# fp32 maximum (3.4e38) for any realistic T and advantage.
LOG_RATIO_CLAMP = 20.0

sg = jax.lax.stop_gradient


# ---------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------
def _check_agg(loss_agg: str, max_len: Optional[int]) -> None:
  if loss_agg not in LOSS_AGG_MODES:
    raise ValueError(f"loss_agg must be one of {LOSS_AGG_MODES}, got {loss_agg!r}")
  if loss_agg == "seq-mean-token-sum-norm":
    if max_len is None or max_len < 1:
      raise ValueError('loss_agg="seq-mean-token-sum-norm" needs max_len >= 1 (the constant '
                       f'length normaliser, e.g. the generation budget), got {max_len!r}')


def loss_normalizer(response_mask: jax.Array, *, loss_agg: str,
                    max_len: Optional[int] = None) -> jax.Array:
  """The denominator N of `loss_agg` for this batch: [] float32, >= 1.

  Compute it once on the full batch and pass it as `normalizer` to each microbatch to make
  gradient accumulation equal the big batch.
  """
  _check_agg(loss_agg, max_len)
  rm = sg(jnp.asarray(response_mask)).astype(jnp.float32)           # [B, T]
  if loss_agg == "token-mean":
    n = jnp.sum(rm)
  else:
    n = jnp.sum((jnp.sum(rm, axis=1) > 0).astype(jnp.float32))       # N_seq
    if loss_agg == "seq-mean-token-sum-norm":
      n = n * float(max_len)
  return jnp.maximum(n, 1.0)


def aggregate(per_token: jax.Array, weights: jax.Array, response_mask: jax.Array, *,
              loss_agg: str, normalizer: Optional[jax.Array] = None,
              max_len: Optional[int] = None) -> jax.Array:
  """sum_bt weights * per_token (/ |y_b| for seq-mean-token-mean) / N, in fp32.

  Args:
    per_token: [B, T] per-token loss terms.
    weights: [B, T] multipliers (response mask, sequence mask, token weights), no gradient.
    response_mask: [B, T] defines |y_b| and the default normaliser.
    normalizer: [] the global N; None computes it from this batch's response_mask.
  """
  _check_agg(loss_agg, max_len)
  w = sg(weights).astype(jnp.float32)
  if loss_agg == "seq-mean-token-mean":
    seq_len = jnp.sum(sg(response_mask).astype(jnp.float32), axis=1, keepdims=True)  # [B, 1]
    w = w / jnp.maximum(seq_len, 1.0)
  if normalizer is None:
    normalizer = loss_normalizer(response_mask, loss_agg=loss_agg, max_len=max_len)
  return jnp.sum(w * per_token.astype(jnp.float32)) / sg(normalizer)


# ---------------------------------------------------------------------------------------------
# Shared plumbing
# ---------------------------------------------------------------------------------------------
def _check_shapes(logp_theta, logp_roll, advantages, response_mask, seq_mask, logp_old,
                  logp_ref, token_weights) -> None:
  if jnp.ndim(logp_theta) != 2:
    raise ValueError(f"logp_theta must be [B, T], got shape {jnp.shape(logp_theta)}")
  B, T = jnp.shape(logp_theta)
  for name, x in (("logp_roll", logp_roll), ("response_mask", response_mask),
                  ("logp_old", logp_old), ("logp_ref", logp_ref),
                  ("token_weights", token_weights)):
    if x is not None and jnp.shape(x) != (B, T):
      raise ValueError(f"{name} must be [B, T]=({B}, {T}) like logp_theta, got shape "
                       f"{jnp.shape(x)}")
  if jnp.shape(seq_mask) != (B,):
    raise ValueError(f"seq_mask must be [B]=({B},), got shape {jnp.shape(seq_mask)}")
  if jnp.shape(advantages) not in ((B,), (B, T)):
    raise ValueError(f"advantages must be [B]=({B},) or [B, T]=({B}, {T}), got shape "
                     f"{jnp.shape(advantages)}")


def _log_ratio(logp_num: jax.Array, logp_den: jax.Array, valid: jax.Array) -> jax.Array:
  """Clamped fp32 log(p_num / p_den) [B, T], 0 where not valid (no NaN in value or gradient)."""
  num = jnp.where(valid, logp_num.astype(jnp.float32), 0.0)
  den = jnp.where(valid, logp_den.astype(jnp.float32), 0.0)
  return jnp.clip(num - den, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _masked_mean(x: jax.Array, m: jax.Array) -> jax.Array:
  return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


def _finish(pg_token: jax.Array, *, logp_theta, log_rho, response_mask, seq_mask,
            token_keep, token_weights, logp_ref, kl_beta, loss_agg, normalizer, max_len,
            extra_metrics) -> tuple[jax.Array, dict]:
  """Weights, optional k3 KL, aggregation and the metrics common to every objective."""
  rm = sg(response_mask).astype(jnp.float32)                           # [B, T]
  m_seq = sg(seq_mask).astype(jnp.float32)[:, None] * rm               # [B, T] kept sequences
  w_pg = m_seq * token_keep                                            # [B, T]
  if token_weights is not None:
    w_pg = w_pg * sg(token_weights).astype(jnp.float32)
  pg_loss = aggregate(pg_token, w_pg, rm, loss_agg=loss_agg, normalizer=normalizer,
                      max_len=max_len)
  loss = pg_loss
  metrics = {}
  if logp_ref is not None:
    # k3 estimator of KL(pi_theta || pi_ref) per token (Schulman 2020; GRPO, Shao et al. 2024):
    # exp(l) - l - 1 with l = log pi_ref - log pi_theta; >= 0, unbiased under pi_theta samples.
    valid = rm > 0
    log_q = _log_ratio(sg(logp_ref), logp_theta, valid)
    kl_token = jnp.exp(log_q) - log_q - 1.0                            # [B, T]
    kl = aggregate(kl_token, m_seq, rm, loss_agg=loss_agg, normalizer=normalizer,
                   max_len=max_len)
    loss = loss + kl_beta * kl
    metrics["kl_ref"] = sg(_masked_mean(kl_token, m_seq))
  has_tokens = (jnp.sum(rm, axis=1) > 0).astype(jnp.float32)          # [B]
  rho = jnp.exp(sg(log_rho))
  metrics.update({
      "loss": sg(loss),
      "pg_loss": sg(pg_loss),
      "ratio_mean": _masked_mean(rho, m_seq),
      "log_ratio_abs_max": jnp.max(jnp.abs(sg(log_rho)) * rm, initial=0.0),
      "seq_kept_frac": jnp.sum(sg(seq_mask).astype(jnp.float32) * has_tokens)
                       / jnp.maximum(jnp.sum(has_tokens), 1.0),
      "token_kept_frac": _masked_mean((w_pg > 0).astype(jnp.float32), rm),
  })
  metrics.update({k: sg(v) for k, v in extra_metrics.items()})
  return loss, metrics


def _prepare(logp_theta, logp_roll, advantages, response_mask, seq_mask, logp_old, logp_ref,
             kl_beta, token_weights, loss_agg, max_len, *, uses_old: bool, name: str):
  _check_shapes(logp_theta, logp_roll, advantages, response_mask, seq_mask, logp_old,
                logp_ref, token_weights)
  _check_agg(loss_agg, max_len)
  if (logp_ref is None) != (kl_beta is None):
    raise ValueError("logp_ref and kl_beta go together: pass both for a KL penalty or neither "
                     f"(got logp_ref={'set' if logp_ref is not None else None}, "
                     f"kl_beta={kl_beta!r})")
  if logp_old is not None and not uses_old:
    readers = ", ".join(sorted(n for n, o in OBJECTIVES.items() if o.uses_logp_old))
    raise ValueError(f"logp_old is read only by objectives registered with uses_logp_old "
                     f"({readers}); {name} measures its ratio against logp_roll")
  valid = sg(response_mask) > 0                                        # [B, T] bool
  adv = sg(jnp.asarray(advantages)).astype(jnp.float32)
  adv = jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, valid.shape)  # [B, T]
  log_rho = _log_ratio(logp_theta, sg(logp_roll), valid)              # [B, T]
  return valid, adv, log_rho


def _check_clip(low, high, *, low_max: float, inclusive: bool = False) -> None:
  """0 <= low < low_max (<= with `inclusive`) and high >= 0: the clip range [1 - low, 1 + high]
  holds 1 and stays positive (low = 1 inclusive: no lower bound, the ratio being > 0)."""
  ok_low = 0.0 <= low <= low_max if inclusive else 0.0 <= low < low_max
  if not ok_low or high < 0.0:
    span = f"[0, {low_max:g}]" if inclusive else f"[0, {low_max:g})"
    raise ValueError(f"clip_eps_low must be in {span} and clip_eps_high >= 0, got "
                     f"{low!r}, {high!r}")


def _old_log_ratio(logp_theta, logp_old, log_rho, valid):
  """log r = log pi_theta / pi_old [B, T] (clamped, 0 off the response); pi_old defaults to
  pi_roll (then r = rho)."""
  return log_rho if logp_old is None else _log_ratio(logp_theta, sg(logp_old), valid)


def _reinforce_term(weight, adv, logp_theta, valid):
  """-weight A log pi_theta per token [B, T]: a REINFORCE term with a gradient-free weight;
  log pi_theta is zeroed off the response before the product (garbage there never enters)."""
  return -sg(weight) * adv * jnp.where(valid, logp_theta.astype(jnp.float32), 0.0)


# ---------------------------------------------------------------------------------------------
# Objectives
# ---------------------------------------------------------------------------------------------
def trm_surrogate(*, logp_theta, logp_roll, advantages, response_mask, seq_mask, loss_agg,
                  logp_old=None, logp_ref=None, kl_beta=None, token_weights=None,
                  normalizer=None, max_len=None) -> tuple[jax.Array, dict]:
  """The TRM paper's masked surrogate, per token -M A rho_t (Sec. 4.2).

  With loss_agg="seq-mean-token-sum" the loss is exactly -(1/N_seq) sum_b M_b A_b sum_t rho_t,
  the sample mean of L_masked; other modes re-weight the same per-token terms.
  """
  valid, adv, log_rho = _prepare(logp_theta, logp_roll, advantages, response_mask, seq_mask,
                                 logp_old, logp_ref, kl_beta, token_weights, loss_agg, max_len,
                                 uses_old=False, name="trm_surrogate")
  pg_token = -adv * jnp.exp(log_rho)                                   # [B, T]
  return _finish(pg_token, logp_theta=logp_theta, log_rho=log_rho,
                 response_mask=response_mask, seq_mask=seq_mask, token_keep=1.0,
                 token_weights=token_weights, logp_ref=logp_ref, kl_beta=kl_beta,
                 loss_agg=loss_agg, normalizer=normalizer, max_len=max_len, extra_metrics={})


def ppo_clip(*, logp_theta, logp_roll, advantages, response_mask, seq_mask, loss_agg,
             clip_eps_low: float, clip_eps_high: float, dual_clip_c: Optional[float],
             logp_old=None, logp_ref=None, kl_beta=None, token_weights=None, normalizer=None,
             max_len=None) -> tuple[jax.Array, dict]:
  """Token-level PPO-clip (Schulman et al. 2017) with asymmetric clip and dual clip.

  r = pi_theta / pi_old (pi_old = logp_old, default logp_roll). Per token:
    l = max(-A r, -A clip(r, 1 - clip_eps_low, 1 + clip_eps_high))
    l = min(l, -A c) where A < 0           (dual clip, Ye et al. 2020; dual_clip_c=None: off)
  """
  _check_clip(clip_eps_low, clip_eps_high, low_max=1.0)
  if dual_clip_c is not None and dual_clip_c <= 1.0:
    raise ValueError(f"dual_clip_c must be > 1 (or None to disable), got {dual_clip_c!r}")
  valid, adv, log_rho = _prepare(logp_theta, logp_roll, advantages, response_mask, seq_mask,
                                 logp_old, logp_ref, kl_beta, token_weights, loss_agg, max_len,
                                 uses_old=True, name="ppo_clip")
  r = jnp.exp(_old_log_ratio(logp_theta, logp_old, log_rho, valid))   # [B, T]
  pg1 = -adv * r
  pg2 = -adv * jnp.clip(r, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
  pg_token = jnp.maximum(pg1, pg2)
  m = sg(response_mask).astype(jnp.float32) * sg(seq_mask).astype(jnp.float32)[:, None]
  extra = {"clip_frac": _masked_mean((pg2 > pg1).astype(jnp.float32), m)}
  if dual_clip_c is not None:
    pg3 = -adv * dual_clip_c
    dual = (adv < 0) & (pg_token > pg3)
    pg_token = jnp.where(adv < 0, jnp.minimum(pg_token, pg3), pg_token)
    extra["dual_clip_frac"] = _masked_mean(dual.astype(jnp.float32), m)
  extra["ppo_ratio_mean"] = _masked_mean(sg(r), m)
  return _finish(pg_token, logp_theta=logp_theta, log_rho=log_rho,
                 response_mask=response_mask, seq_mask=seq_mask, token_keep=1.0,
                 token_weights=token_weights, logp_ref=logp_ref, kl_beta=kl_beta,
                 loss_agg=loss_agg, normalizer=normalizer, max_len=max_len, extra_metrics=extra)


def truncated_is(*, logp_theta, logp_roll, advantages, response_mask, seq_mask, loss_agg,
                 tis_cap: float, logp_old=None, logp_ref=None, kl_beta=None,
                 token_weights=None, normalizer=None, max_len=None) -> tuple[jax.Array, dict]:
  """Truncated importance sampling: per token -sg(min(rho, C)) A log pi_theta (C = tis_cap).

  The loss value is not a surrogate of J (it is a REINFORCE loss); only its gradient matters:
  min(rho, C) A grad log pi_theta, the IS-corrected policy gradient with the weight truncated
  at C to bound its variance (Ionides 2008; Yao et al. 2025 use C = 2 for rollout mismatch).
  """
  if tis_cap < 1.0:
    raise ValueError(f"tis_cap must be >= 1 (C < 1 would down-weight on-policy tokens), got "
                     f"{tis_cap!r}")
  valid, adv, log_rho = _prepare(logp_theta, logp_roll, advantages, response_mask, seq_mask,
                                 logp_old, logp_ref, kl_beta, token_weights, loss_agg, max_len,
                                 uses_old=False, name="tis")
  pg_token = _reinforce_term(jnp.minimum(jnp.exp(log_rho), tis_cap), adv, logp_theta, valid)
  m = sg(response_mask).astype(jnp.float32) * sg(seq_mask).astype(jnp.float32)[:, None]
  extra = {"tis_trunc_frac": _masked_mean((log_rho > jnp.log(tis_cap)).astype(jnp.float32), m)}
  return _finish(pg_token, logp_theta=logp_theta, log_rho=log_rho,
                 response_mask=response_mask, seq_mask=seq_mask, token_keep=1.0,
                 token_weights=token_weights, logp_ref=logp_ref, kl_beta=kl_beta,
                 loss_agg=loss_agg, normalizer=normalizer, max_len=max_len, extra_metrics=extra)


def cispo(*, logp_theta, logp_roll, advantages, response_mask, seq_mask, loss_agg,
          clip_eps_low: float, clip_eps_high: float, logp_old=None, logp_ref=None,
          kl_beta=None, token_weights=None, normalizer=None, max_len=None
          ) -> tuple[jax.Array, dict]:
  """CISPO (MiniMax-M1, Chen et al. 2025, Eq. 4): per token
  -sg(clip(r, 1 - clip_eps_low, 1 + clip_eps_high)) A log pi_theta, r = pi_theta / pi_old.

  Like `tis` a REINFORCE term under a gradient-free weight, with PPO's ratio (against logp_old,
  default logp_roll) and a two-sided clip. Its gradient is clip(r) A grad log pi_theta: a
  token outside the range keeps its gradient at the clipped weight, where PPO-clip drops it.
  The paper sets no lower bound (clip_eps_low = 1: the weight is only capped above).
  """
  _check_clip(clip_eps_low, clip_eps_high, low_max=1.0, inclusive=True)
  valid, adv, log_rho = _prepare(logp_theta, logp_roll, advantages, response_mask, seq_mask,
                                 logp_old, logp_ref, kl_beta, token_weights, loss_agg, max_len,
                                 uses_old=True, name="cispo")
  log_r = _old_log_ratio(logp_theta, logp_old, log_rho, valid)        # [B, T]
  # Bounds in log space: log(1 - clip_eps_low) is -inf for no lower bound, and no exp overflows.
  lo, hi = math.log1p(-clip_eps_low) if clip_eps_low < 1.0 else -math.inf, \
      math.log1p(clip_eps_high)
  pg_token = _reinforce_term(jnp.exp(jnp.clip(log_r, lo, hi)), adv, logp_theta, valid)
  m = sg(response_mask).astype(jnp.float32) * sg(seq_mask).astype(jnp.float32)[:, None]
  extra = {"cispo_clip_frac": _masked_mean(((log_r < lo) | (log_r > hi)).astype(jnp.float32),
                                           m),
           "ppo_ratio_mean": _masked_mean(jnp.exp(sg(log_r)), m)}
  return _finish(pg_token, logp_theta=logp_theta, log_rho=log_rho,
                 response_mask=response_mask, seq_mask=seq_mask, token_keep=1.0,
                 token_weights=token_weights, logp_ref=logp_ref, kl_beta=kl_beta,
                 loss_agg=loss_agg, normalizer=normalizer, max_len=max_len, extra_metrics=extra)


def gspo(*, logp_theta, logp_roll, advantages, response_mask, seq_mask, loss_agg,
         clip_eps_low: float, clip_eps_high: float, logp_old=None, logp_ref=None, kl_beta=None,
         token_weights=None, normalizer=None, max_len=None) -> tuple[jax.Array, dict]:
  """GSPO (Zheng et al. 2025): PPO-clip on the sequence's length-normalised ratio.

  s_b = exp((1 / |y_b|) sum_t log r_bt), r = pi_theta / pi_old (logp_old, default logp_roll),
  l_b = max(-A_b s_b, -A_b clip(s_b, 1 - clip_eps_low, 1 + clip_eps_high)) (their Eq. 5-7;
  the paper clips at 3e-4 / 4e-4: s_b is a geometric mean, far closer to 1 than a token's r).
  Written per token as GSPO-token (their Eq. 13), which also takes [B, T] advantages and token
  weights: with [B] advantages and loss_agg="seq-mean-token-mean", the paper's, the loss is
  sum_b M_b l_b / N_seq and its gradient the sequence objective's; another loss_agg weights
  the same per-token terms as it does for every objective.
  """
  _check_clip(clip_eps_low, clip_eps_high, low_max=1.0)
  valid, adv, log_rho = _prepare(logp_theta, logp_roll, advantages, response_mask, seq_mask,
                                 logp_old, logp_ref, kl_beta, token_weights, loss_agg, max_len,
                                 uses_old=True, name="gspo")
  log_r = _old_log_ratio(logp_theta, logp_old, log_rho, valid)        # [B, T], 0 off response
  n_tok = jnp.maximum(jnp.sum(valid, axis=1), 1).astype(jnp.float32)  # [B] |y_b|
  log_s = jnp.sum(log_r, axis=1) / n_tok                               # [B] log s_b
  # GSPO-token: the value log s_b at every token, the gradient that of log pi_theta(y_t).
  log_s_tok = sg(log_s)[:, None] + log_r - sg(log_r)                   # [B, T]
  s_tok = jnp.exp(log_s_tok)
  pg1 = -adv * s_tok
  pg2 = -adv * jnp.clip(s_tok, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
  pg_token = jnp.maximum(pg1, pg2)
  m_seq = sg(seq_mask).astype(jnp.float32) * (jnp.sum(valid, axis=1) > 0)   # [B]
  clipped = (log_s < jnp.log1p(-clip_eps_low)) | (log_s > jnp.log1p(clip_eps_high))
  extra = {"gspo_clip_frac": jnp.sum(clipped * m_seq) / jnp.maximum(jnp.sum(m_seq), 1.0),
           "gspo_seq_ratio_mean": jnp.sum(jnp.exp(sg(log_s)) * m_seq)
                                  / jnp.maximum(jnp.sum(m_seq), 1.0)}
  return _finish(pg_token, logp_theta=logp_theta, log_rho=log_rho,
                 response_mask=response_mask, seq_mask=seq_mask, token_keep=1.0,
                 token_weights=token_weights, logp_ref=logp_ref, kl_beta=kl_beta,
                 loss_agg=loss_agg, normalizer=normalizer, max_len=max_len, extra_metrics=extra)


# ---------------------------------------------------------------------------------------------
# Registry: the trainer config names the objective (rl.objective).
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Objective:
  """A registered objective: its loss, what it reads beyond the inputs every one takes, and the
  check of its own settings."""
  loss: Callable[..., tuple[jax.Array, dict]]   # keyword-only, as described above
  config_fields: tuple = ()             # the `rl` settings passed to `loss` (LearnerConfig.
                                        #   objective_kwargs): a key, passed under its own name,
                                        #   or a (keyword, key) pair: gspo's clip_eps_low is
                                        #   rl.gspo_clip_eps_low, its own setting, not PPO's
  uses_logp_old: bool = False           # reads LearnerBatch.logp_old (PPO's behaviour policy)
  check: Callable = no_check            # check(config): its settings' values, run by
                                        #   config.validate when it is rl.objective; raises
                                        #   config.ConfigError naming the key

  @property
  def settings(self) -> tuple[tuple[str, str], ...]:
    """((keyword of `loss`, key of the config's `rl` section), ...)."""
    return tuple((f, f) if isinstance(f, str) else (f[0], f[1]) for f in self.config_fields)


OBJECTIVES: Registry[Objective] = Registry("objective")


def register_objective(name: str, loss: Callable[..., tuple[jax.Array, dict]], *,
                       config_fields: tuple = (), uses_logp_old: bool = False,
                       check: Callable = no_check) -> Objective:
  """Adds `loss` under `name` (the value of `rl.objective`); `config_fields` name the `rl`
  settings it takes as keyword arguments (see `Objective`), `check(config)` validates them."""
  return OBJECTIVES.register(name, Objective(loss, tuple(config_fields), uses_logp_old, check))


def _check_clip_keys(low_key: str, high_key: str, *, inclusive: bool = False):
  """A check of an objective's clip range rl.<low_key> / rl.<high_key> (see _check_clip)."""
  def check(c) -> None:
    r, who = c.rl, f"rl.objective={c.rl.objective!r}"
    low = r[low_key]
    config_lib.require(0.0 <= low <= 1.0 if inclusive else 0.0 <= low < 1.0, [f"rl.{low_key}"],
                       f"must be in [0, 1{']' if inclusive else ')'} ({who}), got {low!r}")
    config_lib.require(r[high_key] >= 0.0, [f"rl.{high_key}"],
                       f"must be >= 0 ({who}), got {r[high_key]!r}")
  return check


def _check_ppo_clip(c) -> None:
  _check_clip_keys("clip_eps_low", "clip_eps_high")(c)
  config_lib.require(c.rl.dual_clip_c > 1.0, ["rl.dual_clip_c"],
                     f"must be > 1 (rl.objective='ppo_clip'), got {c.rl.dual_clip_c!r}")


def _check_tis(c) -> None:
  config_lib.require(c.rl.tis_cap >= 1.0, ["rl.tis_cap"],
                     f"must be >= 1 (rl.objective='tis'; a cap below 1 down-weights on-policy "
                     f"tokens), got {c.rl.tis_cap!r}")


register_objective("trm_surrogate", trm_surrogate)
register_objective("ppo_clip", ppo_clip, config_fields=("clip_eps_low", "clip_eps_high",
                                                        "dual_clip_c"), uses_logp_old=True,
                   check=_check_ppo_clip)
register_objective("tis", truncated_is, config_fields=("tis_cap",), check=_check_tis)
register_objective("gspo", gspo, config_fields=(("clip_eps_low", "gspo_clip_eps_low"),
                                                ("clip_eps_high", "gspo_clip_eps_high")),
                   uses_logp_old=True,
                   check=_check_clip_keys("gspo_clip_eps_low", "gspo_clip_eps_high"))
register_objective("cispo", cispo, config_fields=(("clip_eps_low", "cispo_clip_eps_low"),
                                                  ("clip_eps_high", "cispo_clip_eps_high")),
                   uses_logp_old=True,
                   check=_check_clip_keys("cispo_clip_eps_low", "cispo_clip_eps_high",
                                          inclusive=True))


def get_objective(name: str) -> Objective:
  return OBJECTIVES.get(name)


def compute_loss(objective: str, **kwargs) -> tuple[jax.Array, dict]:
  """`get_objective(objective).loss(**kwargs)`: the config-facing entry point."""
  return get_objective(objective).loss(**kwargs)
