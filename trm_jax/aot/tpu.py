"""Ahead-of-time compilation for real TPU chips on a machine without one.

With libtpu installed (`pip install -e .[tpu]`), `jax.experimental.topologies` describes a TPU
slice by name ("v5e:2x2", "v5p:2x2x1", "v6e:2x2") and `jit(f).lower(...).compile()` on its
devices runs the real XLA:TPU and Mosaic compilers: a Pallas kernel that Mosaic cannot lower,
or whose tiles overflow VMEM, fails here exactly as it would on the chip, and
`memory_analysis()` gives the chip's HBM temporaries. Nothing is executed.

`CHIPS` holds each generation's public per-chip figures (HBM capacity, peak bf16 FLOP/s, HBM
bandwidth) for fit checks and roofline bounds (`trm_jax.aot`).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re
from typing import Callable, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def libtpu_available() -> bool:
  return importlib.util.find_spec("libtpu") is not None


@dataclasses.dataclass(frozen=True)
class ChipSpec:
  """Public per-chip figures of one TPU generation (Google Cloud's TPU documentation)."""
  name: str
  hbm_bytes: int            # HBM capacity per chip
  peak_bf16_flops: float    # peak dense bf16 FLOP/s per chip
  hbm_bytes_per_s: float    # HBM bandwidth per chip
  max_chips: int            # chips in a whole pod: the largest slice
  source: str


# cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e}, "key specifications" tables (read 2025).
CHIPS = {
    "v4": ChipSpec("v4", 32 * 2**30, 275e12, 1200e9, 4096,
                   "https://cloud.google.com/tpu/docs/v4"),
    "v5e": ChipSpec("v5e", 16 * 2**30, 197e12, 819e9, 256,
                    "https://cloud.google.com/tpu/docs/v5e"),
    "v5p": ChipSpec("v5p", 95 * 2**30, 459e12, 2765e9, 8960,
                    "https://cloud.google.com/tpu/docs/v5p"),
    "v6e": ChipSpec("v6e", 32 * 2**30, 918e12, 1638e9, 256,
                    "https://cloud.google.com/tpu/docs/v6e"),
}


def chip_spec(topology: str) -> ChipSpec:
  """The generation of a topology name such as "v5p:4x4x4"."""
  gen = topology.split(":", 1)[0]
  if gen not in CHIPS:
    raise ValueError(f"topology {topology!r}: unknown TPU generation {gen!r}; known: "
                     f"{', '.join(CHIPS)}")
  return CHIPS[gen]


def topology_chips(topology: str) -> int:
  """Chips in a topology name ("v5p:4x4x4" -> 64), after checking that the name's generation
  is known and that a pod of it has that many chips (libtpu is not asked about a larger one:
  it crashes the process on some, e.g. v5p:1000x1000x1000)."""
  spec = chip_spec(topology)
  m = re.fullmatch(r"[^:]+:(\d+(?:x\d+)*)", topology)
  if not m:
    raise ValueError(f"topology {topology!r} is not of the form GEN:AxB[xC], e.g. v5e:2x2")
  n = math.prod(int(d) for d in m.group(1).split("x"))
  if not 1 <= n <= spec.max_chips:
    raise ValueError(f"topology {topology!r} has {n} chips; a {spec.name} slice has 1 to "
                     f"{spec.max_chips} (a whole pod)")
  return n


@functools.lru_cache(maxsize=None)
def topology_devices(topology: str) -> tuple:
  """Every device (chip, or core where the generation exposes cores) of a named topology."""
  if not libtpu_available():
    raise RuntimeError(f"AOT compile for {topology!r} needs libtpu: pip install -e '.[tpu]'")
  topology_chips(topology)   # bounded before libtpu sees it
  # A machine without TPUs has no multi-process lock to coordinate; without this libtpu
  # aborts with "Internal error when accessing libtpu multi-process lockfile".
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")   # no GCE metadata server to ask
  from jax.experimental import topologies
  return tuple(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)


def topology_device(topology: str):
  """The first chip of a named TPU topology, e.g. "v5e:2x2"."""
  return topology_devices(topology)[0]


def compile_for_tpu(fn: Callable, args: Sequence[jax.ShapeDtypeStruct], topology: str):
  """jit(fn) compiled for one chip of `topology`; args are shapes (no data needed)."""
  sharding = NamedSharding(Mesh([topology_device(topology)], ("chip",)), PartitionSpec())
  placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
  return jax.jit(fn).lower(*placed).compile()
