"""Learner modes (`smd.mode`): which track the learner scores and what it adds to the loss.

Each mode is one `LearnerMode` entry of `MODES`; the learner (`rl.learner`), the step that
builds its batch (`step.rl_step`), the abstract batch AOT compiles for (`programs.build`) and
the config checks (`config.validate`) read the entry's fields, never the mode's name. The SMD
paper's comparisons (docs/smd.md, "Learner modes"):

  "off" / "dense"  rollouts with a dense cache; the learner is dense (evicted_at ignored).
  "naive"          sparse rollouts scored by the dense learner as if on-policy.
  "sparse_rl"      dense learner, Sparse-RL token weights and vetoes on the dense/sparse ratio
                   (`rl.sparse_rl`); the surrogate's ratio is taken against the dense
                   learner's own log-probs, since the weights carry the correction.
  "smd"            the learner replays the rollout's `evicted_at` (pi_shadow == pi_sparse),
                   plus the dense stop-gradient teacher distilled with weight `smd.lam`.

A new mode is one entry: `register_mode("name", LearnerMode(...))`, then `smd.mode = "name"`.
A mode receives only the `smd` settings its `config_fields` name (programs.learner_config), so
a setting no mode reads never enters another mode's compiled program.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax

from trm_jax.registry import Registry
from trm_jax.rl import sparse_rl

# (logp_theta [B, T], logp_roll [B, T], response_mask [B, T]) -> (token weights [B, T],
# metrics): computed once per rollout batch by the score pass, fixed data of every update.
TokenWeights = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, dict]]


@dataclasses.dataclass(frozen=True)
class LearnerMode:
  """What a learner mode changes; every field's default is the plain dense learner."""
  needs_compressed_cache: bool = False   # its rollouts must come from an evicting KV cache
  replays_eviction: bool = False         # the learner track obeys the rollout's evicted_at
                                         #   (LearnerBatch.evicted_at is filled)
  distills: bool = False                 # + smd.lam * KL(sg[dense teacher] || learner track)
                                         #   (LearnerConfig.lam; a teacher forward when > 0)
  token_weights: Optional[TokenWeights] = None   # score-pass weights (ones when None)
  ratio_to_learner: bool = False         # the objective's ratio is against the scored
                                         #   log-probs (logp_roll := logp_old), not pi_roll's
  config_fields: tuple[str, ...] = ()    # keys of the config's `smd` section this mode reads
                                         #   (LearnerConfig.mode_kwargs); a mode that distills
                                         #   reads its weight "lam"

  def __post_init__(self):
    if self.distills and "lam" not in self.config_fields:
      raise ValueError("a LearnerMode that distills reads its weight: config_fields must "
                       "include 'lam' (smd.lam)")


def _sparse_rl_weights(logp, logp_roll, response_mask):
  w = sparse_rl.sparse_rl_weights(logp, logp_roll, response_mask)
  return w.token_weights, {"sparse_rl/wasted_frac": w.wasted_frac,
                           "sparse_rl/veto_frac": w.veto_frac}


MODES: Registry[LearnerMode] = Registry("learner mode")


def register_mode(name: str, mode: LearnerMode) -> LearnerMode:
  """Adds `mode` under `name` (the value of `smd.mode` / `LearnerConfig.mode`)."""
  return MODES.register(name, mode)


def get_mode(name: str) -> LearnerMode:
  return MODES.get(name)


register_mode("off", LearnerMode())
register_mode("dense", LearnerMode())
register_mode("naive", LearnerMode(needs_compressed_cache=True))
register_mode("sparse_rl", LearnerMode(needs_compressed_cache=True,
                                       token_weights=_sparse_rl_weights,
                                       ratio_to_learner=True))
register_mode("smd", LearnerMode(needs_compressed_cache=True, replays_eviction=True,
                                 distills=True, config_fields=("lam",)))
