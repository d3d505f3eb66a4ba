"""`ModelConfig`: one frozen description of every decoder this package runs.

Built from a Hugging Face `config.json` dict (`ModelConfig.from_hf`) and written back
(`ModelConfig.to_hf`). One implementation covers four `model_type`s; what differs between them
is one `Family` row each in `FAMILIES`, resolved here into flags, so the model code never
branches on `model_type` (a new family of the same shape is one row):

  qwen3      q/k RMSNorm on the head dim; q/k/v/o bias iff `attention_bias`.
  qwen2      q/k/v bias always (checkpoints in the wild say `attention_bias: null` and still
             carry the biases, so the flag is ignored); no o bias; no q/k norm.
  llama      q/k/v/o bias iff `attention_bias`; optional `llama3` RoPE frequency scaling.
  qwen3_moe  qwen3 attention + sparse MoE MLP (softmax router, top-k, `norm_topk_prob`) on
             layers selected by `decoder_sparse_step` / `mlp_only_layers`.

RoPE parameters are accepted both as top-level `rope_theta` / `rope_scaling` (transformers 4)
and as `rope_parameters` (transformers 5). Anything we do not implement (sliding window,
non-SiLU activations, MLP bias, other RoPE types) raises instead of being silently ignored.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Tuple, Union

import jax.numpy as jnp



@dataclasses.dataclass(frozen=True)
class Family:
  """What a Hugging Face `model_type` fixes about the shared decoder."""
  architecture: str            # config.json "architectures" entry
  qk_norm: bool                # RMSNorm on q and k over the head dim
  fixed_bias: bool = False     # q/k/v bias always, o bias never, whatever attention_bias
                               #   says (qwen2); else one attention_bias for q/k/v/o
  moe: bool = False            # sparse MoE MLP layers (config.json num_experts, ...)
  writes_mlp_bias: bool = False  # to_hf writes mlp_bias=false (llama's key)


FAMILIES = {
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True),
    "qwen2": Family("Qwen2ForCausalLM", qk_norm=False, fixed_bias=True),
    "llama": Family("LlamaForCausalLM", qk_norm=False, writes_mlp_bias=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", qk_norm=True, moe=True),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)   # the shipped families (checks read FAMILIES)
# Compute / parameter dtypes by name: the one name -> dtype map (the trainer's settings
# model.dtype and rollout.dtype take the subset trm_jax.config.DTYPES of these names).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
TokenIds = Union[None, int, Tuple[int, ...]]
# config.json sizes past these are refused before any model is built, naming the key: a typo
# such as 100000 layers would otherwise build for hours and then exhaust memory. Each is far
# above every released checkpoint (at most 126 layers, width 16384, MLP width 53248,
# vocabulary 262144, 128 heads, head_dim 256, 384 experts).
SIZE_LIMITS = {"num_hidden_layers": 1024, "hidden_size": 65536, "intermediate_size": 262144,
               "moe_intermediate_size": 262144, "vocab_size": 1 << 20,
               "num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 1024,
               "num_experts": 4096, "num_local_experts": 4096, "num_experts_per_tok": 4096,
               "decoder_sparse_step": 1024}


# What a low-rank adapter can sit on: the short name of each projection (models/lora.py maps
# them to the blocks' weights), and how a frozen base may be stored.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
BASE_QUANTS = ("none", "int8", "nf4")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters on the decoder's projections (models/lora.py): W x + (alpha / rank) *
  B(A x) with A [in, rank], B [rank, out]; the base W frozen, stored as `base_quant` says."""
  rank: int                          # r >= 1
  alpha: float = 32.0                # scale alpha / rank (PEFT's lora_alpha)
  targets: Tuple[str, ...] = LORA_TARGETS   # which projections carry an adapter
  base_quant: str = "none"           # none (the param dtype) | int8 | nf4 (QLoRA)

  def __post_init__(self):
    object.__setattr__(self, "targets", tuple(self.targets))
    if not (isinstance(self.rank, int) and self.rank >= 1):
      raise ValueError(f"LoRA rank must be an integer >= 1, got {self.rank!r}")
    if not self.alpha > 0:
      raise ValueError(f"LoRA alpha must be > 0, got {self.alpha!r}")
    bad = [t for t in self.targets if t not in LORA_TARGETS]
    if bad or not self.targets or len(set(self.targets)) != len(self.targets):
      raise ValueError(f"LoRA targets {self.targets} must be distinct names of "
                       f"{', '.join(LORA_TARGETS)}")
    if self.base_quant not in BASE_QUANTS:
      raise ValueError(f"base_quant {self.base_quant!r} is not one of {', '.join(BASE_QUANTS)}")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def dtype_name(dtype: Any) -> str:
  """Canonical name ("float32", "bfloat16", ...) of a jnp/np dtype or dtype name."""
  name = jnp.dtype(dtype).name
  if name not in DTYPES:
    raise ValueError(f"dtype {name!r} not supported; expected one of {sorted(DTYPES)}")
  return name


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a decoder; hashable so it can be a static jit argument."""
  model_type: str = "qwen3"           # a key of FAMILIES
  vocab_size: int = 128               # V
  hidden_size: int = 64               # D
  intermediate_size: int = 128        # F of dense MLPs
  num_layers: int = 2                 # L
  num_heads: int = 4                  # N
  num_kv_heads: int = 2               # K
  head_dim: int = 16                  # H
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False   # unembedding reuses the [V, D] embedding table
  # None = the model_type's architecture (see module docstring); explicit values must agree.
  qkv_bias: Optional[bool] = None     # q/k/v projections carry a bias
  o_bias: Optional[bool] = None       # output projection carries a bias
  qk_norm: Optional[bool] = None      # RMSNorm over H on q and k before RoPE (Qwen3)
  # RoPE
  rope_theta: float = 10000.0
  rope_type: str = "default"          # "default" or "llama3"
  rope_factor: float = 1.0            # llama3: wavelength stretch of low frequencies
  rope_low_freq_factor: float = 1.0   # llama3
  rope_high_freq_factor: float = 4.0  # llama3
  rope_original_max_position: int = 8192  # llama3: pre-training context length
  max_position_embeddings: int = 32768
  # MoE (qwen3_moe only; num_experts = 0 means every MLP is dense)
  num_experts: int = 0                # E
  num_experts_per_tok: int = 0        # top-k
  moe_intermediate_size: int = 0      # F of each expert
  norm_topk_prob: bool = False        # renormalise the top-k router probabilities to sum 1
  decoder_sparse_step: int = 1        # layer l is MoE iff (l + 1) % step == 0 ...
  mlp_only_layers: Tuple[int, ...] = ()  # ... and l is not listed here
  # Special tokens, carried so export round-trips and samplers know when to stop.
  bos_token_id: TokenIds = None
  eos_token_id: TokenIds = None
  pad_token_id: TokenIds = None
  # Numerics and memory
  dtype: str = "float32"              # compute dtype of activations and matmuls
  param_dtype: str = "float32"        # storage dtype of parameters
  remat: bool = False                 # rematerialise each block in the backward pass
  moe_chunk: int = 4096               # expert parallelism: tokens per device per all-to-all
                                      #   (models/expert_parallel.py); bounds its buffers
  # Low-rank adapters over a frozen base (None = none: every parameter is trained); not part
  # of config.json (to_hf): an adapter is saved as a PEFT adapter or merged (hf_io).
  lora: Optional[LoraConfig] = None

  def __post_init__(self):
    if self.model_type not in FAMILIES:
      raise ValueError(f"unsupported model_type {self.model_type!r}; supported: "
                       f"{', '.join(FAMILIES)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                       f"num_key_value_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
    if self.rope_type not in ("default", "llama3"):
      raise ValueError(f"rope_type {self.rope_type!r} not supported; expected default or llama3")
    if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
      raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                       f"[1, num_experts={self.num_experts}]")
    self._resolve_attention_flags()
    object.__setattr__(self, "dtype", dtype_name(self.dtype))
    object.__setattr__(self, "param_dtype", dtype_name(self.param_dtype))
    object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))

  def _resolve_attention_flags(self):
    """Fills None flags from model_type; rejects combinations transformers cannot express."""
    fam = FAMILIES[self.model_type]
    default_bias = self.o_bias if self.qkv_bias is None else self.qkv_bias
    flags = dict(qkv_bias=True if fam.fixed_bias else bool(default_bias),
                 o_bias=False if fam.fixed_bias else bool(default_bias), qk_norm=fam.qk_norm)
    for name, want in flags.items():
      got = getattr(self, name)
      if got is not None and got != want:
        raise ValueError(f"{name}={got} is not a {self.model_type} architecture (qwen2: q/k/v "
                         "bias, no o bias; llama/qwen3: one attention_bias for q/k/v/o; q/k "
                         "norm iff qwen3)")
      object.__setattr__(self, name, want)

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def weight_dtype(self):
    return DTYPES[self.param_dtype]

  def is_moe_layer(self, l: int) -> bool:
    """Same rule as transformers' Qwen3MoeDecoderLayer."""
    return (self.num_experts > 0 and l not in self.mlp_only_layers
            and (l + 1) % self.decoder_sparse_step == 0)

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  # ------------------------------------------------------------------ HF config.json
  @classmethod
  def from_hf(cls, hf: Mapping[str, Any], *, dtype: Any = jnp.float32,
              param_dtype: Optional[Any] = None, remat: bool = False,
              moe_chunk: int = 4096) -> "ModelConfig":
    """Parses a transformers `config.json` dict; raises a ValueError naming the key of any
    unsupported, mistyped or out-of-bounds value (`SIZE_LIMITS`), before anything is built."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
      raise ValueError(f"unsupported model_type {model_type!r}; supported: "
                       f"{', '.join(FAMILIES)}")

    def size(key, default=None, *, alias=None):
      """An integer in [1, SIZE_LIMITS[key]]; `default` when the key is absent or null (no
      default: required)."""
      value = hf.get(key)
      if value is None and alias is not None:
        key, value = alias, hf.get(alias)
      if value is None:
        if default is None:
          raise ValueError(f"lacks required key {key!r} ({model_type})")
        return default
      return _bounded_int(key, value)

    act = hf.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"hidden_act={act!r}: only 'silu' (SwiGLU) is supported")
    if hf.get("use_sliding_window"):
      raise ValueError("use_sliding_window=true: sliding-window attention is not supported")
    if hf.get("mlp_bias"):
      raise ValueError("mlp_bias=true: MLP biases are not supported")
    num_heads = size("num_attention_heads")
    hidden = size("hidden_size")
    head_dim = size("head_dim", 0) or hidden // num_heads
    if head_dim < 1:
      raise ValueError(f"hidden_size={hidden} < num_attention_heads={num_heads} and no "
                       "head_dim: the heads would be empty")
    fam = FAMILIES[model_type]
    attention_bias = bool(hf.get("attention_bias") or False)
    qkv_bias = True if fam.fixed_bias else attention_bias
    o_bias = False if fam.fixed_bias else attention_bias

    rope = _parse_rope(hf)
    moe = {}
    if fam.moe:
      if hf.get("num_experts", hf.get("num_local_experts")) is None:
        raise ValueError(f"lacks 'num_experts' / 'num_local_experts' ({model_type})")
      mlp_only = hf.get("mlp_only_layers") or ()
      if not (isinstance(mlp_only, (list, tuple)) and all(
          isinstance(l, int) and not isinstance(l, bool) for l in mlp_only)):
        raise ValueError(f"mlp_only_layers must be a list of layer indices, got {mlp_only!r}")
      moe = dict(num_experts=size("num_experts", alias="num_local_experts"),
                 num_experts_per_tok=size("num_experts_per_tok"),
                 moe_intermediate_size=size("moe_intermediate_size"),
                 norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                 decoder_sparse_step=size("decoder_sparse_step", 1),
                 mlp_only_layers=tuple(mlp_only))
    return cls(
        model_type=model_type,
        vocab_size=size("vocab_size"),
        hidden_size=hidden,
        intermediate_size=size("intermediate_size"),
        num_layers=size("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=size("num_key_value_heads", num_heads),
        head_dim=head_dim,
        rms_norm_eps=_number(hf, "rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias, o_bias=o_bias,
        qk_norm=fam.qk_norm,
        max_position_embeddings=size("max_position_embeddings", 32768),
        bos_token_id=_token_ids(hf, "bos_token_id"),
        eos_token_id=_token_ids(hf, "eos_token_id"),
        pad_token_id=_token_ids(hf, "pad_token_id"),
        dtype=dtype_name(dtype),
        param_dtype=dtype_name(dtype if param_dtype is None else param_dtype),
        remat=remat, moe_chunk=moe_chunk, **rope, **moe)

  def to_hf(self) -> dict:
    """A `config.json` dict that transformers 5 loads into the same network."""
    fam = FAMILIES[self.model_type]
    hf = {
        "architectures": [fam.architecture],
        "model_type": self.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": self.rms_norm_eps,
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "bos_token_id": _json_ids(self.bos_token_id),
        "eos_token_id": _json_ids(self.eos_token_id),
        "pad_token_id": _json_ids(self.pad_token_id),
        "dtype": self.param_dtype,
        "rope_parameters": self._rope_parameters(),
    }
    if not fam.fixed_bias:
      hf["attention_bias"] = self.qkv_bias
    if fam.writes_mlp_bias:
      hf["mlp_bias"] = False
    if fam.moe:
      hf.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers))
    return hf

  def _rope_parameters(self) -> dict:
    rope = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
    if self.rope_type == "llama3":
      rope.update(factor=self.rope_factor, low_freq_factor=self.rope_low_freq_factor,
                  high_freq_factor=self.rope_high_freq_factor,
                  original_max_position_embeddings=self.rope_original_max_position)
    return rope


def _parse_rope(hf: Mapping[str, Any]) -> dict:
  """RoPE fields from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling`."""
  params = {}
  for key in ("rope_scaling", "rope_parameters"):
    value = hf.get(key) or {}
    if not isinstance(value, Mapping):
      raise ValueError(f"{key} must be an object or null, got {value!r}")
    params.update(value)
  theta = _number(params, "rope_theta", _number(hf, "rope_theta", 10000.0))
  rope_type = params.get("rope_type", params.get("type", "default"))
  if _number(params, "partial_rotary_factor", 1.0) != 1.0:
    raise ValueError("partial_rotary_factor != 1 is not supported")
  out = dict(rope_theta=theta, rope_type=rope_type)
  if rope_type == "llama3":
    for ours, theirs in (("rope_factor", "factor"), ("rope_low_freq_factor", "low_freq_factor"),
                         ("rope_high_freq_factor", "high_freq_factor"),
                         ("rope_original_max_position", "original_max_position_embeddings")):
      if theirs not in params:
        raise ValueError(f"llama3 RoPE parameters lack {theirs!r}")
      out[ours] = _number(params, theirs, None)
    out["rope_original_max_position"] = int(out["rope_original_max_position"])
  elif rope_type != "default":
    raise ValueError(f"rope_type {rope_type!r} not supported; expected 'default' or 'llama3'")
  return out


def _bounded_int(key: str, value: Any) -> int:
  """`value` as a size in [1, SIZE_LIMITS.get(key)], or a ValueError naming the key."""
  if isinstance(value, bool) or not isinstance(value, int):
    raise ValueError(f"{key} must be an integer, got {value!r}")
  limit = SIZE_LIMITS.get(key)
  if value < 1 or (limit is not None and value > limit):
    raise ValueError(f"{key}={value} is outside [1, {limit or 'inf'}]" + (
        " (SIZE_LIMITS: far above any released checkpoint's)" if value > 1 else ""))
  return value


def _number(d: Mapping[str, Any], key: str, default) -> float:
  """d[key] as a float (`default` when absent or null), or a ValueError naming the key."""
  value = d.get(key)
  if value is None:
    if default is None:
      raise ValueError(f"lacks {key!r}")
    return default
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ValueError(f"{key} must be a number, got {value!r}")
  return float(value)


def _token_ids(hf: Mapping[str, Any], key: str) -> TokenIds:
  x = hf.get(key)
  if x is None or (isinstance(x, int) and not isinstance(x, bool)):
    return x
  if isinstance(x, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool)
                                          for i in x):
    return tuple(x)
  raise ValueError(f"{key} must be a token id, a list of them or null, got {x!r}")


def _json_ids(x):
  return list(x) if isinstance(x, tuple) else x
