r"""`python -m trm_jax.aot`: the command line of the ahead-of-time compile (the package
docstring has its usage): flags, the report file, one subprocess per program, and the exit
status (0 every program fits, 1 one does not and the knobs that change its memory are
printed, 2 bad input, 3 a program's compiler process died, e.g. out of host memory).

Each program compiles in a subprocess of its own (`--subprocess`, the default): XLA's
compile of one of the 8B config's programs holds several GiB of host memory that a process
never hands back, so the programs of one run compiled in one process add up (over 22 GB at
that config); in turn, each one's memory is released before the next starts. While a
program compiles, a line every `HEARTBEAT_S` seconds says how long and how much host memory
its process holds; the report is rewritten after each program, so a run cut short keeps what
it finished."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Callable, Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the host backend; devices come from topologies

from trm_jax import config as config_lib        # noqa: E402
from trm_jax import gc_tuning                   # noqa: E402
from trm_jax import programs as programs_lib    # noqa: E402
from trm_jax.aot import gpu as gpu_aot          # noqa: E402
from trm_jax.aot import tpu as tpu_aot          # noqa: E402
from trm_jax.aot.compiler import (GiB, KNOWN_MODELS, compile_config, platform_of,  # noqa: E402
                                  resolve_model)
from trm_jax.config import ConfigError          # noqa: E402

HEARTBEAT_S = 60.0   # seconds between progress lines while a program compiles


def main(argv: Sequence[str]) -> int:
  from absl import flags  # pylint: disable=g-import-not-at-top
  gc_tuning.tune_for_tracing()
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
  isolate = flags.DEFINE_bool("subprocess", True, "compile each program in a subprocess of its "
                              "own, which releases its host memory before the next",
                              flag_values=fv)
  row_out = flags.DEFINE_string("row_out", "", "what each program's subprocess runs: compile "
                                "the one program of --programs here and write its report row "
                                "to this path", flag_values=fv)
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
    try:
      if gpu:
        gpu_aot.gpu_spec(topo.value)
        gpu_aot.topology_gpus(topo.value)
      else:
        tpu_aot.chip_spec(topo.value)
        tpu_aot.topology_chips(topo.value)
    except ValueError as e:
      raise ConfigError(str(e)) from e
    if gpu:
      ok, why = gpu_aot.gpu_aot_available()
      if not ok:
        print(f"error: trm_jax.aot for {topo.value}: {why}", file=sys.stderr)
        return 2
    elif not tpu_aot.libtpu_available():
      print("error: trm_jax.aot needs libtpu (TPU compiler): pip install -e '.[tpu]'",
            file=sys.stderr)
      return 2
    stem = os.path.splitext(os.path.basename(spec.partition(":")[0]))[0]
    path = out.value or f"aot_{stem}_{topo.value.replace(':', '_')}.json"
    c = cfg.value
    hf, source = resolve_model(c, model.value, spec.partition(":")[0])
    if row_out.value:   # one program's subprocess: compile it here, quietly
      if len(progs.value) != 1:
        raise ConfigError("--row_out compiles exactly one program: pass --programs=NAME")
      report = compile_config(c, topo.value, hf, programs=progs.value,
                              hlo_dir=hlo_dir.value, gpu_mem_fraction=mem_fraction.value,
                              log=lambda m: None)
      row = report["programs"][0]
      bounds = report["loop_bounds"].get(row["program"])
      write_json(row_out.value, {**row, "loop_bounds": bounds} if bounds else row)
      return 0
    check_writable(path)
    log = lambda m: print(m, flush=True)
    mem = host_memory()
    log(f"[aot] config {spec}; model {source}; host: {os.cpu_count()} CPUs, "
        f"{mem['available'] / GiB:.1f} of {mem['total'] / GiB:.1f} GiB memory available")
    compile_one = subprocess_compiler(argv, log) if isolate.value else None
    extra = {"model_source": source, "host": host(), **commit()}
    report = compile_config(
        c, topo.value, hf, programs=progs.value or None, hlo_dir=hlo_dir.value,
        gpu_mem_fraction=mem_fraction.value, log=log, compile_one=compile_one,
        on_row=lambda r: write_json(path, {**r, **extra, **host_peak(r)}))
  except (ConfigError, flags.Error) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  report = {**report, **extra, **host_peak(report)}
  write_json(path, report)
  print(f"[aot] wrote {path}; host memory at most {report['host_peak_bytes'] / GiB:.1f} GiB "
        f"(this process {report['host_parent_rss_bytes'] / GiB:.1f}, the largest compile "
        f"{report['host_compile_peak_bytes'] / GiB:.1f}); {report['wall_s']:.0f} s")
  if report["failed"]:
    print(f"[aot] not compiled on this host: {', '.join(report['failed'])}", file=sys.stderr)
    return 3
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


def subprocess_compiler(argv: Sequence[str], log: Callable[[str], None]):
  """compile_one(name) -> row: `python -m trm_jax.aot <argv> --programs=NAME --row_out=...`
  (absl keeps a flag's last value), watched from here (`compile_in_subprocess`)."""
  return lambda name: compile_in_subprocess(
      [sys.executable, "-m", "trm_jax.aot", *argv, f"--programs={name}"], name, log)


def compile_in_subprocess(cmd: Sequence[str], name: str, log: Callable[[str], None]) -> dict:
  """Runs `cmd --row_out=FILE` (one program's compile) and returns the row it wrote, with its
  process's peak host memory; while it runs, a line every HEARTBEAT_S seconds. A process
  that dies (killed, e.g. by the kernel's out-of-memory killer, or a compiler error other
  than "does not fit") gives a row {"failed": why} with the tail of its stderr."""
  with tempfile.TemporaryDirectory() as d:
    row_path, err_path = os.path.join(d, "row.json"), os.path.join(d, "stderr.txt")
    t0 = last = time.time()
    with open(err_path, "w") as err:
      proc = subprocess.Popen([*cmd, f"--row_out={row_path}"], stdout=subprocess.DEVNULL,
                              stderr=err)
      while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
          break
        time.sleep(0.5)
        if time.time() - last >= HEARTBEAT_S:
          last = time.time()
          rss, hwm = process_memory(proc.pid)
          log(f"[aot] {name}: compiling for {last - t0:.0f} s; its process holds "
              f"{rss / GiB:.1f} GiB of host memory (peak {hwm / GiB:.1f})")
    peak = usage.ru_maxrss * 1024     # Linux: KiB
    wall = round(time.time() - t0, 1)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and os.path.exists(row_path):
      with open(row_path) as f:
        return {**json.load(f), "host_peak_rss_bytes": peak, "process_s": wall}
    code = (f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
            else f"exited with status {os.WEXITSTATUS(status)}")
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9:
      code += " (the kernel's out-of-memory killer sends it)"
    with open(err_path, errors="replace") as f:
      tail = [l.rstrip() for l in f.readlines()[-6:]]
    log(f"[aot] {name}: its compiler process {code} after {wall} s at "
        f"{peak / GiB:.1f} GiB of host memory; last lines of its stderr:\n  " +
        "\n  ".join(tail))
    return {"failed": f"compiler process {code} after {wall} s at {peak / GiB:.1f} GiB of "
                      "host memory", "stderr_tail": tail, "host_peak_rss_bytes": peak,
            "process_s": wall}


def process_memory(pid: int) -> tuple[int, int]:
  """(resident, peak resident) bytes of a process (/proc/PID/status VmRSS, VmHWM); (0, 0)
  where /proc is not available."""
  got = {}
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
          got[key] = int(value.split()[0]) * 1024
  except OSError:
    pass
  return got.get("VmRSS", 0), got.get("VmHWM", 0)


def host_memory() -> dict:
  """Total and available host memory in bytes (/proc/meminfo; 0 where it is missing)."""
  got = {}
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        got[key] = int(value.split()[0]) * 1024
  except OSError:
    pass
  return {"total": got.get("MemTotal", 0), "available": got.get("MemAvailable", 0)}


def host() -> dict:
  """The machine the compile ran on (compile times and host memory depend on it)."""
  return {"platform": platform.platform(), "cpus": os.cpu_count(),
          "memory_bytes": host_memory()["total"],
          "load_average": [round(x, 2) for x in os.getloadavg()]}


def host_peak(report: dict) -> dict:
  """This process's peak resident memory, the largest program's compile (its own process's,
  or this process's when compiled here) and their sum: the host memory the run needed."""
  import resource  # pylint: disable=g-import-not-at-top
  parent = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  compiles = max((r.get("host_peak_rss_bytes", 0) for r in report["programs"]), default=0)
  isolated = any("process_s" in r for r in report["programs"])
  return {"host_parent_rss_bytes": parent, "host_compile_peak_bytes": compiles,
          "host_peak_bytes": parent + compiles if isolated else max(parent, compiles)}


def commit() -> dict:
  """The git commit of the code that compiled (when run from a checkout), and whether its
  tracked files differ from it."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  try:
    head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                          text=True, timeout=30, check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=30, check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return {"commit": None, "dirty": None}
  return {"commit": head, "dirty": bool(dirty.strip())}


def check_writable(path: str) -> None:
  """ConfigError naming `path` unless the report can be written there (its folder made if
  needed): checked before anything compiles."""
  folder = os.path.dirname(path) or "."
  up = folder
  while up and not os.path.exists(up):
    up = os.path.dirname(up)
  if up and not os.path.isdir(up):
    raise ConfigError(f"--out {path}: {up} is a file, not a directory")
  try:
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".aot_check_"):
      pass
  except OSError as e:
    raise ConfigError(f"--out {path}: cannot write the report there ({e.strerror}: "
                      f"{e.filename})") from e
  if os.path.isdir(path):
    raise ConfigError(f"--out {path}: is a directory; name the report file")


def write_json(path: str, obj: dict) -> None:
  """`obj` written to `path` whole or not at all (a temporary file renamed over it)."""
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2)
  os.replace(tmp, path)
