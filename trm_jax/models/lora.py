"""LoRA and QLoRA: low-rank adapters on the decoder's projections over a frozen base.

With `ModelConfig.lora` (a `LoraConfig`) every projection its `targets` name computes

  y = W x + (alpha / r) * B (A x),     A [in..., r], B [r, out...]      (Hu et al. 2021, eq. 3)

in the compute dtype, the adapter stored in float32 (as PEFT keeps it). A new adapter is the
base exactly: B starts at zero, A is drawn with PEFT's variance (its kaiming-uniform with
a = sqrt(5) has variance 1 / (3 fan_in); drawn here as a normal of that variance).

Layout. An adapter is a module `<weight>_lora` beside the weight it adapts (attention's
`q_proj_lora`, an MLP's `down_proj_lora`) holding `a` and `b`, both `nnx.LoRAParam` with
logical axes: A takes the weight's input axes plus `lora_rank`, B `lora_rank` plus its output
axes, so the sharding rules (trm_jax/sharding.py) place an adapter like its weight.
`layers.linear` adds it to the projection in every forward (learner, prefill, decode). The
decoder builds the adapters from its config (`attach`, called by `Decoder.__init__`), so every
graph made from a config carries them: the sampler's graph in its own dtype, AOT's abstract
model. A loaded base gets them with `with_adapters`.

Targets (`LORA_TARGETS`): q, k, v, o on every layer's attention, dense or MoE model; gate, up,
down on dense MLPs (every layer of a dense model, the `mlp_only_layers` of a MoE one). MoE
experts and routers are not adapted: transformers stores a layer's experts as fused 3-D tensors
(`gate_up_proj` [E, 2F, D]), on which PEFT's adapters (`target_parameters`) are another
parametrisation than one adapter per expert projection, and per-expert adapters would multiply
the adapter's memory by E.

Training. `split(model)` returns (graphdef, adapters, everything else): the trainer's `params`
are the adapters, so gradients, AdamW's moments, checkpoints, staleness copies and the KL
reference hold only them, and the frozen base rides in `rest` (never differentiated, never
donated).

Frozen base storage (`LoraConfig.base_quant`, quantization by qwix: `qwix.quantize`, its
QArray layout and NF4 codebook; `dequantize` is qwix's arithmetic): "none" keeps each weight in the parameter
dtype; "int8" stores int8 codes with one absmax scale per output channel (over its inputs);
"nf4" stores 4-bit NormalFloat codes (QLoRA, Dettmers et al. 2023) with one absmax scale per
block of 64 inputs of an output channel, bitsandbytes' block, without its double quantization
of the scales. Every projection `projections` lists is quantized, adapted or not; embeddings,
the unembedding, norms, routers and MoE experts stay in the parameter dtype. A quantized
weight is a `Quantized` module whose `w[...]` dequantizes to the parameter dtype, so every
reader of `w[...]` works unchanged.

Why adapters of our own rather than `qwix.LoraProvider`: qwix creates an adapter while it
traces a forward, shaped by the einsum it intercepts there, and without logical axes. Our
cached decode contracts the output projection as one [N*H, D] matrix while the learner
contracts [N, H, D], so the two forwards would ask for adapters of different shapes; and the
adapters must exist in graphs built from the config alone (the sampler's, AOT's) and shard by
the model's rules.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Iterator, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trm_jax import sharding as shd
from trm_jax.models import layers
from trm_jax.models.config import LoraConfig

# target -> (block attribute, weight attribute, how many leading weight dims are inputs)
PROJECTIONS = {
    "q": ("attn", "q_proj", 1), "k": ("attn", "k_proj", 1), "v": ("attn", "v_proj", 1),
    "o": ("attn", "o_proj", 2),
    "gate": ("mlp", "gate_proj", 1), "up": ("mlp", "up_proj", 1), "down": ("mlp", "down_proj", 1),
}
# base_quant -> qwix's qtype. qwix itself is imported where a base is quantized: it loads
# flax.linen (~0.4 s), which a model without a quantized base never needs.
QTYPES = {"int8": jnp.int8, "nf4": "nf4"}
NF4_BLOCK = 64                              # inputs per nf4 scale (QLoRA's block size)


def projections(cfg) -> Iterator[Tuple[int, str, str, str, int]]:
  """(layer, target, block attribute, weight attribute, input dims) of every projection an
  adapter or the base's quantization reaches: attention everywhere, dense MLPs only."""
  for l in range(cfg.num_layers):
    for target, (block, name, n_in) in PROJECTIONS.items():
      if block == "mlp" and cfg.is_moe_layer(l):
        continue
      yield l, target, block, name, n_in


