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


def test_op_profile_classes_the_attention_ops_of_a_backward_pass():
  """`bench.rl_step.op_profile` on attention's backward pass: the reference attention's two
  einsums are attention matmuls, the mask and softmax over [B, K, G, T, T] are attention's
  elementwise work, and every op the profile times is an instruction of the compiled program."""
  import jax
  import jax.numpy as jnp

  from bench import rl_step, xla_profile
  from trm_jax.kernels.attention_ref import attention_reference
  B, T, N, K, H = 2, 96, 4, 2, 16
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (B, T, N, H))
  k, v = (jax.random.normal(kk, (B, T, K, H)) for kk in ks[1:])
  grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention_reference(q, k, v) ** 2),
                          argnums=(0, 1, 2)))

  hlo = grad.lower(q, k, v).compile().as_text()
  names = xla_profile.op_table(hlo)
  prof = xla_profile.thunk_times(lambda: jax.block_until_ready(grad(q, k, v)), names)
  assert prof["us"] and set(prof["us"]) <= set(names) and prof["wall_s"] > 0
  p = rl_step.op_profile(hlo, lambda: jax.block_until_ready(grad(q, k, v)),
                         lambda i, n, s: rl_step.learner_category(i, n, s, T=T, G=N // K))
  assert {"attention_matmul", "attention_elementwise"} <= set(p["seconds"]), p
  assert sum(p["share"].values()) == pytest.approx(1.0, abs=0.01)
  assert p["thunks"] >= len(p["top_ops"]) > 0
  scores = [o for o in p["top_ops"] if o["category"] == "attention_elementwise"]
  assert all(f"{T},{T}]" in o["shape"] or f"{T},{T * N // K}]" in o["shape"] or
             f"{T * N // K},{T}]" in o["shape"] for o in scores), scores
