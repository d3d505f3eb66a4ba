"""The sampler: jitted prefill plus one `lax.while_loop` decode, with an exact retention record.

`generate(model, prompt_ids, prompt_lengths, ...)` splits the NNX model (`nnx.split`) and calls
one `jax.jit`-compiled pure function that merges it inside (nnx.jit's per-call graph traversal
is ~15x slower to dispatch). Everything static (sampling and cache configs, the graph) is a
static argument, so calls with the same bucketed shapes reuse one executable.

The model's own blocks do the work (`Decoder.prefill`, then `Decoder.decode_step` per token,
with `eviction.CacheEviction` as the cache policy); this module keeps the loop, the output
buffers (`DecodeState`) and sampling.

Indexing. Prompts are left-padded to the bucket P; R new tokens follow, T = P + R. All rows
share array indices: the prompt ends at P - 1, token P is sampled from the prefill's last
logits, and decode query i (i = P .. P + R - 2) feeds token i and samples token i + 1. RoPE
position of index i in row b is i - (P - len_b), which is what `Decoder`'s default positions
give the learner for `segment_ids` = 1 on valid tokens. `evicted_at` uses the same array
indices.

Exactness. Prefill attention uses the whole prompt (`kernels.attention`, as the model does);
compression happens after it, so dropped prompt keys get evicted_at = P. During decoding, query
i attends exactly the keys held after `eviction.evict` + `kv_cache.write`, i.e. the keys j <= i
with evicted_at[j] > i: the learner's `model(tokens, visibility=Visibility(segment_ids,
evicted_at))` replays the same attention. Rows that finished keep running (static shapes);
their later tokens are pad_id with segment id 0, invisible to the learner.

Mismatch knobs (rollout != learner, for TRM experiments): `compute_dtype` (e.g. bf16 sampling
of an fp32 model), `logit_noise`, `router_noise_scale` (MoE layers), and stale parameters:
pass the stale model (or its state to `generate_from_state`). Logit noise for the token at
index i + 1 is `logit_noise * sampling.gaussian_noise(fold_in(stream_keys(key)[1], i), (B, V))`,
so a test or an analysis can replay it.

Costs worth knowing: H2O's prefill scores materialise the prompt's [B, K, G, P, P] attention
probabilities once (the column sums are what H2O accumulates); SnapKV only needs the window's
[B, K, G, W, P]. Decode attention reads all C slots every step (empty ones masked), so the
dense cache costs P + R - 1 slots per step from the first step on.

Where a decode step's time goes (`python -m bench.decode_profile`, bench model: Qwen3 4 layers,
d 512, vocab 32000; batch 8, prompt 128, 128 new tokens, dense cache; quiet 2-core CPU; summed
thunk times, ms per step; bench/results/decode_profile.json):

                        fp32 before  fp32 after   bf16 before  bf16 after
  Gumbel noise, PRNG       2.55        0.01          2.52        0.01
  vocabulary projection    1.92        2.01          1.60        1.46
  MLP matmuls              1.98        1.90          1.87        1.45
  q/k/v/o matmuls          1.00        0.81          0.96        0.61
  attention                1.10        1.10          0.53        0.65
  sampling, entropy        0.10        0.15          0.12        0.14
  cache writes             0.07        0.05          0.33        0.06
  loop, casts, other       0.90        0.09          1.22        0.33
  wall per step            8.85        5.32          8.16        4.13

Before: `jax.random.categorical` (threefry Gumbel noise for all V entries, two logs and an
argmax per row), fp32 copies of every bf16 weight made per call (XLA:CPU upcasts a bf16 x
bf16 -> bf16 matmul) and read at every step, the o_proj weight re-laid-out at every step, bf16
cache writes through fp32. After: `sampling.inverse_cdf` with one uniform per row, fp32
accumulation requested so bf16 weights stay bf16 (`layers.project`), o_proj contracted as one
[N*H] dimension, bf16 tables and caches updated as their bits. What is left is the matmuls
(memory bound: the weights are read once per step) and attention over the cache.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from trm_jax.kernels.visibility import Visibility
from trm_jax.models.kv_cache import KVCache
from trm_jax.models.protocol import CausalLM
from trm_jax.rollout import cache as kv
from trm_jax.rollout import eviction, sampling
from trm_jax.rollout.types import CacheConfig, Rollout, RolloutStats, SamplingConfig


@struct.dataclass
class DecodeState:
  """The decode loop's carry, and what `run_phase("prefill")` returns. T = P + R."""
  index: jax.Array               # [] int32 next query i: feeds tokens[:, i], samples i + 1
  tokens: jax.Array              # [B, T] int32 prompt, sampled tokens, pad_id elsewhere
  logp: jax.Array                # [B, T] fp32 log-prob of each sampled token, 0 elsewhere
  entropy: jax.Array             # [B, T] fp32 entropy of each sampled distribution
  mask: jax.Array                # [B, T] int32 1 on generated tokens up to and including EOS
  done: jax.Array                # [B] bool the row emitted an EOS
  caches: Tuple[KVCache, ...]    # L caches: k, v [B, K, C, H]; pos, score [B, K, C];
                                 #   evicted_at [B, K, T]
  topk_logp: Optional[jax.Array] = None  # [B, T, k] fp32 (keep_topk_logprobs)
  topk_ids: Optional[jax.Array] = None   # [B, T, k] int32
  full_logp: Optional[jax.Array] = None  # [B, T, V] fp32 (keep_full_logprobs)
  routed: Optional[jax.Array] = None     # [B, L_moe, T, k] expert ids (record_routing);
                                         #   -1 where no token was fed (the last index)


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
             record_routing: bool = False, attn_impl: str = "auto") -> Rollout:
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
    attn_impl: prefill attention implementation (`kernels.attention`).
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
                             attn_impl=attn_impl)


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
                        attn_impl: str = "auto") -> Rollout:
  """`generate` for callers that already hold the model's graph and state (training loops).

  `graphdef` from `sampler_graphdef`, `state` the model's whole state (`nnx.split(model)[1]`,
  or `nnx.merge_state(params, rest)`), `sampling_config` from `sampling_config`.
  """
  prompt_ids, prompt_lengths = check_prompts(prompt_ids, prompt_lengths)
  return _generate_jit(graphdef, state, prompt_ids, prompt_lengths, key,
                       scfg=sampling_config, ccfg=cache_config, attn_impl=attn_impl)


