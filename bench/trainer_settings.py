"""The trainer's own steps at each value of one setting: which value a config defaults to.

  python -m bench.trainer_settings                   # configs/tiny_trm.py, rollout.slots 0 16 32
  python -m bench.trainer_settings --values 0 8 --steps 12 --config configs/tiny_smd.py
  python -m bench.trainer_settings --config configs/tiny_trm_long.py \
      --key rl.num_microbatches --values 1 4 8 --metric time/step_s

Each value runs the main job (`trm_jax.train`) for `--steps` steps with no evaluation and no
export, in a subprocess, and reads `--metric` from its metrics.jsonl: `time/rollout_s` (the
rollout program's wall time, one call per step; the default, for rollout settings) or
`time/step_s` (the whole step: rollout, score pass and updates). The first `--skip` steps
(compilation) are left out and the median of the rest is reported with the ratio to the first
value. The values run in turn, `--rounds` times (rounds in opposite orders), with
`bench.hygiene` probing each subprocess: a run during which other processes used more than 0.1
core is flagged and not summarised. Writes bench/results/trainer_<last part of --key>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench import hygiene


def run(config: str, settings: dict, steps: int, workdir: str, metric: str) -> list[float]:
  cmd = [sys.executable, "-m", "trm_jax.train", f"--config={config}", f"--workdir={workdir}",
         f"--config.total_steps={steps}", "--config.eval_problems=0",
         "--config.export_hf=False", *(f"--config.{k}={v}" for k, v in settings.items())]
  subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [r[metric] for r in rows if metric in r]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="configs/tiny_trm.py")
  ap.add_argument("--key", default="rollout.slots", help="the config key measured")
  ap.add_argument("--values", nargs="+", default=["0", "16", "32"])
  ap.add_argument("--metric", default="time/rollout_s", choices=("time/rollout_s",
                                                                  "time/step_s"))
  ap.add_argument("--set", action="append", default=[], metavar="KEY=V",
                  help="another config override for every run (e.g. warmup.cache_dir=...)")
  ap.add_argument("--steps", type=int, default=14)
  ap.add_argument("--skip", type=int, default=4, help="first steps left out (compilation)")
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--out", default="")
  args = ap.parse_args(argv)
  out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                 f"trainer_{args.key.rsplit('.', 1)[-1]}.json")
  fixed = dict(s.split("=", 1) for s in args.set)
  start = hygiene.wait_for_quiet(timeout_s=0)
  runs = []
  for rnd in range(args.rounds):
    order = args.values if rnd % 2 == 0 else args.values[::-1]
    for v in order:
      with tempfile.TemporaryDirectory() as tmp:
        _, info, times = hygiene.timed(run, args.config, {**fixed, args.key: v}, args.steps,
                                       tmp, args.metric)
      med = statistics.median(times[args.skip:])
      runs.append(dict(round=rnd, value=v, median_s=round(med, 4),
                       times_s=[round(t, 4) for t in times], contended=info["contended"],
                       other_cores=info["other_cores"], load_before=info["load_before"]))
      print(f"round {rnd} {args.key}={v}: median {args.metric} {med:.4f} s"
            f"{' CONTENDED' if info['contended'] else ''}", flush=True)
  quiet = [r for r in runs if not r["contended"]]
  summary = {}
  for v in args.values:
    meds = [r["median_s"] for r in quiet if r["value"] == v]
    if meds:
      summary[v] = dict(median_s=meds)
  base = summary.get(args.values[0])
  if base:
    for v, s in summary.items():
      s["ratio_to_first"] = [round(m / b, 3) for m, b in zip(s["median_s"], base["median_s"])]
  result = dict(config=args.config, key=args.key, metric=args.metric, fixed=fixed,
                steps=args.steps, skip=args.skip, start=start, machine=hygiene.machine(),
                results=summary, runs=runs)
  print(json.dumps(summary, indent=1))
  hygiene.write_json(result, out)


if __name__ == "__main__":
  main()
