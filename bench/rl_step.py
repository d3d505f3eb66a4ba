r"""One whole GRPO step, here and in the two codebases a researcher would pick instead.

  python -m bench.rl_step                  # both shapes, three systems: bench/results/rl_step.json
                                           #   and rl_step.png (about 10 minutes on 2 CPU cores)
  python -m bench.rl_step --shapes main --systems ours tunix
  python -m bench.rl_step --smoke          # one warm step of ours at a tiny shape (the test)

A step is everything between two parameter versions: the prompts' rollouts (rl.group_size per
prompt), their rewards, any scoring pass, the advantages and one optimizer update of the whole
batch; no evaluation, no checkpoint. The three systems run it on the same model, the base the
config's supervised warm-up builds (`trm_jax.warmup`: a Hugging Face checkpoint, which every
system loads with its own loader), the same prompts in the same order (rendered by the base's
chat template; each system tokenizes them to the same ids), the same group size, batch,
maximum prompt and response lengths, sampling temperature (1.0, no top-k / top-p), learning
rate, one update per batch and no KL term:

  ours    `trm_jax.step.rl_step` with the shape's config as the trainer runs it (the main shape
          samples in bf16 with logit noise and masks with TRM-max; the long one samples exactly
          in fp32 and trains PPO-clip);
  tunix   Tunix 0.1.7's `GRPOLearner` (the `bench` extra): vanilla rollout engine on the
          actor's own mesh, `num_iterations=1`, `beta=0`, its Qwen3 loaded by its own
          safetensors loader, AdamW. Its Qwen3 attention ignores the config's rope_theta
          (always 1e6); the bench passes the checkpoint's, or Tunix would run another model;
  trl     TRL 1.16's `GRPOTrainer` on torch CPU (transformers `generate`), `num_iterations=1`,
          `beta=0`, `steps_per_generation=1`, AdamW.
Each peer's model is checked against ours on one prompt (`tunix_parity`, `trl_parity`: the
largest logit difference, both freshly loaded).

Shapes: "main" is `configs/tiny_trm.py` (64 rollouts = 8 prompts x 8, prompts of at most 23
tokens, responses of at most 55), "long" is `configs/tiny_trm_long.py` (the same batch,
prompts of at most 71 tokens, responses of at most 263; the base's are 140-265).

Each system runs in a process of its own, started for the measurement (so its first step pays
for imports, model load and compilation as a user's does), for --steps steps (default 6):
  warm_s            median seconds of the steps after the first (what a training loop pays);
  first_s           from the process's launch to the end of its first step: interpreter,
                    imports, model load, building the trainer, compilation and the step, with
                    an empty compilation cache (ours and Tunix: JAX's persistent cache in a new
                    empty directory);
  first_cached_s    ours only, the same in a second process whose persistent compilation cache
                    the first one filled (the trainer keeps one under ~/.cache by default);
  startup_s, first_step_s   the two parts of first_s (up to the first step's start; the step;
                    first_cached_step_s and cached_startup_s for the rerun);
  tokens_per_s      response tokens (sampled tokens up to and including EOS) of the warm steps
                    over their seconds;
  phases            where a warm step's time goes, as each system exposes it: ours from extra
                    steps run phase by phase with a barrier after each (`phase_steps`);
                    Tunix's and TRL's from timing their own methods (rollout, rewards, the
                    rest of the batch preparation, the update).
Each worker records the load and the CPU time other processes used while it ran
(`bench.hygiene`); a contended worker is flagged, not dropped (the JSON says so).

The limits the trainer's speed is held against (`limits` of ours, measured in the rerun's
process after its steps):
  learner   the learner program's FLOPs (`hlo_cost.program_cost`, loops counted per trip) at
            the shape's batch over its median wall time, against this CPU's fp32 matmul peak
            measured in the same run (`bench.learner.matmul_peak`);
  decode    a rollout's seconds (prefill included) against the bytes its decode steps must
            read at least: every parameter, in the sampler's dtype, once per decode step, and
            at each decode query the keys and values it attends; over this machine's memory
            bandwidth, measured in the same run (the best read + write rate of one pass over a
            256 MiB array, by numpy and by XLA:CPU);
  trace_and_lower_s   per program, what tracing and lowering it costs from empty in-memory
            caches: what a rerun's first step pays before its persistent-cache lookups;
  compile_s per program, XLA's compilation of that lowering with the persistent cache off
            (what the first run pays on top);
  imports_s a new interpreter importing `trm_jax.step` (JAX, Flax, optax), nothing run;
  profile   of the learner program and of a rollout, one call each under `jax.profiler`
            (`bench.xla_profile`): the thread time of each class of op and its share. The
            learner's classes: attention's two einsums, every other op over attention's
            [B, K, G, T, T] scores (mask, softmax, their gradients, layout copies), the other
            matmuls, the rest; the rollout's: library matmuls and the rest, with the thunks
            (XLA:CPU's units of execution) each decode step runs.
`missed_because` in the JSON says, for each goal missed, what bounds it, in these numbers.

Peers are imported from the `bench` extra's installs; nothing of theirs is copied here.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SHAPES = {"main": "tiny_trm", "long": "tiny_trm_long"}
SYSTEMS = ("ours", "tunix", "trl")
# The tiny shape of --smoke: 16 rollouts of 4 prompts (the test adds its shared base model:
# tests/shared_run.py), the trainer tests' settings, so its programs are theirs.
SMOKE_OVERRIDES = {"rl.batch_size": 16, "rl.group_size": 4, "total_steps": 6}
_LAUNCH = "RL_STEP_BENCH_LAUNCH"     # the parent's time.time() just before starting a worker


# ------------------------------------------------------------------------------------------
# The measurement's settings, shared by every worker (a JSON file)
# ------------------------------------------------------------------------------------------
def shape_config(name: str, overrides: dict):
  """The shape's config with the bench's settings: no evaluation, export or plot."""
  from trm_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from trm_jax import sweep  # pylint: disable=g-import-not-at-top
  c = config_lib.load_config(name)
  c = sweep.apply_overrides(c, {"eval_problems": 0, "export_hf": False, "plot": False,
                                **overrides}.items())
  config_lib.validate(c)
  return c


def make_spec(name: str, overrides: dict, steps: int, phase_steps: int = 0) -> dict:
  """Everything a worker needs: the base model, the sizes and each step's prompts (as the
  trainer's Task draws them, so ours and the peers see the same problems in the same order).
  Every worker of ours trains with total_steps = steps + phase_steps (the learning-rate
  schedule is part of the update program: a rerun with another one would compile anew)."""
  from trm_jax import warmup  # pylint: disable=g-import-not-at-top
  from trm_jax.data import Task, load_tokenizer  # pylint: disable=g-import-not-at-top
  overrides = {"total_steps": steps + phase_steps, **overrides}
  c = shape_config(name, overrides)
  base = warmup.ensure_base_model(c, log=lambda m: print(m, flush=True))
  tok = load_tokenizer(base)
  task = Task(c.task, seed=c.seed, tokenizer=tok, eval_problems=0)
  n = c.rl.batch_size // c.rl.group_size
  prompts = []
  for i in range(steps):
    problems = task.batch(i * n, n)
    pb = task.prompts(problems, 1)
    prompts.append([dict(text=tok.apply_chat_template(p.messages(), add_generation_prompt=True,
                                                      tokenize=False),
                         ids=pb.tokens[j, -int(pb.lengths[j]):].tolist(), answer=p.answer)
                    for j, p in enumerate(problems)])
  return dict(config=name, overrides=overrides, base=base, steps=steps,
              batch_size=c.rl.batch_size, group_size=c.rl.group_size,
              max_prompt_len=task.max_prompt_len, max_new_tokens=task.max_new_tokens,
              temperature=float(c.rollout.temperature), lr=float(c.optim.lr),
              eos_id=tok.eos_id, pad_id=tok.pad_id, prompts=prompts)


class _Clock:
  """Step boundaries of a worker, against the parent's launch time."""

  def __init__(self):
    self.launch = float(os.environ.get(_LAUNCH, time.time()))
    self.start = None          # the first step's start
    self.ends = []             # each step's end

  def result(self, response_tokens: list) -> dict:
    steps = [self.ends[0] - self.start] + [b - a for a, b in zip(self.ends, self.ends[1:])]
    warm = steps[1:]
    n = len(response_tokens)
    tokens_warm = sum(response_tokens[1:n])
    return dict(step_s=[round(s, 4) for s in steps],
                warm_s=round(statistics.median(warm), 4) if warm else None,
                first_s=round(self.ends[0] - self.launch, 3),
                startup_s=round(self.start - self.launch, 3),
                first_step_s=round(steps[0], 4),
                response_tokens=response_tokens,
                tokens_per_s=round(tokens_warm / sum(warm[:n - 1]), 1) if warm and n > 1
                else None)


