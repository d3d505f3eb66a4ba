"""Ahead-of-time TPU compiles of the trainer's programs (trm_jax.aot) without a TPU.

  * the decoder's forward and gradient with the TPU kernel compile for a 4-chip v5e and v5p
    slice under a plain `jax.set_mesh` (`kernels.attention` partitions the kernel itself;
    its bitwise equality with the unsharded kernel is in test_kernels_tpu.py);
  * the loop-aware cost (`hlo_cost`): nested scans count every trip, an unreadable loop takes
    the caller's trip count and says so, the attention kernels' FLOPs are the analytic ones;
    collective bytes count each loop body by its executions, as the cost does;
  * the CLI compiles a tiny SMD config (h2o cache, shadow-masked learner through the kernel)
    for a v5e:2x2 slice: every program fits, with the resident batch counted exactly; a
    program that does not fit exits 1 naming its knobs; bad input gets one line naming it.

Everything but the first test needs libtpu (`pip install -e .[tpu]`) and skips without it.
Runtime about 40 s on 2 CPU cores, most of it the CLI's three compiles.
"""
import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trm_jax import sharding as shd
from trm_jax.kernels.flash_attention_tpu import flash_attention_tpu
from trm_jax.aot.tpu import compile_for_tpu, libtpu_available
from trm_jax.models import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_libtpu = pytest.mark.skipif(
    not libtpu_available(), reason="libtpu not installed (pip install -e .[tpu]): no TPU compiler")


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1"])
def test_model_with_the_tpu_kernel_compiles_under_a_plain_mesh(topology):
  """The decoder's forward and parameter gradient with attn_impl="pallas_tpu", jitted under a
  plain `jax.set_mesh` on a 4-chip slice (data 2 x tensor 2): `kernels.attention` partitions
  the Mosaic calls itself (XLA alone refuses: "Mosaic kernels cannot be automatically
  partitioned")."""
  from flax import nnx   # pylint: disable=g-import-not-at-top
  from trm_jax.aot import tpu as tpu_aot  # pylint: disable=g-import-not-at-top
  from trm_jax.kernels.visibility import Visibility   # pylint: disable=g-import-not-at-top
  from trm_jax.models import Decoder   # pylint: disable=g-import-not-at-top
  cfg = ModelConfig(model_type="qwen3", vocab_size=128, hidden_size=128, intermediate_size=256,
                    num_layers=1, num_heads=4, num_kv_heads=2, head_dim=128)
  mesh = shd.make_mesh({"data": 2, "tensor": 2}, tpu_aot.topology_devices(topology))
  model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  sds = lambda tree: jax.tree.map(
      lambda v, sh: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh)), tree,
      shd.state_shardings(tree, mesh), is_leaf=lambda x: isinstance(x, nnx.Variable))
  B, T = 8, 256
  tokens = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=shd.batch_sharding(mesh, (B, T)))
  ev = jax.ShapeDtypeStruct((B, cfg.num_layers, cfg.num_kv_heads, T), jnp.int32,
                            sharding=shd.batch_sharding(mesh, (B, 1, 1, 1)))

  def loss(params, rest, tokens, ev):
    vis = Visibility(segment_ids=jnp.ones_like(tokens), evicted_at=ev)
    logits = nnx.merge(graphdef, params, rest)(tokens, visibility=vis, attn_impl="pallas_tpu")
    return jnp.mean(jax.nn.logsumexp(logits, -1))

  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.value_and_grad(loss)).lower(sds(params), sds(rest), tokens,
                                                       ev).compile()
  hlo = compiled.as_text()
  # forward, dq and dk/dv kernels of each layer, on each chip's 4 rows and 1 kv head
  assert hlo.count('custom_call_target="tpu_custom_call"') == 3 * cfg.num_layers
  # each chip holds a shard of the parameters, not all of them
  full = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) + B * T * 4
  assert 0 < compiled.memory_analysis().argument_size_in_bytes < full


