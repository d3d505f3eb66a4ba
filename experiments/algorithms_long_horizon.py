r"""TRM beside the algorithms verl, TRL, slime and SkyRL ship, where TRM learns on the long task.

  python -m experiments.algorithms_long_horizon --restore     # references + base, then the grid
  python -m experiments.algorithms_long_horizon --report-only

The setting is the committed long-horizon follow-up's (experiments/results/
trm_long_horizon_delta): `configs/tiny_trm_long.py` under the `noise_0.3` mismatch (bf16
sampler, logit noise 0.3) with trm.delta = 0.1, from the committed base model
(experiments/results/trm_long_horizon/base), 100 RL steps of 64 rollouts at lr 3e-5, held-out
avg@4 on 64 fixed problems, seeds 0-2. There, TRM-max (delta 0.1), PPO-clip and the exact
sampler each have three committed runs (REFERENCE); this experiment adds, on the same cells'
settings, the methods of METHODS, every setting fixed before any run:

  gspo          GSPO (Zheng et al. 2025): its clip range 3e-4 / 4e-4 and its aggregation
                (seq-mean-token-mean)
  cispo         CISPO (MiniMax-M1 2025): no lower bound, the weight capped at 5 (ScaleRL's
                epsilon_max), token-mean aggregation (the paper's)
  ppo_seq_mis   PPO-clip with trm.criteria = ("seq_mis",), cap 2.0 (verl's default)
  ppo_geo_mean  PPO-clip with trm.criteria = ("geo_mean",), tau 0.001 (verl's geo_rs bounds
                0.999 / 1.001)

GSPO's, CISPO's and PPO's ratios are against pi_old, the learner's own scores of the batch
before its update (as in verl's decoupled mode and TRL): with one update per batch (the
setting's rl.num_minibatches = 1) they measure no rollout mismatch, which only the sequence
masks (seq_mis, geo_mean, TRM) see, through pi_theta / pi_roll.

Per method: the held-out gain (avg@4 at the end minus at step 0), the rejection rate, the PPL
gap (|Delta_PPL| over the last 10 % of steps) and the largest token KL(pi_roll || pi_theta)
(mean over steps of the batch's maximum), each new method's difference from each reference
with 2 s.e., paired by seed (a seed fixes the prompts and the held-out problems).

Writes into --out: summary.md, summary.json, curves.png, results.csv (the new runs) and
runs.jsonl.gz (the new runs' summaries and metrics, archived after every run). The runs live in
--workdir, resumable; --restore first installs the committed base as the warm-up's cache and
adds the reference runs (from their archives) and this experiment's archived runs to the
workdir, so only the missing runs run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

from experiments import report, trm_long_horizon as tlh
from trm_jax import run_archive, sweep

REPO = tlh.REPO
CONFIG = tlh.CONFIG
SETTING = "noise_0.3"
FIXED = {"trm.delta": 0.1}     # the follow-up's: TRM-max's threshold, read by no new method
RESULTS = os.path.join(REPO, "experiments", "results")
# The committed runs, by method: (archive, cell names).
REFERENCE = {
    "exact": [("trm_long_horizon/runs.jsonl.gz", [f"method=exact,seed={s}" for s in (0, 1, 2)])],
    "ppo_clip": [("trm_long_horizon/runs.jsonl.gz", ["setting=noise_0.3,method=ppo_clip,seed=0"]),
                 ("trm_long_horizon_delta/delta_0.1_ppo_seeds_1_2/runs.jsonl.gz",
                  [f"setting=noise_0.3,method=ppo_clip,seed={s}" for s in (1, 2)])],
    "trm_max_kl": [("trm_long_horizon_delta/delta_0.1/runs.jsonl.gz",
                    ["setting=noise_0.3,method=trm_max_kl,seed=0"]),
                   ("trm_long_horizon_delta/delta_0.1_ppo_seeds_1_2/runs.jsonl.gz",
                    [f"setting=noise_0.3,method=trm_max_kl,seed={s}" for s in (1, 2)])],
}
BASE = os.path.join(RESULTS, "trm_long_horizon", tlh.BASE)
# A sequence mask that rejects every sequence of a batch is a result here too (tlh.METHODS):
# the stall guard is off for the masking methods, so such a run trains on nothing to the end.
METHODS = {
    "gspo": {"rl.objective": "gspo", "rl.loss_agg": "seq-mean-token-mean", "trm.criteria": ()},
    "cispo": {"rl.objective": "cispo", "rl.loss_agg": "token-mean", "trm.criteria": ()},
    "ppo_seq_mis": {"rl.objective": "ppo_clip", "trm.criteria": ("seq_mis",),
                    "rl.max_consecutive_skips": 0},
    "ppo_geo_mean": {"rl.objective": "ppo_clip", "trm.criteria": ("geo_mean",),
                     "rl.max_consecutive_skips": 0},
}
# The per-run numbers compared, (key of tlh.run_stats, label, format).
MEASURES = (("gain", "held-out gain", "+.3f"), ("reject", "rejection rate", ".3f"),
            ("abs_gap_last", "|Delta_PPL| last 10%", ".4f"),
            ("max_kl", "largest token KL", ".3f"))
CLIP_KEYS = ("gspo_clip_frac", "cispo_clip_frac", "clip_frac")
ARCHIVE = "runs.jsonl.gz"


def new_cell(method: str, seed: int, fixed: dict) -> sweep.Cell:
  """A run of METHODS[method] under the setting, named like the references' cells."""
  return sweep.product([("", fixed)], [(f"setting={SETTING},method={method}",
                                        {**tlh.MISMATCHES[SETTING], **METHODS[method]})],
                       sweep.axis("seed", [seed]))[0]


