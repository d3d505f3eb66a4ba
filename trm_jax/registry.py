"""Registries of named variants: objectives, learner modes, cache policies, TRM criteria,
tasks.

A variant is one entry, added with `register` and looked up with `get` by the name a config
uses (`rl.objective`, `smd.mode`, `rollout.cache.policy`, `trm.criteria`, `task.name`). A
`Registry` is a dict (name -> entry), so `name in R`, `sorted(R)` and iteration work as on one;
what it adds is the two errors every registry gives the same way: a name registered twice, and
an unknown name (which lists the registered ones).

An entry's settings are validated by the entry itself: objectives and criteria carry a
`check(config)` (`no_check` when they have nothing of their own to check), and tasks an
optional one (data/tasks.py), which `config.validate` runs for the entries the config selects,
so adding a variant touches its own module only.
"""
from __future__ import annotations

from typing import Generic, Iterable, TypeVar

V = TypeVar("V")


class Registry(dict, Generic[V]):
  """`Registry("cache policy", also=("none",))`: entries by name; `also` are names the
  owner accepts without an entry (and that cannot be registered)."""

  def __init__(self, kind: str, *, also: Iterable[str] = ()):
    super().__init__()
    self.kind = kind
    self.also = tuple(also)

  def register(self, name: str, entry: V) -> V:
    if name in self or name in self.also:
      raise ValueError(f"{self.kind} {name!r} is already registered")
    self[name] = entry
    return entry

  def get(self, name: str) -> V:  # pylint: disable=arguments-differ
    if name not in self:
      names = " or ".join(repr(n) for n in self.also)
      choices = f"{names} or one of {sorted(self)}" if names else f"one of {sorted(self)}"
      raise ValueError(f"{self.kind} must be {choices}, got {name!r}")
    return self[name]


def no_check(config) -> None:
  """The `check` of an entry with no settings of its own (or none beyond the checks every
  setting of its section gets)."""
  del config
