"""The sampler: jitted prefill plus a chunked `lax.while_loop` decode over S slots, with an
exact retention record.

`generate(model, prompt_ids, prompt_lengths, ...)` splits the NNX model (`nnx.split`) and calls
one `jax.jit`-compiled pure function that merges it inside (nnx.jit's per-call graph traversal
is ~15x slower to dispatch). Everything static (sampling, cache and batching configs, the
graph) is a static argument, so calls with the same bucketed shapes reuse one executable.

The model's own blocks do the work (`Decoder.prefill` over the prompts, then
`Decoder.decode_step` per token, with `eviction.CacheEviction` as the cache policy); this
module keeps the loop, the slots, the output buffers (`Outputs`) and sampling.

Indexing. Prompts are left-padded to the bucket P; R new tokens follow, T = P + R. All rows
share array indices: the prompt ends at P - 1, token P is sampled from the prefill's last
logits, and decode query i (i = P .. P + R - 2) feeds token i and samples token i + 1. RoPE
position of index i in row b is i - (P - len_b), which is what `Decoder`'s default positions
give the learner for `segment_ids` = 1 on valid tokens. `evicted_at` uses the same array
indices.

Scheduling (`BatchingConfig`). Rows [g*G, (g+1)*G) share a prompt (GRPO's group): the prefill
runs once per group (U = B / G prompts; row by row where the U prompts do not split over the
mesh's batch shards, `prefill_group`) and keeps each prompt's keys, values and policy scores
(`eviction.PromptKV`). S slots decode at once (S = B by default); each slot holds one row at
its own array index. Loading a row into a slot copies its prompt's KV (the policy's per-row
selection: random eviction differs row by row) and samples its first token. The loop runs in
chunks of `chunk` steps; between chunks, once `refill` slots are free (their rows hit EOS or
T - 1), the next rows are loaded, on device. A chunk runs on the caches cut to the smallest
`cache.slot_buckets` size holding every slot it can fill (one compiled branch per size; the
smallest holds a loaded prompt and one chunk of keys), so a step reads the live part of the
cache, not its capacity. Rows that finished mid-chunk, or
slots with no row left, idle: their writes drop and their cache stays as it was.

A row's draws are its own: the uniform of its token at index i + 1, the logit noise there,
the router jitter of its token i and its random-eviction draws hash (key, row, index)
(`trm_jax.rng`), so S, G, the chunking and the other rows never change what a row samples
(up to fp32 rounding of batch-size-dependent matmuls: tests/test_rollout_slots.py). A group's
shared prompt has one router jitter, keyed by the group's first row.

Exactness. Prefill attention uses the whole prompt (`kernels.attention`, as the model does);
compression happens when a row is loaded, so dropped prompt keys get evicted_at = P. During
decoding, query i attends exactly the keys held after `eviction.evict` + `kv_cache.write`,
i.e. the keys j <= i with evicted_at[j] > i: the learner's `model(tokens,
visibility=Visibility(segment_ids, evicted_at))` replays the same attention. Tokens after EOS
are pad_id with segment id 0, invisible to the learner.

Mismatch knobs (rollout != learner, for TRM experiments): `compute_dtype` (e.g. bf16 sampling
of an fp32 model), `logit_noise`, `router_noise_scale` (MoE layers), and stale parameters:
pass the stale model (or its state to `generate_from_state`). Logit noise for the token at
index i + 1 of row b is `logit_noise * sampling.row_noise(rng.seed(stream_keys(key)[1]), b, i,
V)`, so a test or an analysis can replay it.

Costs worth knowing: H2O's prefill scores materialise the prompt's [U, K, G, P, P] attention
probabilities once (the column sums are what H2O accumulates); SnapKV only needs the window's
[U, K, G, W, P]. The prompt records hold every group's prompt KV for the whole call
([U, P, K, H] per layer). A decode step reads the cache's live bucket: about max_i(i) + 1
slots for the dense cache, Cp + (i - P) + 1 (at most C) for the compressed ones.

Where a decode step's time goes (`python -m bench.decode_profile`): sampling draws one uniform
per row and inverts the CDF (`sampling.inverse_cdf`) instead of Gumbel noise over the whole
vocabulary, and bf16 weights stay bf16 with fp32 accumulation (`layers.project`), so what is
left is the matmuls (memory bound: the weights are read once per step) and attention over the
cache.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from trm_jax import rng
from trm_jax import sharding as shd
from trm_jax.kernels.visibility import NEVER_EVICTED, Visibility
from trm_jax.models import kv_cache
from trm_jax.models.decoder import abstract_model
from trm_jax.models.kv_cache import KVCache
from trm_jax.models.protocol import CausalLM
from trm_jax.rollout import cache as kv
from trm_jax.rollout import eviction, sampling
from trm_jax.rollout.types import (BatchingConfig, CacheConfig, Rollout, RolloutStats,
                                   SamplingConfig)


@struct.dataclass
class Outputs:
  """The rollout being written, in rows of the whole batch (T = P + R)."""
  tokens: jax.Array              # [B, T] int32 prompt, sampled tokens, pad_id elsewhere
  logp: jax.Array                # [B, T] fp32 log-prob of each sampled token, 0 elsewhere
  entropy: jax.Array             # [B, T] fp32 entropy of each sampled distribution
  mask: jax.Array                # [B, T] int32 1 on generated tokens up to and including EOS
  done: jax.Array                # [B] bool the row emitted an EOS
  evicted_at: jax.Array          # [B, L, K, T] int32 retention records (written when a row's
                                 #   slot is refilled or the loop ends)
  topk_logp: Optional[jax.Array] = None  # [B, T, k] fp32 (keep_topk_logprobs)
  topk_ids: Optional[jax.Array] = None   # [B, T, k] int32
  full_logp: Optional[jax.Array] = None  # [B, T, V] fp32 (keep_full_logprobs)
  routed: Optional[jax.Array] = None     # [B, L_moe, T, k] expert ids (record_routing);
                                         #   -1 where no token was fed (the last index)


@struct.dataclass
class DecodeState:
  """The decode loop's carry, and what `run_phase("prefill")` returns. S decoding slots."""
  steps: jax.Array               # [] int32 decode steps run
  next_row: jax.Array            # [] int32 the next row to load into a free slot
  row: jax.Array                 # [S] int32 the row each slot holds (B: none)
  index: jax.Array               # [S] int32 next query i of each slot: feeds token i of its
                                 #   row, samples i + 1
  tok: jax.Array                 # [S] int32 the token at `index`
  active: jax.Array              # [S] bool the slot is decoding (else finished or empty)
  start: jax.Array               # [S] int32 array index of its row's first valid token
  budget: jax.Array              # [S] int32 most keys its row may hold at once
  caches: Tuple[KVCache, ...]    # L caches: k [S, K, H, C], v [S, K, C, H]; pos, score
                                 #   [S, K, C];
                                 #   evicted_at [S, K, T]
  prompts: Tuple[eviction.PromptKV, ...]  # L records of the U prefilled prompts
  h_prompt: jax.Array            # [U, D] final-normed hidden state of each prompt's last index
  out: Outputs
  routed_prompt: Optional[jax.Array] = None  # [U, L_moe, P, k] the prompts' expert choices


