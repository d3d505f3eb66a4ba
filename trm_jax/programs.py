"""The jitted programs of an RL run, built once from the config, the meshes and the model.

`build(c, model, mesh, sampler_mesh, sizes)` is the one place that turns the config into
compiled programs; `step.make_context` (the trainer) and `trm_jax.aot` (ahead-of-time
compiles for a TPU slice) both call it, with real or abstract (`nnx.eval_shape`, sharded
`ShapeDtypeStruct`) model state:

  rollout                 the sampler: prefill and the decode loop with the config's KV
                          cache over rl.batch_size rows, on the sampler's mesh (pi_roll: its
                          dtype, noise, truncation, routing record);
  score                   the learner's scoring pass over the whole batch (called again for
                          the frozen KL reference when rl.kl_beta > 0);
  update                  one minibatch update (microbatch scan, optimizer, SMD teacher),
                          rl.num_minibatches x rl.num_epochs per step;
  score_update            instead of both when a batch gets one update (rl.num_minibatches =
                          rl.num_epochs = rl.num_microbatches = 1, rl.kl_beta = 0): the
                          scoring pass, the advantages and the update from one forward pass
                          (rl.learner.make_score_update);
  eval_greedy             held-out evaluation, greedy, dense cache, learner dtype, in
                          calls of at most eval_batch_size rows;
  eval_sampled            eval_samples = k > 1: k samples per problem;
  eval_*_compressed       the same under the rollout's cache policy (when it compresses).

Each `Program` carries the abstract inputs the trainer passes it (shapes, dtypes,
shardings; `tests/test_programs.py` checks them against a real run's calls) and the
train-state buffers resident on its devices while it runs, so AOT lowers exactly
`program.fn` at `program.args` and counts what else the chip holds. Calling a program
enters its mesh (`jax.set_mesh`): the model's activation constraints and the attention
kernels' shard_map (`kernels.partition`) read it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from trm_jax import config as config_lib
from trm_jax import sharding as shd
from trm_jax.config import ConfigError
from trm_jax.models import lora
from trm_jax.models.config import DTYPES, LoraConfig
from trm_jax.models.decoder import abstract_model as _abstract_decoder
from trm_jax.rl import advantages as adv_lib
from trm_jax.rl import modes, objectives, optim
from trm_jax.rl.learner import (LearnerBatch, LearnerConfig, make_learner, make_score_update,
                                one_pass)
from trm_jax.rollout import BatchingConfig, CacheConfig, sampler_graphdef, sampling_config
from trm_jax.rollout.policies import get_policy
from trm_jax.rollout.types import DENSE
from trm_jax.rollout.sampler import decode_schedule, make_generate, routing_dtype


# ------------------------------------------------------------------------------------------
# What lowers memory: the settings each program's per-device memory grows with (named by
# trm_jax.aot for a program that does not fit), and the list the trainer's out-of-memory
# error names whatever stage ran out (step.oom_hints), the learner's first.
# ------------------------------------------------------------------------------------------
MEMORY_KNOBS = {
    "rollout": ("rl.batch_size (rows sampled at once; the KV cache is [B, K, C, H] per layer)",
                "task.max_new_tokens / task.max_prompt_len (cache slots C)",
                "rollout.cache.policy / ratio (a compressed cache has fewer slots)",
                "mesh.fsdp / mesh.data (more chips share the rows) or mesh.tensor (kv heads)"),
    "score": ("rl.chunk (positions per [B, chunk, V] vocabulary projection)",
              "rl.score_microbatches (raise it: the scoring pass runs its rows in that many "
              "groups, one after another)",
              "rl.batch_size (the scoring pass runs the whole rollout batch)",
              "mesh.fsdp / mesh.data / mesh.tensor (more chips share rows, heads, vocabulary)",
              "model.moe_chunk (MoE with mesh.expert > 1: tokens per device per all-to-all)"),
    "update": ("rl.num_microbatches (raise it: fewer rows per microbatch)",
               "model.remat=True (recompute block activations in the backward pass)",
               "rl.chunk (lower it: fewer positions per vocabulary projection)",
               "rl.num_minibatches (smaller minibatches)",
               "mesh.fsdp (shard parameters and AdamW state over more chips) / mesh.tensor"),
    "score_update": ("rl.num_microbatches > 1 or rl.num_minibatches > 1 (separate score "
                     "and update programs over fewer rows at a time)",
                     "model.remat=True (recompute block activations in the backward pass)",
                     "rl.chunk (lower it: fewer positions per vocabulary projection)",
                     "mesh.fsdp (shard parameters and AdamW state over more chips) / "
                     "mesh.tensor"),
}



def memory_knobs(program: str) -> tuple:
  """MEMORY_KNOBS of a program; the evaluations are sampler programs over held-out rows."""
  if program.startswith("eval_"):
    return ("eval_problems / eval_samples (rows sampled at once)",
            *MEMORY_KNOBS["rollout"][1:])
  return MEMORY_KNOBS[program]


OOM_KNOBS = ("rl.num_microbatches (raise it: smaller microbatches, same update)",
             "rl.score_microbatches (raise it: the scoring pass's rows in groups, in turn)",
             "rl.chunk (lower it: fewer positions per vocabulary projection)",
             "model.remat=True (recompute block activations in the backward pass)",
             "task.max_new_tokens (shorter rollouts)",
             "rl.batch_size, or a larger mesh.fsdp to shard parameters and optimizer state")


# ------------------------------------------------------------------------------------------
# Settings derived from the config (static: part of the compiled programs)
# ------------------------------------------------------------------------------------------
def learner_config(c: ml_collections.ConfigDict, max_len: int) -> LearnerConfig:
  r = c.rl
  # The objective's own settings: the `rl` keys its registry entry names.
  kwargs = tuple((arg, r[key]) for arg, key in objectives.get_objective(r.objective).settings)
  thresholds = tuple((k, float(v)) for k, v in c.trm.items() if k != "criteria")
  # The learner mode's own settings: the `smd` keys its registry entry names (and no other
  # mode's, so e.g. smd.lam never enters a dense learner's program).
  mode_kwargs = tuple((k, c.smd[k]) for k in modes.get_mode(c.smd.mode).config_fields)
  return LearnerConfig(objective=r.objective, loss_agg=r.loss_agg, objective_kwargs=kwargs,
                       max_len=max_len, criteria=tuple(c.trm.criteria), thresholds=thresholds,
                       mode=c.smd.mode, mode_kwargs=mode_kwargs,
                       num_microbatches=r.num_microbatches,
                       score_microbatches=r.score_microbatches, chunk=r.chunk,
                       attn_impl=c.model.attn_impl, temperature=float(c.rollout.temperature),
                       kl_beta=float(c.rl.kl_beta))


def cache_config(c: ml_collections.ConfigDict) -> CacheConfig:
  """The sampler's cache: dense for "none", else the policy's budget and its own settings
  (the `rollout.cache` keys its registry entry names)."""
  cc = c.rollout.cache
  if cc.policy == DENSE:
    return CacheConfig()
  budget = ({"capacity": cc.capacity} if cc.capacity else {"ratio": cc.ratio})
  own = {k: cc[k] for k in get_policy(cc.policy).config_fields}
  return CacheConfig(policy=cc.policy, **own, **budget)


def group_advantages(c: ml_collections.ConfigDict):
  """(rewards [B], TRM's sequence mask [B]) -> [B] GRPO advantages with the config's group
  size, std normalisation and baseline (rl.advantages.group_advantages)."""
  return functools.partial(adv_lib.group_advantages, group_size=c.rl.group_size,
                           normalize_std=c.rl.normalize_std, baseline=c.rl.baseline)


def lora_config(c: ml_collections.ConfigDict) -> Optional[LoraConfig]:
  """`model.lora` as the model's LoraConfig, or None for rank 0 (full fine-tuning)."""
  lc = c.model.lora
  if lc.rank == 0:
    return None
  return LoraConfig(rank=lc.rank, alpha=float(lc.alpha), targets=tuple(lc.targets),
                    base_quant=lc.base_quant)


def sampler_merge(c: ml_collections.ConfigDict):
  """What a sampler program does to the model it is given first: with LoRA and
  `model.lora.sampler` "merged" ("auto" over a base that is not quantized), merge the
  adapters into the weights (inside the program); else nothing (None)."""
  lc = c.model.lora
  merged = lc.sampler == "merged" or (lc.sampler == "auto" and lc.base_quant == "none")
  return lora.merged_sampler_state if lc.rank and merged else None


def make_optimizer(c: ml_collections.ConfigDict):
  """AdamW with warm-up and cosine decay over every optimizer step of the run."""
  o = c.optim
  n_updates = c.total_steps * c.rl.num_minibatches * c.rl.num_epochs
  return optim.make_optimizer(lr=o.lr, warmup_steps=min(o.warmup_steps, n_updates - 1),
                              total_steps=n_updates, weight_decay=o.weight_decay, b1=o.b1,
                              b2=o.b2, eps=o.eps, clip_norm=o.clip_norm,
                              min_lr_ratio=o.min_lr_ratio)


def narrowed(dtype, to):
  """`to` for a floating dtype wider than it, else `dtype` unchanged."""
  dtype, to = jnp.dtype(dtype), jnp.dtype(to)
  return to if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize > to.itemsize else dtype


def eval_chunk_rows(rows: int, eval_batch_size: int, shards: int) -> int:
  """Rows of one evaluation generate call: at most `eval_batch_size` of the evaluation's
  `rows` (0 = all), rounded up to a multiple of the mesh's batch shards so that no call is
  replicated on every device (`step.evaluate` pads the last chunk)."""
  n = min(rows, eval_batch_size) if eval_batch_size > 0 else rows
  return -(-max(n, 1) // shards) * shards


def eval_sampling(roll, c: ml_collections.ConfigDict, n: int):
  """The evaluation's sampling: greedy for n = 1, else eval_temperature / eval_top_p; no
  mismatch knobs (noise, truncation by top-k) and nothing recorded for a learner."""
  return dataclasses.replace(roll, greedy=n == 1, temperature=c.eval_temperature,
                             top_p=c.eval_top_p, top_k=0, logit_noise=0.0,
                             router_noise_scale=0.0, keep_full_logprobs=False,
                             keep_topk_logprobs=0, record_routing=False)


# ------------------------------------------------------------------------------------------
# Programs
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sizes:
  """The shapes the task fixes: prompt bucket P, new tokens R, held-out problems evaluated."""
  P: int
  R: int
  eval_problems: int = 0


@dataclasses.dataclass(frozen=True)
class Program:
  """One jitted program and what it runs with."""
  name: str
  fn: Any                   # jax.jit-wrapped function
  mesh: jax.sharding.Mesh   # entered (jax.set_mesh) for every call and lowering
  args: tuple               # abstract inputs as the trainer passes them (sharded SDS trees)
  resident: Any             # train-state buffers its devices hold besides `args` meanwhile
  calls: int                # calls per RL step (per evaluation for the eval_* programs)
  per: str = "step"         # "step" | "evaluation"
  loop_bounds: Optional[Any] = None   # () -> {named scope: body executions per call} of its
                                      #   data-dependent loops (the sampler's when no row
                                      #   stops early: sampler.decode_schedule); AOT's

  def __call__(self, *args):
    with jax.set_mesh(self.mesh):
      return self.fn(*args)

  def lower(self):
    """`fn` lowered at `args` (AOT: the same program the trainer compiles at its first call)."""
    with jax.set_mesh(self.mesh):
      return self.fn.lower(*self.args)


@dataclasses.dataclass(frozen=True)
class Programs:
  """Every program of a run, plus the static settings and shardings they were built with."""
  programs: dict            # name -> Program, in the order a step first calls them
  tx: Any                   # the optax optimizer
  lcfg: LearnerConfig
  roll: Any                 # SamplingConfig of training rollouts
  cache: CacheConfig        # the sampler's KV cache
  graphdef: nnx.GraphDef    # the policy's graph (learner dtype)
  roll_graphdef: nnx.GraphDef   # the same graph computing in rollout.dtype
  sampler_dtype: Any            # rollout.dtype as a dtype: what the sampler's copies and the
                                #   stale versions are narrowed to (step.narrow)
  param_sh: Any             # parameter shardings (learner mesh)
  opt_sh: Any               # optimizer-state shardings
  sampler_param_sh: Any = None   # disaggregated sampler: parameter shardings on its mesh
  sampler_rest_sh: Any = None    # and the non-parameter state's
  sent_params: Any = None        # what step.to_sampler copies there per rollout (abstract)
  score_alone: Optional[Program] = None   # with "score_update": the scoring pass on its own,
                                          #   which no step calls (analyses, tests)

  def __getitem__(self, name: str) -> Program:
    return self.programs[name]

  def __iter__(self):
    return iter(self.programs.values())


def abstract(tree, shardings=None):
  """Sharded ShapeDtypeStructs of a pytree of arrays (or of ShapeDtypeStructs); `shardings`
  (same structure) replaces theirs."""
  if shardings is None:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        tree)
  return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree,
                      shardings)


