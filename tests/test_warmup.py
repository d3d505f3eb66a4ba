"""The warm-up base's marker: a cached base is reused exactly when it is the configured one."""
import json
import shutil

from trm_jax import config as config_lib
from trm_jax import sweep
from trm_jax import warmup


def _marked(path, c):
  path.mkdir()
  (path / warmup.MARKER).write_text(json.dumps(warmup._fingerprint(c)))
  return path


def test_a_base_is_current_wherever_it_lives_and_only_for_its_settings(tmp_path):
  c = config_lib.load_config("configs/tiny_trm.py")
  c.warmup.cache_dir = str(tmp_path / "a")
  a = _marked(tmp_path / "a", c)
  assert warmup.is_current(str(a), c)
  # Moved (or copied) to a directory another config names: still the same base.
  b = tmp_path / "b"
  shutil.copytree(a, b)
  c.warmup.cache_dir = str(b)
  assert warmup.is_current(str(b), c)
  # Any setting that changes what the base is makes it stale.
  for key, value in (("warmup.steps", c.warmup.steps + 1), ("warmup.answer_only_frac", 0.5),
                     ("task.synthetic.max_operands", 7), ("model.arch.num_layers", 3)):
    d = sweep.apply_overrides(config_lib.load_config("configs/tiny_trm.py"),
                              [("warmup.cache_dir", str(b)), (key, value)])
    assert not warmup.is_current(str(b), d), key
  assert not warmup.is_current(str(tmp_path / "missing"), c)
