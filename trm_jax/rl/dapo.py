"""DAPO's batch shaping (Yu et al. 2025, "DAPO: an open-source LLM RL system at scale"): host
side, per rollout batch, before the advantages.

  overlong_penalty   the soft overlong punishment (their Eq. 13): rewards of responses in the
                     last `buffer` tokens before the generation limit R fall linearly, to
                     -penalty at R:  R_len(y) = -penalty * clip((|y| - (R - buffer)) / buffer,
                     0, 1). (Their third case, |y| > R, cannot occur: the sampler stops at R.)
  group_signal       dynamic sampling's test (their Sec. 3.2): a group whose rewards are all
                     equal has GRPO advantage 0 for every row, no gradient, and only dilutes
                     the batch's normaliser; it is dropped and more prompts are rolled out.
  topup_prompts      how many prompts the next round rolls out: the missing groups over the
                     rate of groups with signal so far, rounded up to a power of two (so the
                     rollout program compiles for at most log2(prompts) + 1 row counts) and
                     to a row count the sampler's mesh splits evenly, at most a full batch.
  fill_plan          where a round's groups with signal go: into the batch's slots of groups
                     without signal, in order, so the batch keeps its rl.batch_size rows and
                     its group layout (static shapes for the score and update programs).

"Overlong filtering" (their Sec. 3.4: truncated responses leave the loss) is the trainer's
`rl.mask_truncated`: it only needs the rollout's `finished` flags (`step.fill_batch`).
Everything here is a pure function of its arguments, so a step that calls it replays bitwise
on resume.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Shaping:
  """A run's DAPO settings (the config's `rl` keys of the same names; off by default)."""
  dynamic_sampling: bool = False    # rl.dynamic_sampling
  max_rounds: int = 1               # rl.dynamic_sampling_max_rounds: rollout calls per step
  overlong_buffer: int = 0          # rl.overlong_buffer (0 = no overlong penalty)
  overlong_penalty: float = 1.0     # rl.overlong_penalty
  mask_truncated: bool = False      # rl.mask_truncated

  @classmethod
  def from_config(cls, rl) -> "Shaping":
    return cls(dynamic_sampling=rl.dynamic_sampling,
               max_rounds=rl.dynamic_sampling_max_rounds, overlong_buffer=rl.overlong_buffer,
               overlong_penalty=rl.overlong_penalty, mask_truncated=rl.mask_truncated)


def check_overlong(buffer: int, penalty: float, max_new_tokens: int) -> None:
  """ValueError naming the setting unless 0 <= buffer < max_new_tokens and penalty >= 0."""
  if not (isinstance(buffer, int) and 0 <= buffer < max(max_new_tokens, 1)):
    raise ValueError(f"rl.overlong_buffer={buffer!r} must be an integer in [0, "
                     f"task.max_new_tokens={max_new_tokens}): the penalty ramps over the last "
                     "overlong_buffer tokens before the limit")
  if not penalty >= 0:
    raise ValueError(f"rl.overlong_penalty={penalty!r} must be >= 0")


def overlong_penalty(lengths: np.ndarray, *, max_new_tokens: int, buffer: int,
                     penalty: float) -> np.ndarray:
  """[B] float32 reward added to responses of `lengths` [B] tokens (EOS included): 0 up to
  max_new_tokens - buffer tokens, then falling linearly by penalty / buffer a token, to
  -penalty at max_new_tokens. buffer = 0: no penalty."""
  check_overlong(buffer, penalty, max_new_tokens)
  lengths = np.asarray(lengths)
  if buffer == 0:
    return np.zeros(lengths.shape, np.float32)
  over = (lengths.astype(np.float64) - (max_new_tokens - buffer)) / buffer
  return (-penalty * np.clip(over, 0.0, 1.0)).astype(np.float32)


def group_signal(rewards: np.ndarray, group_size: int) -> np.ndarray:
  """[B / G] bool: the group's rewards are not all equal (GRPO has a non-zero advantage)."""
  r = np.asarray(rewards).reshape(-1, group_size)
  return np.any(r != r[:, :1], axis=1)


def topup_prompts(missing: int, with_signal: int, sampled: int, *, batch_prompts: int,
                  group_size: int, shards: int = 1) -> int:
  """Prompts for the next round: enough to fill `missing` groups at the rate of groups with
  signal seen so far (`with_signal` of `sampled`; none yet: a full batch), rounded up to a
  power of two and then to a multiple of rows the `shards` batch shards split, at most
  `batch_prompts` (whose rows the mesh already splits)."""
  if missing < 1:
    return 0
  rate = with_signal / sampled if sampled else 0.0
  want = batch_prompts if rate == 0.0 else math.ceil(missing / rate)
  n = 1 << max(0, math.ceil(math.log2(max(want, 1))))
  while (n * group_size) % shards:
    n *= 2
  return min(n, batch_prompts)


def fill_plan(batch_signal: np.ndarray, round_signal: np.ndarray, group_size: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Where a top-up round's groups with signal go in the batch.

  Args:
    batch_signal: [U] bool, the batch's groups so far (False: a slot to fill).
    round_signal: [n] bool, the round's groups.
  Returns:
    take [U * G] int32: for each batch row, the round's row that replaces it (0 where none);
    from_round [U * G] bool: the rows replaced;
    filled [U] bool: the batch's groups with signal after the round.
  The i-th empty slot (in batch order) takes the round's i-th group with signal; the round's
  groups beyond the empty slots are not used.
  """
  slots = np.flatnonzero(~batch_signal)
  fills = np.flatnonzero(round_signal)[:len(slots)]
  slots = slots[:len(fills)]
  G = group_size
  take = np.zeros(len(batch_signal) * G, np.int32)
  from_round = np.zeros(len(batch_signal) * G, bool)
  for dst, src in zip(slots, fills):
    take[dst * G:(dst + 1) * G] = np.arange(src * G, (src + 1) * G)
    from_round[dst * G:(dst + 1) * G] = True
  filled = batch_signal.copy()
  filled[slots] = True
  return take, from_round, filled
