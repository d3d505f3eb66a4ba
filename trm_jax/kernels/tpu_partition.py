"""The TPU attention kernel under a device mesh: one `shard_map` over batch and kv heads.

XLA cannot partition a Mosaic custom call: jit of `flash_attention_tpu` on a multi-chip mesh
fails to lower ("Mosaic kernels cannot be automatically partitioned. Please wrap the call in a
shard_map"), so a model that picks the kernel (`attention(impl="auto")` on TPU) could not run
on any slice larger than one chip. Attention is independent per sequence and per kv head
group, so the kernel runs unchanged on each chip's block of rows and heads:

  q, o [B, T, N, H] and k, v [B, T, K, H]  (batch, -, kv heads, -)
  segment_ids [B, T]                        (batch, -)
  evicted_at [B, K, T]                      (batch, kv heads, -)

with the batch and head mesh axes taken from the same logical-axis rules as the model's
activations (`sharding.spec_for`: batch over data x fsdp, heads over tensor, an axis that does
not divide its dimension replicated). Query heads follow their kv heads: a chip holding kv
heads [k0, k1) holds query heads [k0 * G, k1 * G), which is exactly what contiguous sharding
of N = G * K by the same axes gives. The length axis is never split (that would need ring
attention); a rule that maps it to a mesh axis is ignored here and XLA gathers T for the call.
The backward pass is the kernel's own `custom_vjp`, differentiated inside the shard_map.
Without a mesh, or on one device, this is `flash_attention_tpu` itself.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Optional

import jax
from jax.sharding import PartitionSpec

from trm_jax import sharding as shd
from trm_jax.kernels.flash_attention_tpu import TPUBlockSizes, flash_attention_tpu
from trm_jax.kernels.visibility import LayerVisibility


def kernel_specs(mesh, B: int, K: int) -> tuple[PartitionSpec, PartitionSpec, PartitionSpec]:
  """(q/k/v/o spec, segment_ids spec, evicted_at spec) of the kernel's shard_map on `mesh`."""
  spec = shd.spec_for((shd.BATCH, None, shd.KV_HEADS, None), shape=(B, 1, K, 1), mesh=mesh)
  batch, heads = spec[0], spec[2]
  return (PartitionSpec(batch, None, heads, None), PartitionSpec(batch, None),
          PartitionSpec(batch, heads, None))


def flash_attention_tpu_partitioned(q: jax.Array, k: jax.Array, v: jax.Array,
                                    vis: Optional[LayerVisibility] = None, *,
                                    scale: Optional[float] = None,
                                    block_sizes: TPUBlockSizes = TPUBlockSizes(),
                                    interpret: bool = False) -> jax.Array:
  """`flash_attention_tpu` (same arguments and result) on the mesh set by `jax.set_mesh`."""
  mesh = jax.sharding.get_abstract_mesh()
  kwargs = dict(scale=scale, block_sizes=block_sizes, interpret=interpret)
  if mesh.empty or mesh.size == 1:
    return flash_attention_tpu(q, k, v, vis, **kwargs)
  vis = vis or LayerVisibility()
  qkv_spec, seg_spec, ev_spec = kernel_specs(mesh, q.shape[0], k.shape[2])
  has_seg, has_ev = vis.segment_ids is not None, vis.evicted_at is not None

  def local(q, k, v, *side):
    side = list(side)
    seg = side.pop(0) if has_seg else None
    ev = side.pop(0) if has_ev else None
    return flash_attention_tpu(q, k, v, LayerVisibility(segment_ids=seg, evicted_at=ev),
                               **kwargs)

  side = [x for x in (vis.segment_ids, vis.evicted_at) if x is not None]
  side_specs = [s for s, present in ((seg_spec, has_seg), (ev_spec, has_ev)) if present]
  # check_vma=False: the kernel's pallas_call carries no varying-axes annotations.
  return jax.shard_map(local, mesh=mesh, in_specs=(qkv_spec,) * 3 + tuple(side_specs),
                       out_specs=qkv_spec, check_vma=False)(q, k, v, *side)


@contextlib.contextmanager
def partitioned_in_attention():
  """While active, `kernels.attention`'s TPU impls call `flash_attention_tpu_partitioned`.

  `kernels.attention` calls `flash_attention_tpu` directly, which cannot lower on a multi-chip
  mesh; `trm_jax.aot` compiles the trainer's programs inside this context so that the kernel
  path compiles the way it will once `attention` calls the partitioned entry point itself
  (then this context changes nothing).
  """
  # The module, not the `attention` function that trm_jax.kernels re-exports under its name.
  attention_module = importlib.import_module("trm_jax.kernels.attention")
  before = attention_module.flash_attention_tpu
  attention_module.flash_attention_tpu = flash_attention_tpu_partitioned
  try:
    yield
  finally:
    attention_module.flash_attention_tpu = before
