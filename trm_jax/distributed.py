"""Multi-host start-up: `jax.distributed.initialize` the way the platform provides it.

  JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID set   the explicit variables
  otherwise, a cluster environment JAX detects                     SLURM (srun), Open MPI
                                                                   (mpirun), Cloud TPU pods
                                                                   (GCE and GKE), Kubernetes
  neither                                                          one process

JAX's own detection (`jax._src.clusters.ClusterEnv`: what `jax.distributed.initialize()`
with no arguments consults) finds the coordinator, the process count and this process's index
from the environment; a `srun -n 2` step or `gcloud ... ssh --worker=all` on a TPU slice
therefore starts one multi-process run with no JAX_* variables. An environment that reports a
single process (a one-task SLURM step) is not initialised: nothing to coordinate, and no port
to open. Opt-in-only detectors (mpi4py) are left to an explicit `initialize` call.

On a machine with no TPU chip and no GPU, and JAX_PLATFORMS unset, JAX is restricted to the
CPU first (`cpu_when_no_accelerator`): otherwise it tries every installed accelerator plugin,
and with the `tpu` / `gpu_aot` extras installed libtpu ("unexpected worker hostname", "No
jellyfish device found") and the CUDA plugin ("Unable to load CUDA", with a traceback) print
error lines on every CPU run.
"""
from __future__ import annotations

import glob
import logging
import os
from typing import Optional

import jax

from trm_jax import config as config_lib

log = logging.getLogger(__name__)

EXPLICIT = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def detect_cluster() -> Optional[type]:
  """The cluster environment `jax.distributed.initialize()` would detect, or None."""
  try:
    from jax._src import clusters  # pylint: disable=g-import-not-at-top
    kinds = list(clusters.ClusterEnv._cluster_types)  # pylint: disable=protected-access
  except (ImportError, AttributeError):   # a jax without the registry: nothing detected
    return None
  for kind in kinds:
    if getattr(kind, "opt_in_only_method", False):
      continue
    try:
      if kind.is_env_present():
        return kind
    except Exception:  # pylint: disable=broad-except  (a detector's own probe failed)
      continue
  return None


def cpu_when_no_accelerator() -> bool:
  """Sets jax_platforms to "cpu" when it is unset, no backend is up yet, and the machine has
  no TPU chip (JAX's own probe, what Cloud TPU start-up reads) and no GPU device node; returns
  whether it did. What such a run ends up on is the CPU either way; this only skips the failed
  plugin start-ups and their error lines."""
  from jax._src import hardware_utils, xla_bridge  # pylint: disable=g-import-not-at-top
  if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
    return False
  if xla_bridge.backends_are_initialized():
    return False
  if (hardware_utils.num_available_tpu_chips_and_device_id()[0]
      or glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd")):
    return False
  jax.config.update("jax_platforms", "cpu")
  return True


def init_distributed() -> bool:
  """Initialises jax.distributed as the environment asks (see the module docstring) and logs
  one line saying how, with the process count. Returns whether it initialised. Must run
  before anything touches a jax device (CPU-only machines are kept quiet first:
  `cpu_when_no_accelerator`)."""
  cpu_when_no_accelerator()
  set_vars = [k for k in EXPLICIT if k in os.environ]
  if set_vars:
    missing = [k for k in EXPLICIT if k not in os.environ]
    if missing:
      raise config_lib.ConfigError(f"{', '.join(set_vars)} set but {', '.join(missing)} not: "
                                   "set all three for a multi-process run")
    jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"],
                               num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                               process_id=int(os.environ["JAX_PROCESS_ID"]))
    how = "the JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID variables"
  else:
    kind = detect_cluster()
    n = _process_count(kind)
    if kind is None or n <= 1:
      log.info("multi-host start-up: one process (%s)",
               "no cluster environment, no JAX_* variables" if kind is None
               else f"{kind.__name__} reports one task")
      return False
    jax.distributed.initialize()
    how = f"{kind.__name__} (JAX's cluster detection)"
  log.info("multi-host start-up: %s: process %d of %d, %d local of %d devices", how,
           jax.process_index(), jax.process_count(), jax.local_device_count(),
           jax.device_count())
  return True


def _process_count(kind) -> int:
  if kind is None:
    return 1
  try:
    return int(kind.get_process_count())
  except Exception:  # pylint: disable=broad-except  (e.g. a TPU pod's metadata query)
    return 2          # unknown: let jax.distributed.initialize() find out
