"""The decoder-only transformer behind every supported checkpoint (Qwen3, Qwen2, Llama, Qwen3-MoE).

Pre-norm blocks: h = x + attn(norm(x)); y = h + mlp(norm(h)). Attention never sees a [T, T]
mask: it is told who may see whom by a `Visibility` (causal + segment ids + per-key
`evicted_at`), which is how the learner replays the rollout's KV-cache evictions (SMD).

The same `Block` serves the learner's forward and the sampler's cached decoding: given a
`CachePolicy` it also returns its layer's `KVCache` (built at prefill, updated per decode step),
so there is one definition of the block to keep equal to the checkpoint's.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from flax import nnx, struct

from trm_jax import sharding as shd
from trm_jax.kernels.visibility import LayerVisibility, Visibility
from trm_jax.models import lora
from trm_jax.models.config import ModelConfig
from trm_jax.models.kv_cache import CachePolicy, KVCache
from trm_jax.models.layers import MLP, Attention, MoE, RMSNorm, Route, param

Caches = Tuple[KVCache, ...]  # one per layer


class Embedding(nnx.Module):
  """Token embedding table [V, D]; also the unembedding when embeddings are tied."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embedding = param(rngs, (cfg.vocab_size, cfg.hidden_size), (shd.VOCAB, shd.EMBED),
                           cfg.weight_dtype)

  def __call__(self, tokens: jax.Array, *, inference: bool = False) -> jax.Array:
    """tokens [B, T] int -> [B, T, D] in the compute dtype.

    inference (cached decoding, never differentiated): a 16-bit table is gathered as uint16
    bits. XLA:CPU gathers bf16 from an fp32 copy of the whole table, made once per sampler
    call (about 40 ms for 32000 x 512); the bits gather needs no copy and gives the same rows
    (out-of-range ids read as NaN either way).
    """
    table = self.embedding[...]
    if inference and jnp.issubdtype(table.dtype, jnp.floating) and table.dtype.itemsize == 2:
      bits = jnp.take(jax.lax.bitcast_convert_type(table, jnp.uint16), tokens, axis=0)
      rows = jax.lax.bitcast_convert_type(bits, table.dtype)
    else:
      rows = jnp.take(table, tokens, axis=0)
    return rows.astype(self.cfg.compute_dtype)


class Block(nnx.Module):
  """One pre-norm transformer block: `input_norm`, `attn`, `post_attn_norm`, `mlp`."""

  def __init__(self, cfg: ModelConfig, layer_idx: int, *, rngs: nnx.Rngs):
    self.input_norm = RMSNorm(cfg.hidden_size, cfg)
    self.attn = Attention(cfg, layer_idx, rngs=rngs)
    self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg)
    self.mlp = (MoE(cfg, layer_idx, rngs=rngs) if cfg.is_moe_layer(layer_idx)
                else MLP(cfg, rngs=rngs))

  def __call__(self, x: jax.Array, positions: jax.Array,
               vis: Optional[LayerVisibility] = None, *, attn_impl: str = "auto",
               router_noise_key: Optional[jax.Array] = None, router_noise_scale: float = 0.0,
               cache: Optional[KVCache] = None, policy: Optional[CachePolicy] = None,
               index: Optional[jax.Array] = None, routing: Optional[jax.Array] = None,
               router_noise_ids: Optional[jax.Array] = None,
               ) -> Tuple[jax.Array, Optional[KVCache], Optional[Route]]:
    """x [B, T, D] -> (y [B, T, D], cache, Route of an MoE layer or None); `cache`,
    `policy`, `index` as in `Attention`, `routing` [B, T, k] and `router_noise_ids` [B, T] as
    in `MoE` (dense: ignored)."""
    a, cache = self.attn(self.input_norm(x), positions, vis, impl=attn_impl, cache=cache,
                         policy=policy, index=index)
    h = x + a
    # Cached decoding is never differentiated: its projections accumulate as `project` says.
    x = self.post_attn_norm(h)
    if isinstance(self.mlp, MoE):   # the router's arguments reach only a layer that routes
      y, route = self.mlp(x, router_noise_key, router_noise_scale, inference=policy is not None,
                          routing=routing, with_route=True, noise_ids=router_noise_ids)
    else:
      y, route = self.mlp(x, inference=policy is not None), None
    return h + y, cache, route


