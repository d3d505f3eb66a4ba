"""Steps per second: colocated synchronous (k = 0) vs a disaggregated sampler with k = 1.

  python -m bench.staleness            # writes bench/results/staleness.json

Both run the real step (`trm_jax.step.rl_step`) on the default tiny config over 8 simulated CPU
devices: colocated = sampler and learner on all 8; disaggregated = sampler on devices 0-3,
learner on 4-7, rl.staleness = 1 (the next batch's rollout is dispatched before this step's
updates finish, and the parameters are copied to the sampler's devices for every rollout).
Rounds of steps alternate between the two set-ups in one process, so machine load hits both
alike; each round records other processes' CPU time (`bench.hygiene`), and only rounds in
which no call was contended count (the load average cannot tell: the simulated devices' own
threads push it above the core count).

What 2 CPU cores can show: the cost of the pipeline (the weight copy, sync/seconds, and the
extra dispatch), not its gain. Simulated devices share the same two cores, so the sampler and
the learner cannot actually run at the same time; on separate accelerators the k = 1 step
approaches max(rollout, update) instead of their sum.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import hygiene  # noqa: E402
from trm_jax import config as config_lib  # noqa: E402
from trm_jax import step as step_lib  # noqa: E402
from trm_jax import train, warmup  # noqa: E402
from trm_jax.data import Task, load_tokenizer  # noqa: E402
from trm_jax.models import from_pretrained  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def setup(k: int, rollout_devices: int, steps: int):
  c = config_lib.load_config(train.DEFAULT_CONFIG)
  c.total_steps, c.rl.staleness, c.mesh.rollout_devices = steps, k, rollout_devices
  config_lib.validate(c)
  base = warmup.ensure_base_model(c, log=print)
  mesh, sampler_mesh = train.make_mesh(c)
  with jax.set_mesh(mesh):
    model = from_pretrained(base, dtype=jnp.float32, mesh=mesh)
    tok = load_tokenizer(base)
    task = Task(c.task, seed=c.seed, tokenizer=tok, eval_problems=0)
    ctx, state = step_lib.make_context(c, mesh, model, tok, task, sampler_mesh)
  return ctx, state, mesh


def run_round(ctx, state, mesh, n: int):
  """n steps; returns (state, probe info, last metrics). Ends when the last update is done."""
  def steps(state):
    with jax.set_mesh(mesh):
      for _ in range(n):
        state, m = step_lib.rl_step(ctx, state)
      jax.block_until_ready(state.params)
    return state, m
  _, info, (state, m) = hygiene.timed(steps, state)
  return state, info, m


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rounds", type=int, default=4)
  ap.add_argument("--steps-per-round", type=int, default=5)
  ap.add_argument("--out", default=os.path.join(HERE, "results", "staleness.json"))
  a = ap.parse_args()
  total = 2 + a.rounds * a.steps_per_round
  setups = {"colocated_k0": setup(0, 0, total), "disaggregated_k1": setup(1, 4, total)}
  start = hygiene.wait_for_quiet(timeout_s=120)
  rounds = []
  sync = {}
  states = {}
  for name, (ctx, state, mesh) in setups.items():   # compile, first steps
    states[name], _, _ = run_round(ctx, state, mesh, 2)
  for r in range(a.rounds):
    row = {"round": r}
    for name, (ctx, _, mesh) in setups.items():   # interleaved: load hits both alike
      states[name], info, m = run_round(ctx, states[name], mesh, a.steps_per_round)
      row[name] = {"steps_per_s": a.steps_per_round / info["wall_s"],
                   "other_cores": info["other_cores"], "contended": info["contended"]}
      if "sync/bytes" in m:
        sync = {"bytes": m["sync/bytes"], "seconds_last": m["sync/seconds"]}
    row["contended"] = any(row[n]["contended"] for n in setups)
    rounds.append(row)
  quiet = [r for r in rounds if not r["contended"]]
  med = lambda name: (statistics.median(r[name]["steps_per_s"] for r in quiet)
                      if quiet else None)
  result = {
      "steps_per_s_quiet_median": {n: med(n) for n in setups},
      "ratio_disaggregated_over_colocated": (
          statistics.median(r["disaggregated_k1"]["steps_per_s"] /
                            r["colocated_k0"]["steps_per_s"] for r in quiet) if quiet else None),
      "rounds": rounds,
      "sync": sync,
      "machine": {**hygiene.machine(), "jax": jax.__version__, "start": start,
                  "load_average_after": os.getloadavg()},
      "contended": not quiet,
      "note": __doc__.split("\n\n")[-1].strip(),
  }
  os.makedirs(os.path.dirname(a.out), exist_ok=True)
  with open(a.out, "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
