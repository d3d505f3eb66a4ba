"""Attention visibility as O(B*T) integers instead of a materialised [T, S] mask.

Every attention call in the package (learner forward, prefill, kernels) is told *who may see
whom* by a `Visibility`, never by a boolean or additive [T, S] array. Three ingredients:

  * causality on array indices: query i can see key j only if j <= i;
  * `segment_ids` [B, T] int32: 0 marks padding; a query sees a key only inside its own
    non-zero segment (this also expresses packed sequences);
  * `evicted_at` [B, L, K, T] int32 (optional): the SMD retention record
    (docs/smd.md, "The visibility rule"). For layer l and kv head k, key j is visible to query i
    iff  j <= i < evicted_at[b, l, k, j].  `NEVER_EVICTED` marks keys that stayed in the cache.

All indices are *array* indices along T (not RoPE positions): with left padding the two
differ, and the rollout engine writes `evicted_at` in array indices so the learner can replay
it without knowing how the batch was padded.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

# Large enough to exceed any query index, small enough that `i < NEVER_EVICTED` never overflows.
NEVER_EVICTED = 2**30


@struct.dataclass
class Visibility:
  segment_ids: Optional[jax.Array] = None  # [B, T] int32, 0 = padding; None = all valid
  evicted_at: Optional[jax.Array] = None   # [B, L, K, T] int32; None = nothing evicted

  @classmethod
  def from_lengths(cls, lengths: jax.Array, T: int, *, left_pad: bool = False,
                   evicted_at: Optional[jax.Array] = None) -> "Visibility":
    """Padding visibility for sequences of `lengths` [B] inside a [B, T] array."""
    idx = jnp.arange(T)[None, :]
    lengths = jnp.asarray(lengths)[:, None]
    valid = idx >= T - lengths if left_pad else idx < lengths
    return cls(segment_ids=valid.astype(jnp.int32), evicted_at=evicted_at)

  def layer(self, l: int) -> "LayerVisibility":
    ev = None if self.evicted_at is None else self.evicted_at[:, l]
    return LayerVisibility(segment_ids=self.segment_ids, evicted_at=ev)


@struct.dataclass
class LayerVisibility:
  """What one attention layer needs: padding/segments and that layer's eviction record."""
  segment_ids: Optional[jax.Array] = None  # [B, T] int32, 0 = padding
  evicted_at: Optional[jax.Array] = None   # [B, K, T] int32


def visible_mask(vis: LayerVisibility, B: int, K: int, T: int) -> jax.Array:
  """The dense predicate, for references and tests only: bool [B, K, T(query), T(key)]."""
  i = jnp.arange(T)[:, None]
  j = jnp.arange(T)[None, :]
  m = jnp.broadcast_to((j <= i)[None, None], (B, K, T, T))
  if vis.segment_ids is not None:
    seg = vis.segment_ids
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)  # [B, T, T]
    m = m & same[:, None]
  if vis.evicted_at is not None:
    m = m & (i[None, None] < vis.evicted_at[:, :, None, :])  # [B, K, 1, S] vs i
  return m
