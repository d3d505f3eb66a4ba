"""The learner: one jitted scoring pass and one jitted update step per minibatch.

Data flow for a rollout batch (docs/architecture.md):

  score(params, batch)                   no gradient; current pi_theta over the whole batch
    (1) hidden states of the learner track (shadow visibility in SMD mode, dense otherwise)
    (2) chunked per-token log-probs (+ exact KL/TV when the rollout kept full log-probs)
    (3) TRM token statistics -> sequence mask M and monitors (rejection rates, PPL gap, B*)
    (4) the mode's token weights (Sparse-RL's), logp_old for PPO ratios
  update(params, opt_state, minibatch)   per minibatch, microbatches accumulated with lax.scan
    (1) learner track -> logp_theta; dense teacher track under stop_gradient (SMD)
    (2) M recomputed from the current pi_theta (TRM's mask is a property of the policy pair,
        so after a first minibatch update it can change), stop-gradient
    (3) objective(logp_theta, logp_roll, A, M) + lambda * KL(teacher || masked)
    (4) optax update, skipped exactly when the loss or a gradient is non-finite, or when
        every sequence of the minibatch is masked (no signal; `learner/skipped`)

Learner tracks by `mode`: the entries of `rl.modes.MODES` (the SMD paper's comparisons,
docs/smd.md); the objective is an entry of `rl.objectives.OBJECTIVES`. This module reads their
fields, never their names.

Deviation from the SMD paper: the distillation KL is applied on every response token, including
sequences TRM masks out; it is a supervised term against the dense teacher, not an off-policy
estimate, so the trust-region argument does not apply to it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from trm_jax import trm
from trm_jax.kernels import Visibility
from trm_jax.models.protocol import CausalLM
from trm_jax.rl import modes, objectives, optim
from trm_jax.rl.token_terms import token_terms



@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """Static learner settings (hashable: part of the compiled program).

  The defaults serve direct use of the library (tests, benchmarks); the trainer sets every
  field the config has from it (programs.learner_config; its values may differ: rl.chunk)."""
  objective: str = "trm_surrogate"
  loss_agg: str = "seq-mean-token-sum"
  objective_kwargs: tuple = ()        # ((name, value), ...) of the objective's config_fields
  max_len: Optional[int] = None       # Dr.GRPO constant normaliser
  criteria: tuple = ()                # TRM criteria names, ANDed
  thresholds: tuple = ()              # ((name, value), ...)
  mode: str = "off"                   # a key of rl.modes.MODES
  mode_kwargs: tuple = ()             # ((name, value), ...) of the mode's config_fields
                                      #   (the smd mode's distillation weight: (("lam", 0.1),))
  num_microbatches: int = 1
  score_microbatches: int = 1         # the scoring pass's forward over this many groups of
                                      #   rows in turn (`_score`)
  chunk: int = 128                    # positions per vocabulary projection
  attn_impl: str = "auto"
  temperature: float = 1.0            # the sampler's; pi_theta is scored at it (as verl does)
  kl_beta: float = 0.0                # k3 KL penalty to a frozen reference policy (0 = off)
  length_edges: tuple = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

  def __post_init__(self):
    want, got = set(modes.get_mode(self.mode).config_fields), {k for k, _ in self.mode_kwargs}
    if want != got:
      raise ValueError(f"learner mode {self.mode!r} reads smd settings {sorted(want)}; "
                       f"LearnerConfig.mode_kwargs gives {sorted(got)}")
    objectives.get_objective(self.objective)
    for n in self.criteria:
      trm.CRITERIA.get(n)   # an unknown name fails here, listing the registered ones

  @property
  def learner_mode(self) -> modes.LearnerMode:
    return modes.get_mode(self.mode)

  @property
  def mode_settings(self) -> dict:
    return dict(self.mode_kwargs)

  @property
  def objective_entry(self) -> objectives.Objective:
    return objectives.get_objective(self.objective)


@struct.dataclass
class LearnerBatch:
  """A rollout batch in the learner's layout; T = P + R, response region [P, T)."""
  tokens: jax.Array          # [B, T] int32
  segment_ids: jax.Array     # [B, T] int32, 0 = padding
  response_mask: jax.Array   # [B, T] float32, 1 on generated tokens
  logp_roll: jax.Array       # [B, T] float32 rollout log-probs of the sampled tokens
  advantages: jax.Array      # [B] float32
  logp_old: jax.Array        # [B, T] float32 pi_theta before this update (PPO ratios)
  token_weights: jax.Array   # [B, T] float32 (Sparse-RL weights; ones otherwise)
  evicted_at: Optional[jax.Array] = None      # [B, L, K, T] int32 (modes that replay eviction)
  roll_logp_full: Optional[jax.Array] = None  # [B, T, V] float32 (exact TRM divergences)
  roll_topk_logp: Optional[jax.Array] = None  # [B, T, k] float32 (top-k + tail lower bounds)
  roll_topk_ids: Optional[jax.Array] = None   # [B, T, k] int32
  logp_ref: Optional[jax.Array] = None        # [B, T] float32 reference policy (kl_beta > 0)
  routed_experts: Optional[jax.Array] = None  # [B, L_moe, T, k] MoE choices to replay


