"""The model interface the sampler and the learner call, and nothing more.

`rollout.sampler` runs `prefill`, then `decode_step` per token, and samples from `unembed`;
`rl.learner` scores with `hidden_states` + `unembed` (chunked over T, so no [B, T, V] array is
held twice); `programs.build` reads `config` and `moe_layers`. A model is usable by the
trainer when it offers these; `models.Decoder` is the one implementation here, and what
differs between the families it covers is one row each of `models.config.FAMILIES`.

Dimension letters as everywhere: B batch, T tokens, P prompt, D model dim, V vocabulary,
L layers, L_moe MoE layers, k experts per token.
"""
from __future__ import annotations

from typing import Optional, Protocol, Sequence, Tuple, runtime_checkable

import jax

from trm_jax.kernels.visibility import Visibility
from trm_jax.models.config import ModelConfig
from trm_jax.models.kv_cache import CachePolicy, KVCache


@runtime_checkable
class CausalLM(Protocol):
  """A decoder-only language model as the sampler and the learner use it."""
  config: ModelConfig

  @property
  def moe_layers(self) -> Tuple[int, ...]:
    """Indices of the MoE layers: the L_moe axis of routing records (empty when dense)."""
    ...

  def hidden_states(self, tokens: jax.Array, *, positions: Optional[jax.Array] = None,
                    visibility: Optional[Visibility] = None, attn_impl: str = "auto",
                    routing: Optional[jax.Array] = None, with_routing: bool = False):
    """tokens [B, T] -> final-normed hidden states [B, T, D] (+ the MoE layers' routing);
    `visibility` carries segment ids and the rollout's evicted_at (the learner's replay),
    `routing` [B, L_moe, T, k] the sampler's expert choices to replay."""
    ...

  def unembed(self, h: jax.Array) -> jax.Array:
    """h [..., D] -> logits [..., V] float32."""
    ...

  def prefill(self, tokens: jax.Array, policy: CachePolicy, *,
              positions: Optional[jax.Array] = None, visibility: Optional[Visibility] = None,
              attn_impl: str = "auto", router_noise_key: Optional[jax.Array] = None,
              router_noise_scale: float = 0.0, router_noise_ids: Optional[jax.Array] = None,
              with_routing: bool = False):
    """tokens [B, P] -> (hidden state of index P - 1 [B, D], L caches or prompt records
    built by `policy`[, routing]); `router_noise_ids` [B, P] name each token in the router
    jitter's hash."""
    ...

  def decode_step(self, tokens: jax.Array, caches: Sequence[KVCache], policy: CachePolicy, *,
                  positions: jax.Array, index: jax.Array, attn_impl: str = "auto",
                  router_noise_key: Optional[jax.Array] = None,
                  router_noise_scale: float = 0.0, router_noise_ids: Optional[jax.Array] = None,
                  with_routing: bool = False):
    """tokens [B, 1] at array index `index` ([] or [B]) -> (hidden state [B, D], caches
    [, routing]); `attn_impl` as `kernels.attention` (its decode kernel, if any)."""
    ...
