"""The trainer's programs compiled ahead of time for a named TPU slice or NVIDIA node, and
their per-device memory and roofline (the package docstring says what and how)."""
from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import re
import resource
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections

from trm_jax import config as config_lib
from trm_jax import programs as programs_lib
from trm_jax import sharding as shd
from trm_jax.aot import gpu as gpu_aot
from trm_jax.aot import hlo_cost
from trm_jax.aot import tpu as tpu_aot
from trm_jax.config import ConfigError
from trm_jax.kernels.attention import resolve_impl
from trm_jax.models import Decoder, ModelConfig, lora
from trm_jax.programs import device_bytes

GiB = 2**30

# Architecture fields of the published config.json files the paper configs train.
_QWEN3 = dict(model_type="qwen3", vocab_size=151936, num_attention_heads=32,
              num_key_value_heads=8, head_dim=128, num_hidden_layers=36, rms_norm_eps=1e-6,
              hidden_act="silu", attention_bias=False, bos_token_id=151643,
              eos_token_id=151645)
KNOWN_MODELS = {
    # huggingface.co/Qwen/Qwen3-8B/blob/main/config.json
    "Qwen3-8B": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, rope_theta=1000000.0,
                     tie_word_embeddings=False, max_position_embeddings=40960),
    # huggingface.co/Qwen/Qwen3-4B-Instruct-2507/blob/main/config.json
    "Qwen3-4B": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, rope_theta=5000000.0,
                     tie_word_embeddings=True, max_position_embeddings=262144),
    # huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json: 48 layers, every MLP a
    # 128-expert top-8 MoE (decoder_sparse_step 1, no mlp_only_layers), 4 kv heads
    "Qwen3-30B-A3B": dict(_QWEN3, model_type="qwen3_moe", hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_key_value_heads=4, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], rope_theta=1000000.0, tie_word_embeddings=False,
                          max_position_embeddings=40960),
}

# ------------------------------------------------------------------------------------------
# Inputs: model architecture, lengths, mesh
# ------------------------------------------------------------------------------------------
def resolve_model(c: ml_collections.ConfigDict, model: str = "",
                  config_path: str = "") -> tuple[dict, str]:
  """(HF config.json dict, where it came from); see the module docstring for the order."""
  def read(path: str) -> dict:
    if os.path.isdir(path):
      path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
      raise ConfigError(f"no HF config.json at {path} (expected a checkpoint directory or a "
                        "config.json file)")
    with open(path) as f:
      try:
        return json.load(f)
      except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e

  known = {k.lower(): k for k in KNOWN_MODELS}
  if model:
    if model.lower() in known:
      return dict(KNOWN_MODELS[known[model.lower()]]), f"{known[model.lower()]} (published config)"
    return read(model), model
  if c.model.path:
    return read(c.model.path), c.model.path
  stem = os.path.basename(config_path).lower()
  for name in KNOWN_MODELS:
    if name.lower().replace("-", "_") in stem:
      return dict(KNOWN_MODELS[name]), f"{name} (published config, named by {stem})"
  from trm_jax import warmup  # pylint: disable=g-import-not-at-top
  base = os.path.expanduser(c.warmup.cache_dir)
  if warmup.is_current(base, c):
    return read(base), f"warm-up base model {base}"
  if c.get("model", {}).get("arch"):
    # Not built yet: its architecture is the config's (model.arch over the synthetic
    # tokenizer), which is all a compile needs.
    import tempfile  # pylint: disable=g-import-not-at-top
    from trm_jax.data import synthetic  # pylint: disable=g-import-not-at-top
    with tempfile.TemporaryDirectory() as d:
      mcfg = warmup.base_model_config(c, synthetic.make_synthetic_tokenizer(d))
    return mcfg.to_hf(), "the warm-up base model's architecture (config.model.arch)"
  raise ConfigError("config.model.path is empty and the config names no warm-up "
                    f"architecture; pass --model with one of {', '.join(KNOWN_MODELS)}, a "
                    "checkpoint directory or a config.json")