@needs_libtpu
def test_loop_aware_cost_counts_every_trip_and_the_kernels():
  from trm_jax.aot.hlo_cost import program_cost   # pylint: disable=g-import-not-at-top
  n = 512
  mm = 2.0 * n ** 3
  x = jax.ShapeDtypeStruct((n, n), jnp.float32)

  def nested(a, w):
    inner = lambda c, _: (c @ w, None)
    outer = lambda c, _: (jax.lax.scan(inner, c, None, length=4)[0], None)
    return jax.lax.scan(outer, a, None, length=16)[0]

  cost = program_cost(compile_for_tpu(nested, [x, x], "v5e:2x2"))
  assert sorted((l["trips"], l["executions"], l["source"]) for l in cost["loops"]) == [
      (4, 64, "condition"), (16, 16, "condition")]
  assert cost["xla_flops"] == pytest.approx(mm, rel=1e-3)        # XLA: each body once
  assert cost["flops"] == pytest.approx(64 * mm, rel=1e-3)

  def until(a, w):             # a data-dependent exit inside a scan: no trip count to read
    def outer(c, _):
      cond = lambda s: (s[0] < 16) & (jnp.sum(s[1]) < 1e9)
      with jax.named_scope("until"):
        return jax.lax.while_loop(cond, lambda s: (s[0] + 1, s[1] @ w), (0, c))[1], None
    return jax.lax.scan(outer, a, None, length=3)[0]

  # The bound is the body's executions over the call, not per entry of the loop.
  cost = program_cost(compile_for_tpu(until, [x, x], "v5e:2x2"), bounds={"until": 7})
  assert sorted((l["scope"], l["executions"], l["source"]) for l in cost["loops"])[-1] == (
      "until", 7, "bound")
  # Seven matmuls, the condition's sum over n x n run 10 times (7 trips, and once more per
  # entry of 3), and w's conversion to bf16 for the MXU, once before the loops: to one n x n.
  assert cost["flops"] == pytest.approx(7 * mm + 11 * n * n, abs=n * n / 2)
  assert not cost["unbounded"]

  B, T, N, K, H = 1, 1024, 8, 2, 128

  def fwd_bwd(q, k, v, do):
    out, pull = jax.vjp(lambda q, k, v: flash_attention_tpu(q, k, v), q, k, v)
    return out, *pull(do)

  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in
          ((B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H))]
  cost = program_cost(compile_for_tpu(fwd_bwd, args, "v5e:2x2"))
  # forward 2 matmuls, dq 3, dk/dv 4, each 2*B*N*H*T^2/2 FLOPs (causal half)
  assert cost["kernel_flops"] == 9 * 2 * B * N * H * T * T / 2
  assert cost["xla_flops"] < 1e-3 * cost["kernel_flops"]           # XLA counts 0 for them


def _tiny_model(tmp_path) -> str:
  """A tiny Qwen3 config.json (H = 128: the kernel's lane width, as real models have)."""
  cfg = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=128, intermediate_size=256,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128, eos_token_id=1,
                    pad_token_id=0)
  path = tmp_path / "config.json"
  path.write_text(json.dumps(cfg.to_hf()))
  return str(path)


def _aot(*args, tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)   # the tool's host needs one CPU device, not the tests' eight
  return subprocess.run(
      [sys.executable, "-m", "trm_jax.aot", "--config",
       os.path.join(ROOT, "configs", "tiny_smd.py"), "--topology", "v5e:2x2",
       "--model", _tiny_model(tmp_path), *args],
      capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=300)


