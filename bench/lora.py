"""LoRA's cost in the two programs it changes: the sampler (merged or not) and the update.

  python -m bench.lora [--quick] [--out bench/results/lora.json]

Sampler. pi_theta = base + adapters can be sampled two ways (`model.lora.sampler`), both
the trainer's own sampler programs (`rollout.sampler.make_generate`):
  unmerged  over the base and the adapters: every projection adds (alpha / r) B (A x)
            (models/lora.py);
  merged    the same program with `merge=lora.merged_sampler_state`: it first computes
            W' = W + (alpha / r) A B for every adapted weight, then samples the plain model.
Per shape, one rollout batch each way, calls interleaved over --repeats rounds, medians. The
shapes: the main job's (configs/tiny_trm.py's architecture, rows, prompt and response
lengths, slots; bf16 sampler over fp32 weights) and the rollout bench's model
(bench/rollout.py: Qwen3, 4 layers, d 512, vocab 32000; 8 rows, prompt 128, 128 new tokens,
bf16). Rank 8 on every projection; random weights, EOS off, so every row decodes every step.

Update. The learner's update step (make_learner, plain GRPO, reference attention), full
fine-tuning against LoRA rank 8, interleaved, at both shapes (the main job's batch and
lengths; the bench model at 8 rows of 256 tokens).

Every timed call records the load and other processes' CPU time (`bench.hygiene`); the JSON
says which rounds were contended, and the commit it was produced at. At a paper config's
shapes the two sampler programs are compared by `python -m trm_jax.aot` with
`--config.model.lora.sampler=merged` and without (docs/lora.md).
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
from trm_jax.rollout import sampler_graphdef  # noqa: E402
from trm_jax.rollout.sampler import make_generate  # noqa: E402

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


def sampler(shape: dict, repeats: int) -> dict:
  _, adapted = _models(shape["model"])
  V, B, P, R = shape["model"].vocab_size, shape["B"], shape["P"], shape["R"]
  g = shape["batching"].group_size          # a group's rows share their prompt
  ids = jnp.asarray(np.repeat(np.random.default_rng(1).integers(3, V, (B // g, P)), g, 0),
                    jnp.int32)
  lens = jnp.full((B,), P, jnp.int32)
  scfg = SamplingConfig(max_new_tokens=R, eos_ids=())
  graphdef, state = sampler_graphdef(adapted, jnp.bfloat16), nnx.state(adapted)
  run = {}
  for name, merge in (("unmerged", None), ("merged", lora.merged_sampler_state)):
    fn = make_generate(graphdef, scfg, CacheConfig(), batching=shape["batching"], merge=merge)
    run[name] = lambda fn=fn: fn(state, ids, lens, jax.random.key(0)).tokens
  for fn in run.values():
    jax.block_until_ready(fn())                      # compile
  calls = {n: [] for n in run}
  for _ in range(repeats):
    for n, fn in run.items():                         # interleaved: load hits all alike
      calls[n].append(hygiene.timed(lambda fn=fn: jax.block_until_ready(fn()))[1])
  med = {n: statistics.median(c["wall_s"] for c in v) for n, v in calls.items()}
  out = dict(shape=shape["name"], B=B, P=P, R=R, model=shape["model"].to_hf(), rank=RANK,
             median_s={n: round(v, 5) for n, v in med.items()},
             unmerged_over_merged=round(med["unmerged"] / med["merged"], 4),
             contended_calls={n: sum(c["contended"] for c in v) for n, v in calls.items()},
             calls={n: [dict(wall_s=c["wall_s"], other_cores=c["other_cores"])
                        for c in v] for n, v in calls.items()})
  print(f"sampler {shape['name']}: {out['median_s']} unmerged / merged = "
        f"{out['unmerged_over_merged']}", flush=True)
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


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--quick", action="store_true", help="the main job's shape only, 3 rounds")
  p.add_argument("--out", default="bench/results/lora.json")
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
                update=[update(s, repeats) for s in shapes])
  hygiene.write_json(result, args.out)


if __name__ == "__main__":
  sys.exit(main())
