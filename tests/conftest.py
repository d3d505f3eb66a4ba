"""Test setup: 8 simulated CPU devices (for mesh tests) and small, deterministic defaults.

XLA_FLAGS must be set before jax is imported anywhere, which is why it lives here.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import pytest  # noqa: E402  (after the environment above)


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
  """One tiny base model and one XLA compilation cache for every trainer test (shared_run.py)."""
  from shared_run import SharedRun, session_root  # pylint: disable=g-import-not-at-top
  run = SharedRun(session_root(tmp_path_factory))
  run.build_base()
  return run