# ------------------------------------------------------------------------------------------
# The two modules
# ------------------------------------------------------------------------------------------
class Adapter(nnx.Module):
  """delta(x) = scale * B (A x) for a weight [*in, *out] whose first `n_in` dims are inputs:
  A [*in, r], B [r, *out] (float32 nnx.LoRAParam with logical axes)."""

  def __init__(self, shape: Sequence[int], axes: Sequence[Optional[str]], n_in: int,
               cfg: LoraConfig, *, rngs: nnx.Rngs):
    shape, r = tuple(int(s) for s in shape), cfg.rank
    self.n_in, self.scale = n_in, cfg.scale
    # PEFT's lora_A variance, 1 / (3 fan_in), through the layers' host draw (std INIT_STD).
    std = 1.0 / math.sqrt(3 * math.prod(shape[:n_in]))
    a = layers._normal(rngs.params(), (*shape[:n_in], r), np.float32) * (std / layers.INIT_STD)  # pylint: disable=protected-access
    self.a = nnx.LoRAParam(a, **{shd.LOGICAL_AXES_KEY: (*axes[:n_in], shd.LORA_RANK)})
    self.b = nnx.LoRAParam(jnp.asarray(np.zeros((r, *shape[n_in:]), np.float32)),
                           **{shd.LOGICAL_AXES_KEY: (shd.LORA_RANK, *axes[n_in:])})

  def __call__(self, x: jax.Array, dtype, *, inference: bool = False) -> jax.Array:
    """x [..., *in] -> [..., *out] in `dtype`; inference as `layers.project`."""
    # Leading dimensions named, not "...": layers.project folds them into one row dimension.
    lead, ins, outs = "ijkl"[:x.ndim - self.n_in], "abcd"[:self.n_in], "wxyz"[:self.b.ndim - 1]
    h = layers.project(f"{lead}{ins},{ins}r->{lead}r", x, self.a[...], dtype, inference=inference)
    d = layers.project(f"{lead}r,r{outs}->{lead}{outs}", h, self.b[...], dtype,
                       inference=inference)
    return d * self.scale


class QuantizedValue(nnx.Variable):
  """Codes or scales of a quantized frozen weight: not an nnx.Param, so no filter of the
  trainable state ever takes it."""


def _layout(shape: Sequence[int], n_in: int, base_quant: str) -> dict:
  """qwix's quantization layout of a weight whose first n_in dims are inputs: one scale per
  output channel (and per leading input dim), over the last input dim whole (int8) or in
  blocks of NF4_BLOCK (nf4, where the dim divides; else whole)."""
  last = n_in - 1
  block = NF4_BLOCK if base_quant == "nf4" and shape[last] % NF4_BLOCK == 0 else shape[last]
  tiled = {last: block} if block < shape[last] else {}
  return dict(channelwise_axes=tuple(i for i in range(len(shape)) if i != last),
              tiled_axes=tiled)


class Quantized(nnx.Module):
  """A frozen weight stored as qwix codes and scales; `w[...]` is the dequantized weight in
  the original dtype (the scales' dtype)."""

  def __init__(self, w: jax.Array, axes: Sequence[Optional[str]], n_in: int, base_quant: str):
    qvalue, scale = quantize(w, n_in=n_in, base_quant=base_quant)
    self.base_quant = base_quant
    self.qvalue = QuantizedValue(qvalue, **{shd.LOGICAL_AXES_KEY: tuple(axes)})
    self.scale = QuantizedValue(scale, **{shd.LOGICAL_AXES_KEY: tuple(axes)})

  def __getitem__(self, index) -> jax.Array:
    return dequantize(self.qvalue[...], self.scale[...], self.base_quant)[index]


def quantize(w: jax.Array, *, n_in: int, base_quant: str) -> Tuple[jax.Array, jax.Array]:
  """(codes, scales) of weight w (first n_in dims inputs) as `base_quant` stores it."""
  import qwix  # pylint: disable=g-import-not-at-top  (see QTYPES)
  q = qwix.quantize(w, QTYPES[base_quant], **_layout(w.shape, n_in, base_quant))
  return q.qvalue, q.scale


