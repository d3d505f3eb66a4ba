"""Per-op time of a compiled XLA:CPU program, from `jax.profiler`'s trace.

XLA:CPU runs a compiled program as thunks, one per top-level HLO instruction (a fusion, a
library dot, a loop's body op), and the profiler records each thunk's run as an event named
by the instruction. `op_table` reads the compiled module's text (`compiled.as_text()`): each
instruction's result shape and the `op_name`s of the JAX operations it was built from (its
own and those of the computations it calls), which is what a caller classifies ops by.
`thunk_times` runs a call under the profiler and sums each instruction's events.

Times are thread time per thunk: XLA's CPU runtime runs independent thunks concurrently, so
their sum can exceed the call's wall time; `bench.decode_profile` and `bench.rl_step` report
the wall time beside it and shares of the summed time.
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import shutil
import tempfile
import time
from typing import Callable

import jax

from bench import hygiene


def op_table(hlo: str) -> dict[str, tuple[list[str], str]]:
  """Instruction name -> (op names of it and of the computations it calls, result shape)."""
  comps, cur = {}, None
  for line in hlo.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if m and not line.startswith(" "):
      cur = m.group(1)
      comps[cur] = []
    elif cur is not None:
      comps[cur].append(line)
  out = {}
  for lines in comps.values():
    for line in lines:
      m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ", line)
      if not m:
        continue
      names = re.findall(r'op_name="([^"]+)"', line)
      calls = re.findall(r"(?:calls|body|condition|to_apply)=%?([\w.\-]+)", line)
      for c in calls:
        for inner in comps.get(c, ()):
          names += re.findall(r'op_name="([^"]+)"', inner)
      out[m.group(1)] = (names, m.group(2))
  return out


def thunk_times(call: Callable[[], object], names) -> dict:
  """Runs `call()` (which blocks until its results are ready) once under the profiler.

  Returns wall_s, us (Counter: microseconds per instruction of `names`), calls (Counter: events
  per instruction) and contention (`bench.hygiene.Probe`'s record of the call)."""
  tmp = tempfile.mkdtemp(prefix="xla_profile_")
  try:
    probe = hygiene.Probe()
    jax.profiler.start_trace(tmp)
    probe.start()
    t0 = time.perf_counter()
    call()
    wall = time.perf_counter() - t0
    contention = probe.stop()
    jax.profiler.stop_trace()
    trace = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)[-1]
    with gzip.open(trace) as f:
      events = json.load(f)["traceEvents"]
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  us, calls = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and e["name"] in names:
      us[e["name"]] += e["dur"]
      calls[e["name"]] += 1
  return dict(wall_s=wall, us=us, calls=calls, contention=contention)
