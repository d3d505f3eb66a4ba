"""The experts' grouped matmuls on one TPU chip, compiled ahead of time: `jax.lax.ragged_dot`
(what `layers.MoE.ffn` runs) against the Pallas megablox grouped matmul (`gmm`), without a TPU.

Under expert parallelism each chip runs its E_loc experts' SwiGLU (`layers.MoE.ffn`) on the rows
it received (`models/expert_parallel.py`, step 4): rows [R, D] grouped by expert, R = n * m * k
(the receive buffer; the rows past the groups are padding). At Qwen3-30B-A3B's expert shape (D =
2048, F = 768, bf16) with 128 experts over mesh.expert = 8 (E_loc = 16, k = 8), for the buffers
of the config's programs on v5p:4x4x4 (m tokens per chip: a decode step's 512 rows / 64 chips,
an update microbatch's 8 x 5120 / 64, one exchange of the scoring pass's 512 x 5120 / 64, which
sends them in chunks of model.moe_chunk = 4096), it compiles the forward and the forward +
backward (a `jax.vjp` into the rows and the three weights) through libtpu with each
implementation and records per-chip `memory_analysis()` bytes, compile time and the cost of the
compiled program (`aot.hlo_cost`; XLA counts a Mosaic kernel as 0 FLOPs, so the kernel's FLOPs
are given analytically beside: 3 matmuls of 2 x rows x D x F forward, twice that backward).

The group sizes are an argument (data, as in the layer): the figures hold for any routing.
Nothing runs, so this says which compiles smaller; which runs faster needs a TPU.

  pip install -e '.[tpu]'
  python -m bench.moe_gmm_aot [--topology v5p:2x2x1] [--out bench/results/moe_gmm_aot.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the host backend; TPUs come from topologies

import jax
import jax.numpy as jnp
from flax import nnx

from bench import hygiene
from trm_jax.aot import hlo_cost
from trm_jax.aot.tpu import compile_for_tpu, libtpu_available
from trm_jax.models import ModelConfig, expert_parallel
from trm_jax.models.layers import MoE

D, F, E, K, N_EXPERT = 2048, 768, 128, 8, 8   # Qwen3-30B-A3B's experts over mesh.expert=8
E_LOC = E // N_EXPERT
TOKENS_PER_CHIP = {"decode step": 512 // 64, "update microbatch": 8 * 5120 // 64,
                   "scoring pass": 4096}   # 512 x 5120 / 64 in chunks of model.moe_chunk


def _ffn(impl: str):
  """The layer's grouped SwiGLU (`layers.MoE.ffn`) with `impl`'s grouped matmul: the one
  `expert_parallel.grouped_matmul` picks on TPU, or ragged_dot."""
  cfg = ModelConfig(model_type="qwen3_moe", hidden_size=D, num_experts=E,
                    num_experts_per_tok=K, moe_intermediate_size=F, dtype="bfloat16",
                    param_dtype="bfloat16")
  layer = nnx.eval_shape(lambda: MoE(cfg, 0, rngs=nnx.Rngs(0)))
  matmul = expert_parallel.grouped_matmul("tpu") if impl == "megablox_gmm" else None
  return lambda x, sizes, gate, up, down: layer.ffn(x, sizes, gate, up, down, matmul=matmul)


def _program(impl: str, mode: str):
  ffn = _ffn(impl)
  if mode == "fwd":
    return ffn

  def fwd_bwd(x, sizes, gate, up, down, dy):
    y, vjp = jax.vjp(lambda x, g, u, d: ffn(x, sizes, g, u, d), x, gate, up, down)
    return y, *vjp(dy)
  return fwd_bwd


def measure(topology: str, rows: int, impl: str, mode: str) -> dict:
  bf16 = jnp.bfloat16
  sds = jax.ShapeDtypeStruct
  args = [sds((rows, D), bf16), sds((E_LOC,), jnp.int32), sds((E_LOC, D, F), bf16),
          sds((E_LOC, D, F), bf16), sds((E_LOC, F, D), bf16)]
  if mode == "fwd_bwd":
    args.append(sds((rows, D), bf16))
  t0 = time.time()
  try:
    compiled = compile_for_tpu(_program(impl, mode), args, topology)
  except Exception as e:  # pylint: disable=broad-except  (recorded: a size may not compile)
    msg = next((l for l in str(e).splitlines() if l.strip()), type(e).__name__)
    return {"compiled": False, "error": f"{type(e).__name__}: {msg[:300]}",
            "compile_s": round(time.time() - t0, 1)}
  compile_s = round(time.time() - t0, 1)
  mem = compiled.memory_analysis()
  cost = hlo_cost.hlo_text_cost(compiled.as_text(), xla=compiled.cost_analysis())
  return {"compiled": True, "compile_s": compile_s, "temp_bytes": int(mem.temp_size_in_bytes),
          "argument_bytes": int(mem.argument_size_in_bytes),
          "output_bytes": int(mem.output_size_in_bytes), "flops": cost["flops"],
          "bytes_accessed": cost["bytes_accessed"],
          "analytic_flops": 6.0 * rows * D * F * (1 if mode == "fwd" else 3)}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--topology", default="v5p:2x2x1")
  ap.add_argument("--out", default="bench/results/moe_gmm_aot.json")
  a = ap.parse_args(argv)
  if not libtpu_available():
    sys.exit("bench/moe_gmm_aot.py needs libtpu: pip install -e '.[tpu]'")
  from importlib.metadata import version  # pylint: disable=g-import-not-at-top
  out_rows = []
  for what, m in TOKENS_PER_CHIP.items():
    rows = N_EXPERT * m * K
    for mode in ("fwd", "fwd_bwd"):
      for impl in ("ragged_dot", "megablox_gmm"):
        r = {"buffer": what, "tokens_per_chip": m, "rows": rows, "mode": mode, "impl": impl,
             **measure(a.topology, rows, impl, mode)}
        print(json.dumps(r), flush=True)
        out_rows.append(r)
  out = {"what": "per-chip memory_analysis() and compiled cost of the experts' grouped SwiGLU "
                 "(ragged_dot vs megablox gmm), AOT for a TPU chip",
         "topology": a.topology, "jax_version": jax.__version__,
         "libtpu_version": version("libtpu"),
         "shape": {"D": D, "F": F, "experts_per_chip": E_LOC, "k": K,
                   "mesh_expert": N_EXPERT, "dtype": "bfloat16",
                   "megablox_tiling": expert_parallel.GMM_TILING},
         "rows": out_rows}
  hygiene.write_json(out, a.out)


if __name__ == "__main__":
  main()