def _phase_summary(rows: list[dict]) -> dict:
  """{phase: median seconds}, and each phase's share of their sum."""
  if not rows:
    return {}
  med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
  total = sum(med.values())
  return {"median_s": {k: round(v, 4) for k, v in med.items()},
          "share": {k: round(v / total, 3) for k, v in med.items()}}


# ------------------------------------------------------------------------------------------
# ours: trm_jax.step.rl_step
# ------------------------------------------------------------------------------------------
def run_ours(spec: dict, *, phase_steps: int = 0, limits: bool = False) -> dict:
  clock = _Clock()
  import jax  # pylint: disable=g-import-not-at-top
  from trm_jax import step as step_lib  # pylint: disable=g-import-not-at-top
  from trm_jax import train  # pylint: disable=g-import-not-at-top
  from trm_jax.data import Task, load_tokenizer  # pylint: disable=g-import-not-at-top
  from trm_jax.models import from_pretrained  # pylint: disable=g-import-not-at-top
  c = shape_config(spec["config"], spec["overrides"])
  train.compilation_cache(c)
  mesh, sampler_mesh = train.make_mesh(c)
  out = {}
  with jax.set_mesh(mesh):
    model = from_pretrained(spec["base"], dtype=step_lib.DTYPES[c.model.dtype], mesh=mesh)
    mcfg = model.config
    tok = load_tokenizer(spec["base"])
    task = Task(c.task, seed=c.seed, tokenizer=tok, eval_problems=0)
    _check_prompts(spec, task, tok)
    ctx, state = step_lib.make_context(c, mesh, model, tok, task, sampler_mesh)
    del model
    tokens = []
    clock.start = time.time()
    for _ in range(spec["steps"]):
      state, m = step_lib.rl_step(ctx, state)
      jax.block_until_ready(state.params)
      clock.ends.append(time.time())
      tokens.append(int(round(m["response_len"] * c.rl.batch_size)))
    out.update(clock.result(tokens))
    rows = []
    for _ in range(phase_steps):
      state, row = _ours_phased_step(ctx, state)
      rows.append(row)
    out["phases"] = _phase_summary(rows)
    if limits:
      out["limits"] = _ours_limits(ctx, state, mcfg)
  out["compiled_programs"] = sorted(ctx.programs.programs)
  out["jax_cache_dir"] = jax.config.jax_compilation_cache_dir
  return out


def _check_prompts(spec: dict, task, tok) -> None:
  """The spec's prompts are the ones the trainer's Task draws at the same positions."""
  n = spec["batch_size"] // spec["group_size"]
  for i, step in enumerate(spec["prompts"]):
    problems = task.batch(i * n, n)
    assert [p.answer for p in problems] == [p["answer"] for p in step], "prompt order differs"
    assert [tok.encode(p["text"], add_special_tokens=False) for p in step] == [
        p["ids"] for p in step], "prompt tokens differ"


