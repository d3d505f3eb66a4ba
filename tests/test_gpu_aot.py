"""Deviceless AOT compile for an 8 x H200 node through the CUDA PJRT plugin (no GPU, no driver).

Skips with the reason when the plugin is absent (`pip install -e .[gpu_aot]`; CI installs it).
Runtime ~20 s, most of it the trainer's update program.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from trm_jax.aot import hlo_cost
from trm_jax.aot import gpu as gpu_aot
from trm_jax.kernels.flash_attention import BlockSizes, flash_attention
from trm_jax.kernels.visibility import LayerVisibility


@pytest.fixture(scope="module")
def mesh():
  ok, why = gpu_aot.gpu_aot_available()
  if not ok:
    print(f"GPU AOT skipped: {why}")
    pytest.skip(why)
  return gpu_aot.make_mesh("h200:8", (4, 2), ("data", "tensor"))


def _abstract(mesh, shape, dtype, spec):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def test_topology_names():
  assert gpu_aot.parse_topology("h200:8") == (1, 8)
  assert gpu_aot.topology_gpus("h100:2x8") == 16
  with pytest.raises(ValueError, match="unknown GPU"):
    gpu_aot.gpu_spec("a100:8")
  with pytest.raises(ValueError, match="GPU:N"):
    gpu_aot.parse_topology("h200")


def test_sharded_mlp_gradient_memory(mesh):
  """A tensor-parallel MLP's gradient: per-GPU argument bytes are the shards', the
  partitioner inserts the all-reduces, and memory_analysis gives the temporaries."""
  devices = list(mesh.devices.flat)
  assert all(d.platform == "gpu" and d.device_kind == "NVIDIA H200" for d in devices)
  assert {d.compute_capability for d in devices} == {"9.0"}

  def loss(x, w1, w2):
    return jnp.sum(jnp.square(jax.nn.gelu(x @ w1) @ w2).astype(jnp.float32))

  D, F, B = 1024, 4096, 2048
  args = (_abstract(mesh, (B, D), jnp.bfloat16, P("data", None)),
          _abstract(mesh, (D, F), jnp.bfloat16, P(None, "tensor")),
          _abstract(mesh, (F, D), jnp.bfloat16, P("tensor", None)))
  compiled = jax.jit(jax.grad(loss, argnums=(1, 2))).lower(*args).compile()
  mem = compiled.memory_analysis()
  per_gpu_args = 2 * (B * D // 4 + D * F // 2 + F * D // 2)
  assert mem.argument_size_in_bytes == per_gpu_args
  assert mem.temp_size_in_bytes > 0
  text = compiled.as_text()
  assert "all-reduce" in text and "num_partitions=8" in text
  assert compiled.cost_analysis() is None          # hence hlo_cost, below
  assert hlo_cost.program_cost(compiled)["flops"] > 2 * 2 * B * D * F / 8


def test_triton_kernel_per_device_under_shard_map(mesh):
  """The Pallas Triton kernel compiles for sm_90 inside shard_map (rows over data, kv heads
  over tensor): every Triton call takes the per-GPU block, and hlo_cost counts its FLOPs."""
  B, T, N, K, H = 8, 512, 8, 4, 64
  blocks = BlockSizes(64, 64, 64, 64)

  def attn(q, k, v, seg, ev):
    return flash_attention(q, k, v, LayerVisibility(segment_ids=seg, evicted_at=ev),
                           block_sizes=blocks)

  heads = P("data", None, "tensor", None)
  sharded = jax.shard_map(attn, mesh=mesh, out_specs=heads, check_vma=False,
                          in_specs=(heads, heads, heads, P("data", None),
                                    P("data", "tensor", None)))
  loss = lambda *a: jnp.sum(jnp.square(sharded(*a).astype(jnp.float32)))
  args = (_abstract(mesh, (B, T, N, H), jnp.bfloat16, heads),
          _abstract(mesh, (B, T, K, H), jnp.bfloat16, heads),
          _abstract(mesh, (B, T, K, H), jnp.bfloat16, heads),
          _abstract(mesh, (B, T), jnp.int32, P("data", None)),
          _abstract(mesh, (B, K, T), jnp.int32, P("data", "tensor", None)))
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
  calls = [l for l in compiled.as_text().splitlines()
           if 'custom_call_target="__gpu$xla.gpu.triton"' in l]
  assert len(calls) == 3, calls                     # forward, dq, dk/dv
  per_gpu_q = f"bf16[{B // 4},{T},{N // 2},{H}]"
  assert all(per_gpu_q in l.split("backend_config=")[0] for l in calls)
  assert compiled.memory_analysis().temp_size_in_bytes > 0
  cost = hlo_cost.program_cost(compiled)
  assert cost["kernel_flops"] == 9 * 2 * (B // 4) * (N // 2) * H * T * T / 2


def test_triton_decode_kernel_compiles_per_device(mesh):
  """The Triton decode kernel (what "auto" decodes with on a GPU) compiles for sm_90 at a
  Qwen3-8B decode shape (64 rows, 8 kv heads x 4, H 128, 8192 slots, bf16), one call per GPU
  on its 16 rows and 4 kv heads: Triton's own compile (tile shapes, shared memory) passes, which
  lowering alone (tests/test_kernels_decode.py) does not reach."""
  from trm_jax.kernels.attention import decode_kernel  # pylint: disable=g-import-not-at-top
  B, K, G, H, C = 64, 8, 4, 128, 8192
  rows3, rows4 = P("data", "tensor", None), P("data", "tensor", None, None)
  args = (_abstract(mesh, (B, K * G, H), jnp.bfloat16, rows3),
          _abstract(mesh, (B, K, H, C), jnp.bfloat16, rows4),
          _abstract(mesh, (B, K, C, H), jnp.bfloat16, rows4),
          _abstract(mesh, (B, K, C), jnp.int32, rows3))
  kernel = decode_kernel("pallas")
  with jax.set_mesh(mesh):
    compiled = jax.jit(lambda q, k, v, pos: kernel(q, k, v, pos)).lower(*args).compile()
  calls = [l for l in compiled.as_text().splitlines()
           if 'custom_call_target="__gpu$xla.gpu.triton"' in l]
  assert len(calls) == 1 and "/decode_attention/" in calls[0], calls
  assert f"bf16[{B // 4},{K // 2},{H},{C}]" in calls[0].split("backend_config=")[0]


def test_triton_tiles_that_overflow_shared_memory_fail_here(mesh):
  """What the compile checks without a GPU: fp32 tiles of 64 x 256 overflow the H200's 227 KiB
  of shared memory per block, and Triton says so at compile time."""
  x = jax.ShapeDtypeStruct((1, 256, 2, 256), jnp.float32,
                           sharding=NamedSharding(mesh, P()))
  f = jax.jit(lambda q, k, v: flash_attention(q, k, v, None,
                                              block_sizes=BlockSizes(64, 64, 64, 64)))
  with pytest.raises(Exception, match="Shared memory size limit exceeded"):
    f.lower(x, x, x).compile()


def test_figures_and_target_config():
  h200, h100 = gpu_aot.GPUS["h200"], gpu_aot.GPUS["h100"]
  assert h200.peak_bf16_flops == 989e12 and h200.hbm_bytes_per_s == 4.8e12
  assert h100.hbm_bytes < h200.hbm_bytes
  text = h200.target_config()
  assert "device_memory_size: %d" % h200.hbm_bytes in text and "core_count: 132" in text
  np.testing.assert_equal(gpu_aot.gpu_spec("H200:8").name, "h200")


def test_trainer_update_compiles_for_an_h200_node(mesh):
  """The trainer's own learner program (programs.build, through trm_jax.aot's builder) for
  tiny_smd on 8 H200s: the SMD learner's Triton attention partitions itself onto each GPU's
  rows, and XLA:GPU assigns per-GPU buffers."""
  del mesh   # the fixture only decides whether the plugin is usable
  import os  # pylint: disable=g-import-not-at-top
  from trm_jax import config as config_lib, sweep  # pylint: disable=g-import-not-at-top
  from trm_jax.aot import compiler as aot  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  c = config_lib.load_config(os.path.join(root, "configs", "tiny_smd.py"))
  c = sweep.apply_overrides(c, {"rl.batch_size": 16, "rl.group_size": 4, "eval_problems": 0,
                                "warmup.cache_dir": "/nonexistent"}.items())
  hf, _ = aot.resolve_model(c)
  s = aot.build(c, hf, gpu_aot.topology_devices("h200:8"), "gpu")
  # One update per batch: the learner is one program, scoring inside the update.
  assert s.impl == "pallas" and sorted(s.programs.programs) == ["rollout", "score_update"]
  compiled = s.programs["score_update"].lower().compile()
  hlo = compiled.as_text()
  assert "__gpu$xla.gpu.triton" in hlo
  B_dev = 16 // c.rl.num_minibatches // 8    # a minibatch's rows on each GPU
  assert f"bf16[{B_dev}," in hlo or f"f32[{B_dev}," in hlo
  assert compiled.memory_analysis().temp_size_in_bytes > 0
  # Its rollout program prefills through the flash kernel and decodes with the einsums: H2O,
  # tiny_smd's policy, evicts by the attention probabilities, which the decode kernel does not
  # return. Under SnapKV the same program decodes through the Triton decode kernel.
  names = lambda c: set(re.findall(r'name = "(\w+)"', aot.build(
      c, hf, gpu_aot.topology_devices("h200:8"), "gpu").programs["rollout"].lower().as_text()))
  h2o = names(c)
  assert c.rollout.cache.policy == "h2o" and "vis_flash_fwd" in h2o
  assert "decode_attention" not in h2o
  snap = sweep.apply_overrides(c, {"rollout.cache.policy": "snapkv"}.items())
  assert names(snap) >= {"vis_flash_fwd", "decode_attention"}
