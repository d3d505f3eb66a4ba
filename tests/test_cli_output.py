"""What the trainer's command line prints around a run: `--help`, and nothing from the
accelerator plugins on a CPU-only machine. (The progress bar's ETA, curves.png and the
warm-up's time estimate are in test_metrics.py and test_warmup.py.)"""
import os
import subprocess
import sys

import pytest

from trm_jax import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_help_exits_0_and_shows_config_and_where_it_is_documented():
  """absl's --help exited 1, listed --workdir and --allow_config_change only, and hid
  --config under --helpfull."""
  p = subprocess.run([sys.executable, "-m", "trm_jax.train", "--help"], cwd=ROOT,
                     capture_output=True, text=True, timeout=120)
  assert p.returncode == 0, p.stderr[-2000:]
  out = p.stdout
  assert out.startswith("usage: python -m trm_jax.train [--config CONFIG] --workdir DIR")
  for flag in ("--config CONFIG", "--config.KEY=VALUE", "--workdir DIR",
               "--allow_config_change"):
    assert f"\n  {flag} " in out, flag
  assert "tiny_smd" in out    # the shipped configs, by name
  assert os.path.join(config_lib.shipped_dir(), "tiny_trm.py") in " ".join(out.split())


def _accelerator_here() -> bool:
  import glob  # pylint: disable=g-import-not-at-top
  from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
  return bool(hardware_utils.num_available_tpu_chips_and_device_id()[0]
              or glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"))


def test_a_cpu_run_prints_nothing_from_accelerator_plugins(tmp_path):
  """With the tpu and gpu_aot extras installed, every CPU run printed the CUDA plugin's
  failure with two tracebacks and libtpu's error lines ("unexpected worker hostname", "No
  jellyfish device found"). The run below stops once the devices are up (a bad
  mesh.rollout_devices), with JAX_PLATFORMS unset as a user's shell has it."""
  if _accelerator_here():
    pytest.skip("this machine has an accelerator: the plugins are meant to start")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  p = subprocess.run([sys.executable, "-m", "trm_jax.train", "--workdir", str(tmp_path / "w"),
                      "--config.mesh.rollout_devices=64"], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 1
  assert p.stderr.strip().splitlines()[-1].startswith(
      "error: bad config value [mesh.rollout_devices]: 64 sampler devices leave none")
  for noise in ("Traceback", "Jax plugin configuration error", "Unable to initialize backend",
                "libtpu", "worker hostname", "jellyfish"):
    assert noise not in p.stderr, (noise, p.stderr[-3000:])
