"""A GPU day in one command: the Triton kernel, the tiny trainers, learner MFU, sampler tokens/s.

Run from the repository root on a CUDA host (one H200 is the target; under 8 minutes):

  # pip install -U "jax[cuda12]==<the repo's jax, 0.10.2>" flax   # if jax lacks CUDA
  python -m bench.gpu_day                       # writes $OUT/gpu_day.json, else bench/results/
  python -m bench.gpu_day --out results.json    # or to an explicit path
  python -m bench.gpu_day --allow_cpu --tiny    # CPU smoke test (2-3 min): tiny shapes, the
                                                #   kernel through the Pallas interpreter;
                                                #   writes /tmp/gpu_day_cpu.json by default

Without a GPU backend it exits 2 with one line unless --allow_cpu is given. Never run in CI.

Sections of the JSON (each with its wall_s; a section that fails is recorded with its traceback
and the script moves on; the JSON is rewritten after every item, so a run killed by a time
limit keeps everything finished before it; items past --budget_s are listed under `skipped`):
  kernel    the Triton kernel (`flash_attention`, impl "pallas") forward and (dq, dk, dv) for a
            random cotangent against `attention_reference` in fp32 at HIGHEST matmul precision
            on the same (rounded) inputs, bf16 and fp32: synthetic visibilities (ragged
            padding, GQA, odd T and H, mixed and window eviction) and the `evicted_at` records
            that real rollouts of every cache policy write (snapkv, h2o, recent, random at
            ratio 0.5, as tests/test_kernels_tpu.py builds them). Max abs errors, max |ref|,
            pass/fail at a per-dtype tolerance.
  train     configs tiny_trm and tiny_smd trained for 20 steps through `trm_jax.train.run`
            with model.attn_impl="pallas" (the warm-up base model is built first, its time
            reported apart): loop wall time, final metrics, held-out evaluation.
  learner   the plain-GRPO learner update step (`make_learner`, bf16 compute, fp32 params,
            AdamW) at a 0.5B-parameter Qwen3-like shape: FLOPs of the compiled step
            (`trm_jax.aot.hlo_cost.program_cost`, loops and the Triton attention kernels counted)
            over its median time, and MFU against the H200's dense bf16 peak.
  decode    the Triton decode kernel (`decode_attention`, what "auto" decodes with on a GPU)
            against `kv_cache.attend`'s einsums on a cache whose rows are filled to ragged
            depths (geometric, mean ~1/8 of the capacity, one row full, holes): max abs error
            per dtype, then both timed at a Qwen3-8B decode shape (64 rows, 8 kv heads x 4,
            H 128, 8192 slots, bf16), ragged and all rows full (median of 20 after 3 warm-ups).
  sampler   `trm_jax.rollout.generate` new tokens/s, bf16, 256 rows x 512 new tokens after
            128-token prompts, no EOS: end to end (B N / t(N)) and decode (B (N-1) / (t(N) -
            t(1))).
  kernel_timing  last (the first to fall to the budget): kernel (shadow visibility and plain
            causal) vs the XLA reference at a Qwen3-4B-like layer (32/8 heads, H 128, T 4096,
            bf16), forward and forward+backward, median and min of 20 runs after 3 warm-ups.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

# NVIDIA H200 datasheet (https://www.nvidia.com/en-us/data-center/h200/): "BF16 Tensor Core
# 1,979 TFLOPS" is with 2:4 sparsity; dense bf16 is half, 989 TFLOP/s (trm_jax/aot/gpu.py).
H200_PEAK_BF16_FLOPS = 989e12

# ---------------------------------------------------------------------------------------------
# (a) the kernel against the reference
# ---------------------------------------------------------------------------------------------

# (name, B, T, N, K, H, dtype, padding, eviction, BlockSizes args); tolerances below by dtype.
FULL_CHECKS = [
    ("causal_T256_H64", 2, 256, 4, 4, 64, "float32", "none", "none", ()),
    ("ragged_gqa2_T512", 2, 512, 4, 2, 64, "float32", "left", "mixed", ()),
    ("odd_T1000_H80_gqa4", 1, 1000, 8, 2, 80, "float32", "right", "mixed", (64, 32, 32, 32)),
    ("gqa4_T2048_H128", 1, 2048, 8, 2, 128, "float32", "right", "mixed", (64, 64, 32, 32)),
    ("bf16_ragged_gqa2_T512", 2, 512, 4, 2, 64, "bfloat16", "left", "mixed", ()),
    ("bf16_gqa4_T4096_H128", 1, 4096, 8, 2, 128, "bfloat16", "right", "window",
     (128, 64, 64, 64)),
]
TINY_CHECKS = [
    ("tiny_causal", 1, 64, 2, 2, 16, "float32", "none", "none", (16, 16, 16, 16)),
    ("tiny_ragged_gqa2", 2, 80, 4, 2, 16, "float32", "left", "mixed", (32, 16, 16, 32)),
    ("tiny_bf16_gqa4", 1, 64, 8, 2, 32, "bfloat16", "right", "window", (32, 32, 16, 16)),
]
# Timings: a Qwen3-4B-like layer (32 query heads, 8 kv heads, H = 128), bf16.
FULL_TIMINGS = [
    ("qwen3_4b_T4096", 1, 4096, 32, 8, 128, "bfloat16", "right", "mixed", (64, 64, 32, 32)),
]
TINY_TIMINGS = [
    ("tiny_timing", 1, 64, 4, 2, 16, "float32", "right", "mixed", (16, 16, 16, 16)),
]
POLICIES = ("snapkv", "h2o", "recent", "random")
# max |kernel - reference| / max(1, max |reference|) allowed, per dtype: (output, grads).
TOLERANCE = {"float32": (1e-5, 1e-4), "bfloat16": (2e-2, 5e-2)}


def make_inputs(B, T, N, K, H, dtype, padding, eviction, seed=0):
  """Random q, k, v, dO and a visibility of the requested kind (numpy rng, then device)."""
  from trm_jax.kernels.visibility import NEVER_EVICTED, LayerVisibility
  rng = np.random.default_rng(seed)
  q, k, v, do = _random_qkv_do(rng, B, T, N, K, H)
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
  return (*(jnp.asarray(x, dtype) for x in (q, k, v, do)), vis)


def _random_qkv_do(rng, B, T, N, K, H):
  return tuple(rng.standard_normal(s).astype(np.float32)
               for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)))


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


def compare(q, k, v, do, vis, dtype: str, blocks, interpret: bool) -> dict:
  """Kernel (q, k, v in `dtype`) vs the fp32 HIGHEST reference on the same rounded inputs."""
  from trm_jax.kernels.attention_ref import attention_reference
  from trm_jax.kernels.flash_attention import flash_attention
  q, k, v, do = (x.astype(dtype) for x in (q, k, v, do))
  kern = vjp_fn(lambda q, k, v, vis: flash_attention(q, k, v, vis, block_sizes=blocks,
                                                      interpret=interpret))
  got, stats = compile_and_time(kern, (q, k, v, vis, do), warmup=1, iters=0)
  up = lambda x: x.astype(jnp.float32)
  with jax.default_matmul_precision("highest"):
    want = jax.jit(vjp_fn(attention_reference))(up(q), up(k), up(v), vis, up(do))
  tol_out, tol_grad = TOLERANCE[dtype]
  rec = {"dtype": dtype, "blocks": vars(blocks), "compile_s": stats["compile_s"],
         "temp_bytes": stats["temp_bytes"], "tensors": {}, "passed": True}
  for tname, g, w, tol in zip(("out", "dq", "dk", "dv"), got, want,
                              (tol_out, tol_grad, tol_grad, tol_grad)):
    g, w = np.asarray(up(g)), np.asarray(w)
    err = float(np.max(np.abs(g - w)))
    ref_max = float(np.max(np.abs(w)))
    ok = bool(np.all(np.isfinite(g))) and err <= tol * max(1.0, ref_max)
    rec["tensors"][tname] = {"max_abs_err": err, "max_abs_ref": ref_max, "tol": tol,
                             "passed": ok}
    rec["passed"] &= ok
  return rec


def synthetic_check(cfg, interpret: bool) -> dict:
  from trm_jax.kernels.flash_attention import BlockSizes
  name, B, T, N, K, H, dtype, padding, eviction, blocks = cfg
  q, k, v, do, vis = make_inputs(B, T, N, K, H, jnp.float32, padding, eviction)
  rec = compare(q, k, v, do, vis, dtype, BlockSizes(*blocks), interpret)
  rec.update(shape=dict(B=B, T=T, N=N, K=K, H=H), padding=padding, eviction=eviction)
  return rec


def policy_records(tiny: bool) -> dict:
  """{policy: LayerVisibility} of real rollouts of a one-layer model (ratio 0.5, 2 rows of
  prompt lengths P and ~0.6 P, left-padded, P new tokens), as tests/test_kernels_tpu.py."""
  from flax import nnx
  from trm_jax.kernels.visibility import Visibility
  from trm_jax.models import Decoder, ModelConfig
  from trm_jax.rollout import CacheConfig, generate
  P = 32 if tiny else 128
  model = Decoder(ModelConfig(num_layers=1), rngs=nnx.Rngs(0))
  lens = np.array([P, int(P * 0.6)], np.int32)
  rng = np.random.default_rng(0)
  prompts = np.zeros((2, P), np.int32)
  for b, n in enumerate(lens):
    prompts[b, P - n:] = rng.integers(3, 128, n)
  out = {}
  for policy in POLICIES:
    ro = generate(model, prompts, lens, max_new_tokens=P, key=jax.random.key(1), eos_ids=(),
                  cache=CacheConfig(policy=policy, ratio=0.5),
                  attn_impl="pallas_interpret" if tiny else "auto")
    out[policy] = Visibility(ro.segment_ids, ro.evicted_at).layer(0)
  return out


def policy_check(policy: str, vis, dtype: str, tiny: bool, interpret: bool) -> dict:
  from trm_jax.kernels.flash_attention import BlockSizes
  from trm_jax.kernels.visibility import NEVER_EVICTED
  B, K, T = vis.evicted_at.shape
  N, H = 2 * K, (32 if tiny else 128)
  q, k, v, do = (jnp.asarray(x) for x in _random_qkv_do(np.random.default_rng(1), B, T, N, K,
                                                        H))
  blocks = BlockSizes(16, 16, 16, 16) if tiny else BlockSizes(64, 64, 32, 32)
  rec = compare(q, k, v, do, vis, dtype, blocks, interpret)
  rec.update(policy=policy, shape=dict(B=B, T=T, N=N, K=K, H=H),
             evicted_fraction=round(float(jnp.mean(vis.evicted_at < NEVER_EVICTED)), 4))
  return rec


def timing(cfg, interpret: bool, warmup: int, iters: int) -> dict:
  from trm_jax.kernels.attention_ref import attention_reference
  from trm_jax.kernels.flash_attention import BlockSizes, flash_attention
  name, B, T, N, K, H, dtype, padding, eviction, blocks = cfg
  blocks = BlockSizes(*blocks)
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


# ---------------------------------------------------------------------------------------------
# (b) the tiny configs trained on the GPU
# ---------------------------------------------------------------------------------------------

def default_config_dir() -> str:
  """The shipped configs' directory: configs/ at the top of the repository (or wherever
  trm_jax.config finds them: an installed wheel, the older trm_jax/configs/)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for d in (os.path.join(root, "configs"), os.path.join(root, "trm_jax", "configs")):
    if os.path.isfile(os.path.join(d, "tiny_trm.py")):
      return d
  from trm_jax import config as config_lib
  return config_lib.shipped_dir()


