r"""The RL trainer: the loop around `step.rl_step`, with resume, evaluation and export.

  python -m trm_jax.train --config configs/tiny_trm.py --workdir /tmp/trm_tiny \
      [--config.total_steps=100 --config.trm.criteria="('trm_max_kl','trm_avg_kl')" ...]

`run` prepares the workdir (one trainer at a time: `workdir.WorkdirLock`), builds the mesh,
the base model (a supervised warm-up when `model.path` is empty), the tokenizer, the task and
the `step.RLContext`; resumes from the newest good checkpoint, refusing a changed config
unless `--allow_config_change`; then repeats `step.rl_step` to `total_steps`. Held-out
evaluation (`step.evaluate`) runs at step 0, every `eval_every` steps and at the end, logged
as `eval/*`. At the end: a PNG of the curves, the summary (reward change from the first 10% of
steps to the last 10%, first and last held-out evaluation) and the policy as an HF checkpoint.

Artifacts in --workdir: config.json, metrics.jsonl, tb/, ckpt/, curves.png, summary.json, hf/.

Scale and faults:
  * Mesh (`config.mesh`, axes data/fsdp/expert/tensor, one -1 = remaining devices): the model
    loads sharded by its logical axes (an MoE model's experts over `expert`), the optimizer
    state mirrors the parameter shardings, batches are split over (data, fsdp, expert). The
    sampler runs on the same sharded parameters, or with mesh.rollout_devices = n on the
    first n devices with a copy in its dtype per rollout (`step.to_sampler`).
  * Multi-process: `init_distributed()` (CLI; `trm_jax.distributed`) calls
    `jax.distributed.initialize` from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID when they are set, else from the cluster JAX detects (a SLURM step, Open MPI,
    a Cloud TPU pod), and its first log line says which, with the process count. Every process
    builds the same prompt batch and hands jax only its addressable shards
    (`sharding.put_batch`). Process 0 builds the warm-up base model, the others wait for it on
    the shared filesystem. Checkpoints are written by all processes together (orbax);
    metrics, plots and the HF export by process 0.
  * Exact resume: everything the loop reads is in the checkpoint (params, AdamW state with
    its schedule count, the data position) or a pure function of (seed, step); a run killed
    at any point and resumed ends with bitwise identical parameters.
  * Preemption (preemption.py): SIGTERM / SIGINT finish the current step, checkpoint it
    (every process agreeing on the step), flush the metrics and exit 128 + signal (143 /
    130) with one line; a second signal exits at once. Resume also refuses changed data (the
    checkpoint's data fingerprint) unless --allow_config_change, and repairs a metrics line
    torn by a crash from the checkpoint's copy of it.
  * A skipped update (non-finite loss or gradient, or every sequence masked) is counted in
    `learner/skipped`; `rl.max_consecutive_skips` skipped steps in a row stop the run with a
    message (`debug.nan_step` injects a NaN step). A failed background checkpoint save stops
    the run at the next step, naming the step, path and cause. XLA out-of-memory errors are
    re-raised naming the knobs that lower memory.
"""
from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import signal
import sys
import time
from typing import Optional

import jax
import ml_collections
from absl import app, flags
from flax import nnx

from trm_jax import config as config_lib
from trm_jax import gc_tuning
from trm_jax import preemption
from trm_jax import programs as programs_lib
from trm_jax.distributed import init_distributed
from trm_jax import sharding as shd
from trm_jax import step as step_lib
from trm_jax import warmup
from trm_jax import workdir as wd
from trm_jax.checkpoint import (Checkpointer, CheckpointSaveError, CheckpointStructureError,
                                tree_digest)
from trm_jax.data import fingerprint
from trm_jax.data.loaders import DataFileError
from trm_jax.data.task import Task
from trm_jax.data.tokenizer import (TokenizerFileError, TokenizerMismatchError,
                                    check_tokenizer_fits, load_tokenizer)
from trm_jax.metrics import (DEFAULT_SUMMARY_KEYS, MetricsLogger, format_summary, plot_curves,
                             summarize)
from trm_jax.models import from_pretrained, lora, peft_io, save_pretrained
from trm_jax.models.hf_io import CheckpointFileError, CheckpointMismatchError