def check_prompts(prompt_ids, prompt_lengths) -> tuple[jax.Array, jax.Array]:
  """(prompt_ids, prompt_lengths) as int32 arrays, after checking their shapes and, for
  concrete lengths, that each is in [1, P]; a ValueError names what is wrong."""
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
  return prompt_ids.astype(jnp.int32), prompt_lengths.astype(jnp.int32)


def make_generate(graphdef, sampling_config: SamplingConfig,
                  cache_config: CacheConfig = CacheConfig(), attn_impl: str = "auto"):
  """jit(state, prompt_ids, prompt_lengths, key) -> Rollout: `generate_from_state` with its
  static settings bound, as one jitted program (`.lower(...)` compiles it ahead of time).
  Its inputs are not checked: pass them through `check_prompts` first."""
  return jax.jit(functools.partial(_generate_jit, graphdef, scfg=sampling_config,
                                   ccfg=cache_config, attn_impl=attn_impl))


def stream_keys(key: jax.Array):
  """The independent PRNG streams of one `generate` call: (sample, logit noise, router noise,
  random eviction). Each is folded with the query index that uses it."""
  return tuple(jax.random.split(key, 4))


@functools.lru_cache(maxsize=None)
def _graphdef_with_dtype(cls, config, dtype_name: str):
  """Graph of the same model computing in another dtype (same state layout)."""
  abstract = nnx.eval_shape(lambda: cls(config.replace(dtype=dtype_name), rngs=nnx.Rngs(0)))
  return nnx.split(abstract)[0]


def run_phase(phase: str, graphdef, state, prompt_ids, prompt_lengths, *, key: jax.Array,
              sampling_config: SamplingConfig, cache_config: CacheConfig = CacheConfig(),
              carry=None, attn_impl: str = "auto"):
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
  args = (graphdef, state, jnp.asarray(prompt_ids, jnp.int32),
          jnp.asarray(prompt_lengths, jnp.int32), key)
  static = dict(scfg=sampling_config, ccfg=cache_config, attn_impl=attn_impl)
  if phase == "prefill":
    return _prefill_jit(*args, **static)
  return _decode_jit(*args, carry, **static)


