"""The decoder-only transformer behind every supported checkpoint (Qwen3, Qwen2, Llama, Qwen3-MoE).

Pre-norm blocks: h = x + attn(norm(x)); y = h + mlp(norm(h)). Attention never sees a [T, T]
mask: it is told who may see whom by a `Visibility` (causal + segment ids + per-key
`evicted_at`), which is how the learner replays the rollout's KV-cache evictions (SMD).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from trm_jax import sharding as shd
from trm_jax.kernels.visibility import LayerVisibility, Visibility
from trm_jax.models.config import ModelConfig
from trm_jax.models.layers import MLP, Attention, MoE, RMSNorm, param


class Embedding(nnx.Module):
  """Token embedding table [V, D]; also the unembedding when embeddings are tied."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embedding = param(rngs, (cfg.vocab_size, cfg.hidden_size), (shd.VOCAB, shd.EMBED),
                           cfg.weight_dtype)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] int -> [B, T, D] in the compute dtype."""
    return jnp.take(self.embedding[...], tokens, axis=0).astype(self.cfg.compute_dtype)


class Block(nnx.Module):
  """One pre-norm transformer block: `input_norm`, `attn`, `post_attn_norm`, `mlp`."""

  def __init__(self, cfg: ModelConfig, layer_idx: int, *, rngs: nnx.Rngs):
    self.input_norm = RMSNorm(cfg.hidden_size, cfg)
    self.attn = Attention(cfg, rngs=rngs)
    self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg)
    self.mlp = (MoE(cfg, layer_idx, rngs=rngs) if cfg.is_moe_layer(layer_idx)
                else MLP(cfg, rngs=rngs))

  def __call__(self, x: jax.Array, positions: jax.Array, vis: Optional[LayerVisibility], *,
               attn_impl: str = "auto", router_noise_key: Optional[jax.Array] = None,
               router_noise_scale: float = 0.0) -> jax.Array:
    """x [B, T, D] -> [B, T, D]."""
    h = x + self.attn(self.input_norm(x), positions, vis, impl=attn_impl)
    return h + self.mlp(self.post_attn_norm(h), router_noise_key, router_noise_scale)


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

  Submodules for a cached decode step (the rollout engine):
    `model.embed(tokens [B, T]) -> [B, T, D]` in the compute dtype;
    `model.layers[l]` with `.input_norm`, `.attn`, `.post_attn_norm`, `.mlp`;
    `attn.qkv(x [B, T, D], positions [B, T]) -> q [B, T, N, H], k, v [B, T, K, H]`
      (bias, q/k norm and RoPE applied);
    `attn.out(o [B, T, N, H]) -> [B, T, D]`;
    `layer.mlp(x, router_noise_key=None, router_noise_scale=0.0) -> [B, T, D]`;
    `model.final_norm(h)`; then `model.unembed(h)`.
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

  def hidden_states(self, tokens: jax.Array, *, positions: Optional[jax.Array] = None,
                    visibility: Optional[Visibility] = None, attn_impl: str = "auto",
                    router_noise_key: Optional[jax.Array] = None,
                    router_noise_scale: float = 0.0) -> jax.Array:
    """tokens [B, T] -> final-normed hidden states [B, T, D] (compute dtype)."""
    cfg = self.config
    if visibility is not None and visibility.evicted_at is not None:
      L = visibility.evicted_at.shape[1]
      if L != cfg.num_layers:
        raise ValueError(f"visibility.evicted_at has {L} layers, model has {cfg.num_layers}")
    if positions is None:
      positions = default_positions(tokens, visibility)
    residual_axes = (shd.BATCH, shd.LENGTH, shd.EMBED)
    x = shd.constrain(self.embed(tokens), residual_axes)
    for l, layer in enumerate(self.layers):
      vis = None if visibility is None else visibility.layer(l)

      def run(block, x, positions, vis, key):
        return block(x, positions, vis, attn_impl=attn_impl, router_noise_key=key,
                     router_noise_scale=router_noise_scale)
      if cfg.remat:
        run = nnx.remat(run)
      x = shd.constrain(run(layer, x, positions, vis, router_noise_key), residual_axes)
    return self.final_norm(x)

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
               router_noise_scale: float = 0.0) -> jax.Array:
    """tokens [B, T] -> logits [B, T, V] float32."""
    return self.unembed(self.hidden_states(
        tokens, positions=positions, visibility=visibility, attn_impl=attn_impl,
        router_noise_key=router_noise_key, router_noise_scale=router_noise_scale))


def make_test_model(seed: int = 0, **overrides) -> Decoder:
  """A tiny random decoder (defaults: qwen3, D=64, L=2, N=4, K=2, H=16, V=128) for tests."""
  return Decoder(ModelConfig(**overrides), rngs=nnx.Rngs(seed))
