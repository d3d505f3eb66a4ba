"""FLOPs and bytes of a compiled XLA program with every while loop counted per trip.

`Compiled.cost_analysis()` walks the optimized HLO once: the body of a while loop (a
`lax.scan` over microbatches or vocabulary chunks, the sampler's decode loop) is counted once
whatever its trip count, and a Mosaic kernel (a `tpu_custom_call`) counts zero FLOPs. For a
roofline of a training step both matter, so `program_cost` re-counts:

  * each computation is costed on its own (XLA's HloCostAnalysis on the module re-rooted at
    that computation) and multiplied by the number of times it runs in one call of the
    program: its *executions*;
  * a loop's body runs (its parent's executions) x (its trip count) times when the trip count
    is known: XLA's `known_trip_count` where the compiler recorded one (the CPU compiler
    does), else read from the loop when its condition is `counter < constant` and its body
    adds a constant step (what `lax.scan`, `fori_loop` and XLA's windowed einsums lower to;
    the start is the initial tuple's constant, else 0). These counts are exact;
  * a loop whose exit depends on data (the sampler's `any row still decoding`) has no trip
    count. The program that wrote it declares, per loop, how many times its body runs in one
    call at most (`bounds`: the loop's `jax.named_scope` -> executions; the sampler's
    `decode_schedule`, from the config's sizes). That count replaces (parent executions x
    trips): bounds are totals over the call, never multiplied by another count. A
    data-dependent loop with no declared bound is counted once per entry and says so
    (`unbounded` in the result);
  * a conditional counts its most expensive branch each time it runs (XLA's rule);
  * the TPU attention kernels (`vis_flash_tpu_fwd`, `_bwd_dq`, `_bwd_dkdv`, see
    kernels/flash_attention_tpu.py) are counted analytically from their per-chip operand
    shapes: 2, 3 and 4 matmuls of 2*B*N*H*T^2/2 FLOPs (causal half; the kernel skips blocks
    above the diagonal); their bytes are operands and results once, as XLA:TPU counts a
    custom call (a lower bound on the kernel's traffic);
  * the Triton attention kernels (`vis_flash_fwd`, `_bwd_dq`, `_bwd_dkdv`, named in the
    custom call's op_name; kernels/flash_attention.py) likewise, from their per-device q
    [B, T, N, H]: XLA:GPU's cost analysis counts a `__gpu$xla.gpu.triton` call as 0 FLOPs.

Bytes are XLA's cost model, which charges every unfused instruction its operands and
results: a same-width bitcast-convert around an in-place cache update counts the whole
cache twice, so the memory-bound figures are estimates of the compiled program's traffic,
not a proof of a floor. All figures are per device: the HLO of an SPMD program is one
device's program.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Optional

# Matmuls per attention kernel call (forward: q k^T and p v; dq: s, dO v^T, dS k; dk/dv: s^T,
# p^T dO, v dO^T, dS^T q).
KERNEL_MATMULS = {"vis_flash_tpu_fwd": 2, "vis_flash_tpu_bwd_dq": 3, "vis_flash_tpu_bwd_dkdv": 4}
# The Triton kernels' names (GPU), by the same count; matched in the call's op_name metadata.
TRITON_KERNEL_MATMULS = {"vis_flash_fwd": 2, "vis_flash_bwd_dq": 3, "vis_flash_bwd_dkdv": 4}

_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\{$")
_WHILE = re.compile(r"while\(.*condition=%([\w.\-]+), body=%([\w.\-]+)")
_CALLS = re.compile(r"(?:calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_REF = re.compile(r"%([\w.\-]+)")
_CUSTOM = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = .*custom_call_target="tpu_custom_call"')
_TRITON = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = .*custom_call_target="__gpu\$xla\.gpu\.triton"'
                     r'.*op_name="[^"]*/(vis_flash_fwd|vis_flash_bwd_dq|vis_flash_bwd_dkdv)/')
_SHAPE = re.compile(r"(?:bf16|f32|f16|s32)\[([\d,]+)\]")


@dataclasses.dataclass
class Loop:
  """One while loop of the program."""
  body: str               # computation name
  parent: str             # computation holding the while
  scope: str              # the named scope the program wrote it in ("" for XLA's own loops)
  trips: Optional[int]    # iterations per entry when known (None: data-dependent)
  executions: int         # times its body runs in one call of the program
  source: str             # "known_trip_count" (XLA's), "condition" (read from the loop),
                          #   "bound" (declared by the program, see `bounds`) or
                          #   "unbounded (once per entry)"
  flops: float = 0.0      # everything its body runs over those executions (nested loops
  bytes: float = 0.0      #   and kernels included)


def _computations(text: str) -> tuple[dict[str, list[str]], dict[str, str], str]:
  """(name -> instruction lines, name -> header line without ENTRY, entry name).

  headers[""] is the module's preamble (the stack-frame tables that instruction metadata
  refers to, printed between the HloModule line and the first computation)."""
  comps, headers, entry, name = {}, {"": []}, None, None
  for i, line in enumerate(text.splitlines()):
    m = _HEADER.match(line)
    if not comps and not m:
      if i:
        headers[""].append(line)
      continue
    if m:
      name = m.group(2)
      comps[name], headers[name] = [], line[len("ENTRY "):] if m.group(1) else line
      if m.group(1):
        entry = name
    elif line.startswith("}"):
      name = None
    elif name is not None:
      comps[name].append(line)
  if entry is None:
    raise ValueError("HLO text has no ENTRY computation")
  headers[""] = "\n".join(headers[""])
  return comps, headers, entry


def _rooted_text(comps: dict[str, list[str]], headers: dict[str, str], root: str) -> str:
  """An HLO module of the computations `root` reaches, with `root` as its entry.

  Any `%name` in an instruction that names a computation counts as a reference (a superset
  of the called ones; an unreferenced extra computation is harmless). Order is kept:
  the printer writes callees before callers.
  """
  seen, stack = {root}, [root]
  while stack:
    for line in comps[stack.pop()]:
      for ref in _REF.findall(line):
        if ref in comps and ref not in seen:
          seen.add(ref)
          stack.append(ref)
  blocks = []
  for name in comps:
    if name in seen:
      head = ("ENTRY " if name == root else "") + headers[name]
      blocks.append("\n".join([head, *comps[name], "}"]))
  return "HloModule rooted\n" + headers[""] + "\n" + "\n\n".join(blocks) + "\n"


_DEF = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$")


def _defs(lines: list[str]) -> dict[str, str]:
  """instruction name -> its right-hand side."""
  out = {}
  for l in lines:
    m = _DEF.match(l)
    if m:
      out[m.group(1)] = m.group(2)
  return out


def _operands(rhs: str, op: str) -> list[str]:
  """Operand names of `op(...)` in an instruction's right-hand side."""
  m = re.search(re.escape(op) + r"\((.*?)\)(?:,|$)", rhs)
  if not m:
    return []
  return re.findall(r"%([\w.\-]+)", re.sub(r"/\*.*?\*/", "", m.group(1)))


