"""The package as a user without the repository gets it: a wheel, installed into a fresh venv
outside the repository, runs 2 steps of `python -m trm_jax.train --config tiny_trm` from a
directory outside it; the wheel holds every module of trm_jax/ and every shipped config.

Kept affordable: the wheel is built without build isolation when setuptools is at hand
(seconds, no download), the venv has no pip of its own (the running pip installs into it with
`--python`), and it sees the running environment's dependencies through a .pth line instead of
installing them again (that directory's own .pth files, such as an editable install of this
repository, are not processed, so only the wheel provides trm_jax).
"""
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow


def _run(argv, **kw):
  p = subprocess.run(argv, capture_output=True, text=True, timeout=600, **kw)
  assert p.returncode == 0, f"{argv}:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
  return p


def test_wheel_in_a_fresh_venv_runs_a_shipped_config_by_name(tmp_path, shared_run):
  # Built from a copy of what the build reads, so that no build/ or egg-info lands in the
  # checkout (an egg-info on sys.path would make pip think trm_jax is installed already).
  src, dist = tmp_path / "src", tmp_path / "dist"
  src.mkdir()
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(os.path.join(ROOT, name), src / name)
  for name in ("trm_jax", "configs"):
    shutil.copytree(os.path.join(ROOT, name), src / name,
                    ignore=shutil.ignore_patterns("__pycache__"))
  no_iso = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
  env = dict(os.environ)
  env.pop("PYTHONPATH", None)   # nothing of the checkout on the path from here on
  _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *no_iso, "-w", str(dist),
        str(src)], env=env)
  (whl,) = glob.glob(str(dist / "trm_jax-*.whl"))

  # Every module of the package and every config, once (configs/ -> trm_jax/configs/).
  names = set(zipfile.ZipFile(whl).namelist())
  expected = {os.path.relpath(f, ROOT) for f in glob.glob(os.path.join(ROOT, "trm_jax", "**",
                                                                       "*.py"), recursive=True)}
  expected |= {"trm_jax/configs/" + os.path.basename(f)
               for f in glob.glob(os.path.join(ROOT, "configs", "*.py"))}
  assert expected <= names, sorted(expected - names)
  assert not any(n.startswith("configs/") for n in names)

  env_dir = tmp_path / "venv"
  venv.EnvBuilder(with_pip=False).create(str(env_dir))
  py = str(env_dir / "bin" / "python")
  _run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", whl],
       env=env)
  site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
              ).stdout.strip()
  with open(os.path.join(site, "_trm_test_deps.pth"), "w") as f:
    f.write(sysconfig.get_paths()["purelib"] + "\n")

  outside = tmp_path / "elsewhere"
  outside.mkdir()
  env = shared_run.env()
  env.pop("PYTHONPATH", None)
  where = _run([py, "-c", "import trm_jax; print(trm_jax.__file__)"], cwd=outside, env=env)
  assert where.stdout.strip().startswith(site), where.stdout
  workdir = outside / "run"
  _run([py, "-m", "trm_jax.train", "--config", "tiny_trm", "--workdir", str(workdir),
        "--config.total_steps=2", "--config.rl.batch_size=8", "--config.rl.group_size=4",
        "--config.eval_problems=0", "--config.export_hf=False", *shared_run.cli_args()],
       cwd=outside, env=env)
  assert (workdir / "summary.json").exists()
  assert not (workdir / "curves.png").exists()   # --config.plot=False (shared_run's overrides)
