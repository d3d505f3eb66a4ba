"""Shared reporting for the experiment scripts: seed statistics and markdown tables.

The experiments run their grids with `trm_jax.sweep` and read back `results.csv`-style rows
(dicts of strings/floats). These helpers turn rows grouped by a method label into the
mean +- std (over seeds) cells of a markdown table, and read per-step metrics of a cell.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Callable, Mapping, Optional, Sequence

import numpy as np


def fmt_stat(mean: float, std: float, n: int, digits: int = 3) -> str:
  if n == 0 or not math.isfinite(mean):
    return "n/a"
  return f"{mean:.{digits}f}" if n == 1 else f"{mean:.{digits}f} ± {std:.{digits}f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
  lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
  return "\n".join(lines)


def weighted_bucket_rates(records: Sequence[Mapping], prefix: str = "trm/reject_rate/len_"
                          ) -> dict[str, tuple[float, float]]:
  """Per length bucket: (rejection rate pooled over all steps, sequences seen).

  The trainer logs, per step, each bucket's rate and its `/count`; pooling weights each step by
  its count, so a bucket that is rarely populated does not swing the estimate.
  """
  out: dict[str, list[float]] = {}
  for r in records:
    for k, v in r.items():
      if k.startswith(prefix) and not k.endswith("/count") and v is not None:
        n = r.get(k + "/count") or 0
        acc = out.setdefault(k[len(prefix):], [0.0, 0.0])
        acc[0] += float(v) * n
        acc[1] += n
  return {b: (rej / n if n else math.nan, n) for b, (rej, n) in out.items()}


def bucket_order(name: str) -> int:
  lo = name.split("_")[0]
  return int(lo) if lo.isdigit() else 1 << 30


def write_text(path: str, text: str) -> None:
  from trm_jax import workdir  # pylint: disable=g-import-not-at-top
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  workdir.write_text_atomic(path, text)


def write_summary(out: str, sections: Sequence[str]) -> str:
  """OUT/summary.md from markdown sections (blank line between them); returns the text."""
  text = "\n\n".join(sections) + "\n"
  write_text(os.path.join(out, "summary.md"), text)
  return text


def write_table_summary(out: str, title: str, intro: str, header: Sequence[str], rows,
                        claims: Sequence[str]) -> str:
  """The summary of a seed-grid experiment with one table: its title, what was run, the
  table, what the runs show (`claims`, one line each) and the curves."""
  return write_summary(out, [title, intro, markdown_table(header, rows),
                             "## What these runs show", "\n".join(claims),
                             "![curves](curves.png)"])


def choices(p, value: str, known, what: str = "method") -> list[str]:
  """The comma-separated `value` as a list; an unknown entry is an argparse error naming it."""
  items = [x for x in value.split(",") if x]
  unknown = [x for x in items if x not in known]
  if unknown:
    p.error(f"unknown {what}(s) {unknown}; known: {list(known)}")
  return items


def first_last_mean(values: np.ndarray, frac: float = 0.1) -> tuple[float, float]:
  """Means of the first and last `frac` of the finite values (at least one each)."""
  v = values[np.isfinite(values)]
  if not len(v):
    return math.nan, math.nan
  k = max(1, int(math.ceil(len(v) * frac)))
  return float(v[:k].mean()), float(v[-k:].mean())


MIN_REPLICATES = 3


@dataclasses.dataclass(frozen=True)
class Difference:
  """mean(a) - mean(b) with its standard error (Welch: independent groups of replicates)."""
  mean_a: float
  mean_b: float
  se: float
  n_a: int
  n_b: int

  @property
  def diff(self) -> float:
    return self.mean_a - self.mean_b

  def verdict(self, direction: str) -> str:
    """'yes' / 'no (opposite)' / 'not resolved' for the claim that a is `direction` than b,
    at two standard errors."""
    if min(self.n_a, self.n_b) < MIN_REPLICATES or not (
        math.isfinite(self.diff) and math.isfinite(self.se)):
      # Two points give a standard error with one degree of freedom: no verdict on that.
      return (f"not resolved: {min(self.n_a, self.n_b)} replicate(s), fewer than "
              f"{MIN_REPLICATES} (difference {self.diff:+.4f})")
    sign = 1.0 if direction == "higher" else -1.0
    margin = f"difference {self.diff:+.4f}, 2 s.e. {2 * self.se:.4f}"
    if sign * self.diff > 2 * self.se:
      return f"yes ({margin})"
    if sign * self.diff < -2 * self.se:
      return f"no, the opposite ({margin})"
    return f"not resolved at this size ({margin})"


def compare(a: Sequence[float], b: Sequence[float]) -> Difference:
  """Difference of means of two groups of replicates; se is NaN with < 2 values in a group."""
  a = np.array(a, float)
  b = np.array(b, float)
  a, b = a[np.isfinite(a)], b[np.isfinite(b)]
  var = lambda x: x.var(ddof=1) / len(x) if len(x) > 1 else math.nan
  return Difference(float(a.mean()) if len(a) else math.nan,
                    float(b.mean()) if len(b) else math.nan,
                    float(math.sqrt(var(a) + var(b))), len(a), len(b))


def paired(a: Sequence[float], b: Sequence[float]) -> Difference:
  """Mean of a - b over matched replicates (same setting); se of that mean difference."""
  a, b = np.array(a, float), np.array(b, float)
  d = a - b
  se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else math.nan
  return Difference(float(a.mean()) if len(a) else math.nan,
                    float(b.mean()) if len(b) else math.nan, se, len(a), len(b))


def finite_mean(vals) -> float:
  """Mean of the finite values; NaN when there are none."""
  v = np.array(vals, float)
  v = v[np.isfinite(v)]
  return float(v.mean()) if len(v) else math.nan


def fmt_values(vals) -> str:
  """'mean ± std' over the finite values (just the mean for one, 'n/a' for none)."""
  v = np.array(vals, float)
  v = v[np.isfinite(v)]
  if not len(v):
    return "n/a"
  return fmt_stat(float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0, len(v))


# --- The command line and run loop both experiment scripts share ------------------------------

def add_run_args(p, name: str, *, seeds: str, batch: int, eval_problems: int,
                 lr: float = 3e-5) -> None:
  """Flags every experiment has: size, learning rate, parallelism, directories, overrides."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  p.add_argument("--seeds", default=seeds)
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--batch", type=int, default=batch, help="rollouts per step (8 per prompt)")
  # 3e-5: with 4-8 prompts per step, lr 1e-4 leaves these tiny policies in a gradient-noise
  # regime (experiments/results/smd_compression_lr1e-4: the dense learner ends below the
  # untrained policy on held-out problems).
  p.add_argument("--lr", type=float, default=lr)
  p.add_argument("--eval-problems", type=int, default=eval_problems)
  p.add_argument("--parallel", type=int, default=2)
  p.add_argument("--workdir", default=os.path.join(repo, "experiments", "out", name))
  p.add_argument("--out", default=os.path.join(repo, "experiments", "results", name))
  p.add_argument("--set", action="append", default=[], metavar="KEY=V",
                 help="extra config override for every run (e.g. warmup.cache_dir=...)")