def abstract_model(model_cls, model_config, mesh: jax.sharding.Mesh) -> nnx.Module:
  """The model with every variable a ShapeDtypeStruct sharded by its logical axes on `mesh`
  (as `hf_io.from_pretrained` places real weights): nothing is allocated."""
  model = _abstract_decoder(model_cls, model_config)
  state = nnx.state(model)
  nnx.update(model, jax.tree.map(
      lambda v, sh: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh), state,
      _variable_shardings(state, mesh)))
  return model


def _variable_shardings(state, mesh):
  """`shd.state_shardings` as a tree of the state's own structure (NamedSharding leaves)."""
  is_var = lambda x: isinstance(x, nnx.Variable)
  return jax.tree.map(lambda v, sh: v.replace(sh), state, shd.state_shardings(state, mesh),
                      is_leaf=is_var)


def rollout_sampling(c: ml_collections.ConfigDict, mcfg, R: int):
  """The training rollouts' SamplingConfig (pi_roll: temperature, truncation, mismatch
  noise, what the rollout records for the learner)."""
  r = c.rollout
  return sampling_config(
      mcfg, max_new_tokens=R, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
      keep_full_logprobs=r.keep_full_logprobs, keep_topk_logprobs=r.keep_topk_logprobs,
      logit_noise=r.logit_noise, router_noise_scale=r.router_noise,
      record_routing=r.routing_replay)


