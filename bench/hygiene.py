"""Is the machine quiet? Load and other processes' CPU time around each timed call.

A benchmark on a shared machine measures the machine as much as the code: other processes
slow torch's thread pool far more than XLA's, so a ratio measured under load can be several
times the quiet one. Every timed call of the benchmarks goes through a `Probe`, which records

  load          os.getloadavg() before and after (1, 5, 15 minutes; includes this process);
  other_cpu_s   CPU seconds the whole machine spent busy (/proc/stat: user, nice, system, irq,
                softirq, steal) minus this process's own CPU time (getrusage, all threads);
  steal_s       CPU time the hypervisor gave to other guests (/proc/stat steal);
  other_cores   other_cpu_s / wall: how many cores others used on average during the call;

and flags the call `contended` when others used more than `OTHER_CORES_LIMIT` cores on average
plus two ticks of /proc/stat's resolution (a 60 ms call otherwise reads one stray kernel tick as
0.17 cores). A benchmark
reports a ratio as a result only from rounds in which no timed call was contended.
`wait_for_quiet` waits (bounded) for the 1-minute load to drop before a run starts.
"""
from __future__ import annotations

import os
import platform
import resource
import time
from typing import Optional

# Busy CPU time of other processes, in cores averaged over a call, above which the call is
# contended. Idle, this machine's kernel threads use about 0.01-0.02 cores; /proc/stat counts
# in 10 ms ticks per core, so a 1 s call reads other_cores to about +-0.03.
OTHER_CORES_LIMIT = 0.1
_HZ = os.sysconf("SC_CLK_TCK")
_SLACK_TICKS = 2


def _proc_stat() -> Optional[tuple[float, float]]:
  """(busy seconds, steal seconds) of all CPUs since boot, or None off Linux."""
  try:
    with open("/proc/stat") as f:
      fields = f.readline().split()
  except OSError:
    return None
  v = [int(x) for x in fields[1:]]
  user, nice, system, _idle, _iowait, irq, softirq = v[:7]
  steal = v[7] if len(v) > 7 else 0
  return (user + nice + system + irq + softirq + steal) / _HZ, steal / _HZ


def _own_cpu() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  c = resource.getrusage(resource.RUSAGE_CHILDREN)
  return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime


class Probe:
  """`p = Probe(); p.start(); ...timed call...; info = p.stop()`."""

  def start(self) -> "Probe":
    self._load = os.getloadavg()
    self._stat = _proc_stat()
    self._own = _own_cpu()
    self._t = time.perf_counter()
    return self

  def stop(self) -> dict:
    wall = time.perf_counter() - self._t
    own = _own_cpu() - self._own
    stat = _proc_stat()
    out = dict(wall_s=round(wall, 4), own_cpu_s=round(own, 3),
               load_before=[round(x, 2) for x in self._load],
               load_after=[round(x, 2) for x in os.getloadavg()])
    if stat is None or self._stat is None:
      out.update(other_cpu_s=None, steal_s=None, other_cores=None, contended=None)
      return out
    busy = stat[0] - self._stat[0]
    other = max(busy - own, 0.0)
    out.update(other_cpu_s=round(other, 3), steal_s=round(stat[1] - self._stat[1], 3),
               other_cores=round(other / max(wall, 1e-9), 3))
    out["contended"] = bool(other > OTHER_CORES_LIMIT * wall + _SLACK_TICKS / _HZ)
    return out


def timed(fn, *args, **kwargs):
  """(seconds, probe info, result) of fn(*args, **kwargs)."""
  p = Probe().start()
  r = fn(*args, **kwargs)
  info = p.stop()
  return info["wall_s"], info, r


def wait_for_quiet(max_load: float = 0.5, timeout_s: float = 0.0, poll_s: float = 15.0) -> dict:
  """Waits until the 1-minute load is below max_load, at most timeout_s; says what it saw."""
  t0 = time.time()
  while os.getloadavg()[0] >= max_load and time.time() - t0 < timeout_s:
    time.sleep(poll_s)
  load = os.getloadavg()
  return dict(load=[round(x, 2) for x in load], waited_s=round(time.time() - t0, 1),
              quiet=load[0] < max_load, max_load=max_load)


def machine() -> dict:
  cpu = platform.processor()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  return dict(platform=platform.platform(), cpu=cpu, cpus=os.cpu_count(),
              load_average=[round(x, 2) for x in os.getloadavg()])


def write_json(result: dict, path: str) -> None:
  """Writes a benchmark's result to `path` (its folder made if needed) and says so."""
  import json  # pylint: disable=g-import-not-at-top
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  print("wrote", path)