def test_loop_aware_cost_on_cpu_counts_each_loop_by_its_executions():
  """FLOPs and bytes of a program whose counts are known: a scan of 3 trips holding a
  data-dependent loop (declared to run its body 5 times over the whole call) and a scan of 4
  trips, each body one [n, n] matmul. 12 + 5 = 17 matmuls, not 3 x 5 + 12 (a bound is a total,
  never multiplied by the enclosing trips). Bytes are XLA's cost model: a matmul reads two
  [n, n] f32 operands and writes one (3 units of 4 n^2 bytes), the copy XLA:CPU puts the
  result into the loop's carry with reads and writes one (2 units), the data-dependent loop's
  condition reads its carry (1 unit) once per trip and once more per entry (5 + 3 times), and
  the entry copies the input into the first carry (2 units). The CPU compiler records the
  scans' trip counts (`known_trip_count`), as bench.learner's FLOP/s relies on."""
  from trm_jax.aot.hlo_cost import program_cost   # pylint: disable=g-import-not-at-top
  n = 128
  x = jnp.ones((n, n), jnp.float32)
  mm, unit = 2.0 * n ** 3, 4.0 * n * n

  def f(a, w, scope="until"):
    def outer(c, _):
      with jax.named_scope(scope):
        c = jax.lax.while_loop(lambda s: (s[0] < 1000) & (jnp.sum(s[1]) < 1e30),
                               lambda s: (s[0] + 1, s[1] @ w), (0, c))[1]
      return jax.lax.scan(lambda c, _: (c @ w, None), c, None, length=4)[0], None
    return jax.lax.scan(outer, a, None, length=3)[0]

  compiled = jax.jit(f).lower(x, x).compile()
  cost = program_cost(compiled, bounds={"until": 5})
  loops = {l["scope"]: l for l in cost["loops"]}
  assert {(l["trips"], l["executions"], l["source"]) for l in cost["loops"]} == {
      (3, 3, "known_trip_count"), (4, 12, "known_trip_count"), (None, 5, "bound")}
  assert loops["until"]["executions"] == 5 and not cost["unbounded"]
  cond_flops = (5 + 3) * n * n                 # the condition's sum over the carry
  assert cost["flops"] == pytest.approx(17 * mm + cond_flops, rel=1e-6)
  assert cost["bytes_accessed"] == pytest.approx((2 + 17 * (3 + 2) + (5 + 3)) * unit, rel=1e-3)
  assert cost["xla_flops"] == pytest.approx(2 * mm + n * n, rel=1e-6)   # each body once

  # Without a bound the loop is counted once per entry (3 of its bodies), and says so.
  cost = program_cost(compiled)
  assert [l["executions"] for l in cost["loops"] if l["source"].startswith("unbounded")] == [3]
  assert len(cost["unbounded"]) == 1
  assert cost["flops"] == pytest.approx(15 * mm + (3 + 3) * n * n, rel=1e-6)
  # A bound that names no loop of the program (renamed, or compiled away) is an error.
  with pytest.raises(ValueError, match="loops matched per scope: untill: 0"):
    program_cost(compiled, bounds={"untill": 5})


def test_collective_bytes_count_each_loop_by_its_executions():
  """`collective_bytes` counts loops as `hlo_text_cost` does: the program above with an
  all-reduce (psum over 2 simulated devices) of the [n, n] f32 carry in each loop body runs
  12 + 5 = 17 all-reduces with the data-dependent loop bounded at 5 in all, and 12 + 3 (once
  per entry) without a bound."""
  from trm_jax.aot import hlo_cost   # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P   # pylint: disable=g-import-not-at-top
  n = 64
  mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:2])

  def f(a, w):
    def outer(c, _):
      with jax.named_scope("until"):
        c = jax.lax.while_loop(lambda s: (s[0] < 1000) & (jnp.sum(s[1]) < 1e30),
                               lambda s: (s[0] + 1, jax.lax.psum(s[1] @ w, "x")), (0, c))[1]
      return jax.lax.scan(lambda c, _: (jax.lax.psum(c @ w, "x"), None), c, None,
                          length=4)[0], None
    return jax.lax.scan(outer, a, None, length=3)[0]

  x = jnp.ones((n, n), jnp.float32)
  text = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P()), out_specs=P())).lower(
      x, x).compile().as_text()
  assert hlo_cost.collective_bytes(text, bounds={"until": 5}) == {"all-reduce": 17 * 4 * n * n}
  assert hlo_cost.collective_bytes(text) == {"all-reduce": 15 * 4 * n * n}