def dequantize(qvalue: jax.Array, scale: jax.Array, base_quant: str) -> jax.Array:
  """The weight in the scales' dtype: `qwix.dequantize`'s arithmetic (code -> level, times
  its block's scale; bitwise the same, tests/test_lora.py), with NF4's code -> level lookup a
  `take` from the 16 levels instead of qwix's vmapped gather, which XLA:TPU compiles to far
  more memory traffic (tiny_trm's rollout with an nf4 base, compiled for v5e-8: 79 GB
  accessed with qwix's lookup, 17 GB with `take`). int8 codes dequantize inside the matmul
  that reads them; an NF4 lookup does not fuse there, so each use writes the weight out in
  the compute dtype first (docs/lora.md)."""
  values = qvalue
  if base_quant == "nf4":
    values = jnp.take(jnp.asarray(NF4_LEVELS), qvalue.astype(jnp.int32))
  values = values.astype(scale.dtype)
  for axis, (n, s) in enumerate(zip(values.shape, scale.shape)):
    if n != s:                                   # a blocked axis: one scale per n // s values
      scale = jnp.repeat(scale, n // s, axis=axis)
  return values * scale


# The 16 NF4 levels (QLoRA, Dettmers et al. 2023, appendix E), code order: qwix's codebook,
# which its quantization assigns codes by (tests/test_lora.py checks they are equal). Written
# out because qwix builds it with jnp inside its functions, which cannot run eagerly under an
# AOT compile's mesh of devices that do not exist.
NF4_LEVELS = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                       -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                       0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                       0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                       0.7229568362236023, 1.0], np.float32)


# ------------------------------------------------------------------------------------------
# Building, splitting, merging
# ------------------------------------------------------------------------------------------
def check_targets(cfg) -> None:
  """Raises ValueError when a target of `cfg.lora` names no projection of the model."""
  hit = {target for _, target, *_ in projections(cfg)}
  missing = [t for t in cfg.lora.targets if t not in hit]
  if missing:
    raise ValueError(f"LoRA targets {', '.join(missing)} match no weight of this "
                     f"{cfg.model_type} model (gate, up and down adapt dense MLPs; MoE experts "
                     "are not adapted)")


def attach(model: nnx.Module, rngs: nnx.Rngs) -> None:
  """Adds `model.config.lora`'s adapters to a freshly built decoder and quantizes its base
  (in place; `Decoder.__init__` calls it after drawing the base, so the base's draws do not
  depend on the adapters)."""
  lcfg = model.config.lora
  check_targets(model.config)
  for l, target, block, name, n_in in projections(model.config):
    module = getattr(model.layers[l], block)
    w = getattr(module, name)
    axes = shd.param_axes(w)
    if target in lcfg.targets:
      setattr(module, f"{name}_lora", Adapter(w.shape, axes, n_in, lcfg, rngs=rngs))
    if lcfg.base_quant != "none":
      setattr(module, name, Quantized(w[...], axes, n_in, lcfg.base_quant))


def trainable(model: nnx.Module):
  """The filter of what the trainer trains: the adapters of a LoRA model, else every
  nnx.Param."""
  return nnx.LoRAParam if getattr(model.config, "lora", None) is not None else nnx.Param


def split(model: nnx.Module):
  """(graphdef, trainable state, the rest): `nnx.split(model, trainable(model), ...)`."""
  return nnx.split(model, trainable(model), ...)


def _placement(model: nnx.Module):
  """place(axes, shape) -> the sharding of an array with those logical axes on the model's
  mesh, or jax.devices()[0] for a model on one device (`hf_io.from_pretrained`'s two
  placements)."""
  leaf = jax.tree.leaves(nnx.state(model))[0]
  mesh = getattr(leaf.sharding, "mesh", None)
  if mesh is None:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return lambda axes, shape: device
  return lambda axes, shape: shd.named_sharding(mesh, axes, shape)


def _rebuilt(model: nnx.Module, cfg, fill, *, traced: bool = False) -> nnx.Module:
  """`type(model)(cfg)` built abstractly, each variable's value `fill(path, var, place)`
  (`place` as `_placement`'s, on the model's devices; None for a `traced` model, whose
  arrays are a jitted program's, placed by the program)."""
  from trm_jax.models.decoder import abstract_model  # pylint: disable=g-import-not-at-top  (imports lora)
  graphdef, state = nnx.split(abstract_model(type(model), cfg))
  flat = nnx.to_flat_state(state)
  place = None if traced else _placement(model)
  for path, var in flat:
    var.set_value(fill(path, var, place))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def at_path(model: nnx.Module, path: Tuple):
  """The attribute (module or variable) of `model` at an nnx state path."""
  return functools.reduce(lambda m, k: m[k] if isinstance(k, int) else getattr(m, k), path,
                          model)


