"""The decode kernels: TPU (`kernels/decode_attention_tpu.py`, through the Mosaic interpreter)
and Triton (`kernels/decode_attention.py`, through the Pallas interpreter).

The claims, for each: it computes `kv_cache.attend`'s output (fp32 rounding) for rows filled
to different depths, with evicted holes, GQA and rows with no key; it reads nothing of a row
past its filled extent; the sampler with a Pallas impl decodes through it (every cache policy
that does not observe the probabilities) and gives the rows of the XLA decode, which the
learner still replays; the TPU kernel compiles for a TPU chip and under a multi-chip mesh, and
the Triton kernel lowers for "cuda" (per device under a mesh) without a GPU.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from model_fixtures import assert_learner_replays, make_test_model
from trm_jax.aot.tpu import compile_for_tpu, libtpu_available, topology_devices
from trm_jax.kernels.attention import decode_kernel
from trm_jax.kernels.decode_attention import decode_attention, slot_block
from trm_jax.kernels.decode_attention_tpu import decode_attention_tpu, filled_extent
from trm_jax.models import kv_cache
from trm_jax.rollout import CacheConfig
from trm_jax.rollout import sampler as sampler_lib


def _cache(B=4, K=2, G=3, H=64, C=300, extents=(5, 150, 0, 300), dtype=jnp.float32, seed=0):
  """Random q and a cache whose row b holds keys in slots [0, extents[b]), with holes."""
  r = np.random.default_rng(seed)
  q = jnp.asarray(r.normal(size=(B, K * G, H)), dtype)
  k = jnp.asarray(r.normal(size=(B, K, H, C)), dtype)
  v = jnp.asarray(r.normal(size=(B, K, C, H)), dtype)
  pos = np.full((B, K, C), -1, np.int32)
  for b, e in enumerate(extents):
    pos[b, :, :e] = np.arange(e)
  pos[1, 0, 10:20] = -1          # evicted holes inside the extent, one kv head only
  pos[3, 1, 200:260] = -1
  return q, kv_cache.KVCache(k=k, v=v, pos=jnp.asarray(pos))


# kernel name -> f(q, k, v, pos, block) through its interpreter on CPU.
KERNELS = {
    "tpu": lambda q, k, v, pos, block: decode_attention_tpu(q, k, v, pos, block=block,
                                                             interpret=True),
    "triton": lambda q, k, v, pos, block: decode_attention(q, k, v, pos, block=block,
                                                           interpret=True)}


@pytest.mark.parametrize("kernel,dtype,block,C,atol", [
    ("tpu", jnp.float32, 128, 300, 2e-6), ("tpu", jnp.float32, 512, 300, 2e-6),
    ("tpu", jnp.bfloat16, 128, 300, 2e-2),
    ("triton", jnp.float32, 128, 300, 2e-6),     # C with no power-of-two factor >= 16: padded
    ("triton", jnp.float32, 64, 320, 2e-6),      # read in place, 64-slot blocks
    ("triton", jnp.bfloat16, 128, 320, 2e-2)])
def test_matches_the_caches_own_attention(kernel, dtype, block, C, atol):
  q, cache = _cache(dtype=dtype, C=C)
  ref, _ = kv_cache.attend(q, cache)
  got = KERNELS[kernel](q, cache.k, cache.v, cache.pos, block)
  assert got.dtype == ref.dtype and got.shape == ref.shape
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                             atol=atol, rtol=0)
  np.testing.assert_array_equal(np.asarray(got[2]), 0)   # a row with no key gives zeros
  np.testing.assert_array_equal(filled_extent(cache.pos), [5, 150, 0, 300])


def test_the_triton_block_divides_the_capacity():
  assert [slot_block(C) for C in (300, 320, 384, 4096, 4112)] == [16, 64, 128, 128, 16]
  assert slot_block(4096, block=64) == 64


@pytest.mark.parametrize("kernel,block", [("tpu", 128), ("triton", 32)])
def test_reads_no_block_past_a_rows_extent(kernel, block):
  """NaN in every block past a row's last filled block: a read of any of them would poison
  the row's output (p @ v with p = 0 still gives NaN); the TPU kernel's clamped fetches and
  skipped steps, and the Triton kernel's loop bound, never touch them. (Empty slots inside the
  last block are read and masked.)"""
  q, cache = _cache(extents=(5, 150, 0, 129), C=320)
  pos = np.asarray(cache.pos)
  live_end = -(-np.asarray(filled_extent(cache.pos)) // block) * block     # [B]
  past = np.broadcast_to(np.arange(pos.shape[-1]) >= live_end[:, None, None], pos.shape)
  assert past.sum() > 0
  k = jnp.where(past[:, :, None, :], jnp.nan, cache.k)
  v = jnp.where(past[..., None], jnp.nan, cache.v)
  got = KERNELS[kernel](q, k, v, cache.pos, block)
  ref, _ = kv_cache.attend(q, cache)
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6, rtol=0)


def test_the_impls_that_have_a_decode_kernel():
  for impl in ("pallas_tpu_interpret", "pallas_tpu", "pallas", "pallas_interpret"):
    assert decode_kernel(impl) is not None, impl
  assert decode_kernel("reference") is None
  q, cache = _cache()
  for impl in ("pallas_tpu_interpret", "pallas_interpret"):
    o, probs = kv_cache.attend(q, cache, impl=impl, probs=False)
    assert probs is None
    o_ref, probs_ref = kv_cache.attend(q, cache, impl=impl, probs=True)
    assert probs_ref.shape == (4, 2, 3, 300)   # a caller that needs them gets the einsums
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=2e-6, rtol=0)


P, R, B, G = 10, 14, 8, 2
EOS = (7, 8, 9)
POLICIES = {"none": CacheConfig(), "snapkv": CacheConfig(policy="snapkv", ratio=0.5, window=3,
                                                        kernel=3),
            "random": CacheConfig(policy="random", ratio=0.4),
            "h2o": CacheConfig(policy="h2o", capacity=12)}   # observes: decodes with einsums


@pytest.fixture(scope="module")
def dense():
  return make_test_model(seed=3, num_layers=1)


# impl -> the decode kernel's name in a traced program (the Pallas call's `name=`).
DECODE_IMPLS = {"pallas_tpu_interpret": "decode_attention_tpu",
                "pallas_interpret": "decode_attention"}


# Every policy through the Triton kernel's interpreter; the Mosaic interpreter (about 4x
# slower per decode step) on the two paths that differ for it: a policy with evicted holes in
# the cache (snapkv) and one that decodes with the einsums (h2o).
SAMPLER_CASES = [(p, "pallas_interpret") for p in POLICIES] + [
    (p, "pallas_tpu_interpret") for p in ("snapkv", "h2o")]


@pytest.mark.parametrize("policy,impl", SAMPLER_CASES)
def test_the_sampler_decodes_through_it_with_the_same_rows(dense, policy, impl):
  rng = np.random.default_rng(0)
  lens = np.repeat(rng.integers(2, P + 1, B // G), G).astype(np.int32)
  ids = np.zeros((B, P), np.int32)
  for b in range(B):
    ids[b, P - lens[b]:] = rng.integers(10, 128, lens[b]) if b % G == 0 else ids[b - 1, P - lens[b]:]
  run = lambda impl: sampler_lib.generate(
      dense, ids, lens, max_new_tokens=R, key=jax.random.key(1), eos_ids=EOS,
      cache=POLICIES[policy], attn_impl=impl, slots=3, group_size=G, chunk=3, refill=1,
      bucket=16, tail=1)
  ref, got = run("reference"), run(impl)
  # The kernel is in the decode program unless the policy observes the probabilities.
  traced = str(jax.make_jaxpr(functools.partial(run, impl))())
  named = re.search(rf"name={DECODE_IMPLS[impl]}\b", traced) is not None
  assert named == (policy != "h2o"), (policy, impl)
  np.testing.assert_array_equal(got.tokens, ref.tokens)
  np.testing.assert_array_equal(got.evicted_at, ref.evicted_at)
  np.testing.assert_allclose(got.logp, ref.logp, atol=1e-5, rtol=0)
  assert_learner_replays(dense, got, max_new_tokens=R, eos_ids=EOS, atol=1e-5)


@pytest.mark.skipif(not libtpu_available(),
                    reason="libtpu not installed (pip install -e .[tpu]): no TPU compiler")
def test_compiles_for_a_tpu_chip_and_a_multi_chip_mesh():
  """Mosaic compiles a Qwen3-8B-shaped decode (K 8, G 4, H 128, bf16, 8192 slots, 64 rows)
  for one v5e chip, and `kernels.attention.decode_kernel` runs it per chip under a 2x4 mesh
  (a Mosaic call cannot be partitioned by XLA: without the shard_map this does not lower)."""
  Bq, K, Gq, H, C = 64, 8, 4, 128, 8192
  bf16 = jnp.bfloat16
  shapes = (((Bq, K * Gq, H), bf16), ((Bq, K, H, C), bf16), ((Bq, K, C, H), bf16),
            ((Bq, K, C), jnp.int32))
  compiled = compile_for_tpu(lambda q, k, v, p: decode_attention_tpu(q, k, v, p),
                             [jax.ShapeDtypeStruct(s, d) for s, d in shapes], "v5e:2x2")
  assert "decode_attention_tpu" in compiled.as_text()
  mesh = Mesh(np.array(topology_devices("v5e:2x4")).reshape(4, 2), ("data", "tensor"))
  specs = (PartitionSpec("data", "tensor", None), PartitionSpec("data", "tensor", None, None),
           PartitionSpec("data", "tensor", None, None), PartitionSpec("data", "tensor", None))
  args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, sp))
          for (s, d), sp in zip(shapes, specs)]
  kernel = decode_kernel("pallas_tpu")
  with jax.set_mesh(mesh):
    text = jax.jit(lambda q, k, v, p: kernel(q, k, v, p)).lower(*args).compile().as_text()
  assert "decode_attention_tpu" in text


def test_the_triton_kernel_lowers_for_cuda_per_device_under_a_mesh():
  """Exported for "cuda" without a GPU (jax.export runs the Pallas -> Triton lowering here, so
  a lowering error fails CI, not a GPU job): one Triton call, named, for a Qwen3-8B-shaped
  decode (K 8, G 4, H 128, bf16, 8192 slots); under a data 4 x tensor 2 mesh
  `decode_kernel("pallas")` gives it one device's rows and kv heads (16 of 64 rows, 4 of 8
  kv heads), never the global cache."""
  from jax import export  # pylint: disable=g-import-not-at-top
  from trm_jax import sharding as shd  # pylint: disable=g-import-not-at-top
  Bq, K, Gq, H, C = 64, 8, 4, 128, 8192
  bf16 = jnp.bfloat16
  shapes = (((Bq, K * Gq, H), bf16), ((Bq, K, H, C), bf16), ((Bq, K, C, H), bf16),
            ((Bq, K, C), jnp.int32))
  allow = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  one = export.export(jax.jit(decode_kernel("pallas")), platforms=("cuda",),
                      disabled_checks=allow)(*[jax.ShapeDtypeStruct(s, d) for s, d in shapes])
  mlir = one.mlir_module()
  assert mlir.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1
  assert 'name = "decode_attention"' in mlir
  mesh = shd.make_mesh({"data": 4, "tensor": 2})
  specs = (PartitionSpec(("data", "fsdp"), "tensor", None),
           PartitionSpec(("data", "fsdp"), "tensor", None, None),
           PartitionSpec(("data", "fsdp"), "tensor", None, None),
           PartitionSpec(("data", "fsdp"), "tensor", None))
  args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, sp))
          for (s, d), sp in zip(shapes, specs)]
  with jax.set_mesh(mesh):
    sharded = export.export(jax.jit(decode_kernel("pallas")), platforms=("cuda",),
                            disabled_checks=allow)(*args)
  calls = [l for l in sharded.mlir_module().splitlines()
           if "stablehlo.custom_call @__gpu$xla.gpu.triton" in l]
  assert sharded.nr_devices == 8 and len(calls) == 1
  operands = calls[0].rsplit(":", 1)[1]
  assert "tensor<16x4x128x8192xbf16>" in operands, operands      # k, one device's block
  assert "64x8x" not in operands, operands
