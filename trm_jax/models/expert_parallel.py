"""Expert parallelism: every (token, expert) pair of an MoE layer is sent to the device that
holds its expert, computed there, and sent back, inside one `shard_map` over the mesh.

Layout (dimension letters of docs/architecture.md; n = mesh.expert, E_loc = E / n, k the
experts per token):

  tokens   x [M, D] (M = B * T) split over every batch axis (data x fsdp x expert), padded to
           a multiple of their product with tokens that go nowhere: m tokens per device;
  routing  gates [M, k], experts [M, k], decided before the layer (router, jitter, replay:
           `layers.MoE.route`) and split like the tokens;
  experts  gate/up [E, D, F] and down [E, F, D] split over `expert` on E (device i of an
           expert group holds experts [i * E_loc, (i + 1) * E_loc)) and over `tensor` on F
           when it divides F; D whole (the fsdp shards are gathered on entry, as for any
           FSDP matmul).

Per device and layer:
  (1) its m * k pairs sorted by expert, hence by destination device, then local expert;
  (2) its per-expert counts [E] all-gathered over `expert` into the group's count matrix
      [n, E], from which every device derives the same offsets: sizes[s, j] pairs go from
      device s to device j;
  (3) dispatch: a ragged all-to-all into a receive buffer of n * m * k rows, each source's
      chunk ordered by local expert;
  (4) the received rows regrouped by local expert (a counting sort, no `argsort`), the
      grouped SwiGLU (`ffn`: three grouped matmuls over E_loc groups, `grouped_matmul`),
      partial sums over F added over `tensor` when F is split, rows put back;
  (5) return: the reverse ragged all-to-all lands every result where its pair left;
  (6) pairs back in token order, weighted by their gates and summed (`combine`).

No pair is dropped, whatever the routing: a device's receive buffer holds n * m * k rows, every
pair the n devices of its expert group hold, so it cannot overflow. The price is memory: the
buffer is n times the pairs a device sends (what MaxText's ragged dispatch allocates too). A
device with more than `chunk` (model.moe_chunk) tokens sends them chunk by chunk, one exchange
each (a `lax.map`), so the buffers never exceed n * chunk * k rows.

Transport: `jax.lax.ragged_all_to_all` on TPU and GPU. XLA:CPU cannot run it (jax 0.10.2:
"HLO opcode `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter"), so on CPU the same
contract runs as a dense `all_to_all` of a padded [n, m * k, D] layout
(`ragged_all_to_all_padded`), with the offsets computed by the same code; the simulated-device
tests check that path. The platform is the mesh's devices', so an ahead-of-time compile for a
TPU slice on a CPU host takes the TPU path.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from trm_jax import sharding as shd

# Inside the MoE shard_map an expert weight keeps its experts on `expert` and its MLP dimension
# on `tensor`; every other dimension is whole.
_EXPERT_RULES = tuple((name, {shd.EXPERTS: shd.EXPERT, shd.MLP: shd.TENSOR}.get(name))
                      for name, _ in shd.DEFAULT_RULES)


def expert_mesh():
  """The active mesh (`jax.set_mesh`) when it has an expert axis of more than one device,
  else None (the MoE layer then computes every expert where its tokens are)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or shd.EXPERT not in mesh.axis_names or mesh.shape[shd.EXPERT] == 1:
    return None
  return mesh


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
  return jnp.cumsum(x, axis=axis) - x


def ragged_all_to_all_padded(operand, output, input_offsets, send_sizes, output_offsets,
                             recv_sizes, *, axis_name: str, capacity: int):
  """`jax.lax.ragged_all_to_all`'s contract (its docstring) as one dense `all_to_all`: each
  chunk is padded to `capacity` rows, which must bound every send size."""
  rows = jnp.arange(capacity, dtype=jnp.int32)
  take = jnp.clip(input_offsets[:, None] + rows, 0, operand.shape[0] - 1)      # [n, C]
  sent = (rows < send_sizes[:, None]).reshape(take.shape + (1,) * (operand.ndim - 1))
  packed = jnp.where(sent, operand[take], 0)                                    # [n, C, D]
  got = jax.lax.all_to_all(packed, axis_name, 0, 0, tiled=True)      # [n, C, D] by source
  # Where each source's rows go here: its output_offsets entry for this device.
  at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)           # [n]
  put = jnp.where(rows < recv_sizes[:, None], at[:, None] + rows, output.shape[0])
  return output.at[put.reshape(-1)].set(got.reshape(-1, *got.shape[2:]), mode="drop")


# Megablox tiles (rows, contracted, output dimension): rows are padded to a multiple of the
# first; the others are capped at their dimension (a block as large as the dimension is legal).
GMM_TILING = (512, 1024, 1024)