def _ours_phased_step(ctx, state):
  """One rl_step's work phase by phase, with a barrier after each: (state, seconds per
  phase). The phases are the step's own functions, in its order; with one update per batch
  the scoring pass, the advantages and the update are one program ("learner")."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from trm_jax import step as S  # pylint: disable=g-import-not-at-top
  c = ctx.c
  t = [time.time()]
  fl = S.dispatch_rollout(ctx, state)
  jax.block_until_ready(fl.ro.tokens)
  t.append(time.time())
  rewards = S.rewards_of(ctx, fl.ro, fl.problems, fl.pb.problem_ids)["reward"]
  t.append(time.time())
  if "score_update" in ctx.programs.programs:
    names = ("rollout", "rewards", "learner")
    params, opt_state, _, _ = ctx.programs["score_update"](
        state.params, state.opt_state, ctx.rest, S.learner_batch(ctx, fl.ro),
        S.shd.put_batch(np.asarray(rewards), ctx.mesh))
  else:
    names = ("rollout", "rewards", "score", "advantages", "update")
    batch, seq_mask, _ = S.score_rollout(ctx, state.params, fl.ro)
    jax.block_until_ready((batch, seq_mask))
    t.append(time.time())
    adv = S._group_advantages(rewards, group_size=c.rl.group_size,   # pylint: disable=protected-access
                              normalize_std=c.rl.normalize_std, seq_mask=seq_mask,
                              baseline=c.rl.baseline)
    batch = batch.replace(advantages=S.shd.put_batch(adv, ctx.mesh))
    jax.block_until_ready(batch)
    t.append(time.time())
    k_perm = S._step_keys(ctx.rng, state.step + 1)[1]   # pylint: disable=protected-access
    params, opt_state, _ = S.run_updates(ctx, state, batch, k_perm, state.step + 1)
  jax.block_until_ready((params, opt_state))
  t.append(time.time())
  state = S.TrainState(params=params, opt_state=opt_state, step=state.step + 1,
                       data_pos=state.data_pos + c.rl.batch_size // c.rl.group_size)
  return state, {k: b - a for k, a, b in zip(names, t, t[1:])}


def _ours_limits(ctx, state, mcfg) -> dict:
  """The learner's fraction of the fp32 matmul peak, the sampler's decode against the
  memory-bandwidth roofline (both measured now: module docstring), and what tracing and
  lowering the step's programs costs."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from bench import learner as learner_bench  # pylint: disable=g-import-not-at-top
  from trm_jax import step as S  # pylint: disable=g-import-not-at-top
  from trm_jax.aot import hlo_cost  # pylint: disable=g-import-not-at-top
  name = "score_update" if "score_update" in ctx.programs.programs else "update"
  program = ctx.programs[name]
  compiled = program.lower().compile()
  flops = hlo_cost.program_cost(compiled)["flops"]
  fl = S.dispatch_rollout(ctx, state)
  if name == "update":
    data = (S.score_rollout(ctx, state.params, fl.ro)[0],)
  else:
    data = (S.learner_batch(ctx, fl.ro), S.shd.put_batch(
        np.zeros(fl.ro.tokens.shape[:1], np.float32), ctx.mesh))
  learner_state = [jax.tree.map(jnp.copy, (state.params, state.opt_state))]

  def learner_call():
    """One update from the last one's state (the program donates it)."""
    params, opt_state, *aux = program(*learner_state[0], ctx.rest, *data)
    learner_state[0] = (params, opt_state)
    jax.block_until_ready((params, opt_state, aux))
  walls = []
  for _ in range(5):
    t = time.time()
    learner_call()
    walls.append(time.time() - t)
  peak = learner_bench.matmul_peak()
  upd_s = statistics.median(walls)
  learner = dict(program=name, flops=flops, seconds=round(upd_s, 4),
                 gflops_per_s=round(flops / upd_s / 1e9, 2), matmul_peak=peak,
                 fraction_of_peak=round(flops / upd_s / (peak["peak_gflops"] * 1e9), 4),
                 profile=op_profile(compiled.as_text(), learner_call, functools.partial(
                     learner_category, T=int(data[0].tokens.shape[1]),
                     G=mcfg.num_heads // mcfg.num_kv_heads)))
  # Decode: what a rollout's decode steps must read at least, from its own rows: every
  # parameter once per decode step (in the sampler's dtype), and at each decode query of
  # each row the keys and values it attends, over the memory bandwidth. A row of n response
  # tokens has n - 1 decode queries (the first token comes from the prefill), the j-th
  # attending its prompt and j tokens. The rollout's time includes its prefill.
  itemsize = jnp.dtype(ctx.programs.sampler_dtype).itemsize
  param_bytes = sum(x.size * jnp.dtype(S.narrowed(x.dtype, ctx.programs.sampler_dtype)).itemsize
                    for x in jax.tree.leaves(state.params))
  kv_per_key = 2 * mcfg.num_layers * mcfg.num_kv_heads * mcfg.head_dim * itemsize
  bw = memory_bandwidth()

  def rollout_call():
    """One rollout batch, blocking; returns its Rollout."""
    ro = S.dispatch_rollout(ctx, state).ro
    jax.block_until_ready(ro.tokens)
    return ro
  rows = []
  for _ in range(3):
    t = time.time()
    ro = rollout_call()
    wall = time.time() - t
    prompt = np.asarray(ro.prompt_lengths, np.float64)
    q = np.maximum(np.asarray(ro.response_lengths, np.float64) - 1, 0)  # decode queries
    keys = np.sum(q * prompt + q * (q + 1) / 2)              # keys seen, over all queries
    steps = int(ro.stats.decode_steps)
    need = steps * param_bytes + keys * kv_per_key
    rows.append(dict(rollout_s=round(wall, 4), decode_steps=steps, bytes=int(need),
                     roofline_s=need / bw["best_bytes_per_s"]))
  ratio = statistics.median(r["rollout_s"] / r["roofline_s"] for r in rows)
  decode = dict(rollouts=rows, param_bytes=int(param_bytes), kv_bytes_per_key=kv_per_key,
                memory_bandwidth=bw, rollout_over_roofline=round(ratio, 2),
                seconds_per_decode_step=round(statistics.median(
                    r["rollout_s"] / r["decode_steps"] for r in rows), 6))
  # Every rollout of the same prompts and key decodes as many steps (the three above agree).
  decode["profile"] = op_profile(ctx.programs["rollout"].lower().compile().as_text(),
                                 rollout_call, rollout_category)
  steps = rows[-1]["decode_steps"]
  decode["profile"].update(decode_steps=steps, thunks_per_decode_step=round(
      decode["profile"]["thunks"] / steps, 1), thunk_us_per_decode_step=round(
          decode["profile"]["summed_s"] / steps * 1e6, 1))
  # What a rerun's first step pays before its cache lookups: tracing and lowering every
  # program of the step (JAX keys its persistent cache by the lowered module), timed from
  # empty in-memory caches, as in a new process.
  jax.clear_caches()
  trace, compile_s = {}, {}
  for p in ctx.programs:
    t = time.time()
    lowered = p.lower()
    trace[p.name] = round(time.time() - t, 3)
    # What the first run's step pays on top: XLA's compilation, the persistent cache off.
    cache_on = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
      t = time.time()
      lowered.compile()
      compile_s[p.name] = round(time.time() - t, 3)
    finally:
      jax.config.update("jax_enable_compilation_cache", cache_on)
  return dict(learner=learner, decode=decode, trace_and_lower_s=trace, compile_s=compile_s,
              imports_s=import_seconds())


# Op classes of the profiles (`op_profile`): an instruction is a matmul when XLA:CPU runs it
# as a library dot (a `ynn_fusion` / `dot` thunk built from a dot_general); the learner's
# attention ops are its two einsums (kernels/attention_ref.py) and every other op whose result
# holds the [.., T, T] scores (a T x T or a (G T) x T pair of dimensions: the mask, the
# softmax, their gradients and layout copies).
ATTENTION_EINSUMS = ("BTKGH,BSKH->BKGTS", "BKGTS,BSKH->BTKGH")
_CONTAINERS = ("while", "conditional", "call")     # their events hold their bodies' events


def _is_matmul(inst: str, names) -> bool:
  return inst.startswith(("ynn_fusion", "dot", "custom-call")) and any(
      n.endswith("/dot_general") for n in names)


def learner_category(inst: str, names, shape: str, *, T: int, G: int) -> str:
  dims = [int(d) for d in re.findall(r"\d+", shape.split("{")[0].split("[", 1)[-1])]
  if _is_matmul(inst, names):
    attn = any(spec in n for n in names for spec in ATTENTION_EINSUMS)
    return "attention_matmul" if attn else "matmul"
  if dims.count(T) >= 2 or (T in dims and G * T in dims):
    return "attention_elementwise"
  return "other"


def rollout_category(inst: str, names, shape: str) -> str:
  del shape
  return "matmul" if _is_matmul(inst, names) else "other"


def op_profile(hlo: str, call, category, top: int = 8) -> dict:
  """`call()` (one run of the program compiled as `hlo`, blocking) under the profiler: each op
  class's summed thunk seconds and share, the number of thunks run, and the `top` ops by time
  (loops and conditionals are left out of the sums: their events contain their bodies')."""
  from bench import xla_profile  # pylint: disable=g-import-not-at-top
  names = xla_profile.op_table(hlo)
  call()
  prof = xla_profile.thunk_times(call, names)
  leaves = {op: us for op, us in prof["us"].items() if not op.startswith(_CONTAINERS)}
  cats = {}
  for op, us in leaves.items():
    c = category(op, *names[op])
    cats[c] = cats.get(c, 0.0) + us / 1e6
  total = sum(cats.values())
  return dict(wall_s=round(prof["wall_s"], 4), summed_s=round(total, 4),
              thunks=sum(n for op, n in prof["calls"].items() if op in leaves),
              seconds=dict(sorted(((c, round(v, 4)) for c, v in cats.items()),
                                  key=lambda kv: -kv[1])),
              share={c: round(v / total, 3) for c, v in cats.items()},
              top_ops=[dict(op=op, ms=round(us / 1e3, 2), calls=prof["calls"][op],
                            shape=names[op][1].split("{")[0][:48],
                            category=category(op, *names[op]))
                       for op, us in sorted(leaves.items(), key=lambda kv: -kv[1])[:top]],
              contended=prof["contention"]["contended"])


def import_seconds(repeats: int = 3) -> float:
  """Fastest wall time of a new interpreter importing what the trainer's step needs (JAX, Flax,
  optax, the step module), nothing run: a floor under any new process's first step."""
  best = float("inf")
  for _ in range(repeats):
    t = time.time()
    subprocess.run([sys.executable, "-c", "import trm_jax.step"], check=True,
                   env=_env(None), capture_output=True)
    best = min(best, time.time() - t)
  return round(best, 3)


def memory_bandwidth(n_bytes: int = 256 * 2**20, repeats: int = 5) -> dict:
  """This machine's memory bandwidth now: the best read + write bytes per second of one pass
  over an array far larger than the caches, by numpy (one thread) and by an XLA:CPU program
  (its threads)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  a = np.ones(n_bytes // 4, np.float32)
  b = np.empty_like(a)
  x = jax.device_put(a)
  scale = jax.jit(lambda x: x * 1.5)
  scale(x).block_until_ready()
  best = {"numpy": 0.0, "xla": 0.0}
  for _ in range(repeats):
    t = time.perf_counter()
    np.copyto(b, a)
    best["numpy"] = max(best["numpy"], 2 * a.nbytes / (time.perf_counter() - t))
    t = time.perf_counter()
    scale(x).block_until_ready()
    best["xla"] = max(best["xla"], 2 * a.nbytes / (time.perf_counter() - t))
  top = max(best.values())
  return dict(best_bytes_per_s=top, gb_per_s=round(top / 1e9, 2), array_bytes=a.nbytes,
              by={k: round(v / 1e9, 2) for k, v in best.items()})


# ------------------------------------------------------------------------------------------
# Tunix: GRPOLearner
# ------------------------------------------------------------------------------------------
class _TunixTokenizer:
  """The base's tokenizer (trm_jax.data.load_tokenizer: the same tokenizer.json) with the
  methods Tunix's TokenizerAdapter asks of a tokenizer that is neither HF nor sentencepiece."""

  def __init__(self, tok):
    self.tok = tok

  def encode(self, text, **_):
    return self.tok.encode(str(text), add_special_tokens=False)   # Tunix passes np.str_

  def decode(self, ids, **_):
    return self.tok.decode(list(ids), skip_special_tokens=True)

  def bos_id(self):
    return self.tok.bos_id

  def eos_id(self):
    return self.tok.eos_id

  def pad_id(self):
    return self.tok.pad_id


def _response_tokens(ids, R: int, eos: int) -> int:
  """Sampled tokens of one completion up to and including EOS (a completion shorter than R
  ended with an EOS that its system may have stripped), as ours counts them."""
  ids = list(ids)
  if eos in ids:
    return ids.index(eos) + 1
  return len(ids) + 1 if len(ids) < R else len(ids)


def _rewards(completions, answers) -> list[float]:
  from trm_jax.data import math_reward  # pylint: disable=g-import-not-at-top
  return [math_reward(t, a) for t, a in zip(completions, answers)]


def run_tunix(spec: dict) -> dict:
  clock = _Clock()
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from tunix.models.qwen3 import model as tmodel  # pylint: disable=g-import-not-at-top
  from tunix.models.qwen3 import params as tparams  # pylint: disable=g-import-not-at-top
  from tunix.rl import rl_cluster as rlc  # pylint: disable=g-import-not-at-top
  from tunix.rl.grpo import grpo_learner  # pylint: disable=g-import-not-at-top
  from tunix.rl.rollout import base_rollout  # pylint: disable=g-import-not-at-top
  from tunix.utils import mesh as tmesh  # pylint: disable=g-import-not-at-top
  from trm_jax.data import load_tokenizer  # pylint: disable=g-import-not-at-top
  base, P, R = spec["base"], spec["max_prompt_len"], spec["max_new_tokens"]
  with open(os.path.join(base, "config.json")) as f:
    hf = json.load(f)
  cfg = tmodel.ModelConfig(
      num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
      embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
      num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
      num_kv_heads=hf["num_key_value_heads"],
      rope_theta=int(hf.get("rope_parameters", hf).get("rope_theta", 10000)),
      norm_eps=hf["rms_norm_eps"], use_tied_embedding=hf["tie_word_embeddings"],
      dtype=jnp.float32, param_dtype=jnp.float32)
  # Tunix 0.1.7's Qwen3 attention calls `apply_rope` without the config's rope_theta, so it
  # always rotates with theta = 1e6: on this checkpoint (theta 1e4) that is another model, whose
  # responses are shorter. Passing the checkpoint's theta makes it the same model as the
  # others' (`tunix_parity` below); the cost of a step is the same either way.
  tmodel.apply_rope = functools.partial(_TUNIX_ROPE.setdefault("fn", tmodel.apply_rope),
                                        rope_theta=cfg.rope_theta)
  mesh = tmesh.create_mesh((1, 1), ("fsdp", "tp"))     # Tunix's own (auto-sharded axes)
  with mesh:
    model = tparams.create_model_from_safe_tensors(base, cfg, mesh=mesh, dtype=jnp.float32)
  tok = load_tokenizer(base)
  training = rlc.RLTrainingConfig(
      actor_optimizer=optax.adamw(spec["lr"], b1=0.9, b2=0.99, weight_decay=0.0),
      eval_every_n_steps=10**9, max_steps=spec["steps"])
  rollout = base_rollout.RolloutConfig(
      max_tokens_to_generate=R, max_prompt_length=P, kv_cache_size=P + R + 1,
      temperature=spec["temperature"], top_p=1.0, top_k=None, eos_tokens=[spec["eos_id"]])
  cluster = rlc.RLCluster(
      actor=model, reference=None, tokenizer=_TunixTokenizer(tok),
      cluster_config=rlc.ClusterConfig(
          role_to_mesh={rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh, rlc.Role.ROLLOUT: mesh},
          rollout_engine="vanilla", offload_to_cpu=False, training_config=training,
          rollout_config=rollout))
  phases, tokens, current = [], [], {}

  def reward_fn(prompts, completions, answer, **_):
    t = time.time()
    out = _rewards(completions, answer)
    current["rewards"] = time.time() - t
    return out

  generate, update = cluster.generate, cluster.update_actor

  def timed_generate(*a, **k):
    t = time.time()
    out = generate(*a, **k)
    current["rollout"] = time.time() - t
    tokens.append(sum(_response_tokens(ids, R, spec["eos_id"]) for ids in out.tokens))
    return out

  def timed_update(*a, **k):
    t = time.time()
    update(*a, **k)
    jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
    now = time.time()
    current["update"] = now - t
    clock.ends.append(now)
    # The rest of the step: advantages, batch assembly, the learner's own bookkeeping.
    step = now - (clock.ends[-2] if len(clock.ends) > 1 else clock.start)
    current["other"] = step - sum(current.values())
    phases.append(dict(current))
    current.clear()

  cluster.generate, cluster.update_actor = timed_generate, timed_update
  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster, reward_fns=reward_fn,
      algo_config=grpo_learner.GRPOConfig(num_generations=spec["group_size"], num_iterations=1,
                                          beta=0.0, epsilon=0.2))
  import numpy as np  # pylint: disable=g-import-not-at-top
  # Arrays, not lists: Tunix repeats each leaf of a batch num_generations times (np.repeat).
  data = [{"prompts": np.array([p["text"] for p in step]),
           "answer": np.array([p["answer"] for p in step])} for step in spec["prompts"]]
  clock.start = time.time()
  learner.train(data)
  out = clock.result(tokens)
  out["phases"] = _phase_summary(phases[1:])
  out["versions"] = _versions("google-tunix")
  with mesh:
    fresh = tparams.create_model_from_safe_tensors(base, cfg, mesh=mesh, dtype=jnp.float32)
  ids = jnp.asarray([spec["prompts"][0][0]["ids"]], jnp.int32)
  T = ids.shape[1]
  with jax.set_mesh(mesh):
    logits, _ = fresh(ids, jnp.arange(T)[None], None, jnp.tril(jnp.ones((1, T, T), bool)))
  out["tunix_parity"] = _parity(base, ids, logits)
  return out


_TUNIX_ROPE = {}


def _parity(base: str, ids, logits) -> dict:
  """The largest |logit| difference between a peer's model and ours (whose parity with
  transformers the test suite checks) on one prompt, both freshly loaded from `base`."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from trm_jax.models import from_pretrained  # pylint: disable=g-import-not-at-top
  ours = from_pretrained(base, dtype=jnp.float32)(ids)
  return {"max_abs_logit_diff": float(jnp.max(jnp.abs(ours - logits))),
          "prompt_tokens": int(ids.shape[1])}


def _versions(*packages) -> dict:
  from importlib.metadata import version  # pylint: disable=g-import-not-at-top
  return {p: version(p) for p in packages}


# ------------------------------------------------------------------------------------------
# TRL: GRPOTrainer
# ------------------------------------------------------------------------------------------
def run_trl(spec: dict) -> dict:
  clock = _Clock()
  import datasets  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from trl import GRPOConfig, GRPOTrainer  # pylint: disable=g-import-not-at-top
  base, R = spec["base"], spec["max_new_tokens"]
  tok = transformers.AutoTokenizer.from_pretrained(base)
  ids = tok(text=[p["text"] for step in spec["prompts"] for p in step])["input_ids"]
  assert ids == [p["ids"] for step in spec["prompts"] for p in step], "prompt tokens differ"
  model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
  data = datasets.Dataset.from_list([{"prompt": p["text"], "answer": p["answer"]}
                                     for step in spec["prompts"] for p in step])
  phases, tokens, current = [], [], {}

  def reward_fn(prompts, completions, answer, **_):
    t = time.time()
    out = _rewards(completions, answer)
    current["rewards"] = current.get("rewards", 0.0) + time.time() - t
    return out

  class Timer(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **_):
      now = time.time()
      clock.ends.append(now)
      step = now - (clock.ends[-2] if len(clock.ends) > 1 else clock.start)
      current["update"] = step - current["prepare"]
      current["other"] = current.pop("prepare") - current["rollout"] - current["rewards"]
      phases.append(dict(current))
      current.clear()

  args = GRPOConfig(
      output_dir=tempfile.mkdtemp(prefix="rl_step_trl_"), per_device_train_batch_size=spec[
          "batch_size"], num_generations=spec["group_size"], max_completion_length=R,
      temperature=spec["temperature"], top_p=1.0, top_k=0, learning_rate=spec["lr"],
      beta=0.0, num_iterations=1, steps_per_generation=1, gradient_accumulation_steps=1,
      max_steps=spec["steps"], adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0,
      lr_scheduler_type="constant", shuffle_dataset=False, logging_steps=1,
      save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True, seed=0)
  trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=data,
                        processing_class=tok, callbacks=[Timer()])
  generate, prepare = trainer._generate_single_turn, trainer._generate_and_score_completions  # pylint: disable=protected-access

  def timed_generate(*a, **k):
    t = time.time()
    completion_ids, logprobs = generate(*a, **k)
    current["rollout"] = time.time() - t
    tokens.append(sum(_response_tokens(c, R, tok.eos_token_id) for c in completion_ids))
    return completion_ids, logprobs

  def timed_prepare(*a, **k):
    t = time.time()
    out = prepare(*a, **k)
    current["prepare"] = time.time() - t
    return out

  trainer._generate_single_turn = timed_generate   # pylint: disable=protected-access
  trainer._generate_and_score_completions = timed_prepare   # pylint: disable=protected-access
  clock.start = time.time()
  trainer.train()
  out = clock.result(tokens)
  out["phases"] = _phase_summary(phases[1:])
  out["versions"] = {**_versions("trl", "transformers"), "torch": torch.__version__,
                     "torch_threads": torch.get_num_threads()}
  fresh = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
  ids = spec["prompts"][0][0]["ids"]
  with torch.no_grad():
    logits = fresh(torch.tensor([ids])).logits.numpy()
  out["trl_parity"] = _parity(base, np.asarray([ids]), logits)
  return out


WORKERS = {"ours": run_ours, "tunix": run_tunix, "trl": run_trl}


# ------------------------------------------------------------------------------------------
# The run: one process per system and shape, side by side
# ------------------------------------------------------------------------------------------
def _env(cache_dir) -> dict:
  """A worker's environment: CPU JAX with one device (the trainer's default on this machine),
  and JAX's persistent compilation cache in `cache_dir` (None: no persistent cache)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
             TOKENIZERS_PARALLELISM="false")
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  if cache_dir is None:
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  else:
    env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
  env["PYTHONPATH"] = os.pathsep.join(
      [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
       *filter(None, [env.get("PYTHONPATH")])])
  return env


