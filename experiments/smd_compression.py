r"""SMD paper, small scale: RL from KV-compressed rollouts, dense vs naive vs Sparse-RL vs SMD.

  python -m experiments.smd_compression                    # default grid, 1 seed
  python -m experiments.smd_compression --policies snapkv --ratios 0.5 --steps 10

Every run starts from the tiny dense base model of `configs/tiny_smd.py` and trains with GRPO
on the synthetic task. The rollout keeps a compressed KV cache (a fraction `ratio` of each
sequence's keys evicted by SnapKV / H2O / recent+sinks / random); the learner is one of

  dense       uncompressed rollouts (the reference the others try to match)
  naive       the dense learner treats the sparse rollouts as on-policy
  sparse_rl   Sparse-RL: per-token dense/sparse ratio truncated to [0.5, 1.5], sequence veto
              below 1e-4, weights normalised to mean 1; the fraction of rollouts wasted logged
  smd         Shadow Mask Distillation: the learner replays the rollout's eviction record as
              attention visibility (ratio exactly 1) and distils from the dense stop-gradient
              teacher with weight lambda (0, 0.1 = the SMD paper's default, 0.8)
  frozen      control: the base policy on the same compressed rollouts, never updated
              (lr 0); its accuracy is what training has to beat

TRM masking is off in every run (the comparison is the SMD paper's); its divergence monitors
still report the residual mismatch (trm/delta_hat = the largest token KL in the batch).

Writes into --out: results.csv, curves.png, summary.md (final accuracy per method and policy,
fraction of rollouts wasted, residual mismatch, learner memory, and the SMD paper's claims checked
against these numbers). The runs live in --workdir and are resumable.

Claims tested (SMD paper): SMD is close to dense and above Sparse-RL, naive is worst; lambda =
0.1 beats 0.8. "Learner memory" is the compiled temporary memory of one learner update at the
experiment's shapes (XLA's buffer assignment on this machine, not a measured peak).
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
CONFIG = os.path.join(REPO, "configs", "tiny_smd.py")
POLICIES = ("snapkv", "h2o", "recent", "random")
DENSE = {"smd.mode": "dense", "rollout.cache.policy": "none", "rollout.cache.ratio": 0.0}


def method_overrides(method: str) -> dict:
  """'naive' | 'sparse_rl' | 'smd@<lambda>' | 'frozen' -> config overrides."""
  if method == "frozen":  # AdamW at lr 0 leaves the parameters bitwise unchanged
    return {"smd.mode": "naive", "optim.lr": 0.0}
  if method.startswith("smd@"):
    return {"smd.mode": "smd", "smd.lam": float(method[4:])}
  if method in ("naive", "sparse_rl"):
    return {"smd.mode": method}
  raise ValueError(f"unknown method {method!r}; expected naive, sparse_rl, smd@<lambda> or "
                   "frozen")


def build_cells(policies, ratios, methods, lambda_policies, lambdas, seeds, fixed):
  """{(method, policy, ratio): [cells over seeds]}; dense is ('dense', 'none', 0.0)."""
  seed_axis = sweep.axis("seed", seeds)
  groups = {("dense", "none", 0.0): sweep.product([("", fixed)], [("method=dense", DENSE)],
                                                  seed_axis)}
  wanted = [(m, p, r) for p in policies for r in ratios for m in methods]
  wanted += [(f"smd@{lam:g}", p, r) for p in lambda_policies for r in ratios for lam in lambdas
             if (f"smd@{lam:g}", p, r) not in wanted]
  for m, p, r in wanted:
    ov = {"rollout.cache.policy": p, "rollout.cache.ratio": r, **method_overrides(m)}
    groups[(m, p, r)] = sweep.product([("", fixed)], [(f"method={m},{p}@{r:g}", ov)],
                                      seed_axis)
  return groups


def learner_memory(methods, fixed: dict) -> dict:
  """Compiled temporary bytes of one learner update per method, at the experiment's shapes."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  from trm_jax import programs, warmup
  from trm_jax.data import Task, load_tokenizer
  from trm_jax.models import from_pretrained
  from trm_jax.rl.learner import LearnerBatch, make_learner
  out = {}
  for m in methods:
    ov = DENSE if m == "dense" else {"rollout.cache.policy": "snapkv",
                                     "rollout.cache.ratio": 0.5, **method_overrides(m)}
    c = sweep.cell_config(CONFIG, list({**fixed, **ov}.items()))
    base = warmup.ensure_base_model(c, log=lambda _: None)
    model = from_pretrained(base, dtype=jnp.float32)
    task = Task(c.task, c.seed, load_tokenizer(base), c.eval_problems)
    P, R = task.max_prompt_len, task.max_new_tokens
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adamw(1e-4)
    lcfg = programs.learner_config(c, R)
    _, update = make_learner(graphdef, tx, lcfg, response_start=P)
    B, T, cfg = c.rl.batch_size, P + R, model.config
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    batch = LearnerBatch(
        tokens=jax.ShapeDtypeStruct((B, T), jnp.int32),
        segment_ids=jax.ShapeDtypeStruct((B, T), jnp.int32), response_mask=f32(B, T),
        logp_roll=f32(B, T), advantages=f32(B), logp_old=f32(B, T), token_weights=f32(B, T),
        evicted_at=(jax.ShapeDtypeStruct((B, cfg.num_layers, cfg.num_kv_heads, T), jnp.int32)
                    if lcfg.learner_mode.replays_eviction else None),
        roll_logp_full=f32(B, T, cfg.vocab_size) if c.rollout.keep_full_logprobs else None)
    opt_state = jax.eval_shape(tx.init, params)
    mem = update.lower(params, opt_state, rest, batch).compile().memory_analysis()
    out[m] = int(mem.temp_size_in_bytes)
  return out