def rollout_batching(c: ml_collections.ConfigDict) -> BatchingConfig:
  """How the training rollouts schedule their rows: rollout.slots decode at once (continuous
  batching), each problem's rl.group_size rollouts prefilled once; rollout.chunk, refill,
  bucket and tail as `BatchingConfig` says."""
  r = c.rollout
  return BatchingConfig(slots=r.slots, group_size=c.rl.group_size, chunk=r.chunk,
                        refill=r.refill, bucket=r.bucket, tail=r.tail)


def _abstract_prompts(n: int, on: jax.sharding.Mesh, *, P: int) -> tuple:
  """(prompt ids [n, P], lengths [n], key) as step.sample / step.evaluate pass them."""
  rep = NamedSharding(on, PartitionSpec())
  key = jax.eval_shape(lambda: jax.random.key(0))
  return (jax.ShapeDtypeStruct((n, P), jnp.int32, sharding=shd.batch_sharding(on, (n, P))),
          jax.ShapeDtypeStruct((n,), jnp.int32, sharding=rep),
          jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep))


def abstract_batch(c: ml_collections.ConfigDict, mcfg, lcfg: LearnerConfig,
                   mesh: jax.sharding.Mesh, n: int, *, T: int, with_ref: bool) -> LearnerBatch:
  """The learner batch of n rows step.rl_step builds from a rollout (step.score_rollout), as
  sharded ShapeDtypeStructs: the optional fields present exactly when the config fills them."""
  r = c.rollout

  def row(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=shd.batch_sharding(mesh, shape))
  k = r.keep_topk_logprobs
  n_moe = sum(mcfg.is_moe_layer(l) for l in range(mcfg.num_layers))
  return LearnerBatch(
      tokens=row((n, T), jnp.int32), segment_ids=row((n, T), jnp.int32),
      response_mask=row((n, T)), logp_roll=row((n, T)), advantages=row((n,)),
      logp_old=row((n, T)), token_weights=row((n, T)),
      evicted_at=(row((n, mcfg.num_layers, mcfg.num_kv_heads, T), jnp.int32)
                  if lcfg.learner_mode.replays_eviction else None),
      roll_logp_full=row((n, T, mcfg.vocab_size)) if r.keep_full_logprobs else None,
      roll_topk_logp=row((n, T, k)) if k else None,
      roll_topk_ids=row((n, T, k), jnp.int32) if k else None,
      logp_ref=row((n, T)) if with_ref else None,
      routed_experts=(row((n, n_moe, T, mcfg.num_experts_per_tok),
                          routing_dtype(mcfg.num_experts)) if r.routing_replay else None))


