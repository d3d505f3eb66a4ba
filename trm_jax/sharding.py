"""Logical axis names, their mapping to a device mesh, and shardings for parameter pytrees.

Every `nnx.Param` in `trm_jax.models` carries a `logical_axes` metadata tuple (one name per
array dimension, constants below). Rules map a logical name to zero, one or several mesh axes
of the fixed four-axis mesh (`data`, `fsdp`, `expert`, `tensor`), the maxtext convention: the
model says *what* a dimension is, the config says *where* it lives.

The `expert` axis holds the MoE experts (`E` split over it; `models/expert_parallel.py` sends
each token to its experts' devices and back). Outside the MoE layers it is one more batch axis
(rows split over data x fsdp x expert) and, like fsdp, it shards the model dimension of every
weight that has no expert dimension, so no weight is whole on every device of an expert group.

Deviation from maxtext: a mesh axis that does not divide a dimension is dropped for that
dimension (the dimension is replicated over it) instead of raising, so tiny test models and
GQA models with few kv heads still load into any mesh. `spec_for` documents the exact rule.
We keep our own metadata key rather than flax's `out_sharding`, because flax 0.12 shards
`out_sharding` variables eagerly at creation and then demands a mesh for every model build.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence, Tuple, Union

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

# Logical axis names of parameters and activations.
BATCH = "batch"          # B
LENGTH = "length"        # T / S
EMBED = "embed"          # D
VOCAB = "vocab"          # V
Q_HEADS = "q_heads"      # N
KV_HEADS = "kv_heads"    # K
HEAD_DIM = "head_dim"    # H
MLP = "mlp"              # F
EXPERTS = "experts"      # E
NORM = "norm"            # RMSNorm scales (tiny: always replicated)
LORA_RANK = "lora_rank"  # r of a low-rank adapter (models/lora.py): small, replicated

# Mesh axes, outermost first (tensor innermost: its collectives are the most frequent).
DATA, FSDP, EXPERT, TENSOR = "data", "fsdp", "expert", "tensor"
MESH_AXES = (DATA, FSDP, EXPERT, TENSOR)

MeshAxes = Union[None, str, Tuple[str, ...]]
Rules = Tuple[Tuple[str, MeshAxes], ...]

# Default rules: batch over data x fsdp x expert; weights fully sharded over fsdp (and expert)
# on D and tensor-parallel over heads / mlp / vocab; MoE experts over the expert axis (an
# expert weight [E, D, F] takes `expert` for E first, so its D is split over fsdp alone).
DEFAULT_RULES: Rules = (
    (BATCH, (DATA, FSDP, EXPERT)),
    (LENGTH, None),
    (EMBED, (FSDP, EXPERT)),
    (VOCAB, TENSOR),
    (Q_HEADS, TENSOR),
    (KV_HEADS, TENSOR),
    (HEAD_DIM, None),
    (MLP, TENSOR),
    (EXPERTS, EXPERT),
    (NORM, None),
    (LORA_RANK, None),
)

LOGICAL_AXES_KEY = "logical_axes"  # nnx.Param metadata key


def make_mesh(axis_sizes: Union[Mapping[str, int], Sequence[int]],
              devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """A (data, fsdp, expert, tensor) mesh with Auto axis types, devices in topology order.

  Args:
    axis_sizes: {"fsdp": 2, "tensor": 4} (missing axes get size 1) or a sequence of sizes
      in MESH_AXES order.
    devices: defaults to the first prod(sizes) of jax.devices().
  """
  if isinstance(axis_sizes, Mapping):
    unknown = set(axis_sizes) - set(MESH_AXES)
    if unknown:
      raise ValueError(f"unknown mesh axes {sorted(unknown)}; expected a subset of {MESH_AXES}")
    shape = tuple(int(axis_sizes.get(a, 1)) for a in MESH_AXES)
  else:
    shape = tuple(int(s) for s in axis_sizes)
    if len(shape) != len(MESH_AXES):
      raise ValueError(f"mesh shape {shape} must have {len(MESH_AXES)} sizes {MESH_AXES}")
  n = math.prod(shape)
  devices = list(jax.devices()[:n] if devices is None else devices)
  if len(devices) != n:
    raise ValueError(f"mesh shape {dict(zip(MESH_AXES, shape))} needs {n} devices, "
                     f"got {len(devices)}")
  # jax.make_mesh orders the devices by the physical topology (rings on TPU). Auto axes:
  # shardings propagate through jit; Explicit (its default) would make every op's output
  # sharding part of its type, which this code base does not use.
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  try:
    return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
  except AssertionError:
    # A part of a TPU slice that is not itself a slice (mesh.rollout_devices = 1 of a 2x2
    # leaves three chips): no physical order exists, so the devices keep the order given.
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES,
                axis_types=axis_types)


def spec_for(axes: Sequence[Optional[str]], *, shape: Optional[Sequence[int]] = None,
             mesh: Optional[Mesh] = None, rules: Optional[Rules] = None) -> PartitionSpec:
  """PartitionSpec for an array whose dimensions have logical names `axes`.

  A logical name missing from the rules is an error (so a typo cannot silently replicate a
  weight). Each mesh axis is used at most once per array (first dimension wins); with `mesh`,
  axes it lacks are skipped, and with `shape` too, mesh axes are kept for a dimension only
  while their size product divides it.
  """
  rules = dict(DEFAULT_RULES if rules is None else rules)
  used = set()
  out = []
  for d, name in enumerate(axes):
    if name is None:
      out.append(None)
      continue
    if name not in rules:
      raise ValueError(f"logical axis {name!r} has no sharding rule; rules cover {sorted(rules)}")
    target = rules[name]
    target = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    kept = []
    for m in target:
      if m in used or (mesh is not None and m not in mesh.axis_names):
        continue
      if shape is not None and mesh is not None:
        size = math.prod(mesh.shape[a] for a in kept) * mesh.shape[m]
        if shape[d] % size:
          continue
      kept.append(m)
    used.update(kept)
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*out)


def constrain(x: jax.Array, axes: Sequence[Optional[str]],
              rules: Optional[Rules] = None) -> jax.Array:
  """Sharding constraint on an activation by logical axes, when a mesh is set.

  Inside `jax.set_mesh(mesh)` this pins e.g. the residual stream [B, T, D] to
  (data x fsdp x expert, -, -) at block boundaries (maxtext's practice); without a mesh it is
  a no-op, so single-device code pays nothing.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(
      x, spec_for(axes, shape=x.shape, mesh=mesh, rules=rules))


def named_sharding(mesh: Mesh, axes: Sequence[Optional[str]], shape: Sequence[int],
                   rules: Optional[Rules] = None) -> NamedSharding:
  return NamedSharding(mesh, spec_for(axes, shape=shape, mesh=mesh, rules=rules))


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def param_axes(var: nnx.Variable) -> Tuple[Optional[str], ...]:
  """The logical axes of one parameter; raises if the parameter was created without them."""
  axes = var.get_metadata().get(LOGICAL_AXES_KEY)
  if axes is None or len(axes) != np.ndim(var.get_value()):
    raise ValueError(f"parameter of shape {np.shape(var.get_value())} lacks logical axes "
                     f"(metadata {LOGICAL_AXES_KEY!r} = {axes!r})")
  return tuple(axes)


def state_shardings(state, mesh: Mesh, rules: Optional[Rules] = None):
  """NamedSharding for every Variable of an nnx state (same tree structure, leaves replaced).

  Variables without logical axes (none in trm_jax.models) are replicated.
  """
  def one(v):
    axes = v.get_metadata().get(LOGICAL_AXES_KEY)
    shape = np.shape(v.get_value())
    if axes is None:
      return NamedSharding(mesh, PartitionSpec())
    return named_sharding(mesh, param_axes(v), shape, rules)
  return jax.tree.map(one, state, is_leaf=_is_var)


def shard_model(model: nnx.Module, mesh: Mesh, rules: Optional[Rules] = None) -> nnx.Module:
  """Moves a built model's parameters onto `mesh` following their logical axes (in place)."""
  state = nnx.state(model)
  shardings = state_shardings(state, mesh, rules)
  nnx.update(model, jax.tree.map(lambda v, s: jax.device_put(v.get_value(), s), state, shardings,
                                 is_leaf=_is_var))
  return model


# --- Trainer placement: mesh from the config, batches, optimizer state --------------------


def resolve_mesh_shape(axis_sizes: Mapping[str, int], n_devices: int, *,
                       key: str = "mesh") -> dict:
  """Mesh axis sizes with at most one -1 (= the devices the other axes leave) filled in.

  Raises ValueError naming the config keys (`mesh.data`, ...) when the sizes cannot cover
  exactly `n_devices` devices.
  """
  unknown = set(axis_sizes) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"unknown axes {sorted(f'{key}.{a}' for a in unknown)}; "
                     f"expected a subset of {[f'{key}.{a}' for a in MESH_AXES]}")
  sizes = {a: int(axis_sizes.get(a, 1)) for a in MESH_AXES}
  desc = " * ".join(f"{key}.{a}={s}" for a, s in sizes.items())
  free = [a for a, s in sizes.items() if s == -1]
  bad = [a for a, s in sizes.items() if s == 0 or s < -1]
  if bad or len(free) > 1:
    raise ValueError(f"{desc}: sizes must be positive, with at most one -1 (= remaining "
                     "devices)")
  fixed = math.prod(s for s in sizes.values() if s != -1)
  for a, s in sizes.items():
    if s > 1 and n_devices % s:
      raise ValueError(f"{key}.{a}={s} does not divide the {n_devices} devices present "
                       f"({desc})")
  if free:
    if n_devices % fixed:
      raise ValueError(f"{desc}: the fixed axes use {fixed} devices, which does not divide the "
                       f"{n_devices} devices present")
    sizes[free[0]] = n_devices // fixed
  elif fixed != n_devices:
    raise ValueError(f"{desc} = {fixed} devices, but {n_devices} are present "
                     f"(jax.device_count()); make the product {n_devices} or set one axis "
                     "to -1")
  return sizes


