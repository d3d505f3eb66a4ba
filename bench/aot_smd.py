"""The SMD learner step compiled ahead of time for TPU slices: memory against sequence length.

Two measurements, both through `trm_jax.aot` (the trainer's update program at abstract
shapes, compiled by libtpu's XLA:TPU and Mosaic compilers; nothing runs):

  temporaries  Qwen3-4B, one sequence per chip (rl.group_size 2, one minibatch, one
               microbatch), T = 512 prompt + response in --lengths. Per-chip HBM temporaries
               of the SMD update (shadow-masked learner replaying evicted_at, plus the dense
               stop-gradient teacher) and of its masked track alone against the same track
               with plain causal attention (VARIANTS), for the Pallas TPU kernel and the XLA
               reference. Claims checked: with the kernel, SMD T 16384 / T 8192 <= 2.3x and
               masked / causal <= 1.15x at every T.
  longest      the qwen3_4b_smd_gsm8k config (as written, or with --set overrides) on --topology,
               task.max_new_tokens doubled from 1024 until the update no longer fits a chip
               (XLA refuses it, or with the resident rollout batch it exceeds HBM), per
               attention implementation.

  pip install -e '.[tpu]'
  python -m bench.aot_smd temporaries [--topology v5p:2x2x1] [--lengths 4096,8192,16384]
  python -m bench.aot_smd longest --topology v6e:4x4 [--impls pallas_tpu,reference] \
      [--set rl.num_microbatches=2]

Each compile of the 36-layer model takes minutes on 2 CPU cores; a configuration XLA refuses
records the compiler's first line and its required bytes.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the host backend; TPUs come from topologies

from trm_jax.aot import cli as aot_cli           # noqa: E402
from trm_jax.aot import compiler as aot         # noqa: E402
from trm_jax import config as config_lib         # noqa: E402
from trm_jax.aot import tpu as tpu_aot           # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                      "qwen3_4b_smd_gsm8k.py")
PROMPT = 512
GiB = 2**30


LAYERS = 36   # Qwen3-4B; --layers lowers it for a quick check of the script


def update_row(c, topology: str, *, causal: bool = False) -> dict:
  """The update program's report row for config `c` (causal: the batch without evicted_at,
  so every track attends causally)."""
  devices = tpu_aot.topology_devices(topology)
  s = aot.build(c, dict(aot.KNOWN_MODELS["Qwen3-4B"], num_hidden_layers=LAYERS), devices)
  program = s.programs["update"]
  if causal:
    args = program.args
    program = dataclasses.replace(program, args=(*args[:3], args[3].replace(evicted_at=None)))
  row = aot.measure(program, chip=tpu_aot.chip_spec(topology),
                    devices_per_chip=max(1, len(devices) // tpu_aot.topology_chips(topology)))
  row.pop("loops", None)
  return row


def _print(r: dict) -> None:
  mem = (f"temp {r['temp_bytes'] / GiB:.2f} GiB, total {r['total_bytes'] / GiB:.2f} GiB"
         if "temp_bytes" in r else f"refused: {r.get('error', '')[:160]}")
  print(json.dumps({k: r[k] for k in r if k in ("T", "R", "impl", "attention")}), mem,
        f"fits={r['fits']}", f"({r['compile_s']}s)", flush=True)


# Variants of the update at each T: (name, smd.lam, batch carries the retention record).
#   smd     the SMD step: masked track replaying evicted_at + dense stop-gradient teacher
#   masked  the masked track alone (lam = 0: no teacher)
#   causal  the same one-track step with plain causal attention (no evicted_at)
# masked / causal isolates what the retention record costs through an implementation. The
# two-track step without a record is no baseline on TPU: its teacher and student tracks are
# the same computation, which XLA merges into one.
VARIANTS = (("smd", 0.1, True), ("masked", 0.0, True), ("causal", 0.0, False))


def temporaries(topology: str, lengths, impls) -> dict:
  n = len(tpu_aot.topology_devices(topology))
  rows = []
  for T in lengths:
    for impl in impls:
      for name, lam, record in VARIANTS:
        c = config_lib.load_config(CONFIG)
        c.task.max_prompt_len, c.task.max_new_tokens = PROMPT, T - PROMPT
        c.rl.group_size, c.rl.batch_size = 2, n
        c.rl.num_minibatches, c.rl.num_microbatches = 1, 1
        c.model.attn_impl, c.smd.lam = impl, lam
        r = {"T": T, "impl": impl, "attention": name,
             **update_row(c, topology, causal=not record)}
        _print(r)
        rows.append(r)
  temp = {(r["impl"], r["T"], r["attention"]): r.get("temp_bytes") for r in rows}
  checks = {}
  for impl in impls:
    lo, hi = temp.get((impl, 8192, "smd")), temp.get((impl, 16384, "smd"))
    if lo and hi:
      checks[f"{impl}_smd_T16384_over_T8192"] = hi / lo
    for T in lengths:
      m, c = temp.get((impl, T, "masked")), temp.get((impl, T, "causal"))
      if m and c:
        checks[f"{impl}_masked_over_causal_T{T}"] = m / c
  return {"what": "per-chip HBM temporaries of the SMD learner update (memory_analysis) vs "
                  "T, Qwen3-4B, one sequence per chip, AOT for a TPU topology",
          "variants": {v[0]: {"smd.lam": v[1], "retention_record": v[2]} for v in VARIANTS},
          "topology": topology, "prompt_len": PROMPT, "rows": rows, "ratios": checks}


def _config(overrides):
  """The 4B SMD config with `key=value` overrides (python literals)."""
  c = config_lib.load_config(CONFIG)
  for kv in overrides:
    key, _, value = kv.partition("=")
    *parents, field = key.split(".")
    node = c
    for p in parents:
      node = node[p]
    if field not in node:
      raise SystemExit(f"unknown config key {key!r}")
    node[field] = ast.literal_eval(value)
  return c


def longest(topology: str, impls, max_r: int, overrides, r_list=()) -> dict:
  """Per impl, R = 1024, 2048, ... (or the given r_list, ascending) until one does not fit."""
  rows, best = [], {}
  for impl in impls:
    lengths = list(r_list) or [1024 * 2**i for i in range(32) if 1024 * 2**i <= max_r]
    for R in lengths:
      c = _config(overrides)
      c.task.max_new_tokens = R
      c.model.attn_impl = impl
      r = {"R": R, "impl": impl, **update_row(c, topology)}
      _print(r)
      rows.append(r)
      if not r["fits"]:
        break
      best[impl] = R
  c = _config(overrides)
  return {"what": "longest task.max_new_tokens (doubling from 1024, or r_list) whose SMD "
                  "learner update fits a chip, qwen3_4b_smd_gsm8k (with `overrides`), AOT for "
                  "a TPU topology",
          "topology": topology, "batch_per_chip": {
              "rollout_rows": c.rl.batch_size // len(tpu_aot.topology_devices(topology)),
              "microbatch_rows": c.rl.batch_size // c.rl.num_minibatches
                                 // c.rl.num_microbatches
                                 // len(tpu_aot.topology_devices(topology))},
          "overrides": list(overrides), "prompt_len": c.task.max_prompt_len,
          "longest_fitting_R": best, "rows": rows}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("mode", choices=("temporaries", "longest"))
  ap.add_argument("--topology", default="v5p:2x2x1")
  ap.add_argument("--lengths", default="4096,8192,16384")
  ap.add_argument("--impls", default="pallas_tpu,reference")
  ap.add_argument("--max_r", type=int, default=65536)
  ap.add_argument("--r_list", default="", help="`longest`: these response lengths instead of "
                  "doubling from 1024 (ascending), e.g. to refine between two powers of two")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="config override for `longest`, e.g. rl.num_microbatches=2")
  ap.add_argument("--layers", type=int, default=36, help="model layers (36: Qwen3-4B)")
  ap.add_argument("--out", default="")
  a = ap.parse_args(argv)
  global LAYERS
  LAYERS = a.layers
  if not tpu_aot.libtpu_available():
    sys.exit("bench/aot_smd.py needs libtpu: pip install -e '.[tpu]'")
  t0 = time.time()
  impls = a.impls.split(",")
  if a.mode == "temporaries":
    out = temporaries(a.topology, [int(x) for x in a.lengths.split(",")], impls)
  else:
    out = longest(a.topology, impls, a.max_r, a.set,
                  [int(x) for x in a.r_list.split(",")] if a.r_list else ())
  out.update(layers=LAYERS, jax_version=aot.jax.__version__,
             libtpu_version=aot.package_version("libtpu"), wall_s=round(time.time() - t0, 1),
             **aot_cli.commit())
  path = a.out or (f"bench/results/aot_smd_{a.mode}_{a.topology.replace(':', '_')}.json")
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(out, f, indent=2)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