log = logging.getLogger("trm_jax.train")

# The default main job, the shipped `tiny_trm`, so that it works from any directory.
DEFAULT_CONFIG = config_lib.resolve_config("tiny_trm")
_CONFIG = config_lib.define_config_flag(DEFAULT_CONFIG)
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory (checkpoints, metrics, plots)")
_ALLOW_CHANGE = flags.DEFINE_bool(
    "allow_config_change", False,
    "resume a run whose checkpoint was written with other settings (both configs are kept)")


# ------------------------------------------------------------------------------------------
# Devices and faults
# ------------------------------------------------------------------------------------------
def compilation_cache(c: ml_collections.ConfigDict) -> Optional[str]:
  """Turns on JAX's persistent compilation cache in `config.compilation_cache` (default
  ~/.cache/trm_jax/xla) and returns the directory in use (None: no cache).

  A rerun of the same programs (same config, shapes, devices and code) then loads each
  compiled executable instead of compiling it; what its first step still pays is tracing and
  lowering every program, by which JAX keys the cache (docs/architecture.md, "What a step
  costs, and the cache"). JAX's own
  settings win: JAX_COMPILATION_CACHE_DIR (or `jax_compilation_cache_dir`) names another
  directory, JAX_ENABLE_COMPILATION_CACHE=false turns caching off, and "" here sets none.
  Every program is cached however quickly it compiled (JAX's default skips those under 1 s,
  which a rerun would compile again), unless JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says
  otherwise. An entry's key is the lowered program and its compile options, so a changed
  setting, shape or line of code compiles anew, never reuses a stale program."""
  default = c.compilation_cache
  if not jax.config.jax_enable_compilation_cache:
    return None
  path = jax.config.jax_compilation_cache_dir
  if path is None and default:
    path = os.path.expanduser(default)
    jax.config.update("jax_compilation_cache_dir", path)
  if path and "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return path


def make_mesh(c: ml_collections.ConfigDict) -> tuple[jax.sharding.Mesh, Optional[jax.sharding.Mesh]]:
  """(learner mesh, sampler mesh or None) from `config.mesh`.

  Colocated (mesh.rollout_devices = 0): one (data, fsdp, expert, tensor) mesh over every
  device of every process, shared by sampler and learner. Disaggregated (n > 0): the sampler
  gets the first n devices (a data-parallel mesh of its own), the learner the config's axes
  over the rest; parameters are copied to the sampler for every rollout
  (step.dispatch_rollout).
  """
  axes = {k: v for k, v in c.mesh.items() if k != "rollout_devices"}
  n, devices = c.mesh.rollout_devices, jax.devices()
  if n >= len(devices):
    raise config_lib.ConfigError(
        f"bad config value [mesh.rollout_devices]: {n} sampler devices leave none of the "
        f"{len(devices)} devices (jax.device_count()) to the learner")
  if n and jax.process_count() > 1:
    raise config_lib.ConfigError(
        "mesh.rollout_devices > 0 needs a single process (the parameter copy to the sampler's "
        f"devices is a device_put); this job has {jax.process_count()} processes")
  try:
    learner = shd.mesh_from_config(axes, devices[n:], key="mesh")
  except ValueError as e:
    raise config_lib.ConfigError(str(e)) from e
  return learner, (shd.make_mesh({"data": n}, devices[:n]) if n else None)


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


# ------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------
class TrainingStalledError(RuntimeError):
  """Every update of `rl.max_consecutive_skips` consecutive steps was skipped."""


# Errors whose message is the whole story for the user: the CLI prints one line, no traceback.
USER_ERRORS = (config_lib.ConfigError, wd.WorkdirError, TrainingStalledError,
               CheckpointSaveError, CheckpointMismatchError, CheckpointFileError,
               TokenizerMismatchError, TokenizerFileError, DataFileError,
               step_lib.OutOfMemoryError, peft_io.AdapterFileError)


