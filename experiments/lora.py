r"""LoRA on the main job: does training adapters only learn the task, and what does a step cost?

  python -m experiments.lora                     # full fine-tuning and LoRA x 3 seeds, 150 steps
  python -m experiments.lora --seeds 0 --steps 30

Both arms are the main job (`configs/tiny_trm.py`: GRPO + TRM-max, bf16 sampler with logit
noise, 64 rollouts per step, held-out avg@4 on 64 problems at step 0 and every 50 steps):

  full   every parameter trained, lr --lr (3e-5, the main job's)
  lora   `model.lora.rank` = --rank adapters on every projection (q, k, v, o, gate, up, down,
         alpha 32), the base frozen, lr --lora-lr (3e-4: ten times full fine-tuning's, the
         ratio Schulman et al. 2025, "LoRA Without Regret", found best across model sizes)

fixed before running. Every run starts from the main job's base (the warm-up depends on the
warmup settings alone, so the seeds share it; it is built once under --workdir); a seed
chooses the RL prompts, the held-out problems and the adapters' initial A. A seed's two arms
run side by side (`--parallel 2`), so their step times are measured under the same load. The
frozen control of a seed is its step-0 evaluation: evaluation samples fixed problems with a
fixed key, so an untrained policy scores the same at every evaluation (docs/results.md, the
main job).

Per run: held-out avg@4 and greedy accuracy at step 0 and the end, reward over the first and
last 10 % of steps, and the mean RL step time (time/step_s, the first step, which compiles,
left out). Claims, each with its difference and two standard errors over seeds: LoRA's gain
over its frozen control, LoRA's gain against full fine-tuning's, and LoRA's step time
against full fine-tuning's. Writes results.csv, curves.png and summary.md into --out; runs
live in --workdir (resumable).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

from experiments import report
from trm_jax import sweep
from trm_jax.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "tiny_trm.py")
ARMS = ("full", "lora")
CURVE_KEYS = ("reward", "eval/avg@4", "time/step_s")


def build_cells(args, seeds) -> tuple[list[sweep.Cell], dict]:
  """(cells, arm -> its cells): per seed the two arms next to each other, so that
  `--parallel 2` runs them side by side."""
  fixed = report.fixed_overrides(args, eval_every=50 if args.steps >= 50 else args.steps)
  fixed.setdefault("warmup.cache_dir", os.path.join(args.workdir, "base"))
  arms = {"full": {}, "lora": {"model.lora.rank": args.rank, "optim.lr": args.lora_lr}}
  groups = {arm: [] for arm in ARMS}
  for s in seeds:
    for arm in ARMS:
      groups[arm] += sweep.product([("", fixed)], [(f"arm={arm}", arms[arm])],
                                   sweep.axis("seed", [s]))
  return [c for pair in zip(*groups.values()) for c in pair], groups


def run_stats(workdir: str, cells) -> dict:
  """Per finished run (lists over seeds): held-out numbers, rewards, step time."""
  out = {k: [] for k in ("seed", "avg_first", "avg_last", "greedy_first", "greedy_last",
                         "reward_first", "reward_last", "step_s")}
  for c in cells:
    if not sweep.is_done(workdir, c):
      continue
    d = sweep.cell_dir(workdir, c)
    records = [r for r in read_metrics(os.path.join(d, "metrics.jsonl")) if "reward" in r]
    rf, rl = report.first_last_mean(np.array([r["reward"] for r in records], float))
    with open(os.path.join(d, "summary.json")) as f:
      evals = json.load(f)["summary"].get("evals", {})
    for key, name in (("avg", "avg@4"), ("greedy", "greedy_accuracy")):
      e = evals.get(name)
      out[f"{key}_first"].append(e["first"] if e and e["first_step"] == 0 else math.nan)
      out[f"{key}_last"].append(e["last"] if e else math.nan)
    out["reward_first"].append(rf)
    out["reward_last"].append(rl)
    out["step_s"].append(float(np.mean([r["time/step_s"] for r in records[1:]]))
                         if len(records) > 1 else math.nan)
    out["seed"].append(dict(c.overrides)["seed"])
  return out


def _by_seed(stats: dict, key: str) -> dict:
  return dict(zip(stats["seed"], stats[key]))


def claims(stats: dict) -> list[str]:
  """What the runs say, each difference judged at two standard errors (seeds as replicates;
  the two arms of a seed share its base and prompts, so arms are compared seed by seed)."""
  lines = []
  lora, full = stats.get("lora"), stats.get("full")
  if lora and lora["seed"]:
    d = report.paired(lora["avg_last"], lora["avg_first"])
    lines.append(f"- LoRA learns the task: held-out avg@4 {d.mean_b:.3f} -> {d.mean_a:.3f}, a "
                 f"gain of {d.diff:+.3f} over the frozen control (its step-0 value) over "
                 f"{d.n_a} seeds: {d.verdict('higher')}.")
  if lora and full:
    seeds = [s for s in lora["seed"] if s in full["seed"]]
    gain = lambda st: [_by_seed(st, "avg_last")[s] - _by_seed(st, "avg_first")[s]
                       for s in seeds]
    d = report.paired(gain(lora), gain(full))
    lines.append(f"- LoRA's gain against full fine-tuning's, seed by seed: {d.mean_a:+.3f} vs "
                 f"{d.mean_b:+.3f}. LoRA lower: {d.verdict('lower')}.")
    ratio = [_by_seed(lora, "step_s")[s] / _by_seed(full, "step_s")[s] for s in seeds]
    d = report.paired(ratio, [1.0] * len(ratio))
    lines.append(f"- RL step time, LoRA / full fine-tuning, side by side: {d.mean_a:.3f} "
                 f"(seconds per step {report.finite_mean([_by_seed(lora, 'step_s')[s] for s in seeds]):.2f}"
                 f" vs {report.finite_mean([_by_seed(full, 'step_s')[s] for s in seeds]):.2f})."
                 f" LoRA faster: {d.verdict('lower')}.")
  return lines


def write_summary(out: str, stats: dict, args, wall_s: float) -> str:
  fmt = report.fmt_values
  header = ["arm", "held-out avg@4 step 0", "held-out avg@4 end", "greedy step 0",
            "greedy end", "reward first 10%", "reward last 10%", "step time (s)"]
  rows = [[arm, fmt(s["avg_first"]), fmt(s["avg_last"]), fmt(s["greedy_first"]),
           fmt(s["greedy_last"]), fmt(s["reward_first"]), fmt(s["reward_last"]),
           fmt(s["step_s"])] for arm, s in stats.items()]
  n_seeds = max(len(s["seed"]) for s in stats.values())
  return report.write_table_summary(
      out, "# LoRA on the main job: adapters only, against full fine-tuning",
      f"{len(stats)} arms x {n_seeds} seeds, {args.steps} RL steps of {args.batch} rollouts; "
      f"full fine-tuning at lr {args.lr}, LoRA rank {args.rank} (alpha 32, q/k/v/o/gate/up/"
      f"down) at lr {args.lora_lr}; config `configs/tiny_trm.py`. Held-out: "
      f"{args.eval_problems} problems, avg@4 and greedy at step 0 and the end. Step time: mean "
      "time/step_s after the first step, the two arms of a seed running side by side. Values "
      f"are mean ± std over seeds. Training span {wall_s / 60:.1f} min ({args.parallel} runs "
      "at a time).",
      header, rows, claims(stats))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  report.add_run_args(p, "lora", seeds="0,1,2", batch=64, eval_problems=64)
  p.set_defaults(steps=150)
  p.add_argument("--rank", type=int, default=8, help="model.lora.rank of the LoRA arm")
  p.add_argument("--lora-lr", type=float, default=3e-4, help="the LoRA arm's optim.lr")
  args = p.parse_args(argv)
  cells, groups = build_cells(args, [int(s) for s in args.seeds.split(",")])
  return report.finish_grid(CONFIG, cells, args, groups, curve_keys=CURVE_KEYS,
                            stats_of=run_stats, has_runs=lambda st: st["seed"],
                            write_summary=write_summary)


if __name__ == "__main__":
  sys.exit(main())