def group_stats(workdir: str, cells) -> dict:
  keys = ("reward", "sparse_rl/wasted_frac", "trm/delta_hat", "smd/distill_kl")
  out = {k: [] for k in ("reward_first", "reward_last", "eval", "eval_compressed", "wasted",
                         "delta_hat", "distill_kl")}
  for c in cells:
    if not sweep.is_done(workdir, c):
      continue
    d = sweep.cell_dir(workdir, c)
    records = read_metrics(os.path.join(d, "metrics.jsonl"))
    s = {k: np.array([r.get(k) if r.get(k) is not None else np.nan for r in records], float)
         for k in keys}
    rf, rl = report.first_last_mean(s["reward"])
    out["reward_first"].append(rf)
    out["reward_last"].append(rl)
    with open(os.path.join(d, "summary.json")) as f:
      ev = json.load(f).get("eval", {})
    out["eval"].append(ev.get("greedy_accuracy", math.nan))
    # Dense runs have no compressed cache: their dense accuracy is the reference for both.
    out["eval_compressed"].append(ev.get("compressed_greedy_accuracy",
                                         ev.get("greedy_accuracy", math.nan)))
    for name, k in (("wasted", "sparse_rl/wasted_frac"), ("delta_hat", "trm/delta_hat"),
                    ("distill_kl", "smd/distill_kl")):
      v = s[k][np.isfinite(s[k])]
      out[name].append(float(v.mean()) if len(v) else math.nan)
  return out


