"""GPU check of the visibility-aware flash kernel: real Triton compile, correctness, timings.

Run from the repository root on a CUDA machine (one H200 is the target; < 4 minutes):

  # pip install -U "jax[cuda12]==<the repo's jax version, 0.10.2>" flax   # if jax lacks CUDA
  python -m bench.gpu_kernel_check                    # writes $OUT/gpu_kernel_check.json
  python -m bench.gpu_kernel_check results.json       # or to an explicit path
  python -m bench.gpu_kernel_check --interpret        # CPU smoke test at tiny sizes

Sections of the JSON:
  checks   per configuration: the kernel's forward output and (dq, dk, dv) for a random
           cotangent vs `attention_reference` evaluated in fp32 at HIGHEST matmul precision
           (XLA's default on GPU is TF32 for fp32 dots, which would make the reference the
           less accurate side). max |err| and max |ref| per tensor, pass/fail at the stated
           tolerance, compiled temp bytes.
  timings  per configuration: kernel (shadow visibility and plain causal) vs the XLA
           reference, forward and forward+backward, median and min of --iters runs after
           --warmup runs, each run ended by block_until_ready; compile seconds; temp bytes.
  errors   a configuration that fails to compile or run is recorded with its traceback and
           the script moves on; the JSON is rewritten after every configuration, so a run
           killed by a time limit still leaves everything finished before it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from trm_jax.kernels.attention_ref import attention_reference
from trm_jax.kernels.flash_attention import BlockSizes, flash_attention
from trm_jax.kernels.visibility import NEVER_EVICTED, LayerVisibility

# (name, B, T, N, K, H, dtype, padding, eviction, BlockSizes); tolerances below by dtype.
FULL_CHECKS = [
    ("causal_T256_H64", 2, 256, 4, 4, 64, "float32", "none", "none", BlockSizes()),
    ("ragged_gqa2_T512", 2, 512, 4, 2, 64, "float32", "left", "mixed", BlockSizes()),
    ("odd_T1000_H80_gqa4", 1, 1000, 8, 2, 80, "float32", "right", "mixed",
     BlockSizes(64, 32, 32, 32)),
    ("gqa4_T2048_H128", 1, 2048, 8, 2, 128, "float32", "right", "mixed",
     BlockSizes(64, 64, 32, 32)),
    ("bf16_gqa4_T4096_H128", 1, 4096, 8, 2, 128, "bfloat16", "right", "window",
     BlockSizes(128, 64, 64, 64)),
]
TINY_CHECKS = [
    ("tiny_causal", 1, 64, 2, 2, 16, "float32", "none", "none", BlockSizes(16, 16, 16, 16)),
    ("tiny_ragged_gqa2", 2, 80, 4, 2, 16, "float32", "left", "mixed",
     BlockSizes(32, 16, 16, 32)),
    ("tiny_bf16_gqa4", 1, 64, 8, 2, 32, "bfloat16", "right", "window",
     BlockSizes(32, 32, 16, 16)),
]
# Timings: a Qwen3-4B-like layer (32 query heads, 8 kv heads, H = 128), bf16.
FULL_TIMINGS = [
    ("qwen3_4b_T2048", 1, 2048, 32, 8, 128, "bfloat16", "right", "mixed",
     BlockSizes(64, 64, 32, 32)),
    ("qwen3_4b_T4096", 1, 4096, 32, 8, 128, "bfloat16", "right", "mixed",
     BlockSizes(64, 64, 32, 32)),
    ("qwen3_4b_T4096_big_blocks", 1, 4096, 32, 8, 128, "bfloat16", "right", "mixed",
     BlockSizes(128, 64, 64, 64)),
]
TINY_TIMINGS = [
    ("tiny_timing", 1, 64, 4, 2, 16, "float32", "right", "mixed", BlockSizes(16, 16, 16, 16)),
]
# max |kernel - reference| / max(1, max |reference|) allowed, per dtype: (output, grads).
TOLERANCE = {"float32": (1e-5, 1e-4), "bfloat16": (2e-2, 5e-2)}


def make_inputs(B, T, N, K, H, dtype, padding, eviction, seed=0):
  """Random q, k, v, dO and a visibility of the requested kind (numpy rng, then device)."""
  rng = np.random.default_rng(seed)
  q, k, v, do = (rng.standard_normal(s).astype(np.float32)
                 for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)))
  idx = np.arange(T)
  lengths = np.maximum(T - (np.arange(B) * T) // 3, 1)            # row 0 full, others ragged
  if padding == "none":
    seg = None
  elif padding == "left":
    seg = (idx[None] >= T - lengths[:, None]).astype(np.int32)
  else:
    seg = (idx[None] < lengths[:, None]).astype(np.int32)
  j = np.broadcast_to(idx, (B, K, T))
  if eviction == "mixed":   # never / at prompt_len / right after creation / later step
    prompt_len = T // 4
    kind = rng.integers(0, 4, size=(B, K, T))
    later = j + 1 + (rng.random((B, K, T)) * (T - j)).astype(np.int64)
    ev = np.select([kind == 0, kind == 1, kind == 2],
                   [np.full_like(j, NEVER_EVICTED),
                    np.where(j < prompt_len, prompt_len, NEVER_EVICTED), j + 1], later)
  elif eviction == "window":  # recent-window cache of T // 8 keys
    ev = j + max(T // 8, 1)
  else:
    ev = None
  vis = LayerVisibility(
      segment_ids=None if seg is None else jnp.asarray(seg),
      evicted_at=None if ev is None else jnp.asarray(ev.astype(np.int32)))
  cast = lambda x: jnp.asarray(x, dtype)
  return cast(q), cast(k), cast(v), cast(do), vis


def vjp_fn(attn):
  """(q, k, v, vis, dO) -> (out, dq, dk, dv) through `attn(q, k, v, vis)`."""
  def f(q, k, v, vis, do):
    out, pullback = jax.vjp(lambda q, k, v: attn(q, k, v, vis), q, k, v)
    return (out, *pullback(do))
  return f


def compile_and_time(fn, args, warmup, iters):
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - t0
  temp = compiled.memory_analysis()
  temp = None if temp is None else int(temp.temp_size_in_bytes)
  out = None
  for _ in range(warmup):
    out = jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  stats = {"compile_s": round(compile_s, 3), "temp_bytes": temp,
           "median_ms": round(statistics.median(times), 4) if times else None,
           "min_ms": round(min(times), 4) if times else None, "iters": iters}
  return out, stats


def run_check(cfg, interpret):
  name, B, T, N, K, H, dtype, padding, eviction, blocks = cfg
  q, k, v, do, vis = make_inputs(B, T, N, K, H, jnp.dtype(dtype), padding, eviction)
  kern = vjp_fn(lambda q, k, v, vis: flash_attention(q, k, v, vis, block_sizes=blocks,
                                                      interpret=interpret))
  got, stats = compile_and_time(kern, (q, k, v, vis, do), warmup=1, iters=0)
  up = lambda x: x.astype(jnp.float32)
  with jax.default_matmul_precision("highest"):
    want = jax.jit(vjp_fn(attention_reference))(up(q), up(k), up(v), vis, up(do))
  tol_out, tol_grad = TOLERANCE[dtype]
  rec = {"shape": dict(B=B, T=T, N=N, K=K, H=H), "dtype": dtype, "padding": padding,
         "eviction": eviction, "blocks": vars(blocks), "compile_s": stats["compile_s"],
         "temp_bytes": stats["temp_bytes"], "tensors": {}, "passed": True}
  for tname, g, w, tol in zip(("out", "dq", "dk", "dv"), got, want,
                              (tol_out, tol_grad, tol_grad, tol_grad)):
    g = np.asarray(up(g))
    w = np.asarray(w)
    err = float(np.max(np.abs(g - w)))
    ref_max = float(np.max(np.abs(w)))
    ok = bool(np.all(np.isfinite(g))) and err <= tol * max(1.0, ref_max)
    rec["tensors"][tname] = {"max_abs_err": err, "max_abs_ref": ref_max, "tol": tol,
                             "passed": ok}
    rec["passed"] &= ok
  return rec


def run_timing(cfg, interpret, warmup, iters):
  name, B, T, N, K, H, dtype, padding, eviction, blocks = cfg
  q, k, v, do, vis = make_inputs(B, T, N, K, H, jnp.dtype(dtype), padding, eviction)
  kernel = lambda q, k, v, vis: flash_attention(q, k, v, vis, block_sizes=blocks,
                                                interpret=interpret)
  causal = lambda q, k, v, vis: flash_attention(q, k, v, None, block_sizes=blocks,
                                                interpret=interpret)
  rec = {"shape": dict(B=B, T=T, N=N, K=K, H=H), "dtype": dtype, "blocks": vars(blocks)}
  for impl_name, attn in (("kernel_shadow", kernel), ("kernel_causal", causal),
                          ("reference_shadow", attention_reference)):
    for mode, fn in (("fwd", lambda q, k, v, vis, do, a=attn: a(q, k, v, vis)),
                     ("fwd_bwd", vjp_fn(attn))):
      key = f"{impl_name}_{mode}"
      try:
        _, rec[key] = compile_and_time(fn, (q, k, v, vis, do), warmup, iters)
      except Exception as e:  # one failing variant must not hide the others
        rec[key] = {"error": f"{type(e).__name__}: {e}"[:2000],
                    "traceback": traceback.format_exc()[-4000:]}
  for mode in ("fwd", "fwd_bwd"):
    kt = rec.get(f"kernel_shadow_{mode}", {}).get("median_ms")
    rt = rec.get(f"reference_shadow_{mode}", {}).get("median_ms")
    if kt and rt:
      rec[f"speedup_{mode}_reference_over_kernel"] = round(rt / kt, 3)
  return rec


def main(argv=None):
  p = argparse.ArgumentParser(description="GPU check of the flash attention kernel")
  p.add_argument("out", nargs="?", default=None,
                 help="JSON path (default $OUT/gpu_kernel_check.json, else bench/results/)")
  p.add_argument("--interpret", action="store_true",
                 help="Pallas interpret mode at tiny sizes (CPU smoke test)")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--budget-s", type=float, default=170.0,
                 help="skip remaining configurations once this much time has passed")
  args = p.parse_args(argv)
  out_path = args.out or os.path.join(
      os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"),
      "gpu_kernel_check.json")
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  start = time.perf_counter()
  result = {
      "backend": jax.default_backend(),
      "devices": [str(d) for d in jax.devices()],
      "device_kind": jax.devices()[0].device_kind,
      "jax_version": jax.__version__,
      "python": platform.python_version(),
      "interpret": args.interpret,
      "checks": {}, "timings": {}, "errors": {}, "skipped": [],
  }

  def save():
    result["elapsed_s"] = round(time.perf_counter() - start, 2)
    with open(out_path, "w") as f:
      json.dump(result, f, indent=2)

  if jax.default_backend() != "gpu" and not args.interpret:
    result["errors"]["setup"] = ("no GPU backend (jax.default_backend() = "
                                 f"{jax.default_backend()!r}); install jax[cuda12] or pass "
                                 "--interpret for the CPU smoke test")
    save()
    print(result["errors"]["setup"], file=sys.stderr)
    return 1
  checks = TINY_CHECKS if args.interpret else FULL_CHECKS
  timings = TINY_TIMINGS if args.interpret else FULL_TIMINGS
  iters = 3 if args.interpret else args.iters
  warmup = 1 if args.interpret else args.warmup
  jobs = ([("checks", c, lambda c=c: run_check(c, args.interpret)) for c in checks]
          + [("timings", c, lambda c=c: run_timing(c, args.interpret, warmup, iters))
             for c in timings])
  for section, cfg, job in jobs:
    name = cfg[0]
    if time.perf_counter() - start > args.budget_s:
      result["skipped"].append(name)
      continue
    t0 = time.perf_counter()
    try:
      result[section][name] = job()
      result[section][name]["wall_s"] = round(time.perf_counter() - t0, 2)
    except Exception as e:  # record and move on: later configurations may still compile
      result["errors"][name] = {"error": f"{type(e).__name__}: {e}"[:2000],
                                "traceback": traceback.format_exc()[-4000:]}
    print(f"[{time.perf_counter() - start:7.1f}s] {section}/{name}: "
          f"{'ERROR' if name in result['errors'] else 'done'}", flush=True)
    save()
  result["timing_variant_errors"] = sorted(
      f"{name}/{key}" for name, rec in result["timings"].items() for key, val in rec.items()
      if isinstance(val, dict) and "error" in val)
  result["all_checks_passed"] = (not result["errors"] and not result["skipped"]
                                 and not result["timing_variant_errors"]
                                 and all(c["passed"] for c in result["checks"].values()))
  save()
  print(json.dumps({k: result[k] for k in ("all_checks_passed", "skipped", "elapsed_s")}))
  print(f"wrote {out_path}", file=sys.stderr)
  return 0 if result["all_checks_passed"] else 1


if __name__ == "__main__":
  sys.exit(main())
