r"""The RL trainer: rollout -> reward -> GRPO advantages -> TRM/SMD learner, in one loop.

  python -m trm_jax.train --config configs/tiny_trm.py --workdir /tmp/trm_tiny \
      [--config.total_steps=100 --config.trm.criteria="('trm_max_kl','trm_avg_kl')" ...]

Each step (ARCHITECTURE.md):
  (1) prompts at data position `pos` (a pure function of the seed and the index: resumable);
  (2) rollout with the sampler's cache / dtype / noise settings (pi_roll);
  (3) rewards from the decoded completions, GRPO advantages per group;
  (4) learner `score` (logp_old, TRM monitors, Sparse-RL weights) and `update` per minibatch;
  (5) metrics -> console, TensorBoard, metrics.jsonl; orbax checkpoint every `ckpt_every`.
Held-out evaluation (`evaluate`) at step 0 and every `eval_every` steps, logged as `eval/*`,
and at the end. At the end also a PNG of the curves, the summary (reward change from the first
10% of steps to the last 10%, and the first and last held-out evaluation), and the policy
exported as an HF checkpoint.

Artifacts in --workdir: metrics.jsonl, tb/, ckpt/, curves.png, summary.json, hf/.

Scale and faults:
  * Mesh (`config.mesh`, axes data/fsdp/tensor, one -1 = remaining devices): the model loads
    sharded by its logical axes, the optimizer state mirrors the parameter shardings, batches
    are split over (data, fsdp), and the learner's update returns its state with the same
    NamedShardings. The sampler runs on the same sharded parameters.
  * Multi-process: `init_distributed()` (CLI) calls `jax.distributed.initialize` when
    JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID are set. Every process
    builds the same prompt batch from the shared data position and hands jax only its
    addressable shards (`sharding.put_batch`); rewards are computed on every process from the
    gathered completions (redundant but cheap, and every process then holds the same
    advantages without another collective). Process 0 builds the warm-up base model, the
    others wait for it on the shared filesystem. Checkpoints are written by all processes
    together (orbax); metrics, plots and the HF export by process 0. Tested with 2 processes
    x 2 CPU devices against 1 process x 4 devices (tests/test_distributed.py).
  * Exact resume: everything the loop reads is in the checkpoint (params, AdamW state with
    its schedule count, the RNG key, the data position) or a pure function of (seed, step);
    a run killed at any point and resumed ends with bitwise identical parameters.
  * A non-finite loss or gradient skips the update (`learner/skipped`); `debug.nan_step`
    injects one. XLA out-of-memory errors are re-raised naming the knobs that lower memory.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec
from ml_collections import config_flags

from trm_jax import config as config_lib
from trm_jax import sharding as shd
from trm_jax import warmup
from trm_jax.checkpoint import Checkpointer
from trm_jax.data import (load_problems, make_prompt_batch, math_reward, problem_batch,
                          synthetic)
from trm_jax.data import summarize as eval_summary
from trm_jax.metrics import MetricsLogger, format_summary, plot_curves, summarize
from trm_jax.models import from_pretrained, save_pretrained
from trm_jax.models.tokenizer import load_tokenizer
from trm_jax.rl import advantages as adv_lib
from trm_jax.rl import optim
from trm_jax.rl.learner import LearnerBatch, LearnerConfig, make_learner
from trm_jax.rollout import CacheConfig, generate

log = logging.getLogger("trm_jax.train")

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_trm.py",
                                          "experiment config (python file with get_config)",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory (checkpoints, metrics, plots)")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PROGRESS_KEYS = ("reward", "trm/reject_rate", "trm/ppl_gap", "bound/unified")
SUMMARY_KEYS = ("reward", "accuracy", "trm/reject_rate", "trm/ppl_gap", "bound/unified",
                "smd/distill_kl", "sparse_rl/wasted_frac", "learner/entropy", "response_len",
                "learner/skipped", "throughput/tokens_per_s", "memory/host_peak_rss_mb")


# ------------------------------------------------------------------------------------------
# Settings derived from the config
# ------------------------------------------------------------------------------------------
def _dtype(name: str, key: str):
  if name not in DTYPES:
    raise config_lib.ConfigError(f"{key}={name!r}; expected one of {sorted(DTYPES)}")
  return DTYPES[name]


def learner_config(c: ml_collections.ConfigDict, max_len: int) -> LearnerConfig:
  r = c.rl
  kwargs = {"ppo_clip": (("clip_eps_low", r.clip_eps_low), ("clip_eps_high", r.clip_eps_high),
                         ("dual_clip_c", r.dual_clip_c)),
            "tis": (("tis_cap", r.tis_cap),),
            "token_mask": (("tau", r.token_mask_tau),)}.get(r.objective, ())
  criteria = tuple(c.trm.criteria)
  thresholds = tuple((k, float(v)) for k, v in c.trm.items() if k != "criteria")
  return LearnerConfig(objective=r.objective, loss_agg=r.loss_agg, objective_kwargs=kwargs,
                       max_len=max_len, criteria=criteria, thresholds=thresholds,
                       mode=c.smd.mode, lam=float(c.smd.lam),
                       num_microbatches=r.num_microbatches, chunk=r.chunk,
                       attn_impl=c.model.attn_impl, temperature=float(c.rollout.temperature),
                       kl_beta=float(c.rl.kl_beta))


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
  log.warning("rollout.%s truncates pi_roll; the learner scores the untruncated pi_theta, so "
              "TRM (trm.criteria=%s, trm.delta=%s) counts the truncation as mismatch and may "
              "reject sequences for it. Train with rollout.top_p=1.0, rollout.top_k=0 and set "
              "eval_top_p for evaluation.", cut, tuple(c.trm.criteria), c.trm.delta)


def cache_config(c: ml_collections.ConfigDict) -> CacheConfig:
  cc = c.rollout.cache
  if cc.policy == "none":
    return CacheConfig()
  budget = ({"capacity": cc.capacity} if cc.capacity else {"ratio": cc.ratio})
  return CacheConfig(policy=cc.policy, window=cc.window, kernel=cc.kernel,
                     recent_frac=cc.recent_frac, sinks=cc.sinks, **budget)


class Task:
  """Prompts by data position, and the lengths the sampler is compiled for."""

  def __init__(self, c: ml_collections.ConfigDict, tokenizer):
    self.c, self.tok = c, tokenizer
    t = c.task
    if t.name == "synthetic":
      self.syn = warmup.synthetic_config(c)
      # chat template adds "<bos>Q:" ... "\nA:" around the problem: 6 tokens.
      self.max_prompt_len = t.max_prompt_len or synthetic.max_prompt_chars(self.syn) + 6
      self.max_new_tokens = t.max_new_tokens or synthetic.max_completion_chars(self.syn) + 1
      self.problems = self.eval_set = None
    else:
      if not t.path:
        raise config_lib.ConfigError(f"task.name={t.name!r} needs task.path (a local file)")
      self.problems = load_problems(t.name, t.path)
      self.eval_set = load_problems(t.name, t.eval_path) if t.eval_path else None
      if not (t.max_prompt_len and t.max_new_tokens):
        raise config_lib.ConfigError(
            f"task.name={t.name!r} needs task.max_prompt_len and task.max_new_tokens")
      self.max_prompt_len, self.max_new_tokens = t.max_prompt_len, t.max_new_tokens

  def batch(self, pos: int, n: int):
    if self.problems is None:
      return problem_batch(self.syn, self.c.seed, pos, n)
    return [self.problems[(pos + i) % len(self.problems)] for i in range(n)]

  def eval_problems(self, n: int):
    if self.problems is None:  # a stream no training step ever reads
      return problem_batch(self.syn, self.c.seed + 2, 0, n)
    return (self.eval_set or self.problems)[:n]

  def prompts(self, problems, group_size: int):
    return make_prompt_batch(self.tok, problems, group_size, max_prompt_len=self.max_prompt_len)


def host(x: jax.Array) -> np.ndarray:
  """The full value of a (possibly multi-process) global array on this host."""
  if jax.process_count() == 1:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def memory_metrics() -> dict:
  """Peak host RSS, and the accelerator's peak bytes where the backend reports them (GPU/TPU;
  the CPU backend has no allocator statistics)."""
  out = {"memory/host_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
  stats = jax.local_devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    out["memory/device_peak_mb"] = stats["peak_bytes_in_use"] / 2**20
  return out


def rewards_of(tok, rollout, problems, problem_ids, P: int) -> np.ndarray:
  tokens = host(rollout.tokens)[:, P:]
  mask = host(rollout.response_mask)[:, P:] > 0
  out = np.zeros(tokens.shape[0], np.float32)
  for b in range(tokens.shape[0]):
    text = tok.decode(tokens[b][mask[b]].tolist())
    out[b] = math_reward(text, problems[problem_ids[b]].answer)
  return out


# ------------------------------------------------------------------------------------------
# Devices and faults
# ------------------------------------------------------------------------------------------
def init_distributed() -> bool:
  """`jax.distributed.initialize` from the standard environment variables, if they are set.

  JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES, JAX_PROCESS_ID. Returns
  whether it initialised. Must run before anything touches a jax device.
  """
  addr = os.environ.get("JAX_COORDINATOR_ADDRESS")
  if not addr:
    return False
  missing = [k for k in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if k not in os.environ]
  if missing:
    raise config_lib.ConfigError(f"JAX_COORDINATOR_ADDRESS={addr!r} is set but {missing} "
                                 "are not: set all three for a multi-process run")
  jax.distributed.initialize(addr, num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                             process_id=int(os.environ["JAX_PROCESS_ID"]))
  return True


def make_mesh(c: ml_collections.ConfigDict) -> jax.sharding.Mesh:
  """The (data, fsdp, tensor) mesh of `config.mesh` over every device of every process."""
  try:
    return shd.mesh_from_config(dict(c.mesh), key="mesh")
  except ValueError as e:
    raise config_lib.ConfigError(str(e)) from e


OOM_KNOBS = ("rl.num_microbatches (raise it: smaller microbatches, same update)",
             "rl.chunk (lower it: fewer positions per vocabulary projection)",
             "model.remat=True (recompute block activations in the backward pass)",
             "task.max_new_tokens (shorter rollouts)",
             "rl.batch_size, or a larger mesh.fsdp to shard parameters and optimizer state")


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


def wait_for_base_model(c: ml_collections.ConfigDict, timeout_s: float = 3 * 3600) -> str:
  """Processes other than 0 wait for process 0's warm-up base model on the shared filesystem.

  Not a device barrier: CPU (gloo) collectives time out long before a warm-up ends. The base
  model is published atomically (warmup.py), so `is_current` never sees half a checkpoint.
  """
  if c.model.path:
    return c.model.path
  out = os.path.expanduser(c.warmup.cache_dir)
  t0 = time.time()
  while not warmup.is_current(out, c):
    if time.time() - t0 > timeout_s:
      raise TimeoutError(f"process {jax.process_index()}: no base model at {out} "
                         f"(warmup.cache_dir) after {timeout_s:.0f}s; it must be on a "
                         "filesystem all processes share")
    time.sleep(1.0)
  return out


def init_learner_state(model: nnx.Module, tx, mesh: jax.sharding.Mesh):
  """Splits a (sharded) model and creates its optimizer state on `mesh`.

  Returns (graphdef, params, rest, opt_state, (param shardings, opt-state shardings)): AdamW's
  moments take their parameter's sharding, scalars (the schedule count) are replicated.
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  param_sh = jax.tree.map(lambda x: x.sharding, params)
  opt_sh = shd.mirror_shardings(jax.eval_shape(tx.init, params), params, mesh)
  opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
  return graphdef, params, rest, opt_state, (param_sh, opt_sh)