def task_lengths(c: ml_collections.ConfigDict) -> tuple[int, int]:
  """(P, R): prompt bucket and new tokens, as `data.task.Task` sizes them."""
  t = c.task
  if t.max_prompt_len and t.max_new_tokens:
    return int(t.max_prompt_len), int(t.max_new_tokens)
  import tempfile  # pylint: disable=g-import-not-at-top
  from trm_jax.data import synthetic  # pylint: disable=g-import-not-at-top
  from trm_jax.data.task import Task  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as d:   # generated tasks only: file tasks set both
    task = Task(t, seed=c.seed, tokenizer=synthetic.make_synthetic_tokenizer(d),
                eval_problems=0)
  return task.max_prompt_len, task.max_new_tokens


def validate(c: ml_collections.ConfigDict) -> None:
  """`config.validate`, except that the data files need not exist (nothing is read)."""
  from trm_jax.data import tasks  # pylint: disable=g-import-not-at-top
  c = ml_collections.ConfigDict(c.to_dict())
  if tasks.reads_files(c.task.name):
    c.task.path = c.task.path or "(not read by trm_jax.aot)"
    if c.task.eval_name:
      c.task.eval_path = c.task.eval_path or "(not read by trm_jax.aot)"
  config_lib.validate(c)


# ------------------------------------------------------------------------------------------
# Abstract train state and programs
# ------------------------------------------------------------------------------------------
def meshes(c: ml_collections.ConfigDict, devices: Sequence):
  """(learner mesh, sampler mesh) as the trainer builds them (`train.make_mesh`): with
  mesh.rollout_devices = n > 0 the sampler gets the first n devices as a data-parallel mesh
  and the learner the config's (data, fsdp, expert, tensor) axes over the rest; else both
  share one."""
  n = int(c.mesh.get("rollout_devices", 0))
  axes = {k: v for k, v in c.mesh.items() if k != "rollout_devices"}
  if n >= len(devices):
    raise ConfigError(f"bad config value [mesh.rollout_devices]: {n} sampler devices leave "
                      f"none of the topology's {len(devices)} devices to the learner")
  try:
    learner = shd.mesh_from_config(axes, list(devices[n:]), key="mesh")
  except ValueError as e:
    raise ConfigError(str(e)) from e
  except NotImplementedError as e:   # jax.make_mesh: an axis no product of physical axes
    sizes = ", ".join(f"mesh.{k}={v}" for k, v in axes.items())
    raise ConfigError(f"{sizes} cannot be laid on the topology's physical axes without "
                      f"splitting one: {str(e).split('.')[0]}") from e
  return learner, (shd.make_mesh({"data": n}, list(devices[:n])) if n else learner)


@dataclasses.dataclass
class Setup:
  """The trainer's programs over abstract state on the topology's meshes."""
  mesh: jax.sharding.Mesh
  mcfg: ModelConfig
  P: int
  R: int
  impl: str                       # resolved attention impl
  programs: programs_lib.Programs
  sync: Optional[dict] = None     # disaggregated sampler: the parameter copy per rollout