def mesh_from_config(axis_sizes: Mapping[str, int],
                     devices: Optional[Sequence[jax.Device]] = None, *,
                     key: str = "mesh") -> Mesh:
  """The (data, fsdp, expert, tensor) mesh over all `devices` (default: every device of every
  process)."""
  devices = list(jax.devices() if devices is None else devices)
  return make_mesh(resolve_mesh_shape(axis_sizes, len(devices), key=key), devices)


def batch_sharding(mesh: Mesh, shape: Sequence[int],
                   rules: Optional[Rules] = None) -> NamedSharding:
  """Sharding of a per-example array: leading dimension by the BATCH rule, the rest replicated.

  A batch the BATCH mesh axes do not divide is replicated over them (`spec_for`'s rule).
  """
  axes = (BATCH,) + (None,) * (len(shape) - 1)
  return named_sharding(mesh, axes, shape, rules)


def batch_shards(mesh: Mesh, rules: Optional[Rules] = None) -> int:
  """How many ways a batch is split on `mesh`: the product of the BATCH rule's mesh axes.

  A batch whose size this does not divide is replicated (`batch_sharding`), every device
  then computing every row; `config.check_batch_mesh` refuses that for the trainer's batches.
  """
  target = dict(DEFAULT_RULES if rules is None else rules)[BATCH]
  target = () if target is None else (target,) if isinstance(target, str) else tuple(target)
  return math.prod(mesh.shape[a] for a in target if a in mesh.axis_names)


