"""Compiled temporary memory of attention forward+backward: flash kernel vs XLA reference.

For T in --lengths, compiles `grad(sum(attention(q, k, v, vis)))` w.r.t. (q, k, v) and reads
`compile().memory_analysis().temp_size_in_bytes` (on CPU `peak_memory_in_bytes` counts only
arguments and outputs, so temporaries are the honest figure). Nothing is executed; shapes come
from `jax.ShapeDtypeStruct`. Variants:

  kernel_shadow     Pallas kernel, segment_ids + evicted_at (the SMD masked track)
  kernel_causal     the same kernel, plain causal (vis=None)
  reference_shadow  attention_reference: [B, K, G, T, S] fp32 logits and the dense mask
  reference_causal  attention_reference, plain causal

On CPU the kernel can only be lowered through the Pallas interpreter (`interpret=True`), which
discharges the grid into an XLA while loop that slices each program's blocks out of the full
operands; the numbers are therefore XLA's buffers for that loop, not Triton's SRAM tiles. The
`interpret_check` section compares the interpreter's temporaries with the analytic size of what
the kernel keeps in HBM (inputs are arguments; residuals o, lse; per-query-head dk/dv in fp32;
delta) so a hidden [T, T] buffer would show up as a gap growing like T^2.

  python -m bench.attention_memory [--out bench/results/attention_memory.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp

from trm_jax.kernels.attention_ref import attention_reference
from trm_jax.kernels.flash_attention import BlockSizes, flash_attention
from trm_jax.kernels.visibility import LayerVisibility


def _grad_fn(impl: str, shadow: bool, blocks: BlockSizes):
  """(q, k, v, seg, ev) -> grads of sum(attention) w.r.t. q, k, v."""
  def loss(q, k, v, seg, ev):
    vis = LayerVisibility(segment_ids=seg, evicted_at=ev) if shadow else None
    if impl == "kernel":
      out = flash_attention(q, k, v, vis, block_sizes=blocks,
                            interpret=jax.default_backend() == "cpu")
    else:
      out = attention_reference(q, k, v, vis)
    return jnp.sum(out.astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2))


def measure(T: int, B: int, N: int, K: int, H: int, dtype, blocks: BlockSizes) -> dict:
  shapes = (jax.ShapeDtypeStruct((B, T, N, H), dtype),
            jax.ShapeDtypeStruct((B, T, K, H), dtype),
            jax.ShapeDtypeStruct((B, T, K, H), dtype),
            jax.ShapeDtypeStruct((B, T), jnp.int32),
            jax.ShapeDtypeStruct((B, K, T), jnp.int32))
  row = {"T": T}
  for impl in ("kernel", "reference"):
    for shadow in (True, False):
      name = f"{impl}_{'shadow' if shadow else 'causal'}"
      t0 = time.perf_counter()
      compiled = jax.jit(_grad_fn(impl, shadow, blocks)).lower(*shapes).compile()
      mem = compiled.memory_analysis()
      row[name] = {"temp_bytes": int(mem.temp_size_in_bytes),
                   "argument_bytes": int(mem.argument_size_in_bytes),
                   "output_bytes": int(mem.output_size_in_bytes),
                   "compile_s": round(time.perf_counter() - t0, 2)}
      print(f"T={T:5d} {name:17s} temp {mem.temp_size_in_bytes / 2**20:10.2f} MiB", flush=True)
  itemsize = jnp.dtype(dtype).itemsize
  # What the kernel path must hold besides its arguments, all O(T): o [B,T,N,H], lse and delta
  # [B,N,T] f32, padded copies of q/k/v, dO, dq, per-query-head dk/dv [B,T,N,H] f32 (x2).
  row["kernel_linear_estimate_bytes"] = int(
      B * T * N * H * itemsize * 3 + B * T * K * H * itemsize * 2 + B * N * T * 4 * 2
      + B * T * N * H * 4 * 2)
  # One [B, N, T, T] fp32 array: the unit the reference path materialises several times.
  row["one_TxT_f32_bytes"] = B * N * T * T * 4
  return row


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="bench/results/attention_memory.json")
  p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=4, help="query heads N")
  p.add_argument("--kv-heads", type=int, default=2, help="kv heads K (GQA G = N // K)")
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  args = p.parse_args(argv)
  blocks = BlockSizes()
  dtype = jnp.dtype(args.dtype)
  rows = [measure(T, args.batch, args.heads, args.kv_heads, args.head_dim, dtype, blocks)
          for T in args.lengths]
  by_t = {r["T"]: r for r in rows}

  def ratio(a, b):
    return round(a / b, 4) if b else None

  summary = {}
  if 2048 in by_t and 4096 in by_t:
    for name in ("kernel_shadow", "kernel_causal", "reference_shadow", "reference_causal"):
      summary[f"{name}_T4096_over_T2048"] = ratio(by_t[4096][name]["temp_bytes"],
                                                  by_t[2048][name]["temp_bytes"])
  if 4096 in by_t:
    r = by_t[4096]
    summary["kernel_shadow_over_kernel_causal_T4096"] = ratio(
        r["kernel_shadow"]["temp_bytes"], r["kernel_causal"]["temp_bytes"])
    summary["reference_shadow_over_kernel_shadow_T4096"] = ratio(
        r["reference_shadow"]["temp_bytes"], r["kernel_shadow"]["temp_bytes"])
  interpret_check = [{
      "T": r["T"],
      "kernel_shadow_temp_over_linear_estimate": ratio(r["kernel_shadow"]["temp_bytes"],
                                                       r["kernel_linear_estimate_bytes"]),
      "kernel_shadow_temp_over_one_TxT_f32": ratio(r["kernel_shadow"]["temp_bytes"],
                                                   r["one_TxT_f32_bytes"]),
  } for r in rows]
  result = {
      "what": "temp_size_in_bytes of jit(grad(sum(attention))) w.r.t. q, k, v",
      "backend": jax.default_backend(),
      "kernel_mode": "interpret" if jax.default_backend() == "cpu" else "compiled",
      "jax_version": jax.__version__,
      "python": platform.python_version(),
      "shape": {"B": args.batch, "N": args.heads, "K": args.kv_heads, "H": args.head_dim,
                "dtype": args.dtype},
      "block_sizes": {k: v for k, v in vars(blocks).items()},
      "rows": rows,
      "summary": summary,
      "interpret_check": interpret_check,
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(json.dumps(summary, indent=2))
  print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
  main()
