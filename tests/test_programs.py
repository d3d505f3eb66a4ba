"""The trainer's programs are AOT's programs (`programs.build`).

One real RL step and one evaluation run in-process on the session's tiny base model, with
every `Program` call recorded: the programs the trainer calls are exactly the ones
`trm_jax.aot` builds for the same config, and every call's inputs have the shapes, dtypes and
shardings of the abstract inputs AOT compiles (so AOT compiles the trainer's program, not a
look-alike). Colocated with the evaluation's dense and compressed programs, two minibatches
(separate score and update programs) and the scoring pass in two groups of rows, a sampler on its own devices with stale
parameters and one update per batch (the learner's one `score_update` program), and the
latter with LoRA adapters over an nf4 base, merged inside the sampler's program, and two
minibatches (params, the stale copy and what each rollout sends are the adapters; the base
rides in the model's other state, on the sampler's devices once).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trm_jax import train
from trm_jax.aot import compiler as aot
from trm_jax import programs as programs_lib
from trm_jax import step as step_lib
from trm_jax.data import Task, load_tokenizer
from trm_jax.models import from_pretrained

pytestmark = pytest.mark.slow


def _signature(tree):
  """(path, shape, dtype, partition spec) of every array leaf, None leaves kept out. Mesh axes
  of one device are dropped from the spec: P() and P(None, 'tensor') on a mesh whose tensor
  axis is one device are one placement, and XLA's propagation (a jitted cast's output, e.g.
  step.narrow's) may return either."""
  def keep(mesh, entry):
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    names = tuple(n for n in names if mesh.shape[n] > 1)
    return None if not names else names[0] if len(names) == 1 else names

  def one(path, x):
    sh = getattr(x, "sharding", None)
    spec = (tuple(keep(sh.mesh, e) for e in sh.spec)
            if isinstance(sh, jax.sharding.NamedSharding) else None)
    return (jax.tree_util.keystr(path), tuple(x.shape), str(x.dtype), spec)
  return [one(p, x) for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def _spec(sig):
  """Partition specs compared up to trailing replicated dimensions (P('d') == P('d', None));
  a host (numpy) input is placed replicated by the jitted program."""
  out = []
  for path, shape, dtype, spec in sig:
    spec = () if spec is None else tuple(spec)
    while spec and spec[-1] is None:
      spec = spec[:-1]
    out.append((path, shape, dtype, spec))
  return out


@pytest.mark.parametrize("variant", ["colocated_smd_eval", "disaggregated_stale",
                                     "lora_nf4_disaggregated_stale"])
def test_trainer_calls_exactly_the_programs_aot_compiles(shared_run, monkeypatch, variant):
  c = shared_run.config()
  # Batches that divide the learner's devices (8, or 6 beside a 2-device sampler) per
  # minibatch, as config.check_batch_mesh requires.
  c.total_steps, c.rl.batch_size, c.rl.group_size = 2, 16, 4
  # eval_samples = 1: one evaluation program per cache (the sampled ones differ only in
  # their static sampling settings, which the AOT tests compile).
  c.rl.num_minibatches, c.eval_problems, c.eval_samples = 2, 4, 1
  if variant == "colocated_smd_eval":
    c.rollout.cache.policy, c.rollout.cache.ratio, c.smd.mode = "h2o", 0.5, "smd"
    c.rl.score_microbatches = 2          # the scoring pass over two groups of 8 rows
  elif variant == "disaggregated_stale":
    c.mesh.rollout_devices, c.rl.staleness, c.rollout.dtype = 2, 1, "bfloat16"
    # One update per batch: the step's learner is the one "score_update" program.
    c.eval_problems, c.rl.batch_size, c.rl.num_minibatches = 0, 24, 1
  else:   # adapters over an nf4 base: the copies sent to the sampler are the adapters, which
          # the merged sampler merges into the dequantized base inside its program
    c.model.lora.rank, c.model.lora.base_quant, c.model.lora.sampler = 8, "nf4", "merged"
    c.mesh.rollout_devices, c.rl.staleness, c.rollout.dtype = 2, 1, "bfloat16"
    c.eval_problems, c.rl.batch_size = 0, 24
  calls = []
  real_call = programs_lib.Program.__call__

  def recording(self, *args):
    calls.append((self.name, _signature(args)))
    return real_call(self, *args)
  monkeypatch.setattr(programs_lib.Program, "__call__", recording)

  mesh, sampler_mesh = train.make_mesh(c)
  with jax.set_mesh(mesh):
    model = from_pretrained(str(shared_run.base_dir), dtype=jnp.float32, mesh=mesh)
    model, _ = train.add_adapters(c, model, str(shared_run.base_dir))
    tok = load_tokenizer(str(shared_run.base_dir))
    task = Task(c.task, seed=c.seed, tokenizer=tok, eval_problems=c.eval_problems)
    ctx, state = step_lib.make_context(c, mesh, model, tok, task, sampler_mesh)
    state, _ = step_lib.rl_step(ctx, state)
    if c.eval_problems:
      step_lib.evaluate(ctx, state.params)

  # AOT's build for the same config and model architecture, on the same devices.
  c.task.max_prompt_len, c.task.max_new_tokens = task.max_prompt_len, task.max_new_tokens
  setup = aot.build(c, model.config.to_hf(), jax.devices())
  compiled = setup.programs.programs
  assert sorted({name for name, _ in calls}) == sorted(compiled)
  assert ("score_update" in compiled) == (variant == "disaggregated_stale")
  assert ctx.programs.lcfg.score_microbatches == setup.programs.lcfg.score_microbatches == (
      2 if variant == "colocated_smd_eval" else 1)
  for name, sig in calls:
    assert _spec(sig) == _spec(_signature(compiled[name].args)), name


def test_evaluation_in_chunks_equals_one_call(shared_run):
  """eval_batch_size splits the held-out rows into calls of a fixed row count (the last one
  padded); greedy correctness of every problem is the same as in one call, and the program
  AOT compiles is the chunk-sized one (its `calls` per evaluation counted)."""
  c = shared_run.config()
  c.eval_problems, c.eval_samples = 10, 1
  mesh, _ = train.make_mesh(c)
  out = {}
  with jax.set_mesh(mesh):
    model = from_pretrained(str(shared_run.base_dir), dtype=jnp.float32, mesh=mesh)
    tok = load_tokenizer(str(shared_run.base_dir))
    task = Task(c.task, seed=c.seed, tokenizer=tok, eval_problems=c.eval_problems)
    for size in (0, 4):
      c.eval_batch_size = size
      ctx, state = step_lib.make_context(c, mesh, model, tok, task)
      program = ctx.programs["eval_greedy"]
      out[size] = (program.args[1].shape[0], program.calls,
                   step_lib._evaluate_rows(ctx, program, nnx.merge_state(state.params, ctx.rest),
                                           task.prompts(task.eval_problems(10), 1),
                                           task.eval_problems(10), jax.random.key(3)))
  # 10 rows on 8 devices: one call of 16 rows (6 padding), or calls of 4 rows rounded up to 8
  assert step_lib.shd.batch_shards(mesh) == 8
  assert out[0][:2] == (16, 1) and out[4][:2] == (8, 2)
  assert set(out[0][2]) == set(out[4][2]) == {"reward"}     # a binary task: no parts
  np.testing.assert_array_equal(out[0][2]["reward"], out[4][2]["reward"])
