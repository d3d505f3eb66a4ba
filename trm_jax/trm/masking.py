"""Trust Region Masking criteria: which sampled sequences enter the masked surrogate.

TRM (paper Sec. 4) replaces the surrogate by L_masked = E_roll[M(x, y) A sum_t rho_t] with a
stop-gradient sequence mask M. Criteria are chosen by name from the config and ANDed:

  name             keeps a sequence when                                thresholds   needs
  trm_max_kl       max_t KL_t <= delta                                  delta        kl
  trm_max_tv       max_t TV_t <= eps                                    eps          tv
  trm_avg_kl       mean_t KL_t <= delta_avg                             delta_avg    kl
  trm_max_avg_kl   both of the two above                                delta,       kl
                                                                        delta_avg
  k2_max           max_t (log rho_t)^2 / 2 <= delta_k2                  delta_k2     log_rho
  k3_avg           mean_t (rho_t - 1 - log rho_t) <= delta_k3           delta_k3     log_rho
  ln_trm           sum_t w_t |rho_t - 1| <= delta_w sum_t w_t,          eps, delta,  log_rho
                   w_t = min(1, (T-t) eps, sqrt((T-t) delta / 2))       delta_w
  ser              mean_t |rho_t - 1| <= delta_ser                      delta_ser    log_rho
  seq_mis          sum_t log rho_t <= log seq_mis_cap                   seq_mis_cap  log_rho
                   (sequence-level masked IS: the sequence's ratio prod_t rho_t at most the
                   cap; verl's sequence rejection / TRL's "sequence_mask", cap 2.0)
  geo_mean         |mean_t log rho_t| <= geo_mean_tau                   geo_mean_tau log_rho
                   (the geometric mean of the ratios within exp(+-tau) of 1; verl's geo_rs,
                   bounds 0.999 / 1.001, i.e. tau = 0.001)
  token_mask       (baseline, NOT TRM) drops tokens with |log rho_t| > tau;  tau     log_rho
                   keeps every sequence, so the trust region stays violated (Sec. 4.1)

KL_t / TV_t are the per-token divergences of `divergence.py` (exact from full logits, or the
top-k + tail lower bounds; the criterion cannot tell, so a lower bound makes it more lenient).
In LN-TRM, T and t are the sequence's own response length and 1-based position in it, so the
threshold delta_w Z(T) does not grow with T (App. F.2). Every criterion is monotone in its own
threshold (delta_w for ln_trm; its eps and delta shape the weights instead). seq_mis and
geo_mean are the sequence masks practitioners run beside TRM; both compare in log space (a
product of T ratios overflows or underflows fp32 long before it is compared with a cap).

Criteria are entries of the CRITERIA registry (`trm_jax.registry`); each names the thresholds
it reads (keys of the config's `trm` section), the TokenStats fields it needs, and checks its
own thresholds (`check(config)`, run by `config.validate` for the criteria in trm.criteria).

Trainer interface:

  stats = token_stats(mask, logp_theta=..., logp_roll=..., logits_theta=..., logits_roll=...)
  res = apply_criteria(cfg.trm.criteria, cfg.trm.thresholds, stats)   # e.g. ("trm_max_kl",)
  loss_tokens = res.token_mask            # [B, T] = mask * seq_mask * AND of token criteria
  metrics.update(res.metrics)             # trm/reject_rate, trm/<name>/reject_rate, ...

`thresholds` is any mapping (dict, ConfigDict) holding at least the keys the chosen criteria
need. Sequences without a response token are kept (nothing to reject) and excluded from every
rate; their token_mask row is zero anyway.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from trm_jax import config as config_lib
from trm_jax.registry import Registry, no_check
from trm_jax.trm import divergence
from trm_jax.trm import monitors


@struct.dataclass
class TokenStats:
  """Per-token statistics of a rollout batch; fields not computed are None."""
  mask: jax.Array                        # [B, T] response mask, 1 = response token
  log_rho: Optional[jax.Array] = None    # [B, T] logp_theta - logp_roll of the sampled token
  kl: Optional[jax.Array] = None         # [B, T] KL(roll || theta) (exact or top-k lower bound)
  tv: Optional[jax.Array] = None         # [B, T] token TV (exact or top-k lower bound)


def token_stats(mask: jax.Array, *, logp_theta: Optional[jax.Array] = None,
                logp_roll: Optional[jax.Array] = None,
                logits_theta: Optional[jax.Array] = None,
                logits_roll: Optional[jax.Array] = None,
                roll_topk_logp: Optional[jax.Array] = None,
                roll_topk_ids: Optional[jax.Array] = None,
                chunk_size: int = divergence.DEFAULT_CHUNK) -> TokenStats:
  """Builds TokenStats from whatever the rollout recorded (see divergence.py for the routes).

  logp_* [B, T] give log_rho; logits_theta [B, T, V] with logits_roll [B, T, V] give exact
  kl/tv, or with roll_topk_logp / roll_topk_ids [B, T, k] the top-k + tail lower bounds.
  """
  log_rho = kl = tv = None
  if (logp_theta is None) != (logp_roll is None):
    raise ValueError("token_stats: pass both `logp_theta` and `logp_roll`, or neither")
  if logp_theta is not None:
    log_rho = divergence.sample_estimators(logp_theta, logp_roll, mask)["log_rho"]
  if logits_theta is not None and logits_roll is not None:
    kl, tv = divergence.token_divergences(logits_theta, logits_roll, mask,
                                          chunk_size=chunk_size)
  elif logits_theta is not None and roll_topk_logp is not None:
    if roll_topk_ids is None:
      raise ValueError("token_stats: `roll_topk_logp` needs `roll_topk_ids`")
    kl, tv = divergence.topk_tail_divergences(logits_theta, roll_topk_logp, roll_topk_ids,
                                              mask, chunk_size=chunk_size)
  return TokenStats(mask=mask, log_rho=log_rho, kl=kl, tv=tv)


@struct.dataclass
class MaskResult:
  seq_mask: jax.Array     # [B] float32 in {0, 1}, stop-gradient: AND of sequence criteria
  token_mask: jax.Array   # [B, T] float32: response mask * seq_mask * AND of token criteria
  metrics: dict           # str -> [] scalars


# A criterion maps (stats, thresholds) to (seq_keep [B] bool, token_keep [B, T] bool or None,
# stats {short name: [B]} of the per-sequence statistics it thresholded).
CriterionFn = Callable[[TokenStats, Mapping], tuple]


@dataclasses.dataclass(frozen=True)
class Criterion:
  name: str
  thresholds: tuple[str, ...]   # keys it reads from the thresholds mapping (the `trm` section)
  needs: tuple[str, ...]        # TokenStats fields it reads
  fn: CriterionFn
  check: Callable = no_check    # check(config): its thresholds beyond the >= 0 every `trm` key
                                #   gets (config.validate); raises config.ConfigError


def _abs_rho_minus_one(log_rho):
  return jnp.abs(jnp.expm1(log_rho))  # |rho - 1| without forming rho - 1 by subtraction


def _trm_max_kl(s, th):
  m = divergence.seq_max(s.kl, s.mask)
  return m <= th["delta"], None, {"max_kl": m}


def _trm_max_tv(s, th):
  m = divergence.seq_max(s.tv, s.mask)
  return m <= th["eps"], None, {"max_tv": m}


def _trm_avg_kl(s, th):
  a = divergence.seq_mean(s.kl, s.mask)
  return a <= th["delta_avg"], None, {"avg_kl": a}


def _trm_max_avg_kl(s, th):
  m = divergence.seq_max(s.kl, s.mask)
  a = divergence.seq_mean(s.kl, s.mask)
  return (m <= th["delta"]) & (a <= th["delta_avg"]), None, {"max_kl": m, "avg_kl": a}


def _k2_max(s, th):
  m = divergence.seq_max(0.5 * jnp.square(s.log_rho), s.mask)
  return m <= th["delta_k2"], None, {"max_k2": m}


def _k3_avg(s, th):
  a = divergence.seq_mean(divergence.k3(s.log_rho), s.mask)
  return a <= th["delta_k3"], None, {"avg_k3": a}


def ln_trm_weights(mask: jax.Array, eps, delta) -> jax.Array:
  """[B, T] w_t = min(1, (T_i - t) eps, sqrt((T_i - t) delta / 2)) on response tokens (App. F.2).

  t is the 1-based position inside the response (cumsum of the mask, so prompts or padding in
  front of the response do not shift it) and T_i the sequence's response length.
  """
  valid = mask > 0
  t = jnp.cumsum(valid, axis=-1)                                      # [B, T] 1-based
  horizon = (jnp.sum(valid, axis=-1, keepdims=True) - t).astype(jnp.float32)   # T_i - t
  w = jnp.minimum(1.0, jnp.minimum(horizon * eps, jnp.sqrt(horizon * delta / 2.0)))
  return jnp.where(valid, w, 0.0)


def _ln_trm(s, th):
  w = ln_trm_weights(s.mask, th["eps"], th["delta"])                   # [B, T]
  W = jnp.sum(w * jnp.where(s.mask > 0, _abs_rho_minus_one(s.log_rho), 0.0), axis=-1)  # [B]
  Z = jnp.sum(w, axis=-1)                                              # [B]
  keep = W <= th["delta_w"] * Z
  # W / Z is what is compared with delta_w; Z = 0 (one-token responses) forces W = 0.
  return keep, None, {"w_ratio": W / jnp.maximum(Z, jnp.finfo(jnp.float32).tiny)}


def _ser(s, th):
  a = divergence.seq_mean(_abs_rho_minus_one(s.log_rho), s.mask)
  return a <= th["delta_ser"], None, {"ser": a}


def _token_mask(s, th):
  keep_tok = jnp.abs(s.log_rho) <= th["tau"]                           # [B, T]
  m = divergence.seq_max(jnp.abs(s.log_rho), s.mask)
  return jnp.ones(s.mask.shape[:1], bool), keep_tok, {"max_abs_log_rho": m}


def _seq_mis(s, th):
  # log prod_t rho_t = sum_t log rho_t, compared with log C: no product of T ratios is formed.
  log_w = divergence.seq_sum(s.log_rho, s.mask)
  return log_w <= jnp.log(jnp.float32(th["seq_mis_cap"])), None, {"log_seq_ratio": log_w}


def _geo_mean(s, th):
  a = jnp.abs(divergence.seq_mean(s.log_rho, s.mask))
  return a <= th["geo_mean_tau"], None, {"abs_mean_log_rho": a}


def _check_seq_mis(c) -> None:
  cap = c.trm.seq_mis_cap
  config_lib.require(cap >= 1.0, ["trm.seq_mis_cap"],
                     f"must be >= 1 (trm.criteria has 'seq_mis'; a cap below 1 rejects "
                     f"on-policy sequences, whose ratio is 1), got {cap!r}")


CRITERIA: Registry[Criterion] = Registry("TRM criterion")


def register_criterion(criterion: Criterion) -> Criterion:
  """Adds `criterion` under its name (an entry of the config's trm.criteria)."""
  return CRITERIA.register(criterion.name, criterion)


for _c in (
    Criterion("trm_max_kl", ("delta",), ("kl",), _trm_max_kl),
    Criterion("trm_max_tv", ("eps",), ("tv",), _trm_max_tv),
    Criterion("trm_avg_kl", ("delta_avg",), ("kl",), _trm_avg_kl),
    Criterion("trm_max_avg_kl", ("delta", "delta_avg"), ("kl",), _trm_max_avg_kl),
    Criterion("k2_max", ("delta_k2",), ("log_rho",), _k2_max),
    Criterion("k3_avg", ("delta_k3",), ("log_rho",), _k3_avg),
    Criterion("ln_trm", ("eps", "delta", "delta_w"), ("log_rho",), _ln_trm),
    Criterion("ser", ("delta_ser",), ("log_rho",), _ser),
    Criterion("token_mask", ("tau",), ("log_rho",), _token_mask),
    Criterion("seq_mis", ("seq_mis_cap",), ("log_rho",), _seq_mis, check=_check_seq_mis),
    Criterion("geo_mean", ("geo_mean_tau",), ("log_rho",), _geo_mean),
):
  register_criterion(_c)


def _validate(names: Sequence[str], thresholds: Mapping, stats: TokenStats):
  if isinstance(names, str):
    raise ValueError(f"criteria must be a sequence of names, got the string {names!r}")
  for n in names:
    c = CRITERIA.get(n)
    for k in c.thresholds:
      if k not in thresholds:
        raise ValueError(f"TRM criterion {n!r} needs threshold {k!r} (config "
                         f"`thresholds.{k}`); got keys {sorted(thresholds)}")
    for f in c.needs:
      if getattr(stats, f) is None:
        raise ValueError(f"TRM criterion {n!r} needs TokenStats.{f}, which was not computed "
                         "(see token_stats: kl/tv need logits, log_rho needs log-probs)")
      if getattr(stats, f).shape != stats.mask.shape:
        raise ValueError(f"TokenStats.{f} shape {getattr(stats, f).shape} != mask shape "
                         f"{stats.mask.shape}")


def apply_criteria(names: Sequence[str], thresholds: Mapping,
                   stats: TokenStats) -> MaskResult:
  """ANDs the named criteria into a sequence mask and a loss token mask, with metrics.

  Metrics: `trm/reject_rate` (AND of all, over sequences with a response token),
  `trm/masked_token_frac` (response tokens out of the loss), and per criterion
  `trm/<name>/reject_rate` plus the mean and max over sequences of each statistic it
  thresholded (`trm/<name>/<stat>_mean`, `_max`); token_mask also reports its token fraction.
  """
  _validate(names, thresholds, stats)
  mask = stats.mask
  valid_tok = mask > 0                                                 # [B, T]
  valid_row = jnp.any(valid_tok, axis=-1)                              # [B]
  seq_keep = jnp.ones(mask.shape[:1], bool)
  tok_keep = jnp.ones(mask.shape, bool)
  metrics = {}
  for n in names:
    keep, keep_tok, seq_stats = CRITERIA[n].fn(stats, thresholds)
    keep = keep | ~valid_row  # nothing to reject in a sequence without response tokens
    seq_keep = seq_keep & keep
    metrics[f"trm/{n}/reject_rate"] = monitors.rejection_rate(keep, mask)
    if keep_tok is not None:
      tok_keep = tok_keep & keep_tok
      metrics[f"trm/{n}/masked_token_frac"] = monitors.masked_token_fraction(keep_tok, mask)
    n_rows = jnp.maximum(jnp.sum(valid_row), 1)
    for k, v in seq_stats.items():
      v = jnp.where(valid_row, v, 0.0)
      metrics[f"trm/{n}/{k}_mean"] = jnp.sum(v) / n_rows
      metrics[f"trm/{n}/{k}_max"] = jnp.max(v) if v.size else jnp.float32(0.0)
  seq_mask = jax.lax.stop_gradient(seq_keep.astype(jnp.float32))
  token_mask = jax.lax.stop_gradient(
      jnp.where(valid_tok & tok_keep & seq_keep[:, None], 1.0, 0.0).astype(jnp.float32))
  metrics["trm/reject_rate"] = monitors.rejection_rate(seq_mask, mask)
  metrics["trm/masked_token_frac"] = monitors.masked_token_fraction(token_mask, mask)
  return MaskResult(seq_mask=seq_mask, token_mask=token_mask, metrics=metrics)
