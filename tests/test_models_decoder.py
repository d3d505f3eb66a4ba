"""Decoder behaviour beyond HF parity: the decode-step contract, eviction replay, remat,
dtypes, the MoE dispatch and the router-jitter knob."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trm_jax.kernels import NEVER_EVICTED, Visibility, attention
from model_fixtures import make_test_model
from trm_jax.models import FAMILIES, CausalLM, Decoder, KVCache, ModelConfig
from trm_jax.models.decoder import default_positions
from trm_jax.models.layers import MoE

MOE = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=32, norm_topk_prob=True)


def _tokens(B=2, T=10, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 128, (B, T)), jnp.int32)


@nnx.jit
def _logits(model, tokens, vis):
  return model(tokens, visibility=vis)


def test_call_is_unembed_of_hidden_states_chunked():
  @nnx.jit
  def both(model, tokens):
    h = model.hidden_states(tokens)
    chunks = jnp.concatenate([model.unembed(h[:, :4]), model.unembed(h[:, 4:])], axis=1)
    return model(tokens), chunks
  full, chunks = both(make_test_model(), _tokens())
  assert full.dtype == jnp.float32 and full.shape == (2, 10, 128)
  np.testing.assert_array_equal(np.asarray(chunks), np.asarray(full))


def test_decode_submodules_compose_to_the_forward():
  """The public pieces step-by-step analyses use (embed, qkv, attention, out, mlp,
  final_norm, unembed) reproduce model(tokens)."""
  @nnx.jit
  def both(model, tokens):
    pos = default_positions(tokens, None)
    x = model.embed(tokens)
    for layer in model.layers:
      q, k, v = layer.attn.qkv(layer.input_norm(x), pos)
      assert q.shape == (2, 10, 4, 16) and k.shape == v.shape == (2, 10, 2, 16)
      h = x + layer.attn.out(attention(q, k, v, None))
      x = h + layer.mlp(layer.post_attn_norm(h))
    return model.unembed(model.final_norm(x)), model(tokens)
  pieces, full = both(make_test_model(**MOE), _tokens())
  # Same ops; only XLA's fusion choices may differ between the two traces.
  np.testing.assert_allclose(np.asarray(pieces), np.asarray(full), atol=1e-6, rtol=0)


class _StaticCache:
  """A cache policy that never evicts: slot = array index (transformers' static cache)."""

  def __init__(self, T):
    self.T = T
    self.seen = []

  def prefill(self, layer, q, k, v):
    self.seen.append(layer)
    B, P, K, H = k.shape
    pad = ((0, 0), (0, 0), (0, self.T - P), (0, 0))
    idx = jnp.arange(self.T, dtype=jnp.int32)
    kt = jnp.pad(jnp.transpose(k, (0, 2, 3, 1)), ((0, 0), (0, 0), (0, 0), (0, self.T - P)))
    return KVCache(k=kt, v=jnp.pad(jnp.swapaxes(v, 1, 2), pad),
                   pos=jnp.broadcast_to(jnp.where(idx < P, idx, -1), (B, K, self.T)),
                   score=jnp.zeros((B, K, self.T), jnp.float32))

  def free_slot(self, layer, cache, index):
    return cache, index

  def observe(self, layer, cache, probs):
    assert probs.shape == cache.pos.shape[:2] + (2, self.T)           # [B, K, G, C]
    return cache.replace(score=cache.score + probs.sum(axis=2))


@pytest.mark.parametrize("overrides", [{}, MOE])
def test_prefill_and_cached_decode_steps_equal_the_forward(overrides):
  """The same blocks, run over a 6-token prompt and then one cached token at a time, give
  the logits of the full forward at every index."""
  B, T, P = 2, 10, 6
  tokens = _tokens(B, T)

  @nnx.jit
  def run(model, tokens):
    policy = _StaticCache(T)
    h, caches = model.prefill(tokens[:, :P], policy)
    assert policy.seen == [0, 1] and len(caches) == 2 and caches[0].k.shape == (B, 2, 16, T)
    logits = [model.unembed(h)]
    for i in range(P, T - 1):
      pos = jnp.full((B, 1), i, jnp.int32)
      h, caches = model.decode_step(tokens[:, i:i + 1], caches, policy, positions=pos,
                                    index=jnp.int32(i))
      logits.append(model.unembed(h))
    return jnp.stack(logits, axis=1), model(tokens)[:, P - 1:T - 1], caches
  cached, full, caches = run(make_test_model(**overrides), tokens)
  np.testing.assert_allclose(np.asarray(cached), np.asarray(full), atol=1e-6, rtol=0)
  # Every decode step wrote its key and the policy saw the probabilities of each query.
  assert np.asarray(caches[1].pos)[0, 0].tolist() == list(range(T - 1)) + [-1]
  np.testing.assert_allclose(np.asarray(caches[0].score).sum(-1), 2.0 * (T - 1 - P), rtol=1e-5)


def test_inference_embedding_gathers_bf16_rows_as_bits():
  """Cached decoding gathers a bf16 table through its uint16 bits: the same rows, bitwise."""
  model = make_test_model(param_dtype="bfloat16", dtype="bfloat16")
  tokens = _tokens(2, 5)
  a = model.embed(tokens, inference=True)
  assert a.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                np.asarray(model.embed(tokens).astype(jnp.float32)))