# ------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------
def run(c: ml_collections.ConfigDict, workdir: str, *, progress: bool = True) -> dict:
  """Trains per config `c` into `workdir`; returns the summary dict."""
  config_lib.validate(c)
  os.makedirs(workdir, exist_ok=True)
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(c.to_json_best_effort(indent=2))

  mesh = make_mesh(c)
  log.info("mesh %s over %d devices, %d processes", dict(mesh.shape), mesh.size,
           jax.process_count())
  # Outside the mesh context: the warm-up is a process-local job (its arrays are not global).
  base = (warmup.ensure_base_model(c, log=log.info) if jax.process_index() == 0 else
          wait_for_base_model(c))
  # Inside the mesh context the model's block-boundary activation constraints (residual
  # stream over (data, fsdp), sharding.constrain) are live in the sampler and the learner.
  with jax.set_mesh(mesh):
    return _run(c, workdir, mesh, base, progress=progress)


def _run(c: ml_collections.ConfigDict, workdir: str, mesh: jax.sharding.Mesh, base: str, *,
         progress: bool) -> dict:
  # --- Model, tokenizer, task -------------------------------------------------------------
  model = from_pretrained(base, dtype=_dtype(c.model.dtype, "model.dtype"), remat=c.model.remat,
                          mesh=mesh)
  tok = load_tokenizer(base)
  task = Task(c, tok)
  P, N = task.max_prompt_len, task.max_new_tokens
  roll_dtype = _dtype(c.rollout.dtype, "rollout.dtype")
  lcfg = learner_config(c, max_len=N)
  cache = cache_config(c)
  warn_truncation(c)

  # --- Optimizer and learner ----------------------------------------------------------------
  o = c.optim
  steps_per_batch = c.rl.num_minibatches * c.rl.num_epochs
  n_updates = c.total_steps * steps_per_batch
  tx = optim.make_optimizer(lr=o.lr, warmup_steps=min(o.warmup_steps, n_updates - 1),
                            total_steps=n_updates,
                            weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, eps=o.eps,
                            clip_norm=o.clip_norm, min_lr_ratio=o.min_lr_ratio)
  graphdef, params, rest, opt_state, state_sh = init_learner_state(model, tx, mesh)
  score, update = make_learner(graphdef, tx, lcfg, response_start=P, state_shardings=state_sh)
  # Replicated on the mesh: orbax saves global arrays only (multi-process); made under jit
  # because device_put cannot reach other processes' devices.
  rng = jax.jit(lambda: jax.random.key(c.seed),
                out_shardings=NamedSharding(mesh, PartitionSpec()))()

  # The reference policy of the optional k3 KL penalty: the starting policy, frozen.
  ref_params = jax.tree.map(jnp.copy, params) if lcfg.kl_beta > 0 else None

  # --- Resume -------------------------------------------------------------------------------
  ckpt = Checkpointer(os.path.join(workdir, "ckpt"), save_every=c.ckpt_every,
                      keep=c.keep_ckpts)
  state = {"params": params, "opt_state": opt_state, "rng": rng}
  start, data_pos = 0, 0
  restored = ckpt.restore_latest(jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state))
  if restored is not None:
    start, state, meta = restored
    data_pos = int(meta["data_pos"])
    log.info("resumed from step %d (data position %d)", start, data_pos)
  params, opt_state, rng = state["params"], state["opt_state"], state["rng"]

  lead = jax.process_index() == 0  # writes metrics, plots, summary and the HF export
  logger = MetricsLogger(workdir, total_steps=c.total_steps, enable_progress=progress,
                         progress_keys=PROGRESS_KEYS,
                         resume_step=start if restored is not None else None) if lead else None
  n_prompts = c.rl.batch_size // c.rl.group_size
  mb_size = c.rl.batch_size // c.rl.num_minibatches

  def eval_due(step: int) -> bool:
    return bool(c.eval_problems) and (
        step == c.total_steps or (c.eval_every > 0 and step % c.eval_every == 0))

  def eval_metrics(ev: dict) -> dict:
    return {f"eval/{k}": v for k, v in ev.items()}

  last_eval = None
  if start == 0 and c.eval_every > 0 and c.eval_problems:
    # Step 0: the starting policy on the same held-out problems (and, through the fixed eval
    # key, the same sampling noise) as every later evaluation, so eval/* changes are the
    # policy's, not the training batches' difficulty (which dominates per-step reward).
    last_eval = evaluate(c, graphdef, params, rest, task, tok, mesh)
    if logger is not None:
      logger.log(0, eval_metrics(last_eval))
  t_start = time.time()
  for step in range(start + 1, c.total_steps + 1):
    t0 = time.time()
    key = jax.random.fold_in(rng, step)
    k_roll, k_perm = jax.random.split(key)
    # (1) prompts
    problems = task.batch(data_pos, n_prompts)
    pb = task.prompts(problems, c.rl.group_size)
    data_pos += n_prompts
    # (2) rollout (pi_roll: sampler dtype, noise, cache)
    sampler = nnx.merge(graphdef, params, rest)
    # Lengths stay on the host: the sampler checks them there (and a [B] vector is cheap).
    with oom_hints("rollout"):
      ro = generate(sampler, shd.put_batch(pb.tokens, mesh), pb.lengths, max_new_tokens=N,
                    key=k_roll, temperature=c.rollout.temperature,
                    top_p=c.rollout.top_p, top_k=c.rollout.top_k, cache=cache,
                    keep_full_logprobs=c.rollout.keep_full_logprobs,
                    keep_topk_logprobs=c.rollout.keep_topk_logprobs,
                    compute_dtype=roll_dtype, logit_noise=c.rollout.logit_noise,
                    router_noise_scale=c.rollout.router_noise, attn_impl=c.model.attn_impl)
    t_roll = time.time() - t0
    # (3) rewards and advantages
    rewards = rewards_of(tok, ro, problems, pb.problem_ids, P)
    adv = adv_lib.group_advantages(jnp.asarray(rewards), group_size=c.rl.group_size,
                                   normalize_std=c.rl.normalize_std)
    if step == c.debug.nan_step:
      # Fault injection: NaN advantages make the loss and every gradient NaN.
      adv = jnp.full_like(adv, jnp.nan)
    resp = ro.response_mask.astype(jnp.float32)
    batch = LearnerBatch(tokens=ro.tokens, segment_ids=ro.segment_ids, response_mask=resp,
                         logp_roll=ro.logp, advantages=adv, logp_old=ro.logp,
                         token_weights=jnp.ones_like(resp),
                         evicted_at=ro.evicted_at if lcfg.mode == "smd" else None,
                         roll_logp_full=ro.full_logp, roll_topk_logp=ro.topk_logp,
                         roll_topk_ids=ro.topk_ids)
    batch = shd.put_batch(batch, mesh)
    # (4) learner
    with oom_hints("learner score pass"):
      logp_old, weights, _, metrics = score(params, rest, batch)
    batch = batch.replace(logp_old=logp_old, token_weights=weights)
    if ref_params is not None:
      batch = batch.replace(logp_ref=score(ref_params, rest, batch)[0])
    if lcfg.mode == "sparse_rl":
      # Sparse-RL's weights already carry the dense/sparse correction: the surrogate's ratio
      # is then taken against the dense learner's own log-probs, not the sparse sampler's.
      batch = batch.replace(logp_roll=logp_old)
    upd = []
    for epoch in range(c.rl.num_epochs):
      perm = jax.random.permutation(jax.random.fold_in(k_perm, epoch), c.rl.batch_size)
      for i in range(c.rl.num_minibatches):
        idx = perm[i * mb_size:(i + 1) * mb_size]
        mb = shd.put_batch(jax.tree.map(lambda x: x[idx], batch), mesh)
        with oom_hints("learner update"):
          params, opt_state, aux = update(params, opt_state, rest, mb)
        upd.append(aux)
    # (5) metrics and checkpoint
    metrics = {k: float(v) for k, v in metrics.items()}
    for k in upd[0]:
      metrics[k] = float(np.mean([float(a[k]) for a in upd]))
    n_tok = float(jnp.sum(resp))
    metrics.update({"reward": float(rewards.mean()),
                    "accuracy": float((rewards > 0.5).mean()),
                    "response_len": n_tok / rewards.shape[0],
                    "rollout/cache_bytes": float(ro.stats.cache_bytes),
                    "time/rollout_s": t_roll, "time/step_s": time.time() - t0,
                    "throughput/tokens_per_s": n_tok / max(time.time() - t0, 1e-9)})
    metrics.update(memory_metrics())
    logged = step % c.log_every == 0 or step == c.total_steps
    if eval_due(step):
      last_eval = evaluate(c, graphdef, params, rest, task, tok, mesh)
      metrics.update(eval_metrics(last_eval))
      logged = True
    if logger is not None and logged:
      logger.log(step, metrics)
    ckpt.maybe_save(step, {"params": params, "opt_state": opt_state, "rng": rng},
                    meta={"step": step, "data_pos": data_pos},
                    force=step == c.total_steps)
  ckpt.close()
  if logger is not None:
    logger.close()

  # --- Final evaluation, plot, summary, export ----------------------------------------------
  result = {"workdir": workdir, "wall_s": time.time() - t_start}
  if c.eval_problems:
    # Evaluated in the loop's last step, unless this process resumed a run that had finished
    # its steps (and died before writing the summary).
    result["eval"] = last_eval if last_eval is not None else evaluate(
        c, graphdef, params, rest, task, tok, mesh)
  # The export needs the full parameters on the lead's host (a collective: all processes).
  params_host = jax.tree.map(host, params) if c.export_hf else None
  if not lead:
    return result
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  plot_curves(metrics_path, os.path.join(workdir, "curves.png"),
              keys=["reward", "trm/reject_rate", "trm/ppl_gap", "bound/unified",
                    "learner/entropy", "response_len"])
  s = summarize(metrics_path, key="reward", final_keys=SUMMARY_KEYS)
  result["summary"] = s
  if c.export_hf:
    out = os.path.join(workdir, "hf")
    save_pretrained(nnx.merge(graphdef, params_host, rest), out)
    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
              "special_tokens_map.json", "chat_template.jinja"):
      if os.path.exists(os.path.join(base, f)):
        with open(os.path.join(base, f), "rb") as src, open(os.path.join(out, f), "wb") as dst:
          dst.write(src.read())
  # Atomic: summary.json marks the run as finished (the sweep runner skips finished cells).
  tmp = os.path.join(workdir, "summary.json.tmp")
  with open(tmp, "w") as f:
    json.dump(result, f, indent=2)
  os.replace(tmp, os.path.join(workdir, "summary.json"))
  print(format_summary(s))
  if "eval" in result:
    print(f"eval on {c.eval_problems} held-out problems: " +
          "  ".join(f"{k}={v:.3f}" for k, v in result["eval"].items()))
  return result


