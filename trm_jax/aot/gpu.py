"""Ahead-of-time compilation for named NVIDIA GPUs on a machine without one.

With the CUDA PJRT plugin installed (`pip install -e .[gpu_aot]`: jax-cuda12-plugin and
jax-cuda12-pjrt, ~180 MB of wheels, ~480 MB on disk; no CUDA libraries, no driver, no GPU),
`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=<a
GpuTargetConfigProto textproto>, topology="1xHOSTSxGPUS")` gives compile-only devices of a GPU
node, and `jit(f).lower(...).compile()` on a mesh of them runs the real XLA:GPU pipeline for
that chip: SPMD partitioning, fusion, the buffer assignment that `memory_analysis()` reports,
the Triton compiler for Pallas kernels (a kernel whose tiles overflow the chip's shared memory
fails here with "RESOURCE_EXHAUSTED: Shared memory size limit exceeded"), and sm_90a PTX.
Nothing is executed. What differs from a compile on the GPU (docs/gpu.md):

  * no autotuning: GEMM fusions take XLA's default tile configs, not the measured best, so
    temporaries can differ slightly from a compile on the GPU (cuBLAS workspaces, tiles);
  * `Compiled.cost_analysis()` returns None: count FLOPs with `trm_jax.aot.hlo_cost`
    (which costs the HLO text with XLA's own analysis and counts the Triton attention kernels
    analytically);
  * the plugin registers its topology factory only when its start-up version check is skipped:
    set JAX_PLATFORMS=cpu (the test suite does) or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 before jax
    starts its backends; otherwise the check fails at cuInit (no driver) and `get_topology_desc`
    answers "topology not implemented for cuda". `gpu_aot_available()` says which.

`GPUS` holds each chip's public figures (HBM capacity, peak dense bf16 FLOP/s, HBM bandwidth) for
fit checks and roofline bounds, and the device description XLA compiles against.

  devices = topology_devices("h200:8")            # one node of 8 H200s
  mesh = Mesh(np.array(devices).reshape(4, 2), ("data", "tensor"))
  compiled = jax.jit(f).lower(*abstract_args_with_NamedShardings_on(mesh)).compile()
  compiled.memory_analysis().temp_size_in_bytes    # per GPU

A program run on such devices must pick the GPU code paths explicitly: `jax.default_backend()`
is still "cpu" here, so attn_impl="auto" would resolve to the reference; pass "pallas".
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import re
from typing import Callable, Optional, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

_PLUGIN_MODULES = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


@dataclasses.dataclass(frozen=True)
class GPUSpec:
  """Public per-GPU figures of one NVIDIA data-centre part, and what XLA compiles against."""
  name: str
  device_kind: str          # what jax reports as Device.device_kind on the real part
  hbm_bytes: int            # HBM capacity per GPU (what the driver reports, nvidia-smi MiB)
  peak_bf16_flops: float    # peak dense (no 2:4 sparsity) bf16 tensor-core FLOP/s per GPU
  hbm_bytes_per_s: float    # HBM bandwidth per GPU
  source: str
  # Device description for XLA (GpuTargetConfigProto.gpu_device_info). Both parts are GH100
  # SXM5: 132 SMs at up to 1.98 GHz, 50 MiB L2, 228 KiB shared memory per SM (227 KiB
  # opt-in per block), compute capability 9.0 (NVIDIA H100 Tensor Core GPU Architecture
  # whitepaper; CUDA C++ Programming Guide, "Compute Capabilities", 9.0).
  compute_capability: tuple[int, int] = (9, 0)
  sm_count: int = 132
  clock_ghz: float = 1.98
  l2_bytes: int = 50 * 2**20
  shared_memory_per_sm: int = 228 * 1024
  shared_memory_per_block_optin: int = 227 * 1024

  def target_config(self) -> str:
    """The GpuTargetConfigProto textproto `get_topology_desc(target_config=...)` parses."""
    major, minor = self.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {self.sm_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.hbm_bytes_per_s)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.hbm_bytes}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
device_description_str: "{self.device_kind}"
"""


# NVIDIA's datasheets (read 2025): H100 SXM5 80 GB, https://www.nvidia.com/en-us/data-center/h100/
# ("BF16 Tensor Core 1,979 teraFLOPS*", * with sparsity, so 989.4e12 dense; 3.35 TB/s);
# H200 SXM 141 GB, https://www.nvidia.com/en-us/data-center/h200/ ("BF16 Tensor Core 1,979
# TFLOPS", with sparsity, so 989e12 dense; 4.8 TB/s). HBM bytes are what nvidia-smi reports
# (H100 80GB HBM3: 81559 MiB; H200: 143771 MiB, seen on this project's H200 machines).
GPUS = {
    "h100": GPUSpec("h100", "NVIDIA H100 80GB HBM3", 81559 * 2**20, 989.4e12, 3.35e12,
                    "https://www.nvidia.com/en-us/data-center/h100/"),
    "h200": GPUSpec("h200", "NVIDIA H200", 143771 * 2**20, 989e12, 4.8e12,
                    "https://www.nvidia.com/en-us/data-center/h200/"),
}