def test_cached_decoding_rejects_misuse():
  model = make_test_model()
  policy = _StaticCache(4)
  _, caches = model.prefill(_tokens(1, 3), policy)
  pos = jnp.zeros((1, 2), jnp.int32)
  with pytest.raises(ValueError, match=r"one token per row at a given index; got x \(1, 2, 64\)"):
    model.decode_step(_tokens(1, 2), caches, policy, positions=pos, index=jnp.int32(3))
  with pytest.raises(ValueError, match="decode_step got 1 caches, model has 2 layers"):
    model.decode_step(_tokens(1, 1), caches[:1], policy, positions=pos[:, :1], index=3)
  with pytest.raises(ValueError, match="a cache without the policy"):
    model.layers[0].attn(jnp.zeros((1, 1, 64)), pos[:, :1], cache=caches[0])


def test_never_evicted_is_plain_causal_and_eviction_only_affects_later_queries():
  model = make_test_model()
  B, T, L, K = 2, 10, 2, 2
  tokens = _tokens(B, T)
  base = _logits(model, tokens, Visibility())
  never = jnp.full((B, L, K, T), NEVER_EVICTED, jnp.int32)
  np.testing.assert_array_equal(np.asarray(_logits(model, tokens, Visibility(evicted_at=never))),
                                np.asarray(base))
  # Layer 1, kv head 0 loses key 2 from query 6 on, in row 0 only.
  evicted = never.at[0, 1, 0, 2].set(6)
  out = np.asarray(_logits(model, tokens, Visibility(evicted_at=evicted)))
  base = np.asarray(base)
  np.testing.assert_array_equal(out[:, :6], base[:, :6])
  np.testing.assert_array_equal(out[1], base[1])
  assert np.abs(out[0, 6:] - base[0, 6:]).min() > 0


def test_evicted_at_layer_count_is_checked():
  model = make_test_model()
  bad = jnp.full((1, 3, 2, 4), NEVER_EVICTED, jnp.int32)
  with pytest.raises(ValueError, match="3 layers, model has 2"):
    model(_tokens(1, 4), visibility=Visibility(evicted_at=bad))


def test_remat_changes_nothing_but_memory():
  plain = make_test_model(num_layers=1)
  remat = make_test_model(num_layers=1, remat=True)
  tokens = _tokens()

  @nnx.jit
  def loss_and_grad(m):
    return nnx.value_and_grad(lambda m: jnp.mean(jax.nn.log_softmax(m(tokens))[..., 0]))(m)
  l0, g0 = loss_and_grad(plain)
  l1, g1 = loss_and_grad(remat)
  np.testing.assert_allclose(float(l0), float(l1), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_param_and_compute_dtypes_are_separate():
  model = make_test_model(dtype="bfloat16", param_dtype="float32")
  assert all(v.get_value().dtype == jnp.float32
             for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
  assert nnx.eval_shape(lambda m: m.embed(_tokens()), model).dtype == jnp.bfloat16
  assert nnx.eval_shape(lambda m: m(_tokens()), model).dtype == jnp.float32  # logits: fp32
  low = make_test_model(param_dtype="bfloat16")
  assert low.layers[0].attn.q_proj[...].dtype == jnp.bfloat16


def test_random_init_is_seeded_and_independent_of_tracing():
  cfg = ModelConfig(**MOE)
  a = nnx.state(Decoder(cfg, rngs=nnx.Rngs(3)))
  b = nnx.state(nnx.jit(lambda: Decoder(cfg, rngs=nnx.Rngs(3)))())
  c = nnx.state(Decoder(cfg, rngs=nnx.Rngs(4)))
  for x, y, z in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(c)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  q = ("layers", 0, "attn", "q_proj")
  fa, fc = dict(nnx.to_flat_state(a)), dict(nnx.to_flat_state(c))
  assert not np.array_equal(np.asarray(fa[q].get_value()), np.asarray(fc[q].get_value()))
  assert abs(float(np.std(np.asarray(fa[q].get_value()))) - 0.02) < 0.002


def _moe_dense_reference(moe: MoE, x):
  """Every expert on every token, combined with one-hot top-k weights."""
  B, T, D = x.shape
  xf = x.reshape(-1, D)
  w, idx, _ = moe.route(xf)
  g = jnp.einsum("MD,EDF->MEF", xf, moe.gate_proj[...])
  u = jnp.einsum("MD,EDF->MEF", xf, moe.up_proj[...])
  y = jnp.einsum("MEF,EFD->MED", jax.nn.silu(g) * u, moe.down_proj[...])
  combine = jnp.sum(jax.nn.one_hot(idx, moe.cfg.num_experts) * w[..., None], axis=1)  # [M, E]
  return jnp.einsum("ME,MED->MD", combine, y).reshape(B, T, D)


@nnx.jit
def _moe_outputs(moe, x):
  return moe(x), _moe_dense_reference(moe, x), moe.route(x.reshape(-1, x.shape[-1]))[0]


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_grouped_dispatch_equals_dense_mixture(norm_topk_prob):
  cfg = ModelConfig(**{**MOE, "norm_topk_prob": norm_topk_prob})
  moe = MoE(cfg, 0, rngs=nnx.Rngs(1))
  x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 7, 64)), jnp.float32)
  out, ref, w = _moe_outputs(moe, x)
  if norm_topk_prob:
    np.testing.assert_allclose(np.asarray(w.sum(-1)), 1.0, rtol=1e-6)
  else:
    assert float(w.sum(-1).max()) < 1.0
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-6, rtol=1e-5)