def evaluate(c, graphdef, params, rest, task: Task, tok, mesh) -> dict:
  """Held-out evaluation in the learner dtype, with the dense cache and, when the rollouts
  are compressed, also with the rollout's cache policy (keys prefixed `compressed_`).

  Always greedy accuracy; with eval_samples = k > 1 also k samples per problem at
  eval_temperature and eval_top_p -> avg@k and unbiased pass@k (Chen et al. 2021) for k in
  {1, k}.
  At the rollout's temperature and top-p (the tiny configs' defaults), avg@k is what the
  training reward estimates, on fixed problems: the per-step reward mixes
  the policy's change with the difficulty of that step's few prompts. The sampling key is the
  same at every evaluation, so two evaluations differ only by the policy. The compressed
  figure is the one a KV-compressed deployment sees, which SMD trains for (the dense one is
  what the dense learner baselines train for).
  """
  problems = task.eval_problems(c.eval_problems)
  k = c.eval_samples
  caches = {"": CacheConfig()}
  if c.rollout.cache.policy != "none":
    caches["compressed_"] = cache_config(c)
  model = nnx.merge(graphdef, params, rest)
  out = {}
  for prefix, cache in caches.items():
    for n in (1, k) if k > 1 else (1,):
      pb = task.prompts(problems, n)
      ro = generate(model, shd.put_batch(pb.tokens, mesh), pb.lengths,
                    max_new_tokens=task.max_new_tokens, key=jax.random.key(c.seed + 3),
                    greedy=n == 1, temperature=c.eval_temperature, top_p=c.eval_top_p,
                    cache=cache)
      correct = rewards_of(tok, ro, problems, pb.problem_ids, task.max_prompt_len) > 0.5
      if n == 1:
        out[prefix + "greedy_accuracy"] = float(correct.mean())
      else:
        out.update({prefix + key: float(v) for key, v in
                    eval_summary(correct.reshape(len(problems), n), ks=(1, n)).items()})
  return out


def main(argv):
  del argv
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required")
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
  logging.getLogger("absl").setLevel(logging.WARNING)
  try:
    init_distributed()
    run(_CONFIG.value, _WORKDIR.value)
  except config_lib.ConfigError as e:
    sys.exit(f"error: {e}")


def cli():
  # Fail on misspelt `--config.x=...` keys before absl's own parsing (which would print a bare
  # AttributeError) and before any work.
  spec = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--config=")), None)
  if spec is None and "--config" in sys.argv:
    i = sys.argv.index("--config")
    spec = sys.argv[i + 1] if i + 1 < len(sys.argv) else None
  try:
    config_lib.check_override_keys(config_lib.load_config(spec or "configs/tiny_trm.py"),
                                   sys.argv)
  except config_lib.ConfigError as e:
    sys.exit(f"error: {e}")
  app.run(main)


if __name__ == "__main__":
  cli()