def launch(system: str, spec_path: str, workdir: str, *, cache_dir, steps: int = 0,
           phase_steps: int = 0, limits: bool = False) -> dict:
  """Runs one worker in a new process; its result with the hygiene probe of its run, or
  {"error": ...} with the end of its stderr."""
  from bench import hygiene  # pylint: disable=g-import-not-at-top
  out = os.path.join(workdir, f"{system}_{len(os.listdir(workdir))}.json")
  cmd = [sys.executable, "-m", "bench.rl_step", "--worker", system, "--spec", spec_path,
         "--out", out, "--steps", str(steps), "--phase-steps", str(phase_steps)]
  if limits:
    cmd.append("--limits")
  env = _env(cache_dir)
  print(f"[rl_step] {system}: {' '.join(cmd[3:])}", flush=True)
  probe = hygiene.Probe().start()
  env[_LAUNCH] = repr(time.time())
  p = subprocess.run(cmd, env=env, capture_output=True, text=True)
  info = probe.stop()
  if p.returncode:
    print(p.stderr[-3000:], file=sys.stderr, flush=True)
    return {"error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else
            f"exit {p.returncode}", "exit_code": p.returncode}
  with open(out) as f:
    result = json.load(f)
  result["probe"] = {k: info[k] for k in ("wall_s", "other_cores", "contended", "load_before",
                                          "load_after")}
  print(f"[rl_step] {system}: warm {result.get('warm_s')} s/step, first {result['first_s']} s"
        f"{' CONTENDED' if info['contended'] else ''}", flush=True)
  return result