def run(c: ml_collections.ConfigDict, workdir: str, *, progress: bool = True,
        allow_config_change: bool = False) -> dict:
  """Trains per config `c` into `workdir`; returns the summary dict.

  Refuses (`WorkdirError`) a workdir that is a file, not writable, used by a running trainer,
  or holding a run whose config differs in a key that changes the trajectory (unless
  `allow_config_change`).
  """
  config_lib.validate(c)
  config_lib.check_task_files(c.task)
  cache = compilation_cache(c)
  workdir = wd.prepare(workdir)
  # One trainer per workdir: the lock lives as long as this process (the kernel drops it on
  # SIGKILL). Process 0 holds it for a multi-process job.
  lock = wd.WorkdirLock(workdir) if jax.process_index() == 0 else None
  try:
    # From here SIGTERM / SIGINT only request a stop, honoured between steps (preemption.py).
    with preemption.StopOnSignal() as stop:
      mesh, sampler_mesh = make_mesh(c)
      config_lib.check_batch_mesh(c, mesh, sampler_mesh)
      log.info("mesh %s over %d devices, %d processes%s; compilation cache %s",
               dict(mesh.shape), mesh.size, jax.process_count(), "" if sampler_mesh is None
               else f"; sampler on its own {sampler_mesh.size} devices", cache or "off")
      # Outside the mesh context: the warm-up is a process-local job (its arrays are not
      # global).
      base = (warmup.ensure_base_model(c, log=log.info) if jax.process_index() == 0 else
              wait_for_base_model(c))
      # Inside the mesh context the model's block-boundary activation constraints (residual
      # stream over (data, fsdp), sharding.constrain) are live in the sampler and the learner.
      with jax.set_mesh(mesh):
        return _run(c, workdir, mesh, sampler_mesh, base, progress=progress,
                    allow_config_change=allow_config_change, stop=stop)
  finally:
    if lock is not None:
      lock.release()


def _run(c: ml_collections.ConfigDict, workdir: str, mesh: jax.sharding.Mesh,
         sampler_mesh: Optional[jax.sharding.Mesh], base: str, *, progress: bool,
         allow_config_change: bool, stop: preemption.StopOnSignal) -> dict:
  lead = jax.process_index() == 0  # writes metrics, plots, summary and the HF export
  # --- Model, tokenizer, task, learner --------------------------------------------------------
  model = from_pretrained(base, dtype=step_lib.DTYPES[c.model.dtype], remat=c.model.remat,
                          moe_chunk=c.model.moe_chunk, mesh=mesh)
  model, base_record = add_adapters(c, model, base)
  tok = load_tokenizer(base)
  check_tokenizer_fits(tok, model.config.vocab_size)
  task = Task(c.task, seed=c.seed, tokenizer=tok, eval_problems=c.eval_problems)
  # validate() checked what the config alone tells; now the model's own limits and the
  # task's derived lengths are known.
  config_lib.check_model_fit(c, max_positions=model.config.max_position_embeddings,
                             vocab_size=model.config.vocab_size,
                             prompt_len=task.max_prompt_len, new_tokens=task.max_new_tokens,
                             num_experts=model.config.num_experts)
  task.check_prompts(c.eval_problems)
  step_lib.warn_truncation(c)
  if _zero_thresholds(c):
    log.warning("%s: %s keeps only sequences with no divergence at all, so with any mismatch "
                "between sampler and learner every sequence is masked and every update "
                "skipped", ", ".join(f"trm.{k}=0" for k in _zero_thresholds(c)),
                "/".join(c.trm.criteria))
  ctx, state = step_lib.make_context(c, mesh, model, tok, task, sampler_mesh)
  del model

  # --- Resume ---------------------------------------------------------------------------------
  config_json = json.loads(c.to_json_best_effort())
  ckpt = Checkpointer(os.path.join(workdir, "ckpt"), save_every=c.ckpt_every,
                      keep=c.keep_ckpts)
  state, meta = resume(ckpt, state, config_json, workdir, data=task.fingerprint,
                       allow_config_change=allow_config_change, base=base_record)
  if lead:
    wd.write_json_atomic(os.path.join(workdir, wd.CONFIG_FILE), config_json)
  logger = MetricsLogger(workdir, total_steps=c.total_steps, enable_progress=progress,
                         resume_step=state.step if meta is not None else None,
                         resume_record=(meta or {}).get("metrics")) if lead else None

  try:
    state, last_eval, loop_s, skips = _loop(c, ctx, state, ckpt, logger, config_json,
                                            task.fingerprint, stop, base_record)
  except BaseException:
    # Flush the record (and end the progress bar before the error is printed); let the
    # in-flight checkpoint finish, so the last good one is complete on disk.
    if logger is not None:
      logger.close()
    try:
      ckpt.close()
    except CheckpointSaveError as e:
      log.warning("while stopping: %s", e)
    raise
  ckpt.close()
  if logger is not None:
    logger.close()

  # --- Final evaluation, plot, summary, export ----------------------------------------------
  result = {"workdir": workdir, "wall_s": loop_s}
  if c.eval_problems:
    # Evaluated in the loop's last step, unless this process resumed a run that had finished
    # its steps (and died before writing the summary).
    result["eval"] = last_eval if last_eval is not None else step_lib.evaluate(
        ctx, state.params)
  # The export needs the exported arrays on the lead's host (a collective: all processes).
  policy = exported_policy(c, ctx, state) if c.export_hf else None
  if not lead:
    return result
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  if c.plot:
    plot_curves(metrics_path, os.path.join(workdir, "curves.png"))
  s = summarize(metrics_path, key="reward", final_keys=DEFAULT_SUMMARY_KEYS)
  result["summary"] = s
  if c.export_hf:
    try:
      export_hf(policy, base, os.path.join(workdir, "hf"),
                adapter=base_record is not None and c.model.lora.export == "adapter")
    except CheckpointFileError as e:
      # The run is whole: its last checkpoint holds step total_steps, and without
      # summary.json the same command resumes there and exports again.
      raise CheckpointFileError(
          f"exporting the policy failed: {e}. The run is kept (checkpoint step {state.step} "
          f"in {ckpt.directory}); rerun the same command once {workdir}/hf can be written, to "
          "export it") from e
  # Atomic: summary.json marks the run as finished (the sweep runner skips finished cells).
  wd.write_json_atomic(os.path.join(workdir, "summary.json"), result)
  print(format_summary(s))
  if skips["nonfinite"] or skips["masked"]:
    print(skip_line(c, skips))
  if "eval" in result:
    print(eval_line(c, task, result["eval"]))
  return result