def routing_dtype(num_experts: int):
  """The smallest signed integer dtype that holds expert ids 0..E-1 and the -1 of an
  unrecorded position (int8 for E <= 127)."""
  for dt in (jnp.int8, jnp.int16, jnp.int32):
    if num_experts - 1 <= jnp.iinfo(dt).max:
      return dt
  raise ValueError(f"num_experts={num_experts} does not fit int32 expert ids")


def generate(model, prompt_ids, prompt_lengths, *, max_new_tokens: int, key: jax.Array,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
             greedy: bool = False, eos_ids: Optional[Sequence[int]] = None,
             pad_id: Optional[int] = None, cache: CacheConfig = CacheConfig(),
             keep_topk_logprobs: int = 0, keep_full_logprobs: bool = False,
             compute_dtype=None, logit_noise: float = 0.0, router_noise_scale: float = 0.0,
             record_routing: bool = False, attn_impl: str = "auto", slots: int = 0,
             group_size: int = 1, chunk: int = 16, refill: int = 0, bucket: int = 128,
             tail: int = 4) -> Rollout:
  """Samples `max_new_tokens` continuations of left-padded prompts.

  Args:
    model: a `trm_jax.models.Decoder` (a stale copy gives stale-parameter rollouts).
    prompt_ids: [B, P] int32, left-padded (bucket P to avoid recompiles).
    prompt_lengths: [B] int32 valid tokens per row, 1 <= len <= P.
    max_new_tokens: R; the output has T = P + R columns.
    key: PRNG key (sampling, logit noise, router noise, random eviction).
    temperature, top_p, top_k, greedy: the sampling distribution (see `SamplingConfig`).
    eos_ids: stop tokens (default: the model config's eos_token_id; () = never stop).
    pad_id: written after EOS (default: config pad_token_id, else 0).
    cache: KV cache and eviction policy (`CacheConfig`).
    keep_topk_logprobs, keep_full_logprobs: also return those log-probs of each sampled
      distribution (for exact rollout-side divergences).
    compute_dtype: sampler compute dtype (e.g. jnp.bfloat16), default the model's.
    logit_noise: std of Gaussian noise added to the logits before sampling.
    router_noise_scale: MoE router jitter in every MoE layer.
    record_routing: also return `Rollout.routed_experts` [B, L_moe, T, k], the experts each
      MoE layer ran for every prompt and sampled token (with jitter, the jittered choice),
      for routing replay in the learner (`model(tokens, routing=...)`).
    attn_impl: attention implementation (`kernels.attention`) of the prefill, and of each
      decode step where the impl has a decode kernel (TPU: each row reads its filled slots).
    slots, group_size, chunk, refill, bucket, tail: continuous batching and shared prompts
      (`BatchingConfig`, whose defaults these are):
      S = slots rows decode at once (0 = all), rows [g*G, (g+1)*G) share one prompt,
      prefilled once. Every draw of a row is keyed by (key, row, array index), so neither
      changes what a row samples.
  Returns:
    `Rollout`.
  """
  scfg = sampling_config(
      model.config, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
      top_k=top_k, greedy=greedy, eos_ids=eos_ids, pad_id=pad_id,
      keep_topk_logprobs=keep_topk_logprobs, keep_full_logprobs=keep_full_logprobs,
      logit_noise=logit_noise, router_noise_scale=router_noise_scale,
      record_routing=record_routing)
  graphdef, state = nnx.split(model)
  return generate_from_state(sampler_graphdef(model, compute_dtype), state, prompt_ids,
                             prompt_lengths, key=key, sampling_config=scfg, cache_config=cache,
                             attn_impl=attn_impl, batching=BatchingConfig(
                                 slots=slots, group_size=group_size, chunk=chunk,
                                 refill=refill, bucket=bucket, tail=tail))