def _forward(model: CausalLM, batch: LearnerBatch, cfg: LearnerConfig, *,
             with_teacher: bool, with_routing: bool = False):
  """(1) of both passes: learner-track (+ teacher) hidden states and chunked token terms.

  With `batch.routed_experts` every MoE layer runs the sampler's experts (routing replay),
  in the learner track and the teacher alike: replay defines the policy being trained, the
  teacher differs from it only by the eviction mask. `with_routing` also returns the
  MoE layers' `Routing` (the router's own choices, for the flip rate)."""
  shadow = cfg.learner_mode.replays_eviction and batch.evicted_at is not None
  vis = Visibility(segment_ids=batch.segment_ids,
                   evicted_at=batch.evicted_at if shadow else None)
  h, routing = model.hidden_states(batch.tokens, visibility=vis, attn_impl=cfg.attn_impl,
                                   routing=batch.routed_experts, with_routing=True)
  teacher_h = None
  if with_teacher:
    teacher_h = jax.lax.stop_gradient(model.hidden_states(
        batch.tokens, visibility=Visibility(segment_ids=batch.segment_ids),
        attn_impl=cfg.attn_impl, routing=batch.routed_experts))
  # pi_theta is the tempered policy, so at any sampling temperature an on-policy ratio is 1;
  # top-k / top-p truncation is left to the rollout side and shows up as mismatch (TRM's job).
  unembed = model.unembed if cfg.temperature == 1.0 else (
      lambda x: model.unembed(x) / cfg.temperature)
  terms = token_terms(unembed, h, batch.tokens, batch.response_mask, teacher_h=teacher_h,
                      roll_logp_full=batch.roll_logp_full, roll_topk_logp=batch.roll_topk_logp,
                      roll_topk_ids=batch.roll_topk_ids, chunk=cfg.chunk)
  return (terms, routing) if with_routing else terms


def replay_flip_rate(routing, routed_experts: jax.Array, segment_ids: jax.Array) -> jax.Array:
  """Fraction of (token, MoE layer) choices where the learner's own top-k set differs from
  the replayed one, over the tokens the sampler fed (valid and recorded)."""
  fed = (segment_ids > 0)[:, None, :] & jnp.all(routed_experts >= 0, axis=-1)  # [B, L_moe, T]
  own = jnp.sort(routing.own, axis=-1)
  rec = jnp.sort(routed_experts.astype(jnp.int32), axis=-1)
  flips = jnp.any(own != rec, axis=-1) & fed
  return jnp.sum(flips) / jnp.maximum(jnp.sum(fed), 1)


def expert_load_max_over_mean(chosen: jax.Array, segment_ids: jax.Array,
                              num_experts: int) -> jax.Array:
  """How far the busiest expert's share exceeds a balanced one, averaged over MoE layers.

  chosen [B, L_moe, T, k] the experts that ran, segment_ids [B, T] (0 = padding). Per layer,
  the tokens each expert ran on (valid tokens only), max over experts / mean over experts; the
  mean over layers is the factor by which the step's grouped matmuls, each layer waiting for
  its busiest expert, exceed perfectly balanced ones (every layer sees the same number of
  (token, expert) pairs, so the layers weigh equally). 1 = balanced."""
  B, L, T, k = chosen.shape
  valid = jnp.broadcast_to((segment_ids > 0)[:, None, :, None], chosen.shape)
  per_layer = lambda e, w: jnp.bincount(e, weights=w, length=num_experts)   # [E]
  counts = jax.vmap(per_layer)(jnp.moveaxis(chosen, 1, 0).reshape(L, -1),
                               jnp.moveaxis(valid, 1, 0).reshape(L, -1).astype(jnp.float32))
  mean = jnp.sum(counts, axis=1) / num_experts                             # [L]
  return jnp.mean(jnp.max(counts, axis=1) / jnp.maximum(mean, 1e-9))