def claims(stats: dict, methods, lambdas) -> list[str]:
  """The SMD paper's claims, each decided by paired differences over (policy, ratio) settings.

  With one seed per setting the settings are the replicates: a difference counts when its
  mean over settings exceeds two standard errors; otherwise it is "not resolved".
  """
  lines = []
  settings = sorted({(p, r) for (m, p, r) in stats if m != "dense"})
  if not settings or ("dense", "none", 0.0) not in stats:
    return ["- (no compressed runs finished)"]
  dense = stats[("dense", "none", 0.0)]
  val = lambda m, p, r, key: report.finite_mean(stats[(m, p, r)][key]) if (m, p, r) in stats else math.nan

  def paired(a: str, b: str, key: str, among=None) -> report.Difference:
    pts = [(p, r) for p, r in (among or settings)
           if math.isfinite(val(a, p, r, key)) and math.isfinite(val(b, p, r, key))]
    return report.paired([val(a, p, r, key) for p, r in pts],
                         [val(b, p, r, key) for p, r in pts])

  for key, what in (("reward_last", "training reward on the compressed rollouts, last 10 %"),
                    ("eval_compressed", "held-out greedy accuracy after training, with the "
                                        "rollout's compressed cache"),
                    ("eval", "held-out greedy accuracy after training, dense cache")):
    per = {m: report.finite_mean([val(m, p, r, key) for p, r in settings]) for m in methods}
    lines.append(f"- {what}: dense {report.finite_mean(dense[key]):.3f}; " +
                 ", ".join(f"{m} {v:.3f}" for m, v in per.items()) +
                 f" (mean over {len(settings)} policy x ratio settings).")
    if key != "reward_last" and "frozen" in methods:
      for m in (x for x in methods if x != "frozen"):
        lines.append(f"  - {m} above the untrained policy (frozen): "
                     f"{paired(m, 'frozen', key).verdict('higher')}.")
    if {"smd@0.1", "sparse_rl", "naive"} <= set(methods):
      lines.append(f"  - SMD above Sparse-RL: {paired('smd@0.1', 'sparse_rl', key).verdict('higher')}.")
      lines.append(f"  - SMD above naive: {paired('smd@0.1', 'naive', key).verdict('higher')}.")
      lines.append(f"  - Sparse-RL above naive: "
                   f"{paired('sparse_rl', 'naive', key).verdict('higher')}.")
  lam_settings = [(p, r) for p, r in settings
                  if all((f"smd@{lam:g}", p, r) in stats for lam in lambdas)]
  if lam_settings and 0.1 in lambdas and 0.8 in lambdas:
    names = ", ".join(f"{p} {r:.0%}" for p, r in lam_settings)
    for key in ("reward_last", "eval_compressed", "eval"):
      v = {lam: report.finite_mean([val(f"smd@{lam:g}", p, r, key) for p, r in lam_settings]) for lam in lambdas}
      lines.append(f"- lambda, {key} over {names}: " +
                   ", ".join(f"{lam:g} -> {x:.3f}" for lam, x in v.items()) +
                   f". 0.1 above 0.8: "
                   f"{paired('smd@0.1', 'smd@0.8', key, lam_settings).verdict('higher')}.")
  wasted = report.finite_mean([val("sparse_rl", p, r, "wasted") for p, r in settings])
  if math.isfinite(wasted):
    lines.append(f"- Sparse-RL wasted {wasted:.3f} of its rollouts on average (vetoed or "
                 "entirely outside the trust band); SMD and naive train on all of them.")
  return lines


