"""Held-out metrics: avg@k and pass@k from a [P, n] correctness array (P problems, n samples
each) for binary tasks, mean reward and its parts for graded ones (`heldout_metrics`).

avg@n is the mean reward over all samples (the paper reports avg@32 on AIME25). pass@k uses the
unbiased estimator of Chen et al. 2021 (Codex, eq. 1): with c of n samples correct,
  pass@k = 1 - C(n - c, k) / C(n, k),
computed as the product 1 - prod_{i=n-c+1}^{n} (1 - k / i), which never forms the huge binomials
(their Appendix A, numerically stable form). It is averaged over problems.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np


def _check(correct: np.ndarray) -> np.ndarray:
  correct = np.asarray(correct)
  if correct.ndim != 2:
    raise ValueError(f"correct must be [num_problems, n_samples], got shape {correct.shape}")
  if correct.size and not np.isin(correct, (0, 1)).all():
    raise ValueError("correct must hold 0/1 (or bool) values; got others")
  return correct.astype(bool)


def pass_at_k_per_problem(correct: np.ndarray, k: int) -> np.ndarray:
  """[P] unbiased pass@k of each problem from `correct` [P, n] (bool or 0/1), 1 <= k <= n."""
  correct = _check(correct)
  n = correct.shape[1]
  if not 1 <= k <= n:
    raise ValueError(f"pass@k needs 1 <= k <= n_samples; got k={k}, n_samples={n}")
  c = correct.sum(axis=1)                                    # [P]
  out = np.empty(correct.shape[0], dtype=np.float64)
  for p, cp in enumerate(c):
    if n - cp < k:  # every k-subset holds a correct sample
      out[p] = 1.0
    else:
      i = np.arange(n - cp + 1, n + 1, dtype=np.float64)
      out[p] = 1.0 - np.prod(1.0 - k / i)
  return out


def pass_at_k(correct: np.ndarray, k: int) -> float:
  """Mean unbiased pass@k over problems."""
  return float(pass_at_k_per_problem(correct, k).mean())


def avg_at_k(correct: np.ndarray) -> float:
  """Mean correctness over all P * n samples (avg@n)."""
  correct = _check(correct)
  return float(correct.mean())


def summarize(correct: np.ndarray, ks: Iterable[int] = (1,)) -> dict[str, float]:
  """{"avg@n": ..., "pass@k": ... for each k <= n}, the numbers an eval log prints."""
  correct = _check(correct)
  n = correct.shape[1]
  out = {f"avg@{n}": avg_at_k(correct)}
  for k in ks:
    if k <= n:
      out[f"pass@{k}"] = pass_at_k(correct, k)
  return out


def heldout_metrics(scores: Mapping[str, np.ndarray], *, binary: bool,
                    n: int) -> dict[str, float]:
  """The numbers one evaluation pass logs, from `scores` ("reward" and each part of the
  task's, data/tasks.py: [P * n] values, the n samples of each problem adjacent).

    n = 1, greedy:  binary -> greedy_accuracy;  graded -> greedy_reward, greedy_<part>
    n > 1, sampled: binary -> avg@n, pass@1, pass@n (`summarize`);
                    graded -> avg@n (the mean reward), <part>@n (the mean of each part)

  A graded reward has no "correct", hence no pass@k; avg@n is the mean reward either way.
  """
  rewards = np.asarray(scores["reward"]).reshape(-1, n)            # [P, n]
  if binary:
    correct = _check(rewards)
    if n == 1:
      return {"greedy_accuracy": float(correct.mean())}
    return summarize(correct, ks=(1, n))
  means = {k: float(np.mean(v, dtype=np.float64)) for k, v in scores.items()}
  if n == 1:
    return {f"greedy_{k}": v for k, v in means.items()}
  return {f"avg@{n}" if k == "reward" else f"{k}@{n}": v for k, v in means.items()}


def step_metrics(scores: Mapping[str, np.ndarray], *, binary: bool) -> dict[str, float]:
  """A training step's reward numbers from its rollouts' `scores` (data/tasks.py): the mean
  reward, and a binary task's accuracy (the fraction rewarded 1) or a graded task's parts
  (`task/<part>`, means)."""
  rewards = np.asarray(scores["reward"])
  out = {"reward": float(rewards.mean())}
  if binary:
    out["accuracy"] = float((rewards == 1.0).mean())
  else:
    out.update({f"task/{k}": float(np.mean(v, dtype=np.float64))
                for k, v in scores.items() if k != "reward"})
  return out