def run_shape(shape: str, name: str, overrides: dict, systems, *, steps: int,
              phase_steps: int, workdir: str, report=lambda part: None) -> dict:
  """The shape's results by system; `report(part)` after each system (the JSON is rewritten
  then, so a stopped run keeps what it measured)."""
  spec = make_spec(name, overrides, steps, phase_steps)
  spec_path = os.path.join(workdir, f"spec_{shape}.json")
  with open(spec_path, "w") as f:
    json.dump(spec, f)
  out = {"config": f"configs/{name}.py", "overrides": spec["overrides"],
         "batch_size": spec["batch_size"], "group_size": spec["group_size"],
         "max_prompt_len": spec["max_prompt_len"], "max_new_tokens": spec["max_new_tokens"],
         "steps": steps}
  for system in systems:
    if system != "ours":
      out[system] = launch(system, spec_path, workdir, cache_dir=None)
      report(_with_speedups(out, systems))
      continue
    cache = tempfile.mkdtemp(prefix="xla_cache_", dir=workdir)
    ours = launch("ours", spec_path, workdir, cache_dir=cache, phase_steps=phase_steps)
    # A rerun: the same settings in a new process, whose persistent compilation cache the
    # run above filled; then the limits, measured in that process after its steps.
    cached = launch("ours", spec_path, workdir, cache_dir=cache, steps=2, limits=True)
    if "error" not in ours and "error" not in cached:
      ours.update(first_cached_s=cached["first_s"], first_cached_step_s=cached["first_step_s"],
                  cached_startup_s=cached["startup_s"], limits=cached.get("limits"),
                  cached_probe=cached["probe"])
    out["ours"] = ours
    report(_with_speedups(out, systems))
  return _with_speedups(out, systems)


