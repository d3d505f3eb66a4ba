r"""`python -m trm_jax.aot`: the command line of the ahead-of-time compile (the package
docstring has its usage): flags, the report file and the exit status (0 every program fits,
1 one does not and the knobs that change its memory are printed, 2 bad input)."""
from __future__ import annotations

import json
import os
import sys
from typing import Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the host backend; devices come from topologies

from trm_jax import config as config_lib        # noqa: E402
from trm_jax import programs as programs_lib    # noqa: E402
from trm_jax.aot import gpu as gpu_aot          # noqa: E402
from trm_jax.aot import tpu as tpu_aot          # noqa: E402
from trm_jax.aot.compiler import KNOWN_MODELS, compile_config, platform_of, resolve_model  # noqa: E402,E501
from trm_jax.config import ConfigError          # noqa: E402


def main(argv: Sequence[str]) -> int:
  from absl import flags  # pylint: disable=g-import-not-at-top
  fv = flags.FlagValues()
  cfg = config_lib.define_config_flag(flag_values=fv)
  topo = flags.DEFINE_string("topology", None, "TPU topology, e.g. v5p:4x4x4", flag_values=fv)
  model = flags.DEFINE_string("model", "", f"{' | '.join(KNOWN_MODELS)} | checkpoint dir | "
                              "config.json (default: see the module docstring)", flag_values=fv)
  progs = flags.DEFINE_list("programs", [], "programs to compile (default: every program the "
                            "trainer runs for the config)", flag_values=fv)
  out = flags.DEFINE_string("out", "", "report path (default aot_<config>_<topology>.json)",
                            flag_values=fv)
  mem_fraction = flags.DEFINE_float(
      "gpu_mem_fraction", 0.75, "a GPU topology's usable share of HBM (jax preallocates 75%% "
      "by default: XLA_PYTHON_CLIENT_MEM_FRACTION)", flag_values=fv)
  hlo_dir = flags.DEFINE_string("hlo_dir", "", "also write each program's optimized HLO "
                                "(one device's program) into this directory", flag_values=fv)
  try:
    argv, spec = config_lib.config_argv(argv, example="configs/qwen3_8b_dapo_trm.py")
    # config_flags reads the `--config.x=` overrides from sys.argv itself.
    saved, sys.argv = sys.argv, [sys.argv[0], *argv]
    try:
      fv(sys.argv)
    finally:
      sys.argv = saved
    if not topo.value:
      raise ConfigError("--topology is required, e.g. v5p:4x4x4, v6e:16x16, v5e:2x2, h200:8")
    gpu = platform_of(topo.value) == "gpu"
    if gpu:
      ok, why = gpu_aot.gpu_aot_available()
      if not ok:
        print(f"error: trm_jax.aot for {topo.value}: {why}", file=sys.stderr)
        return 2
    elif not tpu_aot.libtpu_available():
      print("error: trm_jax.aot needs libtpu (TPU compiler): pip install -e '.[tpu]'",
            file=sys.stderr)
      return 2
    try:
      if gpu:
        gpu_aot.gpu_spec(topo.value)
        gpu_aot.topology_gpus(topo.value)
      else:
        tpu_aot.chip_spec(topo.value)
        tpu_aot.topology_chips(topo.value)
    except ValueError as e:
      raise ConfigError(str(e)) from e
    c = cfg.value
    hf, source = resolve_model(c, model.value, spec.partition(":")[0])
    print(f"[aot] config {spec}; model {source}", flush=True)
    report = compile_config(c, topo.value, hf, programs=progs.value or None,
                            hlo_dir=hlo_dir.value, gpu_mem_fraction=mem_fraction.value,
                            log=lambda m: print(m, flush=True))
  except (ConfigError, flags.Error) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  report["model_source"] = source
  stem = os.path.splitext(os.path.basename(spec.partition(":")[0]))[0]
  path = out.value or f"aot_{stem}_{topo.value.replace(':', '_')}.json"
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(report, f, indent=2)
  print(f"[aot] wrote {path}")
  if not report["fits"]:
    for row in report["programs"]:
      if not row["fits"]:
        print(f"[aot] {row['program']} does not fit on {topo.value}; knobs that change its "
              "memory:\n  " + "\n  ".join(programs_lib.memory_knobs(row["program"])),
              file=sys.stderr)
    return 1
  if report["step_roofline_s"] is not None:
    print(f"[aot] every program fits; roofline lower bound of one RL step "
          f"{report['step_roofline_s']:.3g} s" + (
              f", of one evaluation {report['evaluation_roofline_s']:.3g} s"
              if report["evaluation_roofline_s"] is not None else ""))
  else:
    print("[aot] every program fits")
  return 0
