"""The trainer's own rollouts at each `rollout.slots`: which setting the tiny configs default to.

  python -m bench.trainer_slots                      # configs/tiny_trm.py, slots 0 16 32
  python -m bench.trainer_slots --slots 0 8 --steps 12 --config configs/tiny_smd.py

Each setting runs the main job (`trm_jax.train`) for `--steps` steps with no evaluation and
no export, in a subprocess, and reads `time/rollout_s` (the rollout program's wall time, one
call per step) from its metrics.jsonl; the first `--skip` steps (compilation) are left out
and the median of the rest is reported with the ratio to slots=0. The settings run in turn,
twice (rounds in opposite orders), with `bench.hygiene` probing each subprocess: a run during
which other processes used more than 0.1 core is flagged and not summarised. Writes
bench/results/trainer_slots.json.
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


def run(config: str, slots: int, steps: int, workdir: str) -> list[float]:
  cmd = [sys.executable, "-m", "trm_jax.train", f"--config={config}", f"--workdir={workdir}",
         f"--config.total_steps={steps}", f"--config.rollout.slots={slots}",
         "--config.eval_problems=0", "--config.export_hf=False"]
  subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [r["time/rollout_s"] for r in rows if "time/rollout_s" in r]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="configs/tiny_trm.py")
  ap.add_argument("--slots", type=int, nargs="+", default=[0, 16, 32])
  ap.add_argument("--steps", type=int, default=14)
  ap.add_argument("--skip", type=int, default=4, help="first steps left out (compilation)")
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                "trainer_slots.json"))
  args = ap.parse_args(argv)
  start = hygiene.wait_for_quiet(timeout_s=0)
  runs = []
  for rnd in range(args.rounds):
    order = args.slots if rnd % 2 == 0 else args.slots[::-1]
    for s in order:
      with tempfile.TemporaryDirectory() as tmp:
        _, info, times = hygiene.timed(run, args.config, s, args.steps, tmp)
      med = statistics.median(times[args.skip:])
      runs.append(dict(round=rnd, slots=s, median_rollout_s=round(med, 4),
                       rollout_s=[round(t, 4) for t in times], contended=info["contended"],
                       other_cores=info["other_cores"], load_before=info["load_before"]))
      print(f"round {rnd} slots {s}: median rollout {med:.4f} s"
            f"{' CONTENDED' if info['contended'] else ''}", flush=True)
  quiet = [r for r in runs if not r["contended"]]
  summary = {}
  for s in args.slots:
    meds = [r["median_rollout_s"] for r in quiet if r["slots"] == s]
    if meds:
      summary[str(s)] = dict(median_rollout_s=meds)
  base = summary.get(str(args.slots[0]))
  if base:
    for s, v in summary.items():
      v["ratio_to_first"] = [round(m / b, 3) for m, b in zip(v["median_rollout_s"],
                                                             base["median_rollout_s"])]
  result = dict(config=args.config, steps=args.steps, skip=args.skip, start=start,
                machine=hygiene.machine(), results=summary, runs=runs)
  print(json.dumps(summary, indent=1))
  hygiene.write_json(result, args.out)


if __name__ == "__main__":
  main()
