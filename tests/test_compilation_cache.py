"""The trainer's persistent compilation cache (`train.compilation_cache`): on by default in
~/.cache/trm_jax/xla with every program cached; JAX's own settings win (a directory set by
JAX_COMPILATION_CACHE_DIR, JAX_ENABLE_COMPILATION_CACHE=false); "" in the config sets none.

The cases run in one fresh process (the cache is process-wide JAX state, which this test
process keeps off: conftest.py) with HOME in a temporary directory; JAX's environment variables
are its config values, so the script sets those (`jax.config.update`) between cases."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """
import json, os, sys
import jax, jax.numpy as jnp
from jax._src import compilation_cache
from trm_jax import config as config_lib, train
c = config_lib.load_config("tiny_trm")
out = {}

def case(name, setting, **jax_config):
  compilation_cache.reset_cache()
  jax.config.update("jax_compilation_cache_dir", None)
  for k, v in jax_config.items():
    jax.config.update(k, v)
  c.compilation_cache = setting
  path = train.compilation_cache(c)
  jax.jit(lambda x: x * len(out) + 1)(jnp.arange(5.0)).block_until_ready()
  out[name] = dict(path=path, min_time=jax.config.jax_persistent_cache_min_compile_time_secs,
                   entries=sorted(os.listdir(path)) if path else None)

case("default", "~/.cache/trm_jax/xla")
case("jax_dir", "~/.cache/trm_jax/xla", jax_compilation_cache_dir=sys.argv[1])
case("config_off", "")
case("jax_off", "~/.cache/trm_jax/xla", jax_enable_compilation_cache=False)
print(json.dumps(out))
"""


def test_compilation_cache_default_and_its_switches(tmp_path):
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")
         and k not in ("JAX_ENABLE_COMPILATION_CACHE",
                       "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
  env.update(HOME=str(tmp_path), JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  p = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "elsewhere")], cwd=ROOT,
                     env=env, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  out = json.loads(p.stdout.strip().splitlines()[-1])
  default = out["default"]
  assert default["path"] == str(tmp_path / ".cache" / "trm_jax" / "xla")
  # Even a program that compiles in milliseconds is kept (JAX's default threshold is 1 s).
  assert default["min_time"] == 0.0 and default["entries"], default
  assert out["jax_dir"]["path"] == str(tmp_path / "elsewhere") and out["jax_dir"]["entries"]
  assert out["config_off"]["path"] is None and out["jax_off"]["path"] is None
  # Nothing else was written to the default directory after the first case.
  assert sorted(os.listdir(default["path"])) == default["entries"]