def _const(defs: dict[str, str], name: str) -> Optional[int]:
  m = re.match(r"[su](?:32|64)\[\]\S* constant\((-?\d+)\)", defs.get(name, ""))
  return int(m.group(1)) if m else None


def _gte_index(defs: dict[str, str], name: str) -> Optional[int]:
  """Tuple index that `name` reads from the loop parameter (through copies and bitcasts)."""
  for _ in range(8):
    rhs = defs.get(name, "")
    m = re.search(r"get-tuple-element\(%[\w.\-]+\), index=(\d+)", rhs)
    if m:
      return int(m.group(1))
    m = re.search(r" (?:copy|bitcast|convert)\(%([\w.\-]+)\)", rhs)
    if not m:
      return None
    name = m.group(1)
  return None


def _trip_count(cond: list[str], body: list[str], parent: list[str],
                while_line: str) -> Optional[tuple[int, str]]:
  """(trips, how they were found) of a loop whose trip count is known: XLA's own analysis
  when it wrote one into the loop's backend config ("known_trip_count", as the CPU compiler
  does for loops whose condition it rewrote), else read from a condition `counter < N` (N a
  constant) whose body adds a constant step to the counter, the counter starting at a
  constant (0 when the start is not a visible constant: what lax.scan and fori_loop lower
  to), "condition". None otherwise (a data-dependent exit)."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', while_line)
  if known:
    return int(known.group(1)), "known_trip_count"
  cdefs = _defs(cond)
  root = next((l for l in cond if l.lstrip().startswith("ROOT ")), "")
  m = re.search(r"compare\(%([\w.\-]+), %([\w.\-]+)\), direction=LT", root)
  if not m or _const(cdefs, m.group(2)) is None:
    return None
  limit, index = _const(cdefs, m.group(2)), _gte_index(cdefs, m.group(1))
  if index is None:
    return None
  bdefs = _defs(body)
  broot = next((l for l in body if l.lstrip().startswith("ROOT ")), "")
  outs = _operands(_DEF.match(broot).group(2), "tuple") if _DEF.match(broot) else []
  if index >= len(outs):
    return None
  step = None
  added = _operands(bdefs.get(outs[index], ""), "add")
  if len(added) == 2:
    for x, y in (added, added[::-1]):
      if _gte_index(bdefs, x) == index and _const(bdefs, y):
        step = _const(bdefs, y)
  if not step or step < 0:
    return None
  pdefs = _defs(parent)
  init = _operands(while_line, "while")
  start = 0
  if init:
    elems = _operands(pdefs.get(init[0], ""), "tuple")
    if index < len(elems) and _const(pdefs, elems[index]) is not None:
      start = _const(pdefs, elems[index])
  return max(0, -(-(limit - start) // step)), "condition"


def _executions(known: Optional[tuple[int, str]], bound: Optional[int],
                runs: int) -> tuple[Optional[int], int, str]:
  """(trips per entry or None, body executions over the call, source) of a while loop whose
  parent runs `runs` times: `known` is `_trip_count`'s (trips, source), `bound` the total the
  program declared for a data-dependent loop (never multiplied by `runs`); a data-dependent
  loop with neither is counted once per entry."""
  if known is not None:
    return known[0], runs * known[0], known[1]
  if bound is not None:
    return None, bound, "bound"
  return None, runs, "unbounded (once per entry)"


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4}
_ANY_SHAPE = re.compile(r"(pred|s8|u8|bf16|f16|s32|u32|f32)\[([\d,]*)\]")


def _nbytes(text: str) -> int:
  total = 0
  for dtype, dims in _ANY_SHAPE.findall(text):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += _BYTES[dtype] * n
  return total


def kernel_cost(line: str) -> tuple[float, float]:
  """(FLOPs, bytes) of one Mosaic kernel call from its HLO line; (0, 0) for other lines.

  Bytes are the call's operands and results once (what XLA:TPU's own cost analysis counts
  for a custom call, and a lower bound on the kernel's traffic); FLOPs are analytic for the
  attention kernels and 0 for any other Mosaic kernel.
  """
  t = _TRITON.match(line)
  if t:
    return _triton_kernel_cost(line, t.group(2))
  m = _CUSTOM.match(line)
  if not m:
    return 0.0, 0.0
  head = line.split("backend_config=", 1)[0]
  results = head.split(" = ", 1)[1].split(" custom-call(", 1)[0]
  operands = head.split("operand_layout_constraints={", 1)[1] if "operand_layout_" in head else ""
  nbytes = float(_nbytes(results) + _nbytes(operands))
  # Instruction names carry the kernel's name behind transform prefixes (jvp_, transpose_).
  kernel = next((k for k in KERNEL_MATMULS if k in m.group(1)), None)
  if not kernel:
    return 0.0, nbytes
  shapes = [tuple(int(d) for d in s.split(",")) for s in _SHAPE.findall(head)]
  stats = [s for s in shapes if len(s) == 4 and s[2] == 1]      # lse / delta [B, N, 1, T]
  if not stats:
    raise ValueError(f"attention kernel {kernel} without a [B, N, 1, T] operand: "
                     f"{head[:300]}")
  B, N, _, T = stats[0]
  rows = [s[2] for s in shapes if len(s) == 3 and s[:2] == (B, T)]   # q/k/v [B, T, heads*H]
  H = max(rows) // N
  return KERNEL_MATMULS[kernel] * 2.0 * B * N * H * T * T / 2, nbytes


def _triton_kernel_cost(line: str, kernel: str) -> tuple[float, float]:
  """(FLOPs, bytes) of one Triton attention kernel call: its first operand is q [B, T, N, H]
  (T and H as padded for the kernel), FLOPs the causal half of its matmuls."""
  head = line.split("backend_config=", 1)[0]
  results = head.split(" = ", 1)[1].split(" custom-call(", 1)[0]
  operands = head.split("operand_layout_constraints={", 1)[1] if "operand_layout_" in head else ""
  shapes = [tuple(int(d) for d in s.split(",")) for s in _SHAPE.findall(operands)]
  if not shapes or len(shapes[0]) != 4:
    raise ValueError(f"Triton attention kernel {kernel} without a [B, T, N, H] first operand: "
                     f"{head[:300]}")
  B, T, N, H = shapes[0]
  nbytes = float(_nbytes(results) + _nbytes(operands))
  return TRITON_KERNEL_MATMULS[kernel] * 2.0 * B * N * H * T * T / 2, nbytes


def program_cost(compiled, *, bounds: Optional[Mapping[str, int]] = None) -> dict:
  """Loop-aware FLOPs and bytes accessed of a `jax.stages.Compiled` (per device); `bounds`
  as in `hlo_text_cost`."""
  text = compiled.runtime_executable().hlo_modules()[0].to_string()
  xla = compiled.cost_analysis() or {}
  del compiled
  return hlo_text_cost(text, bounds=bounds, xla=xla)


def loop_scope(while_line: str) -> tuple[str, bool]:
  """(the named scope a while loop was written in, whether the program wrote it) from its
  op_name: ".../decode_bucket640_chunks/while" -> ("decode_bucket640_chunks", True). XLA's own loops
  (windowed einsums, a scatter's expansion) name the op they implement, not "while"."""
  op = re.search(r'op_name="([^"]*)"', while_line)
  parts = op.group(1).split("/") if op else []
  if not parts or parts[-1] != "while":
    return "", False
  return (parts[-2] if len(parts) > 1 else ""), True


def hlo_text_cost(text: str, *, bounds: Optional[Mapping[str, int]] = None,
                  xla: Optional[dict] = None) -> dict:
  """`program_cost` of an optimized HLO module's text (`Compiled.as_text()`).

  bounds: named scope -> how many times the body of the data-dependent while loop written in
    that scope runs in one call of the program (its total over the call, whatever encloses
    it). A bound that matches no loop of the program, or more than one, is an error: the
    compiler renamed or duplicated it, and the count would be wrong.
  xla: the program's own `cost_analysis()`, reported beside (empty: those fields are 0).

  Returns a dict: flops, bytes_accessed (every loop body times its executions, kernels
  included), kernel_flops, xla_flops and xla_bytes (XLA's counts, each loop body once), loops
  (one `Loop` dict per while loop), unbounded (the bodies of data-dependent loops counted
  once per entry for want of a bound).
  """
  from jax._src.lib import _jax   # pylint: disable=g-import-not-at-top
  from jaxlib import _hlo        # pylint: disable=g-import-not-at-top
  import jax                     # pylint: disable=g-import-not-at-top

  bounds = dict(bounds or {})
  comps, headers, entry = _computations(text)
  client = jax.devices("cpu")[0].client
  xla_cache: dict[str, tuple[float, float]] = {}

  def xla_cost(name: str) -> tuple[float, float]:
    """XLA's own count (nested loop bodies once) of the module re-rooted at `name` (the
    header's entry attributes, aliasing and layouts, belong to the old entry and go)."""
    if name not in xla_cache:
      mod = _hlo.hlo_module_from_text(_rooted_text(comps, headers, name))
      c = _jax.hlo_module_cost_analysis(client, mod)
      xla_cache[name] = (max(float(c.get("flops", 0.0)), 0.0),
                         max(float(c.get("bytes accessed", 0.0)), 0.0))
    return xla_cache[name]

  def walk(name: str, seen: frozenset) -> tuple[list[tuple], float, float]:
    """(while loops reachable without entering a loop body as (condition, body, named
    scope, (trips, source) or None, written in the program), kernel FLOPs, kernel bytes) of
    computation `name` and the computations it calls."""
    found, kflops, kbytes = [], 0.0, 0.0
    for line in comps.get(name, ()):
      w = _WHILE.search(line)
      if w:
        scope, written = loop_scope(line)
        found.append((w.group(1), w.group(2), scope,
                      _trip_count(comps.get(w.group(1), []), comps.get(w.group(2), []),
                                  comps[name], line), written))
        continue
      f, b = kernel_cost(line)
      kflops, kbytes = kflops + f, kbytes + b
      called = _CALLS.findall(line)
      for br in _BRANCHES.findall(line):
        called += [c.strip().lstrip("%") for c in br.split(",") if c.strip()]
      for c in called:
        if c in comps and c not in seen:
          sub, f, b = walk(c, seen | {c})
          found, kflops, kbytes = found + sub, kflops + f, kbytes + b
    return found, kflops, kbytes

  loops: list[Loop] = []
  used: dict[str, int] = {}

  def total(name: str, runs: int) -> tuple[float, float, float]:
    """(flops, bytes, kernel flops) of `runs` executions of computation `name`, its loops
    expanded and kernels included."""
    once_flops, once_bytes = xla_cost(name)
    whiles, kflops, kbytes = walk(name, frozenset({name}))
    flops, nbytes = runs * (once_flops + kflops), runs * (once_bytes + kbytes)
    kflops *= runs
    for cond, body, scope, known, written in whiles:
      declared = written and scope in bounds
      used[scope] = used.get(scope, 0) + declared
      trips, execs, source = _executions(known, bounds[scope] if declared else None, runs)
      b_flops, b_bytes, b_kernel = total(body, execs)
      # XLA's count of `name` holds one pass of the body and one of the condition per
      # execution of `name`; the condition runs once more per entry than the body.
      body_flops, body_bytes = xla_cost(body)
      cond_flops, cond_bytes = xla_cost(cond)
      b_flops, b_bytes = b_flops + execs * cond_flops, b_bytes + execs * cond_bytes
      flops += b_flops - runs * body_flops
      nbytes += b_bytes - runs * body_bytes
      kflops += b_kernel
      loops.append(Loop(body=body, parent=name, scope=scope, trips=trips, executions=execs,
                        source=source, flops=b_flops, bytes=b_bytes))
    return flops, nbytes, kflops

  flops, nbytes, kflops = total(entry, 1)
  wrong = {k: used.get(k, 0) for k in bounds if used.get(k, 0) != 1}
  if wrong:
    raise ValueError("declared loop bounds must each match one data-dependent while loop "
                     "of the program; loops matched per scope: " +
                     ", ".join(f"{k}: {n}" for k, n in sorted(wrong.items())))
  xla = xla or {}
  return {"flops": flops, "bytes_accessed": nbytes, "kernel_flops": kflops,
          "xla_flops": float(xla.get("flops", 0.0)),
          "xla_bytes": float(xla.get("bytes accessed", 0.0)),
          "loops": [dataclasses.asdict(l) for l in loops],
          "unbounded": [l.body for l in loops if l.source.startswith("unbounded")]}


# Collective ops and how many bytes one call moves per device, for `collective_bytes`.
COLLECTIVES = ("ragged-all-to-all", "all-to-all", "all-gather", "reduce-scatter", "all-reduce",
               "collective-permute")
_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (.*?) (" + "|".join(COLLECTIVES) +
                         r")(-start)?\((.*)$")


def collective_bytes(text: str, *, bounds: Optional[Mapping[str, int]] = None) -> dict:
  """Bytes each kind of collective moves per device in one call of an optimized HLO module,
  every while loop's body counted by its executions (trip counts, and `bounds` for
  data-dependent loops, as in `hlo_text_cost`).

  A collective counts its result (an async `-start` its largest buffer): what a device holds
  after an all-gather or all-to-all, the buffer an all-reduce sums. A `ragged-all-to-all`
  counts the smaller of its input and output buffers: the rows it moves when routing is
  balanced (an MoE dispatch sends its m * k pairs into a buffer of n * m * k rows, and the
  return sends them back into m * k rows); the rows it moves are data-dependent.
  """
  bounds = dict(bounds or {})
  comps, _, entry = _computations(text)
  cache: dict[tuple[str, int], dict] = {}

  def buffers(rhs: str) -> list[int]:
    """Bytes of each array of an instruction's result (an async start's tuple holds its
    operands, then its result)."""
    result = rhs.split(" ", 1)[0] if not rhs.startswith("(") else rhs[:rhs.rindex(")") + 1]
    return [_nbytes(s) for s in re.findall(r"\w+\[[\d,]*\]", result)]

  def count(name: str, runs: int) -> dict:
    """Bytes per kind of `runs` executions of computation `name`."""
    if (name, runs) in cache:
      return cache[name, runs]
    cache[name, runs] = out = {}
    lines = comps.get(name, ())
    defs = _defs(lines)

    def add(kind, n):
      out[kind] = out.get(kind, 0) + n
    for line in lines:
      w = _WHILE.search(line)
      if w:
        scope, written = loop_scope(line)
        known = _trip_count(comps.get(w.group(1), []), comps.get(w.group(2), []), lines, line)
        _, execs, _ = _executions(known, bounds.get(scope) if written else None, runs)
        for kind, n in count(w.group(2), execs).items():
          add(kind, n)
        continue
      m = _COLLECTIVE.match(line)
      if m:
        sizes = buffers(m.group(1))
        nbytes = max(sizes, default=0)
        if m.group(2) == "ragged-all-to-all":   # the smaller of input and output buffer
          if m.group(3):
            nbytes = min(sizes[:2])
          else:
            first = re.findall(r"%([\w.\-]+)", m.group(4))[:1]
            if first and first[0] in defs:
              nbytes = min(nbytes, max(buffers(defs[first[0]]), default=nbytes))
        add(m.group(2), runs * nbytes)
        continue
      called = _CALLS.findall(line)
      for br in _BRANCHES.findall(line):
        called += [c.strip().lstrip("%") for c in br.split(",") if c.strip()]
      for c in called:
        if c in comps and c != name:
          for kind, n in count(c, runs).items():
            add(kind, n)
    return out

  return {k: float(v) for k, v in count(entry, 1).items()}