def grouped_matmul(platform: Optional[str], interpret: bool = False) -> Optional[Callable]:
  """The grouped matmul (a [R, K], w [G, K, N], sizes [G], out dtype) -> [R, N] for
  `platform`: on TPU the Pallas megablox `gmm` (its backward a `tgmm` over each group's own
  rows), which compiles smaller than `jax.lax.ragged_dot` there, whose weight gradient XLA:TPU
  computes over every group's rows (bench/moe_gmm_aot.py); None elsewhere (`ragged_dot`).
  Rows past the groups are left unwritten (`ragged_dot` writes 0): the layer never reads
  them. interpret: run the kernel in the Pallas interpreter (tests on CPU)."""
  if platform != "tpu" and not interpret:
    return None
  from jax.experimental.pallas.ops.tpu.megablox import gmm  # pylint: disable=g-import-not-at-top

  def matmul(a, w, sizes, dtype):
    R, K = a.shape
    tm, tk, tn = GMM_TILING
    pad = -R % tm
    out = gmm(jnp.pad(a, ((0, pad), (0, 0))), w, sizes, dtype,
              (tm, min(tk, K), min(tn, w.shape[2])), interpret=interpret)
    return out[:R]
  return matmul


def _platform(mesh) -> Optional[str]:
  return None if mesh.abstract_device is None else mesh.abstract_device.platform


def _transport(platform: Optional[str]):
  if platform in ("tpu", "gpu", "cuda", "rocm"):
    return lambda *a, capacity: jax.lax.ragged_all_to_all(*a, axis_name=shd.EXPERT)
  return functools.partial(ragged_all_to_all_padded, axis_name=shd.EXPERT)


