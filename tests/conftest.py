"""Test setup: 8 simulated CPU devices (for mesh tests) and small, deterministic defaults.

XLA_FLAGS must be set before jax is imported anywhere, which is why it lives here.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import jax  # noqa: E402  (after the environment above)
import pytest  # noqa: E402

# This process's backend starts now, with the flags above. The processes the tests start
# (trainers, sweeps, experiment scripts, notebooks, two-process runs) compile every program
# from scratch and run tiny models, so they inherit XLA's optimisation level 0: about a quarter
# less CPU for those tests. Every assertion inside one test compares programs compiled at one
# level (a subprocess run against a subprocess run); the in-process tests, the cross-program
# bitwise checks among them, keep XLA's default.
jax.devices()
os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
  """One tiny base model and one XLA compilation cache for every trainer test (shared_run.py)."""
  from shared_run import SharedRun, session_root  # pylint: disable=g-import-not-at-top
  run = SharedRun(session_root(tmp_path_factory))
  run.build_base()
  return run