def _with_speedups(out: dict, systems) -> dict:
  """The shape's results with each peer's warm and first-step seconds over ours."""
  out = dict(out)
  warm = {s: out[s].get("warm_s") for s in systems if s in out and "error" not in out[s]}
  if warm.get("ours"):
    out["speedup_warm"] = {s: round(w / warm["ours"], 2) for s, w in warm.items()
                           if s != "ours" and w}
    out["speedup_first"] = {s: round(out[s]["first_s"] / out["ours"]["first_s"], 2)
                            for s in warm if s != "ours"}
  return out


def goals(shapes: dict) -> dict:
  """The goals of this benchmark, each met (True), missed (False) or not measured (None)."""
  def get(shape, *keys):
    node = shapes.get(shape, {})
    for k in keys:
      node = node.get(k) if isinstance(node, dict) else None
    return node

  out = {}
  for shape in shapes:
    for peer, goal in (("tunix", 3.0), ("trl", 5.0)):
      r = get(shape, "speedup_warm", peer)
      out[f"{shape}: warm step >= {goal:g}x {peer}"] = None if r is None else bool(r >= goal)
    frac = get(shape, "ours", "limits", "learner", "fraction_of_peak")
    out[f"{shape}: learner >= 0.5 of fp32 matmul peak"] = None if frac is None else frac >= 0.5
  # The goal is the rerun's first_cached_s (from the process's launch); its step alone
  # (first_cached_step_s, without interpreter, imports and model load) is reported beside it.
  warm = get("main", "ours", "warm_s")
  for key, what in (("first_cached_s", "from launch"), ("first_cached_step_s", "step alone")):
    first = get("main", "ours", key)
    out[f"main: first step of a rerun ({what}) <= 2x warm"] = (
        None if first is None or not warm else bool(first <= 2 * warm))
  for shape in shapes:
    ours, tunix = get(shape, "ours", "first_s"), get(shape, "tunix", "first_s")
    out[f"{shape}: first_s below Tunix's"] = (None if ours is None or tunix is None
                                              else bool(ours < tunix))
  ratio = get("long", "ours", "limits", "decode", "rollout_over_roofline")
  out["long: decode within 2x of the memory-bandwidth roofline"] = (
      None if ratio is None else bool(ratio <= 2.0))
  return out