@dataclasses.dataclass(frozen=True)
class _Call:
  """What both phases of one generate call derive from its inputs (traced arrays)."""
  model: CausalLM
  scfg: SamplingConfig
  policy: eviction.CacheEviction   # the cache policy of every layer
  start: jax.Array                 # [B] int32 array index of each row's first valid token
  valid: jax.Array                 # [B, P] bool non-padding prompt positions
  k_sample: jax.Array              # the sampling, logit-noise and router-noise streams
  k_noise: jax.Array
  k_router: jax.Array

  def router_noise(self, step) -> dict:
    """The MoE router jitter of query `step` (a fresh key per query index)."""
    if self.scfg.router_noise_scale > 0:
      return dict(router_noise_key=jax.random.fold_in(self.k_router, step),
                  router_noise_scale=self.scfg.router_noise_scale)
    return {}

  def next_token(self, h, step):
    """h [B, D] final-normed hidden state of query `step` -> (tokens, logp, dist, entropy)
    for index step + 1."""
    with jax.named_scope("unembed"):
      logits = self.model.unembed(h)                                  # [B, V] fp32
    if self.scfg.logit_noise > 0:
      logits = logits + self.scfg.logit_noise * sampling.gaussian_noise(
          jax.random.fold_in(self.k_noise, step), logits.shape)
    return sampling.draw(jax.random.fold_in(self.k_sample, step), logits, self.scfg)


def _call(graphdef, state, prompt_ids, prompt_lengths, key, scfg: SamplingConfig,
          ccfg: CacheConfig) -> _Call:
  model: CausalLM = nnx.merge(graphdef, state)
  P = prompt_ids.shape[1]
  R = scfg.max_new_tokens
  k_sample, k_noise, k_router, k_evict = stream_keys(key)
  start = P - prompt_lengths                                          # [B]
  valid = jnp.arange(P, dtype=jnp.int32)[None, :] >= start[:, None]   # [B, P]
  keep, budget = kv.row_budgets(ccfg, prompt_lengths, P, R)           # [B], [B]
  policy = eviction.CacheEviction(ccfg, valid=valid, start=start, keep=keep, budget=budget,
                                  length=P + R, prompt_slots=kv.prompt_slots(ccfg, P, R),
                                  total_slots=kv.num_slots(ccfg, P, R), rand_key=k_evict)
  return _Call(model=model, scfg=scfg, policy=policy, start=start, valid=valid,
               k_sample=k_sample, k_noise=k_noise, k_router=k_router)


def _prefill(g: _Call, prompt_ids, attn_impl: str) -> DecodeState:
  """The blocks over the whole prompt, each layer's cache from its q/k/v, and the first
  sampled token (index P): the decode loop's initial state."""
  model, scfg = g.model, g.scfg
  B, P = prompt_ids.shape
  R = scfg.max_new_tokens
  T = P + R
  idx = jnp.arange(P, dtype=jnp.int32)
  h, caches, routing = model.prefill(
      prompt_ids, g.policy, positions=jnp.maximum(idx[None, :] - g.start[:, None], 0),
      visibility=Visibility(segment_ids=g.valid.astype(jnp.int32)), attn_impl=attn_impl,
      with_routing=True, **g.router_noise(P - 1))
  routed = None
  if scfg.record_routing:
    if routing is None:
      raise ValueError("record_routing=True needs a model with MoE layers; this "
                       f"{model.config.model_type} model has none")
    rdt = routing_dtype(model.config.num_experts)
    routed = jnp.concatenate([routing.chosen.astype(rdt), jnp.full(
        routing.chosen.shape[:2] + (R,) + routing.chosen.shape[3:], -1, rdt)], axis=2)
  zeros = jnp.zeros((B, T), jnp.float32)
  kk = scfg.keep_topk_logprobs
  V = model.config.vocab_size
  s = DecodeState(
      index=jnp.int32(P),
      tokens=jnp.concatenate([prompt_ids, jnp.full((B, R), scfg.pad_id, jnp.int32)], axis=1),
      logp=zeros, entropy=zeros, mask=jnp.zeros((B, T), jnp.int32),
      done=jnp.zeros((B,), bool), caches=caches,
      topk_logp=jnp.zeros((B, T, kk), jnp.float32) if kk else None,
      topk_ids=jnp.zeros((B, T, kk), jnp.int32) if kk else None,
      full_logp=jnp.zeros((B, T, V), jnp.float32) if scfg.keep_full_logprobs else None,
      routed=routed)
  return _record(s, P, *g.next_token(h, P - 1), scfg)


