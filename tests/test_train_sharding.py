"""Trainer on a device mesh: the learner update on 8 simulated CPU devices equals the 1-device
update, the mesh is built from `config.mesh` with errors naming the key, and out-of-memory
errors name the knobs to lower.

`learner_step` is also the worker of tests/test_distributed.py: one tiny model, one fixed
batch, AdamW updates, on whatever mesh it is given. AdamW's eps is 1e-3 rather than 1e-8: with
eps << |g| one step moves every weight by ~lr * sign(g), so a gradient entry at rounding level
(different reduction orders on different meshes) would flip a whole lr step.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from trm_jax import config as config_lib
from trm_jax import sharding as shd
from trm_jax import step
from trm_jax import train
from model_fixtures import make_test_model
from trm_jax.rl import optim
from trm_jax.rl.learner import LearnerBatch, LearnerConfig, make_learner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, P, R = 8, 6, 10  # sequences, prompt length, response length; T = P + R
MODEL = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=8, vocab_size=64)


def host_batch(seed: int = 0) -> LearnerBatch:
  """A fixed rollout batch (numpy): ragged responses, mixed-sign advantages, off-policy
  logp_roll."""
  rng = np.random.default_rng(seed)
  T = P + R
  tokens = rng.integers(3, MODEL["vocab_size"], (B, T)).astype(np.int32)
  lengths = rng.integers(2, R + 1, B)
  resp = (np.arange(T)[None] >= P) & (np.arange(T)[None] < P + lengths[:, None])
  segment_ids = (np.arange(T)[None] < P + lengths[:, None]).astype(np.int32)
  logp_roll = np.where(resp, -rng.uniform(0.5, 5.0, (B, T)), 0.0).astype(np.float32)
  return LearnerBatch(tokens=tokens, segment_ids=segment_ids,
                      response_mask=resp.astype(np.float32), logp_roll=logp_roll,
                      advantages=rng.normal(size=B).astype(np.float32), logp_old=logp_roll,
                      token_weights=resp.astype(np.float32))


def learner_step(mesh, steps: int = 1):
  """`steps` learner updates of the tiny model on `mesh`; returns (params, opt_state, aux, fns)."""
  model = make_test_model(seed=0, **MODEL)
  # Placed from host copies, shard by shard: the same call works when the mesh spans several
  # processes (a device_put from one local device could not reach the other processes).
  state = nnx.state(model)
  sh = shd.state_shardings(state, mesh)
  nnx.update(model, jax.tree.map(
      lambda v, s: jax.make_array_from_callback(
          v.get_value().shape, s, lambda idx, a=np.asarray(v.get_value()): a[idx]),
      state, sh, is_leaf=lambda x: isinstance(x, nnx.Variable)))
  tx = optim.make_optimizer(lr=1e-2, warmup_steps=1, total_steps=10, weight_decay=0.01, b1=0.9,
                            b2=0.99, eps=1e-3, clip_norm=1.0, min_lr_ratio=0.1)
  graphdef, params, rest, opt_state, state_sh = step.init_learner_state(model, tx, mesh)
  cfg = LearnerConfig(objective="trm_surrogate", loss_agg="seq-mean-token-mean",
                      criteria=("k3_avg",), thresholds=(("delta_k3", 1.0),),
                      num_microbatches=2, chunk=8)
  _, update = make_learner(graphdef, tx, cfg, response_start=P, state_shardings=state_sh)
  batch = shd.put_batch(host_batch(), mesh)
  aux = None
  with jax.set_mesh(mesh):  # as in the trainer: activation constraints on
    for _ in range(steps):
      params, opt_state, aux = update(params, opt_state, rest, batch)
  return params, opt_state, aux, state_sh


def _np(tree):
  return [np.asarray(step.host(x)) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def one_device():
  params, opt_state, aux, _ = learner_step(shd.make_mesh((1, 1, 1, 1)))
  return _np(params), _np(opt_state), {k: float(v) for k, v in aux.items()}


@pytest.mark.parametrize("sizes", [dict(fsdp=2, tensor=4), dict(data=8),
                                   dict(fsdp=2, expert=4)],
                         ids=["fsdp2_tensor4", "data8", "fsdp2_expert4"])
def test_learner_update_on_8_devices_equals_one_device(one_device, sizes):
  ref_params, ref_opt, ref_aux = one_device
  assert ref_aux["learner/skipped"] == 0.0 and ref_aux["learner/grad_norm"] > 0
  assert 0 < ref_aux["learner/kept_seqs"] < B  # the TRM mask is live: some kept, some not
  mesh = shd.mesh_from_config(sizes)
  params, opt_state, aux, (param_sh, opt_sh) = learner_step(mesh)
  # The new state comes back with exactly the shardings it went in with (donation, no
  # recompile), and the optimizer moments are sharded like their parameters.
  for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(param_sh)):
    assert x.sharding == s
  for x, s in zip(jax.tree.leaves(opt_state), jax.tree.leaves(opt_sh)):
    assert x.sharding == s
  specs = {s.spec for s in jax.tree.leaves(param_sh)}
  assert any(p != jax.sharding.PartitionSpec(*[None] * len(p)) for p in specs)
  for a, b in zip(_np(params), ref_params):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  for a, b in zip(_np(opt_state), ref_opt):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  for k, v in ref_aux.items():
    assert float(aux[k]) == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_batch_is_split_over_data_fsdp_and_expert():
  mesh = shd.mesh_from_config(dict(data=2, fsdp=2, expert=2))
  batch = shd.put_batch(host_batch(), mesh)
  s = batch.tokens.sharding
  assert isinstance(s, NamedSharding) and s.spec[0] == ("data", "fsdp", "expert")
  assert {sh.data.shape for sh in batch.tokens.addressable_shards} == {(B // 8, P + R)}
  assert batch.advantages.sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp",
                                                                        "expert"))


def test_mesh_from_config_fills_minus_one_and_names_bad_keys():
  c = config_lib.load_config(os.path.join(ROOT, "configs", "tiny_trm.py"))
  mesh, sampler = train.make_mesh(c)
  assert dict(mesh.shape) == {"data": 8, "fsdp": 1, "expert": 1, "tensor": 1}
  assert sampler is None
  c.mesh.fsdp, c.mesh.tensor = 2, 2
  assert dict(train.make_mesh(c)[0].shape) == {"data": 2, "fsdp": 2, "expert": 1, "tensor": 2}
  c.mesh.data = 4
  with pytest.raises(config_lib.ConfigError, match=r"mesh\.data=4 \* mesh\.fsdp=2 \* "
                     r"mesh\.expert=1 \* mesh\.tensor=2 = 16 devices, but 8 are present"):
    train.make_mesh(c)
  c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.tensor = -1, 1, 3, 1
  with pytest.raises(config_lib.ConfigError, match=r"^mesh\.expert=3 does not divide the 8 "
                     "devices present"):
    train.make_mesh(c)
  c.mesh.expert = 1
  c.mesh.data, c.mesh.fsdp = -1, 3
  with pytest.raises(config_lib.ConfigError, match=r"mesh\.fsdp=3.*does not divide the 8"):
    train.make_mesh(c)
  c.mesh.fsdp, c.mesh.tensor = -1, 2
  with pytest.raises(config_lib.ConfigError, match="at most one -1"):
    train.make_mesh(c)


def test_disaggregated_meshes_split_the_devices():
  c = config_lib.load_config(os.path.join(ROOT, "configs", "tiny_trm.py"))
  c.mesh.rollout_devices = 4
  mesh, sampler = train.make_mesh(c)
  devices = jax.devices()
  assert list(sampler.devices.flat) == devices[:4] and dict(sampler.shape)["data"] == 4
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices[4:])
  assert dict(mesh.shape) == {"data": 4, "fsdp": 1, "expert": 1, "tensor": 1}
  c.mesh.rollout_devices = 8
  with pytest.raises(config_lib.ConfigError) as e:
    train.make_mesh(c)
  assert str(e.value) == ("bad config value [mesh.rollout_devices]: 8 sampler devices leave "
                          "none of the 8 devices (jax.device_count()) to the learner")
  with pytest.raises(ValueError, match=r"mesh\.pipeline"):
    shd.mesh_from_config(dict(data=-1, pipeline=1))


def test_oom_is_reraised_with_the_knobs_to_lower():
  with pytest.raises(step.OutOfMemoryError) as e:
    with step.oom_hints("learner update"):
      raise jax.errors.JaxRuntimeError(
          "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.")
  msg = str(e.value)
  for knob in ("rl.num_microbatches", "rl.score_microbatches", "rl.chunk", "model.remat=True",
               "task.max_new_tokens"):
    assert knob in msg
  assert "learner update" in msg and "1.00GiB" in msg
  # Any other runtime error passes through untouched.
  with pytest.raises(jax.errors.JaxRuntimeError, match="INVALID_ARGUMENT"):
    with step.oom_hints("rollout"):
      raise jax.errors.JaxRuntimeError("INVALID_ARGUMENT: bad")


def test_real_allocation_failure_is_caught():
  """A genuine XLA RESOURCE_EXHAUSTED (a 2^62-byte buffer) goes through the same path."""
  with pytest.raises(step.OutOfMemoryError, match="rl.num_microbatches"):
    with step.oom_hints("rollout"):
      jax.block_until_ready(jnp.zeros((2 ** 31, 2 ** 29), jnp.float32))