def test_decode_schedule_is_the_samplers_own_schedule():
  """`sampler.decode_schedule`, the bound trm_jax.aot counts the sampler's loops with, is
  the schedule the sampler runs when no row stops early: every stage's decode steps equal
  `RolloutStats.stage_steps` of a run without stop tokens, for every row at once over three
  cache buckets (the prompt longer than the first bucket) and for continuous batching with
  refills (dense and compressed caches)."""
  from model_fixtures import make_test_model   # pylint: disable=g-import-not-at-top
  from trm_jax.rollout import BatchingConfig, CacheConfig   # pylint: disable=g-import-not-at-top
  from trm_jax.rollout import sampler   # pylint: disable=g-import-not-at-top
  model = make_test_model(seed=1, num_layers=1)
  B, P, R = 12, 10, 22
  ids = np.full((B, P), 9, np.int32)
  lens = np.full((B,), P, np.int32)
  cases = [(CacheConfig(), BatchingConfig(chunk=3, bucket=8)),
           (CacheConfig(), BatchingConfig(slots=5, chunk=3, refill=2, bucket=16, tail=2)),
           (CacheConfig(policy="snapkv", ratio=0.5, window=3, kernel=3),
            BatchingConfig(slots=4, chunk=5, refill=1, bucket=8))]
  for cache, batching in cases:
    out = sampler.generate(model, ids, lens, max_new_tokens=R, key=jax.random.key(0),
                           eos_ids=(), cache=cache, **dataclasses.asdict(batching))
    sched = sampler.decode_schedule(B, P, R, cache, batching)
    steps = [v for k, v in sched.items() if k.endswith("_steps")]
    assert list(np.asarray(out.stats.stage_steps)) == steps, (cache, batching, sched)
    assert sum(steps) == int(out.stats.decode_steps)
    # A chunk runs at most `chunk` steps.
    assert all(sched[k.replace("_steps", "_chunks")] >= -(-v // batching.chunk)
               for k, v in sched.items() if k.endswith("_steps"))
  # C = P + R = 32 slots in 8-slot buckets: 8 cannot hold a loaded 10-token prompt and a chunk
  # of 3 keys, so the stages are 16, 24 and 32 slots, two loops each.
  assert len(sampler.decode_schedule(B, P, R, CacheConfig(), cases[0][1])) == 2 * 3


@needs_libtpu
def test_disaggregated_sampler_gets_its_devices_and_a_copy_in_its_dtype():
  """mesh.rollout_devices on a topology: the sampler's first devices, the learner the rest,
  and the per-rollout copy sized in the sampler's dtype (what step.to_sampler sends)."""
  from trm_jax import config as config_lib   # pylint: disable=g-import-not-at-top
  from trm_jax.aot import compiler as aot, tpu as tpu_aot  # pylint: disable=g-import-not-at-top
  c = config_lib.load_config(os.path.join(ROOT, "configs", "tiny_trm.py"))
  c.mesh.rollout_devices, c.rollout.dtype, c.rl.staleness = 1, "bfloat16", 1
  c.rl.batch_size = 48   # divides the learner's 3 chips (check_batch_mesh)
  cfg = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=128, intermediate_size=256,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128)
  devices = tpu_aot.topology_devices("v5e:2x2")
  s = aot.build(c, cfg.to_hf(), devices)
  roll_mesh = s.programs["rollout"].mesh
  assert [d.id for d in roll_mesh.devices.flat] == [devices[0].id]
  assert sorted(d.id for d in s.mesh.devices.flat) == sorted(d.id for d in devices[1:])
  params = s.programs["score_update"].args[0]   # one update per batch: scored inside it
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
  assert s.sync == {"bytes_per_rollout": 2 * n, "bytes_per_sampler_device": 2 * n,
                    "dtype": "bfloat16", "sampler_devices": 1}


