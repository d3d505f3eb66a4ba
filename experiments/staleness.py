r"""TRM paper's third mismatch source, small scale: rollouts sampled by stale parameters.

  python -m experiments.staleness                        # 4 methods x k in {0,1,2,4} x 2 seeds
  python -m experiments.staleness --staleness 0,2 --methods ppo_clip,trm_max_kl --seeds 0

Asynchronous RL samples batch t with the parameters of update t - 1 - k (`rl.staleness = k`),
so pi_roll lags pi_theta by k updates. Here staleness is the only mismatch: the sampler runs in
fp32 without logit noise (`configs/tiny_trm.py` otherwise), so at k = 0 pi_roll ==
pi_theta exactly and every divergence measured at k > 0 is the lag's. The learning rate is
1e-4 by default (3e-5 moves the tiny policy so little in k updates that the lag is invisible).

  token-level     ppo_clip (ratio against the rollout's log-probs, clipped), tis (truncated IS)
  sequence-level  trm_max_kl (TRM-max, KL from the rollout's full log-probs), ln_trm
  control         frozen (lr = 0; staleness is moot when nothing moves)

Per run: the largest token KL between sampler and learner (mean over steps of the batch
maximum), the mean token KL (E[sum_t KL] / response length), rejection rate, |PPL gap|, and
the held-out avg@k / greedy accuracy at step 0 and the end against the frozen control.
Writes results.csv, curves.png and summary.md into --out; runs live in --workdir (resumable).
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

METHODS = {
    "ppo_clip": {"rl.objective": "ppo_clip", "trm.criteria": ()},
    "tis": {"rl.objective": "tis", "trm.criteria": ()},
    "trm_max_kl": {"rl.objective": "trm_surrogate", "trm.criteria": ("trm_max_kl",)},
    "ln_trm": {"rl.objective": "trm_surrogate", "trm.criteria": ("ln_trm",)},
}
TOKEN_LEVEL = ("ppo_clip", "tis")
CONTROL = "frozen"
CURVE_KEYS = ("reward", "trm/delta_hat", "trm/reject_rate")
# Staleness is the only mismatch: no bf16, no logit noise.
PURE = {"rollout.dtype": "float32", "rollout.logit_noise": 0.0}
# The base of the committed results: warmed up on worked demonstrations only (the main job's
# answer-only mix came later), cached apart from the main job's; --set may override both.
BASE = {"warmup.answer_only_frac": 0.0, "warmup.cache_dir": "~/.cache/trm_jax/tiny_worked_base"}


def build_cells(methods, ks, seeds, fixed: dict) -> tuple[list[sweep.Cell], dict]:
  groups = {}
  for m in methods:
    for k in ks:
      groups[(m, k)] = sweep.product(
          [("", {**fixed, **PURE})], [(f"method={m},k={k}", {**METHODS[m], "rl.staleness": k})],
          sweep.axis("seed", seeds))
  groups[(CONTROL, 0)] = sweep.product(
      [("", {**fixed, **PURE})], [(f"method={CONTROL}", {**METHODS["ppo_clip"],
                                                         "optim.lr": 0.0})],
      sweep.axis("seed", seeds))
  return [c for cs in groups.values() for c in cs], groups


def run_stats(workdir: str, cells) -> dict:
  """Per finished run (lists over seeds): divergences, rejection, PPL gap, held-out numbers."""
  out = {k: [] for k in ("seed", "max_kl", "mean_kl", "reject", "abs_gap", "avg_first",
                         "avg_last", "greedy_last", "reward_first", "reward_last")}
  for c in cells:
    if not sweep.is_done(workdir, c):
      continue
    records = [r for r in read_metrics(os.path.join(sweep.cell_dir(workdir, c),
                                                    "metrics.jsonl")) if "reward" in r]
    col = lambda k: np.array([r.get(k) if r.get(k) is not None else np.nan
                              for r in records], float)
    out["max_kl"].append(float(np.nanmean(col("trm/delta_hat"))))
    out["mean_kl"].append(float(np.nanmean(col("trm/kl_seq_hat") / col("response_len"))))
    out["reject"].append(float(np.nanmean(col("trm/reject_rate"))))
    out["abs_gap"].append(float(np.nanmean(np.abs(col("trm/ppl_gap")))))
    rf, rl = report.first_last_mean(col("reward"))
    out["reward_first"].append(rf)
    out["reward_last"].append(rl)
    out["seed"].append(dict(c.overrides)["seed"])
    with open(os.path.join(sweep.cell_dir(workdir, c), "summary.json")) as f:
      summ = json.load(f)
    evals = summ["summary"].get("evals", {})
    avg = next((e for k, e in evals.items() if k.startswith("avg@")), None)
    out["avg_first"].append(avg["first"] if avg and avg["first_step"] == 0 else math.nan)
    out["avg_last"].append(avg["last"] if avg else math.nan)
    out["greedy_last"].append(summ.get("eval", {}).get("greedy_accuracy", math.nan))
  return out


def claims(stats: dict) -> list[str]:
  """What the runs say, each difference judged at two standard errors (seeds as replicates)."""
  lines = []
  ks = sorted({k for (_, k) in stats if k > 0})
  methods = sorted({m for (m, _) in stats if m != CONTROL})
  if ks and methods:
    k_hi = ks[-1]
    lo = [v for m in methods for v in stats.get((m, 0), {}).get("max_kl", [])]
    hi = [v for m in methods for v in stats.get((m, k_hi), {}).get("max_kl", [])]
    d = report.compare(hi, lo)
    lines.append(f"- Largest token KL grows with the lag: {d.mean_b:.4f} at k = 0 vs "
                 f"{d.mean_a:.4f} at k = {k_hi} (all methods): {d.verdict('higher')}.")
    for m in methods:
      if m in TOKEN_LEVEL or (m, k_hi) not in stats or (m, 0) not in stats:
        continue
      d = report.compare(stats[(m, k_hi)]["reject"], stats[(m, 0)]["reject"])
      lines.append(f"- {m} rejects more of the stale batches: {d.mean_b:.3f} at k = 0 vs "
                   f"{d.mean_a:.3f} at k = {k_hi}: {d.verdict('higher')}.")
  if CONTROL in {m for m, _ in stats}:
    ctl = stats[(CONTROL, 0)]
    by_seed = dict(zip(ctl["seed"], ctl["avg_last"]))
    for k in sorted({k for (_, k) in stats}):
      trm = [s["avg_last"][i] - by_seed.get(s["seed"][i], math.nan)
             for (m, kk), s in stats.items() if kk == k and m not in TOKEN_LEVEL + (CONTROL,)
             for i in range(len(s["seed"]))]
      tok = [s["avg_last"][i] - by_seed.get(s["seed"][i], math.nan)
             for (m, kk), s in stats.items() if kk == k and m in TOKEN_LEVEL
             for i in range(len(s["seed"]))]
      if trm and tok:
        d = report.compare(trm, tok)
        lines.append(f"- k = {k}: held-out avg@k minus the frozen control's, sequence-level "
                     f"{d.mean_a:+.3f} vs token-level {d.mean_b:+.3f} over {d.n_a} / {d.n_b} "
                     f"runs. TRM ahead: {d.verdict('higher')}.")
  return lines


def write_summary(out: str, stats: dict, args, wall_s: float) -> str:
  fmt = report.fmt_values
  header = ["method", "k", "largest token KL", "mean token KL", "reject rate", "|PPL gap|",
            "held-out avg@k step 0", "held-out avg@k end", "greedy end", "reward first 10%",
            "reward last 10%"]
  rows = [[m, k if m != CONTROL else "-", fmt(s["max_kl"]), fmt(s["mean_kl"]),
           fmt(s["reject"]), fmt(s["abs_gap"]), fmt(s["avg_first"]), fmt(s["avg_last"]),
           fmt(s["greedy_last"]), fmt(s["reward_first"]), fmt(s["reward_last"])]
          for (m, k), s in stats.items()]
  n_seeds = max(len(s["seed"]) for s in stats.values())
  return report.write_table_summary(
      out, "# Stale rollouts: rl.staleness = k (the sampler lags the learner by k updates)",
      f"{len(stats)} (method, k) groups x {n_seeds} seeds, {args.steps} RL steps each, "
      f"{args.batch} rollouts per step, lr {args.lr}; config `configs/tiny_trm.py` "
      "with an fp32 sampler and no logit noise, so staleness is the only mismatch. "
      f"Held-out: {args.eval_problems} problems, avg@{args.eval_samples} and greedy, at step 0 "
      "and the end. Largest token KL: the batch maximum of KL(pi_roll || pi_theta) per token, "
      "averaged over steps; mean token KL: E[sum_t KL] / response length. Values are mean ± "
      f"std over seeds. Training span {wall_s / 60:.1f} min ({args.parallel} runs at a time).",
      header, rows, claims(stats))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--methods", default=",".join(METHODS))
  p.add_argument("--staleness", default="0,1,2,4", help="values of rl.staleness")
  report.add_run_args(p, "staleness", seeds="0,1", batch=64, eval_problems=64, lr=1e-4)
  p.add_argument("--eval-samples", type=int, default=4, help="k of the held-out avg@k")
  args = p.parse_args(argv)
  methods = report.choices(p, args.methods, METHODS)
  ks = [int(k) for k in args.staleness.split(",")]
  fixed = report.fixed_overrides(args, eval_every=args.steps, eval_samples=args.eval_samples,
                                 **BASE)
  cells, groups = build_cells(methods, ks, [int(s) for s in args.seeds.split(",")], fixed)
  curve_groups = {f"{m},k={k}" if m != CONTROL else m: cs for (m, k), cs in groups.items()}
  return report.finish_grid(CONFIG, cells, args, groups, curve_keys=CURVE_KEYS,
                            stats_of=run_stats, has_runs=lambda st: st["seed"],
                            write_summary=write_summary, curve_groups=curve_groups)


if __name__ == "__main__":
  sys.exit(main())