def restore(workdir: str, out: str) -> None:
  """The committed base as the warm-up's cache; the reference runs and OUT's archived runs
  into WORKDIR."""
  from trm_jax import warmup  # pylint: disable=g-import-not-at-top
  _, c = tlh.base_of(tlh.cell(tlh.EXACT, "", 0, {}))
  print(f"[restore] base model {warmup.install_base(BASE, c)} from {BASE}")
  archives = {a for parts in REFERENCE.values() for a, _ in parts}
  for a in sorted(archives):
    n = len(run_archive.restore_runs(os.path.join(RESULTS, a), workdir, CONFIG))
    print(f"[restore] {n} runs from {a}")
  own = os.path.join(out, ARCHIVE)
  if os.path.exists(own):
    print(f"[restore] {len(run_archive.restore_runs(own, workdir, CONFIG))} runs from {own}")


def planned(workdir: str, names_by_method: dict) -> dict[str, list[sweep.Cell]]:
  """{method: its cells as planned in WORKDIR} for {method: cell names}."""
  _, cells = sweep.load_plan(workdir)
  by_name = {c.name: c for c in cells}
  missing = [n for ns in names_by_method.values() for n in ns if n not in by_name]
  if missing:
    raise SystemExit(f"runs {missing} are not in {workdir}: run with --restore")
  return {m: [by_name[n] for n in ns] for m, ns in names_by_method.items()}


def reference_cells(workdir: str) -> dict[str, list[sweep.Cell]]:
  """The reference runs as planned in WORKDIR (after `restore`), by method."""
  return planned(workdir, {m: [n for _, ns in parts for n in ns]
                           for m, parts in REFERENCE.items()})


def clip_fraction(workdir: str, cells) -> list[float]:
  """Per run: the mean over steps of the objective's clip fraction (GSPO's sequences, CISPO's
  and PPO's tokens), NaN for an objective without one."""
  from trm_jax.metrics import read_metrics  # pylint: disable=g-import-not-at-top
  out = []
  for c in cells:
    if not sweep.is_done(workdir, c):
      continue
    recs = read_metrics(os.path.join(sweep.cell_dir(workdir, c), "metrics.jsonl"))
    key = next((k for k in CLIP_KEYS if any(k in r for r in recs)), None)
    vals = [r[key] for r in recs if key and r.get(key) is not None]
    out.append(float(np.mean(vals)) if vals else math.nan)
  return out


def by_seed(workdir: str, cells, key: str) -> dict[int, float]:
  """{seed: that run's value of tlh.run_stats' `key`}."""
  st = tlh.run_stats(workdir, cells)
  return dict(zip(st["seed"], st[key]))