def build(c: ml_collections.ConfigDict, hf: dict, devices: Sequence,
          platform: str = "tpu") -> Setup:
  """`programs.build` (what `step.make_context` builds for the trainer) over an abstract
  model sharded on the topology's devices. Only the platform differs from a host of that
  kind: attn_impl="auto" resolves as it would there ("tpu" or "gpu")."""
  mesh, sampler_mesh = meshes(c, devices)
  # As the trainer does right after building its meshes: a batch the mesh does not divide
  # would be replicated on every device.
  config_lib.check_batch_mesh(c, mesh, None if sampler_mesh is mesh else sampler_mesh)
  P, R = task_lengths(c)
  c = ml_collections.ConfigDict(c.to_dict())
  c.model.attn_impl = impl = resolve_impl(c.model.attn_impl, platform)
  try:
    mcfg = ModelConfig.from_hf(hf, dtype=programs_lib.DTYPES[c.model.dtype],
                               remat=c.model.remat, moe_chunk=c.model.moe_chunk)
  except ValueError as e:   # an unsupported or incomplete config.json: the user's input
    raise ConfigError(f"the model's config.json: {e}") from e
  mcfg = mcfg.replace(lora=programs_lib.lora_config(c))   # the trainer's add_adapters
  if mcfg.lora is not None:
    try:
      lora.check_targets(mcfg)
    except ValueError as e:
      raise ConfigError(f"bad config value [model.lora.targets]: {e}") from None
  model = programs_lib.abstract_model(Decoder, mcfg, mesh)
  progs = programs_lib.build(c, model, mesh, None if sampler_mesh is mesh else sampler_mesh,
                             programs_lib.Sizes(P=P, R=R, eval_problems=c.eval_problems))
  sync = None
  if progs.sent_params is not None:
    sent = progs.sent_params
    sync = {"bytes_per_rollout": sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                                     for x in jax.tree.leaves(sent)),
            "bytes_per_sampler_device": device_bytes(sent), "dtype": c.rollout.dtype,
            "sampler_devices": int(sampler_mesh.devices.size)}
  return Setup(mesh=mesh, mcfg=mcfg, P=P, R=R, impl=impl, programs=progs, sync=sync)


# ------------------------------------------------------------------------------------------
# Compile and measure
# ------------------------------------------------------------------------------------------
_OOM = re.compile(r"(?:required for HLO temporaries \(|Used )([\d.]+)([KMGT])")


def platform_of(topology: str) -> str:
  """"gpu" for a named NVIDIA node ("h200:8", "h100:2x8"), else "tpu"."""
  return "gpu" if topology.split(":", 1)[0].lower() in gpu_aot.GPUS else "tpu"