def _decode(g: _Call, s: DecodeState, prompt_lengths) -> Rollout:
  """The decode loop from `s`: query i feeds token i and samples token i + 1, until every
  row has finished or T - 1 is reached; the `Rollout` with its retention record."""
  model, scfg = g.model, g.scfg
  B, P = g.valid.shape
  T = P + scfg.max_new_tokens

  def cond(s: DecodeState):
    return (s.index < T - 1) & ~jnp.all(s.done)

  def body(s: DecodeState) -> DecodeState:
    i = s.index
    h, caches, routing = model.decode_step(
        jax.lax.dynamic_slice_in_dim(s.tokens, i, 1, axis=1), s.caches, g.policy,
        positions=(i - g.start)[:, None], index=i, with_routing=True, **g.router_noise(i))
    if scfg.record_routing:   # the experts token i ran through, in every MoE layer
      s = s.replace(routed=jax.lax.dynamic_update_slice_in_dim(
          s.routed, routing.chosen.astype(s.routed.dtype), i, axis=2))
    s = _record(s.replace(caches=caches), i + 1, *g.next_token(h, i), scfg)
    return s.replace(index=i + 1)

  s = jax.lax.while_loop(cond, body, s)

  return Rollout(
      tokens=s.tokens,
      segment_ids=jnp.concatenate([g.valid.astype(jnp.int32), s.mask[:, P:]], axis=1),
      prompt_lengths=prompt_lengths,
      response_lengths=jnp.sum(s.mask, axis=1).astype(jnp.int32),
      response_mask=s.mask,
      logp=s.logp,
      evicted_at=jnp.stack([c.evicted_at for c in s.caches], axis=1),   # [B, L, K, T]
      stats=RolloutStats(finished=s.done, decode_steps=s.index - P, entropy=s.entropy,
                         cache_slots=g.policy.total_slots,
                         cache_bytes=kv.nbytes([(c.k, c.v) for c in s.caches])),
      topk_ids=s.topk_ids, topk_logp=s.topk_logp, full_logp=s.full_logp,
      routed_experts=s.routed)


_STATIC = ("graphdef", "scfg", "ccfg", "attn_impl")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _generate_jit(graphdef, state, prompt_ids, prompt_lengths, key, *,
                  scfg: SamplingConfig, ccfg: CacheConfig, attn_impl: str) -> Rollout:
  """The whole sampler as one program: prefill, then the decode loop."""
  g = _call(graphdef, state, prompt_ids, prompt_lengths, key, scfg, ccfg)
  return _decode(g, _prefill(g, prompt_ids, attn_impl), prompt_lengths)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _prefill_jit(graphdef, state, prompt_ids, prompt_lengths, key, *,
                 scfg: SamplingConfig, ccfg: CacheConfig, attn_impl: str) -> DecodeState:
  """The prefill alone (`run_phase("prefill")`)."""
  g = _call(graphdef, state, prompt_ids, prompt_lengths, key, scfg, ccfg)
  return _prefill(g, prompt_ids, attn_impl)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _decode_jit(graphdef, state, prompt_ids, prompt_lengths, key, carry: DecodeState, *,
                scfg: SamplingConfig, ccfg: CacheConfig, attn_impl: str) -> Rollout:
  """The decode loop alone, from the prefill's state (`run_phase("decode")`)."""
  del attn_impl   # the decode loop attends through the cache
  g = _call(graphdef, state, prompt_ids, prompt_lengths, key, scfg, ccfg)
  return _decode(g, carry, prompt_lengths)


def _record(s: DecodeState, at, tok: jax.Array, logp: jax.Array, dist: jax.Array,
            ent: jax.Array, scfg: SamplingConfig) -> DecodeState:
  """Writes the token sampled for array index `at` (tok, logp, ent [B], dist [B, V]); rows
  that already finished get pad_id and zeros."""
  alive = ~s.done
  tok = jnp.where(alive, tok, scfg.pad_id)

  def put(buf, val):
    return jax.lax.dynamic_update_slice_in_dim(buf, val[:, None].astype(buf.dtype), at, axis=1)
  new = dict(tokens=put(s.tokens, tok), logp=put(s.logp, jnp.where(alive, logp, 0.0)),
             entropy=put(s.entropy, jnp.where(alive, ent, 0.0)),
             mask=put(s.mask, alive.astype(jnp.int32)),
             done=s.done | (alive & _is_eos(tok, scfg.eos_ids)))
  if scfg.keep_topk_logprobs:
    tv, ti = jax.lax.top_k(dist, scfg.keep_topk_logprobs)
    new.update(topk_logp=put(s.topk_logp, jnp.where(alive[:, None], tv, 0.0)),
               topk_ids=put(s.topk_ids, jnp.where(alive[:, None], ti, 0)))
  if scfg.keep_full_logprobs:
    new["full_logp"] = put(s.full_logp, jnp.where(alive[:, None], dist, 0.0))
  return s.replace(**new)


def _is_eos(tok: jax.Array, eos_ids) -> jax.Array:
  """tok [B] -> [B] bool."""
  if not eos_ids:
    return jnp.zeros(tok.shape, bool)
  return jnp.any(tok[:, None] == jnp.asarray(eos_ids, jnp.int32)[None, :], axis=1)
