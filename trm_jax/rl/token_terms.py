"""Per-token terms of the learner, computed chunk by chunk over T from hidden states.

The learner needs, at every response position, the policy's log-prob of the sampled token and,
depending on the mode, the SMD distillation KL against a dense teacher and the exact TRM
divergences against the rollout's full distribution. Each of these needs [B, T, V] logits; at
V = 150k and T = 4k a single such array is gigabytes. So the vocabulary projection happens here,
C positions at a time, under `jax.checkpoint`: forward and backward keep only [B, C, V]
temporaries, and two full [B, T, V] logit arrays are never alive together.

Alignment: hidden state t predicts token t+1. Every output is indexed by the *target* token, so
`logp[b, t] = log pi(tokens[b, t] | tokens[b, <t])`, matching the rollout's `logp` and
`full_logp` layout; index 0 (no context) is 0.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from trm_jax.trm import divergence

sg = jax.lax.stop_gradient


def _pad_to(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, n - x.shape[axis])
  return jnp.pad(x, pad)


def token_terms(unembed: Callable[[jax.Array], jax.Array], h: jax.Array, tokens: jax.Array,
                mask: jax.Array, *, teacher_h: Optional[jax.Array] = None,
                roll_logp_full: Optional[jax.Array] = None,
                roll_topk_logp: Optional[jax.Array] = None,
                roll_topk_ids: Optional[jax.Array] = None,
                chunk: int = 128) -> dict[str, jax.Array]:
  """Chunked per-token terms.

  Args:
    unembed: h [..., D] -> logits [..., V] float32 (the model's `unembed`).
    h: [B, T, D] student hidden states (the masked track in SMD mode).
    tokens: [B, T] int32 sampled sequence.
    mask: [B, T] 1 on response tokens; terms elsewhere are 0.
    teacher_h: [B, T, D] dense-track hidden states; gradients are stopped here (teacher).
    roll_logp_full: [B, T, V] rollout log-probs (target-indexed, -inf where truncated) for
      exact KL(roll || theta) and TV.
    roll_topk_logp, roll_topk_ids: [B, T, k] the rollout's top-k instead (large vocabularies):
      KL and TV on the partition {top-k, tail}, a lower bound (trm.topk_tail_divergences).
    chunk: positions per vocabulary projection.
  Returns:
    dict of [B, T] fp32: "logp", "entropy", and "distill_kl" (KL(teacher || student)) and
    "kl", "tv" when their inputs are given.
  """
  B, T, _ = h.shape
  maskf = mask.astype(jnp.float32)
  # Shift: position t-1 predicts token t. Pad T-1 up to a multiple of `chunk`.
  n = T - 1
  C = max(1, min(chunk, n))
  nc = -(-n // C)
  Tp = nc * C

  def to_chunks(x):  # [B, n, ...] -> [nc, B, C, ...]
    x = _pad_to(x, Tp)
    return jnp.moveaxis(x.reshape((B, nc, C) + x.shape[2:]), 1, 0)

  xs = {"h": to_chunks(h[:, :-1]), "y": to_chunks(tokens[:, 1:]),
        "m": to_chunks(maskf[:, 1:])}
  if teacher_h is not None:
    xs["th"] = to_chunks(sg(teacher_h)[:, :-1])
  if roll_logp_full is not None:
    xs["rl"] = to_chunks(roll_logp_full[:, 1:])
  elif roll_topk_logp is not None:
    xs["tk_lp"] = to_chunks(roll_topk_logp[:, 1:])
    xs["tk_ids"] = to_chunks(roll_topk_ids[:, 1:])

  @jax.checkpoint
  def body(c):
    logits = unembed(c["h"])                                   # [B, C, V] fp32
    logq = jax.nn.log_softmax(logits, axis=-1)
    out = {"logp": jnp.take_along_axis(logq, c["y"][..., None], axis=-1)[..., 0],
           "entropy": -jnp.sum(jnp.exp(logq) * logq, axis=-1)}
    if "th" in c:
      # Teacher, no gradient: stopping its hidden states is not enough, `unembed`'s weights
      # (lm_head, or the tied embedding) are the student's and would get the teacher's term.
      logp_t = sg(jax.nn.log_softmax(unembed(c["th"]), axis=-1))
      out["distill_kl"] = jnp.sum(jnp.exp(logp_t) * (logp_t - logq), axis=-1)
    if "rl" in c:
      kl, tv = divergence.token_divergences(sg(logq), c["rl"], c["m"], chunk_size=C)
      out["kl"], out["tv"] = kl, tv
    if "tk_lp" in c:
      kl, tv = divergence.topk_tail_divergences(sg(logq), c["tk_lp"], c["tk_ids"], c["m"],
                                                chunk_size=C)
      out["kl"], out["tv"] = kl, tv
    return jax.tree.map(lambda v: v * c["m"], out)

  outs = jax.lax.map(body, xs)                                  # each [nc, B, C]

  def unchunk(v):  # [nc, B, C] -> [B, T] target-indexed
    v = jnp.moveaxis(v, 0, 1).reshape(B, Tp)[:, :n]
    return jnp.pad(v, ((0, 0), (1, 0)))
  return {k: unchunk(v) * maskf for k, v in outs.items()}