@needs_libtpu
def test_tiny_smd_config_compiles_for_v5e_through_the_cli(tmp_path):
  out = tmp_path / "report.json"
  r = _aot("--out", str(out), "--config.rl.batch_size=32", "--config.rl.group_size=4",
           "--config.rl.num_minibatches=2", "--config.rl.num_microbatches=2",
           "--config.rl.chunk=32", "--programs", "score,update", "--nosubprocess",
           tmp_path=tmp_path)
  assert r.returncode == 0, r.stderr[-3000:]
  assert ("programs rollout, score, update, eval_greedy, eval_sampled, eval_greedy_compressed, "
          "eval_sampled_compressed\n") in r.stdout
  for name in ("score", "update"):   # the sampler compiles in the MoE test below
    assert f"[aot] {name}: compiling ..." in r.stdout
  assert "every program fits; roofline lower bound of one RL step" in r.stdout
  rep = json.loads(out.read_text())
  assert rep["mesh"] == {"data": 4, "fsdp": 1, "expert": 1, "tensor": 1}
  assert rep["attn_impl"] == "pallas_tpu"
  rows = {p["program"]: p for p in rep["programs"]}
  assert list(rows) == ["score", "update"] and rep["fits"]
  P, R, L, K, V = rep["P"], rep["R"], 2, 2, 64
  T = P + R
  # The update's resident state is the whole rollout batch (8 of 32 rows per device): six
  # [B, T] arrays, advantages [B], the SMD record evicted_at [B, L, K, T] and the rollout's
  # full log-probs [B, T, V] (tiny configs keep them), 4 bytes each.
  assert rows["update"]["resident_bytes"] == 8 * (6 * T + 1 + L * K * T + T * V) * 4
  assert rows["update"]["calls_per_step"] == 2 and rows["score"]["calls_per_step"] == 1
  for row in rows.values():
    assert row["fits"] and 0 < row["total_bytes"] < row["hbm_bytes"] == 16 * 2**30
    assert row["flops"] > 0 and row["bytes_accessed"] > 0 and row["roofline_s"] > 0
  # The learner's attention runs through the kernel (counted analytically), in a microbatch
  # scan of rl.num_microbatches trips read from the loop condition.
  assert rows["score"]["kernel_flops"] > 0 and rows["update"]["kernel_flops"] > 0
  assert (2, "condition") in {(l["trips"], l["source"]) for l in rows["update"]["loops"]}
  assert rep["step_roofline_s"] == pytest.approx(
      sum(r["roofline_s"] * r["calls_per_step"] for r in rows.values()))
  # Compiled in this process (--nosubprocess): the report's host peak is this process's.
  assert not any("process_s" in r for r in rows.values())
  assert rep["host_peak_bytes"] == max(rep["host_parent_rss_bytes"],
                                       rep["host_compile_peak_bytes"])
  assert rep["complete"] and rep["host"]["cpus"] >= 1 and len(rep["commit"]) == 40
  assert "host memory at most" in r.stdout


