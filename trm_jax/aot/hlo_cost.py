"""FLOPs and bytes of a compiled XLA program with every while loop counted per trip.

`Compiled.cost_analysis()` walks the optimized HLO once: the body of a while loop (a
`lax.scan` over microbatches or vocabulary chunks, the sampler's decode loop) is counted once
whatever its trip count, and a Mosaic kernel (a `tpu_custom_call`) counts zero FLOPs. For a
roofline of a training step both matter, so `program_cost` re-counts:

  * each while body is costed on its own (XLA's HloCostAnalysis on the module re-rooted at
    that computation) and multiplied by its trip count, recursively for nested loops;
  * the trip count is XLA's `known_trip_count` where the compiler recorded one (the CPU
    compiler does), else read from the loop when its condition is `counter < constant` and
    its body adds a constant step (what `lax.scan`, `fori_loop` and XLA's windowed einsums
    lower to; the start is the initial tuple's constant, else 0). A loop of the program with
    any other condition (the sampler's `index < T - 1 and not all done`) takes `default_trips`
    from the caller; the result says which loops were read, which assumed, and which (none
    expected) could only be counted once;
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
from typing import Optional

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
  trips: int              # iterations counted
  trips_source: str       # "condition" (read from the loop), "assumed" (default_trips) or
                          #   "unknown (counted once)"
  body_flops: float = 0.0   # one iteration, nested loops included
  body_bytes: float = 0.0


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
                while_line: str) -> Optional[int]:
  """Trips of a loop whose condition is `counter < N` (N a constant), whose body adds a
  constant step to the counter, and whose counter starts at a constant (0 when the start is
  not a visible constant: what lax.scan and fori_loop lower to). None otherwise. XLA's own
  analysis, when it wrote one into the loop's backend config (`known_trip_count`, as the CPU
  compiler does for loops whose condition it rewrote), comes first."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', while_line)
  if known:
    return int(known.group(1))
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
  return max(0, -(-(limit - start) // step))


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


def program_cost(compiled, *, default_trips: Optional[int] = None) -> dict:
  """Loop-aware FLOPs and bytes accessed of a `jax.stages.Compiled` (per device).

  Returns a dict: flops, bytes_accessed (loops per trip, kernels included), xla_flops and
  xla_bytes (`cost_analysis()` as XLA reports it), kernel_flops, and loops (one dict per
  while loop: body, trips, how the trip count was found, one iteration's flops and bytes).
  """
  text = compiled.runtime_executable().hlo_modules()[0].to_string()
  xla = compiled.cost_analysis() or {}
  del compiled
  return hlo_text_cost(text, default_trips=default_trips, xla=xla)


def hlo_text_cost(text: str, *, default_trips: Optional[int] = None,
                  xla: Optional[dict] = None) -> dict:
  """`program_cost` of an optimized HLO module's text (`Compiled.as_text()`); `xla` is the
  program's own `cost_analysis()`, reported beside (empty: those fields are 0)."""
  from jax._src.lib import _jax   # pylint: disable=g-import-not-at-top
  from jaxlib import _hlo        # pylint: disable=g-import-not-at-top
  import jax                     # pylint: disable=g-import-not-at-top

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

  loops: list[Loop] = []

  def walk(name: str, seen: frozenset) -> tuple[list[tuple[str, Optional[int], bool]], float,
                                                 float]:
    """(while loops reachable without entering a loop body as (body, trip count or None,
    written in the program), kernel FLOPs, kernel bytes) of computation `name` and the
    computations it calls."""
    found, kflops, kbytes = [], 0.0, 0.0
    for line in comps.get(name, ()):
      w = _WHILE.search(line)
      if w:
        # A loop written in the program (lax.while_loop / scan) says so in its metadata;
        # XLA's own loops (windowed einsums around collectives) name the op they split.
        op = re.search(r'op_name="([^"]*)"', line)
        trips = _trip_count(comps.get(w.group(1), []), comps.get(w.group(2), []),
                            comps[name], line)
        found.append((w.group(2), trips, bool(op) and op.group(1).endswith("/while")))
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

  def total(name: str) -> tuple[float, float, float]:
    """(flops, bytes, kernel flops) of one execution of computation `name`, loops expanded
    and kernels included."""
    flops, nbytes = xla_cost(name)
    whiles, kflops, kbytes = walk(name, frozenset({name}))
    flops, nbytes = flops + kflops, nbytes + kbytes
    for body, trips, written in whiles:
      source = "condition"
      if trips is None and written and default_trips:
        trips, source = default_trips, "assumed"
      elif trips is None:
        trips, source = 1, "unknown (counted once)"
      b_flops, b_bytes, b_kernel = total(body)
      once_flops, once_bytes = xla_cost(body)
      loops.append(Loop(body=body, parent=name, trips=trips, trips_source=source,
                        body_flops=b_flops, body_bytes=b_bytes))
      flops += trips * b_flops - once_flops
      nbytes += trips * b_bytes - once_bytes
      kflops += trips * b_kernel
    return flops, nbytes, kflops

  flops, nbytes, kflops = total(entry)
  xla = xla or {}
  return {"flops": flops, "bytes_accessed": nbytes, "kernel_flops": kflops,
          "xla_flops": float(xla.get("flops", 0.0)),
          "xla_bytes": float(xla.get("bytes accessed", 0.0)),
          "loops": [dataclasses.asdict(l) for l in loops]}


# Collective ops and how many bytes one call moves per device, for `collective_bytes`.
COLLECTIVES = ("ragged-all-to-all", "all-to-all", "all-gather", "reduce-scatter", "all-reduce",
               "collective-permute")
_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (.*?) (" + "|".join(COLLECTIVES) +
                         r")(-start)?\((.*)$")


def collective_bytes(text: str, *, default_trips: Optional[int] = None) -> dict:
  """Bytes each kind of collective moves per device in one run of an optimized HLO module,
  every while loop counted per trip (trip counts as in `hlo_text_cost`).

  A collective counts its result (an async `-start` its largest buffer): what a device holds
  after an all-gather or all-to-all, the buffer an all-reduce sums. A `ragged-all-to-all`
  counts the smaller of its input and output buffers: the rows it moves when routing is
  balanced (an MoE dispatch sends its m * k pairs into a buffer of n * m * k rows, and the
  return sends them back into m * k rows); the rows it moves are data-dependent.
  """
  comps, _, entry = _computations(text)
  cache: dict[str, dict] = {}

  def buffers(rhs: str) -> list[int]:
    """Bytes of each array of an instruction's result (an async start's tuple holds its
    operands, then its result)."""
    result = rhs.split(" ", 1)[0] if not rhs.startswith("(") else rhs[:rhs.rindex(")") + 1]
    return [_nbytes(s) for s in re.findall(r"\w+\[[\d,]*\]", result)]

  def count(name: str) -> dict:
    if name in cache:
      return cache[name]
    cache[name] = out = {}
    lines = comps.get(name, ())
    defs = _defs(lines)

    def add(kind, n, times=1):
      out[kind] = out.get(kind, 0) + n * times
    for line in lines:
      w = _WHILE.search(line)
      if w:
        op = re.search(r'op_name="([^"]*)"', line)
        trips = _trip_count(comps.get(w.group(1), []), comps.get(w.group(2), []), lines, line)
        if trips is None:
          trips = default_trips if (default_trips and op and op.group(1).endswith("/while")) \
              else 1
        for kind, n in count(w.group(2)).items():
          add(kind, n, trips)
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
        add(m.group(2), nbytes)
        continue
      called = _CALLS.findall(line)
      for br in _BRANCHES.findall(line):
        called += [c.strip().lstrip("%") for c in br.split(",") if c.strip()]
      for c in called:
        if c in comps and c != name:
          for kind, n in count(c).items():
            add(kind, n)
    return out

  return {k: float(v) for k, v in count(entry).items()}