def sampling_config(model_config, *, eos_ids: Optional[Sequence[int]] = None,
                    pad_id: Optional[int] = None, **kwargs) -> SamplingConfig:
  """A `SamplingConfig` whose stop and pad ids default to the model config's (`generate`'s
  defaults, for callers of `generate_from_state`)."""
  if eos_ids is None:
    e = model_config.eos_token_id
    eos_ids = () if e is None else ((e,) if isinstance(e, int) else tuple(e))
  if pad_id is None:
    p = model_config.pad_token_id
    pad_id = 0 if p is None else (p if isinstance(p, int) else p[0])
  return SamplingConfig(eos_ids=tuple(eos_ids), pad_id=pad_id, **kwargs)


def sampler_graphdef(model, compute_dtype=None) -> nnx.GraphDef:
  """The graph `generate_from_state` runs: the model's own, or the same model computing in
  `compute_dtype` (same state layout, so the model's parameters plug in unchanged)."""
  if compute_dtype is None:
    return nnx.graphdef(model)
  return _graphdef_with_dtype(type(model), model.config, jnp.dtype(compute_dtype).name)


def generate_from_state(graphdef, state, prompt_ids, prompt_lengths, *, key: jax.Array,
                        sampling_config: SamplingConfig,
                        cache_config: CacheConfig = CacheConfig(),
                        attn_impl: str = "auto",
                        batching: BatchingConfig = BatchingConfig()) -> Rollout:
  """`generate` for callers that already hold the model's graph and state (training loops).

  `graphdef` from `sampler_graphdef`, `state` the model's whole state (`nnx.split(model)[1]`,
  or `nnx.merge_state(params, rest)`), `sampling_config` from `sampling_config`.
  """
  prompt_ids, prompt_lengths = check_prompts(prompt_ids, prompt_lengths,
                                             group_size=batching.group_size)
  return _generate_jit(graphdef, state, prompt_ids, prompt_lengths, key,
                       scfg=sampling_config, ccfg=cache_config, bcfg=batching,
                       attn_impl=attn_impl)