def default_positions(tokens: jax.Array, visibility: Optional[Visibility]) -> jax.Array:
  """RoPE positions [B, T]: count of valid tokens before each index (so left padding works).

  Padding slots get position max(count - 1, 0); they are invisible anyway.
  """
  B, T = tokens.shape
  if visibility is None or visibility.segment_ids is None:
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
  valid = (visibility.segment_ids != 0).astype(jnp.int32)
  return jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)


class Decoder(nnx.Module):
  """Causal LM: `Decoder(config, rngs=nnx.Rngs(0))` builds a random model.

  Forward:
    `model(tokens [B, T] int32, *, positions=None, visibility=None, attn_impl="auto",
           router_noise_key=None, router_noise_scale=0.0) -> logits [B, T, V] float32`
    `model.hidden_states(tokens, **same kwargs) -> [B, T, D]` (after the final norm), and
    `model.unembed(h [..., D]) -> logits [..., V] float32`, so callers can unembed chunk by
    chunk over T instead of materialising [B, T, V].
    positions default to `default_positions` (valid-token count; arange(T) without segment ids;
    packed sequences need explicit positions that restart per segment).
    Inside `jax.set_mesh(mesh)` the residual stream is constrained to (batch, length, embed)
    logical axes at block boundaries (`trm_jax.sharding.constrain`, default rules).
    `visibility.evicted_at` is [B, L, K, T]; layer l attends with `visibility.layer(l)`.
    router noise only affects MoE layers (see `layers.MoE`).

  Cached decoding (the rollout engine), same blocks, with a `CachePolicy` that builds and
  evicts the caches (`trm_jax.models.kv_cache`):
    `model.prefill(tokens [B, P], policy, **forward kwargs) -> (h [B, D], caches)`: the
      forward above, plus each layer's cache from its prompt q/k/v; h is the last index's;
    `model.decode_step(tokens [B, 1], caches, policy, *, positions [B, 1], index,
      router_noise_key=None, router_noise_scale=0.0, router_noise_ids=None) -> (h [B, D],
      caches)`: one token per row, at array index `index` ([] or [B] int32), attending over
      the caches; `router_noise_ids` [B, 1] name each token in the jitter's hash.
    `h` is final-normed, as `hidden_states`: `model.unembed(h)` gives the next-token logits.
  Pieces for step-by-step analyses: `model.embed(tokens) -> [B, T, D]`; `model.layers[l]` with
  `.input_norm`, `.attn` (`.qkv(x, positions) -> q [B, T, N, H], k, v [B, T, K, H]` with bias,
  q/k norm and RoPE applied; `.out(o [B, T, N, H]) -> [B, T, D]`), `.post_attn_norm`, `.mlp`;
  `model.final_norm`.
  """

  def __init__(self, config: ModelConfig, *, rngs: Optional[nnx.Rngs] = None):
    rngs = nnx.Rngs(0) if rngs is None else rngs
    self.config = config
    self.embed = Embedding(config, rngs=rngs)
    self.layers = nnx.List([Block(config, l, rngs=rngs) for l in range(config.num_layers)])
    self.final_norm = RMSNorm(config.hidden_size, config)
    if not config.tie_word_embeddings:
      self.lm_head = param(rngs, (config.hidden_size, config.vocab_size),
                           (shd.EMBED, shd.VOCAB), config.weight_dtype)
    if config.lora is not None:   # low-rank adapters over a frozen (maybe quantized) base
      lora.attach(self, rngs)

  def hidden_states(self, tokens: jax.Array, *, positions: Optional[jax.Array] = None,
                    visibility: Optional[Visibility] = None, attn_impl: str = "auto",
                    router_noise_key: Optional[jax.Array] = None,
                    router_noise_scale: float = 0.0, routing: Optional[jax.Array] = None,
                    with_routing: bool = False):
    """tokens [B, T] -> final-normed hidden states [B, T, D] (compute dtype); with
    `with_routing` also the MoE layers' `Routing`. `routing` [B, L_moe, T, k] replays
    recorded expert choices (`Rollout.routed_experts`; see `layers.MoE`)."""
    x, _, routes = self._blocks(tokens, positions, visibility, attn_impl=attn_impl,
                                router_noise_key=router_noise_key,
                                router_noise_scale=router_noise_scale, routing=routing)
    h = self.final_norm(x)
    return (h, routes) if with_routing else h

  def prefill(self, tokens: jax.Array, policy: CachePolicy, *,
              positions: Optional[jax.Array] = None, visibility: Optional[Visibility] = None,
              attn_impl: str = "auto", router_noise_key: Optional[jax.Array] = None,
              router_noise_scale: float = 0.0, router_noise_ids: Optional[jax.Array] = None,
              with_routing: bool = False):
    """tokens [B, P] -> (final-normed hidden state of the last index [B, D], L caches (or
    prompt records) built by `policy`[, Routing of the P prompt tokens]). Left-padded prompts
    all end at index P - 1, so that state samples the first new token of every row."""
    x, caches, routes = self._blocks(tokens, positions, visibility, attn_impl=attn_impl,
                                     router_noise_key=router_noise_key,
                                     router_noise_scale=router_noise_scale, policy=policy,
                                     router_noise_ids=router_noise_ids)
    out = (self.final_norm(x[:, -1]), caches)
    return (*out, routes) if with_routing else out

  def decode_step(self, tokens: jax.Array, caches: Sequence[KVCache], policy: CachePolicy, *,
                  positions: jax.Array, index: jax.Array, attn_impl: str = "auto",
                  router_noise_key: Optional[jax.Array] = None,
                  router_noise_scale: float = 0.0, router_noise_ids: Optional[jax.Array] = None,
                  with_routing: bool = False):
    """tokens [B, 1] at array index `index` ([] or [B] int32: one per row), RoPE positions
    [B, 1] -> (final-normed hidden state [B, D], updated caches[, Routing of this token]).
    attn_impl: its decode kernel, if it has one, attends over the caches (`kv_cache.attend`)."""
    if len(caches) != self.config.num_layers:
      raise ValueError(f"decode_step got {len(caches)} caches, model has "
                       f"{self.config.num_layers} layers")
    x, caches, routes = self._blocks(tokens, positions, None, attn_impl=attn_impl,
                                     router_noise_key=router_noise_key,
                                     router_noise_scale=router_noise_scale, policy=policy,
                                     caches=caches, index=index,
                                     router_noise_ids=router_noise_ids)
    # Slice, then norm (as `prefill`): XLA rounds a bf16 norm of [B, 1, D] followed by the
    # slice differently, and the sampler's outputs are kept bitwise.
    out = (self.final_norm(x[:, 0]), caches)
    return (*out, routes) if with_routing else out

  @property
  def moe_layers(self) -> Tuple[int, ...]:
    """Indices of the MoE layers (the L_moe axis of routing arrays)."""
    return tuple(l for l in range(self.config.num_layers) if self.config.is_moe_layer(l))

  def _blocks(self, tokens, positions, visibility, *, attn_impl: str = "auto",
              router_noise_key=None, router_noise_scale: float = 0.0,
              policy: Optional[CachePolicy] = None, caches: Optional[Sequence[KVCache]] = None,
              index=None, routing: Optional[jax.Array] = None,
              router_noise_ids: Optional[jax.Array] = None,
              ) -> Tuple[jax.Array, Caches, Optional[Routing]]:
    """The layer loop of every forward: embed and blocks -> (residual stream [B, T, D] before
    the final norm, caches (empty without a policy), Routing of the MoE layers or None)."""
    cfg = self.config
    if visibility is not None and visibility.evicted_at is not None:
      L = visibility.evicted_at.shape[1]
      if L != cfg.num_layers:
        raise ValueError(f"visibility.evicted_at has {L} layers, model has {cfg.num_layers}")
    moe = self.moe_layers
    if routing is not None:
      _check_routing(routing, tokens.shape, len(moe), cfg)
    if positions is None:
      positions = default_positions(tokens, visibility)
    residual_axes = (shd.BATCH, shd.LENGTH, shd.EMBED)
    x = shd.constrain(self.embed(tokens, inference=policy is not None), residual_axes)
    new_caches, routes = [], []
    for l, layer in enumerate(self.layers):
      vis = None if visibility is None else visibility.layer(l)
      forced = None if routing is None or l not in moe else routing[:, moe.index(l)]
      if policy is None:
        def run(block, x, positions, vis, key, forced):
          y, _, route = block(x, positions, vis, attn_impl=attn_impl, router_noise_key=key,
                              router_noise_scale=router_noise_scale, routing=forced)
          return y, route
        if cfg.remat:
          # jax.checkpoint of the block as a pure function of its state (not nnx.remat, which
          # writes the state it traced back into the module: a LoRA model's frozen base lives
          # outside the differentiated params, and Flax refuses that write across traces).
          graphdef, state = nnx.split(layer)
          x, route = jax.checkpoint(
              lambda state, *a: run(nnx.merge(graphdef, state), *a))(
                  state, x, positions, vis, router_noise_key, forced)
        else:
          x, route = run(layer, x, positions, vis, router_noise_key, forced)
      else:
        # Cached decoding never runs a backward pass, so remat would buy nothing.
        x, cache, route = layer(x, positions, vis, attn_impl=attn_impl,
                                router_noise_key=router_noise_key,
                                router_noise_scale=router_noise_scale, policy=policy,
                                cache=None if caches is None else caches[l], index=index,
                                router_noise_ids=router_noise_ids)
        new_caches.append(cache)
      if route is not None:
        routes.append(route)
      x = shd.constrain(x, residual_axes)
    routing_out = None if not routes else Routing(
        chosen=jnp.stack([r.chosen for r in routes], axis=1),
        own=jnp.stack([r.own for r in routes], axis=1))
    return x, tuple(new_caches), routing_out

  def unembed(self, h: jax.Array) -> jax.Array:
    """h [..., D] -> logits [..., V] float32 (fp32 accumulation)."""
    dt = self.config.compute_dtype
    if self.config.tie_word_embeddings:
      return jnp.einsum("...D,VD->...V", h.astype(dt), self.embed.embedding[...].astype(dt),
                        preferred_element_type=jnp.float32)
    return jnp.einsum("...D,DV->...V", h.astype(dt), self.lm_head[...].astype(dt),
                      preferred_element_type=jnp.float32)

  def __call__(self, tokens: jax.Array, *, positions: Optional[jax.Array] = None,
               visibility: Optional[Visibility] = None, attn_impl: str = "auto",
               router_noise_key: Optional[jax.Array] = None,
               router_noise_scale: float = 0.0,
               routing: Optional[jax.Array] = None) -> jax.Array:
    """tokens [B, T] -> logits [B, T, V] float32."""
    return self.unembed(self.hidden_states(
        tokens, positions=positions, visibility=visibility, attn_impl=attn_impl,
        router_noise_key=router_noise_key, router_noise_scale=router_noise_scale,
        routing=routing))