def eval_line(c: ml_collections.ConfigDict, task: Task, ev: dict) -> str:
  """The final console line of the held-out evaluation `ev`, with the number of problems it
  used (fewer than eval_problems when the held-out set is smaller: `Task` caps it)."""
  n = len(task.eval_problems(c.eval_problems))
  capped = "" if n == c.eval_problems else (
      f" (eval_problems={c.eval_problems}: the held-out set has only {n})")
  return f"eval on {n} held-out problems{capped}: " + "  ".join(
      f"{k}={v:.3f}" for k, v in ev.items())


def _loop(c: ml_collections.ConfigDict, ctx: step_lib.RLContext, state: step_lib.TrainState,
          ckpt: Checkpointer, logger, config_json: dict, data: dict,
          stop: preemption.StopOnSignal, base: Optional[dict] = None):
  """Steps to c.total_steps with evaluation, logging, stall detection and checkpoints;
  returns (final state, last held-out evaluation or None, seconds spent in the steps).

  A stop request (SIGTERM / SIGINT, `preemption`) is looked at once per step, before the next
  one starts, by every process together: the step done last is checkpointed (unless it
  already is) and `preemption.Preempted` is raised. So a signal that lands in a rollout, an
  update, an evaluation or a save costs at most the rest of that step."""
  def meta(state, record) -> dict:
    # `metrics`: this step's metrics.jsonl line (None if not logged, or not process 0), from
    # which a resume restores that line if a crash tore it.
    # `base`: with LoRA, the base model the adapters are trained on (`resume` checks it).
    return {"step": state.step, "data_pos": state.data_pos, "config": config_json,
            "data": data, "metrics": record, **({"base": base} if base else {})}

  def eval_due(step: int) -> bool:
    return bool(c.eval_problems) and (
        step == c.total_steps or (c.eval_every > 0 and step % c.eval_every == 0))

  def evaluate(params, **kw) -> tuple[dict, dict]:
    """(the evaluation, its eval/* metrics with time/eval_s: the seconds it took, which
    `sweep.span_seconds` adds to the step's own time/step_s)."""
    t = time.time()
    ev = step_lib.evaluate(ctx, params, **kw)
    return ev, {**{f"eval/{k}": v for k, v in ev.items()}, "time/eval_s": time.time() - t}

  last_eval = None
  if state.step == 0 and c.eval_every > 0 and c.eval_problems:
    # Step 0: the starting policy on the same held-out problems (and, through the fixed eval
    # key, the same sampling noise) as every later evaluation, so eval/* changes are the
    # policy's, not the training batches' difficulty (which dominates per-step reward).
    last_eval, ev_metrics = evaluate(state.params)
    if logger is not None:
      logger.log(0, ev_metrics)

  # --- The loop -------------------------------------------------------------------------------
  t_start = time.time()
  skipped_run = []  # per consecutive skipped step: (non-finite, all masked) update fractions
  skips = {"steps": 0, "nonfinite": 0, "masked": 0}   # steps run, and those wholly skipped
  saved, record = state.step, None   # newest step with a checkpoint; last metrics line
  while True:
    signum = stop.should_stop()
    if signum is not None:
      if state.step != saved:
        ckpt.maybe_save(state.step, checkpointed(state), meta=meta(state, record), force=True)
      ckpt.wait()  # finalized on disk (or CheckpointSaveError) before saying so
      raise _preempted(c, signum, state.step, saved=state.step != 0, directory=ckpt.directory)
    if state.step >= c.total_steps:
      break
    ckpt.check()  # a background save that failed stops the run now, naming step and cause
    state, metrics = step_lib.rl_step(ctx, state)
    metrics.update(memory_metrics())
    logged = state.step % c.log_every == 0 or state.step == c.total_steps
    if eval_due(state.step):
      last_eval, ev_metrics = evaluate(state.params, step=state.step)
      metrics.update(ev_metrics)
      logged = True
    skipped_run = skipped_run + [(metrics["learner/skipped_nonfinite"],
                                  metrics["learner/skipped_all_masked"])] \
        if metrics["learner/skipped"] == 1.0 else []
    skips["steps"] += 1
    if skipped_run:
      skips["nonfinite" if skipped_run[-1][0] > 0 else "masked"] += 1
    stalled = 0 < c.rl.max_consecutive_skips <= len(skipped_run)
    record = logger.log(state.step, metrics) if logger is not None and (
        logged or stalled) else None
    if stalled:
      raise TrainingStalledError(_stall_message(c, state.step, skipped_run))
    if ckpt.maybe_save(state.step, checkpointed(state), meta=meta(state, record),
                       force=state.step == c.total_steps):
      saved = state.step
      preemption.debug_point("save", state.step)   # test hook: a signal while it is written
  return state, last_eval, time.time() - t_start, skips


