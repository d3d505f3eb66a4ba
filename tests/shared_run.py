"""What the tests that run the trainer share: one tiny base model and one persistent XLA
compilation cache per test session, across pytest-xdist workers and the trainer subprocesses.

Without it every test file built its own warm-up base model and compiled its own copy of the
same programs. Now the first test that needs the base builds it (under a file lock, so two
workers never build it twice) and every trainer process, in-process or a subprocess, reads
and writes the same compilation cache.

  def test_x(shared_run):                            # the session fixture in conftest.py
    subprocess.run([..., *shared_run.cli_args()], env=shared_run.env())
    c = shared_run.config()                          # tiny_trm with the shared base's settings

The base model's settings (TINY_BASE) are the trainer tests' long-standing ones: 80 SFT steps
on sums of at most 3 operands of at most 9, enough that rewards vary within GRPO groups, so
updates (and therefore resume bugs) are not zero.
"""
from __future__ import annotations

import dataclasses
import fcntl
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "tiny_trm.py"
# Trainer subprocesses see 2 CPU devices, not the test process's 8: still a sharded data
# mesh (batches split, checkpoints written and restored per shard), at a fraction of the cost.
# Measured on a quiet 2-core machine, the tiny trainer for 6 steps: 22 CPU-s cold and 10 warm
# on 2 devices against 39 and 13 on 8. Sharding over more devices and every mesh axis is
# tested in-process (test_sharding, test_train_sharding, test_staleness) on all 8.
TRAINER_DEVICES = 2
# Every warm-up setting a config may change is named, so that a config with other defaults
# (tiny_trm_long's answer-only fraction, experiments.staleness's) still finds this base current
# instead of rebuilding it in the shared directory under the other tests.
TINY_BASE = {"warmup.steps": 80, "warmup.batch_size": 32, "warmup.answer_only_frac": 0.3,
             "task.synthetic.max_operands": 3, "task.synthetic.max_value": 9}


@dataclasses.dataclass(frozen=True)
class SharedRun:
  root: Path                                  # the session's shared directory

  @property
  def base_dir(self) -> Path:
    return self.root / "base"

  def overrides(self) -> dict:
    """Config overrides that select the shared base model, and no curves.png: drawing it
    costs a trainer process about 1.5 s of CPU (importing matplotlib, laying out, saving),
    and the suite starts dozens of them (test_notebooks' quickstart run draws it, and checks)."""
    return {**TINY_BASE, "warmup.cache_dir": str(self.base_dir), "plot": False}

  def cli_args(self, flag: str = "--config.") -> list[str]:
    """The overrides as `--config.key=value` flags (or `--set key=value` with flag="")."""
    if flag:
      return [f"{flag}{k}={v}" for k, v in self.overrides().items()]
    return [a for k, v in self.overrides().items() for a in ("--set", f"{k}={v}")]

  def env(self, devices: int = TRAINER_DEVICES, **extra) -> dict:
    """The environment of a trainer subprocess: the shared persistent compilation cache and
    `devices` simulated CPU devices (the trainer's default mesh is a data mesh over all of
    them) with the test process's other XLA flags (xla_flags)."""
    return dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(self.root / "xla_cache"),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
                XLA_FLAGS=xla_flags(devices), **extra)

  def config(self):
    """tiny_trm with the shared base's settings."""
    from trm_jax import config as config_lib  # pylint: disable=g-import-not-at-top
    from trm_jax import sweep  # pylint: disable=g-import-not-at-top
    return sweep.apply_overrides(config_lib.load_config(str(CONFIG)), self.overrides().items())

  def build_base(self) -> None:
    """Builds the base model once per session (the first caller; the others wait)."""
    from trm_jax import warmup  # pylint: disable=g-import-not-at-top
    self.root.mkdir(parents=True, exist_ok=True)
    with open(self.root / "base.lock", "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      warmup.ensure_base_model(self.config(), log=lambda _: None)


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a child process with `devices` simulated CPU devices and this process's
  other XLA flags (the compile settings of conftest.py)."""
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
  return f"--xla_force_host_platform_device_count={devices} {flags}".strip()


def session_root(tmp_path_factory) -> Path:
  """A directory every xdist worker of this session sees: the parent of the workers' base
  temp directories (pytest-N/popen-gwK -> pytest-N), or the base temp without xdist."""
  base = tmp_path_factory.getbasetemp()
  return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared_run"