def missed_because(shapes: dict) -> dict:
  """For each goal `goals` finds missed, what bounds it, from this run's own measurements."""
  met = goals(shapes)
  out = {}
  for goal, ok in met.items():
    if ok is not False:
      continue
    shape = goal.split(":")[0]
    res = shapes[shape]
    ours = res["ours"]
    lim = ours.get("limits") or {}
    if "warm step" in goal:
      peer = goal.split()[-1]
      learner = ours["phases"]["median_s"]["learner"]
      out[goal] = (f"ours' learner alone takes {learner:.3f} s of its {ours['warm_s']:.3f} s "
                   f"step; with a rollout that took no time the step would be "
                   f"{res[peer]['warm_s'] / learner:.2f}x {peer}'s {res[peer]['warm_s']:.3f} s")
    elif "matmul peak" in goal and lim:
      prof = lim["learner"]["profile"]
      share = prof["share"]
      out[goal] = (f"of the learner's op time, {share.get('attention_elementwise', 0):.0%} is "
                   f"elementwise work and layout copies over attention's [B, K, G, T, T] "
                   f"scores, {share.get('attention_matmul', 0):.0%} attention's two matmuls, "
                   f"{share.get('matmul', 0):.0%} the other "
                   f"matmuls, {share.get('other', 0):.0%} the rest; {prof['thunks']} thunks in "
                   f"all")
    elif "first step of a rerun" in goal and lim:
      warm = ours["warm_s"]
      trace = (f"tracing and lowering the step's programs (which the persistent cache's lookup "
               f"needs) takes {sum(lim['trace_and_lower_s'].values()):.2f} s")
      if "from launch" in goal:
        trace = (f"a new interpreter importing the trainer's step takes {lim['imports_s']:.2f} "
                 f"s and {trace}")
      out[goal] = f"{trace}, above 2x warm = {2 * warm:.2f} s"
    elif "first_s" in goal and lim:
      comp = lim["compile_s"]
      parts = ", ".join(f"{k} {v:.1f} s" for k, v in comp.items())
      out[goal] = (f"compiling ours' programs takes {sum(comp.values()):.1f} s ({parts}); "
                   f"ours' first step {ours['first_step_s']:.1f} s against Tunix's "
                   f"{res['tunix']['first_step_s']:.1f} s, start-up {ours['startup_s']:.1f} s "
                   f"against {res['tunix']['startup_s']:.1f} s")
    elif "roofline" in goal and lim:
      dec = lim["decode"]
      prof = dec["profile"]
      roof = statistics.median(r["roofline_s"] / r["decode_steps"] for r in dec["rollouts"])
      out[goal] = (f"a decode step takes {dec['seconds_per_decode_step'] * 1e6:.0f} us against "
                   f"{roof * 1e6:.0f} us of memory traffic; it runs "
                   f"{prof['thunks_per_decode_step']:.0f} XLA thunks, "
                   f"{prof['share']['matmul']:.0%} of their time in library matmuls of at most "
                   f"{res['batch_size']} rows")
  return out


