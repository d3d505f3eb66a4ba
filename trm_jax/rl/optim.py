"""The learner's optimizer, gradient accumulation over microbatches, and the non-finite guard.

  make_optimizer         AdamW (decoupled weight decay, Loshchilov & Hutter 2019) behind
                         global-norm clipping, learning rate with linear warmup then cosine
                         decay to min_lr_ratio * lr.
  accumulate_gradients   one `lax.scan` over microbatches whose sum equals the big-batch
                         loss and gradient exactly, for every loss aggregation mode.
  apply_if_finite        the optimizer update, or nothing at all when the loss or any
                         gradient is non-finite (skip the step, keep going, count it).

Weight decay applies to parameters with ndim >= 2 only (matrices, embeddings); biases and
norm scales are not decayed, the usual LLM practice (decaying a norm scale towards 0 fights
the normalisation it exists for).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax

PyTree = Any


def make_schedule(*, lr: float, warmup_steps: int, total_steps: int,
                  min_lr_ratio: float) -> optax.Schedule:
  """0 -> lr linearly over warmup_steps, then cosine to min_lr_ratio * lr at total_steps.

  lr = 0 is allowed: every update is then exactly zero, a frozen-policy control run that sees
  the same prompts and sampling noise as a training run (per-step reward is dominated by the
  difficulty of that step's prompts; the control measures it).
  """
  if not lr >= 0:
    raise ValueError(f"lr must be >= 0, got {lr!r}")
  if total_steps < 1:
    raise ValueError(f"total_steps must be >= 1, got {total_steps!r}")
  if not 0 <= warmup_steps <= total_steps:
    raise ValueError(f"warmup_steps must be in [0, total_steps={total_steps}], got "
                     f"{warmup_steps!r}")
  if not 0.0 <= min_lr_ratio <= 1.0:
    raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}")
  # optax counts decay_steps from step 0, warmup included, so the cosine ends at total_steps.
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=lr, warmup_steps=warmup_steps, decay_steps=total_steps,
      end_value=lr * min_lr_ratio)


def _decay_mask(params: PyTree) -> PyTree:
  return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def make_optimizer(*, lr: float, warmup_steps: int, total_steps: int, weight_decay: float,
                   b1: float, b2: float, eps: float, clip_norm: Optional[float],
                   min_lr_ratio: float) -> optax.GradientTransformation:
  """Global-norm clipping (clip_norm=None: off), then AdamW on the warmup-cosine schedule."""
  if clip_norm is not None and not clip_norm > 0:
    raise ValueError(f"clip_norm must be > 0 or None, got {clip_norm!r}")
  if weight_decay < 0:
    raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
  if not (0 <= b1 < 1 and 0 <= b2 < 1):
    raise ValueError(f"b1 and b2 must be in [0, 1), got b1={b1!r}, b2={b2!r}")
  if not eps > 0:
    raise ValueError(f"eps must be > 0, got {eps!r}")
  schedule = make_schedule(lr=lr, warmup_steps=warmup_steps, total_steps=total_steps,
                           min_lr_ratio=min_lr_ratio)
  adamw = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                      mask=_decay_mask)
  if clip_norm is None:
    return adamw
  return optax.chain(optax.clip_by_global_norm(clip_norm), adamw)


def accumulate_gradients(
    loss_and_grad_fn: Callable[[PyTree, PyTree, jax.Array], tuple[tuple[jax.Array, PyTree],
                                                                  PyTree]],
    params: PyTree, batch: PyTree, *, num_microbatches: int, normalizer: jax.Array,
) -> tuple[jax.Array, PyTree, PyTree]:
  """Sum of microbatch losses and gradients with one global normaliser, via `lax.scan`.

  The per-microbatch function must normalise its loss by the `normalizer` it is given (the
  objectives take it as `normalizer=`), not by its own counts. With N the full batch's
  normaliser (`objectives.loss_normalizer(batch response_mask, ...)`), each microbatch then
  contributes sum_{its terms} w l / N, and the sum over microbatches is the big-batch loss
  term for term, in every aggregation mode. Averaging per-microbatch token-means instead
  would weight a token in a short microbatch more than one in a long microbatch.

  Args:
    loss_and_grad_fn: (params, microbatch, normalizer) -> ((loss, aux), grads), e.g.
      `jax.value_and_grad(loss_fn, has_aux=True)`.
    params: the pytree gradients are taken for.
    batch: pytree whose leaves all have leading axis B; split into `num_microbatches`
      contiguous slices of B / num_microbatches rows.
    num_microbatches: must divide B.
    normalizer: [] the global normaliser.
  Returns:
    (loss [], grads like params, aux): loss and grads summed over microbatches (gradients
    accumulated in fp32, returned in each gradient's own dtype); aux leaves averaged over
    microbatches (ratio-type metrics are then a mean of microbatch means).
  """
  leaves = jax.tree_util.tree_leaves_with_path(batch)
  if not leaves:
    raise ValueError("batch has no array leaves to split into microbatches")
  B = jnp.shape(leaves[0][1])[0] if jnp.ndim(leaves[0][1]) else None
  for path, x in leaves:
    if jnp.ndim(x) == 0 or jnp.shape(x)[0] != B:
      raise ValueError(f"batch leaf {jax.tree_util.keystr(path)} has shape {jnp.shape(x)}; "
                       f"every leaf needs the same leading batch axis B={B}")
  if num_microbatches < 1 or B % num_microbatches:
    raise ValueError(f"num_microbatches={num_microbatches} must divide the batch B={B}")
  micro = jax.tree.map(
      lambda x: jnp.reshape(x, (num_microbatches, B // num_microbatches) + jnp.shape(x)[1:]),
      batch)
  grads_shape = jax.eval_shape(lambda p, mb: loss_and_grad_fn(p, mb, normalizer)[1], params,
                               jax.tree.map(lambda x: x[0], micro))
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), grads_shape)

  def body(carry, mb):
    loss_sum, grad_sum = carry
    (loss, aux), grads = loss_and_grad_fn(params, mb, normalizer)
    grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
    return (loss_sum + loss.astype(jnp.float32), grad_sum), aux

  (loss, grads), aux = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), micro)
  grads = jax.tree.map(lambda g, s: g.astype(s.dtype), grads, grads_shape)
  aux = jax.tree.map(lambda a: jnp.mean(a, axis=0), aux)
  return loss, grads, aux


def all_finite(loss: jax.Array, grads: PyTree) -> jax.Array:
  """[] bool: the loss and every gradient entry are finite."""
  ok = jnp.isfinite(loss)
  for g in jax.tree.leaves(grads):
    ok = ok & jnp.all(jnp.isfinite(g))
  return ok


def apply_if_finite(tx: optax.GradientTransformation, params: PyTree, opt_state: PyTree,
                    grads: PyTree, loss: jax.Array) -> tuple[PyTree, PyTree, jax.Array]:
  """One optimizer step, or an exact no-op when the loss or a gradient is non-finite.

  Skipping leaves the parameters AND the optimizer state untouched (Adam's moments would
  otherwise absorb the NaN, and the schedule's step count would advance for a step that never
  happened), so a skipped step is invisible to the rest of the run. Pure and jit-friendly:
  both branches are computed and one is selected leaf by leaf.

  Returns:
    (params, opt_state, is_finite []), is_finite for the learner's skipped-step counter.
  """
  ok = all_finite(loss, grads)
  updates, new_state = tx.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep = lambda new, old: jnp.where(ok, new, old)
  return jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_state, opt_state), ok