def fixed_overrides(args, **extra) -> dict:
  """The overrides every cell shares: the size flags, `extra`, then each --set KEY=V."""
  from trm_jax import sweep  # pylint: disable=g-import-not-at-top
  fixed = {"total_steps": args.steps, "rl.batch_size": args.batch, "optim.lr": args.lr,
           "eval_problems": args.eval_problems, "ckpt_every": max(1, args.steps // 2),
           **extra}
  fixed.update(sweep.parse_sets(args.set))
  return fixed


def run_grid(config: str, cells, args, csv: str = "results.csv", on_done=None) -> list[dict]:
  """Runs (or resumes) the cells, then writes OUT/`csv` with their rows (only theirs: a
  workdir two phases share holds the other's runs too); returns the rows. With
  `args.report_only` nothing runs: the cells are planned and the rows say which are done.
  `on_done(cell, status)`: `sweep.run_sweep`'s, called as each cell ends."""
  from trm_jax import sweep  # pylint: disable=g-import-not-at-top
  if getattr(args, "report_only", False):
    sweep.plan_sweep(config, cells, args.workdir)
  else:
    sweep.run_sweep(config, cells, args.workdir, parallel=args.parallel,
                    threads_per_cell=1 if args.parallel > 1 else None, on_done=on_done)
  os.makedirs(args.out, exist_ok=True)
  return sweep.aggregate(args.workdir, os.path.join(args.out, csv), cells)


def exit_code(rows, workdir: str) -> int:
  bad = list(dict.fromkeys(r["cell"] for r in rows if r["status"] != "ok"))  # phases overlap
  if bad:
    print(f"runs that did not finish: {bad} (logs in {workdir}/cells/*/log.txt)")
  return 1 if bad else 0


def finish_grid(config: str, cells, args, groups: Mapping[str, Sequence], *,
                curve_keys: Sequence[str], stats_of: Callable, has_runs: Callable[[dict], bool],
                write_summary: Callable, curve_groups: Optional[Mapping] = None,
                also: Optional[Callable[[dict], None]] = None) -> int:
  """The tail every seed-grid experiment shares: run (or resume) the cells, plot their curves
  by group, take each group's statistics (`stats_of(workdir, cells)`, kept where
  `has_runs(stats)`: a group none of whose runs finished has no row), hand them to `also`
  (an extra plot), write and print the summary, and return the exit code."""
  from trm_jax import sweep  # pylint: disable=g-import-not-at-top
  rows = run_grid(config, cells, args)
  sweep.plot_grouped(args.workdir, curve_keys, os.path.join(args.out, "curves.png"),
                     groups=curve_groups or groups)
  stats = {g: stats_of(args.workdir, cs) for g, cs in groups.items()}
  stats = {g: st for g, st in stats.items() if has_runs(st)}
  if also:
    also(stats)
  print(write_summary(args.out, stats, args, sweep.span_seconds(args.workdir)))
  return exit_code(rows, args.workdir)