def plot(result: dict, path: str) -> None:
  """Seconds per warm step (bars, log scale) and to the first step (markers), by system and
  shape."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  shapes = [s for s, r in result["shapes"].items()
            if any(k in r and "error" not in r[k] for k in SYSTEMS)]
  if not shapes:
    return
  fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 3.6), squeeze=False)
  for ax, shape in zip(axes[0], shapes):
    r = result["shapes"][shape]
    systems = [s for s in SYSTEMS if s in r and "error" not in r[s]]
    warm = [r[s]["warm_s"] for s in systems]
    bars = ax.bar(systems, warm, color=["tab:green", "tab:blue", "tab:orange"][:len(systems)])
    for b, w in zip(bars, warm):
      ax.annotate(f"{w:.2f} s", (b.get_x() + b.get_width() / 2, w), ha="center",
                  va="bottom", fontsize=8)
    ax.scatter(systems, [r[s]["first_s"] for s in systems], marker="v", color="k",
               label="first step, from launch")
    if "first_cached_s" in r.get("ours", {}):
      ax.scatter(["ours"], [r["ours"]["first_cached_s"]], marker="^", color="tab:red",
                 label="ours, first step of a rerun")
    ax.set_yscale("log")
    ax.set_ylim(top=20 * max([*warm, *(r[s]["first_s"] for s in systems)]))
    ax.set_title(f"{shape}: {r['batch_size']} rollouts, <= {r['max_new_tokens']} new tokens",
                 fontsize=9)
    ax.set_ylabel("seconds per warm step (bars)")
  axes[0][0].legend(fontsize=7, loc="upper left")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _uptime() -> str:
  """`uptime`'s line (the load of this shared machine, as an operator reads it)."""
  try:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError) as e:
    return f"uptime unavailable: {e}"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
  ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
  ap.add_argument("--steps", type=int, default=6,
                  help="steps per system (the first, then the warm ones; >= 6)")
  ap.add_argument("--phase-steps", type=int, default=3,
                  help="ours: extra steps run phase by phase (the phase shares)")
  ap.add_argument("--out", default=os.path.join(RESULTS, "rl_step.json"))
  ap.add_argument("--smoke", action="store_true",
                  help="one warm step of ours at a tiny shape, in this process (the test)")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=V",
                  help="a config override for every shape (e.g. warmup.cache_dir=...)")
  ap.add_argument("--limits", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
  ap.add_argument("--spec", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    with open(args.spec) as f:
      spec = json.load(f)
    spec["steps"] = args.steps or spec["steps"]
    spec["prompts"] = spec["prompts"][:spec["steps"]]
    kw = (dict(phase_steps=args.phase_steps, limits=args.limits) if args.worker == "ours"
          else {})
    result = WORKERS[args.worker](spec, **kw)
    with open(args.out, "w") as f:
      json.dump(result, f)
    return
  from bench import hygiene  # pylint: disable=g-import-not-at-top
  from trm_jax import sweep  # pylint: disable=g-import-not-at-top
  overrides = sweep.parse_sets(args.set)
  machine = hygiene.machine()
  uptime = _uptime()
  t0 = time.time()

  def write(shapes: dict) -> dict:
    result = {"load_avg": machine["load_average"], "load_avg_end": [
                  round(x, 2) for x in os.getloadavg()], "uptime": uptime,
              "uptime_end": _uptime(), "cpu": machine["cpu"], "machine": machine,
              "wall_s": round(time.time() - t0, 1), "shapes": shapes}
    if not args.smoke:
      result["goals"] = goals(shapes)
      result["missed_because"] = missed_because(shapes)
      plot(result, os.path.splitext(args.out)[0] + ".png")
    hygiene.write_json(result, args.out)
    return result

  if args.smoke:
    spec = make_spec(SHAPES["main"], {**SMOKE_OVERRIDES, **overrides}, 2, 1)
    result = write({"smoke": {"ours": run_ours(spec, phase_steps=1)}})
  else:
    shapes = {}
    with tempfile.TemporaryDirectory(prefix="rl_step_") as workdir:
      for shape in args.shapes:
        shapes[shape] = run_shape(
            shape, SHAPES[shape], overrides, args.systems, steps=args.steps,
            phase_steps=args.phase_steps, workdir=workdir,
            report=lambda part, shape=shape: write({**shapes, shape: part}))
        result = write(shapes)
  print(json.dumps(result.get("goals", {}), indent=1))


if __name__ == "__main__":
  main()
