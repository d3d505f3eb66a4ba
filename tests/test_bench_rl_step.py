"""`python -m bench.rl_step --smoke`: one warm step of the trainer's `rl_step` at a tiny shape,
written as the benchmark's JSON (the full run, against Tunix and TRL, is bench/rl_step.py's)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def test_smoke_writes_the_benchmark_json(shared_run, tmp_path):
  out = tmp_path / "rl_step.json"
  p = subprocess.run([sys.executable, "-m", "bench.rl_step", "--smoke", "--out", str(out),
                      *shared_run.cli_args(flag="")], cwd=ROOT, env=shared_run.env(),
                     capture_output=True, text=True, timeout=900)
  assert p.returncode == 0, p.stderr[-3000:]
  r = json.loads(out.read_text())
  assert len(r["load_avg"]) == 3 and isinstance(r["cpu"], str) and r["cpu"]
  ours = r["shapes"]["smoke"]["ours"]
  assert len(ours["step_s"]) == 2 and ours["warm_s"] == ours["step_s"][1] > 0
  assert abs(ours["first_s"] - ours["startup_s"] - ours["first_step_s"]) < 0.01
  assert ours["first_step_s"] == ours["step_s"][0] > 0
  assert ours["tokens_per_s"] == pytest.approx(ours["response_tokens"][1] / ours["warm_s"],
                                               rel=1e-3)
  phases = ours["phases"]
  # One update per batch: scoring, advantages and the update are one program.
  assert set(phases["median_s"]) == {"rollout", "rewards", "learner"}
  assert ours["compiled_programs"] == ["rollout", "score_update"]
  assert sum(phases["share"].values()) == pytest.approx(1.0, abs=0.01)
