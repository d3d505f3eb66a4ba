"""LoRA's cost in the two programs it changes: the sampler (merged or not) and the update.

  python -m bench.lora [--quick] [--out bench/results/lora.json]

Sampler. pi_theta = base + adapters can be sampled two ways:
  unmerged  the rollout program over the base and the adapters (what the trainer runs:
            every projection adds (alpha / r) B (A x), models/lora.py);
  merged    once per update W' = W + (alpha / r) A B for every adapted weight (one jitted
            merge, timed), then the rollout program of the plain model over W'.
Per shape, one rollout batch each way, calls interleaved over --repeats rounds, medians; the
merged figure is its rollout plus one merge (one update's worth). The shapes: the main job's
(configs/tiny_trm.py's architecture, rows, prompt and response lengths, slots; bf16 sampler
over fp32 weights) and the rollout bench's model (bench/rollout.py: Qwen3, 4 layers, d 512,
vocab 32000; 8 rows, prompt 128, 128 new tokens, bf16). Rank 8 on every projection; random
weights, EOS off, so every row decodes every step.

Update. The learner's update step (make_learner, plain GRPO, reference attention), full
fine-tuning against LoRA rank 8, interleaved, at both shapes (the main job's batch and
lengths; the bench model at 8 rows of 256 tokens).

Every timed call records the load and other processes' CPU time (`bench.hygiene`); the JSON
says which rounds were contended, and the commit it was produced at. At the 8B shapes the
two sampler programs are compared by their AOT rooflines (docs/lora.md).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from bench import hygiene  # noqa: E402
from trm_jax import config as config_lib  # noqa: E402
from trm_jax import programs  # noqa: E402
from trm_jax.aot import compiler as aot  # noqa: E402
from trm_jax.models import Decoder, ModelConfig, lora  # noqa: E402
from trm_jax.models.config import LoraConfig  # noqa: E402
from trm_jax.rl.learner import LearnerBatch, LearnerConfig, make_learner  # noqa: E402
from trm_jax.rollout import BatchingConfig, CacheConfig, SamplingConfig  # noqa: E402
from trm_jax.rollout import generate_from_state, sampler_graphdef  # noqa: E402

RANK = 8
BENCH_MODEL = dict(model_type="qwen3", vocab_size=32000, hidden_size=512, intermediate_size=1536,
                   num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64)


def main_job_shape() -> dict:
  """The main job's architecture (its warm-up model over the synthetic tokenizer), rows,
  lengths and slots, from configs/tiny_trm.py."""
  c = config_lib.load_config("tiny_trm")
  hf, _ = aot.resolve_model(c)
  P, R = aot.task_lengths(c)
  return dict(name="main_job", model=ModelConfig.from_hf(hf), B=c.rl.batch_size, P=P, R=R,
              batching=programs.rollout_batching(c), T_update=P + R)


def bench_shape() -> dict:
  return dict(name="bench_model", model=ModelConfig(**BENCH_MODEL), B=8, P=128, R=128,
              batching=BatchingConfig(), T_update=256)


def _models(cfg: ModelConfig):
  """(plain model, the same base with rank-RANK adapters whose B is random)."""
  plain = Decoder(cfg, rngs=nnx.Rngs(0))
  adapted = lora.with_adapters(plain, LoraConfig(rank=RANK), seed=0)
  rng = np.random.default_rng(0)
  for path, v in nnx.to_flat_state(nnx.state(adapted, nnx.LoRAParam)):
    if path[-1] == "b":
      v.set_value(jnp.asarray(0.02 * rng.standard_normal(v.shape), jnp.float32))
  return plain, adapted


def _merge_program(adapted, dtype=None, out_shardings=None):
  """(one jitted merge of every adapted weight: {path: W + (alpha / r) A B in `dtype`
  (default: the weight's)}, its input {path: (W, A, B)}); lora.merge_weight, what
  lora.merged computes per weight."""
  lcfg = adapted.config.lora
  triples = {}
  for l, target, block, name, _ in lora.projections(adapted.config):
    module = getattr(adapted.layers[l], block)
    adapter = getattr(module, f"{name}_lora")
    triples[(l, block, name)] = (getattr(module, name).get_value(), adapter.a.get_value(),
                                 adapter.b.get_value())
  fn = jax.jit(lambda t: {k: lora.merge_weight(w, None, a, b, base_quant="none",
                                                scale=lcfg.scale, dtype=dtype or w.dtype)
                          for k, (w, a, b) in t.items()}, out_shardings=out_shardings)
  return fn, triples


def sampler(shape: dict, repeats: int) -> dict:
  plain, adapted = _models(shape["model"])
  V, B, P, R = shape["model"].vocab_size, shape["B"], shape["P"], shape["R"]
  g = shape["batching"].group_size          # a group's rows share their prompt
  ids = jnp.asarray(np.repeat(np.random.default_rng(1).integers(3, V, (B // g, P)), g, 0),
                    jnp.int32)
  lens = jnp.full((B,), P, jnp.int32)
  scfg = SamplingConfig(max_new_tokens=R, eos_ids=())
  run = {}
  for name, model in (("unmerged", adapted), ("merged", lora.merged(adapted))):
    graphdef, state = sampler_graphdef(model, jnp.bfloat16), nnx.state(model)
    run[name] = (lambda g=graphdef, s=state: generate_from_state(
        g, s, ids, lens, key=jax.random.key(0), sampling_config=scfg,
        cache_config=CacheConfig(), batching=shape["batching"]).tokens)
  merge, triples = _merge_program(adapted)
  run["merge"] = lambda: merge(triples)
  for fn in run.values():
    jax.block_until_ready(fn())                      # compile
  calls = {n: [] for n in run}
  for _ in range(repeats):
    for n, fn in run.items():                         # interleaved: load hits all alike
      calls[n].append(hygiene.timed(lambda fn=fn: jax.block_until_ready(fn()))[1])
  med = {n: statistics.median(c["wall_s"] for c in v) for n, v in calls.items()}
  out = dict(shape=shape["name"], B=B, P=P, R=R, model=shape["model"].to_hf(), rank=RANK,
             median_s={n: round(v, 5) for n, v in med.items()},
             unmerged_over_merged_plus_merge=round(
                 med["unmerged"] / (med["merged"] + med["merge"]), 4),
             contended_calls={n: sum(c["contended"] for c in v) for n, v in calls.items()},
             calls={n: [dict(wall_s=c["wall_s"], other_cores=c["other_cores"])
                        for c in v] for n, v in calls.items()})
  print(f"sampler {shape['name']}: {out['median_s']} unmerged / (merged + merge) = "
        f"{out['unmerged_over_merged_plus_merge']}", flush=True)
  return out


def update(shape: dict, repeats: int) -> dict:
  plain, adapted = _models(shape["model"])
  B, T, V = shape["B"], shape["T_update"], shape["model"].vocab_size
  P = T // 2
  rng = np.random.default_rng(2)
  resp = (np.arange(T)[None] >= P).astype(np.float32).repeat(B, 0)
  batch = LearnerBatch(
      tokens=jnp.asarray(rng.integers(3, V, (B, T)), jnp.int32),
      segment_ids=jnp.ones((B, T), jnp.int32), response_mask=jnp.asarray(resp),
      logp_roll=jnp.asarray(-rng.random((B, T)), jnp.float32),
      advantages=jnp.asarray(rng.standard_normal(B), jnp.float32),
      logp_old=jnp.asarray(-rng.random((B, T)), jnp.float32),
      token_weights=jnp.ones((B, T), jnp.float32))
  tx = optax.adamw(1e-6)
  lcfg = LearnerConfig(mode="off", chunk=min(128, T), attn_impl="reference")
  state, fns = {}, {}
  for name, model in (("full", plain), ("lora", adapted)):
    graphdef, params, rest = lora.split(model)
    params = jax.tree.map(jnp.copy, params)    # the update donates them; the models share
    fns[name] = (make_learner(graphdef, tx, lcfg, response_start=P)[1], rest)
    p, o, aux = fns[name][0](params, tx.init(params), rest, batch)   # compile
    jax.block_until_ready(aux)
    state[name] = (p, o)
  calls = {n: [] for n in fns}
  for _ in range(repeats):
    for n, (fn, rest) in fns.items():
      p, o = state[n]
      _, info, (p, o, aux) = hygiene.timed(
          lambda: jax.block_until_ready(fn(p, o, rest, batch)))
      state[n] = (p, o)
      calls[n].append(info)
  med = {n: statistics.median(c["wall_s"] for c in v) for n, v in calls.items()}
  out = dict(shape=shape["name"], B=B, T=T, rank=RANK,
             median_s={n: round(v, 5) for n, v in med.items()},
             lora_over_full=round(med["lora"] / med["full"], 4),
             contended_calls={n: sum(c["contended"] for c in v) for n, v in calls.items()})
  print(f"update {shape['name']}: {out['median_s']} lora / full = {out['lora_over_full']}",
        flush=True)
  return out


def merge_roofline(topology: str, config: str = "qwen3_8b_dapo_trm", rank: int = 64) -> dict:
  """What merging costs per update at a paper config's shapes: the merge program (every
  adapted weight W + (alpha / r) A B, in the sampler's dtype, placed as the weight) compiled
  for `topology` over the abstract model the trainer would build (`aot.compiler.build`'s
  model and mesh), its per-device bytes and roofline (`hlo_cost`), and the second copy of
  the weights it leaves on the sampler's devices. The rollout programs themselves come from
  `python -m trm_jax.aot` of the config with and without adapters (docs/lora.md)."""
  from trm_jax.aot import gpu as gpu_aot, hlo_cost, tpu as tpu_aot  # pylint: disable=g-import-not-at-top
  c = config_lib.load_config(config)
  c.model.lora.rank = rank
  hf, _ = aot.resolve_model(c, config_path=config)
  gpu = aot.platform_of(topology) == "gpu"
  devices = (gpu_aot.topology_devices if gpu else tpu_aot.topology_devices)(topology)
  chip = gpu_aot.gpu_spec(topology) if gpu else tpu_aot.chip_spec(topology)
  per_chip = 1 if gpu else max(1, len(devices) // tpu_aot.topology_chips(topology))
  mesh, _ = aot.meshes(c, devices)
  mcfg = ModelConfig.from_hf(hf, dtype=programs.DTYPES[c.model.dtype]).replace(
      lora=programs.lora_config(c))
  model = programs.abstract_model(Decoder, mcfg, mesh)
  to = programs.DTYPES[c.rollout.dtype]
  _, triples = _merge_program(model)
  fn, _ = _merge_program(model, to, {k: w.sharding for k, (w, _, _) in triples.items()})
  with jax.set_mesh(mesh):
    compiled = fn.lower(triples).compile()
  cost = hlo_cost.program_cost(compiled)
  bw = chip.hbm_bytes_per_s / per_chip
  merged_bytes = programs.device_bytes({k: jax.ShapeDtypeStruct(w.shape, to, sharding=w.sharding)
                                        for k, (w, _, _) in triples.items()})
  out = dict(topology=topology, config=config, rank=rank, devices=len(devices),
             mesh=dict(mesh.shape), bytes_accessed_per_device=cost["bytes_accessed"],
             flops_per_device=cost["flops"],
             roofline_s=max(cost["bytes_accessed"] / bw,
                            cost["flops"] / (chip.peak_bf16_flops / per_chip)),
             merged_copy_bytes_per_device=merged_bytes)
  print(f"merge {topology}: {out['roofline_s']:.4f} s, a merged copy of "
        f"{merged_bytes / 2**30:.2f} GiB per device", flush=True)
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--quick", action="store_true", help="the main job's shape only, 3 rounds")
  p.add_argument("--out", default="bench/results/lora.json")
  p.add_argument("--merge_topology", action="append", default=[],
                 help="also compile the 8B config's merge program for this TPU slice or GPU "
                      "node (e.g. v5e:2x4, h200:1); repeatable")
  args = p.parse_args(argv)
  repeats = 3 if args.quick else args.repeats
  shapes = [main_job_shape()] + ([] if args.quick else [bench_shape()])
  quiet = hygiene.wait_for_quiet()
  commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
  result = dict(what="LoRA's sampler merged vs unmerged, and the update step LoRA vs full "
                "fine-tuning (bench/lora.py)", commit=commit, machine=hygiene.machine(),
                start=quiet, jax_version=jax.__version__,
                sampler=[sampler(s, repeats) for s in shapes],
                update=[update(s, repeats) for s in shapes],
                merge_aot=[merge_roofline(t) for t in args.merge_topology])
  hygiene.write_json(result, args.out)


if __name__ == "__main__":
  sys.exit(main())
