"""The Mosaic TPU flash kernel (TPU interpreter on CPU) against the plain-jnp reference.

Each case compares outputs and custom_vjp gradients (dq, dk, dv) with the reference's, in one
jit per case (compiles dominate the cost): fp32 outputs to 1e-5 and gradients to 1e-4, over
ragged right/left padding, packed segments, GQA groups of 1, 2 and 4, head dims 64 and 128
(64 is padded to 128 lanes inside), three block shapes (T not always a multiple of the block),
query rows whose every key is evicted, synthetic eviction records of every kind, and the
records real rollouts of every cache policy write (snapkv, h2o, recent, random at ratio 0.5);
and the tiny decoder scoring an H2O rollout under its record (log-probs and parameter
gradients) through attn_impl="pallas_tpu_interpret" against "reference".

bf16 (inputs and the kernel's matmul operands bf16, fp32 accumulation), max abs error against
the fp32 reference on the same bf16-rounded inputs (T=256, N=4, K=2, H=128, mixed eviction,
values and gradients of order 1):
    kernel in bf16:     out 1.0e-2  dq 1.3e-2  dk 1.2e-2  dv 2.3e-2
    reference in bf16:  out 1.2e-2  dq 9.3e-3  dk 1.1e-2  dv 2.3e-2
The test asserts the kernel stays within 2x the reference's own bf16 error (both round p and
ds to bf16 before their matmuls, at different points of the computation).

The AOT test compiles forward + backward for a real TPU (v5e) through libtpu; it skips with
the reason when libtpu is not installed (`pip install -e .[tpu]`).

Measured fp32 max abs errors are 1e-6 (outputs) and 6e-6 (gradients). Runtime: 54 s on 2 CPU
cores shared with other work (50 s CPU), 11 s of it the four rollouts' sampler compiles; the
AOT test (4 s) skips without libtpu.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prompt_fixtures import left_padded_prompts
from test_kernels import _eviction_record
from trm_jax import sharding as shd
from trm_jax.kernels.attention import attention, resolve_impl
from trm_jax.kernels.attention_ref import attention_reference
from trm_jax.kernels.flash_attention import BlockSizes
from trm_jax.kernels.flash_attention_tpu import (TPUBlockSizes, _padded_length, _side_inputs,
                                                 flash_attention_tpu)
from trm_jax.aot.tpu import compile_for_tpu, libtpu_available
from trm_jax.kernels.tpu_blocks import block_summaries, block_tables, plan_blocks
from trm_jax.kernels.visibility import (NEVER_EVICTED, LayerVisibility, Visibility,
                                        visible_mask)
from model_fixtures import make_test_model
from trm_jax.rollout import CacheConfig, generate

B128 = TPUBlockSizes(128, 128, 128, 128)


@dataclasses.dataclass(frozen=True)
class Case:
  T: int
  N: int
  K: int
  H: int
  blocks: TPUBlockSizes
  pad: str = "right"      # "none" | "right" | "left" | "packed"
  evict: str = "mixed"    # "none" | "mixed" | "window" | "blind" (mixed + fully evicted rows)
  B: int = 2


def _visibility(case: Case, rng) -> LayerVisibility:
  B, T, K = case.B, case.T, case.K
  if case.pad == "packed":   # three sequences packed in each row, then padding
    seg = np.zeros((B, T), np.int32)
    seg[:, : T // 3] = 1
    seg[:, T // 3: 2 * T // 3] = 2
    seg[:, 2 * T // 3: T - 9] = 3
    vis = Visibility(segment_ids=jnp.asarray(seg))
  elif case.pad == "none":
    vis = Visibility()
  else:   # row 1 is short: with left padding its first 128-query block is all padding
    vis = Visibility.from_lengths(np.array([T, 100])[:B], T, left_pad=case.pad == "left")
  ev = None
  if case.evict in ("mixed", "blind"):
    ev = _eviction_record(rng, B, K, T, prompt_len=T // 4)
    if case.evict == "blind":   # keys 0..39 never visible, so queries 0..39 of kv head 0
      ev[0, 0, :40] = np.arange(40)   # see nothing: fully masked rows inside a live block
  elif case.evict == "window":   # key j leaves the cache at j + 40: old key blocks are dead
    ev = np.broadcast_to(np.arange(T) + 40, (B, K, T)).astype(np.int32)
  return LayerVisibility(segment_ids=vis.segment_ids,
                         evicted_at=None if ev is None else jnp.asarray(ev))


def _qkv_do(rng, B, T, N, K, H, dtype=jnp.float32):
  return tuple(jnp.asarray(rng.standard_normal(s), dtype)
               for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)))


def _vjp(f, q, k, v, do):
  out, pull = jax.vjp(f, q, k, v)
  return (out, *pull(do))


@jax.jit
def _reference(q, k, v, do, vis):
  return _vjp(lambda q, k, v: attention_reference(q, k, v, vis), q, k, v, do)


def _kernel(blocks: TPUBlockSizes):
  @jax.jit
  def run(q, k, v, do, vis):
    f = lambda q, k, v: flash_attention_tpu(q, k, v, vis, block_sizes=blocks, interpret=True)
    return _vjp(f, q, k, v, do)
  return run


def _assert_matches_reference(got, want, vis: LayerVisibility, N: int):
  """fp32 tolerances, plus exact zeros where nothing is visible."""
  names = ("out", "dq", "dk", "dv")
  for name, g, w in zip(names, got, want):
    g, w = np.asarray(g), np.asarray(w)
    assert np.isfinite(g).all(), name
    np.testing.assert_allclose(g, w, atol=1e-5 if name == "out" else 1e-4, rtol=0,
                               err_msg=name)
  out, dq, dk, dv = (np.asarray(x) for x in got)
  B, T, K = out.shape[0], out.shape[1], dk.shape[2]
  mask = np.asarray(visible_mask(vis, B, K, T))                    # [B, K, Tq, Tk]
  # Queries that see no key: zero output and zero dq, whatever the cotangent.
  blind = np.repeat(~mask.any(-1), N // K, axis=1).transpose(0, 2, 1)  # [B, T, N]
  assert np.all(out[blind] == 0.0) and np.all(dq[blind] == 0.0)
  # Keys that no query sees get zero dk and dv.
  dead = (~mask.any(-2)).transpose(0, 2, 1)                        # [B, T, K]
  assert np.all(dk[dead] == 0.0) and np.all(dv[dead] == 0.0)
  return blind, dead


CASES = [
    # GQA G = N // K; blocks (fwd q, fwd k, bwd q, bwd k)
    Case(T=200, N=2, K=2, H=64, blocks=B128, pad="right", evict="mixed"),        # G=1, T%128
    Case(T=256, N=4, K=2, H=128, blocks=TPUBlockSizes(256, 128, 128, 256), pad="left",
         evict="blind"),                                                       # G=2
    # G=4 under a 2 MiB VMEM budget: 2 query heads per grid step (head chunks), T_pad 512
    Case(T=300, N=4, K=1, H=64, blocks=TPUBlockSizes(128, 256, 128, 256, vmem_limit_bytes=2**21),
         pad="packed", evict="window", B=1),
]


@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: f"T{c.T}N{c.N}K{c.K}H{c.H}-{c.pad}-{c.evict}")
def test_outputs_and_gradients_match_reference(case):
  rng = np.random.default_rng(0)
  vis = _visibility(case, rng)
  q, k, v, do = _qkv_do(rng, case.B, case.T, case.N, case.K, case.H)
  got = _kernel(case.blocks)(q, k, v, do, vis)
  blind, dead = _assert_matches_reference(got, _reference(q, k, v, do, vis), vis, case.N)
  if case.pad != "none":   # the cases are built to contain both
    assert blind.any() and dead.any()
  if case.evict == "blind":
    assert blind[0, :40, :case.N // case.K].all()


@pytest.fixture(scope="module")
def policy_rollouts():
  """(model, {policy: Rollout}) from real rollouts (tiny one-layer model, ratio 0.5,
  T = 128 + 128; one layer because the four sampler compiles are most of this file's time)."""
  model = make_test_model(seed=0, num_layers=1)
  lens = np.array([128, 77], np.int32)
  prompts = left_padded_prompts(lens, 128)
  out = {}
  for policy in ("snapkv", "h2o", "recent", "random"):
    out[policy] = generate(model, prompts, lens, max_new_tokens=128, key=jax.random.key(1),
                           eos_ids=(), cache=CacheConfig(policy=policy, ratio=0.5))
  return model, out


@pytest.fixture(scope="module")
def policy_records(policy_rollouts):
  """{policy: LayerVisibility} of the rollouts' only layer."""
  return {p: Visibility(ro.segment_ids, ro.evicted_at).layer(0)
          for p, ro in policy_rollouts[1].items()}


def test_rollout_eviction_records_of_every_policy(policy_records):
  """The four policies' records in one batch (B = 4 policies x 2 rows), K=2 like the model."""
  for policy, lv in policy_records.items():
    assert int(jnp.sum(lv.evicted_at < NEVER_EVICTED)) > 0, policy   # something was evicted
  vis = jax.tree.map(lambda *x: jnp.concatenate(x), *policy_records.values())
  B, K, T = vis.evicted_at.shape
  N, H = 4, 128
  q, k, v, do = _qkv_do(np.random.default_rng(1), B, T, N, K, H)
  got = _kernel(TPUBlockSizes(256, 128, 128, 256))(q, k, v, do, vis)
  _assert_matches_reference(got, _reference(q, k, v, do, vis), vis, N)


# The Triton-layout kernel runs through the HLO interpreter on all 8 simulated devices. The
# Mosaic interpreter opens every kernel with a barrier across the mesh's devices, which needs
# all of their programs running at once: XLA:CPU on two cores runs four, so its mesh has four.
@pytest.mark.parametrize("impl,axes,blocks", [
    ("pallas_interpret", {"data": 4, "tensor": 2}, BlockSizes(block_q=64, block_k=64)),
    ("pallas_tpu_interpret", {"data": 2, "tensor": 2}, TPUBlockSizes(256, 128, 128, 256)),
], ids=["triton-8dev", "mosaic-4dev"])
def test_partitioned_kernel_equals_the_single_device_kernel(policy_records, impl, axes, blocks):
  """Under `jax.set_mesh`, `attention` runs each Pallas kernel per device (rows over data,
  kv heads over tensor: kernels.partition); outputs and gradients equal the single-device
  kernel's bitwise, on the four cache policies' real records (B = 8 rows, K = 2 heads)."""
  vis = jax.tree.map(lambda *x: jnp.concatenate(x), *policy_records.values())
  B, K, T = vis.evicted_at.shape
  N, H = 4, 128
  q, k, v, do = _qkv_do(np.random.default_rng(2), B, T, N, K, H)

  def run(q, k, v, do, vis):
    return _vjp(lambda q, k, v: attention(q, k, v, vis, impl=impl, block_sizes=blocks),
                q, k, v, do)

  want = jax.jit(run)(q, k, v, do, vis)
  mesh = shd.make_mesh(axes, jax.devices()[:axes["data"] * axes["tensor"]])
  with jax.set_mesh(mesh):
    lowered = jax.jit(run).lower(q, k, v, do, vis)
    got = lowered.compile()(q, k, v, do, vis)
  # One manual (shard_map) region per kernel call: forward, and the backward's.
  assert lowered.as_text().count("sdy.manual_computation") >= 2
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


def test_decoder_scores_a_rollout_through_the_kernel(policy_rollouts):
  """The model's teacher-forced log-probs of an H2O rollout under its eviction record, and
  their parameter gradients, through attn_impl="pallas_tpu_interpret" and "reference"."""
  model, rollouts = policy_rollouts
  ro = rollouts["h2o"]
  vis = Visibility(ro.segment_ids, ro.evicted_at)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  valid = (ro.segment_ids[:, 1:] != 0) & (ro.segment_ids[:, :-1] != 0)

  @functools.partial(jax.jit, static_argnums=1)
  def score(params, impl):
    def total_logp(params):
      logits = nnx.merge(graphdef, params, rest)(ro.tokens, visibility=vis, attn_impl=impl)
      logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]),
                                 ro.tokens[:, 1:, None], -1)[..., 0]
      return jnp.sum(jnp.where(valid, logp, 0.0)), logp
    return jax.value_and_grad(total_logp, has_aux=True)(params)

  (_, logp), grads = score(params, "pallas_tpu_interpret")
  (_, ref_logp), ref_grads = score(params, "reference")
  np.testing.assert_allclose(np.where(valid, logp, 0), np.where(valid, ref_logp, 0),
                             atol=1e-5, rtol=0)
  for (path, g), rg in zip(jax.tree_util.tree_leaves_with_path(grads),   # entries up to ~10
                           jax.tree_util.tree_leaves(ref_grads)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(rg), atol=1e-4, rtol=0,
                               err_msg=jax.tree_util.keystr(path))