def _trm_mask(cfg: LearnerConfig, terms: dict, batch: LearnerBatch):
  stats = trm.TokenStats(mask=batch.response_mask,
                         log_rho=(terms["logp"] - batch.logp_roll) * batch.response_mask,
                         kl=terms.get("kl"), tv=terms.get("tv"))
  if not cfg.criteria:
    return jnp.ones(batch.tokens.shape[:1], jnp.float32), jnp.ones_like(batch.response_mask), {}
  res = trm.apply_criteria(cfg.criteria, dict(cfg.thresholds), stats)
  return res.seq_mask, res.token_mask, res.metrics


def _distills(cfg: LearnerConfig) -> bool:
  return cfg.learner_mode.distills and cfg.mode_settings["lam"] > 0


def _score(model: CausalLM, batch: LearnerBatch, cfg: LearnerConfig, P: int):
  """The scoring pass, (1)-(4) of the module docstring: (logp [B, T], token weights [B, T],
  sequence mask [B], metrics).

  With `cfg.score_microbatches` = M > 1 the forward (1) runs over M groups of B / M rows one
  after another (`lax.map`), so the pass holds one group's activations instead of the batch's;
  (2)-(4) then see the whole batch's per-token terms, so masks and metrics are the batch's.
  Group m holds rows m, m + M, m + 2M, ...: with the batch's rows split over devices in
  contiguous blocks (`sharding.put_batch`), every device keeps B / (M D) rows of each group,
  where contiguous groups would each sit on a few devices and leave the rest idle."""
  M = cfg.score_microbatches
  if M == 1:
    terms, routing = _forward(model, batch, cfg, with_teacher=False, with_routing=True)
  else:
    B = batch.tokens.shape[0]
    if B % M:
      raise ValueError(f"score_microbatches={M} must divide the batch's {B} rows")
    groups = jax.tree.map(lambda x: jnp.moveaxis(x.reshape(B // M, M, *x.shape[1:]), 1, 0),
                          batch)                                    # [M, B / M, ...]
    out = jax.lax.map(lambda b: _forward(model, b, cfg, with_teacher=False,
                                         with_routing=True), groups)
    terms, routing = jax.tree.map(
        lambda y: jnp.moveaxis(y, 0, 1).reshape(B, *y.shape[2:]), out)  # rows back in order
  return _score_terms(terms, routing, batch, cfg, P, model.config.num_experts)


def _score_terms(terms: dict, routing, batch: LearnerBatch, cfg: LearnerConfig, P: int,
                 num_experts: int):
  """(2)-(4) of the scoring pass from the forward's token terms (gradients stopped here);
  num_experts: the model's (an MoE model's routing is counted per expert)."""
  terms = jax.tree.map(jax.lax.stop_gradient, terms)
  logp = terms["logp"]
  seq_mask, _, metrics = _trm_mask(cfg, terms, batch)
  mask_r = batch.response_mask[:, P:]
  log_rho_r = (logp - batch.logp_roll)[:, P:] * mask_r
  est = trm.batch_estimates(mask_r, kl=None if "kl" not in terms else terms["kl"][:, P:],
                            tv=None if "tv" not in terms else terms["tv"][:, P:],
                            log_rho=log_rho_r)
  metrics.update(trm.trm_monitors(seq_keep=seq_mask, mask=mask_r, T=mask_r.shape[1],
                                  logp_theta=logp[:, P:], logp_roll=batch.logp_roll[:, P:],
                                  est=est, length_edges=cfg.length_edges))
  n_tok = jnp.maximum(jnp.sum(batch.response_mask), 1.0)
  metrics["learner/entropy"] = jnp.sum(terms["entropy"]) / n_tok
  metrics["learner/k3_mean"] = jnp.sum(trm.k3(log_rho_r) * mask_r) / n_tok
  if routing is not None:   # an MoE model: the experts that ran on the batch's tokens
    metrics["moe/expert_load_max_over_mean"] = expert_load_max_over_mean(
        routing.chosen, batch.segment_ids, num_experts)
  if batch.routed_experts is not None:
    metrics["moe/replay_flip_rate"] = replay_flip_rate(routing, batch.routed_experts,
                                                       batch.segment_ids)
  weights = jnp.ones_like(batch.response_mask)
  mode = cfg.learner_mode
  if mode.token_weights is not None:
    weights, mode_metrics = mode.token_weights(logp, batch.logp_roll, batch.response_mask)
    metrics.update(mode_metrics)
  return logp, weights, seq_mask, metrics


def _loss(model: CausalLM, mb: LearnerBatch, normalizer: jax.Array, cfg: LearnerConfig):
  """One microbatch's loss, (1)-(3) of the update: the objective on the learner track under
  the recomputed TRM mask, plus the mode's distillation. normalizer = [the objective's N,
  the minibatch's response-token count], both over the whole minibatch."""
  if cfg.kl_beta > 0 and mb.logp_ref is None:
    raise ValueError("LearnerConfig.kl_beta > 0 needs LearnerBatch.logp_ref (score the batch "
                     "with the reference parameters: score(ref_params, rest, batch)[0])")
  return _loss_terms(_forward(model, mb, cfg, with_teacher=_distills(cfg)), mb, normalizer,
                     cfg)


def _loss_terms(terms: dict, mb: LearnerBatch, normalizer: jax.Array, cfg: LearnerConfig):
  """(2)-(3) of the update from the forward's token terms (gradients flow from here)."""
  distill = _distills(cfg)
  seq_mask, token_mask, _ = _trm_mask(cfg, jax.tree.map(jax.lax.stop_gradient, terms), mb)
  # token-level criteria (the token_mask baseline) act through token_weights.
  weights = mb.token_weights * jnp.where(mb.response_mask > 0, token_mask, 0.0)
  loss, metrics = objectives.compute_loss(
      cfg.objective, logp_theta=terms["logp"], logp_roll=mb.logp_roll,
      advantages=mb.advantages, response_mask=mb.response_mask, seq_mask=seq_mask,
      logp_old=mb.logp_old if cfg.objective_entry.uses_logp_old else None,
      token_weights=weights, loss_agg=cfg.loss_agg, normalizer=normalizer[0],
      max_len=cfg.max_len,
      **({"logp_ref": mb.logp_ref, "kl_beta": cfg.kl_beta} if cfg.kl_beta > 0 else {}),
      **dict(cfg.objective_kwargs))
  metrics = dict(metrics)
  has_response = (jnp.sum(mb.response_mask, axis=1) > 0).astype(jnp.float32)
  metrics["learner/kept_seqs"] = jnp.sum(seq_mask * has_response)
  if distill:
    # lambda * KL(sg[teacher] || masked), token-mean over the whole minibatch: the global
    # token count is normalizer[1], so accumulation over microbatches stays exact.
    kl = jnp.sum(terms["distill_kl"]) / normalizer[1]
    loss = loss + cfg.mode_settings["lam"] * kl
    metrics["smd/distill_kl"] = kl * cfg.num_microbatches
  return loss, metrics


def _apply(tx: optax.GradientTransformation, cfg: LearnerConfig, params, opt_state, grads,
           loss, aux: dict):
  """(4) of the update: the optax step, kept only when finite and when the minibatch has a
  signal; returns (params, opt_state, metrics)."""
  grad_norm = optax.tree.norm(grads)
  new_params, new_opt, ok = optim.apply_if_finite(tx, params, opt_state, grads, loss)
  aux = dict(aux)
  # An all-masked minibatch carries no signal: skip the step entirely (AdamW's weight decay
  # and the schedule would otherwise still move), unless distillation still has a target.
  has_signal = (aux["learner/kept_seqs"] > 0) | _distills(cfg)
  keep = lambda new, old: jnp.where(has_signal, new, old)
  params = jax.tree.map(keep, new_params, params)
  opt_state = jax.tree.map(keep, new_opt, opt_state)
  aux["learner/kept_seqs"] = aux["learner/kept_seqs"] * cfg.num_microbatches
  # learner/skipped: no update reached the parameters, for either reason (each also
  # counted on its own); the trainer stops a run whose updates are skipped step after step.
  applied = ok & has_signal
  aux.update({"learner/loss": loss, "learner/grad_norm": grad_norm,
              "learner/skipped": 1.0 - applied.astype(jnp.float32),
              "learner/skipped_nonfinite": 1.0 - ok.astype(jnp.float32),
              "learner/skipped_all_masked": 1.0 - has_signal.astype(jnp.float32)})
  return params, opt_state, aux


def make_learner(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                 cfg: LearnerConfig, *, response_start: int,
                 state_shardings: Optional[tuple] = None):
  """Builds jitted `score(params, rest, batch)` and `update(params, opt_state, rest, batch)`.

  `params` is the model's nnx.Param state, `rest` any other state (`nnx.split(model,
  nnx.Param, ...)`). `response_start` = P, where the response region of `tokens` begins
  (static; TRM bounds are computed over the response region only). `state_shardings` =
  (param shardings, optimizer-state shardings), pytrees of NamedSharding: `update` returns
  its new state with exactly these (so donation reuses the buffers and the next call does
  not recompile for a layout XLA happened to choose); None leaves the layout to propagation.
  """
  P = response_start

  @jax.jit
  def score(params, rest, batch: LearnerBatch):
    return _score(nnx.merge(graphdef, params, rest), batch, cfg, P)

  grad_fn = jax.value_and_grad(
      lambda params, rest, mb, norm: _loss(nnx.merge(graphdef, params, rest), mb, norm, cfg),
      has_aux=True)
  out_shardings = None if state_shardings is None else (*state_shardings, None)

  @functools.partial(jax.jit, donate_argnums=(0, 1), out_shardings=out_shardings)
  def update(params, opt_state, rest, mb: LearnerBatch):
    loss, grads, aux = optim.accumulate_gradients(
        lambda p, b, n: grad_fn(p, rest, b, n), params, mb,
        num_microbatches=cfg.num_microbatches, normalizer=_normalizer(mb, cfg))
    return _apply(tx, cfg, params, opt_state, grads, loss, aux)

  return score, update


def _normalizer(mb: LearnerBatch, cfg: LearnerConfig) -> jax.Array:
  """[the objective's N, the batch's response-token count] (`_loss`'s normalizer)."""
  return jnp.stack([
      objectives.loss_normalizer(mb.response_mask, loss_agg=cfg.loss_agg, max_len=cfg.max_len),
      jnp.maximum(jnp.sum(mb.response_mask), 1.0)])


def one_pass(cfg: LearnerConfig, *, minibatches: int, epochs: int) -> bool:
  """Whether a rollout batch can be scored inside its update (`make_score_update`): one
  update of the whole batch, one microbatch, one group of scored rows, no frozen reference to
  score."""
  return (minibatches == epochs == cfg.num_microbatches == cfg.score_microbatches == 1
          and cfg.kl_beta == 0)


def make_score_update(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                      cfg: LearnerConfig, *, response_start: int,
                      advantages: Callable[..., jax.Array],
                      state_shardings: Optional[tuple] = None):
  """jitted `score_update(params, opt_state, rest, batch, rewards)` -> (params, opt_state,
  update metrics, score metrics): the scoring pass and the update of a batch that gets one
  update (`one_pass`), from one forward pass.

  With one update per batch, pi_theta before the update is the update's own pi_theta: the
  scoring pass's forward is the update's forward under stop_gradient, so it is made once
  (Tunix and TRL likewise take PPO's old log-probs from the update's forward when a batch is
  used once). From that forward, detached, come what `score` returns: pi_theta's log-probs
  (`logp_old`; PPO's ratio is then 1 up to the gradient), TRM's sequence mask against the
  rollout's pi_roll, its monitors and the mode's token weights; then the advantages
  (`advantages(rewards [B], seq_mask=[B]) -> [B]`, GRPO per group, so `rl.baseline="kept"`
  sees the mask) and the update, whose TRM mask is recomputed from the same terms as always.
  The batch is taken in rollout order (one minibatch has no order to shuffle)."""
  P = response_start
  mode = cfg.learner_mode

  def loss(params, rest, batch, rewards, norm):
    model = nnx.merge(graphdef, params, rest)
    terms, routing = _forward(model, batch, cfg, with_teacher=_distills(cfg), with_routing=True)
    logp_old, weights, seq_mask, score_metrics = _score_terms(terms, routing, batch, cfg, P,
                                                              model.config.num_experts)
    mb = batch.replace(logp_old=logp_old, token_weights=weights,
                       advantages=advantages(rewards, seq_mask=seq_mask))
    if mode.ratio_to_learner:
      mb = mb.replace(logp_roll=logp_old)   # as step.score_rollout does for a separate pass
    value, aux = _loss_terms(terms, mb, norm, cfg)
    return value, (aux, score_metrics)

  grad_fn = jax.value_and_grad(loss, has_aux=True)
  out_shardings = None if state_shardings is None else (*state_shardings, None, None)

  @functools.partial(jax.jit, donate_argnums=(0, 1), out_shardings=out_shardings)
  def score_update(params, opt_state, rest, batch: LearnerBatch, rewards):
    (value, (aux, score_metrics)), grads = grad_fn(params, rest, batch, rewards,
                                                   _normalizer(batch, cfg))
    params, opt_state, aux = _apply(tx, cfg, params, opt_state, grads, value, aux)
    return params, opt_state, aux, score_metrics

  return score_update
