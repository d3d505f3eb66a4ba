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
"""
from __future__ import annotations

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


def init_distributed() -> bool:
  """Initialises jax.distributed as the environment asks (see the module docstring) and logs
  one line saying how, with the process count. Returns whether it initialised. Must run
  before anything touches a jax device."""
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
