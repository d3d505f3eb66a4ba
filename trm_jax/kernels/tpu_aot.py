"""Ahead-of-time compilation for real TPU chips on a machine without one.

With libtpu installed (`pip install -e .[tpu]`), `jax.experimental.topologies` describes a TPU
slice by name ("v5e:2x2", "v5p:2x2x1", "v6e:2x2") and `jit(f).lower(...).compile()` on its
devices runs the real XLA:TPU and Mosaic compilers: a Pallas kernel that Mosaic cannot lower,
or whose tiles overflow VMEM, fails here exactly as it would on the chip, and
`memory_analysis()` gives the chip's HBM temporaries. Nothing is executed.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from typing import Callable, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def libtpu_available() -> bool:
  return importlib.util.find_spec("libtpu") is not None


@functools.lru_cache(maxsize=None)
def topology_device(topology: str):
  """The first chip of a named TPU topology, e.g. "v5e:2x2"."""
  if not libtpu_available():
    raise RuntimeError(f"AOT compile for {topology!r} needs libtpu: pip install -e '.[tpu]'")
  # A machine without TPUs has no multi-process lock to coordinate; without this libtpu
  # aborts with "Internal error when accessing libtpu multi-process lockfile".
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")   # no GCE metadata server to ask
  from jax.experimental import topologies
  return topologies.get_topology_desc(topology_name=topology, platform="tpu").devices[0]


def compile_for_tpu(fn: Callable, args: Sequence[jax.ShapeDtypeStruct], topology: str):
  """jit(fn) compiled for one chip of `topology`; args are shapes (no data needed)."""
  sharding = NamedSharding(Mesh([topology_device(topology)], ("chip",)), PartitionSpec())
  placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
  return jax.jit(fn).lower(*placed).compile()