def paired_difference(workdir: str, a_cells, b_cells, key: str) -> report.Difference:
  """a minus b over the seeds both have (a seed fixes prompts and held-out problems)."""
  a, b = by_seed(workdir, a_cells, key), by_seed(workdir, b_cells, key)
  seeds = sorted(set(a) & set(b))
  return report.paired([a[s] for s in seeds], [b[s] for s in seeds])


def fmt_diff(d: report.Difference, fmt: str) -> str:
  if not math.isfinite(d.diff):
    return "n/a"
  se = f" ± {format(2 * d.se, fmt.lstrip('+'))}" if math.isfinite(d.se) else " (1 seed)"
  return f"{format(d.diff, fmt if fmt.startswith('+') else '+' + fmt)}{se}"


def cpu_model() -> str:
  """The CPU the new runs ran on (the references name theirs in their READMEs)."""
  try:
    with open("/proc/cpuinfo") as f:
      return next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
  except OSError:
    return ""


def tables(workdir: str, groups: dict, k: int) -> tuple[str, str, dict]:
  """(the per-method table, the differences table, summary.json's methods)."""
  rows, methods = [], {}
  for m, cells in groups.items():
    st = tlh.run_stats(workdir, cells)
    if not st["gain"]:
      continue
    clip = clip_fraction(workdir, cells)
    g, se = tlh.mean_se(st["gain"])
    finite = lambda x: x if math.isfinite(x) else None
    methods[m] = {"committed": m in REFERENCE, "seeds": sorted(st["seed"]),
                  "heldout_gain_mean": finite(g), "heldout_gain_se": finite(se),
                  **{k: finite(report.finite_mean(st[k])) for k, _, _ in MEASURES[1:]},
                  "clip_frac": finite(report.finite_mean(clip)),
                  "per_seed": {k: dict(zip(map(str, st["seed"]), map(finite, st[k])))
                               for k, _, _ in MEASURES}}
    rows.append([m + (" (committed)" if m in REFERENCE else ""), len(st["gain"]),
                 tlh.fmt_gain(st["gain"]), report.fmt_values(st["avg_first"]),
                 report.fmt_values(st["avg_last"]), report.fmt_values(st["reject"]),
                 report.fmt_values(st["abs_gap_last"]), report.fmt_values(st["max_kl"]),
                 report.fmt_values(clip)])
  table = report.markdown_table(
      ["method", "seeds", "held-out gain ± s.e.", f"avg@{k} step 0", f"avg@{k} end",
       "rejection rate", "|Delta_PPL| last 10%", "largest token KL", "clipped"], rows)
  diffs = []
  for m in METHODS:
    if m not in methods:
      continue
    for ref in REFERENCE:
      ds = [paired_difference(workdir, groups[m], groups[ref], k) for k, _, _ in MEASURES]
      diffs.append([f"{m} - {ref}", ds[0].n_a] + [fmt_diff(d, f) for d, (_, _, f) in
                                                 zip(ds, MEASURES)])
      methods[m].setdefault("minus", {})[ref] = {
          k: {"diff": d.diff if math.isfinite(d.diff) else None,
              "two_se": 2 * d.se if math.isfinite(d.se) else None, "seeds": d.n_a}
          for d, (k, _, _) in zip(ds, MEASURES)}
  diff_table = report.markdown_table(
      ["difference (paired by seed)", "seeds"] + [f"{label} (± 2 s.e.)" for _, label, _ in
                                                  MEASURES], diffs)
  return table, diff_table, methods


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--methods", default=",".join(METHODS), help="the new methods to run")
  p.add_argument("--eval-samples", type=int, default=4, help="k of the held-out avg@k")
  p.add_argument("--report-only", action="store_true",
                 help="run nothing: write the reports from the runs finished so far")
  p.add_argument("--restore", action="store_true",
                 help="first install the committed base and add the reference runs and OUT's "
                      "archived runs to --workdir")
  report.add_run_args(p, "algorithms_long_horizon", seeds="0,1,2", batch=64, eval_problems=64)
  p.set_defaults(steps=100)   # the references' length
  args = p.parse_args(argv)
  methods = report.choices(p, args.methods, METHODS)
  fixed = report.fixed_overrides(args, eval_every=max(1, args.steps // 6),
                                 eval_samples=args.eval_samples)
  fixed.update({k: v for k, v in FIXED.items() if k not in fixed})
  seeds = [int(s) for s in args.seeds.split(",")]
  os.makedirs(args.out, exist_ok=True)
  if args.restore:
    restore(args.workdir, args.out)
  refs = reference_cells(args.workdir)
  groups = {m: [new_cell(m, s, fixed) for s in seeds] for m in methods}
  # Seed-major: a grid stopped early holds every method at the same number of seeds.
  order = [cs[i] for i in range(len(seeds)) for cs in groups.values()]
  archive = os.path.join(args.out, ARCHIVE)

  def save() -> None:
    # Every new-method run in the workdir, not only this command's: a grid resumed one method
    # or seed at a time (--methods, --seeds) keeps the runs of the others in its archive.
    _, planned = sweep.load_plan(args.workdir)
    mine = {f"setting={SETTING},method={m}," for m in METHODS}
    run_archive.archive_runs(args.workdir, archive, cells=[
        c for c in planned if c.name.rsplit("seed=", 1)[0] in mine])

  def on_done(_, status: str) -> None:
    if status == "ok":   # a grid of an hour loses at most the runs in flight
      save()

  rows = report.run_grid(CONFIG, order, args, on_done=on_done)
  save()
  groups = {**refs, **groups}
  sweep.plot_grouped(args.workdir, (f"eval/avg@{args.eval_samples}",) + tlh.CURVE_KEYS,
                     os.path.join(args.out, "curves.png"), groups=groups)
  table, diff_table, per_method = tables(args.workdir, groups, args.eval_samples)
  missing = [c.name for c in order if not sweep.is_done(args.workdir, c)]
  done = len(order) - len(missing)
  from trm_jax import warmup  # pylint: disable=g-import-not-at-top
  progress = {"runs_done": done, "runs_planned": len(order), "complete": not missing,
              "missing": missing,
              "base_sha256": warmup.model_digest(BASE), "cpu": cpu_model()}
  report.write_text(os.path.join(args.out, "summary.json"), json.dumps(
      {"setting": {"name": SETTING, "overrides": tlh.MISMATCHES[SETTING],
                   "config": os.path.relpath(CONFIG, REPO), "fixed": fixed,
                   "methods": {m: METHODS[m] for m in methods}},
       "methods": per_method, **progress}, indent=2) + "\n")
  span = sweep.span_seconds(args.workdir, order) / 60
  print(report.write_summary(args.out, [
      "# TRM beside GSPO, CISPO and PPO-clip with sequence masks, where TRM learns",
      f"Config `configs/tiny_trm_long.py` under `{SETTING}` = {tlh.MISMATCHES[SETTING]} with "
      f"{FIXED}, {args.steps} RL steps of {args.batch} rollouts, lr {args.lr}; held-out "
      f"avg@{args.eval_samples} on {args.eval_problems} fixed problems; base model sha256 "
      f"{progress['base_sha256'][:12]}. The new methods' settings: "
      + "; ".join(f"`{m}` = {METHODS[m]}" for m in methods)
      + f". Values are mean ± std over seeds (gain: mean ± s.e.). The new runs' training span "
      f"{span:.1f} min, {args.parallel} at a time, on {progress['cpu'] or 'an unnamed CPU'}; "
      "the committed references are "
      "experiments/results/trm_long_horizon (exact, PPO-clip seed 0) and "
      "experiments/results/trm_long_horizon_delta (TRM-max, PPO-clip seeds 1-2).",
      *([] if progress["complete"] else [
          f"**Interim: {done} of the {len(order)} new runs have finished**; missing: "
          + ", ".join(f"`{n}`" for n in missing) + ". Differences are over the seeds both "
          "methods have; with one seed there is no standard error. The numbers change when the "
          "grid completes (rerun the command to go on)."]),
      "## Runs", table,
      "`clipped`: the mean over steps of the objective's clip fraction (GSPO: sequences whose "
      "ratio left [1 - 3e-4, 1 + 4e-4]; CISPO and PPO-clip: tokens).",
      "## Differences", diff_table,
      "![curves](curves.png)"]))
  code = report.exit_code(rows, args.workdir)
  return 0 if args.report_only else code


if __name__ == "__main__":
  sys.exit(main())
