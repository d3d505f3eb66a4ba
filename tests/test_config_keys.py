"""Every key of the default config is read by the code that runs it.

A key nobody reads is a knob that silently does nothing (`rl.baseline` was one: documented,
settable, ignored). This test runs the real trainer in-process on `tiny_trm` for one step
(base model, rollout, score, update, evaluation, checkpoint, export) while recording every read
of a config key, then adds the branches one run cannot take (the other objectives', learner
modes' and cache policies' settings, read when those are chosen). Reads made only to check or serialise the
config (`config.validate`, `to_json_best_effort`) do not count: validating a key is not using
it.
"""
import pytest
from ml_collections import ConfigDict

from trm_jax import config as config_lib
from trm_jax import programs, train
from trm_jax.models import from_pretrained
from trm_jax.rl.modes import MODES
from trm_jax.rl.objectives import OBJECTIVES
from trm_jax.rollout.policies import POLICIES

pytestmark = pytest.mark.slow


class KeyReads:
  """Records reads of leaf keys of one config tree, by dotted path."""

  def __init__(self, c: ConfigDict):
    self.paths = {}
    self.leaves = {}
    self._index(c, "")
    self.read: set[str] = set()
    self.paused = 0

  def _index(self, node: ConfigDict, prefix: str) -> None:
    self.paths[id(node)] = prefix
    self.leaves[id(node)] = []
    for k in node.keys():
      v = node._fields[k]  # pylint: disable=protected-access  (no read recorded)
      if isinstance(v, ConfigDict):
        self._index(v, f"{prefix}{k}.")
        self.leaves[id(node)] += self.leaves[id(v)]
      else:
        self.leaves[id(node)].append(f"{prefix}{k}")

  def install(self, monkeypatch) -> None:
    getitem, to_dict = ConfigDict.__getitem__, ConfigDict.to_dict

    def tracked_getitem(node, key):
      value = getitem(node, key)
      if not self.paused and id(node) in self.paths and not isinstance(value, ConfigDict):
        self.read.add(self.paths[id(node)] + key)
      return value

    def tracked_to_dict(node, *args, **kwargs):
      # Handing a whole section to a constructor (SyntheticConfig(**t.synthetic.to_dict()))
      # reads every key in it.
      if not self.paused and id(node) in self.paths:
        self.read.update(self.leaves[id(node)])
      return self._paused(to_dict)(node, *args, **kwargs)

    monkeypatch.setattr(ConfigDict, "__getitem__", tracked_getitem)
    monkeypatch.setattr(ConfigDict, "to_dict", tracked_to_dict)
    for name in ("to_json_best_effort", "to_json"):
      monkeypatch.setattr(ConfigDict, name, self._paused(getattr(ConfigDict, name)))
    monkeypatch.setattr(config_lib, "validate", self._paused(config_lib.validate))

  def _paused(self, fn):
    def wrapped(*args, **kwargs):
      self.paused += 1
      try:
        return fn(*args, **kwargs)
      finally:
        self.paused -= 1
    return wrapped


def _config(shared_run):
  c = shared_run.config()     # tiny_trm on the session's shared base model
  c.total_steps = 1
  c.eval_problems, c.eval_every, c.eval_samples = 4, 1, 2
  c.rl.batch_size, c.rl.group_size = 8, 4
  return c


def test_every_config_key_is_read(tmp_path, monkeypatch, shared_run):
  c = _config(shared_run)
  keys = set(config_lib.all_keys(c))
  reads = KeyReads(c)
  reads.install(monkeypatch)
  train.run(c, str(tmp_path / "run"), progress=False)
  assert (tmp_path / "run" / "summary.json").exists()

  # Branches one run does not take: the settings of the other objectives, learner modes and
  # cache policies.
  for objective in OBJECTIVES:
    c.rl.objective = objective
    programs.learner_config(c, max_len=8)
  for mode in MODES:
    c.smd.mode = mode
    programs.learner_config(c, max_len=8)
  c.rollout.cache.ratio = 0.5
  for policy in POLICIES:
    c.rollout.cache.policy = policy
    programs.cache_config(c)
  # LoRA's settings, read when adapters are on (model.lora.rank > 0).
  c.model.lora.rank = 8
  train.add_adapters(c, from_pretrained(str(shared_run.base_dir)), str(shared_run.base_dir))
  programs.sampler_merge(c)

  unread = sorted(keys - reads.read)
  assert not unread, f"config keys no code reads: {unread}"