@needs_libtpu
def test_moe_config_with_routing_replay_compiles_every_program_for_v5e_2x4(tmp_path):
  """The acceptance command on a clean checkout (the warm-up base model is not built: its
  architecture comes from config.model.arch), smaller batches: every program the trainer
  runs, evaluation included, compiles for an 8-chip slice, and the routing record reaches the
  learner's programs."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  out = tmp_path / "moe.json"
  r = subprocess.run(
      [sys.executable, "-m", "trm_jax.aot", "--config",
       os.path.join(ROOT, "configs", "tiny_moe_mismatch.py"),
       "--config.rollout.routing_replay=True", "--topology", "v5e:2x4", "--out", str(out),
       f"--config.warmup.cache_dir={tmp_path / 'no_base'}", "--config.rl.batch_size=16",
       "--config.rl.group_size=4", "--config.eval_problems=8", "--config.rl.chunk=32",
       "--nosubprocess"],
      capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "model the warm-up base model's architecture (config.model.arch)" in r.stdout
  rep = json.loads(out.read_text())
  rows = {p["program"]: p for p in rep["programs"]}
  assert list(rows) == ["rollout", "score_update", "eval_greedy", "eval_sampled"]
  assert rep["fits"] and rep["devices"] == 8 and rep["mesh"]["data"] == 8
  assert rows["eval_greedy"]["per"] == "evaluation" and rep["evaluation_roofline_s"] > 0
  # The learner's batch holds the routing record: int8 [B, L_moe, T, k] per row.
  assert rep["config"]["rollout"]["routing_replay"] and rep["model"]["num_experts"] == 8
  # The sampler's loops exit when every row has stopped: each is counted on the schedule in
  # which no row stops early (every row at once: R - 1 decode steps over the cache buckets),
  # never as one loop's count times another's.
  loops = rows["rollout"]["loops"]
  assert not rows["rollout"]["unbounded_loops"]
  steps = [l for l in loops if l["scope"].endswith("_steps")]
  assert all(l["source"] == "bound" for l in steps) and len(steps) == len(
      [k for k in rep["loop_bounds"]["rollout"] if k.endswith("_steps")])
  assert sum(l["executions"] for l in steps) == rep["R"] - 1


@needs_libtpu
@pytest.mark.parametrize("config,overrides", [
    ("tiny_trm.py", {}),
    ("tiny_smd.py", {}),
    ("tiny_trm.py", {"mesh.rollout_devices": 2, "rl.staleness": 1, "rollout.dtype": "bfloat16",
                     "rl.kl_beta": 0.01, "rl.batch_size": 24}),   # 24: 6 learner chips
], ids=["trm", "smd", "disaggregated_stale_kl"])
def test_every_trainer_program_of_the_tiny_configs_lowers_for_v5e_2x4(config, overrides):
  """Every program of each shipped tiny config (the MoE one with routing replay compiles in
  the test above) lowers for an 8-chip slice through the trainer's builder: the Pallas TPU
  kernel partitions itself under the programs' meshes (it refuses to lower otherwise)."""
  from trm_jax import config as config_lib, sweep  # pylint: disable=g-import-not-at-top
  from trm_jax.aot import compiler as aot, tpu as tpu_aot  # pylint: disable=g-import-not-at-top
  from trm_jax.rollout import policies  # pylint: disable=g-import-not-at-top
  c = config_lib.load_config(os.path.join(ROOT, "configs", config))
  c = sweep.apply_overrides(c, {"rl.batch_size": 16, "rl.group_size": 4, "eval_problems": 8,
                                "warmup.cache_dir": "/nonexistent", **overrides}.items())
  hf, _ = aot.resolve_model(c)
  s = aot.build(c, hf, tpu_aot.topology_devices("v5e:2x4"))
  assert s.impl == "pallas_tpu"
  policy = c.rollout.cache.policy
  observes = policy != "none" and policies.get_policy(policy).keeps_score   # H2O reads probs
  for program in s.programs:
    text = program.lower().as_text()   # the learner's attention and the sampler's prefill
    assert "tpu_custom_call" in text and "sdy.manual_computation" in text, program.name
    # The sampler decodes through the per-row-extent kernel (dense evaluation caches always).
    if program.name in ("rollout", "eval_greedy", "eval_sampled"):
      dense = program.name != "rollout" or policy == "none"
      assert ("decode_attention_tpu" in text) == (dense or not observes), program.name
  if overrides:
    assert s.sync["sampler_devices"] == 2 and s.programs["rollout"].mesh.size == 2


@needs_libtpu
def test_a_batch_the_slice_does_not_divide_is_refused_naming_it(tmp_path, capsys):
  from trm_jax.aot.cli import main   # pylint: disable=g-import-not-at-top
  argv = ["--config", os.path.join(ROOT, "configs", "tiny_smd.py"), "--topology", "v5e:2x2",
          "--model", _tiny_model(tmp_path), "--config.rl.batch_size=6",
          "--config.rl.group_size=2", "--out", str(tmp_path / "r.json")]
  assert main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: inconsistent config [rl.batch_size, mesh]: batch_size=6 does "
                        "not split over the 4 batch shards"), err
  assert len(err.splitlines()) == 1


