"""Learner-step scaling on 1, 2, 4, 8 simulated CPU devices: throughput and compiled memory.

For each device count n and layout, a fresh process (XLA_FLAGS sets the simulated device count
before jax starts) builds a tiny decoder, places it on the mesh the way the trainer does
(`step.init_learner_state`, `sharding.put_batch`), and:
  * compiles `update` (the learner's jitted minibatch step) and reads
    `compile().memory_analysis()`: arguments + outputs - aliased (donated) + temporaries, the
    per-device footprint of the SPMD-partitioned program;
  * times `--steps` updates after one warm-up call: sequences and tokens per second.

Layouts: `data` (mesh data=n: the batch is split, weights and AdamW moments replicated) and
`fsdp` (mesh fsdp=n: batch and weights split; the embedding dimension D is sharded, so the
per-device state shrinks like 1/n). The global batch is fixed (strong scaling).

On a CPU the simulated devices share the host's cores: throughput there says how well the
partitioned program keeps those cores busy (one device runs mostly single-threaded ops, so it
can rise from 1 to 2 devices) and is noisy on a shared machine; the trend that transfers is the
memory per device and the fact that every layout compiles and runs. The step is compiled
outside `jax.set_mesh`, i.e. without the decoder's block-boundary activation constraints that
the trainer turns on: the layout inside the step is XLA's propagation from the inputs.

  python -m bench.scaling [--out bench/results/scaling.json] [--counts 1,2,4,8]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

MODEL = dict(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=32, vocab_size=128, tie_word_embeddings=True)
B, P, R = 16, 16, 48  # global batch, prompt length, response length (T = P + R = 64)


def _worker(n: int, layout: str, steps: int) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from trm_jax import sharding as shd  # pylint: disable=g-import-not-at-top
  from trm_jax import step  # pylint: disable=g-import-not-at-top
  from trm_jax.models import Decoder, ModelConfig  # pylint: disable=g-import-not-at-top
  from trm_jax.rl import optim  # pylint: disable=g-import-not-at-top
  from trm_jax.rl import learner  # pylint: disable=g-import-not-at-top

  mesh = shd.mesh_from_config({layout: -1}, jax.devices()[:n])
  model = shd.shard_model(Decoder(ModelConfig(**MODEL), rngs=nnx.Rngs(0)), mesh)
  tx = optim.make_optimizer(lr=1e-4, warmup_steps=1, total_steps=100, weight_decay=0.0, b1=0.9,
                            b2=0.99, eps=1e-8, clip_norm=1.0, min_lr_ratio=0.1)
  graphdef, params, rest, opt_state, state_sh = step.init_learner_state(model, tx, mesh)
  cfg = learner.LearnerConfig(objective="trm_surrogate", loss_agg="seq-mean-token-mean",
                              criteria=("k3_avg",), thresholds=(("delta_k3", 1.0),), chunk=16)
  _, update = learner.make_learner(graphdef, tx, cfg, response_start=P, state_shardings=state_sh)

  rng = np.random.default_rng(0)
  T = P + R
  resp = np.broadcast_to(np.arange(T)[None] >= P, (B, T)).astype(np.float32)
  logp_roll = (-rng.uniform(0.5, 4.0, (B, T)) * resp).astype(np.float32)
  batch = shd.put_batch(learner.LearnerBatch(
      tokens=rng.integers(3, MODEL["vocab_size"], (B, T)).astype(np.int32),
      segment_ids=np.ones((B, T), np.int32), response_mask=resp, logp_roll=logp_roll,
      advantages=rng.normal(size=B).astype(np.float32), logp_old=logp_roll,
      token_weights=resp), mesh)

  t0 = time.perf_counter()
  compiled = update.lower(params, opt_state, rest, batch).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  params, opt_state, aux = update(params, opt_state, rest, batch)  # warm-up (and cache)
  jax.block_until_ready(params)
  t0 = time.perf_counter()
  for _ in range(steps):
    params, opt_state, aux = update(params, opt_state, rest, batch)
  jax.block_until_ready((params, opt_state, aux))
  dt = time.perf_counter() - t0
  per_device = (mem.argument_size_in_bytes + mem.output_size_in_bytes -
                mem.alias_size_in_bytes + mem.temp_size_in_bytes)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  shard = jax.tree.leaves(params)[0].addressable_shards[0].data.shape
  return {"devices": n, "layout": layout, "mesh": dict(mesh.shape),
          "step_s": dt / steps, "seqs_per_s": B * steps / dt, "tokens_per_s": B * T * steps / dt,
          "compile_s": compile_s,
          "memory_per_device_bytes": {
              "total": per_device, "arguments": mem.argument_size_in_bytes,
              "outputs": mem.output_size_in_bytes, "aliased": mem.alias_size_in_bytes,
              "temporaries": mem.temp_size_in_bytes},
          "params": n_params, "first_param_shard_shape": list(shard),
          "skipped": float(aux["learner/skipped"])}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="bench/results/scaling.json")
  ap.add_argument("--counts", default="1,2,4,8")
  ap.add_argument("--layouts", default="data,fsdp")
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--timeout", type=int, default=900, help="seconds per worker process")
  ap.add_argument("--worker", nargs=2, metavar=("N", "LAYOUT"), help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.worker:
    print(json.dumps(_worker(int(args.worker[0]), args.worker[1], args.steps)))
    return

  rows = []
  for n in (int(x) for x in args.counts.split(",")):
    for layout in args.layouts.split(","):
      env = dict(os.environ, JAX_PLATFORMS="cpu",
                 XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
      p = subprocess.run([sys.executable, __file__, "--worker", str(n), layout,
                          "--steps", str(args.steps)], env=env, capture_output=True, text=True,
                         timeout=args.timeout)
      if p.returncode:
        sys.exit(f"worker n={n} layout={layout} failed:\n{p.stderr[-3000:]}")
      row = json.loads(p.stdout.strip().splitlines()[-1])
      rows.append(row)
      m = row["memory_per_device_bytes"]
      print(f"n={n} {layout:5s} step {row['step_s'] * 1e3:8.1f} ms  "
            f"{row['tokens_per_s']:9.0f} tok/s  memory/device {m['total'] / 2**20:7.2f} MiB "
            f"(args {m['arguments'] / 2**20:.2f}, temps {m['temporaries'] / 2**20:.2f})",
            flush=True)
  result = {"what": "learner update (trm_surrogate, k3_avg mask) of a tiny decoder, fixed "
                    "global batch, per simulated CPU device count",
            "model": MODEL, "batch": {"B": B, "P": P, "R": R}, "steps_timed": args.steps,
            "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "note": "simulated devices share the host's cores (a shared, loaded machine): "
                    "throughput is noisy and bounded by the cores; memory per device is the "
                    "compiled per-partition footprint",
            "rows": rows}
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