def gpu_spec(topology: str) -> GPUSpec:
  """The part of a topology name such as "h200:8"."""
  gen = topology.split(":", 1)[0].lower()
  if gen not in GPUS:
    raise ValueError(f"topology {topology!r}: unknown GPU {gen!r}; known: {', '.join(GPUS)}")
  return GPUS[gen]


def parse_topology(topology: str) -> tuple[int, int]:
  """(hosts, GPUs per host) of "h200:8" (one node of 8) or "h200:2x8" (two nodes of 8)."""
  m = re.fullmatch(r"[^:]+:(?:(\d+)x)?(\d+)", topology)
  if not m:
    raise ValueError(f"topology {topology!r} is not of the form GPU:N or GPU:HOSTSxN, "
                     "e.g. h200:8")
  hosts, per_host = int(m.group(1) or 1), int(m.group(2))
  if hosts < 1 or per_host < 1:
    raise ValueError(f"topology {topology!r}: counts must be positive")
  return hosts, per_host


def topology_gpus(topology: str) -> int:
  """GPUs in a topology name ("h200:2x8" -> 16)."""
  return math.prod(parse_topology(topology))


def cuda_plugin_installed() -> bool:
  if importlib.util.find_spec("jax_plugins") is None:
    return False
  return any(importlib.util.find_spec(m) is not None for m in _PLUGIN_MODULES)


def gpu_aot_available() -> tuple[bool, str]:
  """(True, "") when named-GPU devices can be made here, else (False, why)."""
  if not cuda_plugin_installed():
    return False, ("the CUDA PJRT plugin is not installed: pip install -e '.[gpu_aot]' "
                   "(jax-cuda12-plugin matching jax)")
  from jax._src import xla_bridge as xb   # pylint: disable=g-import-not-at-top
  xb.backends()            # plugin discovery and registration happen with the backends
  if "cuda" not in xb._topology_factories:   # pylint: disable=protected-access
    return False, ("the CUDA plugin is installed but registered no topology factory: its "
                   "start-up version check failed (no driver here); set JAX_PLATFORMS=cpu or "
                   "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 before jax starts")
  return True, ""


@functools.lru_cache(maxsize=None)
def topology_devices(topology: str) -> tuple:
  """Every GPU of a named node topology, e.g. "h200:8" (compile-only devices)."""
  spec = gpu_spec(topology)
  hosts, per_host = parse_topology(topology)
  ok, why = gpu_aot_available()
  if not ok:
    raise RuntimeError(f"AOT compile for {topology!r}: {why}")
  from jax.experimental import topologies   # pylint: disable=g-import-not-at-top
  desc = topologies.get_topology_desc(topology_name=topology, platform="cuda",
                                      target_config=spec.target_config(),
                                      topology=f"1x{hosts}x{per_host}")
  return tuple(desc.devices)


def make_mesh(topology: str, shape: Sequence[int], axis_names: Sequence[str]) -> Mesh:
  """A mesh of `shape` over a named topology's GPUs (row-major: the last axis is fastest,
  so a trailing "tensor" axis of size <= GPUs per host stays inside one NVLink domain)."""
  import numpy as np   # pylint: disable=g-import-not-at-top
  devices = topology_devices(topology)
  if math.prod(shape) != len(devices):
    raise ValueError(f"mesh {tuple(shape)} has {math.prod(shape)} devices; {topology!r} has "
                     f"{len(devices)}")
  return Mesh(np.array(devices).reshape(tuple(shape)), tuple(axis_names))


def compile_for_gpu(fn: Callable, args: Sequence[jax.ShapeDtypeStruct], topology: str,
                    specs: Optional[Sequence[PartitionSpec]] = None,
                    mesh_shape: Optional[Sequence[int]] = None,
                    axis_names: Sequence[str] = ("data",)):
  """jit(fn) compiled for a named GPU topology; args are shapes (no data needed).

  Without `specs` every argument is replicated over the mesh (default: one "data" axis over
  every GPU)."""
  mesh = make_mesh(topology, mesh_shape or (topology_gpus(topology),), axis_names)
  specs = specs or [PartitionSpec()] * len(args)
  placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s))
            for a, s in zip(args, specs)]
  return jax.jit(fn).lower(*placed).compile()
