"""The Pallas flash kernel (interpret mode) against the plain-jnp reference.

Each case builds one visibility (ragged padding, GQA, an eviction record mixing keys evicted
at prompt_len, never evicted, evicted right after creation, evicted at creation, and random
later steps) and compares the kernel's outputs and its custom_vjp gradients with the
reference's, in one jit per case to keep compile time (the cost here) down.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trm_jax.kernels.attention import attention, resolve_impl
from trm_jax.kernels.attention_ref import attention_reference
from trm_jax.kernels.flash_attention import BlockSizes, flash_attention
from trm_jax.kernels.visibility import (NEVER_EVICTED, LayerVisibility, Visibility,
                                        visible_mask)


@dataclasses.dataclass(frozen=True)
class Case:
  T: int
  N: int
  K: int
  blocks: BlockSizes
  pad: str = "right"      # "none" | "right" | "left" | "packed"
  evict: str = "mixed"    # "none" | "mixed" (every kind of record) | "window" (recent-W cache)
  H: int = 16
  B: int = 2


def _eviction_record(rng: np.random.Generator, B: int, K: int, T: int,
                     prompt_len: int) -> np.ndarray:
  """evicted_at [B, K, T] with every kind of record the rollout engine writes."""
  j = np.broadcast_to(np.arange(T), (B, K, T))
  kind = rng.integers(0, 5, size=(B, K, T))
  later = j + 1 + (rng.random((B, K, T)) * (T - j)).astype(np.int64)   # in (j, T]
  ev = np.select(
      [kind == 0, kind == 1, kind == 2, kind == 3],
      [np.full_like(j, NEVER_EVICTED),                      # stayed in the cache
       np.where(j < prompt_len, prompt_len, NEVER_EVICTED),  # SnapKV: dropped after prefill
       j + 1,                                                # evicted right after creation
       j],                                                   # never visible, not even to itself
      later)                                                 # some later decode step
  return ev.astype(np.int32)


def _inputs(case: Case, seed: int = 0):
  rng = np.random.default_rng(seed)
  B, T, N, K, H = case.B, case.T, case.N, case.K, case.H
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
             for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H)))
  lengths = np.array([T, T - T // 3])[:B] if case.pad != "none" else np.full(B, T)
  if case.pad == "packed":   # two sequences packed in row 0, then padding
    seg = np.zeros((B, T), np.int32)
    seg[:, : T // 2] = 1
    seg[:, T // 2: T - 5] = 2
    vis = Visibility(segment_ids=jnp.asarray(seg))
  else:
    vis = Visibility.from_lengths(lengths, T, left_pad=case.pad == "left")
  if case.evict == "mixed":
    ev = _eviction_record(rng, B, K, T, prompt_len=T // 4)
  elif case.evict == "window":   # StreamingLLM-like: key j leaves the cache at j + 24, so
    ev = np.broadcast_to(np.arange(T) + 24, (B, K, T)).astype(np.int32)  # early key blocks
  else:                          # are hidden from late query blocks (dk/dv loop bound)
    ev = None
  lvis = LayerVisibility(segment_ids=vis.segment_ids,
                         evicted_at=None if ev is None else jnp.asarray(ev))
  do = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
  return q, k, v, lvis, do


def _kernel_and_reference(case: Case, q, k, v, vis, do):
  """(out, dq, dk, dv) for the kernel and for the reference, under one jit."""
  def both(q, k, v, vis, do):
    kern = lambda q, k, v: flash_attention(q, k, v, vis, block_sizes=case.blocks,
                                           interpret=True)
    ref = lambda q, k, v: attention_reference(q, k, v, vis)
    results = []
    for f in (kern, ref):
      out, vjp = jax.vjp(f, q, k, v)
      results.append((out, *vjp(do)))
    return results
  return jax.jit(both)(q, k, v, vis, do)


CASES = [
    # T, N, K (G = N // K), blocks (fwd q, fwd k, bwd q, bwd k), padding, eviction
    Case(T=64, N=2, K=2, blocks=BlockSizes(16, 16, 16, 16), pad="none", evict="none"),
    Case(T=64, N=4, K=2, blocks=BlockSizes(32, 16, 16, 32), pad="right"),
    Case(T=80, N=4, K=1, blocks=BlockSizes(32, 32, 32, 16), pad="left"),     # T % 32 != 0
    Case(T=128, N=4, K=1, blocks=BlockSizes(64, 32, 16, 16), pad="packed", evict="window"),
    Case(T=100, N=8, K=2, blocks=BlockSizes(16, 64, 64, 16), pad="right"),   # G = 4, T % 16
    Case(T=96, N=2, K=1, blocks=BlockSizes(32, 32, 16, 16), pad="left", H=24),  # H padded
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"T{c.T}N{c.N}K{c.K}H{c.H}-{c.pad}-{c.evict}")
def test_outputs_and_gradients_match_reference(case):
  q, k, v, vis, do = _inputs(case)
  (out, *grads), (ref, *ref_grads) = _kernel_and_reference(case, q, k, v, vis, do)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)
  for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
    np.testing.assert_allclose(np.asarray(g), np.asarray(rg), atol=1e-4, rtol=0, err_msg=name)
  # Query rows that see no key (padding, or every key evicted) are exact zeros, and so is
  # the gradient that flows into their queries, whatever cotangent arrives.
  blind = ~np.asarray(visible_mask(vis, case.B, case.K, case.T)).any(-1)   # [B, K, T]
  blind = np.repeat(blind, case.N // case.K, axis=1).transpose(0, 2, 1)  # [B, T, N]
  if case.pad != "none":
    assert blind.any(), "case meant to contain fully masked rows has none"
  assert np.all(np.asarray(out)[blind] == 0.0)
  assert np.all(np.asarray(grads[0])[blind] == 0.0)


def test_fully_masked_rows_are_exact_zeros():
  case = Case(T=64, N=2, K=1, blocks=BlockSizes(32, 32, 32, 32), pad="right", evict="none")
  q, k, v, _, _ = _inputs(case)
  # Row 0: keys 0..9 evicted at creation (ev = j) -> queries 0..9 see nothing; row 1: padding.
  ev = np.full((2, 1, 64), NEVER_EVICTED, np.int32)
  ev[0, 0, :10] = np.arange(10)
  vis = LayerVisibility(segment_ids=jnp.asarray((np.arange(64) < [[64], [40]]).astype(np.int32)),
                        evicted_at=jnp.asarray(ev))
  out = np.asarray(flash_attention(q, k, v, vis, block_sizes=case.blocks, interpret=True))
  assert np.all(out[0, :10] == 0.0) and np.all(out[1, 40:] == 0.0)
  assert np.all(np.abs(out[0, 10:]).sum(-1) > 0) and np.all(np.abs(out[1, :40]).sum(-1) > 0)


def test_forward_backward_never_materialises_a_TxT_array():
  """The memory claim: compiled temporaries stay well below one [N, T, T] fp32 array."""
  B, T, N, K, H = 1, 1024, 2, 1, 16
  shapes = (jax.ShapeDtypeStruct((B, T, N, H), jnp.float32),
            jax.ShapeDtypeStruct((B, T, K, H), jnp.float32),
            jax.ShapeDtypeStruct((B, T), jnp.int32),
            jax.ShapeDtypeStruct((B, K, T), jnp.int32))

  def loss(q, k, seg, ev):
    return flash_attention(q, k, k, LayerVisibility(seg, ev), interpret=True).sum()

  grad = jax.grad(loss, argnums=(0, 1))
  temp = jax.jit(grad).lower(*shapes).compile().memory_analysis().temp_size_in_bytes
  one_txt = B * N * T * T * 4   # 8 MiB; the kernel needs ~1.2 MiB, the reference ~32 MiB
  assert temp < one_txt // 2, (temp, one_txt)


def test_dispatcher_routes_and_validates():
  case = Case(T=32, N=2, K=1, blocks=BlockSizes(16, 16, 16, 16), pad="right")
  q, k, v, vis, _ = _inputs(case)
  assert resolve_impl("auto") == "reference"     # tests run on CPU
  ref = attention(q, k, v, vis, impl="auto")
  np.testing.assert_array_equal(np.asarray(ref), np.asarray(attention_reference(q, k, v, vis)))
  out = attention(q, k, v, vis, impl="pallas_interpret", block_sizes=case.blocks)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)
  with pytest.raises(ValueError, match="impl='triton'"):
    attention(q, k, v, vis, impl="triton")


def test_bad_inputs_name_the_culprit():
  q = jnp.zeros((1, 32, 4, 16))
  k = jnp.zeros((1, 32, 2, 16))
  with pytest.raises(ValueError, match="block_k=24"):
    BlockSizes(block_k=24)
  with pytest.raises(ValueError, match="block_q=8"):
    BlockSizes(block_q=8)
  with pytest.raises(ValueError, match="N=4 must be a multiple of kv heads K=3"):
    flash_attention(q, jnp.zeros((1, 32, 3, 16)), jnp.zeros((1, 32, 3, 16)), interpret=True)
  with pytest.raises(ValueError, match="evicted_at"):
    flash_attention(q, k, k, LayerVisibility(evicted_at=jnp.zeros((1, 4, 32), jnp.int32)),
                    interpret=True)
  with pytest.raises(ValueError, match="segment_ids"):
    flash_attention(q, k, k, LayerVisibility(segment_ids=jnp.zeros((1, 31), jnp.int32)),
                    interpret=True)


def test_triton_kernel_lowers_for_cuda_without_a_gpu():
  """Forward and backward go through the Pallas -> Triton lowering for platform "cuda" on a
  CPU-only machine, so a Triton lowering error fails CI here rather than on a GPU. jax.export
  refuses Triton custom calls by default (Triton IR has no stability guarantee);
  DisabledSafetyCheck.custom_call names the target to allow it."""
  from jax import export
  B, T, N, K, H = 1, 128, 4, 2, 64
  bf16 = jnp.bfloat16

  def fwd_bwd(q, k, v, seg, ev, do):
    f = lambda q, k, v: flash_attention(q, k, v, LayerVisibility(seg, ev))
    out, pull = jax.vjp(f, q, k, v)
    return out, *pull(do)

  args = [jax.ShapeDtypeStruct(s, d) for s, d in (
      ((B, T, N, H), bf16), ((B, T, K, H), bf16), ((B, T, K, H), bf16),
      ((B, T), jnp.int32), ((B, K, T), jnp.int32), ((B, T, N, H), bf16))]
  with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
    export.export(jax.jit(fwd_bwd), platforms=("cuda",))(*args)
  allow = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
  exported = export.export(jax.jit(fwd_bwd), platforms=("cuda",), disabled_checks=[allow])(*args)
  mlir = exported.mlir_module()
  assert exported.platforms == ("cuda",)
  assert mlir.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 3
  for name in ("vis_flash_fwd", "vis_flash_bwd_dkdv", "vis_flash_bwd_dq"):
    assert f'name = "{name}"' in mlir, name


def test_triton_kernel_exported_for_cuda_under_a_mesh_takes_per_device_blocks():
  """Under an 8-device mesh (data 4 x tensor 2) `attention(impl="pallas")` exported for
  "cuda" runs each Triton call on one device's block: 2 of the 8 rows and 1 of the 2 kv heads
  (4 of the 8 query heads), never the global [8, 256, 8, 64] q that XLA would otherwise gather
  onto every GPU."""
  from jax import export
  from jax.sharding import NamedSharding, PartitionSpec
  from trm_jax import sharding as shd
  B, T, N, K, H = 8, 256, 8, 2, 64
  bf16 = jnp.bfloat16
  mesh = shd.make_mesh({"data": 4, "tensor": 2})

  def fwd_bwd(q, k, v, seg, ev, do):
    f = lambda q, k, v: attention(q, k, v, LayerVisibility(seg, ev), impl="pallas")
    out, pull = jax.vjp(f, q, k, v)
    return out, *pull(do)

  heads = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None, "tensor", None))
  rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))
  ev_sh = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), "tensor", None))
  args = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d, sh in (
      ((B, T, N, H), bf16, heads), ((B, T, K, H), bf16, heads), ((B, T, K, H), bf16, heads),
      ((B, T), jnp.int32, rows), ((B, K, T), jnp.int32, ev_sh), ((B, T, N, H), bf16, heads))]
  allow = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
  with jax.set_mesh(mesh):
    exported = export.export(jax.jit(fwd_bwd), platforms=("cuda",),
                             disabled_checks=[allow])(*args)
  mlir = exported.mlir_module()
  assert exported.nr_devices == 8
  calls = [l for l in mlir.splitlines() if "stablehlo.custom_call @__gpu$xla.gpu.triton" in l]
  assert len(calls) == 3
  for line in calls:
    operands = line.rsplit(":", 1)[1]
    # per-device q / o / do blocks [2, 256, 4, 64] and k / v [2, 256, 1, 64]
    assert "tensor<2x256x4x64xbf16>" in operands and "tensor<2x256x1x64xbf16>" in operands, line
    assert "8x256" not in operands, line
