"""The Pallas attention kernels under a device mesh: one `shard_map` over rows and kv heads.

XLA cannot partition a Pallas custom call. A Mosaic (TPU) call under a multi-chip mesh fails
to lower ("Mosaic kernels cannot be automatically partitioned. Please wrap the call in a
shard_map"); a Triton (GPU) call lowers, but XLA gathers the whole batch and every head onto
each GPU and every GPU computes all of the batch's attention, silently. Attention is
independent per sequence and per kv-head group, so each kernel runs unchanged on each
device's block of rows and heads:

  q, o [B, T, N, H] and k, v [B, T, K, H]  (batch, -, kv heads, -)
  segment_ids [B, T]                        (batch, -)
  evicted_at [B, K, T]                      (batch, kv heads, -)

with the batch and head mesh axes taken from the same logical-axis rules as the model's
activations (`sharding.spec_for`: batch over data x fsdp x expert, heads over tensor, an axis
that does not divide its dimension replicated). Query heads follow their kv heads: a device
holding kv heads [k0, k1) holds query heads [k0 * G, k1 * G), which is exactly what
contiguous sharding of N = G * K by the same axes gives.

The length axis is never split (that would need ring attention): the specs below give T no
mesh axis whatever the rules say, so an input whose T is sharded is gathered by XLA for the
call (and the output comes back replicated over that axis, to be resharded by the caller's
constraints). The backward pass is each kernel's own `custom_vjp`, differentiated inside the
shard_map. Without an active mesh (`jax.set_mesh`), or on one device, the kernel is called
directly. `kernels.attention` routes both kernels through `partitioned` always, so the
trainer, `trm_jax.aot` and a notebook compile the same program; the TPU decode kernel goes
through `partitioned_decode` the same way (cache [B, K, ., .]: rows and kv heads).
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
from jax.sharding import PartitionSpec

from trm_jax import sharding as shd
from trm_jax.kernels.visibility import LayerVisibility


def kernel_specs(mesh, B: int, K: int) -> tuple[PartitionSpec, PartitionSpec, PartitionSpec]:
  """(q/k/v/o spec, segment_ids spec, evicted_at spec) of the kernel's shard_map on `mesh`."""
  spec = shd.spec_for((shd.BATCH, None, shd.KV_HEADS, None), shape=(B, 1, K, 1), mesh=mesh)
  batch, heads = spec[0], spec[2]
  return (PartitionSpec(batch, None, heads, None), PartitionSpec(batch, None),
          PartitionSpec(batch, heads, None))


def partitioned(kernel: Callable, q: jax.Array, k: jax.Array, v: jax.Array,
                vis: Optional[LayerVisibility] = None, **kwargs) -> jax.Array:
  """`kernel(q, k, v, vis, **kwargs)` (a Pallas attention kernel: `flash_attention` or
  `flash_attention_tpu`), run per device on the mesh set by `jax.set_mesh`."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return kernel(q, k, v, vis, **kwargs)
  vis = vis or LayerVisibility()
  qkv_spec, seg_spec, ev_spec = kernel_specs(mesh, q.shape[0], k.shape[2])
  has_seg, has_ev = vis.segment_ids is not None, vis.evicted_at is not None

  def local(q, k, v, *side):
    side = list(side)
    seg = side.pop(0) if has_seg else None
    ev = side.pop(0) if has_ev else None
    return kernel(q, k, v, LayerVisibility(segment_ids=seg, evicted_at=ev), **kwargs)

  side = [x for x in (vis.segment_ids, vis.evicted_at) if x is not None]
  side_specs = [s for s, present in ((seg_spec, has_seg), (ev_spec, has_ev)) if present]
  # check_vma=False: the kernels' pallas_calls carry no varying-axes annotations.
  return jax.shard_map(local, mesh=mesh, in_specs=(qkv_spec,) * 3 + tuple(side_specs),
                       out_specs=qkv_spec, check_vma=False)(q, k, v, *side)


def partitioned_decode(kernel: Callable, q: jax.Array, k: jax.Array, v: jax.Array,
                       pos: jax.Array, extent: jax.Array, **kwargs) -> jax.Array:
  """`kernel(q, k, v, pos, extent, **kwargs)` (`decode_attention` or `decode_attention_tpu`:
  q [B, N, H], the cache's k [B, K, H, C], v [B, K, C, H], pos [B, K, C], extent [B]) per
  device on the mesh, split by rows and kv heads like `partitioned`; the slot axis is never
  split."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return kernel(q, k, v, pos, extent, **kwargs)
  qkv_spec, _, _ = kernel_specs(mesh, q.shape[0], k.shape[1])
  batch, heads = qkv_spec[0], qkv_spec[2]
  cache_spec = PartitionSpec(batch, heads, None, None)
  return jax.shard_map(
      lambda *a: kernel(*a, **kwargs), mesh=mesh,
      in_specs=(PartitionSpec(batch, heads, None), cache_spec, cache_spec,
                PartitionSpec(batch, heads, None), PartitionSpec(batch)),
      out_specs=PartitionSpec(batch, heads, None), check_vma=False)(q, k, v, pos, extent)