def train_config(name: str, config_dir: str, steps: int, impl: str, tiny: bool, cache: str):
  from trm_jax import config as config_lib
  c = config_lib.load_config(os.path.join(config_dir, name + ".py"))
  c.total_steps = steps
  c.model.attn_impl = impl
  c.ckpt_every = max(steps, 1)
  c.export_hf = False
  c.warmup.cache_dir = os.path.join(cache, f"base_{name}")
  if tiny:   # the shared test base's settings (tests/shared_run.py), smaller batches
    c.warmup.steps, c.warmup.batch_size = 20, 16
    c.task.synthetic.max_operands, c.task.synthetic.max_value = 3, 9
    c.rl.batch_size, c.rl.group_size = 8, 4
    c.eval_problems, c.eval_samples = 4, 1
  return c


def train_one(name: str, args, cache: str) -> dict:
  from trm_jax import train, warmup
  steps = args.train_steps
  impl = "pallas_interpret" if args.interpret else "pallas"
  c = train_config(name, args.config_dir, steps, impl, args.tiny, cache)
  t0 = time.perf_counter()
  warmup.ensure_base_model(c, log=lambda _: None)
  base_s = time.perf_counter() - t0
  workdir = os.path.join(cache, f"run_{name}")
  shutil.rmtree(workdir, ignore_errors=True)
  t0 = time.perf_counter()
  result = train.run(c, workdir, progress=False)
  run_s = time.perf_counter() - t0
  last = {}
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  if os.path.exists(metrics_path):
    with open(metrics_path) as f:
      rows = [json.loads(line) for line in f if line.strip()]
    last = rows[-1] if rows else {}
  final = {k: v for k, v in last.items() if isinstance(v, (int, float))}
  return {"config": name, "steps": steps, "attn_impl": impl, "base_model_s": round(base_s, 2),
          "train_run_s": round(run_s, 2), "loop_s": round(result.get("wall_s", 0.0), 2),
          "s_per_step": round(result.get("wall_s", 0.0) / max(steps, 1), 3),
          "final_metrics": final, "eval": result.get("eval"),
          "summary": result.get("summary")}