def measure(program: programs_lib.Program, *, chip, devices_per_chip: int,
            hlo_dir: str = "", mem_fraction: float = 1.0, kernel_flops: float = 0.0) -> dict:
  """Compiles one program and returns its row of the report; it fits when its bytes stay
  within `mem_fraction` of the chip's HBM (a GPU's jax preallocates a fraction of it).
  kernel_flops: FLOPs of kernels the compiled program's cost cannot see, added to it."""
  name = program.name
  hbm = int(chip.hbm_bytes * mem_fraction) // devices_per_chip
  peak = chip.peak_bf16_flops / devices_per_chip
  bw = chip.hbm_bytes_per_s / devices_per_chip
  row = {"program": name, "calls_per_step": program.calls, "per": program.per,
         "hbm_bytes": hbm, "resident_bytes": device_bytes(program.resident),
         "devices": int(program.mesh.devices.size)}
  t0 = time.time()
  try:
    lowered = program.lower()
    row["lower_s"] = round(time.time() - t0, 1)
    compiled = lowered.compile()
  except Exception as e:  # pylint: disable=broad-except
    msg = str(e)
    if "RESOURCE_EXHAUSTED" not in msg:
      raise
    line = next((l for l in msg.splitlines() if "RESOURCE_EXHAUSTED" in l), msg.splitlines()[0])
    row.update(compile_s=round(time.time() - t0, 1), fits=False, error=line.strip()[:400])
    m = _OOM.search(msg)
    if m:
      row["xla_required_bytes"] = int(float(m.group(1)) * 1024 ** "KMGT".index(m.group(2)) * 1024)
    return row
  row["compile_s"] = round(time.time() - t0, 1)
  row["host_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  del lowered
  mem = compiled.memory_analysis()
  row.update(argument_bytes=int(mem.argument_size_in_bytes),
             output_bytes=int(mem.output_size_in_bytes),
             alias_bytes=int(mem.alias_size_in_bytes),
             temp_bytes=int(mem.temp_size_in_bytes),
             code_bytes=int(mem.generated_code_size_in_bytes))
  row["total_bytes"] = (row["argument_bytes"] + row["output_bytes"] - row["alias_bytes"] +
                        row["temp_bytes"] + row["code_bytes"] + row["resident_bytes"])
  row["fits"] = row["total_bytes"] <= hbm
  text, xla = compiled.as_text(), compiled.cost_analysis()
  del compiled   # the executable is the largest object the host holds
  gc.collect()
  if hlo_dir:
    os.makedirs(hlo_dir, exist_ok=True)
    with open(os.path.join(hlo_dir, f"{name}.hlo.txt"), "w") as f:
      f.write(text)
  # The host replays the sampler's schedule for these bounds (O(rows) steps): only for a
  # program that compiled, once, and the report takes them from its row.
  bounds = program.loop_bounds and program.loop_bounds()
  if bounds:
    row["loop_bounds"] = bounds
  cost = hlo_cost.hlo_text_cost(text, bounds=bounds, xla=xla)
  cost["flops"] += kernel_flops
  cost["kernel_flops"] += kernel_flops
  row["collective_bytes"] = hlo_cost.collective_bytes(text, bounds=bounds)
  row.update(flops=cost["flops"], bytes_accessed=cost["bytes_accessed"],
             kernel_flops=cost["kernel_flops"], xla_flops=cost["xla_flops"],
             xla_bytes_accessed=cost["xla_bytes"], loops=cost["loops"],
             unbounded_loops=cost["unbounded"])
  t_compute, t_memory = cost["flops"] / peak, cost["bytes_accessed"] / bw
  row.update(roofline_s=max(t_compute, t_memory), compute_s=t_compute, memory_s=t_memory,
             bound="compute" if t_compute >= t_memory else "memory")
  return row


def compile_config(c: ml_collections.ConfigDict, topology: str, hf: dict, *,
                   programs: Optional[Sequence[str]] = None, hlo_dir: str = "",
                   gpu_mem_fraction: float = 0.75, log: Callable[[str], None] = print,
                   compile_one: Optional[Callable[[str], dict]] = None,
                   on_row: Optional[Callable[[dict], None]] = None) -> dict:
  """Compiles `programs` (default: every program the trainer runs for `c`) for `topology`,
  one at a time; returns the report (see main).

  compile_one(name) -> row compiles one program (`cli` runs each in a subprocess of its own,
  so that its host memory is released before the next); default `measure` in this process.
  on_row(report) gets the report after each program (`cli` writes it, so that a run cut
  short keeps the programs it finished)."""
  validate(c)
  platform = platform_of(topology)
  if platform == "gpu":
    chip = gpu_aot.gpu_spec(topology)
    try:
      devices = gpu_aot.topology_devices(topology)
    except RuntimeError as e:   # no CUDA plugin, or its topology factory is missing
      raise ConfigError(str(e)) from e
    per_chip = 1
  else:
    chip = tpu_aot.chip_spec(topology)
    try:
      devices = tpu_aot.topology_devices(topology)
    except jax.errors.JaxRuntimeError as e:   # libtpu refuses the shape (e.g. "v5e:3x3")
      raise ConfigError(f"topology {topology!r}: {str(e).splitlines()[0]}") from e
    per_chip = max(1, len(devices) // tpu_aot.topology_chips(topology))
  t0 = time.time()
  s = build(c, hf, devices, platform)
  names = tuple(s.programs.programs)
  unknown = [p for p in programs or () if p not in names]
  if unknown:
    raise ConfigError(f"unknown programs {unknown}; this config's trainer runs {names}")
  log(f"[aot] {topology}: {len(devices)} devices, mesh {dict(s.mesh.shape)}; model "
      f"L={s.mcfg.num_layers} D={s.mcfg.hidden_size} V={s.mcfg.vocab_size}; P={s.P} R={s.R}; "
      f"attention {s.impl}; programs {', '.join(names)}")
  if s.sync:
    log(f"[aot] sampler on {s.sync['sampler_devices']} devices of its own: each rollout copies "
        f"{s.sync['bytes_per_rollout'] / GiB:.2f} GiB of {s.sync['dtype']} parameters "
        f"({s.sync['bytes_per_sampler_device'] / GiB:.2f} GiB per sampler device)")
  mem_fraction = gpu_mem_fraction if platform == "gpu" else 1.0

  def measure_here(name: str) -> dict:
    moe = moe_analytic(c, s, s.programs[name])
    # On TPU the experts' grouped matmuls are Mosaic kernels (expert_parallel.grouped_matmul),
    # which XLA's cost analysis counts as 0 FLOPs: they are counted analytically.
    row = measure(s.programs[name], chip=chip, devices_per_chip=per_chip, hlo_dir=hlo_dir,
                  mem_fraction=mem_fraction,
                  kernel_flops=moe["grouped_matmul_flops"] if moe and platform == "tpu" else 0)
    row["all_to_all_analytic_bytes"] = moe and moe["all_to_all_bytes"]
    return row
  compile_one = compile_one or measure_here
  report = {
      "what": "per-device memory and loop-aware cost of the trainer's programs "
              "(programs.build), compiled ahead of time for a TPU slice or GPU node "
              "(trm_jax.aot)",
      "topology": topology, "platform": platform, "devices": len(devices),
      "devices_per_chip": per_chip,
      "gpu_mem_fraction": gpu_mem_fraction if platform == "gpu" else None,
      "chip": dataclasses.asdict(chip), "mesh": dict(s.mesh.shape),
      "model": dataclasses.asdict(s.mcfg), "P": s.P, "R": s.R, "attn_impl": s.impl,
      "config": json.loads(c.to_json_best_effort()),
      "jax_version": jax.__version__, "libtpu_version": package_version("libtpu"),
      "cuda_plugin_version": package_version("jax-cuda12-plugin"),
      "loop_bounds": {},   # program -> the bounds its row was costed with (measure)
      "loop_bounds_assume": SAMPLER_BOUND,
      "programs": [], "complete": False, "sync": s.sync,
      "sampler_mesh": dict(s.programs["rollout"].mesh.shape)}
  calls = {p.name: {"program": p.name, "calls_per_step": p.calls, "per": p.per}
           for p in s.programs}
  for name in programs or names:
    log(f"[aot] {name}: compiling ...")
    row = {**calls[name], **compile_one(name)}
    if "loop_bounds" in row:
      report["loop_bounds"][name] = row.pop("loop_bounds")
    log("[aot] " + describe(row))
    report["programs"].append(row)
    report.update(summary(report["programs"]), wall_s=round(time.time() - t0, 1))
    if on_row:
      on_row(report)
  report["complete"] = True
  return report


# What the sampler's data-dependent loops are counted with (sampler.decode_schedule).
SAMPLER_BOUND = ("the sampler's loops (decode steps, chunks per cache bucket) are counted on "
                 "the schedule in which every row decodes task.max_new_tokens tokens (no row "
                 "stops early): the most a rollout can generate")


def summary(rows: Sequence[dict]) -> dict:
  """fits, the roofline of one step and of one evaluation (each program's bound times its
  calls; only when every row fits), and the collective bytes of one step, of the rows
  compiled so far."""
  fit = all(r.get("fits") is True for r in rows)

  def roofline(per: str):
    return (sum(r["roofline_s"] * r["calls_per_step"] for r in rows if r["per"] == per)
            if fit and any(r["per"] == per for r in rows) else None)

  def per_step(field):
    """A per-call figure summed over the step's programs times their calls (None where a
    step program lacks it: not compiled, or no expert parallelism)."""
    step = [r for r in rows if r["per"] == "step"]
    if not step or any(r.get(field) is None for r in step):
      return None
    if isinstance(step[0][field], dict):
      kinds = sorted({k for r in step for k in r[field]})
      return {k: sum(r[field].get(k, 0.0) * r["calls_per_step"] for r in step) for k in kinds}
    return sum(r[field] * r["calls_per_step"] for r in step)
  return {"fits": fit, "failed": [r["program"] for r in rows if "failed" in r],
          "step_roofline_s": roofline("step"), "evaluation_roofline_s": roofline("evaluation"),
          "collective_bytes_per_step": per_step("collective_bytes"),
          "all_to_all_analytic_bytes_per_step": per_step("all_to_all_analytic_bytes")}


def moe_analytic(c: ml_collections.ConfigDict, s: Setup,
                 program: programs_lib.Program) -> Optional[dict]:
  """One call of `program`'s expert-parallel MoE work per device, counted analytically with
  balanced routing; None without expert parallelism (mesh.expert = 1 or a dense model).

  Every MoE pass routes each token's k pairs: the all-to-all sends D values per pair to its
  expert and back (`all_to_all_bytes`: tokens x k x D x bytes x 2), and the grouped SwiGLU
  runs 3 matmuls of 2 x D x F FLOPs per pair (`grouped_matmul_flops`; a backward pass twice
  that). The tokens are split over the mesh's batch shards; the update's passes are forward
  and backward (plus the recomputed forward with model.remat), as are score_update's (it
  scores from the update's forward), the sampler's tokens its prefill and every row decoding
  max_new_tokens."""
  mesh, mcfg = program.mesh, s.mcfg
  if not mcfg.num_experts or dict(mesh.shape).get(shd.EXPERT, 1) == 1:
    return None
  n_moe = sum(mcfg.is_moe_layer(l) for l in range(mcfg.num_layers))
  if program.name in ("score", "update", "score_update"):
    # the LearnerBatch: score's and update's last argument, score_update's fourth (rewards last)
    batch = program.args[3] if program.name == "score_update" else program.args[-1]
    tokens = math.prod(batch.tokens.shape)
    fwd, bwd = (1, 0) if program.name == "score" else (1 + mcfg.remat, 1)
    dtype = programs_lib.DTYPES[c.model.dtype]
  else:   # a sampler: prefill once per group of rows sharing a prompt, then R - 1 steps
    rows, P = program.args[1].shape
    group = c.rl.group_size if program.name == "rollout" else 1
    tokens, fwd, bwd = rows // group * P + rows * (s.R - 1), 1, 0
    dtype = programs_lib.DTYPES[c.rollout.dtype if program.name == "rollout" else c.model.dtype]
  pairs = tokens / shd.batch_shards(mesh) * mcfg.num_experts_per_tok * n_moe
  return {"all_to_all_bytes": pairs * mcfg.hidden_size * jnp.dtype(dtype).itemsize * 2 *
                              (fwd + bwd),
          "grouped_matmul_flops": pairs * 3 * 2 * mcfg.hidden_size *
                                  mcfg.moe_intermediate_size * (fwd + 2 * bwd)}


def describe(row: dict) -> str:
  name = row["program"]
  if "failed" in row:
    return f"{name}: NOT COMPILED: {row['failed']}"
  if "error" in row:
    return f"{name}: does NOT fit: {row['error']} ({row['compile_s']}s)"
  fit = "fits" if row["fits"] else "does NOT fit"
  return (f"{name}: {row['total_bytes'] / GiB:.2f} of {row['hbm_bytes'] / GiB:.1f} GiB per "
          f"device, {fit} (args {row['argument_bytes'] / GiB:.2f}, out "
          f"{row['output_bytes'] / GiB:.2f}, donated {row['alias_bytes'] / GiB:.2f}, temp "
          f"{row['temp_bytes'] / GiB:.2f}, code {row['code_bytes'] / GiB:.2f}, resident "
          f"{row['resident_bytes'] / GiB:.2f}); {row['flops'] / 1e12:.1f} TFLOP, "
          f"{row['bytes_accessed'] / 1e9:.1f} GB accessed -> roofline {row['roofline_s']:.3g} "
          f"s ({row['bound']}-bound) x {row['calls_per_step']} per {row['per']}; compiled in "
          f"{row['compile_s']}s, host peak {row['host_peak_rss_bytes'] / GiB:.1f} GiB"
          + _describe_collectives(row))


def _describe_collectives(row: dict) -> str:
  coll = row.get("collective_bytes") or {}
  if not coll:
    return ""
  out = "; collectives " + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in sorted(coll.items()))
  if row.get("all_to_all_analytic_bytes") is not None:
    out += f" (MoE all-to-all analytic {row['all_to_all_analytic_bytes'] / 1e9:.2f} GB)"
  return out


def package_version(package: str) -> str:
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  try:
    return metadata.version(package)
  except metadata.PackageNotFoundError:
    return "unknown"