@nnx.jit
def _noisy_logits(model, tokens, key, scale):
  return model(tokens, router_noise_key=key, router_noise_scale=scale)


def test_router_noise_is_a_moe_only_seeded_knob():
  key = jax.random.key(7)
  tokens = _tokens()
  dense = make_test_model()
  np.testing.assert_array_equal(np.asarray(_noisy_logits(dense, tokens, key, 5.0)),
                                np.asarray(_logits(dense, tokens, Visibility())))
  moe = make_test_model(**MOE)
  clean = np.asarray(_logits(moe, tokens, Visibility()))
  np.testing.assert_allclose(np.asarray(_noisy_logits(moe, tokens, key, 0.0)), clean,
                             atol=1e-6, rtol=0)
  noisy = np.asarray(_noisy_logits(moe, tokens, key, 5.0))
  assert np.abs(noisy - clean).max() > 1e-3
  np.testing.assert_array_equal(np.asarray(_noisy_logits(moe, tokens, key, 5.0)), noisy)
  other = np.asarray(_noisy_logits(moe, tokens, jax.random.key(8), 5.0))
  assert np.abs(other - noisy).max() > 1e-3


def test_router_noise_is_folded_with_the_layer_index():
  """Same base key, same weights and input, different layer index -> different noise."""
  cfg = ModelConfig(**MOE)
  a, b = MoE(cfg, 0, rngs=nnx.Rngs(1)), MoE(cfg, 1, rngs=nnx.Rngs(1))
  x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 64)), jnp.float32)

  @nnx.jit
  def weights(a, b, x, key, scale):
    return a.route(x, key, scale)[0], b.route(x, key, scale)[0]
  wa, wb = weights(a, b, x, jax.random.key(3), 0.0)
  np.testing.assert_array_equal(np.asarray(wa), np.asarray(wb))
  wa, wb = weights(a, b, x, jax.random.key(3), 1.0)
  assert not np.array_equal(np.asarray(wa), np.asarray(wb))


def test_default_positions_count_valid_tokens():
  seg = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]], jnp.int32)
  pos = default_positions(jnp.zeros((2, 5), jnp.int32), Visibility(segment_ids=seg))
  np.testing.assert_array_equal(np.asarray(pos), [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2]])


def test_every_family_builds_a_model_of_the_protocol():
  """The sampler and learner's interface (models.CausalLM) holds for each FAMILIES row, and
  each row's config.json round-trips."""
  for model_type, fam in FAMILIES.items():
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if fam.moe else {}
    cfg = ModelConfig(model_type=model_type, num_layers=1, **moe)
    assert isinstance(Decoder(cfg, rngs=nnx.Rngs(0)), CausalLM)
    hf = cfg.to_hf()
    assert hf["architectures"] == [fam.architecture]
    assert ModelConfig.from_hf(hf) == cfg


@pytest.mark.parametrize("eq, x_shape, w_shape", [
    ("BTD,DF->BTF", (4, 10, 16), (16, 24)),          # SwiGLU gate / up
    ("BTF,FD->BTD", (4, 10, 24), (24, 16)),          # SwiGLU down
    ("BTD,DNH->BTNH", (4, 10, 16), (16, 4, 8)),      # q / k / v
])
def test_learner_projections_are_the_plain_einsum_bitwise(eq, x_shape, w_shape):
  """`project` merges the pass-through B, T dimensions for the learner (a layout choice for
  XLA:CPU's backward pass): the forward and both gradients are the einsum's, bit for bit."""
  from trm_jax.models.layers import project  # pylint: disable=g-import-not-at-top
  kx, kw = jax.random.split(jax.random.key(0))
  x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)

  def value_and_grads(f):
    return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), (0, 1)))(x, w)
  (v, g), (v_ref, g_ref) = (value_and_grads(lambda x, w: project(eq, x, w, jnp.float32)),
                            value_and_grads(lambda x, w: jnp.einsum(eq, x, w)))
  np.testing.assert_array_equal(np.asarray(v), np.asarray(v_ref))
  for a, b in zip(g, g_ref):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  y, y_ref = (jax.jit(lambda x, w: project(eq, x, w, jnp.float32))(x, w),
              jax.jit(lambda x, w: jnp.einsum(eq, x, w))(x, w))
  assert y.shape == y_ref.shape
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
