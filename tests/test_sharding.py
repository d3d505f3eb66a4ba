"""Logical-axis sharding: rules, meshes, and streamed loading into a 2x4 mesh of CPU devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from hf_fixtures import make_hf_checkpoint, sample_batch
from trm_jax import sharding as shd
from trm_jax.kernels import Visibility
from model_fixtures import make_test_model
from trm_jax.models import from_pretrained
from trm_jax.models.hf_io import _Checkpoint, _entries, _ours_from_hf

MOE = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=32)


@pytest.fixture(scope="module")
def mesh():
  assert len(jax.devices()) >= 8, "tests/conftest.py should provide 8 CPU devices"
  return shd.make_mesh({"fsdp": 2, "tensor": 4})


def test_make_mesh_axes_are_auto(mesh):
  assert mesh.axis_names == shd.MESH_AXES
  assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "expert": 1, "tensor": 4}
  assert all(t == AxisType.Auto for t in mesh.axis_types)
  assert dict(shd.make_mesh((2, 1, 1, 4)).shape) == {"data": 2, "fsdp": 1, "expert": 1,
                                                     "tensor": 4}
  with pytest.raises(ValueError, match="needs 16 devices"):
    shd.make_mesh({"data": 4, "tensor": 4})
  with pytest.raises(ValueError, match="unknown mesh axes \\['model'\\]"):
    shd.make_mesh({"model": 2})
  # An explicit device list (here the last four, reversed) is used as given on CPU.
  devs = jax.devices()[4:8][::-1]
  sub = shd.make_mesh({"fsdp": 2, "tensor": 2}, devs)
  assert list(sub.devices.flat) == devs
  assert all(t == AxisType.Auto for t in sub.axis_types)
  with pytest.raises(ValueError, match="needs 4 devices, got 3"):
    shd.make_mesh({"fsdp": 2, "tensor": 2}, devs[:3])


def test_opt_state_shardings_follow_params_scalars_replicated(mesh):
  from trm_jax.rl import optim
  model = shd.shard_model(make_test_model(), mesh)
  params = nnx.state(model, nnx.Param)
  tx = optim.make_optimizer(lr=1e-2, warmup_steps=1, total_steps=10, weight_decay=0.01,
                            b1=0.9, b2=0.99, eps=1e-3, clip_norm=1.0, min_lr_ratio=0.1)
  opt_sh = shd.opt_state_shardings(tx, params, mesh)
  state = jax.jit(tx.init, out_shardings=opt_sh)(params)
  param_sh = jax.tree.leaves(jax.tree.map(lambda x: x.sharding, params))
  adam = state[1][0]  # chain(clip, adamw): adamw = chain(scale_by_adam, decay, schedule)
  for moments in (adam.mu, adam.nu):
    got = [x.sharding for x in jax.tree.leaves(moments)]
    assert got == param_sh
  assert any(s.spec != P() for s in param_sh)  # the test model really is sharded
  replicated = NamedSharding(mesh, P())
  assert adam.count.sharding == replicated
  assert state[1][-1].count.sharding == replicated  # the schedule's step count
  n_param_leaves = 2 * len(param_sh)
  assert len(jax.tree.leaves(state)) == n_param_leaves + 2


def test_spec_rules(mesh):
  q = (shd.EMBED, shd.Q_HEADS, shd.HEAD_DIM)
  fsdp = ("fsdp", "expert")   # D is split over fsdp x expert (expert has size 1 here)
  assert shd.spec_for(q, shape=(64, 4, 16), mesh=mesh) == P(fsdp, "tensor", None)
  # 2 kv heads cannot be split 4 ways: replicated over `tensor` instead of failing.
  assert shd.spec_for((shd.EMBED, shd.KV_HEADS, shd.HEAD_DIM), shape=(64, 2, 16),
                      mesh=mesh) == P(fsdp, None, None)
  # A mesh axis is used once per array: the first dimension asking for it wins.
  assert shd.spec_for((shd.MLP, shd.VOCAB)) == P("tensor", None)
  assert shd.spec_for((shd.BATCH, shd.LENGTH)) == P(("data", "fsdp", "expert"), None)
  # An expert weight: E takes `expert`, so its D is split over fsdp alone.
  assert shd.spec_for((shd.EXPERTS, shd.EMBED, shd.MLP)) == P("expert", "fsdp", "tensor")
  rules = shd.DEFAULT_RULES + ((shd.EXPERTS, "tensor"),)  # later rules override
  assert shd.spec_for((shd.EXPERTS, shd.EMBED, shd.MLP), rules=rules) == P("tensor", fsdp, None)
  with pytest.raises(ValueError, match="logical axis 'heads' has no sharding rule"):
    shd.spec_for(("heads",))


@pytest.mark.parametrize("overrides", [{}, dict(MOE, qkv_bias=True, o_bias=True),
                                       dict(tie_word_embeddings=True)])
def test_every_param_has_logical_axes(overrides):
  model = nnx.eval_shape(lambda: make_test_model(**overrides))
  flat = list(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  assert flat
  for path, v in flat:
    axes = shd.param_axes(v)  # raises if missing or of the wrong rank
    assert all(a in dict(shd.DEFAULT_RULES) for a in axes), (path, axes)


def test_shard_model_places_random_init(mesh):
  model = shd.shard_model(make_test_model(), mesh)
  q = model.layers[0].attn.q_proj[...]
  assert q.sharding.spec == P(("fsdp", "expert"), "tensor", None)
  assert {s.data.shape for s in q.addressable_shards} == {(32, 1, 16)}


def test_block_reads_equal_slices_of_the_full_tensor(tmp_path):
  """The streamed reader returns exactly the requested block, also for blocks that cut the
  head dim (the merged-range + post-slice path) and for stacked experts."""
  path = make_hf_checkpoint(str(tmp_path / "m"), "qwen3_moe", attention_bias=True)
  full = from_pretrained(path)
  state = dict(nnx.to_flat_state(nnx.state(full)))
  ckpt = _Checkpoint(path)
  entries = {e.path: e for e in _entries(full.config)}
  cases = [(("layers", 0, "attn", "q_proj"), (slice(8, 40), slice(1, 3), slice(4, 12))),
           (("layers", 0, "attn", "o_proj"), (slice(2, 4), slice(3, 16), slice(0, 64))),
           (("layers", 1, "attn", "k_bias"), (slice(1, 2), slice(5, 9))),
           (("layers", 0, "mlp", "down_proj"), (slice(1, 3), slice(8, 24), slice(32, 64)))]
  for p, idx in cases:
    want = np.asarray(state[p].get_value())[idx]
    got = _ours_from_hf(ckpt, entries[p], state[p].get_value().shape, idx,
                        np.float32)
    np.testing.assert_array_equal(got, want, err_msg=str(p))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_load_into_2x4_mesh_matches_single_device(tmp_path, mesh, arch):
  path = make_hf_checkpoint(str(tmp_path / arch), arch)
  single = from_pretrained(path)
  sharded = from_pretrained(path, mesh=mesh)
  emb = sharded.embed.embedding[...]
  assert emb.sharding.spec == P("tensor", ("fsdp", "expert"))
  assert {s.data.shape for s in emb.addressable_shards} == {(32, 32)}  # V/4, D/2
  assert len(single.embed.embedding[...].devices()) == 1

  @nnx.jit
  def fwd(model, tokens, seg):
    return model(tokens, visibility=Visibility(segment_ids=seg))
  tokens, mask = sample_batch(B=2, T=8)
  a = np.asarray(fwd(single, jnp.asarray(tokens), jnp.asarray(mask)))
  with jax.set_mesh(mesh):  # also turns on the residual-stream activation constraints
    b = fwd(sharded, jnp.asarray(tokens), jnp.asarray(mask))
  assert len(b.devices()) == 8
  np.testing.assert_allclose(np.asarray(b), a, atol=1e-5, rtol=0)


def test_constrain_is_a_noop_without_mesh_and_shards_with_one(mesh):
  x = jnp.zeros((4, 3, 64))
  axes = (shd.BATCH, shd.LENGTH, shd.EMBED)
  assert shd.constrain(x, axes) is x
  with jax.set_mesh(mesh):
    y = jax.jit(lambda x: shd.constrain(x * 2, axes))(x)
  # batch takes data x fsdp x expert (size 2 here), so embed may not reuse fsdp.
  want = NamedSharding(mesh, P(("data", "fsdp", "expert"), None, None))
  assert y.sharding.is_equivalent_to(want, 3)
  assert {s.data.shape for s in y.addressable_shards} == {(2, 3, 64)}


def test_mesh_load_reads_only_each_devices_slice(tmp_path, mesh, monkeypatch):
  """Streaming claim: on a mesh no tensor is ever read whole from disk if it is sharded."""
  path = make_hf_checkpoint(str(tmp_path / "m"), "qwen3")
  reads = []
  original = _Checkpoint.read

  def spy(self, name, index):
    out = original(self, name, index)
    reads.append((name, out.size))
    return out
  monkeypatch.setattr(_Checkpoint, "read", spy)
  from_pretrained(path, mesh=mesh)
  biggest = {}
  for name, size in reads:
    biggest[name] = max(size, biggest.get(name, 0))
  assert biggest["model.embed_tokens.weight"] == 128 * 64 // 8      # [V/4, D/2] per device
  assert biggest["model.layers.0.self_attn.q_proj.weight"] == 64 * 64 // 8
  assert biggest["model.layers.0.self_attn.k_proj.weight"] == 32 * 64 // 2  # K=2: fsdp only
  assert biggest["model.norm.weight"] == 64                          # replicated
