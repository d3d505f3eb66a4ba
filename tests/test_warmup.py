"""The warm-up base's marker: a cached base is reused exactly when it is the configured one."""
import json
import re
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


def test_a_carried_base_is_installed_as_the_cache_only_for_its_settings(tmp_path):
  """install_base puts a base warmed up elsewhere where the config caches its own (the
  long-horizon grid continued on another CPU must start from the same weights), atomically and
  only once; a base of other warm-up settings, or a config with model.path, is refused."""
  import pytest  # pylint: disable=g-import-not-at-top
  c = config_lib.load_config("configs/tiny_trm.py")
  carried = _marked(tmp_path / "carried", c)
  (carried / "model.safetensors").write_bytes(b"weights A")
  c.warmup.cache_dir = str(tmp_path / "cache" / "base")
  dst = warmup.install_base(str(carried), c)
  assert dst == c.warmup.cache_dir and warmup.is_current(dst, c)
  assert warmup.model_digest(dst) == warmup.model_digest(str(carried))
  # A cache holding other weights is replaced; the same weights are left alone.
  (carried / "model.safetensors").write_bytes(b"weights B")
  warmup.install_base(str(carried), c)
  assert (tmp_path / "cache" / "base" / "model.safetensors").read_bytes() == b"weights B"
  assert not (tmp_path / "cache" / "base.tmp").exists()
  other = sweep.apply_overrides(config_lib.load_config("configs/tiny_trm.py"),
                                [("warmup.steps", c.warmup.steps + 1)])
  with pytest.raises(config_lib.ConfigError, match="not warmed up with this config"):
    warmup.install_base(str(carried), other)
  other = sweep.apply_overrides(config_lib.load_config("configs/tiny_trm.py"),
                                [("model.path", str(carried))])
  with pytest.raises(config_lib.ConfigError, match="model.path"):
    warmup.install_base(str(carried), other)


def test_every_run_seed_shares_one_base_and_warmup_seed_picks_it(tmp_path, monkeypatch):
  """The base is a function of what its fingerprint holds: the warm-up's data come from stream
  warmup.seed + 1 (1 by default, the stream seed 0 always used, so its base is unchanged),
  never from the run seed, which the fingerprint does not hold. Runs of seeds 0 and 1 build
  the same base bit for bit; before, seed 1 warmed up on stream 2 yet reused seed 0's cache."""
  from trm_jax.data import synthetic  # pylint: disable=g-import-not-at-top
  streams = []
  draw = synthetic.demonstration_batch
  monkeypatch.setattr(synthetic, "demonstration_batch",
                      lambda cfg, seed, *a: streams.append(seed) or draw(cfg, seed, *a))
  small = [("warmup.steps", 6), ("warmup.batch_size", 4), ("model.arch.hidden_size", 32),
           ("model.arch.intermediate_size", 64), ("model.arch.num_layers", 1)]
  digests, lines = [], []
  for seed in (0, 1):
    c = sweep.apply_overrides(config_lib.load_config("configs/tiny_trm.py"),
                              small + [("seed", seed)])
    out = warmup.build_base_model(c, str(tmp_path / f"seed{seed}"), log=lines.append)
    digests.append(warmup.model_digest(out))
    assert warmup.is_current(out, c)
  assert digests[0] == digests[1] and streams == [1] * 12
  # A warm-up says how long it will take, measured from the end of step 1 (its compile).
  shown = [re.sub(r"loss \S+ \(\d+s", "loss L (Ts", ln) for ln in lines[:6]]
  assert shown[0] == "[warmup] step 1/6 loss L (Ts)" and shown[5] == "[warmup] step 6/6 loss L (Ts)"
  assert all(re.fullmatch(rf"\[warmup\] step {i}/6 loss L \(Ts; about \d+ s left\)",
                          shown[i - 1]) for i in range(2, 6)), shown
  other = sweep.apply_overrides(config_lib.load_config("configs/tiny_trm.py"),
                                small + [("warmup.seed", 1)])
  assert warmup.data_stream(other) == 2 and not warmup.is_current(str(tmp_path / "seed0"), other)