@needs_libtpu
def test_program_that_does_not_fit_exits_1_naming_its_knobs(tmp_path):
  # 2^20 rows of sampler KV cache: tens of GiB per v5e chip.
  r = _aot("--programs", "rollout", "--config.rl.batch_size=1048576",
           "--config.rl.group_size=8", tmp_path=tmp_path)
  assert r.returncode == 1, r.stderr[-3000:]
  assert "[aot] rollout: does NOT fit: " in r.stdout
  assert "rollout does not fit on v5e:2x2; knobs that change its memory:" in r.stderr
  assert "rl.batch_size (rows sampled at once" in r.stderr
  rep = json.loads((tmp_path / "aot_tiny_smd_v5e_2x2.json").read_text())
  row = rep["programs"][0]
  assert not rep["fits"] and not row["fits"] and row["xla_required_bytes"] > 16 * 2**30
  # The program compiled in a process of its own (the default), whose peak host memory the
  # report keeps, with the host and the commit it was compiled at.
  assert row["host_peak_rss_bytes"] > 2**27 and row["process_s"] > 0
  assert rep["host_peak_bytes"] == rep["host_parent_rss_bytes"] + row["host_peak_rss_bytes"]
  assert rep["complete"] and rep["host"]["cpus"] >= 1 and len(rep["commit"]) == 40


@needs_libtpu
@pytest.mark.parametrize("args,msg", [
    (["--config.rl.num_microbatchez=4"], "error: unknown config key 'rl.num_microbatchez' "
     "(from '--config.rl.num_microbatchez=4'); did you mean rl.num_microbatches, "
     "rl.num_minibatches, rl.score_microbatches?"),
    (["--topology", "v9x:2x2"], "error: topology 'v9x:2x2': unknown TPU generation 'v9x'; "
     "known: v4, v5e, v5p, v6e"),
    (["--topology", "v5e:3x3"], "error: topology 'v5e:3x3': INVALID_ARGUMENT: Topology layout "
     "\"v5e:3x3\" is not divisible"),
    (["--config.mesh.data=1", "--config.mesh.fsdp=3"], "error: mesh.fsdp=3 does not divide "
     "the 4 devices present (mesh.data=1 * mesh.fsdp=3 * mesh.expert=1 * mesh.tensor=1)"),
    (["--topology", "v6e:16x16", "--config.mesh.fsdp=64", "--config.mesh.tensor=4"],
     "error: mesh.data=-1, mesh.expert=1, mesh.fsdp=64, mesh.tensor=4 cannot be laid on the "
     "topology's physical axes without splitting one: Failed to find assignment for "
     "logical_axis_index"),
    (["--model", "/nonexistent/ckpt"], "error: no HF config.json at /nonexistent/ckpt "
     "(expected a checkpoint directory or a config.json file)"),
    (["--programs", "rollout,train"], "error: unknown programs ['train']; this config's trainer "
     "runs ('rollout', 'score_update', 'eval_greedy', 'eval_sampled', "
     "'eval_greedy_compressed', 'eval_sampled_compressed')"),
    # Bounded before libtpu sees it (libtpu crashes the process on this one).
    (["--topology", "v5p:1000x1000x1000"], "error: topology 'v5p:1000x1000x1000' has "
     "1000000000 chips; a v5p slice has 1 to 8960 (a whole pod)"),
    # Refused before anything compiles.
    (["--out", "{tmp}/afile/sub/r.json"], "error: --out {tmp}/afile/sub/r.json: {tmp}/afile "
     "is a file, not a directory"),
    (["--out", "{tmp}"], "error: --out {tmp}: is a directory; name the report file"),
])
def test_bad_input_is_one_line_naming_it(tmp_path, capsys, args, msg):
  from trm_jax.aot.cli import main   # pylint: disable=g-import-not-at-top
  (tmp_path / "afile").write_text("")
  argv = ["--config", os.path.join(ROOT, "configs", "tiny_smd.py"),
          "--topology", "v5e:2x2", "--model", _tiny_model(tmp_path),
          "--out", str(tmp_path / "r.json"), *[a.format(tmp=tmp_path) for a in args]]
  assert main(argv) == 2
  err = capsys.readouterr().err
  assert msg.format(tmp=tmp_path) in err, err
  assert len(err.strip().splitlines()) == 1
  assert not (tmp_path / "r.json").exists()


