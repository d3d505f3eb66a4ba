"""The SMD learner step: compiled temporary memory vs T, and step time vs plain GRPO.

Two measurements of `trm_jax.rl.learner.make_learner(...)`'s `update`, side by side in one run
(the memory and overhead figures of docs/results.md, "Learner"):

  memory   `jit(update).lower(...).compile().memory_analysis().temp_size_in_bytes` at each T
           in --lengths (B = 1, a narrow model, nothing executed; shapes only). Variants:
             kernel_shadow     mode "smd": masked track through the Pallas kernel with the
                               rollout's evicted_at, plus the dense stop-gradient teacher
             kernel_causal     the same step (both tracks, distillation) with plain causal
                               visibility through the same kernel
             reference_shadow  kernel_shadow's step through the XLA reference attention,
                               which materialises [B, K, G, T, S] logits and the dense mask
             reference_causal  the reference with causal visibility
           On CPU (`peak_memory_in_bytes` counts only arguments and outputs there, so
           temporaries are the honest figure) the kernel can only run through the Pallas
           interpreter: its numbers are XLA's buffers for the interpreter's loop over blocks,
           not Triton's. Any buffer of the optimised HLO with two dimensions >= T is listed
           under `quadratic_buffers`, so a [T, T] materialisation outside the kernel (in the
           learner's own code) would be named there; `full_vocab_buffers` lists any buffer
           holding logits for the whole sequence ([.., T, V]), which the chunked vocabulary
           projection (`rl/token_terms.py`) exists to avoid.
  time     median wall time of one `update` call after warm-up, on this machine, reference
           attention (what CPU runs), for mode "off" (plain GRPO: one track), "smd" (masked
           track + dense teacher + full-vocabulary distillation) and "smd" with lam = 0
           (masked track only, to split the overhead). Calls are interleaved so that machine
           load affects every variant alike.
  flops    throughput of the plain-GRPO `update` at the rollout bench's model shape (Qwen3, 4
           layers, d 512, 8/4 heads, F 1536, vocab 32000; B 8, T 256, prompt 128): FLOPs of
           the compiled step (`hlo_cost.program_cost`: `cost_analysis()` with every loop trip
           counted) over its median wall time, against
           the machine's fp32 matmul peak measured in the same run (the best of square
           matmuls of a few sizes), so the fraction is a same-run ratio. Every timed call
           records the load and other processes' CPU time (`bench.hygiene`); a contended
           measurement is flagged, not reported as the result.

  python -m bench.learner [--quick] [--out bench/results/learner.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from bench import hygiene
from trm_jax.aot import hlo_cost
from trm_jax.kernels.visibility import NEVER_EVICTED
from trm_jax.models import Decoder, ModelConfig
from trm_jax.rl.learner import LearnerBatch, LearnerConfig, make_learner

# Model: narrow (the claim is about T), GQA 2:1, two layers; V moderate so the chunked
# vocabulary projection is part of the picture but does not dominate.
MEM_MODEL = dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=32, vocab_size=1024)
TIME_MODEL = dict(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=64, vocab_size=4096)


def _abstract_batch(B: int, T: int, L: int, K: int, shadow: bool) -> LearnerBatch:
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  return LearnerBatch(tokens=i32(B, T), segment_ids=i32(B, T), response_mask=f32(B, T),
                      logp_roll=f32(B, T), advantages=f32(B), logp_old=f32(B, T),
                      token_weights=f32(B, T), evicted_at=i32(B, L, K, T) if shadow else None)


def _quadratic_buffers(hlo: str, T: int) -> list[str]:
  """Distinct array shapes in the HLO with at least two dimensions >= T."""
  out = set()
  for dt, dims in re.findall(r"\b([a-z]+[0-9]*)\[([0-9,]+)\]", hlo):
    d = [int(x) for x in dims.split(",") if x]
    if sum(x >= T for x in d) >= 2:
      out.add(f"{dt}[{','.join(map(str, d))}]")
  return sorted(out)


def _full_vocab_buffers(hlo: str, T: int, V: int) -> list[str]:
  """Distinct array shapes holding a whole sequence of logits: a dimension V and one of
  T - 1 or more (the chunked projection should leave only [B, C, V] chunks)."""
  out = set()
  for dt, dims in re.findall(r"\b([a-z]+[0-9]*)\[([0-9,]+)\]", hlo):
    d = [int(x) for x in dims.split(",") if x]
    if V in d and any(x >= T - 1 and x != V for x in d):
      out.add(f"{dt}[{','.join(map(str, d))}]")
  return sorted(out)


def measure_memory(T: int, *, B: int, chunk: int) -> dict:
  abstract = nnx.eval_shape(lambda: Decoder(ModelConfig(**MEM_MODEL), rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  tx = optax.adamw(1e-4)
  opt_state = jax.eval_shape(tx.init, params)
  cfg = abstract.config
  row = {"T": T}
  for impl, attn in (("kernel", "pallas_interpret"), ("reference", "reference")):
    for shadow in (True, False):
      name = f"{impl}_{'shadow' if shadow else 'causal'}"
      lcfg = LearnerConfig(mode="smd", mode_kwargs=(("lam", 0.1),), chunk=chunk, attn_impl=attn)
      _, update = make_learner(graphdef, tx, lcfg, response_start=T // 4)
      batch = _abstract_batch(B, T, cfg.num_layers, cfg.num_kv_heads, shadow)
      t0 = time.perf_counter()
      compiled = update.lower(params, opt_state, rest, batch).compile()
      mem = compiled.memory_analysis()
      hlo = compiled.as_text()
      row[name] = {"temp_bytes": int(mem.temp_size_in_bytes),
                   "argument_bytes": int(mem.argument_size_in_bytes),
                   "output_bytes": int(mem.output_size_in_bytes),
                   "compile_s": round(time.perf_counter() - t0, 2),
                   "quadratic_buffers": _quadratic_buffers(hlo, T),
                   "full_vocab_buffers": _full_vocab_buffers(hlo, T, cfg.vocab_size)}
      print(f"T={T:5d} {name:17s} temp {mem.temp_size_in_bytes / 2**20:9.2f} MiB  "
            f"quadratic {row[name]['quadratic_buffers'][:3]} "
            f"[T, V] {row[name]['full_vocab_buffers'][:3]}", flush=True)
  row["one_NxTxT_f32_bytes"] = B * cfg.num_heads * T * T * 4
  row["one_BxTxV_f32_bytes"] = B * T * cfg.vocab_size * 4
  return row


def _concrete_batch(key, B: int, T: int, P: int, L: int, K: int, V: int, ratio: float):
  """A rollout-shaped batch: left-padded prompts of mixed lengths, full-length responses, and
  an eviction record in which a fraction `ratio` of keys leave the cache at a random later
  query (what a sequence-scope policy produces)."""
  ks = jax.random.split(key, 5)
  lens = jax.random.randint(ks[0], (B,), P // 2, P + 1)
  idx = jnp.arange(T)[None]
  seg = ((idx >= P - lens[:, None])).astype(jnp.int32)
  tokens = jax.random.randint(ks[1], (B, T), 3, V) * seg
  resp = (idx >= P).astype(jnp.float32) * jnp.ones((B, 1))
  j = jnp.arange(T)[None, None, None]
  evict = jax.random.uniform(ks[2], (B, L, K, T)) < ratio
  when = j + 1 + jax.random.randint(ks[3], (B, L, K, T), 0, T)
  evicted_at = jnp.where(evict & (when < T), when, NEVER_EVICTED).astype(jnp.int32)
  logp = -jax.random.uniform(ks[4], (B, T)) * 5 * resp
  return LearnerBatch(tokens=tokens, segment_ids=seg, response_mask=resp, logp_roll=logp,
                      advantages=jax.random.normal(ks[4], (B,)), logp_old=logp,
                      token_weights=jnp.ones((B, T)), evicted_at=evicted_at)


def measure_time(*, B: int, T: int, chunk: int, repeats: int, warmup: int) -> dict:
  model = Decoder(ModelConfig(**TIME_MODEL), rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  cfg = model.config
  P = T // 4
  batch = _concrete_batch(jax.random.key(0), B, T, P, cfg.num_layers, cfg.num_kv_heads,
                          cfg.vocab_size, ratio=0.5)
  tx = optax.adamw(1e-6)
  variants = {"grpo_off": LearnerConfig(mode="off", chunk=chunk, attn_impl="reference"),
              "smd": LearnerConfig(mode="smd", mode_kwargs=(("lam", 0.1),), chunk=chunk,
                                   attn_impl="reference"),
              "smd_masked_only": LearnerConfig(mode="smd", mode_kwargs=(("lam", 0.0),),
                                               chunk=chunk, attn_impl="reference")}
  state, fns, times, compile_s = {}, {}, {}, {}
  for name, lcfg in variants.items():
    fns[name] = make_learner(graphdef, tx, lcfg, response_start=P)[1]
    p = jax.tree.map(jnp.copy, params)
    t0 = time.perf_counter()
    p, o, aux = fns[name](p, tx.init(p), rest, batch)
    jax.block_until_ready(aux)
    compile_s[name] = round(time.perf_counter() - t0, 2)
    state[name] = (p, o)
    times[name] = []
  for it in range(warmup + repeats):
    for name in variants:              # interleaved: load drifts hit every variant alike
      p, o = state[name]
      t0 = time.perf_counter()
      p, o, aux = fns[name](p, o, rest, batch)
      jax.block_until_ready((p, o, aux))
      if it >= warmup:
        times[name].append(time.perf_counter() - t0)
      state[name] = (p, o)
  med = {n: statistics.median(v) for n, v in times.items()}
  print({n: f"{v * 1e3:.1f} ms" for n, v in med.items()}, flush=True)
  return {"B": B, "T": T, "P": P, "model": TIME_MODEL, "attn_impl": "reference",
          "repeats": repeats, "warmup": warmup, "first_call_s": compile_s,
          "median_s": {n: round(v, 5) for n, v in med.items()},
          "all_s": {n: [round(x, 5) for x in v] for n, v in times.items()},
          "smd_over_grpo": round(med["smd"] / med["grpo_off"], 4),
          "smd_masked_only_over_grpo": round(med["smd_masked_only"] / med["grpo_off"], 4)}


# The rollout bench's model (bench/rollout.py ARCH) in trm_jax terms.
FLOPS_MODEL = dict(hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8,
                   num_kv_heads=4, head_dim=64, vocab_size=32000)


def matmul_peak(repeats: int = 5) -> dict:
  """Best fp32 FLOP/s of square matmuls (n = 512, 1024, 2048) on this machine, now."""
  out, best = {}, 0.0
  for n in (512, 1024, 2048):
    a = jnp.asarray(jax.random.normal(jax.random.key(n), (n, n)), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    jax.block_until_ready(f(a))
    probes = []
    for _ in range(repeats):
      probes.append(hygiene.timed(lambda: jax.block_until_ready(f(a)))[1])
    t = min(p["wall_s"] for p in probes)
    out[f"n{n}_gflops"] = round(2 * n ** 3 / t / 1e9, 2)
    out[f"n{n}_contended"] = any(p["contended"] for p in probes)
    best = max(best, 2 * n ** 3 / t)
  out["peak_gflops"] = round(best / 1e9, 2)
  return out


def measure_flops(*, B: int = 8, T: int = 256, P: int = 128, chunk: int = 128,
                  repeats: int = 5, rounds: int = 2) -> dict:
  """FLOP/s of plain GRPO's update step at the bench shape vs the fp32 matmul peak."""
  model = Decoder(ModelConfig(**FLOPS_MODEL), rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  cfg = model.config
  batch = _concrete_batch(jax.random.key(0), B, T, P, cfg.num_layers, cfg.num_kv_heads,
                          cfg.vocab_size, ratio=0.0)
  batch = batch.replace(evicted_at=None)
  tx = optax.adamw(1e-6)
  _, update = make_learner(graphdef, tx, LearnerConfig(mode="off", chunk=chunk,
                                                       attn_impl="reference"),
                           response_start=P)
  opt = tx.init(params)
  compiled = update.lower(params, opt, rest, batch).compile()
  # Loop-aware: cost_analysis() counts the chunked vocabulary projection's loop body once.
  cost = hlo_cost.program_cost(compiled)
  flops = cost["flops"]
  p, o = jax.tree.map(jnp.copy, params), tx.init(params)
  p, o, aux = update(p, o, rest, batch)                     # warm-up
  jax.block_until_ready(aux)
  out_rounds = []
  for rnd in range(rounds):
    peak = matmul_peak()
    probes = []
    for _ in range(repeats):
      t, info, (p, o, aux) = hygiene.timed(
          lambda: jax.block_until_ready(update(p, o, rest, batch)))
      probes.append(info)
    med = statistics.median(i["wall_s"] for i in probes)
    contended = (any(i["contended"] for i in probes)
                 or any(v for k, v in peak.items() if k.endswith("_contended")))
    out_rounds.append(dict(
        round=rnd, contended=contended, step_s=round(med, 4),
        gflops_per_s=round(flops / med / 1e9, 2), matmul_peak=peak,
        fraction_of_peak=round(flops / med / (peak["peak_gflops"] * 1e9), 4),
        calls=[dict(wall_s=i["wall_s"], other_cores=i["other_cores"],
                    contended=i["contended"]) for i in probes]))
    print(f"learner flops round {rnd}: {'CONTENDED' if contended else 'quiet'} "
          f"{out_rounds[-1]['gflops_per_s']} GFLOP/s, peak {peak['peak_gflops']}, "
          f"fraction {out_rounds[-1]['fraction_of_peak']}", flush=True)
  quiet = [r["fraction_of_peak"] for r in out_rounds if not r["contended"]]
  return dict(B=B, T=T, P=P, model=FLOPS_MODEL, mode="off (plain GRPO)", chunk=chunk,
              attn_impl="reference", step_flops=flops, xla_cost_analysis_flops=cost["xla_flops"],
              loops=[{k: l[k] for k in ("trips", "trips_source", "body_flops")}
                     for l in cost["loops"]], rounds=out_rounds,
              fraction_of_peak_quiet=quiet, target_fraction=0.4)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="bench/results/learner.json")
  p.add_argument("--quick", action="store_true",
                 help="fewer timing repeats and a shorter timing sequence (a few minutes)")
  p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
  p.add_argument("--chunk", type=int, default=128, help="LearnerConfig.chunk")
  p.add_argument("--time-batch", type=int, default=4)
  p.add_argument("--time-length", type=int, default=None)
  p.add_argument("--only-flops", action="store_true",
                 help="run only the FLOP/s measurement and update that section of --out")
  args = p.parse_args(argv)
  if args.only_flops:
    flops = measure_flops()
    result = {}
    if os.path.exists(args.out):
      with open(args.out) as f:
        result = json.load(f)
    result["flops"] = flops
    result.setdefault("targets_met", {})["update_step_fraction_of_fp32_matmul_peak >= 0.4"] = (
        bool(flops["fraction_of_peak_quiet"]) and min(flops["fraction_of_peak_quiet"]) >= 0.4
        if flops["fraction_of_peak_quiet"] else None)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)
    print(json.dumps({k: flops[k] for k in ("step_flops", "fraction_of_peak_quiet")}))
    return
  time_T = args.time_length or (256 if args.quick else 512)
  repeats, warmup = (5, 1) if args.quick else (10, 2)

  rows = [measure_memory(T, B=1, chunk=args.chunk) for T in args.lengths]
  by_t = {r["T"]: r for r in rows}
  ratio = lambda a, b: round(a / b, 4) if b else None
  summary = {}
  lo, hi = min(by_t), max(by_t)
  if hi == 2 * lo:
    for name in ("kernel_shadow", "kernel_causal", "reference_shadow", "reference_causal"):
      summary[f"{name}_T{hi}_over_T{lo}"] = ratio(by_t[hi][name]["temp_bytes"],
                                                  by_t[lo][name]["temp_bytes"])
  r = by_t[hi]
  summary[f"kernel_shadow_over_kernel_causal_T{hi}"] = ratio(
      r["kernel_shadow"]["temp_bytes"], r["kernel_causal"]["temp_bytes"])
  summary[f"reference_shadow_over_kernel_shadow_T{hi}"] = ratio(
      r["reference_shadow"]["temp_bytes"], r["kernel_shadow"]["temp_bytes"])
  for key in ("quadratic_buffers", "full_vocab_buffers"):
    summary[f"kernel_{key}"] = sorted({
        s for row in rows for n in ("kernel_shadow", "kernel_causal") for s in row[n][key]})

  timing = measure_time(B=args.time_batch, T=time_T, chunk=args.chunk, repeats=repeats,
                        warmup=warmup)
  flops = measure_flops(repeats=3 if args.quick else 5)
  summary["step_time_smd_over_grpo"] = timing["smd_over_grpo"]
  targets = {"kernel_shadow_T4096_over_T2048 <= 2.3": None,
             "kernel_shadow_over_kernel_causal_T4096 <= 1.15": None,
             "step_time_smd_over_grpo <= 1.5": timing["smd_over_grpo"] <= 1.5,
             "update_step_fraction_of_fp32_matmul_peak >= 0.4": (
                 min(flops["fraction_of_peak_quiet"]) >= 0.4
                 if flops["fraction_of_peak_quiet"] else None)}
  if "kernel_shadow_T4096_over_T2048" in summary:
    targets["kernel_shadow_T4096_over_T2048 <= 2.3"] = (
        summary["kernel_shadow_T4096_over_T2048"] <= 2.3)
  if "kernel_shadow_over_kernel_causal_T4096" in summary:
    targets["kernel_shadow_over_kernel_causal_T4096 <= 1.15"] = (
        summary["kernel_shadow_over_kernel_causal_T4096"] <= 1.15)

  result = {
      "what": ("learner update step (make_learner(...)[1]): compiled temp_size_in_bytes vs T, "
               "and median step time SMD vs plain GRPO"),
      "backend": jax.default_backend(),
      "kernel_mode": "interpret" if jax.default_backend() == "cpu" else "compiled",
      "note": ("On CPU the Pallas kernel is lowered through the interpreter: its temporaries "
               "are XLA buffers of the interpreter's block loop, not GPU SRAM tiles. Step "
               "times are wall-clock on a shared CPU machine, reference attention."),
      "jax_version": jax.__version__,
      "python": platform.python_version(),
      "quick": args.quick,
      "memory": {"B": 1, "model": MEM_MODEL, "chunk": args.chunk, "mode": "smd, lam=0.1",
                 "optimizer": "adamw", "rows": rows},
      "time": timing,
      "flops": flops,
      "summary": summary,
      "targets_met": targets,
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(json.dumps({"summary": summary, "targets_met": targets}, indent=2))
  print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
  main()
