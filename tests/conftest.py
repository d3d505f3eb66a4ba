"""Test setup: 8 simulated CPU devices (for mesh tests) and small, deterministic defaults.

XLA_FLAGS must be set before jax is imported anywhere, which is why it lives here.
"""
import os

# Two XLA:CPU compile settings for this process and every process it starts (trainers,
# sweeps, experiment scripts, notebooks, two-process runs): the tests compile hundreds of
# programs for tiny models, so compiling takes most of their CPU.
#  * Optimisation level 0 (test_smd, test_rollout_resim, test_models_decoder and
#    test_rl_learner in one process, quiet, side by side: 116 s and 148 CPU-s at level 0,
#    144 s and 205 CPU-s at the default).
#  * XLA:CPU's older fusion emitters instead of the MLIR fusion emitters
#    (--xla_cpu_use_fusion_emitters=false): test_rollout_slots' slotted-vs-all-at-once pairs
#    and test_staleness' disaggregated sampler, one process, quiet: 84 s and 109 CPU-s with
#    the MLIR emitters, 56 s and 62 CPU-s without.
# Either may change rounding (log-probs differ by up to 5e-7 between optimisation levels), so every
# comparison inside a test is between programs compiled with one set of flags, and the
# exactness the trainer relies on is checked again with XLA's defaults by
# test_rollout_slots.py::test_exactness_holds_at_the_default_optimisation_level.
# TRM_TEST_XLA_OPT=default keeps XLA's defaults (that test's child process).
TEST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
_flags = os.environ.get("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if os.environ.get("TRM_TEST_XLA_OPT") != "default":
  _flags = " ".join([_flags, *(f for f in TEST_COMPILE_FLAGS if f.split("=")[0] not in _flags)])
os.environ["XLA_FLAGS"] = _flags
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import jax  # noqa: E402  (after the environment above)
import pytest  # noqa: E402

from trm_jax import gc_tuning  # noqa: E402

# The trainer's collector settings: the tests trace thousands of programs in-process.
gc_tuning.tune_for_tracing()

jax.devices()   # this process's backend starts now, with the flags above
# The trainer turns on a persistent compilation cache in ~/.cache (train.compilation_cache);
# trainers run in a test process must not, so this process has none. Trainer subprocesses
# use the session's shared one (shared_run.env()) or, started without it, the default.
jax.config.update("jax_enable_compilation_cache", False)


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
  """One tiny base model and one XLA compilation cache for every trainer test (shared_run.py)."""
  from shared_run import SharedRun, session_root  # pylint: disable=g-import-not-at-top
  run = SharedRun(session_root(tmp_path_factory))
  run.build_base()
  return run


# --- file order for `pytest -n 2 --dist loadfile` ------------------------------------------
# xdist hands out whole files, by default those with the most tests first (--loadscope-reorder).
# That put the files with a few long end-to-end tests last: test_experiments (4 tests), then
# test_distributed (3), test_slurm (2) and test_wheel (1) were the last files handed out, so
# the run ended with one worker on a long file and the other idle. The files below go first,
# longest first (seconds on one worker: measured on a quiet or a loaded 2-core machine, or
# from the file's docstring); every other file follows in collection order. A new file that
# takes more than ~30 s belongs in this list, by its length.
LONG_FILES_FIRST = (
    "test_experiments.py",     # four experiment scripts end to end: ~110 s each quiet
    "test_slurm.py",           # a real scheduler: ~120 s in CI (skips without slurm-wlm)
    "test_smd.py",             # ~100 s (its docstring)
    "test_distributed.py",     # two-process trainer runs: 93 s loaded
    "test_train_resume.py",    # trainer subprocesses, SIGKILL + resume
    "test_notebooks.py",       # 48-55 s loaded
    "test_routing_replay.py",  # its trainer run ~45 s
    "test_rollout_slots.py",   # 10 slotted-vs-all-at-once pairs, every cache policy: ~50 s
    "test_wheel.py",           # ~40 s
    "test_aot.py",             # ~40 s (its docstring)
    "test_sweep.py",           # sweep subprocesses
)


def pytest_configure(config):
  if hasattr(config.option, "loadscopereorder"):   # xdist: keep the order set below
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
  del config
  rank = {name: i for i, name in enumerate(LONG_FILES_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: files stay whole
