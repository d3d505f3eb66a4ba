"""Compile the TPU visibility kernel (and the XLA reference) for real TPU chips, without a TPU.

For each topology and length, compiles forward-only and forward+backward (a `jax.vjp` with a
cotangent argument) at the Qwen3-8B attention shape (B=1, N=32, K=8, H=128, bf16) with
segment_ids and evicted_at, through libtpu's compiler (`trm_jax.kernels.tpu_aot`), and records
per-chip `memory_analysis()` bytes.

q, k, v, the output and its cotangent cross the jit boundary as [B, T, heads*H], the layout the
kernel reads. Under TPU tiled layouts [B, T, N, H] <-> [B, T, N*H] is not a bitcast: with
[B, T, N, H] parameters XLA would add relayout copies of q, k, v and o (linear in T) to the
kernel's temporaries, which are attention's own cost only in a model that produces that
layout (see the kernel's docstring for a whole layer).

Nothing runs: the figures are what XLA:TPU allocates in HBM (temporaries exclude arguments and
outputs; XLA may keep small temporaries in VMEM, which are not counted). A configuration that
does not compile (the reference's [B, K, G, T, T] fp32 logits outgrow HBM) records the
compiler's first error line instead. About a minute on 2 CPU cores.

  pip install -e '.[tpu]'
  python -m bench.tpu_kernel_aot [--out bench/results/tpu_kernel_aot.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the host backend; TPUs come from topologies

import jax
import jax.numpy as jnp

from trm_jax.kernels.attention_ref import attention_reference
from trm_jax.kernels.flash_attention_tpu import TPUBlockSizes, flash_attention_tpu
from trm_jax.aot import cli as aot_cli
from trm_jax.aot.tpu import compile_for_tpu, libtpu_available
from trm_jax.kernels.visibility import LayerVisibility

TOPOLOGIES = ("v5e:2x2", "v5p:2x2x1", "v6e:2x2")
LENGTHS = (8192, 32768)
SHAPE = dict(B=1, N=32, K=8, H=128)   # Qwen3-8B attention


def _attention(impl: str, blocks: TPUBlockSizes):
  """Projection-shaped q [B, T, N*H], k/v [B, T, K*H] -> [B, T, N*H]."""
  H = SHAPE["H"]

  def attn(q, k, v, seg, ev):
    B, T = seg.shape
    q, k, v = (x.reshape(B, T, -1, H) for x in (q, k, v))
    vis = LayerVisibility(segment_ids=seg, evicted_at=ev)
    if impl == "kernel":
      out = flash_attention_tpu(q, k, v, vis, block_sizes=blocks)
    else:
      out = attention_reference(q, k, v, vis)
    return out.reshape(B, T, -1)
  return attn


def _programs(impl: str, blocks: TPUBlockSizes):
  attn = _attention(impl, blocks)

  def fwd(q, k, v, seg, ev):
    return attn(q, k, v, seg, ev)

  def fwd_bwd(q, k, v, seg, ev, do):
    out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, seg, ev), q, k, v)
    return out, *vjp(do)
  return {"fwd": fwd, "fwd_bwd": fwd_bwd}


def measure(topology: str, T: int, impl: str, mode: str, blocks: TPUBlockSizes) -> dict:
  B, N, K, H = SHAPE["B"], SHAPE["N"], SHAPE["K"], SHAPE["H"]
  bf16 = jnp.bfloat16
  args = [jax.ShapeDtypeStruct((B, T, N * H), bf16), jax.ShapeDtypeStruct((B, T, K * H), bf16),
          jax.ShapeDtypeStruct((B, T, K * H), bf16), jax.ShapeDtypeStruct((B, T), jnp.int32),
          jax.ShapeDtypeStruct((B, K, T), jnp.int32)]
  if mode == "fwd_bwd":
    args.append(jax.ShapeDtypeStruct((B, T, N * H), bf16))
  t0 = time.time()
  try:
    compiled = compile_for_tpu(_programs(impl, blocks)[mode], args, topology)
  except Exception as e:   # recorded, not raised: the reference is expected to fail at 32k
    msg = next((l for l in str(e).splitlines() if l.strip()), type(e).__name__)
    return {"compiled": False, "error": f"{type(e).__name__}: {msg[:300]}",
            "compile_s": round(time.time() - t0, 1)}
  mem = compiled.memory_analysis()
  return {"compiled": True, "temp_bytes": int(mem.temp_size_in_bytes),
          "argument_bytes": int(mem.argument_size_in_bytes),
          "output_bytes": int(mem.output_size_in_bytes),
          "compile_s": round(time.time() - t0, 1)}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--topologies", default=",".join(TOPOLOGIES))
  ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
  ap.add_argument("--impls", default="kernel,reference")
  ap.add_argument("--out", default="bench/results/tpu_kernel_aot.json")
  a = ap.parse_args(argv)
  if not libtpu_available():
    sys.exit("bench/tpu_kernel_aot.py needs libtpu: pip install -e '.[tpu]'")
  import libtpu  # noqa: F401  (version below)
  from importlib.metadata import version
  blocks = TPUBlockSizes()
  rows = []
  for topo in a.topologies.split(","):
    for T in map(int, a.lengths.split(",")):
      for impl in a.impls.split(","):
        for mode in ("fwd", "fwd_bwd"):
          r = {"topology": topo, "T": T, "impl": impl, "mode": mode,
               **measure(topo, T, impl, mode, blocks)}
          print(json.dumps(r), flush=True)
          rows.append(r)
  out = {"what": "per-chip memory_analysis() of jit(attention) compiled AOT for TPU topologies",
         "jax_version": jax.__version__, "libtpu_version": version("libtpu"),
         "shape": {**SHAPE, "dtype": "bfloat16", "visibility": "segment_ids + evicted_at",
                   "boundary": "q, k, v, out, cotangent as [B, T, heads*H]"},
         "block_sizes": dataclasses.asdict(blocks), "rows": rows, **aot_cli.commit()}
  os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
  with open(a.out, "w") as f:
    json.dump(out, f, indent=2)
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