def test_the_sampler_keeps_its_rows_split_over_a_mesh():
  """The sampler compiled for a mesh of 8 (simulated CPU) devices, 16 rows in 4 groups of 4:
  its [B, ...] outputs stay split over the devices (scatters from slots to rows had left them
  replicated on every device: at the 8B config 3.3 GB per chip of retention records and top-k
  log-probs), and the 4 prompts, which do not split over 8 devices, are prefilled row by row
  (2 rows per device) instead of all 4 on every device."""
  from flax import nnx   # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec   # pylint: disable=g-import-not-at-top
  from model_fixtures import make_test_model   # pylint: disable=g-import-not-at-top
  from trm_jax.rollout import BatchingConfig   # pylint: disable=g-import-not-at-top
  from trm_jax.rollout import sampler   # pylint: disable=g-import-not-at-top
  model = make_test_model(seed=1, num_layers=1)
  B, P, R, G, D = 16, 10, 6, 4, model.config.hidden_size
  mesh = shd.make_mesh({"data": 8}, jax.devices()[:8])
  graphdef, state = nnx.split(model)
  state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
  scfg = sampler.sampling_config(model.config, max_new_tokens=R, keep_topk_logprobs=2)
  gen = sampler.make_generate(graphdef, scfg, batching=BatchingConfig(group_size=G))
  ids = jax.device_put(np.full((B, P), 9, np.int32), shd.batch_sharding(mesh, (B, P)))
  with jax.set_mesh(mesh):
    assert sampler.prefill_group(B, G) == 1
    compiled = gen.lower(state, ids, np.full((B,), P, np.int32), jax.random.key(0)).compile()
  out = compiled.output_shardings
  for name in ("tokens", "logp", "response_mask", "evicted_at", "topk_logp", "topk_ids"):
    sh = getattr(out, name)
    assert sh.spec[0] == "data", (name, sh)
  per_device = set(re.findall(rf"f32\[(\d+),{P},{D}\]", compiled.as_text()))
  assert per_device == {str(B // 8)}, per_device     # [rows, P, D] prefill activations


def test_a_compile_process_that_dies_is_reported_with_its_memory(monkeypatch):
  """`cli.compile_in_subprocess` watches one program's compiler process: the row it wrote,
  with its peak host memory and a line while it runs; or, for a process killed (the kernel's
  out-of-memory killer sends SIGKILL), a failed row saying so with its stderr's last lines."""
  from trm_jax.aot import cli   # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(cli, "HEARTBEAT_S", 0.5)
  lines = []
  grow = ("import json, sys, time; x = bytearray(200 * 2**20); time.sleep(1.5); "
          "json.dump({'program': 'p', 'fits': True}, open(sys.argv[-1].split('=', 1)[1], 'w'))")
  row = cli.compile_in_subprocess([sys.executable, "-c", grow], "p", lines.append)
  assert row["fits"] and row["host_peak_rss_bytes"] > 200 * 2**20 and row["process_s"] >= 1.5
  assert any(l.startswith("[aot] p: compiling for ") and "GiB of host memory" in l
             for l in lines), lines
  die = ("import os, signal, sys; print('compiling...', file=sys.stderr, flush=True); "
         "os.kill(os.getpid(), signal.SIGKILL)")
  row = cli.compile_in_subprocess([sys.executable, "-c", die], "p", lines.append)
  assert row["failed"].startswith("compiler process killed by signal 9 (the kernel's "
                                  "out-of-memory killer sends it) after ")
  assert row["stderr_tail"] == ["compiling..."] and "fits" not in row