def with_adapters(model: nnx.Module, lcfg: LoraConfig, *, seed: int = 0) -> nnx.Module:
  """A loaded base model (no adapters) -> the same model carrying `lcfg`'s adapters: the base
  keeps its own arrays (quantized when lcfg.base_quant says), the i-th adapter's A is drawn
  from fold_in(key(seed), i), every B is zero, and every new array is placed by its logical
  axes on the base's devices. The base's full-precision weights are freed once the caller
  drops `model`."""
  if getattr(model.config, "lora", None) is not None:
    raise ValueError("with_adapters: the model carries adapters already")
  cfg = model.config.replace(lora=lcfg)
  check_targets(cfg)
  key = jax.random.key(seed)
  adapters, inputs = {}, {}
  for i, (l, target, block, name, n_in) in enumerate(projections(cfg)):
    inputs[("layers", l, block, name)] = n_in
    if target in lcfg.targets:
      w = getattr(getattr(model.layers[l], block), name)
      adapters[("layers", l, block, f"{name}_lora")] = Adapter(
          w.shape, shd.param_axes(w), n_in, lcfg, rngs=nnx.Rngs(jax.random.fold_in(key, i)))
  quantized = {}   # weight path -> (codes, scales), placed

  def fill(path, var, place):
    if path[:-1] in adapters:                          # a or b of a new adapter: host -> mesh
      value = np.asarray(getattr(adapters[path[:-1]], path[-1]).get_value())
      return jax.make_array_from_callback(value.shape, place(shd.param_axes(var), var.shape),
                                          lambda idx: value[idx])
    if isinstance(var, QuantizedValue):                # codes or scales of a base weight
      w = path[:-1]
      if w not in quantized:
        src = at_path(model, w)
        fn = functools.partial(quantize, n_in=inputs[w], base_quant=lcfg.base_quant)
        out = jax.eval_shape(fn, src.get_value())
        axes = shd.param_axes(src)
        quantized[w] = jax.jit(fn, out_shardings=tuple(place(axes, o.shape) for o in out))(
            src.get_value())
      return quantized[w][0 if path[-1] == "qvalue" else 1]
    return at_path(model, path).get_value()                # the base's own array
  return _rebuilt(model, cfg, fill)


def merged(model: nnx.Module, *, traced: bool = False) -> nnx.Module:
  """A LoRA model as the plain model it computes: each adapted weight W + (alpha / r) A B
  (in float32, then the parameter dtype), quantized weights dequantized, every other array
  shared. What `hf_io.save_pretrained` writes for transformers, and (`traced`: the model's
  arrays are a jitted program's) what the merged sampler runs (`merged_sampler_state`)."""
  lcfg = model.config.lora
  if lcfg is None:
    return model
  dtype = model.config.weight_dtype

  def fill(path, var, place):
    src = at_path(model, path)
    adapter = getattr(at_path(model, path[:-1]), f"{path[-1]}_lora", None)
    if adapter is None and isinstance(src, nnx.Variable):
      return src.get_value()
    codes = (src.qvalue[...], src.scale[...]) if isinstance(src, Quantized) else (src[...], None)
    ab = (adapter.a[...], adapter.b[...]) if adapter is not None else (None, None)
    fn = functools.partial(merge_weight, base_quant=lcfg.base_quant, scale=lcfg.scale,
                           dtype=dtype)
    if traced:
      return fn(*codes, *ab)
    return jax.jit(fn, out_shardings=place(shd.param_axes(var), var.shape))(*codes, *ab)
  return _rebuilt(model, model.config.replace(lora=None), fill, traced=traced)


def merged_sampler_state(graphdef: nnx.GraphDef, state) -> Tuple[nnx.GraphDef, Any]:
  """Inside a jitted program: a LoRA model's (graph, state) -> the plain model's, every
  adapted weight merged (`merged`). The merged sampler (`model.lora.sampler = "merged"`)
  samples from it: one merge per rollout call, its weights a temporary of that program."""
  return nnx.split(merged(nnx.merge(graphdef, state), traced=True))


def merge_weight(w, w_scale, a, b, *, base_quant: str, scale: float, dtype) -> jax.Array:
  """W (dequantized when w_scale is given) + scale * A B, in float32, cast to dtype."""
  w = w if w_scale is None else dequantize(w, w_scale, base_quant)
  w = w.astype(jnp.float32)
  if a is not None:
    w = w + scale * jnp.tensordot(a, b, 1)       # [*in, r] x [r, *out] -> [*in, *out]
  return w.astype(dtype)