def _zero_thresholds(c: ml_collections.ConfigDict) -> list[str]:
  """The trm.* thresholds of the chosen criteria that are 0 (a trust region of radius 0)."""
  from trm_jax.trm import CRITERIA  # pylint: disable=g-import-not-at-top
  keys = dict.fromkeys(k for n in c.trm.criteria if n != "token_mask"
                       for k in CRITERIA[n].thresholds)
  return [k for k in keys if c.trm[k] == 0]


def skip_line(c: ml_collections.ConfigDict, skips: dict) -> str:
  """The console line for a run whose updates were skipped at some steps."""
  why = []
  if skips["masked"]:
    zero = _zero_thresholds(c)
    why.append(f"{skips['masked']} had every sequence masked (trm.criteria="
               f"{tuple(c.trm.criteria)}" + (f" with {', '.join(f'trm.{k}=0' for k in zero)}"
                                             if zero else "") + ")")
  if skips["nonfinite"]:
    why.append(f"{skips['nonfinite']} had a non-finite loss or gradient")
  n = skips["masked"] + skips["nonfinite"]
  return (f"updates skipped at {n} of the {skips['steps']} steps run: {'; '.join(why)}. "
          "The policy changed only at the other steps")


def _preempted(c: ml_collections.ConfigDict, signum: int, step: int, *, saved: bool,
               directory: str) -> preemption.Preempted:
  name = signal.Signals(signum).name
  where = (f"checkpoint step {step} is saved in {directory}; rerun the same command to "
           "resume" if saved else "no step was done, nothing to save")
  rest = "" if step < c.total_steps else " (all steps done; the rerun writes the summary)"
  return preemption.Preempted(
      f"preempted by {name} after step {step} of {c.total_steps}: {where}{rest} (exit code "
      f"{preemption.exit_code(signum)})", signum)