def put_batch(tree, mesh: Mesh, rules: Optional[Rules] = None):
  """Places a pytree of per-example arrays (host numpy or jax) by `batch_sharding`.

  Each process provides only its addressable shards (`make_array_from_callback`), so the same
  call builds global arrays in a multi-process run, given every process holds the same host
  data. Device arrays laid out differently are resharded by a jitted identity.
  """
  def one(x):
    if x is None:
      return None
    sharding = batch_sharding(mesh, x.shape, rules)
    if isinstance(x, jax.Array):
      if x.sharding == sharding:
        return x
      if x.is_fully_addressable and sharding.is_fully_addressable:
        # One process: a copy, also between disjoint device sets (a disaggregated sampler's
        # rollout moving to the learner's devices), which a jit cannot take.
        return jax.device_put(x, sharding)
      # jit, not device_put: device_put cannot target devices of other processes.
      return jax.jit(lambda a: a, out_shardings=sharding)(x)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])
  return jax.tree.map(one, tree)


def opt_state_shardings(tx: optax.GradientTransformation, params, mesh: Mesh):
  """Shardings for `tx.init(params)`: every copy of the parameter tree inside the optimizer
  state (AdamW's mu and nu) takes the parameters' shardings, every other leaf (step counts)
  is replicated over `mesh`.

  `params` holds jax.Arrays or ShapeDtypeStructs with shardings. optax finds the parameter
  copies by initialising `tx` on a placeholder tree, so a moment is recognised by where it
  sits in the state, not by its shape.
  """
  replicated = NamedSharding(mesh, PartitionSpec())
  return optax.tree_map_params(tx, lambda _, p: p.sharding, jax.eval_shape(tx.init, params),
                               params, transform_non_params=lambda _: replicated)
