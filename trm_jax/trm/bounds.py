"""The TRM bound family on |Error| = |J(theta) - J(roll) - L'(theta)| for rewards in [0, 1].

Every bound of Section 3 of the TRM paper, with the square roots that plain-text versions of the
paper lose restored (docs/trm.md, "The bounds"); with them the functions below reproduce all
sixteen numbers of Table 1 (tests/test_trm_bounds.py).

  name         formula (sums over t = 1..T)                                       needs
  classical    2 T (T-1) eps^2                                                    eps
  coupling     4 min(1,eps) sum_t min(1, (t-1) eps)                               eps
  pm_kl        4 min(1,sqrt(delta/2)) sum_t min(1, sqrt((t-1) delta/2))           delta
  pm_tv        4 min(1,eps) sum_t min(1, sqrt((t-1) delta/2))                     eps, delta
  mix_kl       4 T min(1,sqrt(delta/2)) min(1, sqrt(kl_seq/2))                    delta, kl_seq
  mix_tv       4 T min(1,eps) min(1, tv_seq)                                      eps, tv_seq
  adaptive_kl  4 sum_t dbar_t min(1, sqrt((T-t) delta/2))                         dbar, delta
  adaptive_tv  4 sum_t dbar_t min(1, (T-t) eps)                                   dbar, eps
  adaptive     4 sum_t dbar_t min(1, (T-t) eps, sqrt((T-t) delta/2))  (hybrid)    dbar, eps, delta
  unified      B* = min of every bound present

Inputs: `delta` = D_KL^{tok,max} (KL(roll || theta), max over positions and contexts), `eps` =
D_TV^{tok,max}, `kl_seq` = D_KL^seq, `tv_seq` = D_TV^seq, `dbar` [T] = per-position expected token
TV under pi_roll. A bound whose inputs are missing is absent from the result.

Pinsker is NOT applied implicitly: `compute_bounds(T, delta=d)` returns only pm_kl. A caller who
knows only KL quantities and wants the TV-route rows (Table 1's "KL-only" column) passes
`**pinsker_fill(delta=d, kl_seq=k)`, which sets eps = min(1, sqrt(delta/2)) and
tv_seq = min(1, sqrt(kl_seq/2)) where they are missing. Nothing is lost by the explicit form:
with Pinsker-derived eps and tv_seq, coupling >= pm_kl and mix_tv == mix_kl, so the KL rows
already give the minimum.

Two backends: with Python floats / numpy inputs the arithmetic is numpy float64 (exact to
double precision, returns numpy float64 scalars); if any input is a jax array or tracer it is
jnp in that input's floating dtype (jit-compatible; `T` must be a static Python int).

Deviation from the paper: the hybrid `adaptive` is reported only when both eps and delta are
given (with one of them it coincides with adaptive_kl or adaptive_tv, which are reported).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BOUND_NAMES = ("classical", "coupling", "pm_kl", "pm_tv", "mix_kl", "mix_tv",
               "adaptive_kl", "adaptive_tv", "adaptive", "unified")


def _is_traced_or_jax(x) -> bool:
  return isinstance(x, jax.Array)  # tracers are jax.Array instances too


def pinsker_fill(*, delta=None, eps=None, kl_seq=None, tv_seq=None) -> dict:
  """Fills missing TV quantities from KL ones by Pinsker: TV <= sqrt(KL / 2), capped at 1.

  Returns a dict with keys delta, eps, kl_seq, tv_seq suitable for `compute_bounds(T, **d)`.
  Given values are kept as they are (never replaced by the Pinsker value).
  """
  xp = jnp if any(_is_traced_or_jax(x) for x in (delta, eps, kl_seq, tv_seq)) else np
  if eps is None and delta is not None:
    eps = xp.minimum(1.0, xp.sqrt(xp.asarray(delta) / 2.0))
  if tv_seq is None and kl_seq is not None:
    tv_seq = xp.minimum(1.0, xp.sqrt(xp.asarray(kl_seq) / 2.0))
  return dict(delta=delta, eps=eps, kl_seq=kl_seq, tv_seq=tv_seq)


def _check_horizon(T) -> int:
  if not isinstance(T, (int, np.integer)) or isinstance(T, bool) or T < 1:
    raise ValueError(f"compute_bounds: T must be a static Python int >= 1, got {T!r}")
  return int(T)


def _coerce(T: int, inputs: dict):
  """(xp, dtype, {name: array}) of the given inputs: jnp in their float dtype (at least
  fp32) when any is a jax value or tracer, else numpy float64 with a >= 0 check; shapes
  checked (dbar [T], the others scalars)."""
  use_jnp = any(_is_traced_or_jax(v) for v in inputs.values())
  xp = jnp if use_jnp else np
  if use_jnp:
    dtype = jnp.result_type(*[v for v in inputs.values() if v is not None], jnp.float32)
    if not jnp.issubdtype(dtype, jnp.floating):
      dtype = jnp.float32
  else:
    dtype = np.float64
  vals = {}
  for name, v in inputs.items():
    if v is None:
      continue
    a = xp.asarray(v, dtype=dtype)
    want_ndim = 1 if name == "dbar" else 0
    if a.ndim != want_ndim:
      raise ValueError(f"compute_bounds: `{name}` must have {want_ndim} dims, got shape "
                       f"{a.shape}")
    if name == "dbar" and a.shape[0] != T:
      raise ValueError(f"compute_bounds: `dbar` must have shape [T] = [{T}], got {a.shape}")
    if not use_jnp and np.any(a < 0):
      raise ValueError(f"compute_bounds: `{name}` must be >= 0, got {v!r}")
    vals[name] = a
  return xp, dtype, vals


def compute_bounds(T: int, *, delta=None, eps=None, kl_seq=None, tv_seq=None,
                   dbar=None) -> dict:
  """All bounds of the family whose inputs are given, plus `unified` (their minimum).

  Args:
    T: response length (static Python int). With variable-length batches pass the padded
      length: every bound is non-decreasing in T when dbar is zero past a sequence's end.
    delta: D_KL^{tok,max}, scalar.
    eps: D_TV^{tok,max}, scalar (not derived from delta; see `pinsker_fill`).
    kl_seq: D_KL^seq = KL(P_roll || P_theta) over whole responses, scalar.
    tv_seq: D_TV^seq, scalar.
    dbar: [T] per-position expected TV, Dbar_t = E_{c_t ~ d_t^roll}[TV(c_t)], t = 1..T.

  Returns:
    dict name -> scalar, keys a subset of BOUND_NAMES in that order; `unified` is present
    whenever at least one bound is.
  """
  T = _check_horizon(T)
  xp, dtype, vals = _coerce(T, dict(delta=delta, eps=eps, kl_seq=kl_seq, tv_seq=tv_seq,
                                    dbar=dbar))
  delta, eps = vals.get("delta"), vals.get("eps")
  kl_seq, tv_seq, dbar = vals.get("kl_seq"), vals.get("tv_seq"), vals.get("dbar")

  one = xp.asarray(1.0, dtype=dtype)
  k_fwd = xp.arange(T, dtype=dtype)          # [T] t - 1 for t = 1..T (context-shift horizon)
  k_bwd = k_fwd[::-1]                        # [T] T - t (future horizon, adaptive bounds)
  out = {}

  def pinsker_shift(k):                      # min(1, sqrt(k delta / 2)), Lemma 3.2 KL route
    return xp.minimum(one, xp.sqrt(k * delta / 2.0))

  def coupling_shift(k):                     # min(1, k eps), Lemma 3.2 coupling route
    return xp.minimum(one, k * eps)

  adv_kl = None if delta is None else xp.minimum(one, xp.sqrt(delta / 2.0))  # Lemma 3.1
  adv_tv = None if eps is None else xp.minimum(one, eps)

  # Worst-case bounds (Section 3.1-3.2).
  if eps is not None:
    out["classical"] = 2.0 * T * (T - 1) * eps * eps
    out["coupling"] = 4.0 * adv_tv * xp.sum(coupling_shift(k_fwd))
  if delta is not None:
    pm_sum = xp.sum(pinsker_shift(k_fwd))
    out["pm_kl"] = 4.0 * adv_kl * pm_sum
    if eps is not None:
      out["pm_tv"] = 4.0 * adv_tv * pm_sum
  if delta is not None and kl_seq is not None:
    out["mix_kl"] = 4.0 * T * adv_kl * xp.minimum(one, xp.sqrt(kl_seq / 2.0))
  if eps is not None and tv_seq is not None:
    out["mix_tv"] = 4.0 * T * adv_tv * xp.minimum(one, tv_seq)
  # Data-dependent bounds (Section 3.3, Appendix D step 4): Dbar_t times the future TV.
  if dbar is not None:
    if delta is not None:
      out["adaptive_kl"] = 4.0 * xp.sum(dbar * pinsker_shift(k_bwd))
    if eps is not None:
      out["adaptive_tv"] = 4.0 * xp.sum(dbar * coupling_shift(k_bwd))
    if delta is not None and eps is not None:
      out["adaptive"] = 4.0 * xp.sum(
          dbar * xp.minimum(coupling_shift(k_bwd), pinsker_shift(k_bwd)))
  if out:
    unified = None
    for v in out.values():
      unified = v if unified is None else xp.minimum(unified, v)
    out["unified"] = unified
  if xp is np:
    out = {k: np.float64(v) for k, v in out.items()}
  return {k: out[k] for k in BOUND_NAMES if k in out}