def resume(ckpt: Checkpointer, state: step_lib.TrainState, config_json: dict, workdir: str,
           *, data: dict, allow_config_change: bool, base: Optional[dict] = None,
           ) -> tuple[step_lib.TrainState, Optional[dict]]:
  """(state, meta): the newest good checkpoint's state and meta, if there is one and its
  config and data allow continuing (see `workdir.config_changes`, `data.fingerprint`) and,
  with LoRA, `base` is the base model its adapters were trained on (`add_adapters`); else
  (`state` unchanged, None)."""
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          checkpointed(state))
  try:
    restored = ckpt.restore_latest(abstract)
  except CheckpointStructureError as e:
    # The saved arrays do not fit the new settings' state. Name the settings, not the leaves.
    old = (ckpt.read_meta(e.step) or {}).get("config")
    changes = wd.config_changes(old, config_json) if old is not None else {}
    changes.pop("total_steps", None)
    if not changes:
      raise
    raise wd.WorkdirError(
        f"{workdir} holds a run (checkpoint step {e.step}) whose saved state does not fit "
        f"the new settings: {wd.describe(changes)}. These change what a checkpoint holds "
        "(rl.staleness: the parameter versions of the rollout pipeline; model and optimizer "
        "settings: the arrays), so the run cannot continue with them, not even with "
        "--allow_config_change; use another --workdir") from None
  if restored is None:
    return state, None
  step, arrays, meta = restored
  old = meta.get("config")
  if old is None:
    log.warning("checkpoint step %d in %s records no config (written by an older version): "
                "resuming without checking that the settings are unchanged", step, workdir)
  else:
    changes = wd.config_changes(old, config_json)
    total = changes.pop("total_steps", None)
    if total is not None and total[1] < step:
      raise wd.WorkdirError(f"total_steps={total[1]}, but the run in {workdir} is at step "
                            f"{step} already; use another --workdir")
    if total is not None and total[1] < total[0]:
      changes["total_steps"] = total  # shortening changes the schedule: a config change
    elif total is not None:
      log.warning("total_steps %d -> %d: extending the run from step %d; the learning-rate "
                  "schedule now spans %d steps, so updates from here on differ from the "
                  "original plan", total[0], total[1], step, total[1])
    if changes and not allow_config_change:
      raise wd.WorkdirError(
          f"{workdir} holds a run (checkpoint step {step}) with other settings: "
          f"{wd.describe(changes)}. Use another --workdir, or pass --allow_config_change to "
          "continue this run with the new settings (both configs are kept)")
    if changes:
      kept = os.path.join(workdir, f"config.before_step_{step}.json")
      if jax.process_index() == 0:
        wd.write_json_atomic(kept, old)
      log.warning("--allow_config_change: continuing from step %d with %s (the earlier config "
                  "is kept in %s)", step, wd.describe(changes), kept)
  _check_data(meta.get("data"), data, workdir, step, allow_config_change=allow_config_change)
  _check_base(meta.get("base"), base, workdir, step)
  log.info("resumed from step %d (data position %d)", step, meta["data_pos"])
  return step_lib.TrainState(params=arrays["params"], opt_state=arrays["opt_state"], step=step,
                             data_pos=int(meta["data_pos"]),
                             history=tuple(arrays.get("history", ()))), meta