# ---------------------------------------------------------------------------------------------
# (c) learner MFU, (d) sampler tokens/s
# ---------------------------------------------------------------------------------------------

# A 0.5B-parameter Qwen3-like model (bf16 compute, fp32 parameters); tiny: a toy.
MFU_MODEL = dict(hidden_size=2048, intermediate_size=6144, num_layers=8, num_heads=16,
                 num_kv_heads=8, head_dim=128, vocab_size=32000)
TINY_MODEL = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, vocab_size=256)


def learner_mfu(args) -> dict:
  import optax
  from flax import nnx
  from bench.learner import _concrete_batch
  from trm_jax.aot import hlo_cost
  from trm_jax.models import Decoder, ModelConfig
  from trm_jax.rl.learner import LearnerConfig, make_learner
  arch = TINY_MODEL if args.tiny else MFU_MODEL
  B, T = (2, 64) if args.tiny else (16, 1024)
  P = T // 4
  impl = "pallas_interpret" if args.interpret else "pallas"
  model = Decoder(ModelConfig(dtype="bfloat16", param_dtype="float32", **arch), rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  cfg = model.config
  batch = _concrete_batch(jax.random.key(0), B, T, P, cfg.num_layers, cfg.num_kv_heads,
                          cfg.vocab_size, ratio=0.0).replace(evicted_at=None)
  tx = optax.adamw(1e-6)
  _, update = make_learner(graphdef, tx, LearnerConfig(mode="off", chunk=128 if not args.tiny
                                                       else 32, attn_impl=impl),
                           response_start=P)
  opt = tx.init(params)
  t0 = time.perf_counter()
  compiled = update.lower(params, opt, rest, batch).compile()
  compile_s = time.perf_counter() - t0
  cost = hlo_cost.program_cost(compiled)
  mem = compiled.memory_analysis()
  p, o = params, opt
  p, o, aux = compiled(p, o, rest, batch)                  # warm-up
  jax.block_until_ready((p, o, aux))
  times = []
  for _ in range(args.repeats):
    t0 = time.perf_counter()
    p, o, aux = compiled(p, o, rest, batch)
    jax.block_until_ready((p, o, aux))
    times.append(time.perf_counter() - t0)
  med = statistics.median(times)
  rate = cost["flops"] / med
  return {"model": arch, "params": n_params, "B": B, "T": T, "P": P, "mode": "off (plain GRPO)",
          "dtype": "bfloat16 compute, float32 params", "attn_impl": impl,
          "compile_s": round(compile_s, 2), "step_flops": cost["flops"],
          "kernel_flops": cost["kernel_flops"], "xla_cost_analysis_flops": cost["xla_flops"],
          "temp_bytes": None if mem is None else int(mem.temp_size_in_bytes),
          "step_s_median": round(med, 5), "step_s_all": [round(t, 5) for t in times],
          "flops_per_s": rate, "peak_bf16_flops": H200_PEAK_BF16_FLOPS,
          "mfu_vs_h200_bf16_peak": round(rate / H200_PEAK_BF16_FLOPS, 6),
          "tokens_per_s": round(B * T / med, 1)}


def sampler_rate(args) -> dict:
  from flax import nnx
  from trm_jax.models import Decoder, ModelConfig
  from trm_jax.rollout import generate
  arch = TINY_MODEL if args.tiny else MFU_MODEL
  B, P, N = (4, 16, 16) if args.tiny else (256, 128, 512)
  impl = "pallas_interpret" if args.interpret else "auto"
  model = Decoder(ModelConfig(dtype="bfloat16", param_dtype="bfloat16", **arch),
                  rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  lens = rng.integers(P // 2, P + 1, B).astype(np.int32)
  ids = np.zeros((B, P), np.int32)
  for b, n in enumerate(lens):
    ids[b, P - n:] = rng.integers(3, arch["vocab_size"], n)

  def call(n, seed):
    r = generate(model, ids, lens, max_new_tokens=n, key=jax.random.key(seed), eos_ids=(),
                 compute_dtype=jnp.bfloat16, attn_impl=impl)
    jax.block_until_ready(r.tokens)

  first = {}
  for n in (N, 1):                                         # compiles
    t0 = time.perf_counter()
    call(n, 0)
    first[n] = round(time.perf_counter() - t0, 2)
  t_full, t_one = [], []
  for rep in range(args.repeats):
    for n, acc in ((N, t_full), (1, t_one)):
      t0 = time.perf_counter()
      call(n, rep + 1)
      acc.append(time.perf_counter() - t0)
  tf, t1 = statistics.median(t_full), statistics.median(t_one)
  return {"model": arch, "B": B, "prompt": P, "new_tokens": N, "dtype": "bfloat16",
          "prefill_attn_impl": impl, "first_call_s": {str(k): v for k, v in first.items()},
          "t_new_tokens_s": round(tf, 4), "t_one_token_s": round(t1, 4),
          "end_to_end_tokens_per_s": round(B * N / tf, 1),
          "decode_tokens_per_s": round(B * (N - 1) / max(tf - t1, 1e-9), 1)}


# ---------------------------------------------------------------------------------------------
# (e) the decode kernel against the cache's einsums
# ---------------------------------------------------------------------------------------------


def ragged_cache(B, K, G, H, C, dtype, full: bool, seed=0):
  """q [B, K G, H] and a KVCache whose row b is filled to a geometric depth (mean C / 8, row 0
  full, a hole of evicted slots in row 1), or every row full."""
  from trm_jax.models import kv_cache
  rng = np.random.default_rng(seed)
  ext = np.full(B, C) if full else np.minimum(rng.geometric(8 / C, B), C)
  ext[0] = C
  pos = np.where(np.arange(C)[None, None, :] < ext[:, None, None],
                 np.arange(C)[None, None, :], -1).repeat(K, 1).astype(np.int32)
  pos[1 % B, 0, : C // 16] = -1
  mk = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), dtype)
  cache = kv_cache.KVCache(k=mk(B, K, H, C), v=mk(B, K, C, H), pos=jnp.asarray(pos))
  return mk(B, K * G, H), cache, ext


def decode_check(args, dtype: str) -> dict:
  from trm_jax.kernels.attention import decode_kernel
  from trm_jax.models import kv_cache
  B, K, G, H, C = (4, 2, 2, 32, 256) if args.tiny else (16, 8, 4, 128, 4096)
  q, cache, ext = ragged_cache(B, K, G, H, C, jnp.dtype(dtype), full=False)
  kernel = decode_kernel("pallas_interpret" if args.interpret else "pallas")
  got = jax.jit(kernel)(q, cache.k, cache.v, cache.pos)
  ref, _ = jax.jit(kv_cache.attend)(q, cache)
  err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32))))
  tol = TOLERANCE[dtype][0]
  return {"shape": [B, K, G, H, C], "extents": ext.tolist(), "max_abs_err": err,
          "tolerance": tol, "passed": err <= tol}


