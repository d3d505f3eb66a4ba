"""Per-token divergences between pi_roll and pi_theta, their per-sequence reductions and the
batch estimates that feed the bounds (`bounds.compute_bounds`).

Direction and sign conventions (TRM paper Sec. 2.3; docs/trm.md, "Notation"):
  * KL(c_t) = KL(pi_roll(.|c_t) || pi_theta(.|c_t)) = sum_v p_roll (log p_roll - log p_theta);
  * TV(c_t) = 1/2 sum_v |p_theta - p_roll|;
  * log rho_t = logp_theta(y_t) - logp_roll(y_t) for the sampled token y_t;
    k1 = -log rho, k2 = (log rho)^2 / 2, k3 = rho - 1 - log rho (E_roll[k1] = E_roll[k3] = KL).

Three routes to per-token statistics, from most to least informative:
  1. `token_divergences`: full logits of both policies [B, T, V] -> exact KL and TV.
  2. `topk_tail_divergences`: full theta logits + the rollout's top-k log-probs and ids. The
     vocabulary is coarsened to {top-k tokens, one tail bucket}; by the data-processing
     inequality KL and TV of the coarsened pair are LOWER bounds of the true ones (equal when
     the rollout distribution lives on its top-k, e.g. top-k sampling).
  3. `sample_estimators`: only the sampled tokens' log-probs -> k1, k2, k3 per token.

Truncated rollout distributions (top-p / top-k sampling give -inf logits): tokens with
p_roll = 0 contribute 0 to KL (0 log 0 = 0) and their p_theta to TV. If pi_theta gives zero
probability (-inf logit) to a token pi_roll can emit, KL is +inf on purpose: it is the true
value, and every `<=` threshold criterion then rejects the sequence. Theta logits from a model
are finite, so this only happens when both sides are truncated.

Memory: the full-logit routes run `lax.map` over T-chunks of `chunk_size` positions, so next to
the two [B, T, V] inputs there is only a [B, chunk, V] working set, never a third [B, T, V]
temporary (log-softmax of a whole array would be one). All reductions are in float32.
The public array functions are jitted (chunk_size static), so eager calls compile once.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import struct

DEFAULT_CHUNK = 128


# ----------------------------------------------------------------------------------------------
# Chunking over T.

def _check_btv(name: str, x: jax.Array, ndim: int = 3):
  if x.ndim != ndim:
    raise ValueError(f"`{name}` must have {ndim} dims, got shape {x.shape}")


def _chunked_over_T(fn: Callable, xs: tuple, chunk_size: int) -> tuple:
  """Applies fn to T-chunks of xs (arrays with T on axis 1); fn returns a tuple of [B, C]."""
  B, T = xs[0].shape[:2]
  if chunk_size < 1:
    raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
  C = min(chunk_size, T)
  n = T // C

  def body(i):
    return fn(*(jax.lax.dynamic_slice_in_dim(x, i * C, C, axis=1) for x in xs))

  outs = jax.lax.map(body, jnp.arange(n))                         # each [n, B, C]
  outs = [o.transpose(1, 0, 2).reshape(B, n * C) for o in outs]    # each [B, n*C]
  if n * C < T:  # ragged tail: one static slice, still no full-size temporary
    tail = fn(*(x[:, n * C:] for x in xs))
    outs = [jnp.concatenate([o, t], axis=1) for o, t in zip(outs, tail)]
  return tuple(outs)


def _kl_terms(logp_r: jax.Array, logp_t: jax.Array) -> jax.Array:
  """p_r (log p_r - log p_t) elementwise with 0 log 0 = 0 and p_r > 0, p_t = 0 -> +inf."""
  p_r = jnp.exp(logp_r)
  finite = p_r * (logp_r - jnp.where(jnp.isneginf(logp_t), 0.0, logp_t))
  return jnp.where(jnp.isneginf(logp_r), 0.0,
                   jnp.where(jnp.isneginf(logp_t), jnp.inf, finite))


# ----------------------------------------------------------------------------------------------
# Route 1: full logits of both policies.

@functools.partial(jax.jit, static_argnames=("chunk_size",))
def token_divergences(logits_theta: jax.Array, logits_roll: jax.Array, mask: jax.Array, *,
                      chunk_size: int = DEFAULT_CHUNK) -> tuple[jax.Array, jax.Array]:
  """Exact per-token KL(roll || theta) and TV from full logits.

  Args:
    logits_theta: [B, T, V] learner logits (any float dtype; computed in float32).
    logits_roll: [B, T, V] rollout logits; -inf marks tokens the sampler could not emit.
    mask: [B, T] response mask (1 = response token).
    chunk_size: positions per T-chunk.

  Returns:
    kl [B, T], tv [B, T] float32, zero where mask == 0.
  """
  _check_btv("logits_theta", logits_theta)
  if logits_roll.shape != logits_theta.shape:
    raise ValueError(f"`logits_roll` shape {logits_roll.shape} != `logits_theta` shape "
                     f"{logits_theta.shape}")
  _check_mask(mask, logits_theta.shape[:2])

  def chunk(lt, lr):                                      # [B, C, V] each
    logp_t = jax.nn.log_softmax(lt.astype(jnp.float32), axis=-1)
    logp_r = jax.nn.log_softmax(lr.astype(jnp.float32), axis=-1)
    kl = jnp.maximum(jnp.sum(_kl_terms(logp_r, logp_t), axis=-1), 0.0)   # [B, C]
    tv = 0.5 * jnp.sum(jnp.abs(jnp.exp(logp_t) - jnp.exp(logp_r)), axis=-1)
    return kl, tv

  kl, tv = _chunked_over_T(chunk, (logits_theta, logits_roll), chunk_size)
  valid = mask > 0
  return jnp.where(valid, kl, 0.0), jnp.where(valid, tv, 0.0)


# ----------------------------------------------------------------------------------------------
# Route 2: theta logits + rollout top-k log-probs and a tail bucket.

def _log1mexp(x: jax.Array) -> jax.Array:
  """log(1 - exp(x)) for x <= 0, accurate at both ends (Maechler 2012); x >= 0 -> -inf."""
  x = jnp.minimum(x, 0.0)
  return jnp.where(x > -0.6931472, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def topk_tail_divergences(logits_theta: jax.Array, roll_topk_logp: jax.Array,
                          roll_topk_ids: jax.Array, mask: jax.Array, *,
                          chunk_size: int = DEFAULT_CHUNK) -> tuple[jax.Array, jax.Array]:
  """Lower bounds on per-token KL(roll || theta) and TV from the rollout's top-k.

  The two distributions are compared on the partition {v_1, ..., v_k, tail} with
  p(tail) = 1 - sum_i p(v_i). Merging cells never increases KL or TV (data processing), so
  both outputs are <= the exact values (up to float32 rounding of the rollout's top-k sum). They
  are exact when pi_roll puts no mass outside its top-k (top-k sampling, or k = V): the tail then
  adds 0 to KL and theta's tail mass to TV. theta's tail mass is summed exactly from its logits.

  Args:
    logits_theta: [B, T, V] learner logits.
    roll_topk_logp: [B, T, k] rollout log-probs of its k most likely tokens (k = top-k width).
    roll_topk_ids: [B, T, k] int token ids, distinct along the last axis.
    mask: [B, T] response mask.

  Returns:
    kl_lb [B, T], tv_lb [B, T] float32, zero where mask == 0.
  """
  _check_btv("logits_theta", logits_theta)
  _check_btv("roll_topk_logp", roll_topk_logp)
  if roll_topk_ids.shape != roll_topk_logp.shape:
    raise ValueError(f"`roll_topk_ids` shape {roll_topk_ids.shape} != `roll_topk_logp` shape "
                     f"{roll_topk_logp.shape}")
  if roll_topk_logp.shape[:2] != logits_theta.shape[:2]:
    raise ValueError(f"`roll_topk_logp` leading shape {roll_topk_logp.shape[:2]} != "
                     f"`logits_theta` leading shape {logits_theta.shape[:2]}")
  _check_mask(mask, logits_theta.shape[:2])

  k = roll_topk_logp.shape[-1]
  # The rollout's tail is only known as 1 - sum(top-k), whose float32 rounding error is about
  # k ulps; a smaller "tail" is rounding noise and is treated as empty (else a theta tail of
  # exactly zero, as when k = V, would turn that noise into KL = +inf).
  roll_tail_tol = 2.0 * k * float(jnp.finfo(jnp.float32).eps)

  def chunk(lt, lr_k, ids):                  # [B, C, V], [B, C, k], [B, C, k]
    logp_t = jax.nn.log_softmax(lt.astype(jnp.float32), axis=-1)
    ids = ids.astype(jnp.int32)
    lt_k = jnp.take_along_axis(logp_t, ids, axis=-1)                   # [B, C, k]
    lr_k = lr_k.astype(jnp.float32)
    # theta's tail exactly, as a log-sum-exp over the tokens outside the rollout's top-k.
    b_idx = jnp.arange(ids.shape[0])[:, None, None]
    c_idx = jnp.arange(ids.shape[1])[None, :, None]
    in_topk = jnp.zeros(logp_t.shape, bool).at[b_idx, c_idx, ids].set(True)  # [B, C, V]
    tail_t = jax.nn.logsumexp(jnp.where(in_topk, -jnp.inf, logp_t), axis=-1)  # [B, C]
    tail_r = _log1mexp(jax.nn.logsumexp(lr_k, axis=-1))                # [B, C]
    tail_r = jnp.where(jnp.exp(tail_r) < roll_tail_tol, -jnp.inf, tail_r)
    kl = jnp.sum(_kl_terms(lr_k, lt_k), axis=-1) + _kl_terms(tail_r, tail_t)
    tv = 0.5 * (jnp.sum(jnp.abs(jnp.exp(lt_k) - jnp.exp(lr_k)), axis=-1)
                + jnp.abs(jnp.exp(tail_t) - jnp.exp(tail_r)))
    return jnp.maximum(kl, 0.0), tv

  kl, tv = _chunked_over_T(chunk, (logits_theta, roll_topk_logp, roll_topk_ids), chunk_size)
  valid = mask > 0
  return jnp.where(valid, kl, 0.0), jnp.where(valid, tv, 0.0)


# ----------------------------------------------------------------------------------------------
# Route 3: sampled tokens only.

@jax.jit
def sample_estimators(logp_theta: jax.Array, logp_roll: jax.Array,
                      mask: jax.Array) -> dict[str, jax.Array]:
  """Per-token log rho, k1, k2, k3 from the sampled tokens' log-probs (TRM Sec. 4.3, App. E).

  Args:
    logp_theta: [B, T] learner log-prob of the sampled token.
    logp_roll: [B, T] rollout log-prob of the same token.
    mask: [B, T] response mask.

  Returns:
    dict with `log_rho`, `k1` (= -log rho), `k2` (= (log rho)^2 / 2), `k3` (= rho - 1 - log rho,
    >= 0), each [B, T] float32 and zero where mask == 0.
  """
  if logp_theta.shape != logp_roll.shape:
    raise ValueError(f"`logp_theta` shape {logp_theta.shape} != `logp_roll` shape "
                     f"{logp_roll.shape}")
  _check_mask(mask, logp_theta.shape)
  valid = mask > 0
  log_rho = jnp.where(valid, logp_theta.astype(jnp.float32) - logp_roll.astype(jnp.float32), 0.)
  return dict(log_rho=log_rho, k1=-log_rho, k2=0.5 * jnp.square(log_rho), k3=k3(log_rho))


def k3(log_rho: jax.Array) -> jax.Array:
  """rho - 1 - log rho, >= 0, accurate near rho = 1 and finite up to rho ~ 1e38.

  expm1(x) - x loses all digits to cancellation for |x| << 1 in float32 (expm1(1e-6) carries
  an ulp of 1e-13 against a result of 5e-13), so small |x| uses the series
  x^2/2 (1 + x/3 (1 + x/4)), whose truncation error is below 2e-8 relative for |x| < 1e-2.
  """
  x = log_rho
  series = 0.5 * x * x * (1.0 + x / 3.0 * (1.0 + x / 4.0))
  return jnp.maximum(jnp.where(jnp.abs(x) < 1e-2, series, jnp.expm1(x) - x), 0.0)


# ----------------------------------------------------------------------------------------------
# Per-sequence reductions and batch estimates.

def _check_mask(mask: jax.Array, shape: tuple):
  if mask.shape != tuple(shape):
    raise ValueError(f"`mask` must have shape [B, T] = {tuple(shape)}, got {mask.shape}")


def seq_sum(x: jax.Array, mask: jax.Array) -> jax.Array:
  """[B, T] -> [B] sum over valid tokens."""
  return jnp.sum(jnp.where(mask > 0, x, 0.0), axis=-1)


def seq_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """[B, T] -> [B] mean over valid tokens; 0 for a sequence without valid tokens."""
  n = jnp.sum(mask > 0, axis=-1)
  return seq_sum(x, mask) / jnp.maximum(n, 1)


def seq_max(x: jax.Array, mask: jax.Array) -> jax.Array:
  """[B, T] -> [B] max over valid tokens; 0 for a sequence without valid tokens."""
  valid = mask > 0
  m = jnp.max(jnp.where(valid, x, -jnp.inf), axis=-1)
  return jnp.where(jnp.any(valid, axis=-1), m, 0.0)


@struct.dataclass
class BatchEstimates:
  """Batch estimates of the bound inputs; a field is None when its inputs were not given."""
  delta_hat: Optional[jax.Array] = None   # [] max per-token KL over valid tokens
  eps_hat: Optional[jax.Array] = None     # [] max per-token TV over valid tokens
  kl_seq_hat: Optional[jax.Array] = None  # [] E_roll[sum_t KL(c_t)] (or sum_t k3)
  tv_seq_hat: Optional[jax.Array] = None  # [] 1/2 E_roll|1 - prod_t rho_t|, capped at 1
  dbar_hat: Optional[jax.Array] = None    # [T] E_roll[TV(c_t)] per position

  def bound_inputs(self) -> dict:
    """Keyword arguments for `compute_bounds` (None fields are simply absent bounds)."""
    return dict(delta=self.delta_hat, eps=self.eps_hat, kl_seq=self.kl_seq_hat,
                tv_seq=self.tv_seq_hat, dbar=self.dbar_hat)


@jax.jit
def batch_estimates(mask: jax.Array, *, kl: Optional[jax.Array] = None,
                    tv: Optional[jax.Array] = None, log_rho: Optional[jax.Array] = None,
                    seq_weights: Optional[jax.Array] = None) -> BatchEstimates:
  """Estimates delta, eps, D_KL^seq, D_TV^seq and Dbar_t from a batch sampled from pi_roll.

  Which input feeds which estimate:
    delta_hat  = max kl (needs kl);   eps_hat = max tv (needs tv). These are the maxima over the
                 contexts seen, i.e. lower estimates of the max over all contexts.
    kl_seq_hat = E[sum_t kl] from kl, else E[sum_t k3(log rho)] (unbiased, App. E).
    tv_seq_hat = 1/2 E|1 - exp(sum_t log rho)| (needs log_rho): unbiased for the part of the
                 TV on pi_roll's support, the whole TV when supp(theta) is inside supp(roll).
    dbar_hat[t] = E[tv_t] from tv, else E[|rho_t - 1|] / 2 (unbiased on pi_roll's support).
  Positions past a sequence's end count as TV = KL = 0 (the finished sequence emits nothing
  more under either policy); rows without any valid token are left out of the expectations.

  Args:
    mask: [B, T] response mask.
    kl, tv, log_rho: [B, T] per-token statistics (zero or anything where mask == 0).
    seq_weights: [B] optional non-negative sequence weights (e.g. pi_roll(y) when the batch
      enumerates every sequence, which makes the estimates exact); default uniform.
  """
  valid = mask > 0                                                   # [B, T]
  row_valid = jnp.any(valid, axis=-1)                                # [B]
  w = jnp.ones(mask.shape[:1], jnp.float32) if seq_weights is None else (
      jnp.asarray(seq_weights, jnp.float32))
  if w.shape != mask.shape[:1]:
    raise ValueError(f"`seq_weights` must have shape [B] = {mask.shape[:1]}, got {w.shape}")
  w = jnp.where(row_valid, w, 0.0)
  w = w / jnp.maximum(jnp.sum(w), jnp.finfo(jnp.float32).tiny)      # [B] sums to 1 (or 0)

  def expect(x_b):                                                   # [B, ...] -> [...]
    x_b = jnp.where(w.reshape((-1,) + (1,) * (x_b.ndim - 1)) > 0, x_b, 0.0)
    return jnp.tensordot(w, x_b, axes=1)

  def batch_max(x):
    return jnp.max(jnp.where(valid, x, 0.0)) if x.size else jnp.float32(0.0)

  est = {}
  if kl is not None:
    _check_mask(mask, kl.shape)
    est["delta_hat"] = batch_max(kl)
    est["kl_seq_hat"] = expect(seq_sum(kl, mask))
  elif log_rho is not None:
    est["kl_seq_hat"] = expect(seq_sum(k3(log_rho), mask))
  if tv is not None:
    _check_mask(mask, tv.shape)
    est["eps_hat"] = batch_max(tv)
    est["dbar_hat"] = expect(jnp.where(valid, tv, 0.0))
  elif log_rho is not None:
    est["dbar_hat"] = expect(jnp.where(valid, 0.5 * jnp.abs(jnp.expm1(log_rho)), 0.0))
  if log_rho is not None:
    _check_mask(mask, log_rho.shape)
    seq_log_ratio = seq_sum(log_rho, mask)                           # [B] log P_theta/P_roll
    est["tv_seq_hat"] = jnp.minimum(1.0, 0.5 * expect(jnp.abs(jnp.expm1(seq_log_ratio))))
  return BatchEstimates(**est)