def _check_data(old: Optional[dict], new: dict, workdir: str, step: int, *,
                allow_config_change: bool) -> None:
  """Refuses a resume whose data files hold other rows than the checkpoint's run read."""
  if old is None:
    if new:
      log.warning("checkpoint step %d in %s records no data fingerprint (written by an older "
                  "version): resuming without checking that the data is unchanged", step,
                  workdir)
    return
  diff = fingerprint.changes(old, new)
  if not diff:
    return
  if not allow_config_change:
    raise wd.WorkdirError(
        f"the data changed since checkpoint step {step} in {workdir}: "
        f"{fingerprint.describe(diff)}. Use another --workdir, or pass --allow_config_change "
        "to continue this run on the new data")
  log.warning("--allow_config_change: continuing from step %d on changed data: %s", step,
              fingerprint.describe(diff))


def add_adapters(c: ml_collections.ConfigDict, model: nnx.Module, base: str):
  """(model, base record): with model.lora.rank > 0 the loaded base `model` with LoRA
  adapters (new ones, or model.lora.path's PEFT adapter) over its frozen, maybe quantized,
  weights, and the record of that base a checkpoint keeps (`resume` refuses another); else
  (model, None)."""
  lcfg = programs_lib.lora_config(c)
  if lcfg is None:
    return model, None
  # A digest of the weights as loaded (not of the files): a base re-saved with the same
  # weights is the same base; one with any other weight is not.
  record = {"key": "model.path" if c.model.path else "warmup.cache_dir",
            "path": os.path.abspath(base), "digest": tree_digest(nnx.state(model, nnx.Param))}
  try:
    model = lora.with_adapters(model, lcfg, seed=c.seed)
    if c.export_hf and c.model.lora.export == "adapter":   # refused now, not after training
      peft_io.check_exportable(model.config)
  except ValueError as e:   # a target no weight of this model has, or peft could not load
    raise config_lib.ConfigError(f"bad config value [model.lora.targets]: {e}") from None
  if c.model.lora.path:
    peft_io.load_adapter(model, os.path.expanduser(c.model.lora.path))
  return model, record


def _check_base(old: Optional[dict], new: Optional[dict], workdir: str, step: int) -> None:
  """A LoRA checkpoint holds the adapters only: they continue on the base they were trained
  on, or not at all (whatever --allow_config_change says)."""
  if old is None or new is None or old["digest"] == new["digest"]:
    return
  raise wd.WorkdirError(
      f"{new['key']}={new['path']} holds another base model than the one the adapters of "
      f"checkpoint step {step} in {workdir} were trained on ({old['path']}; weights digest "
      f"{old['digest'][:12]} -> {new['digest'][:12]}). Adapters belong to their base: point "
      f"{new['key']} at that base, or use another --workdir")


def exported_policy(c: ml_collections.ConfigDict, ctx: step_lib.RLContext,
                    state: step_lib.TrainState) -> nnx.Module:
  """The policy as the HF export writes it (with LoRA: the adapters, or the merged model per
  model.lora.export), the arrays it writes gathered to this host. A collective: every process
  calls it."""
  policy = nnx.merge(ctx.graphdef, state.params, ctx.rest)
  if c.model.lora.rank and c.model.lora.export == "merged":
    policy = lora.merged(policy)
  graphdef, written, rest = lora.split(policy)
  return nnx.merge(graphdef, jax.tree.map(step_lib.host, written), rest)


def checkpointed(state: step_lib.TrainState) -> dict:
  """The arrays a checkpoint holds: parameters, optimizer state and, with rl.staleness = k,
  the k parameter versions the next rollouts are sampled with (the in-flight pipeline; the
  pending rollout itself is recomputed from them on resume)."""
  out = {"params": state.params, "opt_state": state.opt_state}
  if state.history:
    out["history"] = list(state.history)
  return out


def _stall_message(c: ml_collections.ConfigDict, step: int, run: list) -> str:
  nonfinite = sum(1 for a, _ in run if a > 0)
  masked = sum(1 for _, b in run if b > 0)
  return (f"stopping at step {step}: every update of the last {len(run)} steps was skipped "
          f"(rl.max_consecutive_skips={c.rl.max_consecutive_skips}): {nonfinite} steps had a "
          f"non-finite loss or gradient, {masked} had every sequence masked. The run cannot "
          "learn: check the weights and the tokenizer, lower optim.lr, or loosen trm.* "
          "thresholds; the last good checkpoint is kept")