def _axes(entry) -> tuple:
  """The mesh axes of one PartitionSpec entry."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _gather(w: jax.Array, gathers) -> jax.Array:
  """w with each dimension d gathered over its mesh axes in `gathers` ((d, axes), ...)."""
  for d, axes in gathers:
    if axes:
      w = jax.lax.all_gather(w, axes, axis=d, tiled=True)
  return w


def _local_layout(mine: jax.Array, cap: int) -> tuple[jax.Array, jax.Array]:
  """Where each received row goes when the rows are regrouped by local expert.

  mine [n, E_loc]: rows received from each source for each local expert, the buffer holding
  source 0's rows (local expert 0 first), then source 1's, ... Returns (dest [cap]: each
  row's index in the expert-grouped layout, cap for the unused rows; group sizes [E_loc]).
  """
  n, E_loc = mine.shape
  flat = mine.reshape(-1)                                    # segments (source, expert)
  ends = jnp.cumsum(flat)
  # The segment of row r is the number of segments ending at or before r.
  seg = jnp.cumsum(jnp.zeros(cap + 1, jnp.int32).at[ends].add(1))[:cap]
  group = mine.sum(0)                                        # [E_loc]
  # Row r of segment (s, e) goes to group_start[e] + rows of e from sources before s +
  # (r - the segment's start).
  base = (_exclusive_cumsum(group)[None, :] + _exclusive_cumsum(mine, 0)).reshape(-1) - (
      ends - flat)
  r = jnp.arange(cap, dtype=jnp.int32)
  dest = jnp.where(r < ends[-1], r + base[jnp.minimum(seg, n * E_loc - 1)], cap)
  return dest, group


def moe(mesh, x: jax.Array, experts: jax.Array, gates: jax.Array,
        params: Sequence[jax.Array], param_axes: Sequence[Sequence[Optional[str]]], *,
        ffn: Callable, combine: Callable, chunk: int) -> jax.Array:
  """An MoE layer's expert computation with its experts split over `mesh`'s expert axis.

  x [M, D] (compute dtype), experts [M, k] int32 (each in [0, E)), gates [M, k] fp32;
  chunk: tokens per device per exchange (a device with more sends them chunk by chunk, so
  its buffers hold n * chunk * k rows at most);
  params the expert weights, E first (gate, up, down), with their logical axes;
  ffn(rows [R, D], group_sizes [G], *weights of G experts, matmul=`grouped_matmul`'s) ->
  [R, D] (rows past the groups are never read); combine(pairs [m, k, D], gates [m, k]) ->
  [m, D]. Returns [M, D], equal to running `ffn` on every pair where its token is (the
  module docstring says how).
  """
  M, D = x.shape
  k = experts.shape[1]
  n = mesh.shape[shd.EXPERT]
  E = params[0].shape[0]
  if E % n:
    raise ValueError(f"{E} experts do not split over mesh.expert={n}")
  rule = dict(shd.DEFAULT_RULES)[shd.BATCH]
  batch_axes = tuple(a for a in rule if a in mesh.axis_names)
  shards = math.prod(mesh.shape[a] for a in batch_axes)
  pad = -M % shards
  if pad:   # tokens that choose no expert (id E is dropped by the counts): nothing is sent
    x = jnp.pad(x, ((0, pad), (0, 0)))
    experts = jnp.pad(experts, ((0, pad), (0, 0)), constant_values=E)
    gates = jnp.pad(gates, ((0, pad), (0, 0)))
  token_spec = PartitionSpec(batch_axes, None)
  # Each weight enters as it is stored (E over expert, D over fsdp, F over tensor) and is
  # gathered inside over every axis but expert and tensor: the gather's transpose is then a
  # reduce-scatter of the weight's gradient, as FSDP does, not an all-reduce of it.
  param_specs = [shd.spec_for(a, shape=p.shape, mesh=mesh) for p, a in zip(params, param_axes)]
  kept = [shd.spec_for(a, shape=p.shape, mesh=mesh, rules=_EXPERT_RULES)
          for p, a in zip(params, param_axes)]
  gathers = [[(d, tuple(a for a in _axes(s) if a not in _axes(k))) for d, (s, k) in
              enumerate(zip(stored, keep))] for stored, keep in zip(param_specs, kept)]
  f_split = any(shd.TENSOR in _axes(e) for k in kept for e in k)   # (size 1: a no-op)
  exchange = _transport(_platform(mesh))
  matmul = grouped_matmul(_platform(mesh))

  def local(x, experts, gates, *weights):
    weights = [_gather(w, g) for w, g in zip(weights, gathers)]
    m = x.shape[0]
    if m <= chunk:
      return exchange_and_compute(x, experts, gates, *weights)
    pad = -m % chunk   # tokens that choose no expert, as above
    x = jnp.pad(x, ((0, pad), (0, 0))).reshape(-1, chunk, D)
    experts = jnp.pad(experts, ((0, pad), (0, 0)), constant_values=E).reshape(-1, chunk, k)
    gates = jnp.pad(gates, ((0, pad), (0, 0))).reshape(-1, chunk, k)
    out = jax.lax.map(lambda a: exchange_and_compute(*a, *weights), (x, experts, gates))
    return out.reshape(-1, D)[:m]

  def exchange_and_compute(x, experts, gates, *weights):
    m = x.shape[0]
    E_loc = weights[0].shape[0]
    me = jax.lax.axis_index(shd.EXPERT)
    flat = experts.reshape(-1)                                          # [m*k]
    order = jnp.argsort(flat, stable=True)                              # by expert
    xs = x[order // k]                                                  # [m*k, D]
    counts = jax.lax.all_gather(jnp.bincount(flat, length=E).astype(jnp.int32),
                                shd.EXPERT)                             # [n, E] (source, e)
    per = counts.reshape(n, n, E_loc)                                   # [source, dest, e]
    sizes = per.sum(-1)                                                 # [source, dest]
    send_at = _exclusive_cumsum(sizes, 1)   # a chunk's offset in its source's sorted pairs
    recv_at = _exclusive_cumsum(sizes, 0)   # its offset in its destination's receive buffer
    cap = n * m * k
    # (3) dispatch: this device's chunk for device j goes to j's buffer at recv_at[me, j].
    got = exchange(xs, jnp.zeros_like(xs, shape=(cap, D)), send_at[me], sizes[me],
                   recv_at[me], sizes[:, me], capacity=m * k)
    # (4) the local experts on their rows, grouped by expert.
    dest, group = _local_layout(per[:, me], cap)
    grouped = jnp.zeros_like(got).at[dest].set(got, mode="drop")
    y = ffn(grouped, group, *weights, matmul=matmul)
    if f_split:
      y = jax.lax.psum(y, shd.TENSOR)
    y = y[jnp.minimum(dest, cap - 1)]           # unused rows read garbage and are not sent
    # (5) return: the chunk from device s goes back to s's sorted pairs at send_at[s, me].
    back = exchange(y, jnp.zeros_like(y, shape=(m * k, D)), recv_at[:, me], sizes[:, me],
                    send_at[:, me], sizes[me], capacity=m * k)
    pairs = jnp.zeros_like(back).at[order].set(back, unique_indices=True)   # token order
    return combine(pairs.reshape(m, k, D), gates)

  # check_vma=False: the megablox kernel's pallas_call carries no varying-axes annotations
  # (as the attention kernels', kernels/partition.py). The transpose then sums each weight's
  # gradient over the axes its spec leaves out (data, fsdp) itself.
  out = jax.shard_map(local, mesh=mesh,
                      in_specs=(token_spec, token_spec, token_spec, *param_specs),
                      out_specs=token_spec, check_vma=False)(x, experts, gates, *params)
  return out[:M]