@struct.dataclass
class Routing:
  """The MoE layers' expert choices for every token, stacked over those layers."""
  chosen: jax.Array  # [B, L_moe, T, k] int32 experts that ran (jittered, replayed or own)
  own: jax.Array     # [B, L_moe, T, k] int32 each router's own top-k (no jitter, no replay)


def _check_routing(routing: jax.Array, token_shape, n_moe: int, cfg: ModelConfig) -> None:
  if n_moe == 0:
    raise ValueError(f"routing replay needs MoE layers; this {cfg.model_type} model has none "
                     "(routing= is for qwen3_moe models)")
  want = (token_shape[0], n_moe, token_shape[1], cfg.num_experts_per_tok)
  if tuple(routing.shape) != want:
    raise ValueError(f"routing has shape {tuple(routing.shape)}; expected [B, L_moe, T, k] = "
                     f"{want}")
  if not jnp.issubdtype(routing.dtype, jnp.integer):
    raise ValueError(f"routing must hold integer expert ids, got {routing.dtype}")


class _ShapeOnlyKeys:
  """Stands in for `nnx.Rngs` (whose `params()` stream is all a model's constructor asks for)
  when only the model's shapes are built.

  Why not nnx.Rngs under `nnx.eval_shape`: each draw updates the stream's counter, and flax
  compares the traced counter's `sharding`; for a tracer that is an AttributeError whose
  message JAX builds by walking every equation traced so far. With about seven draws per
  layer the build was quadratic in the layer count (25 / 100 / 200 layers: 1.4 / 21 / 69 s;
  now 0.5 / 1.1 / 2.8 s). The values are never computed here, so every draw is one key."""

  def params(self) -> jax.Array:
    return jax.random.key(0)


def abstract_model(model_cls, config) -> nnx.Module:
  """`model_cls(config)` with every variable a ShapeDtypeStruct: nothing is allocated and no
  initialiser runs (the checkpoint loader, the sampler's other-dtype graph and the AOT
  programs build on it)."""
  return nnx.eval_shape(lambda: model_cls(config, rngs=_ShapeOnlyKeys()))