def export_hf(model: nnx.Module, base: str, out: str, *, adapter: bool = False) -> None:
  """The policy as an HF checkpoint in `out` (with `adapter`, its LoRA adapters as a PEFT
  adapter for the base `base`), with the base model's tokenizer files."""
  save_pretrained(model, out, adapter=adapter, base=base)
  for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
            "special_tokens_map.json", "chat_template.jinja"):
    if os.path.exists(os.path.join(base, f)):
      try:
        shutil.copyfile(os.path.join(base, f), os.path.join(out, f))
      except OSError as e:
        raise CheckpointFileError(f"{os.path.join(out, f)}: cannot be written "
                                  f"({e.strerror or e})") from e


def memory_metrics() -> dict:
  """Peak host RSS, and the accelerator's peak bytes where the backend reports them (GPU/TPU;
  the CPU backend has no allocator statistics)."""
  out = {"memory/host_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
  stats = jax.local_devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    out["memory/device_peak_mb"] = stats["peak_bytes_in_use"] / 2**20
  return out


def main(argv):
  del argv
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required")
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
  logging.getLogger("absl").setLevel(logging.WARNING)
  try:
    init_distributed()
    run(_CONFIG.value, _WORKDIR.value, allow_config_change=_ALLOW_CHANGE.value)
  except USER_ERRORS as e:
    sys.exit(f"error: {e}")
  except preemption.Preempted as e:
    # Not 0: a scheduler or sweep must not read the run as finished (preemption.exit_code).
    print(str(e), file=sys.stderr)
    sys.exit(e.code)
  except KeyboardInterrupt:
    # Ctrl-C before the stop handler is installed (or after it is gone): one line, no
    # traceback, the shell's code for SIGINT.
    print("interrupted by SIGINT outside the training loop (nothing to save)", file=sys.stderr)
    sys.exit(preemption.exit_code(signal.SIGINT))


def help_text() -> str:
  """`--help`: the flags, `--config` first, and where the settings are documented (absl's own
  help listed only --workdir and --allow_config_change, hid --config under --helpfull, and
  exited 1)."""
  import textwrap  # pylint: disable=g-import-not-at-top
  rows = [("--config CONFIG", "experiment config: a python file with get_config (path[:arg]) "
           f"or a shipped config's name ({', '.join(config_lib.shipped_names())}); default "
           "tiny_trm"),
          ("--config.KEY=VALUE", "override one setting, e.g. --config.total_steps=100 "
           "--config.trm.criteria=\"('trm_max_kl',)\""),
          ("--workdir DIR", flags.FLAGS[_WORKDIR.name].help),
          ("--allow_config_change", flags.FLAGS[_ALLOW_CHANGE.name].help)]
  lines = ["usage: python -m trm_jax.train [--config CONFIG] --workdir DIR "
           "[--config.KEY=VALUE ...] [--allow_config_change]", "",
           __doc__.strip().splitlines()[0], ""]
  for name, text in rows:
    lines.append(textwrap.fill(text, 96, initial_indent=f"  {name:<24}",
                               subsequent_indent=" " * 26))
  lines += ["", textwrap.fill(
      "Every setting is documented where its default is set, one comment per key, in the "
      f"shipped configs ({os.path.join(config_lib.shipped_dir(), 'tiny_trm.py')} first: the "
      "others start from it). absl's own flags: --helpfull.", 96)]
  return "\n".join(lines)


def cli():
  gc_tuning.tune_for_tracing()
  if any(a in ("-h", "--help", "--helpshort") for a in sys.argv[1:]):
    print(help_text())
    sys.exit(0)
  # `--config tiny_trm` names a shipped config; misspelt `--config.x=` keys fail here.
  try:
    sys.argv, _ = config_lib.config_argv(sys.argv, DEFAULT_CONFIG)
  except config_lib.ConfigError as e:
    sys.exit(f"error: {e}")
  app.run(main)


if __name__ == "__main__":
  cli()