def write_summary(out: str, stats: dict, methods, lambdas, memory: dict, args,
                  wall_s: float) -> str:
  settings = sorted({(p, r) for (m, p, r) in stats if m != "dense"})
  all_methods = ["dense"] + [m for m in dict.fromkeys(m for (m, _, _) in stats) if m != "dense"]
  header = ["method"] + [f"{p} {r:.0%}" for p, r in settings]
  dense = stats.get(("dense", "none", 0.0))

  def table(key):
    rows = []
    for m in all_methods:
      if m == "dense":
        rows.append(["dense (no compression)"] + [report.fmt_values(dense[key]) if dense else "n/a"] *
                    len(settings))
      else:
        rows.append([m] + [report.fmt_values(stats[(m, p, r)][key]) if (m, p, r) in stats else "-"
                           for p, r in settings])
    return report.markdown_table(header, rows)

  mem_rows = [[m, f"{b / 2**20:.1f}"] for m, b in memory.items()]
  n_seeds = max(len(s["reward_last"]) for s in stats.values())
  return report.write_summary(out, [
      "# SMD under KV-cache compression",
      f"{len(stats)} settings x {n_seeds} seed(s), {args.steps} RL steps each, lr {args.lr}; "
      f"config `configs/tiny_smd.py`, TRM masking off. Training span {wall_s / 60:.1f} min "
      "(first step to the end of the last, which carries the final evaluation; 2 runs at a "
      "time; start-up and the base-model warm-up extra).",
      "## Training reward on the (compressed) rollouts, last 10 % of steps",
      table("reward_last"),
      "## Held-out greedy accuracy after training, with the rollout's compressed cache",
      table("eval_compressed"),
      "## Held-out greedy accuracy after training, dense cache",
      table("eval"),
      "## Residual mismatch: largest token KL(pi_roll || pi_theta) per batch, mean over steps",
      table("delta_hat"),
      "## Fraction of rollouts wasted (Sparse-RL)",
      table("wasted"),
      "## Learner memory: compiled temporaries of one update (snapkv 50 %, B = "
      f"{args.batch})",
      report.markdown_table(["method", "temp MiB"], mem_rows) if mem_rows else "(skipped)",
      "## The SMD paper's claims on these runs",
      "\n".join(claims(stats, methods, lambdas)),
      "![curves](curves.png)",
  ])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--policies", default=",".join(POLICIES))
  p.add_argument("--ratios", default="0.5,0.7", help="fractions of keys evicted")
  p.add_argument("--methods", default="naive,sparse_rl,smd@0.1,frozen")
  p.add_argument("--lambdas", default="0,0.1,0.8", help="SMD lambda ablation")
  p.add_argument("--lambda-policies", default="h2o", help="policies the ablation runs on")
  p.add_argument("--skip-memory", action="store_true", help="do not compile for memory")
  report.add_run_args(p, "smd_compression", seeds="0", batch=64, eval_problems=64)
  args = p.parse_args(argv)
  policies = report.choices(p, args.policies, POLICIES, "policy")
  methods = args.methods.split(",")
  for m in methods:
    method_overrides(m)
  lambdas = [float(x) for x in args.lambdas.split(",") if x]
  # Greedy evaluation at the end only (dense and compressed cache): the committed results'
  # protocol; `--set eval_every=N --set eval_samples=k` adds step-0 and sampled evaluations.
  fixed = report.fixed_overrides(args, **{"trm.criteria": (), "export_hf": False,
                                          "eval_every": 0, "eval_samples": 1})
  groups = build_cells(policies, [float(r) for r in args.ratios.split(",")], methods,
                       [x for x in args.lambda_policies.split(",") if x], lambdas,
                       [int(s) for s in args.seeds.split(",")], fixed)
  rows = report.run_grid(CONFIG, [c for cs in groups.values() for c in cs], args)
  memory = {} if args.skip_memory else learner_memory(
      ["dense", "naive", "sparse_rl", "smd@0", "smd@0.1"], fixed)
  by_method: dict = {}
  for (m, _, _), cs in groups.items():
    by_method.setdefault(m, []).extend(cs)   # curves: mean over policies, ratios, seeds
  sweep.plot_grouped(args.workdir, ("reward", "trm/delta_hat", "learner/entropy"),
                     os.path.join(args.out, "curves.png"), groups=by_method)
  stats = {k: group_stats(args.workdir, cs) for k, cs in groups.items()}
  stats = {k: s for k, s in stats.items() if s["reward_last"]}
  all_methods = methods + [f"smd@{lam:g}" for lam in lambdas if f"smd@{lam:g}" not in methods]
  print(write_summary(args.out, stats, all_methods, lambdas, memory, args,
                      sweep.span_seconds(args.workdir)))
  return report.exit_code(rows, args.workdir)


if __name__ == "__main__":
  sys.exit(main())