def _eval_programs(c: ml_collections.ConfigDict, graphdef: nnx.GraphDef, roll, cache,
                   mesh: jax.sharding.Mesh, state_a, resident, sizes: Sizes) -> dict:
  """step.evaluate's programs: greedy (and k > 1 samples per problem) in the learner's
  dtype, with the dense cache and, when the rollouts compress, the rollout's; each called
  on chunks of at most eval_batch_size rows."""
  k = c.eval_samples
  caches = {"": CacheConfig()}
  if cache.compresses:
    caches["_compressed"] = cache
  out = {}
  for suffix, cc in caches.items():
    for n in (1, k) if k > 1 else (1,):
      rows = sizes.eval_problems * n
      chunk = eval_chunk_rows(rows, c.eval_batch_size, shd.batch_shards(mesh))
      name = f"eval_{'greedy' if n == 1 else 'sampled'}{suffix}"
      out[name] = Program(
          name=name, fn=make_generate(graphdef, eval_sampling(roll, c, n), cc,
                                      c.model.attn_impl, merge=sampler_merge(c)),
          mesh=mesh, args=(state_a, *_abstract_prompts(chunk, mesh, P=sizes.P)),
          resident=resident, calls=-(-rows // chunk), per="evaluation",
          loop_bounds=functools.partial(decode_schedule, chunk, sizes.P, sizes.R, cc,
                                        BatchingConfig()))
  return out


def build(c: ml_collections.ConfigDict, model: nnx.Module, mesh: jax.sharding.Mesh,
          sampler_mesh: Optional[jax.sharding.Mesh], sizes: Sizes) -> Programs:
  """The run's programs for `model` (real, or `abstract_model`) placed on `mesh`; the sampler
  on `sampler_mesh` (mesh.rollout_devices), or colocated when None."""
  r, P, R = c.rollout, sizes.P, sizes.R
  T, B = P + R, c.rl.batch_size
  mcfg = model.config
  try:   # the resolved axis (mesh.expert = -1 included), against the model's experts
    config_lib.check_expert_mesh(dict(mesh.shape).get(shd.EXPERT, 1), mcfg.num_experts)
  except ConfigError as e:
    raise ConfigError(f"{e} (mesh {dict(mesh.shape)})") from None
  if r.routing_replay and not model.moe_layers:
    raise ConfigError(f"bad config value [rollout.routing_replay]: routing replay needs MoE "
                      f"layers; this {mcfg.model_type} model has none")
  graphdef, params, rest = lora.split(model)   # params: what is trained (LoRA: adapters)
  params_a, rest_a = abstract(params), abstract(rest)

  # --- learner: optimizer, score and update (rl.learner.make_learner) --------------------
  tx = make_optimizer(c)
  param_sh = jax.tree.map(lambda x: x.sharding, params)
  opt_sh = shd.opt_state_shardings(tx, params, mesh)
  opt_a = abstract(jax.eval_shape(tx.init, params_a), opt_sh)
  lcfg = learner_config(c, max_len=R)
  score, update = make_learner(graphdef, tx, lcfg, response_start=P,
                               state_shardings=(param_sh, opt_sh))
  fused = one_pass(lcfg, minibatches=c.rl.num_minibatches, epochs=c.rl.num_epochs)

  # --- sampler (pi_roll) ------------------------------------------------------------------
  roll = rollout_sampling(c, mcfg, R)
  to = DTYPES[r.dtype]
  roll_graphdef = sampler_graphdef(model, to)
  cache = cache_config(c)
  roll_mesh = sampler_mesh or mesh

  def narrow_a(tree, shardings):
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(
        x.shape, narrowed(x.dtype, to), sharding=sh), tree, shardings)

  # What the rollout reads: the learner's own arrays (colocated, k = 0), a stale version kept
  # in the sampler's dtype (rl.staleness > 0: step.TrainState.history), or the copy sent to
  # the sampler's devices in that dtype (step.to_sampler).
  sampler_param_sh = sampler_rest_sh = None
  if sampler_mesh is not None:
    sampler_param_sh = _variable_shardings(params, sampler_mesh)
    sampler_rest_sh = _variable_shardings(rest, sampler_mesh)
    roll_params = narrow_a(params_a, sampler_param_sh)
    roll_rest = abstract(rest_a, sampler_rest_sh)
  else:
    roll_params = narrow_a(params_a, param_sh) if c.rl.staleness else params_a
    roll_rest = rest_a
  prompts = functools.partial(_abstract_prompts, P=P)
  batch = functools.partial(abstract_batch, c, mcfg, lcfg, mesh, T=T)

  # Parameter copies the learner's devices hold besides params and opt_state: the frozen
  # reference policy (rl.kl_beta > 0) and the rl.staleness older versions (step.TrainState).
  kl = lcfg.kl_beta > 0
  extra = [params_a] * kl + [narrow_a(params_a, param_sh)] * int(c.rl.staleness)
  learner_resident = (opt_a, extra)
  full = batch(B, with_ref=False)
  mb = batch(B // c.rl.num_minibatches, with_ref=kl)

  programs = {}

  def add(name, fn, on, args, resident, calls, per="step", loop_bounds=None):
    programs[name] = Program(name=name, fn=fn, mesh=on, args=args, resident=resident,
                             calls=calls, per=per, loop_bounds=loop_bounds)

  # Disaggregated, the sampler's devices hold only what the program takes.
  merge = sampler_merge(c)
  add("rollout", make_generate(roll_graphdef, roll, cache, c.model.attn_impl,
                               rollout_batching(c), merge=merge), roll_mesh,
      (nnx.merge_state(roll_params, roll_rest), *prompts(B, roll_mesh)),
      learner_resident if sampler_mesh is None else (), 1,
      loop_bounds=functools.partial(decode_schedule, B, P, R, cache, rollout_batching(c)))
  score_program = Program(name="score", fn=score, mesh=mesh, args=(params_a, rest_a, full),
                          resident=learner_resident, calls=1 + kl)
  if fused:
    # One update per batch: scored inside it, from the update's own forward.
    add("score_update", make_score_update(
        graphdef, tx, lcfg, response_start=P, advantages=group_advantages(c),
        state_shardings=(param_sh, opt_sh)), mesh,
        (params_a, opt_a, rest_a, full, jax.ShapeDtypeStruct(
            (B,), jnp.float32, sharding=shd.batch_sharding(mesh, (B,)))), extra, 1)
  else:
    programs["score"] = score_program
    add("update", update, mesh, (params_a, opt_a, rest_a, mb), (full, extra),
        c.rl.num_minibatches * c.rl.num_epochs)

  # --- held-out evaluation (step.evaluate): learner dtype, dense and compressed caches --------
  if sizes.eval_problems:
    programs.update(_eval_programs(c, graphdef, roll, cache, mesh,
                                   nnx.merge_state(params_a, rest_a), learner_resident, sizes))
  return Programs(programs=programs, tx=tx, lcfg=lcfg, roll=roll, cache=cache,
                  graphdef=graphdef, roll_graphdef=roll_graphdef, sampler_dtype=to,
                  param_sh=param_sh,
                  opt_sh=opt_sh, sampler_param_sh=sampler_param_sh,
                  sampler_rest_sh=sampler_rest_sh,
                  sent_params=roll_params if sampler_mesh is not None else None,
                  score_alone=score_program if fused else None)


def device_bytes(tree) -> int:
  """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (or arrays)."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree) if x is not None)