def decode_timing(args, full: bool) -> dict:
  from trm_jax.kernels.attention import decode_kernel
  from trm_jax.models import kv_cache
  B, K, G, H, C = (4, 2, 2, 32, 256) if args.tiny else (64, 8, 4, 128, 8192)
  q, cache, ext = ragged_cache(B, K, G, H, C, jnp.bfloat16, full=full)
  kernel = decode_kernel("pallas_interpret" if args.interpret else "pallas")
  out = {"shape": [B, K, G, H, C], "dtype": "bfloat16", "mean_extent": float(ext.mean())}
  for name, fn in (("kernel", lambda q, c: kernel(q, c.k, c.v, c.pos)),
                   ("einsum", lambda q, c: kv_cache.attend(q, c, probs=False)[0])):
    _, out[name] = compile_and_time(fn, (q, cache), 1 if args.tiny else 3,
                                    3 if args.tiny else 20)
  out["einsum_over_kernel"] = round(out["einsum"]["median_ms"] / out["kernel"]["median_ms"], 3)
  return out


# ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=None,
                 help="JSON path (default $OUT/gpu_day.json, else bench/results/gpu_day.json on "
                      "a GPU and /tmp/gpu_day_cpu.json otherwise)")
  p.add_argument("--allow_cpu", action="store_true", help="run without a GPU backend")
  p.add_argument("--tiny", action="store_true",
                 help="tiny shapes and short runs (with --allow_cpu: the CPU smoke test)")
  p.add_argument("--config_dir", default=default_config_dir(),
                 help="directory of tiny_trm.py and tiny_smd.py (default: %(default)s)")
  p.add_argument("--sections", default="kernel,decode,train,learner,sampler,kernel_timing",
                 help="comma-separated, run in this order (default: %(default)s)")
  p.add_argument("--train_steps", type=int, default=None, help="default 20 (tiny: 2)")
  p.add_argument("--repeats", type=int, default=None, help="timed calls (default 5, tiny 2)")
  p.add_argument("--budget_s", type=float, default=450.0,
                 help="skip the remaining items once this much time has passed")
  p.add_argument("--workdir", default=None, help="base models and runs (default: a temp dir)")
  args = p.parse_args(argv)
  backend = jax.default_backend()
  if backend != "gpu" and not args.allow_cpu:
    print(f"bench.gpu_day: no GPU backend (jax.default_backend() = {backend!r}); install "
          "jax[cuda12] on a GPU host, or pass --allow_cpu --tiny for the CPU smoke test",
          file=sys.stderr)
    return 2
  args.interpret = backend != "gpu"                # the kernel through the Pallas interpreter
  args.train_steps = args.train_steps or (2 if args.tiny else 20)
  args.repeats = args.repeats or (2 if args.tiny else 5)
  out_path = args.out or (os.path.join(os.environ["OUT"], "gpu_day.json") if os.environ.get("OUT")
                          else os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                            "results", "gpu_day.json") if backend == "gpu"
                          else "/tmp/gpu_day_cpu.json")
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  workdir = args.workdir or tempfile.mkdtemp(prefix="gpu_day_")
  sections = [s.strip() for s in args.sections.split(",") if s.strip()]

  start = time.perf_counter()
  dev = jax.devices()[0]
  result = {"backend": backend, "device_kind": dev.device_kind,
            "devices": [str(d) for d in jax.devices()], "jax_version": jax.__version__,
            "jaxlib_version": None,
            "python": platform.python_version(), "tiny": args.tiny,
            "kernel_mode": "interpret" if args.interpret else "triton",
            "config_dir": args.config_dir, "sections": {}, "section_wall_s": {},
            "errors": {}, "skipped": []}
  import jaxlib  # pylint: disable=g-import-not-at-top
  result["jaxlib_version"] = jaxlib.__version__

  def save():
    result["elapsed_s"] = round(time.perf_counter() - start, 2)
    with open(out_path, "w") as f:
      json.dump(result, f, indent=2, default=str)

  def item(section: str, name: str, job):
    """Runs one item of a section (or skips it past the budget); records result or error."""
    if time.perf_counter() - start > args.budget_s:
      result["skipped"].append(f"{section}/{name}")
      save()
      return
    t0 = time.perf_counter()
    try:
      rec = job()
      rec["wall_s"] = round(time.perf_counter() - t0, 2)
      result["sections"].setdefault(section, {})[name] = rec
      status = "FAILED" if rec.get("passed") is False else "done"
    except Exception as e:  # record and move on
      result["errors"][f"{section}/{name}"] = {"error": f"{type(e).__name__}: {e}"[:2000],
                                               "traceback": traceback.format_exc()[-4000:]}
      status = "ERROR"
    print(f"[{time.perf_counter() - start:7.1f}s] {section}/{name}: {status}", flush=True)
    save()

  for section in sections:
    t_sec = time.perf_counter()
    if section == "kernel":
      checks = TINY_CHECKS if args.tiny else FULL_CHECKS
      for cfg in checks:
        item("kernel", cfg[0], lambda cfg=cfg: synthetic_check(cfg, args.interpret))
      records = {}

      def rollouts():
        records.update(policy_records(args.tiny))
        return {"policies": list(records)}
      item("kernel", "policy_rollouts", rollouts)
      for policy, vis in records.items():
        for dtype in ("float32", "bfloat16"):
          item("kernel", f"policy_{policy}_{dtype}",
               lambda policy=policy, vis=vis, dtype=dtype: policy_check(
                   policy, vis, dtype, args.tiny, args.interpret))
    elif section == "decode":
      for dtype in ("float32", "bfloat16"):
        item("decode", f"check_{dtype}", lambda dtype=dtype: decode_check(args, dtype))
      for full in (False, True):
        item("decode", "timing_full" if full else "timing_ragged",
             lambda full=full: decode_timing(args, full))
    elif section == "kernel_timing":
      for cfg in TINY_TIMINGS if args.tiny else FULL_TIMINGS:
        item("kernel_timing", cfg[0],
             lambda cfg=cfg: timing(cfg, args.interpret, 1 if args.tiny else 3,
                                    3 if args.tiny else 20))
    elif section == "train":
      for name in ("tiny_trm", "tiny_smd"):
        item("train", name, lambda name=name: train_one(name, args, workdir))
    elif section == "learner":
      item("learner", "update_step", lambda: learner_mfu(args))
    elif section == "sampler":
      item("sampler", "generate", lambda: sampler_rate(args))
    else:
      result["errors"][section] = {"error": f"unknown section {section!r}"}
    result["section_wall_s"][section] = round(time.perf_counter() - t_sec, 2)
    save()

  checks = [r for name, r in result["sections"].get("kernel", {}).items() if "passed" in r]
  result["kernel_checks_passed"] = bool(checks) and all(r["passed"] for r in checks)
  result["timing_variant_errors"] = sorted(
      f"{name}/{key}" for name, rec in result["sections"].get("kernel_timing", {}).items()
      for key, val in rec.items() if isinstance(val, dict) and "error" in val)
  result["all_passed"] = (not result["errors"] and not result["skipped"]
                          and not result["timing_variant_errors"]
                          and ("kernel" not in sections or result["kernel_checks_passed"]))
  save()
  summary = {"all_passed": result["all_passed"], "elapsed_s": result["elapsed_s"],
             "section_wall_s": result["section_wall_s"], "skipped": result["skipped"],
             "errors": sorted(result["errors"])}
  for key, path in (("mfu", ("learner", "update_step", "mfu_vs_h200_bf16_peak")),
                    ("sampler_tokens_per_s", ("sampler", "generate", "end_to_end_tokens_per_s"))):
    node = result["sections"]
    for part in path:
      node = node.get(part, {}) if isinstance(node, dict) else {}
    summary[key] = node if node != {} else None
  print(json.dumps(summary))
  print(f"wrote {out_path}", file=sys.stderr)
  if args.workdir is None:
    shutil.rmtree(workdir, ignore_errors=True)
  return 0 if result["all_passed"] else 1


if __name__ == "__main__":
  sys.exit(main())