def test_bf16_within_the_references_own_rounding():
  case = Case(T=256, N=4, K=2, H=128, blocks=B128, pad="right", evict="mixed")
  rng = np.random.default_rng(2)
  vis = _visibility(case, rng)
  args = _qkv_do(rng, case.B, case.T, case.N, case.K, case.H, jnp.bfloat16)
  exact = _reference(*(x.astype(jnp.float32) for x in args), vis)
  errors = {}
  for name, got in (("kernel", _kernel(case.blocks)(*args, vis)),
                    ("reference", _reference(*args, vis))):
    errors[name] = {n: float(jnp.max(jnp.abs(g.astype(jnp.float32) - e)))
                    for n, g, e in zip(("out", "dq", "dk", "dv"), got, exact)}
    assert all(bool(jnp.isfinite(g).all()) for g in got), name
  print("bf16 max abs error vs fp32 reference:", errors)
  for n in ("out", "dq", "dk", "dv"):
    assert errors["kernel"][n] <= errors["reference"][n] * 2, (n, errors)


def test_block_tables_are_conservative_and_skip():
  """Every (query block, key block) pair holding a visible pair is computed; dead blocks
  (padding, evicted bands, the causal upper triangle) are skipped and mostly not fetched."""
  T, bq, bk = 512, 128, 128
  rng = np.random.default_rng(3)
  for case, must_skip in ((Case(T=T, N=2, K=2, H=64, blocks=B128, pad="left",
                                evict="window"), True),
                          (Case(T=T, N=2, K=2, H=64, blocks=B128, pad="packed",
                                evict="mixed"), True)):
    vis = _visibility(case, rng)
    seg, ev = _side_inputs(vis, case.B, T, _padded_length(T, case.blocks))
    _, live = block_summaries(seg, ev, case.K, bq, bk)
    dense = np.asarray(visible_mask(vis, case.B, case.K, T))
    needed = dense.reshape(case.B, case.K, T // bq, bq, T // bk, bk).any((3, 5))
    live = np.asarray(live)
    assert np.all(live[needed]), "a block holding a visible pair would be skipped"
    causal = np.tril(np.ones((T // bq, T // bk), bool))
    assert (live < causal).any() == must_skip       # skips beyond the causal triangle
    # The fetch range of every query block covers its live key blocks.
    tabs = block_tables(seg, ev, case.K, bq, bk, outer="q")
    lo = np.asarray(tabs.f_lo).reshape(live.shape[:3])
    hi = np.asarray(tabs.f_hi).reshape(live.shape[:3])
    j = np.arange(T // bk)
    assert np.all(~live | ((lo[..., None] <= j) & (j <= hi[..., None])))


def test_blocks_fit_the_vmem_budget():
  """Rows per step (heads x block_q) are capped by what compiled for v5e's 16 MiB scoped
  VMEM: short blocks first, then the group is split into head chunks."""
  def plan(G, dtype=jnp.bfloat16, T=32768, blocks=TPUBlockSizes()):
    b, hf, hb = plan_blocks(blocks, T, G, jnp.dtype(dtype).itemsize)
    return (b.block_q, hf), (b.block_q_bwd, hb)
  assert plan(4) == ((512, 4), (256, 4))                    # Qwen3-8B: the defaults
  assert plan(8) == ((256, 8), (256, 8))
  assert plan(16) == ((128, 16), (256, 16))
  assert plan(32) == ((128, 16), (128, 32))                 # forward: two chunks of 16 heads
  assert plan(16, jnp.float32) == ((128, 16), (128, 16))
  assert plan(4, T=200) == ((256, 4), (256, 4))             # clamped to T first
  small = TPUBlockSizes(128, 256, 128, 256, vmem_limit_bytes=2**21)
  assert plan(4, jnp.float32, T=300, blocks=small) == ((128, 2), (128, 2))


def test_dispatch_and_validation():
  assert resolve_impl("auto", "tpu") == "pallas_tpu"
  assert resolve_impl("auto", "gpu") == "pallas"
  assert resolve_impl("auto", "cpu") == "reference" == resolve_impl("auto")  # tests: CPU
  rng = np.random.default_rng(4)
  case = Case(T=128, N=2, K=1, H=64, blocks=B128, pad="right", evict="mixed")
  vis = _visibility(case, rng)
  q, k, v, _ = _qkv_do(rng, case.B, case.T, case.N, case.K, case.H)
  out = attention(q, k, v, vis, impl="pallas_tpu_interpret", block_sizes=B128)
  np.testing.assert_allclose(np.asarray(out), np.asarray(attention_reference(q, k, v, vis)),
                             atol=1e-5, rtol=0)
  with pytest.raises(ValueError, match="impl='pallas_tpu_interpret' takes "
                                       r"block_sizes=TPUBlockSizes\(...\), got BlockSizes"):
    attention(q, k, v, vis, impl="pallas_tpu_interpret", block_sizes=BlockSizes())
  with pytest.raises(ValueError, match=r"impl='pallas' takes block_sizes=BlockSizes\(...\), "
                                       "got TPUBlockSizes"):
    attention(q, k, v, vis, impl="pallas", block_sizes=B128)
  with pytest.raises(ValueError, match="TPUBlockSizes.block_k=64 must be a power of two "
                                       ">= 128"):
    TPUBlockSizes(block_k=64)
  with pytest.raises(ValueError, match="TPUBlockSizes.block_q_bwd=384"):
    TPUBlockSizes(block_q_bwd=384)
  with pytest.raises(ValueError, match="N=2 must be a multiple of kv heads K=3"):
    flash_attention_tpu(q, jnp.zeros((2, 128, 3, 64)), jnp.zeros((2, 128, 3, 64)))
  with pytest.raises(ValueError, match=r"evicted_at \(2, 2, 128\) != \[B, K, T\]"):
    flash_attention_tpu(q, k, v, LayerVisibility(evicted_at=jnp.zeros((2, 2, 128), jnp.int32)))
  assert TPUBlockSizes(512, 1024).clamped(200) == TPUBlockSizes(256, 256, 256, 256)


@pytest.mark.skipif(not libtpu_available(),
                    reason="libtpu not installed (pip install -e .[tpu]): no TPU compiler")
def test_compiles_for_tpu_v5e_without_a_tpu():
  """Forward + backward through XLA:TPU and Mosaic for a v5e chip, with the memory claim: the
  compiled program's HBM temporaries stay far below one [T, T] fp32 array."""
  B, T, N, K, H = 1, 8192, 8, 2, 128   # one [T, T] fp32 array (256 MiB) exceeds VMEM
  bf16 = jnp.bfloat16

  def fwd_bwd(q, k, v, seg, ev, do):   # projection-shaped [B, T, heads*H] at the boundary
    q, k, v = (x.reshape(B, T, -1, H) for x in (q, k, v))
    f = lambda q, k, v: flash_attention_tpu(q, k, v, LayerVisibility(seg, ev)).reshape(B, T, -1)
    out, pull = jax.vjp(f, q, k, v)
    return out, *(g.reshape(B, T, -1) for g in pull(do))

  args = [jax.ShapeDtypeStruct(s, d) for s, d in (
      ((B, T, N * H), bf16), ((B, T, K * H), bf16), ((B, T, K * H), bf16),
      ((B, T), jnp.int32), ((B, K, T), jnp.int32), ((B, T, N * H), bf16))]
  compiled = compile_for_tpu(fwd_bwd, args, "v5e:2x2")
  hlo = compiled.as_text()
  for name in ("vis_flash_tpu_fwd", "vis_flash_tpu_bwd_dq", "vis_flash_tpu_bwd_dkdv"):
    assert name in hlo, name
  assert hlo.count('custom_call_target="tpu_custom_call"') == 3
  temp = compiled.memory_analysis().temp_size_in_bytes
  print(f"v5e fwd+bwd T={T}: temp {temp} bytes")
  assert temp < T * T * 4 // 8, temp