def check_prompts(prompt_ids, prompt_lengths, *, group_size: int = 1
                  ) -> tuple[jax.Array, jax.Array]:
  """(prompt_ids, prompt_lengths) as int32 arrays, after checking their shapes and, for
  concrete values, that each length is in [1, P] and that the rows of each group of
  `group_size` share their prompt; a ValueError names what is wrong."""
  prompt_ids = jnp.asarray(prompt_ids)
  # Host lengths stay on the host (numpy): a jitted program places them with its other
  # inputs, where a device array made here would be committed to one device.
  prompt_lengths = (prompt_lengths if isinstance(prompt_lengths, jax.Array)
                    else np.asarray(prompt_lengths))
  if prompt_ids.ndim != 2 or not jnp.issubdtype(prompt_ids.dtype, jnp.integer):
    raise ValueError(f"prompt_ids must be an int [B, P] array, got {prompt_ids.dtype} "
                     f"{prompt_ids.shape}")
  B, P = prompt_ids.shape
  if prompt_lengths.shape != (B,):
    raise ValueError(f"prompt_lengths must be [B]=[{B}], got {prompt_lengths.shape}")
  if not isinstance(prompt_lengths, jax.core.Tracer):
    lens = np.asarray(prompt_lengths)
    if lens.min() < 1 or lens.max() > P:
      raise ValueError(f"prompt_lengths must be in [1, P={P}], got min {lens.min()} "
                       f"max {lens.max()}")
  if B % group_size:
    raise ValueError(f"{B} prompt rows are not a multiple of group_size={group_size}")
  if group_size > 1 and not isinstance(prompt_ids, jax.core.Tracer) and not isinstance(
      prompt_lengths, jax.core.Tracer):
    ids = np.asarray(prompt_ids).reshape(B // group_size, group_size, P)
    lens = np.asarray(prompt_lengths).reshape(B // group_size, group_size)
    bad = np.flatnonzero(~((ids == ids[:, :1]).all(axis=(1, 2)) & (lens == lens[:, :1]).all(1)))
    if bad.size:
      g = int(bad[0])
      raise ValueError(f"group_size={group_size}: rows {g * group_size}..{(g + 1) * group_size - 1}"
                       f" (group {g}) do not share one prompt; a group's rows are prefilled "
                       f"once and must be identical")
  return prompt_ids.astype(jnp.int32), prompt_lengths.astype(jnp.int32)


def make_generate(graphdef, sampling_config: SamplingConfig,
                  cache_config: CacheConfig = CacheConfig(), attn_impl: str = "auto",
                  batching: BatchingConfig = BatchingConfig(), merge=None):
  """jit(state, prompt_ids, prompt_lengths, key) -> Rollout: `generate_from_state` with its
  static settings bound, as one jitted program (`.lower(...)` compiles it ahead of time).
  Its inputs are not checked: pass them through `check_prompts` first. `merge(graphdef,
  state) -> (graphdef, state)`, when given, first turns the state into the model sampled
  from, inside the program (`models.lora.merged_sampler_state`)."""
  static = dict(scfg=sampling_config, ccfg=cache_config, bcfg=batching, attn_impl=attn_impl)
  if merge is None:
    return jax.jit(functools.partial(_generate_jit, graphdef, **static))

  def generate_merged(state, prompt_ids, prompt_lengths, key):
    return _generate_jit(*merge(graphdef, state), prompt_ids, prompt_lengths, key, **static)
  return jax.jit(generate_merged)


def stream_keys(key: jax.Array):
  """The independent PRNG streams of one `generate` call: (sample, logit noise, router noise,
  random eviction). Each draw hashes its stream's key with the row and array index that use
  it (`trm_jax.rng`)."""
  return tuple(jax.random.split(key, 4))


@functools.lru_cache(maxsize=None)
def _graphdef_with_dtype(cls, config, dtype_name: str):
  """Graph of the same model computing in another dtype (same state layout)."""
  return nnx.graphdef(abstract_model(cls, config.replace(dtype=dtype_name)))


def run_phase(phase: str, graphdef, state, prompt_ids, prompt_lengths, *, key: jax.Array,
              sampling_config: SamplingConfig, cache_config: CacheConfig = CacheConfig(),
              carry=None, attn_impl: str = "auto",
              batching: BatchingConfig = BatchingConfig()):
  """The two phases of `generate` as separately jitted programs (`_prefill_jit`,
  `_decode_jit`), e.g. to time the decode loop on its own (bench/).

  phase="prefill" returns the decode loop's initial `DecodeState`; phase="decode" runs the
  loop from that `carry` (same other arguments) and returns the `Rollout`. `generate`
  compiles both phases into one program; all three trace the same `_prefill` and `_decode`.
  """
  if phase not in ("prefill", "decode"):
    raise ValueError(f"phase={phase!r}; expected 'prefill' or 'decode'")
  if (phase == "decode") != (carry is not None):
    raise ValueError("carry is required for phase='decode' and only for it")
  if carry is not None and not isinstance(carry, DecodeState):
    raise ValueError(f"carry must be the DecodeState of run_phase('prefill'), got "
                     f"{type(carry).__name__}")
  prompt_ids, prompt_lengths = check_prompts(prompt_ids, prompt_lengths,
                                             group_size=batching.group_size)
  args = (graphdef, state, prompt_ids, prompt_lengths, key)
  static = dict(scfg=sampling_config, ccfg=cache_config, bcfg=batching, attn_impl=attn_impl)
  if phase == "prefill":
    return _prefill_jit(*args, **static)
  return _decode_jit(*args, carry, **static)


@dataclasses.dataclass(frozen=True)
class _Call:
  """What both phases of one generate call derive from its inputs (traced arrays)."""
  model: CausalLM
  scfg: SamplingConfig
  bcfg: BatchingConfig
  policy: eviction.CacheEviction   # the cache policy of every layer (slot arrays unset)
  group: int                       # rows per prefilled prompt (`prefill_group`)
  S: int                           # decoding slots
  refill: int                      # load rows once this many slots are free
  start: jax.Array                 # [B] int32 array index of each row's first valid token
  valid: jax.Array                 # [B, P] bool non-padding prompt positions
  keep: jax.Array                  # [B] int32 prompt keys kept after prefill
  budget: jax.Array                # [B] int32 most keys a row may hold
  s_sample: jax.Array              # [2] uint32 seeds of the sampling and logit-noise streams
  s_noise: jax.Array
  k_router: jax.Array              # the router-noise key (MoE layers hash it with token ids)
  attn_impl: str                   # `kernels.attention` impl: the prefill's, and the decode
                                   #   kernel's where it has one

  @property
  def shape(self) -> Tuple[int, int, int]:
    """(B, P, T)."""
    B, P = self.valid.shape
    return B, P, P + self.scfg.max_new_tokens

  def router_noise(self, ids) -> dict:
    """The MoE router jitter of the tokens ids [., .] (row * T + array index)."""
    if self.scfg.router_noise_scale > 0:
      return dict(router_noise_key=self.k_router,
                  router_noise_scale=self.scfg.router_noise_scale,
                  router_noise_ids=ids.astype(jnp.uint32))
    return {}

  def next_token(self, h, rows, index):
    """h [S, D] final-normed hidden state of query index [S] of rows [S] -> (tokens, logp,
    dist, entropy) for index + 1, drawn with that row's own (row, index) uniform and noise."""
    with jax.named_scope("unembed"):
      logits = self.model.unembed(h)                                  # [S, V] fp32
    if self.scfg.logit_noise > 0:
      logits = logits + self.scfg.logit_noise * sampling.row_noise(
          self.s_noise, rows, index, logits.shape[-1])
    return sampling.draw(logits, self.scfg, rng.uniform(self.s_sample, rows, index))


def _call(graphdef, state, prompt_ids, prompt_lengths, key, scfg: SamplingConfig,
          ccfg: CacheConfig, bcfg: BatchingConfig, attn_impl: str) -> _Call:
  model: CausalLM = nnx.merge(graphdef, state)
  B, P = prompt_ids.shape
  R = scfg.max_new_tokens
  S, refill = bcfg.sizes(B)
  k_sample, k_noise, k_router, k_evict = stream_keys(key)
  start = P - prompt_lengths                                          # [B]
  valid = jnp.arange(P, dtype=jnp.int32)[None, :] >= start[:, None]   # [B, P]
  keep, budget = kv.row_budgets(ccfg, prompt_lengths, P, R)           # [B], [B]
  return _Call(model=model, scfg=scfg, bcfg=bcfg, policy=_eviction(ccfg, P, R, k_evict),
               group=prefill_group(B, bcfg.group_size), S=S, refill=refill,
               start=start, valid=valid, keep=keep, budget=budget,
               s_sample=rng.seed(k_sample), s_noise=rng.seed(k_noise), k_router=k_router,
               attn_impl=attn_impl)


def prefill_group(B: int, group_size: int) -> int:
  """Rows per prefilled prompt: `group_size`, unless the B / group_size prompts do not split
  over the mesh's batch shards (set with `jax.set_mesh`), when every row is prefilled on its
  own: the prompts would be replicated on every device, each prefilling them all and holding
  every prompt's KV for the call (the 8B config's 32 prompts on 64 chips: 4x the prefill per
  chip and 4.8 GB of records)."""
  mesh = jax.sharding.get_abstract_mesh()
  shards = 1 if mesh.empty else shd.batch_shards(mesh)
  return group_size if (B // group_size) % shards == 0 else 1


def _eviction(ccfg: CacheConfig, P: int, R: int, rand_key=None) -> eviction.CacheEviction:
  """The cache policy of a call with prompt bucket P and R new tokens (slot arrays unset)."""
  return eviction.CacheEviction(ccfg, length=P + R, prompt_len=P,
                                prompt_slots=kv.prompt_slots(ccfg, P, R),
                                total_slots=kv.num_slots(ccfg, P, R), rand_key=rand_key)


def _stage_sizes(policy: eviction.CacheEviction, bcfg: BatchingConfig) -> Tuple[int, ...]:
  """The cache sizes of the decode loop's stages, smallest first (`cache.slot_buckets`). A
  stage below what a freshly loaded row fills in one chunk (its prompt's slots, then one
  chunk's keys) could neither run a chunk nor hold the prompts its refills load."""
  C = policy.total_slots
  return kv.slot_buckets(C, block=bcfg.bucket, least=min(C, policy.prompt_slots + bcfg.chunk))


def _fits(policy: eviction.CacheEviction, bcfg: BatchingConfig, active, index, n: int):
  """Whether the next chunk's writes stay in the first n cache slots, for slots decoding
  (`active` [S]) at `index` [S]."""
  return policy.with_slots(active=active).filled_bound(index + bcfg.chunk - 1) <= n


def _prefill(g: _Call, prompt_ids) -> DecodeState:
  """The blocks over each group's prompt once (U = B / G prompts), the empty slots, and the
  first S rows loaded into them: the decode loop's initial state."""
  model, scfg = g.model, g.scfg
  B, P, T = g.shape
  R, G, S = scfg.max_new_tokens, g.group, g.S
  cfg = model.config
  idx = jnp.arange(P, dtype=jnp.int32)
  start_u, valid_u = g.start[::G], g.valid[::G]                     # [U], [U, P]
  rows_u = jnp.arange(B // G, dtype=jnp.int32) * G                  # each group's first row
  h, records, routing = model.prefill(
      prompt_ids[::G], eviction.PromptRecorder(g.policy.cfg, valid_u),
      positions=jnp.maximum(idx[None, :] - start_u[:, None], 0),
      visibility=Visibility(segment_ids=valid_u.astype(jnp.int32)), attn_impl=g.attn_impl,
      with_routing=True, **g.router_noise(rows_u[:, None] * T + idx[None, :]))
  routed_prompt = routed = None
  if scfg.record_routing:
    if routing is None:
      raise ValueError("record_routing=True needs a model with MoE layers; this "
                       f"{cfg.model_type} model has none")
    rdt = routing_dtype(cfg.num_experts)
    routed_prompt = routing.chosen.astype(rdt)                     # [U, L_moe, P, k]
    routed = jnp.full((B, routed_prompt.shape[1], T, routed_prompt.shape[3]), -1, rdt)
  L, K, H = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  C = g.policy.total_slots
  zeros = jnp.zeros((B, T), jnp.float32)
  kk = scfg.keep_topk_logprobs
  out = Outputs(
      tokens=jnp.concatenate([prompt_ids, jnp.full((B, R), scfg.pad_id, jnp.int32)], axis=1),
      logp=zeros, entropy=zeros, mask=jnp.zeros((B, T), jnp.int32),
      done=jnp.zeros((B,), bool),
      evicted_at=jnp.full((B, L, K, T), NEVER_EVICTED, jnp.int32),
      topk_logp=jnp.zeros((B, T, kk), jnp.float32) if kk else None,
      topk_ids=jnp.zeros((B, T, kk), jnp.int32) if kk else None,
      full_logp=(jnp.zeros((B, T, cfg.vocab_size), jnp.float32) if scfg.keep_full_logprobs
                 else None),
      routed=routed)
  out = _on_rows(out)
  policy = g.policy.cfg.eviction_policy
  keeps_score = policy is not None and policy.keeps_score
  kv_dtype = records[0].k.dtype
  empty = kv_cache.empty(S, K, H, C, T, kv_dtype, keeps_score=keeps_score,
                         never=NEVER_EVICTED)
  none = jnp.zeros((S,), jnp.int32)
  s = DecodeState(steps=jnp.int32(0), next_row=jnp.int32(0), row=jnp.full((S,), B, jnp.int32),
                  index=jnp.full((S,), P, jnp.int32), tok=none, active=jnp.zeros((S,), bool),
                  start=none, budget=none, caches=(empty,) * L,
                  prompts=tuple(records), h_prompt=h, out=out, routed_prompt=routed_prompt)
  return _load(g, s, first=True)


def _flush(g: _Call, s: DecodeState, which: jax.Array) -> DecodeState:
  """Copies the retention records of the rows held by slots `which` [S] into the output."""
  B = g.shape[0]
  rows = jnp.where(which, s.row, B)                                # B: dropped
  ev = jnp.stack([c.evicted_at for c in s.caches], axis=1)          # [S, L, K, T]
  return s.replace(out=_on_rows(s.out.replace(
      evicted_at=s.out.evicted_at.at[rows].set(ev, mode="drop"))))


def _load(g: _Call, s: DecodeState, first: bool = False) -> DecodeState:
  """Fills the slots that are not decoding with the next rows (in row order): each slot's
  cache from its row's prompt record (the policy's per-row prompt selection), and the row's
  first token (index P), sampled from the prompt's last hidden state with the row's own draw.
  The finished rows those slots held are flushed first.

  `first`: the prefill's load, into empty slots: slot i takes row i, which is static, so the
  prompts' records are repeated per group and the caches built whole, where a gather and a
  scatter by traced rows would leave the partitioner to replicate them on every device."""
  model, scfg = g.model, g.scfg
  B, P, T = g.shape
  G, S = g.group, s.active.shape[0]
  if first:
    free = take = jnp.ones((S,), bool)
    r = jnp.arange(S, dtype=jnp.int32)                                # S <= B
    per_slot = lambda x: jnp.repeat(x, G, axis=0)[:S]
  else:
    free = ~s.active
    s = _flush(g, s, free)
    new = s.next_row + jnp.cumsum(free.astype(jnp.int32)) - 1        # [S]
    take = free & (new < B)
    r = jnp.minimum(jnp.where(take, new, 0), B - 1)
    per_slot = lambda x: x[r // G]
  pol = g.policy.with_slots(rows=r, start=g.start[r], keep=g.keep[r], budget=g.budget[r],
                            active=take)
  loaded = [pol.load(l, jax.tree.map(per_slot, rec), g.valid[r])
            for l, rec in enumerate(s.prompts)]
  if first:
    caches = tuple(kv_cache.pad_slots(c, g.policy.total_slots) for c in loaded)
  else:
    caches = tuple(kv_cache.restart_rows(c, new, take) for c, new in zip(s.caches, loaded))
  query = jnp.full(r.shape, P - 1, jnp.int32)
  tok, logp, dist, ent = g.next_token(per_slot(s.h_prompt), r, query)
  rows = jnp.where(take, r, B)
  out = _record(s.out, rows, query + 1, tok, logp, dist, ent, scfg)
  if s.routed_prompt is not None:
    out = out.replace(routed=out.routed.at[rows, :, :P].set(per_slot(s.routed_prompt),
                                                            mode="drop"))
  first_done = _is_eos(tok, scfg.eos_ids) | (P >= T - 1)   # R = 1: the first token is the last
  pick = lambda new, old: jnp.where(take, new, old)
  return s.replace(
      next_row=s.next_row + jnp.sum(take, dtype=jnp.int32),
      row=jnp.where(take, r, jnp.where(free, B, s.row)),
      index=pick(P, s.index), tok=pick(tok, s.tok),
      active=jnp.where(free, take & ~first_done, s.active),
      start=pick(pol.start, s.start),
      budget=pick(pol.budget, s.budget), caches=caches, out=out)


def _pack(g: _Call, s: DecodeState, n: int) -> DecodeState:
  """The state on n of its S slots, the decoding ones first (the caller ensures at most n
  decode), copied once. Every slot's record is flushed first (the kept rows' again when
  they finish), so no row's record is lost even if more than n were decoding."""
  B = g.shape[0]
  s = _flush(g, s, jnp.ones(s.active.shape, bool))
  keep = jnp.argsort(~s.active, stable=True)[:n]                        # decoding first
  active = s.active[keep]
  return s.replace(row=jnp.where(active, s.row[keep], B), index=s.index[keep],
                   tok=s.tok[keep], active=active, start=s.start[keep],
                   budget=s.budget[keep],
                   caches=tuple(kv_cache.take_rows(c, keep) for c in s.caches))


def _run_chunk(g: _Call, n: int, stage: str, s: DecodeState) -> DecodeState:
  """Up to `bcfg.chunk` decode steps (fewer when no slot is decoding) on caches of n slots
  (the first n of the C slots: `_decode` cuts them); its loop is named for `stage`."""
  model, scfg = g.model, g.scfg
  B, P, T = g.shape
  policy = dataclasses.replace(g.policy, total_slots=n)

  def step(carry):
    j, s = carry
    i = s.index
    r = jnp.minimum(s.row, B - 1)
    pol = policy.with_slots(rows=r, start=s.start, budget=s.budget, active=s.active)
    h, caches, routing = model.decode_step(
        s.tok[:, None], s.caches, pol, positions=(i - s.start)[:, None], index=i,
        attn_impl=g.attn_impl, with_routing=True, **g.router_noise((r * T + i)[:, None]))
    rows = jnp.where(s.active, s.row, B)                               # B: dropped
    out = s.out
    if scfg.record_routing:   # the experts token i ran through, in every MoE layer
      out = out.replace(routed=out.routed.at[rows, :, i].set(
          routing.chosen[:, :, 0].astype(out.routed.dtype), mode="drop"))
    tok, logp, dist, ent = g.next_token(h, r, i)
    out = _record(out, rows, i + 1, tok, logp, dist, ent, scfg)
    finished = s.active & (_is_eos(tok, scfg.eos_ids) | (i + 1 >= T - 1))
    return j + 1, s.replace(steps=s.steps + 1, index=jnp.where(s.active, i + 1, i),
                            tok=jnp.where(s.active, tok, s.tok),
                            active=s.active & ~finished, caches=caches, out=out)

  with jax.named_scope(loop_scope(stage, "steps")):
    return jax.lax.while_loop(lambda c: (c[0] < g.bcfg.chunk) & jnp.any(c[1].active), step,
                              (jnp.int32(0), s))[1]


def _decode(g: _Call, s: DecodeState, prompt_lengths) -> Rollout:
  """The decode loop from `s`, in chunks of `bcfg.chunk` steps: every decoding slot's query i
  feeds its row's token i and samples token i + 1; a row finishes at EOS or index T - 1.
  Between chunks, free slots are refilled with the next rows (once `g.refill` of them are
  free). The loop runs in stages, one per `cache.slot_buckets` size n, smallest first: a stage
  holds the caches cut to their first n slots (copied out once, padded back once) and runs
  chunks while every slot the next chunk can fill is below n, so a step reads the live part
  of the cache, not its capacity. (Stages, not a `lax.switch` per chunk: XLA copies a whole
  cache through a conditional.) Once every row is loaded and at most S // `bcfg.tail` slots
  still decode, the tail: those slots are packed into S // tail slots (`_pack`) and decode
  on, over the whole cache, so the batch's longest rows no longer pay for S slots' matmuls.
  Each stage's loops are named (`loop_scope`); `decode_schedule` replays this schedule on
  the host for the bound on their trips. Returns the `Rollout`."""
  scfg = g.scfg
  B, P, T = g.shape
  C = g.policy.total_slots
  S_tail = max(1, g.S // g.bcfg.tail) if g.S < B else g.S

  def more(s: DecodeState):
    # At most B * R steps: each step advances at least one row (a bound against bugs).
    return ((jnp.any(s.active) | (s.next_row < B))
            & (s.steps < B * scfg.max_new_tokens))

  def fits(s: DecodeState, n: int):
    return _fits(g.policy, g.bcfg, s.active, s.index, n)

  def chunk_then_refill(n, s: DecodeState) -> DecodeState:
    s = _run_chunk(g, n, f"bucket{n}", s)
    if g.S == B:
      return s                                  # every row was loaded at the start
    n_free = jnp.sum(~s.active, dtype=jnp.int32)
    due = (s.next_row < B) & (n_free >= jnp.minimum(g.refill, B - s.next_row))
    return jax.lax.cond(due, functools.partial(_load, g), lambda s: s, s)

  def before_tail(s: DecodeState):
    if S_tail == g.S:
      return more(s)
    tail = (s.next_row >= B) & (jnp.sum(s.active, dtype=jnp.int32) <= S_tail)
    return more(s) & ~tail

  if g.S == B:
    # Every row was loaded at the start: the loop never reads the prompts' records again.
    s = s.replace(prompts=(), h_prompt=None, routed_prompt=None)
  stage_steps = []                               # decode steps run in each stage
  for n in _stage_sizes(g.policy, g.bcfg):
    before = s.steps
    with jax.named_scope(loop_scope(f"bucket{n}", "chunks")):
      if n < C:
        # Slots n.. are still as the prefill left them (empty: every earlier stage wrote
        # below its own, smaller size), so the stage's caches are padded back to C slots
        # rather than written into the full ones, which would stay live through the stage
        # beside its own: C + n slots of every layer's cache instead of n.
        s = s.replace(caches=tuple(kv_cache.first_slots(c, n) for c in s.caches))
        s = jax.lax.while_loop(lambda s, n=n: before_tail(s) & fits(s, n),
                               functools.partial(chunk_then_refill, n), s)
        s = s.replace(caches=tuple(kv_cache.pad_slots(c, C) for c in s.caches))
      else:
        s = jax.lax.while_loop(before_tail, functools.partial(chunk_then_refill, n), s)
    stage_steps.append(s.steps - before)
  if S_tail < g.S:
    # The loop above stopped with every row done or at most S_tail decoding: no row is left
    # to load, so the tail needs neither refills nor cut caches (one more compiled body).
    s = _pack(g, s, S_tail)
    g, before = dataclasses.replace(g, S=S_tail), s.steps
    with jax.named_scope(loop_scope("tail", "chunks")):
      s = jax.lax.while_loop(more, functools.partial(_run_chunk, g, C, "tail"), s)
    stage_steps.append(s.steps - before)

  s = _flush(g, s, jnp.ones((g.S,), bool))
  out = s.out
  return Rollout(
      tokens=out.tokens,
      segment_ids=jnp.concatenate([g.valid.astype(jnp.int32), out.mask[:, P:]], axis=1),
      prompt_lengths=prompt_lengths,
      response_lengths=jnp.sum(out.mask, axis=1).astype(jnp.int32),
      response_mask=out.mask,
      logp=out.logp,
      evicted_at=out.evicted_at,
      stats=RolloutStats(finished=out.done, decode_steps=s.steps, entropy=out.entropy,
                         cache_slots=g.policy.total_slots,
                         cache_bytes=kv.nbytes([(c.k, c.v) for c in s.caches]),
                         stage_steps=jnp.stack(stage_steps)),
      topk_ids=out.topk_ids, topk_logp=out.topk_logp, full_logp=out.full_logp,
      routed_experts=out.routed)


def loop_scope(stage: str, loop: str) -> str:
  """The named scope of one of `_decode`'s loops: a stage's loop over chunks ("chunks") or a
  chunk's loop over decode steps ("steps"); the stage is "bucket<n>" or "tail". Its while
  loop's op_name ends in "<scope>/while", which is how `trm_jax.aot.hlo_cost` finds it."""
  return f"decode_{stage}_{loop}"


def decode_schedule(B: int, P: int, R: int, ccfg: CacheConfig,
                    bcfg: BatchingConfig) -> dict[str, int]:
  """How many times the body of each of `_decode`'s loops (by `loop_scope`) runs in one call
  of B rows (prompt bucket P, R new tokens) when no row stops before its last index
  T - 1, i.e. every row decodes R - 1 steps: the most decode steps a call runs when every
  row decodes at once (S = B), and the schedule of continuous batching in which every row
  generates task.max_new_tokens. The bound `trm_jax.aot` counts the sampler's data-dependent
  loops with.

  It replays `_decode`'s control flow on the host (the slots' indices, refills, the stage
  each chunk runs in, the tail); `RolloutStats.stage_steps` of a run that never samples a
  stop token is its "..._steps" counts (tests/test_aot.py)."""
  S, refill = bcfg.sizes(B)
  T, chunk = P + R, bcfg.chunk
  policy = _eviction(ccfg, P, R)
  C = policy.total_slots
  S_tail = max(1, S // bcfg.tail) if S < B else S
  index, active = np.full(S, P), np.zeros(S, bool)
  state = {"next_row": 0, "steps": 0}
  counts: dict[str, int] = {}

  def load():
    free = ~active
    new = state["next_row"] + np.cumsum(free) - 1
    take = free & (new < B)
    index[take] = P
    active[:] = np.where(free, take & (P < T - 1), active)
    state["next_row"] += int(take.sum())

  def more():
    return (active.any() or state["next_row"] < B) and state["steps"] < B * R

  def run_chunk(stage: str):
    counts[loop_scope(stage, "chunks")] += 1
    for _ in range(chunk):
      if not active.any():
        break
      counts[loop_scope(stage, "steps")] += 1
      state["steps"] += 1
      finished = active & (index + 1 >= T - 1)
      index[active] += 1
      active[finished] = False

  def before_tail() -> bool:
    return more() and not (S_tail < S and state["next_row"] >= B
                           and int(active.sum()) <= S_tail)

  load()
  for n in _stage_sizes(policy, bcfg):
    counts[loop_scope(f"bucket{n}", "chunks")] = counts[loop_scope(f"bucket{n}", "steps")] = 0
    while before_tail() and (n == C or bool(_fits(policy, bcfg, active, index, n))):
      run_chunk(f"bucket{n}")
      if S < B and state["next_row"] < B and (
          int((~active).sum()) >= min(refill, B - state["next_row"])):
        load()
  if S_tail < S:
    counts[loop_scope("tail", "chunks")] = counts[loop_scope("tail", "steps")] = 0
    order = np.argsort(~active, kind="stable")[:S_tail]
    index[:S_tail], active[:S_tail] = index[order], active[order]
    active[S_tail:] = False
    while more():
      run_chunk("tail")
  return counts


_STATIC = ("graphdef", "scfg", "ccfg", "bcfg", "attn_impl")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _generate_jit(graphdef, state, prompt_ids, prompt_lengths, key, *,
                  scfg: SamplingConfig, ccfg: CacheConfig, bcfg: BatchingConfig,
                  attn_impl: str) -> Rollout:
  """The whole sampler as one program: prefill, then the decode loop."""
  g = _call(graphdef, state, prompt_ids, prompt_lengths, key, scfg, ccfg, bcfg, attn_impl)
  return _decode(g, _prefill(g, prompt_ids), prompt_lengths)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _prefill_jit(graphdef, state, prompt_ids, prompt_lengths, key, *,
                 scfg: SamplingConfig, ccfg: CacheConfig, bcfg: BatchingConfig,
                 attn_impl: str) -> DecodeState:
  """The prefill alone (`run_phase("prefill")`)."""
  g = _call(graphdef, state, prompt_ids, prompt_lengths, key, scfg, ccfg, bcfg, attn_impl)
  return _prefill(g, prompt_ids)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _decode_jit(graphdef, state, prompt_ids, prompt_lengths, key, carry: DecodeState, *,
                scfg: SamplingConfig, ccfg: CacheConfig, bcfg: BatchingConfig,
                attn_impl: str) -> Rollout:
  """The decode loop alone, from the prefill's state (`run_phase("decode")`)."""
  g = _call(graphdef, state, prompt_ids, prompt_lengths, key, scfg, ccfg, bcfg, attn_impl)
  return _decode(g, carry, prompt_lengths)


def _record(out: Outputs, rows: jax.Array, at: jax.Array, tok: jax.Array, logp: jax.Array,
            dist: jax.Array, ent: jax.Array, scfg: SamplingConfig) -> Outputs:
  """Writes the tokens sampled for rows [S] at array indices at [S] (tok, logp, ent [S],
  dist [S, V]); a row id of B drops the write (slots that are not decoding)."""
  put = lambda buf, val: buf.at[rows, at].set(val.astype(buf.dtype), mode="drop")
  new = dict(tokens=put(out.tokens, tok), logp=put(out.logp, logp),
             entropy=put(out.entropy, ent), mask=put(out.mask, jnp.ones_like(tok)),
             done=out.done.at[rows].set(_is_eos(tok, scfg.eos_ids), mode="drop"))
  if scfg.keep_topk_logprobs:
    tv, ti = jax.lax.top_k(dist, scfg.keep_topk_logprobs)
    new.update(topk_logp=put(out.topk_logp, tv), topk_ids=put(out.topk_ids, ti))
  if scfg.keep_full_logprobs:
    new["full_logp"] = put(out.full_logp, dist)
  return _on_rows(out.replace(**new))


def _on_rows(out: Outputs) -> Outputs:
  """`out` pinned to the mesh's batch sharding (rows over data x fsdp) when a mesh is set.
  Its writes are scatters from slots to rows, which leave the partitioner free to replicate
  every [B, ...] output on every device; it did: the 8B config's [B, L, K, T] retention
  records and top-k log-probs cost 3.4 GB per chip of 64, beside the same again as the
  loop's buffers."""
  return jax.tree.map(lambda x: shd.constrain(x, (shd.BATCH,) + (None,) * (x.ndim - 1)), out)


def _is_eos(tok: jax.Array, eos_ids) -> jax.Array:
  """tok [B] -> [B] bool."""
  if not eos_ids:
    return jnp.zeros(tok.shape, bool)
  return jnp.any(tok[:, None] == jnp.asarray(eos_ids, jnp.int32)[None, :], axis=1)
