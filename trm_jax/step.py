"""The RL step: prompts -> rollout -> rewards -> score -> advantages -> updates.

This is the function to edit for a new algorithm. `rl_step(ctx, state)` takes what the loop
carries (`TrainState`: parameters, optimizer state, step, data position) and the settings built
once per run (`RLContext`: the model's graph, the jitted learner, the task, the sampler's
configuration), and returns the next state and the step's metrics. It is pure in the sense that
matters for resume: everything it reads is in `state`, in `ctx` or a function of
(seed, step), so a run restored from a checkpoint replays bitwise.

    ctx, state = make_context(config, mesh, model, tokenizer, task)   # step-0 state
    state, metrics = rl_step(ctx, state)        # one rollout batch, its updates
    held_out = evaluate(ctx, state.params)      # greedy / avg@k on fixed problems

Every jitted program a step runs (rollout, score, update, the evaluations) comes from
`programs.build`, which `trm_jax.aot` also compiles for TPU slices: a knob read there reaches
the trainer and AOT alike.

Who computes what (the TRM paper's setting: pi_roll != pi_theta):
  (1) prompts at data position `state.data_pos` (a pure function of the seed and the index);
  (2) rollout by the sampler: its own dtype, logit noise, router noise and KV cache (pi_roll);
  (3) rewards from the decoded completions, by the task's registered reward (data/tasks.py),
      with DAPO's shaping and dynamic sampling when the config asks (`fill_batch`: top-up
      rounds of more prompts replace the groups whose rewards are all equal; the data
      position advances by every prompt rolled out);
  (4) learner `score`: pi_theta's log-probs of the sampled tokens, TRM's sequence mask and
      monitors, Sparse-RL weights (no gradient);
  (5) GRPO advantages per group (the baseline may use TRM's mask: `rl.baseline`);
  (6) `update` per minibatch and epoch; an update with a non-finite loss or gradient, or with
      every sequence masked, is skipped and counted in `learner/skipped`.
When the batch gets one update (one minibatch, epoch and microbatch, no KL reference), (4)-(6)
are one program, `score_update`: the scoring is the update's own forward pass, detached
(`rl.learner.make_score_update`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from trm_jax import preemption
from trm_jax import programs as programs_lib
from trm_jax import sharding as shd
from trm_jax.data.evaluation import heldout_metrics, step_metrics
from trm_jax.models import lora
from trm_jax.programs import DTYPES, OOM_KNOBS, Programs, narrowed  # noqa: F401 (DTYPES: train)
from trm_jax.rl import advantages as adv_lib
from trm_jax.rl import dapo
from trm_jax.rl.learner import LearnerBatch
from trm_jax.rollout.sampler import check_prompts

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------
# What a run builds once, and what it carries from step to step
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RLContext:
  """Built once per run; read, never written, by every step."""
  c: ml_collections.ConfigDict
  mesh: jax.sharding.Mesh
  programs: Programs          # every jitted program of the run (programs.build)
  rest: Any                   # the model state not trained (models.lora.split): buffers, and
                              #   with LoRA the frozen base
  task: Any                   # trm_jax.data.task.Task: prompts, sizes, held-out problems
  tok: Any                    # tokenizer (decodes completions for the reward)
  rng: jax.Array              # the run's base key (a function of config.seed, replicated)
  ref_params: Any = None      # frozen starting policy of the k3 KL penalty (rl.kl_beta > 0)
  # Disaggregated sampler (mesh.rollout_devices > 0): its own mesh, where each rollout's
  # parameters are copied to; None = colocated (the sampler uses the learner's arrays).
  sampler_mesh: Optional[jax.sharding.Mesh] = None
  sampler_rest: Any = None      # `rest` on sampler_mesh

  @property
  def graphdef(self) -> nnx.GraphDef:   # the policy's graph (learner dtype)
    return self.programs.graphdef

  @property
  def lcfg(self):
    return self.programs.lcfg

  @property
  def score(self) -> programs_lib.Program:    # learner scoring pass (rl.learner.make_learner)
    # With one update per batch the step scores inside "score_update"; the pass on its own
    # is still there for analyses.
    return self.programs.score_alone or self.programs["score"]

  @property
  def update(self) -> programs_lib.Program:   # learner update (donates params and opt_state)
    return self.programs["update"]

  @property
  def sampler_param_sh(self):
    return self.programs.sampler_param_sh


@dataclasses.dataclass
class TrainState:
  """What the loop carries between steps; a checkpoint holds all of it but `pending`.

  Staleness (rl.staleness = k): rollout batch t is sampled with the parameters after update
  t - 1 - k (version max(t - 1 - k, 0)). After `step` steps the next k rollouts need versions
  step - k .. step - 1: `history` keeps them, oldest first, in the sampler's dtype
  (`narrow`; copies: the update donates the current parameters' buffers). `pending` is the
  next batch's rollout, already dispatched at the end of the previous step so that it runs
  while that step's updates do; it is a pure function of `history[0]` and the step's key, so
  a resumed run samples it again bitwise.
  """
  params: Any                 # trained state (nnx.Param, or the LoRA adapters), sharded by
                              #   logical axes
  opt_state: Any              # optax state, moments sharded like their parameters
  step: int = 0               # RL steps done
  data_pos: int = 0           # prompts consumed (index into the task's prompt stream)
  history: tuple = ()         # k parameter trees, versions step - k .. step - 1 (k = 0: none)
  pending: Any = None         # InFlight rollout of step + 1 (k > 0), not checkpointed


@dataclasses.dataclass
class InFlight:
  """A rollout batch dispatched to the sampler, with what the step needs to use it."""
  problems: list              # the batch's problems (rewards)
  pb: Any                     # PromptBatch (problem ids per row)
  ro: Any                     # Rollout (device arrays, possibly still being computed)
  version: int                # parameter version that sampled it
  params: Any                 # those parameters as the sampler read them (top-up rounds)
  sync: dict                  # sync/seconds, sync/bytes (disaggregated sampler only)


def init_learner_state(model: nnx.Module, tx, mesh: jax.sharding.Mesh):
  """Splits a (sharded) model and creates its optimizer state on `mesh`.

  Returns (graphdef, params, rest, opt_state, (param shardings, opt-state shardings)).
  """
  graphdef, params, rest = lora.split(model)
  param_sh = jax.tree.map(lambda x: x.sharding, params)
  opt_sh = shd.opt_state_shardings(tx, params, mesh)
  opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
  return graphdef, params, rest, opt_state, (param_sh, opt_sh)


def task_sizes(c: ml_collections.ConfigDict, task) -> programs_lib.Sizes:
  """The shapes `task` gives the programs (prompt bucket, new tokens, held-out rows)."""
  n_eval = len(task.eval_problems(c.eval_problems)) if c.eval_problems else 0
  return programs_lib.Sizes(P=task.max_prompt_len, R=task.max_new_tokens, eval_problems=n_eval)


def make_context(c: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, model: nnx.Module,
                 tok, task, sampler_mesh: Optional[jax.sharding.Mesh] = None,
                 ) -> tuple[RLContext, TrainState]:
  """Builds the run's programs (`programs.build`) and the step-0 state of `model`.

  AdamW's moments take their parameter's sharding, scalars (the schedule count) are
  replicated; the learner's update returns its state with exactly these shardings. With
  `sampler_mesh` the sampler runs there (mesh.rollout_devices).
  """
  progs = programs_lib.build(c, model, mesh, sampler_mesh, task_sizes(c, task))
  _, params, rest = lora.split(model)
  opt_state = jax.jit(progs.tx.init, out_shardings=progs.opt_sh)(params)
  # Replicated on the mesh, made under jit: device_put cannot reach other processes' devices.
  rng = jax.jit(lambda: jax.random.key(c.seed),
                out_shardings=NamedSharding(mesh, PartitionSpec()))()
  disagg = {}
  if sampler_mesh is not None:
    disagg = dict(sampler_mesh=sampler_mesh,
                  sampler_rest=jax.device_put(rest, progs.sampler_rest_sh))
  ctx = RLContext(c=c, mesh=mesh, programs=progs, rest=rest, task=task, tok=tok, rng=rng,
                  # The reference policy of the optional k3 KL penalty: the start, frozen
                  # (with LoRA the starting adapters over the one frozen base: the base itself
                  # for new adapters, whose B is zero; no second copy of the base's weights).
                  ref_params=jax.tree.map(jnp.copy, params) if progs.lcfg.kl_beta > 0 else None,
                  **disagg)
  # Before any update every stale version is the starting policy: one copy serves them all.
  start = narrow(progs.sampler_dtype)(params) if c.rl.staleness else None
  return ctx, TrainState(params=params, opt_state=opt_state,
                         history=(start,) * c.rl.staleness)


# ------------------------------------------------------------------------------------------
# The step
# ------------------------------------------------------------------------------------------
def rl_step(ctx: RLContext, state: TrainState) -> tuple[TrainState, dict]:
  """One rollout batch and its updates; returns (next state, metrics of this step)."""
  c = ctx.c
  t0 = time.time()
  step = state.step + 1
  k_perm = _step_keys(ctx.rng, step)[1]

  # --- (1) prompts and (2) rollout: pi_roll (sampler dtype, noise, cache, staleness) ---------
  fl = state.pending if state.pending is not None else dispatch_rollout(ctx, state)
  ro = fl.ro
  lag = state.step - fl.version               # updates between pi_roll and pi_theta
  # The parameters this rollout's successors need: this step's pre-update parameters join
  # the history, narrowed to the sampler's dtype (copied: the update below donates their
  # buffers). Narrowing here, while the devices wait for the update anyway, lets a
  # disaggregated sampler's copy start without queueing behind that update.
  history = state.history
  if history:
    history = history[1:] + (narrow(ctx.programs.sampler_dtype)(state.params),)
  n_prompts = c.rl.batch_size // c.rl.group_size
  rollout_metrics = {"rollout/staleness": float(lag), "rollout/policy_version": float(fl.version),
                     "rollout/cache_bytes": float(ro.stats.cache_bytes), **fl.sync}
  if 0 <= c.rl.max_staleness < lag:
    # Too old to learn from: dropped and counted; the parameters stay as they are.
    rollout_metrics["rollout/dropped_stale"] = 1.0
    next_state = TrainState(params=state.params, opt_state=state.opt_state, step=step,
                            data_pos=state.data_pos + n_prompts, history=history)
    return _dispatch_next(ctx, next_state), rollout_metrics

  # --- (3) rewards, DAPO's shaping and dynamic sampling's top-up rounds -----------------------
  filled = fill_batch(ctx, state, fl)
  t_roll = time.time() - t0

  # Fault injection (debug.nan_step): that step's advantages, so its loss and every gradient,
  # are NaN.
  nan = step == c.debug.nan_step
  if "score_update" in ctx.programs.programs:
    # --- (4)-(6) in one program: one update of the whole batch, scored from its forward ------
    batch = learner_batch(ctx, filled.ro, learn=filled.learn)
    adv_rewards = np.full_like(filled.rewards, np.nan) if nan else filled.rewards
    with oom_hints("learner update"):
      params, opt_state, aux, metrics = ctx.programs["score_update"](
          state.params, state.opt_state, ctx.rest, batch, shd.put_batch(adv_rewards, ctx.mesh))
    preemption.debug_point("update", step)   # test hook: a signal while updates run
    upd = [aux]
  else:
    # --- (4) score: pi_theta (the current parameters) on the rollout, TRM mask, monitors ---
    batch, seq_mask, metrics = score_rollout(ctx, state.params, filled.ro, learn=filled.learn)

    # --- (5) advantages: GRPO, per group of rl.group_size rollouts of one prompt -----------
    adv = _group_advantages(filled.rewards, group_size=c.rl.group_size,
                            normalize_std=c.rl.normalize_std, seq_mask=seq_mask,
                            baseline=c.rl.baseline)
    if nan:
      adv = jnp.full_like(adv, jnp.nan)
    batch = batch.replace(advantages=shd.put_batch(adv, ctx.mesh))

    # --- (6) updates: rl.num_epochs passes of rl.num_minibatches minibatches ---------------
    params, opt_state, upd = run_updates(ctx, state, batch, k_perm, step)
  next_state = _dispatch_next(ctx, TrainState(
      params=params, opt_state=opt_state, step=step, data_pos=state.data_pos + filled.prompts,
      history=history))

  # --- metrics --------------------------------------------------------------------------------
  metrics = {k: float(v) for k, v in metrics.items()}
  for k in upd[0]:
    metrics[k] = float(np.mean([float(a[k]) for a in upd]))
  dt = time.time() - t0
  metrics.update({**filled.metrics, **rollout_metrics, "time/rollout_s": t_roll,
                  "time/step_s": dt, "throughput/tokens_per_s": filled.tokens / max(dt, 1e-9)})
  return next_state, metrics


@dataclasses.dataclass
class Filled:
  """(3)'s output: the batch the learner trains on and what the step sampled for it."""
  ro: Any                     # Rollout of rl.batch_size rows, groups of rl.group_size
  rewards: np.ndarray         # [B] float32 rewards the advantages take (shaped)
  learn: np.ndarray           # [B] bool rows that enter the loss (the others keep their
                              #   reward in their group's baseline)
  prompts: int                # prompts rolled out this step (the data position's advance)
  tokens: float               # response tokens sampled this step, every round
  metrics: dict               # the task's step metrics (reward; accuracy or task/<part>),
                              #   response_len over every row sampled; dapo/*


def fill_batch(ctx: RLContext, state: TrainState, fl: InFlight) -> Filled:
  """(3): the rollout's rewards, with DAPO's shaping (Yu et al. 2025; `rl.dapo`) when the
  config asks for it.

  rl.overlong_buffer > 0 adds the soft overlong penalty to the rewards; rl.mask_truncated
  takes the responses cut at task.max_new_tokens out of the loss (not out of their group's
  baseline). rl.dynamic_sampling: groups whose rewards are all equal carry no GRPO signal;
  up to rl.dynamic_sampling_max_rounds - 1 top-up rounds roll out more prompts (the next
  ones of the data stream, with the same parameters, each round with its own key) and their
  groups with signal take those groups' places, so the batch keeps its rows (static shapes
  for the learner's programs). A top-up round is a call of the continuous-batching sampler on
  just the prompts it needs (`dapo.topup_prompts`), not a second batch. Groups still without
  signal stay as rows out of the loss; `dapo/fill_rate` is the fraction of groups with
  signal. Every round's rewards are computed on every process, so all agree on the plan.
  """
  c, task = ctx.c, ctx.task
  shaping = dapo.Shaping.from_config(c.rl)
  G = c.rl.group_size
  U = c.rl.batch_size // G
  ro = fl.ro
  first = shaped_rewards(ctx, shaping, ro, fl.problems, fl.pb)
  rewards, learn, seen = first.rewards, first.learn, [first]
  prompts, dyn = U, {}
  if shaping.dynamic_sampling:
    signal = dapo.group_signal(rewards, G)
    with_signal, rounds = int(signal.sum()), 1
    key = _step_keys(ctx.rng, state.step + 1)[0]
    mesh = ctx.sampler_mesh or ctx.mesh
    while not signal.all() and rounds < shaping.max_rounds:
      n = dapo.topup_prompts(int((~signal).sum()), with_signal, prompts, batch_prompts=U,
                             group_size=G, shards=shd.batch_shards(mesh))
      problems = task.batch(state.data_pos + prompts, n)
      pb = task.prompts(problems, G)
      src = sample(ctx, fl.params, pb, jax.random.fold_in(key, rounds))
      src = src.replace(policy_version=np.full(src.tokens.shape[0], fl.version, np.int32))
      got = shaped_rewards(ctx, shaping, src, problems, pb)
      src_signal = dapo.group_signal(got.rewards, G)
      take, from_round, signal = dapo.fill_plan(signal, src_signal, G)
      ro = _merge_rows(ro, src, *shd.put_batch((take, from_round), mesh))
      rewards = np.where(from_round, got.rewards[take], rewards)
      learn = np.where(from_round, got.learn[take], learn)
      seen.append(got)
      prompts, with_signal, rounds = prompts + n, with_signal + int(src_signal.sum()), rounds + 1
    learn = learn & np.repeat(signal, G)
    dyn = {"dapo/fill_rate": float(signal.mean()), "dapo/rounds": float(rounds),
           "dapo/prompts": float(prompts), "dapo/signal_rate": with_signal / prompts}
  every = lambda f: np.concatenate([getattr(r, f) for r in seen])   # each row sampled
  raw, lengths = every("raw"), every("lengths")
  scores = {k: np.concatenate([r.scores[k] for r in seen]) for k in first.scores}
  metrics = {**step_metrics(scores, binary=task.spec.binary),
             "response_len": float(lengths.mean()),
             "rollout/truncated_frac": float(1.0 - every("finished").mean()), **dyn}
  if shaping.overlong_buffer:
    metrics["dapo/overlong_penalty"] = float(np.mean(every("rewards") - raw))
  return Filled(ro=ro, rewards=rewards, learn=learn, prompts=prompts,
                tokens=float(lengths.sum()), metrics=metrics)


@dataclasses.dataclass
class Rewarded:
  """One rollout's rewards and what DAPO's shaping reads, per row [B]."""
  scores: dict                # the task's registered reward: {"reward": [B], part: [B]}
  raw: np.ndarray             # float32 the task's rewards (scores["reward"])
  rewards: np.ndarray         # float32 with the overlong penalty (rl.overlong_buffer > 0)
  learn: np.ndarray           # bool: enters the loss (rl.mask_truncated: finished rows only)
  lengths: np.ndarray         # int32 response tokens, EOS included
  finished: np.ndarray        # bool: ended with EOS (not cut at task.max_new_tokens)


def shaped_rewards(ctx: RLContext, shaping: dapo.Shaping, ro, problems, pb) -> Rewarded:
  """One rollout's rewards: the task's, plus the overlong penalty (rl.overlong_buffer > 0);
  with rl.mask_truncated only the rows that ended with EOS enter the loss."""
  scores = rewards_of(ctx, ro, problems, pb.problem_ids)
  raw = scores["reward"]
  lengths, finished = host(ro.response_lengths), host(ro.stats.finished)
  rewards = raw
  if shaping.overlong_buffer:
    rewards = raw + dapo.overlong_penalty(lengths, max_new_tokens=ctx.task.max_new_tokens,
                                          buffer=shaping.overlong_buffer,
                                          penalty=shaping.overlong_penalty)
  learn = finished if shaping.mask_truncated else np.ones(raw.shape, bool)
  return Rewarded(scores=scores, raw=raw, rewards=rewards, learn=learn, lengths=lengths,
                  finished=finished)


def learner_batch(ctx: RLContext, ro, learn: Optional[np.ndarray] = None) -> LearnerBatch:
  """The rollout as the learner's batch on its devices (advantages, logp_old and token
  weights are placeholders that scoring fills in). Rows where `learn` [B] is False get an
  empty response mask: out of the loss, its normaliser and TRM's monitors, like padding."""
  B, T = ro.tokens.shape
  # Onto the learner's devices first (the sampler's may be others), then computed on.
  batch = shd.put_batch(LearnerBatch(
      tokens=ro.tokens, segment_ids=ro.segment_ids, response_mask=ro.response_mask,
      logp_roll=ro.logp, advantages=np.zeros(B, np.float32), logp_old=ro.logp,
      token_weights=np.ones((B, T), np.float32),
      evicted_at=ro.evicted_at if ctx.lcfg.learner_mode.replays_eviction else None,
      roll_logp_full=ro.full_logp, roll_topk_logp=ro.topk_logp, roll_topk_ids=ro.topk_ids,
      routed_experts=ro.routed_experts), ctx.mesh)
  batch = batch.replace(response_mask=batch.response_mask.astype(jnp.float32))
  if learn is not None and not learn.all():
    batch = batch.replace(response_mask=_mask_rows(
        batch.response_mask, shd.put_batch(learn.astype(np.float32), ctx.mesh)))
  return batch


def score_rollout(ctx: RLContext, params, ro, learn: Optional[np.ndarray] = None
                  ) -> tuple[LearnerBatch, jax.Array, dict]:
  """(4): the rollout as the learner's batch on its devices (`learner_batch`), scored by
  pi_theta = `params`: (batch with logp_old, token weights and the reference's log-probs
  filled in, TRM's sequence mask [B], the score pass's metrics)."""
  mode = ctx.lcfg.learner_mode
  batch = learner_batch(ctx, ro, learn)
  with oom_hints("learner score pass"):
    logp_old, weights, seq_mask, metrics = ctx.score(params, ctx.rest, batch)
  batch = batch.replace(logp_old=logp_old, token_weights=weights)
  if ctx.ref_params is not None:
    batch = batch.replace(logp_ref=ctx.score(ctx.ref_params, ctx.rest, batch)[0])
  if mode.ratio_to_learner:
    # Sparse-RL's weights already carry the dense/sparse correction: the surrogate's ratio
    # is then taken against the dense learner's own log-probs, not the sparse sampler's.
    batch = batch.replace(logp_roll=logp_old)
  return batch, seq_mask, metrics


def run_updates(ctx: RLContext, state: TrainState, batch: LearnerBatch, k_perm: jax.Array,
                step: int) -> tuple[Any, Any, list]:
  """(6): rl.num_epochs passes of rl.num_minibatches minibatch updates of `state`'s
  parameters, each epoch in the order of its own permutation; (params, opt_state, the
  updates' metrics)."""
  c = ctx.c
  params, opt_state = state.params, state.opt_state
  mb_size = c.rl.batch_size // c.rl.num_minibatches
  upd = []
  for epoch in range(c.rl.num_epochs):
    order = _minibatch_rows(k_perm, epoch, n=c.rl.batch_size, mb=mb_size)   # [n / mb, mb]
    for i in range(c.rl.num_minibatches):
      mb = shd.put_batch(_take_rows(batch, order, i), ctx.mesh)
      with oom_hints("learner update"):
        params, opt_state, aux = ctx.update(params, opt_state, ctx.rest, mb)
      if not upd:
        preemption.debug_point("update", step)   # test hook: a signal while updates run
      upd.append(aux)
  return params, opt_state, upd


def dispatch_rollout(ctx: RLContext, state: TrainState) -> InFlight:
  """Prompts and the rollout of batch state.step + 1, sampled with parameter version
  max(state.step - k, 0): `history[0]` when rl.staleness = k > 0, else the current ones.

  Returns without waiting for the sampler (jax dispatches asynchronously); with a
  disaggregated sampler the parameters are first copied to its devices (timed and sized).
  """
  c, task = ctx.c, ctx.task
  step = state.step + 1
  k_roll = _step_keys(ctx.rng, step)[0]
  problems = task.batch(state.data_pos, c.rl.batch_size // c.rl.group_size)
  pb = task.prompts(problems, c.rl.group_size)
  params = state.history[0] if state.history else state.params
  version = max(state.step - len(state.history), 0)
  sync = {}
  if ctx.sampler_mesh is not None:
    t0 = time.time()
    params = jax.block_until_ready(to_sampler(ctx, params))
    sync = {"sync/seconds": time.time() - t0,
            "sync/bytes": float(sum(x.nbytes for x in jax.tree.leaves(params)))}
  ro = sample(ctx, params, pb, k_roll)
  preemption.debug_point("rollout", step)   # test hook: a signal while the rollout runs
  ro = ro.replace(policy_version=np.full(ro.tokens.shape[0], version, np.int32))
  return InFlight(problems=problems, pb=pb, ro=ro, version=version, params=params, sync=sync)


def _dispatch_next(ctx: RLContext, state: TrainState) -> TrainState:
  """With staleness the next batch's parameters exist already: start its rollout now, so it
  runs while this step's updates (dispatched, not finished) do."""
  if state.history and state.step < ctx.c.total_steps:
    state.pending = dispatch_rollout(ctx, state)
  return state


@functools.lru_cache(maxsize=None)
def narrow(to):
  """jit(tree -> tree): every leaf cast to `narrowed(leaf.dtype, to)`."""
  return jax.jit(lambda tree: jax.tree.map(lambda x: x.astype(narrowed(x.dtype, to)), tree))


def to_sampler(ctx: RLContext, params):
  """The learner's parameters as the disaggregated sampler receives them: narrowed to the
  sampler's dtype on the learner's devices (every weight enters the sampler's computation as
  `w.astype(compute dtype)`, so narrowing first changes no rollout bit and halves a bf16
  sampler's copy), then resharded onto the sampler's devices."""
  to = ctx.programs.sampler_dtype
  if any(narrowed(x.dtype, to) != x.dtype for x in jax.tree.leaves(params)):
    params = narrow(to)(params)   # k = 0: the current parameters; history is narrow already
  return jax.device_put(params, ctx.sampler_param_sh)


def sample(ctx: RLContext, params, pb, key: jax.Array):
  """Training rollouts of a prompt batch: pi_roll (the sampler's dtype, noise, truncation and
  KV cache), on the sampler's mesh (the learner's when colocated)."""
  mesh = ctx.sampler_mesh or ctx.mesh
  rest = ctx.rest
  if ctx.sampler_mesh is not None:
    rest = ctx.sampler_rest
    key = jax.device_put(key, NamedSharding(mesh, PartitionSpec()))
  # Lengths stay on the host: they are checked there (and a [B] vector is cheap).
  ids, lengths = check_prompts(shd.put_batch(pb.tokens, mesh), pb.lengths)
  with oom_hints("rollout"):
    return ctx.programs["rollout"](nnx.merge_state(params, rest), ids, lengths, key)


def evaluate(ctx: RLContext, params, *, step: Optional[int] = None) -> dict:
  """Held-out evaluation in the learner dtype, with the dense cache and, when the rollouts
  are compressed, also with the rollout's cache policy (keys prefixed `compressed_`).

  Always greedy; with eval_samples = k > 1 also k samples per problem at eval_temperature
  and eval_top_p. The held-out format's registry entry (task.eval_name, else task.name) scores
  them and picks the numbers (`evaluation.heldout_metrics`): a binary task's greedy accuracy,
  avg@k and unbiased pass@k (Chen et al. 2021) for k in {1, k}; a graded task's mean reward
  and the mean of each of its parts, greedy and over the k samples (avg@k is the mean reward
  either way). At the rollout's temperature and top-p (the tiny configs' defaults), avg@k is
  what the training reward estimates, on fixed problems: the per-step reward mixes the policy's
  change with the difficulty of that step's few prompts. The sampling key is the same at
  every evaluation, so two evaluations differ only by the policy. The compressed figure is
  the one a KV-compressed deployment sees, which SMD trains for (the dense one is what the
  dense learner baselines train for). `step` (the trainer's) only names the moment for the
  preemption test hook.
  """
  c, task = ctx.c, ctx.task
  problems = task.eval_problems(c.eval_problems)
  k = c.eval_samples
  suffixes = [""] + (["_compressed"] if ctx.programs.cache.compresses else [])
  state = nnx.merge_state(params, ctx.rest)
  key = jax.random.key(c.seed + 3)
  out = {}
  for suffix in suffixes:
    prefix = suffix[1:] + "_" if suffix else ""
    for n in (1, k) if k > 1 else (1,):
      pb = task.prompts(problems, n)
      program = ctx.programs[f"eval_{'greedy' if n == 1 else 'sampled'}{suffix}"]
      scores = _evaluate_rows(ctx, program, state, pb, problems, key)
      if step is not None and not out:
        preemption.debug_point("eval", step)   # test hook: a signal mid-evaluation
      out.update({prefix + name: v for name, v in
                  heldout_metrics(scores, binary=task.eval_spec.binary, n=n).items()})
  return out


def _evaluate_rows(ctx: RLContext, program, state, pb, problems, key) -> dict[str, np.ndarray]:
  """{"reward": [rows], part: [rows]}: the held-out scores of every row of prompt batch `pb`,
  sampled in calls of the program's row count (eval_batch_size rounded up to the mesh; the
  last call padded with copies of the last row, which are dropped). Call i > 0 draws from
  fold_in(key, i), call 0 from `key` itself, so an evaluation that fits one call is the same
  as an unchunked one."""
  chunk = program.args[1].shape[0]
  rows = pb.tokens.shape[0]
  out = []
  for i, start in enumerate(range(0, rows, chunk)):
    idx = np.minimum(np.arange(start, start + chunk), rows - 1)   # pad: repeat the last row
    ids, lengths = check_prompts(shd.put_batch(pb.tokens[idx], ctx.mesh), pb.lengths[idx])
    ro = program(state, ids, lengths, key if i == 0 else jax.random.fold_in(key, i))
    scores = rewards_of(ctx, ro, problems, pb.problem_ids[idx], held_out=True)
    out.append({k: v[:min(chunk, rows - start)] for k, v in scores.items()})
  return {k: np.concatenate([o[k] for o in out]) for k in out[0]}


# ------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------
# The step's small computations are jitted: run eagerly, each jnp op is a program of its own,
# lowered and compiled (or read from the persistent cache) in every process, about 40 of them
# per trainer start, each costing tens of milliseconds.
@jax.jit
def _step_keys(rng: jax.Array, step) -> tuple[jax.Array, jax.Array]:
  """(rollout key, minibatch-order key) of step `step`."""
  k = jax.random.split(jax.random.fold_in(rng, step))
  return k[0], k[1]


@functools.partial(jax.jit, static_argnames=("n", "mb"))
def _minibatch_rows(k_perm: jax.Array, epoch, *, n: int, mb: int) -> jax.Array:
  """[n / mb, mb] the rows of each minibatch of epoch `epoch`: a permutation of the batch."""
  return jax.random.permutation(jax.random.fold_in(k_perm, epoch), n).reshape(n // mb, mb)


@jax.jit
def _take_rows(batch, order: jax.Array, i):
  """The rows order[i] of every array of `batch`."""
  return jax.tree.map(lambda x: x[order[i]], batch)


@jax.jit
def _mask_rows(response_mask: jax.Array, keep: jax.Array) -> jax.Array:
  """[B, T] response mask with the rows where keep [B] is 0 emptied."""
  return response_mask * keep[:, None]


@jax.jit
def _merge_rows(dst, src, take: jax.Array, from_src: jax.Array):
  """Rollout `dst` with each row b where from_src[b] replaced by row take[b] of rollout `src`
  (dynamic sampling: a top-up round's groups taking the places of groups without signal);
  the decode steps of both add up."""
  def pick(d, s):
    return jnp.where(from_src.reshape(from_src.shape + (1,) * (d.ndim - 1)), s[take], d)
  stats = dst.stats.replace(finished=pick(dst.stats.finished, src.stats.finished),
                            entropy=pick(dst.stats.entropy, src.stats.entropy),
                            decode_steps=dst.stats.decode_steps + src.stats.decode_steps)
  rows = jax.tree.map(pick, dst.replace(stats=None), src.replace(stats=None))
  return rows.replace(stats=stats)


_group_advantages = jax.jit(adv_lib.group_advantages,
                            static_argnames=("group_size", "normalize_std", "baseline", "eps"))


def host(x: jax.Array) -> np.ndarray:
  """The full value of a (possibly multi-process) global array on this host."""
  if jax.process_count() == 1:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def completions_of(tok, rollout, P: int) -> list[str]:
  """[B] decoded responses of a rollout whose prompts are P columns wide (every process
  decodes every row)."""
  tokens = host(rollout.tokens)[:, P:]
  mask = host(rollout.response_mask)[:, P:] > 0
  return [tok.decode(tokens[b][mask[b]].tolist()) for b in range(tokens.shape[0])]


def rewards_of(ctx: RLContext, rollout, problems, problem_ids, *,
               held_out: bool = False) -> dict[str, np.ndarray]:
  """{"reward": [B] float32, part: [B] ...}: each decoded completion scored against its
  problem (row b's is problems[problem_ids[b]]) by the task's registered reward, the held-out
  format's with `held_out` (`Task.score`).

  Every process scores every row (cheap, and all then hold the same advantages without a
  collective)."""
  texts = completions_of(ctx.tok, rollout, ctx.task.max_prompt_len)
  return ctx.task.score(texts, [problems[i] for i in problem_ids], held_out=held_out)


class OutOfMemoryError(MemoryError):
  """XLA ran out of device memory; the message names the config knobs that lower it."""


@contextlib.contextmanager
def oom_hints(stage: str):
  """Re-raises XLA RESOURCE_EXHAUSTED errors inside the block with the knobs to lower."""
  try:
    yield
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    raise OutOfMemoryError(
        f"out of device memory in the {stage}. Knobs that lower memory:\n  " +
        "\n  ".join(OOM_KNOBS) + f"\n(XLA: {str(e).splitlines()[0]})") from e


def warn_truncation(c: ml_collections.ConfigDict) -> None:
  """The learner scores the untruncated pi_theta, so a sampler nucleus / top-k cut is mismatch
  that TRM measures: per token up to -log(top_p) nats of KL(pi_roll || pi_theta) from top-p
  alone. Say so whenever TRM is on with a truncating sampler (whether a given threshold is
  reached depends on each step's distributions)."""
  r = c.rollout
  if not c.trm.criteria or (r.top_p >= 1.0 and r.top_k <= 0):
    return
  cut = f"top_p={r.top_p} (up to {-math.log(r.top_p):.3g} nats per token)" if r.top_p < 1 \
      else f"top_k={r.top_k}"
  log.warning("rollout.%s truncates pi_roll; the learner scores the untruncated pi_theta, "
              "so TRM (trm.criteria=%s, trm.delta=%s) counts the truncation as mismatch and "
              "may reject sequences for it. Train with rollout.top_p=1.0, rollout.top_k=0 and "
              "set eval_top_p for evaluation.", cut, tuple(c.trm.criteria), c.trm.delta)
