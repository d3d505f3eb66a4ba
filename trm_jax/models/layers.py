"""Building blocks of the decoder: RMSNorm, RoPE, GQA attention, SwiGLU MLP, sparse MoE.

Every parameter is an `nnx.Param` carrying `logical_axes` (see `trm_jax.sharding`), stored in
`config.param_dtype` and cast to `config.dtype` at use. Weight layouts are the einsum-friendly
ones (`DNH`, `NHD`, `EDF`), not torch's `[out, in]`; `hf_io.py` converts. With
`config.lora` a projection weight carries a low-rank adapter `<name>_lora` and may be stored
quantized (`lora.py`): the projections go through `linear` / `adapted`, which add the adapter
and read the weight as `w[...]`.

Numerics follow transformers where it matters for parity: RMSNorm reduces in fp32, casts the
normalised activations to the compute dtype, then multiplies by the weight; attention logits and
softmax are fp32 (`trm_jax.kernels.attention`); the MoE router softmax is fp32. Deviation: RoPE
rotates in fp32 and casts once (transformers rounds cos/sin to the compute dtype first), which
only differs below bf16 precision.

Cached decoding (a `CachePolicy` is given: prefill and decode steps, never differentiated) runs
its projections through `project(..., inference=True)`: fp32 accumulation requested explicitly,
one rounding to the compute dtype. That is the arithmetic XLA uses for a bf16 matmul anyway, but
said this way XLA:CPU keeps bf16 weights in bf16 (otherwise it converts every bf16 weight to fp32
once per call and the decode loop reads twice the bytes), and the attention output is
contracted as one [N*H] dimension so no weight is re-laid-out inside the loop. The learner's
forward (no policy) computes the same einsums with the pass-through B, T dimensions merged into
one (`_flat_rows`: bitwise the same forward and gradients, without the transposed copies
XLA:CPU makes for a weight gradient contracted over two dimensions).
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from trm_jax import rng
from trm_jax import sharding as shd
from trm_jax.kernels import attention
from trm_jax.kernels.visibility import LayerVisibility
from trm_jax.models import expert_parallel, kv_cache
from trm_jax.models.config import ModelConfig

# transformers' default `initializer_range`: random models start at the same scale as HF ones.
INIT_STD = 0.02


def _host_normal(key_data: np.ndarray, shape: Tuple[int, ...], dtype) -> np.ndarray:
  rng = np.random.default_rng(np.asarray(key_data, np.uint32).ravel().tolist())
  return (INIT_STD * rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def _normal(key: jax.Array, shape: Tuple[int, ...], dtype) -> jax.Array:
  """N(0, INIT_STD^2) drawn on the host from the key's bits.

  Why not jax.random.normal: eagerly, XLA compiles one program per parameter shape (about a
  second each on a busy CPU), which made building a 2-layer test model take ~20 s. Under a
  trace (nnx.eval_shape / jit-ed init) the same host function runs as a pure_callback, so the
  values do not depend on how the model is built.
  """
  dtype = np.dtype(dtype)
  data = jax.random.key_data(key)
  if isinstance(data, jax.core.Tracer):
    return jax.pure_callback(functools.partial(_host_normal, shape=shape, dtype=dtype),
                             jax.ShapeDtypeStruct(shape, dtype), data)
  return jnp.asarray(_host_normal(np.asarray(data), shape, dtype))


def project(eq: str, x: jax.Array, w: jax.Array, dtype, *, inference: bool = False) -> jax.Array:
  """`einsum(eq, x, w)` in the compute dtype.

  inference=True (no backward pass will run): fp32 accumulation, rounded once to `dtype`. For
  fp32 it is the same computation; for bf16 it is the arithmetic of a bf16 matmul on every
  backend, and on XLA:CPU it keeps the weight in bf16 (see the module docstring).
  """
  x, w = x.astype(dtype), w.astype(dtype)
  if not inference:
    return _flat_rows(eq, x, w)
  return jnp.einsum(eq, x, w, preferred_element_type=jnp.float32).astype(dtype)


def _flat_rows(eq: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """`einsum(eq, x, w)` with x's leading pass-through dimensions ("BT" of "BTD,DF->BTF")
  merged into one row dimension around it (a free reshape of a row-major array).

  Same products, same sums: the forward and both gradients are bitwise those of the plain
  einsum (tests/test_models_decoder.py). The difference is the backward pass on XLA:CPU: the
  weight gradient contracts x and the output's cotangent over the pass-through dimensions,
  and with two of them XLA:CPU materialises a transposed copy of the [B, T, F] activation (or
  its cotangent) first, a strided copy that cost more than the matmuls around it; contracted
  over one dimension the dot reads both operands as they are. A SwiGLU block's forward and
  backward at the main job's learner shape (64 x 78 rows, D 128, F 384) took 2.7x less CPU
  time this way on a 2-core Intel Xeon."""
  lhs, rest = eq.split(",")
  rhs, out = rest.split("->")
  n = 0
  while n < min(len(lhs), len(out)) and lhs[n] == out[n] and lhs[n] not in rhs:
    n += 1
  if n < 2:
    return jnp.einsum(eq, x, w)
  row = next(c for c in "MRSUWXYZ" if c not in eq)
  y = jnp.einsum(f"{row}{lhs[n:]},{rhs}->{row}{out[n:]}", x.reshape((-1,) + x.shape[n:]), w)
  return y.reshape(x.shape[:n] + y.shape[1:])


def adapted(module: nnx.Module, name: str, y: jax.Array, x: jax.Array, dtype, *,
            inference: bool = False) -> jax.Array:
  """y = (x projected by the module's weight `name`) plus that weight's low-rank adapter
  `<name>_lora` applied to x, when the model carries one (models/lora.py); else y."""
  adapter = getattr(module, f"{name}_lora", None)
  return y if adapter is None else y + adapter(x, dtype, inference=inference)


def linear(module: nnx.Module, name: str, eq: str, x: jax.Array, dtype, *,
           inference: bool = False) -> jax.Array:
  """`project(eq, x, w)` by the module's weight `name`, plus its adapter (`adapted`). The
  weight is read as `w[...]`, where a quantized frozen base (models/lora.py) dequantizes."""
  y = project(eq, x, getattr(module, name)[...], dtype, inference=inference)
  return adapted(module, name, y, x, dtype, inference=inference)


def param(rngs: Optional[nnx.Rngs], shape: Sequence[int], axes: Sequence[Optional[str]],
          dtype, init: str = "normal") -> nnx.Param:
  """An nnx.Param with logical axes; init is "normal" (std INIT_STD), "ones" or "zeros"."""
  shape = tuple(int(s) for s in shape)
  if len(shape) != len(axes):
    raise ValueError(f"shape {shape} and logical axes {tuple(axes)} differ in rank")
  if init == "normal":
    value = _normal(rngs.params(), shape, dtype)
  elif init in ("ones", "zeros"):
    # Built on the host and transferred: no per-shape XLA compile.
    value = jnp.asarray((np.ones if init == "ones" else np.zeros)(shape, np.dtype(dtype)))
  else:
    raise ValueError(f"unknown init {init!r}")
  return nnx.Param(value, **{shd.LOGICAL_AXES_KEY: tuple(axes)})


class RMSNorm(nnx.Module):
  """y = w * (x / sqrt(mean(x^2) + eps)); the mean is taken in fp32."""

  def __init__(self, dim: int, cfg: ModelConfig):
    self.eps = cfg.rms_norm_eps
    self.scale = param(None, (dim,), (shd.NORM,), cfg.weight_dtype, "ones")

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(x.dtype) * normed.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """[H/2] float32 inverse frequencies, with llama3 scaling when configured.

  llama3 (Llama 3.1 report; transformers `_compute_llama3_parameters`): wavelengths longer than
  original_max / low_freq_factor are stretched by `factor`, shorter than original_max /
  high_freq_factor are kept, and the band in between interpolates smoothly.
  """
  H = cfg.head_dim
  inv = (1.0 / cfg.rope_theta ** (np.arange(0, H, 2, dtype=np.float32) / H)).astype(np.float32)
  if cfg.rope_type == "default":
    return inv
  factor, lo, hi = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
  old = cfg.rope_original_max_position
  wavelen = 2 * np.pi / inv
  scaled = np.where(wavelen > old / lo, inv / factor, inv)
  smooth = (old / wavelen - lo) / (hi - lo)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotates x [B, T, n, H] by positions [B, T] (half-split convention, as transformers)."""
  freqs = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [B, T, H/2]
  cos = jnp.cos(freqs)[:, :, None, :]
  sin = jnp.sin(freqs)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
  """GQA self-attention over the sequence, or over a KV cache (see `__call__`).

  `qkv` and `out` are public so tests and analyses can rebuild the attention step by step.
  """

  def __init__(self, cfg: ModelConfig, layer_idx: int, *, rngs: nnx.Rngs):
    D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pd = cfg.weight_dtype
    self.cfg = cfg
    self.layer_idx = layer_idx  # told to the cache policy, which keeps per-layer decisions
    self.q_proj = param(rngs, (D, N, H), (shd.EMBED, shd.Q_HEADS, shd.HEAD_DIM), pd)
    self.k_proj = param(rngs, (D, K, H), (shd.EMBED, shd.KV_HEADS, shd.HEAD_DIM), pd)
    self.v_proj = param(rngs, (D, K, H), (shd.EMBED, shd.KV_HEADS, shd.HEAD_DIM), pd)
    self.o_proj = param(rngs, (N, H, D), (shd.Q_HEADS, shd.HEAD_DIM, shd.EMBED), pd)
    if cfg.qkv_bias:
      self.q_bias = param(None, (N, H), (shd.Q_HEADS, shd.HEAD_DIM), pd, "zeros")
      self.k_bias = param(None, (K, H), (shd.KV_HEADS, shd.HEAD_DIM), pd, "zeros")
      self.v_bias = param(None, (K, H), (shd.KV_HEADS, shd.HEAD_DIM), pd, "zeros")
    if cfg.o_bias:
      self.o_bias = param(None, (D,), (shd.EMBED,), pd, "zeros")
    if cfg.qk_norm:
      self.q_norm = RMSNorm(H, cfg)
      self.k_norm = RMSNorm(H, cfg)

  def qkv(self, x: jax.Array, positions: jax.Array, *, inference: bool = False):
    """x [B, T, D], positions [B, T] -> q [B, T, N, H], k/v [B, T, K, H] (normed, rotated).

    inference: see `project` (cached decoding)."""
    cfg, dt = self.cfg, self.cfg.compute_dtype
    x = x.astype(dt)
    q = linear(self, "q_proj", "BTD,DNH->BTNH", x, dt, inference=inference)
    k = linear(self, "k_proj", "BTD,DKH->BTKH", x, dt, inference=inference)
    v = linear(self, "v_proj", "BTD,DKH->BTKH", x, dt, inference=inference)
    if cfg.qkv_bias:
      q = q + self.q_bias[...].astype(dt)
      k = k + self.k_bias[...].astype(dt)
      v = v + self.v_bias[...].astype(dt)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = rope_inv_freq(cfg)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

  def out(self, o: jax.Array, *, inference: bool = False) -> jax.Array:
    """o [B, T, N, H] -> [B, T, D]. inference: see `project` (cached decoding)."""
    dt = self.cfg.compute_dtype
    if inference:
      # One contracted [N*H] dimension (reshapes of row-major arrays are free): contracting
      # (N, H) as two dimensions, XLA:CPU re-lays the [N, H, D] weight out at every step.
      B, T, N, H = o.shape
      y = project("BTE,ED->BTD", o.reshape(B, T, N * H),
                  self.o_proj[...].reshape(N * H, -1), dt, inference=True)
    else:
      y = jnp.einsum("BTNH,NHD->BTD", o.astype(dt), self.o_proj[...].astype(dt))
    y = adapted(self, "o_proj", y, o, dt, inference=inference)
    if self.cfg.o_bias:
      y = y + self.o_bias[...].astype(dt)
    return y

  def __call__(self, x: jax.Array, positions: jax.Array,
               vis: Optional[LayerVisibility] = None, *, impl: str = "auto",
               cache: Optional[kv_cache.KVCache] = None,
               policy: Optional[kv_cache.CachePolicy] = None,
               index: Optional[jax.Array] = None
               ) -> Tuple[jax.Array, Optional[kv_cache.KVCache]]:
    """x [B, T, D], positions [B, T] (RoPE) -> (y [B, T, D], cache).

    Three modes:
      policy None: attention over x with `vis` (`kernels.attention`); cache None.
      policy, no cache (prefill): the same attention over x, and the layer's cache built by
        `policy.prefill` from this layer's q/k/v.
      policy and cache (decode, T = 1): the key of array index `index` ([] or [B] int32) is
        written where `policy.free_slot` says, the query attends over the cache's slots
        (empty ones masked; `impl`'s decode kernel when the policy does not observe the
        probabilities), and `policy.observe` sees the attention probabilities. `vis` is
        ignored.
    """
    if policy is None:
      if cache is not None:
        raise ValueError("Attention got a cache without the policy that evicts it")
      q, k, v = self.qkv(x, positions)
      return self.out(attention(q, k, v, vis, impl=impl)), None
    q, k, v = self.qkv(x, positions, inference=True)
    if cache is None:
      return (self.out(attention(q, k, v, vis, impl=impl), inference=True),
              policy.prefill(self.layer_idx, q, k, v))
    if x.shape[1] != 1 or index is None:
      raise ValueError(f"cached attention decodes one token per row at a given index; got x "
                       f"{tuple(x.shape)} and index={index}")
    with jax.named_scope("cache_write"):
      cache, slot = policy.free_slot(self.layer_idx, cache, index)
      cache = kv_cache.write(cache, slot, k[:, 0], v[:, 0], index)
    with jax.named_scope("attend"):
      o, probs = kv_cache.attend(q[:, 0], cache, impl=impl,        # probs [B, K, G, C]
                                 probs=getattr(policy, "observes_attention", True))
    return self.out(o[:, None], inference=True), policy.observe(self.layer_idx, cache, probs)


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, F, pd = cfg.hidden_size, cfg.intermediate_size, cfg.weight_dtype
    self.cfg = cfg
    self.gate_proj = param(rngs, (D, F), (shd.EMBED, shd.MLP), pd)
    self.up_proj = param(rngs, (D, F), (shd.EMBED, shd.MLP), pd)
    self.down_proj = param(rngs, (F, D), (shd.MLP, shd.EMBED), pd)

  def __call__(self, x: jax.Array, *, inference: bool = False) -> jax.Array:
    """x [B, T, D] -> [B, T, D]. inference: see `project` (cached decoding)."""
    dt = self.cfg.compute_dtype
    x = x.astype(dt)
    g = linear(self, "gate_proj", "BTD,DF->BTF", x, dt, inference=inference)
    u = linear(self, "up_proj", "BTD,DF->BTF", x, dt, inference=inference)
    return linear(self, "down_proj", "BTF,FD->BTD", jax.nn.silu(g) * u, dt,
                  inference=inference)


class MoE(nnx.Module):
  """Qwen3-MoE sparse block: fp32 softmax router over E experts, top-k, SwiGLU experts.

  Dispatch sorts the B*T*k (token, expert) pairs by expert and runs three grouped matmuls
  (`jax.lax.ragged_dot`), so compute is k/E of running every expert on every token. Under a
  mesh with an `expert` axis of n > 1 devices each device holds E / n experts and the pairs
  travel to their experts' devices and back (`expert_parallel.moe`); the routing below is
  decided first, the same under any mesh.

  Router jitter (the "MoE router mismatch" knob): with `router_noise_key`, the top-k choice is
  made on router logits plus `router_noise_scale * N(0, 1)`; the key is folded with this
  block's layer index, so the same base key gives independent noise per layer whoever calls
  the block (learner forward or the rollout engine's decode step), and each (token, expert)
  draw is a hash of the token's id (`trm_jax.rng`: the sampler's ids are (row, array index)). The jitter decides *which*
  experts run (the routing flip of the TRM paper, App. A.2); the gates are always the router's
  own probabilities of the experts that run, as under routing replay.

  Routing replay (`forced` [M, k] expert ids, entries < 0 = not recorded): the recorded experts
  run instead of the router's top-k, gated by the router's own probabilities of them
  (softmax over all E, gathered, then normalised as `norm_topk_prob` says), so the router
  still gets gradients (verl's "R3"). With `forced` equal to the router's own choice the
  output is bitwise the plain forward's.
  """

  def __init__(self, cfg: ModelConfig, layer_idx: int, *, rngs: nnx.Rngs):
    D, E, F, pd = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.weight_dtype
    self.cfg = cfg
    self.layer_idx = layer_idx
    self.router = param(rngs, (D, E), (shd.EMBED, shd.EXPERTS), pd)
    self.gate_proj = param(rngs, (E, D, F), (shd.EXPERTS, shd.EMBED, shd.MLP), pd)
    self.up_proj = param(rngs, (E, D, F), (shd.EXPERTS, shd.EMBED, shd.MLP), pd)
    self.down_proj = param(rngs, (E, F, D), (shd.EXPERTS, shd.MLP, shd.EMBED), pd)

  def route(self, x: jax.Array, router_noise_key: Optional[jax.Array] = None,
            router_noise_scale: float = 0.0, forced: Optional[jax.Array] = None,
            noise_ids: Optional[jax.Array] = None):
    """x [M, D] -> (gates [M, k] fp32, experts run [M, k] int32, router's own top-k [M, k]).

    noise_ids [M]: each token's id in the jitter's hash (default 0..M-1): the sampler passes
    (row, array index), so a token's jitter does not depend on the batch computing it."""
    cfg, dt = self.cfg, self.cfg.compute_dtype
    k = cfg.num_experts_per_tok
    logits = jnp.einsum("MD,DE->ME", x, self.router[...].astype(dt)).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)                             # [M, E]
    weights, own = jax.lax.top_k(probs, k)                              # [M, k]
    experts = own
    if router_noise_key is not None:
      s = rng.seed(jax.random.fold_in(router_noise_key, self.layer_idx))
      M, E = logits.shape
      ids = jnp.arange(M, dtype=jnp.uint32) if noise_ids is None else noise_ids.reshape(M)
      noisy = logits + router_noise_scale * rng.normal(s, ids[:, None],
                                                      jax.lax.iota(jnp.uint32, E)[None])
      experts = jax.lax.top_k(noisy, k)[1]
    if forced is not None:
      experts = jnp.where(forced >= 0, forced.astype(jnp.int32), experts)
    if experts is not own:
      weights = jnp.take_along_axis(probs, experts, axis=-1)           # the experts that run
    if cfg.norm_topk_prob:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)    # sum > 0: softmax
    return weights, experts, own

  def __call__(self, x: jax.Array, router_noise_key: Optional[jax.Array] = None,
               router_noise_scale: float = 0.0, *, inference: bool = False,
               routing: Optional[jax.Array] = None, with_route: bool = False,
               noise_ids: Optional[jax.Array] = None):
    """x [B, T, D] -> y [B, T, D], or (y, Route) with `with_route`. inference: see
    `project` (cached decoding); routing [B, T, k]: expert ids to replay (< 0 = the router's
    own choice); noise_ids [B, T]: see `route`."""
    cfg, dt = self.cfg, self.cfg.compute_dtype
    B, T, D = x.shape
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    xf = x.astype(dt).reshape(B * T, D)                                  # [M, D]
    forced = None if routing is None else routing.reshape(B * T, k)
    weights, experts, own = self.route(xf, router_noise_key, router_noise_scale, forced,
                                       None if noise_ids is None else noise_ids.reshape(-1))
    ffn = functools.partial(self.ffn, inference=inference)
    experts_w = (self.gate_proj, self.up_proj, self.down_proj)
    mesh = expert_parallel.expert_mesh()
    if mesh is not None:   # experts split over mesh.expert: pairs travel to their experts
      y = expert_parallel.moe(mesh, xf, experts, weights, [p[...] for p in experts_w],
                              [shd.param_axes(p) for p in experts_w], ffn=ffn,
                              combine=self.combine, chunk=cfg.moe_chunk)
    else:
      flat = experts.reshape(-1)                                         # [M*k]
      order = jnp.argsort(flat, stable=True)                             # sorted by expert
      sizes = jnp.bincount(flat, length=E).astype(jnp.int32)             # [E]
      ys = ffn(xf[order // k], sizes, *(p[...] for p in experts_w))      # [M*k, D]
      y = self.combine(ys[jnp.argsort(order)].reshape(B * T, k, D), weights)
    y = y.reshape(B, T, D)
    if not with_route:
      return y
    return y, Route(chosen=experts.reshape(B, T, k), own=own.reshape(B, T, k))

  def ffn(self, xs: jax.Array, sizes: jax.Array, gate: jax.Array, up: jax.Array,
          down: jax.Array, *, inference: bool = False, matmul=None) -> jax.Array:
    """The experts' SwiGLU on rows grouped by expert: xs [R, D], sizes [G] rows per expert,
    the G experts' weights -> [R, D] (rows past sum(sizes): 0 from ragged_dot, unwritten by
    a kernel; never read). inference: see `project`. matmul: a grouped matmul (a, w, sizes,
    out dtype) -> [R, N] to run instead of `jax.lax.ragged_dot`
    (`expert_parallel.grouped_matmul`)."""
    dt = self.cfg.compute_dtype

    def grouped(a, w):
      if matmul is not None:
        return matmul(a, w.astype(dt), sizes, jnp.float32 if inference else dt).astype(dt)
      if not inference:
        return jax.lax.ragged_dot(a, w.astype(dt), sizes)
      return jax.lax.ragged_dot(a, w.astype(dt), sizes,
                                preferred_element_type=jnp.float32).astype(dt)
    g = grouped(xs, gate)                                                # [R, F]
    u = grouped(xs, up)
    return grouped(jax.nn.silu(g) * u, down)

  def combine(self, y: jax.Array, weights: jax.Array) -> jax.Array:
    """Each token's k expert outputs y [M, k, D] weighted by its gates [M, k], summed in
    fp32 -> [M, D] in the compute dtype."""
    dt = self.cfg.compute_dtype
    # transformers rounds the routing weights to the compute dtype before scaling.
    w = weights.astype(dt).astype(jnp.float32)[..., None]
    return jnp.sum(y.astype(jnp.float32) * w, axis=1).astype(dt)


@struct.dataclass
class Route:
  """What one MoE layer decided for every token."""
  chosen: jax.Array  # [B, T, k] int32 experts that ran (jittered, replayed or the router's)
  own: jax.Array     # [B, T, k] int32 the router's own top-k (no jitter, no replay)
