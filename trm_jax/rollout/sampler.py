"""The sampler: jitted prefill plus one `lax.while_loop` decode, with an exact retention record.

`generate(model, prompt_ids, prompt_lengths, ...)` splits the NNX model (`nnx.split`) and calls
one `jax.jit`-compiled pure function that merges it inside (nnx.jit's per-call graph traversal
is ~15x slower to dispatch). Everything static (sampling and cache configs, the graph) is a
static argument, so calls with the same bucketed shapes reuse one executable.

Indexing. Prompts are left-padded to the bucket P; all rows then share array indices: the
prompt ends at P - 1, token P is sampled from the prefill's last logits, and decode query i
(i = P .. P + N - 2) feeds token i and samples token i + 1. RoPE position of index i in row b
is i - (P - len_b), which is what `Decoder`'s default positions give the learner for
`segment_ids` = 1 on valid tokens. `evicted_at` uses the same array indices.

Exactness. Prefill attention uses the whole prompt (`kernels.attention`, as the model does);
compression happens after it, so dropped prompt keys get evicted_at = P. During decoding, query
i attends exactly the keys held after `eviction.evict` + `cache.insert`, i.e. the keys j <= i
with evicted_at[j] > i: the learner's `model(tokens, visibility=Visibility(segment_ids,
evicted_at))` replays the same attention. Rows that finished keep running (static shapes);
their later tokens are pad_id with segment id 0, invisible to the learner.

Mismatch knobs (rollout != learner, for TRM experiments): `compute_dtype` (e.g. bf16 sampling
of an fp32 model), `logit_noise`, `router_noise_scale` (MoE layers), and stale parameters:
pass the stale model (or its state to `generate_from_state`). Logit noise for the token at
index i + 1 is `logit_noise * normal(fold_in(stream_keys(key)[1], i), [B, V])`, so a test or an
analysis can replay it.

Costs worth knowing: H2O's prefill scores materialise the prompt's [B, K, G, P, P] attention
probabilities once (the column sums are what H2O accumulates); SnapKV only needs the window's
[B, K, G, W, P]. Decode attention reads all C slots every step (empty ones masked), so the
dense cache costs P + N - 1 slots per step from the first step on.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trm_jax.kernels.attention import attention
from trm_jax.kernels.visibility import NEVER_EVICTED, LayerVisibility
from trm_jax.rollout import cache as kv
from trm_jax.rollout import eviction, sampling
from trm_jax.rollout.types import CacheConfig, Rollout, RolloutStats, SamplingConfig


def generate(model, prompt_ids, prompt_lengths, *, max_new_tokens: int, key: jax.Array,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
             greedy: bool = False, eos_ids: Optional[Sequence[int]] = None,
             pad_id: Optional[int] = None, cache: CacheConfig = CacheConfig(),
             keep_topk_logprobs: int = 0, keep_full_logprobs: bool = False,
             compute_dtype=None, logit_noise: float = 0.0, router_noise_scale: float = 0.0,
             attn_impl: str = "auto") -> Rollout:
  """Samples `max_new_tokens` continuations of left-padded prompts.

  Args:
    model: a `trm_jax.models.Decoder` (a stale copy gives stale-parameter rollouts).
    prompt_ids: [B, P] int32, left-padded (bucket P to avoid recompiles).
    prompt_lengths: [B] int32 valid tokens per row, 1 <= len <= P.
    max_new_tokens: N; the output has T = P + N columns.
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
    attn_impl: prefill attention implementation (`kernels.attention`).
  Returns:
    `Rollout`.
  """
  cfg = model.config
  if eos_ids is None:
    e = cfg.eos_token_id
    eos_ids = () if e is None else ((e,) if isinstance(e, int) else tuple(e))
  if pad_id is None:
    p = cfg.pad_token_id
    pad_id = 0 if p is None else (p if isinstance(p, int) else p[0])
  scfg = SamplingConfig(
      max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
      greedy=greedy, eos_ids=tuple(eos_ids), pad_id=pad_id,
      keep_topk_logprobs=keep_topk_logprobs, keep_full_logprobs=keep_full_logprobs,
      logit_noise=logit_noise, router_noise_scale=router_noise_scale)
  graphdef, state = nnx.split(model)
  if compute_dtype is not None:
    graphdef = _graphdef_with_dtype(type(model), cfg, jnp.dtype(compute_dtype).name)
  return generate_from_state(graphdef, state, prompt_ids, prompt_lengths, key=key,
                             sampling_config=scfg, cache_config=cache, attn_impl=attn_impl)


def generate_from_state(graphdef, state, prompt_ids, prompt_lengths, *, key: jax.Array,
                        sampling_config: SamplingConfig,
                        cache_config: CacheConfig = CacheConfig(),
                        attn_impl: str = "auto") -> Rollout:
  """`generate` for callers that already hold `nnx.split(model)` (training loops)."""
  prompt_ids = jnp.asarray(prompt_ids)
  prompt_lengths = jnp.asarray(prompt_lengths)
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
  return _generate_jit(graphdef, state, prompt_ids.astype(jnp.int32),
                       prompt_lengths.astype(jnp.int32), key, scfg=sampling_config,
                       ccfg=cache_config, attn_impl=attn_impl, phase="all")


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
  """The two halves of `generate` as separately jitted programs, for profiling (bench).

  phase="prefill" returns the decode loop's initial carry; phase="decode" runs the loop from
  `carry` (same other arguments) and returns the `Rollout`. `generate` compiles both halves
  into one program.
  """
  if phase not in ("prefill", "decode"):
    raise ValueError(f"phase={phase!r}; expected 'prefill' or 'decode'")
  if (phase == "decode") != (carry is not None):
    raise ValueError("carry is required for phase='decode' and only for it")
  return _generate_jit(graphdef, state, jnp.asarray(prompt_ids, jnp.int32),
                       jnp.asarray(prompt_lengths, jnp.int32), key, carry,
                       scfg=sampling_config, ccfg=cache_config, attn_impl=attn_impl,
                       phase=phase)


@functools.partial(jax.jit,
                   static_argnames=("graphdef", "scfg", "ccfg", "attn_impl", "phase"))
def _generate_jit(graphdef, state, prompt_ids, prompt_lengths, key, carry=None, *,
                  scfg: SamplingConfig, ccfg: CacheConfig, attn_impl: str,
                  phase: str = "all"):
  model = nnx.merge(graphdef, state)
  B, P = prompt_ids.shape
  N = scfg.max_new_tokens
  T = P + N
  L = len(model.layers)
  K = model.config.num_kv_heads
  Cp, C = kv.prompt_slots(ccfg, P, N), kv.num_slots(ccfg, P, N)
  scope = ccfg.resolved_scope
  k_sample, k_noise, k_router, k_evict = stream_keys(key)

  start = P - prompt_lengths                                          # [B]
  idx = jnp.arange(P, dtype=jnp.int32)
  valid = idx[None, :] >= start[:, None]                              # [B, P]
  positions = jnp.maximum(idx[None, :] - start[:, None], 0)           # [B, P]
  keep, budget = kv.row_budgets(ccfg, prompt_lengths, P, N)           # [B], [B]

  def mlp(layer, x, step):
    if scfg.router_noise_scale > 0:
      return layer.mlp(x, router_noise_key=jax.random.fold_in(k_router, step),
                       router_noise_scale=scfg.router_noise_scale)
    return layer.mlp(x)

  def next_token(h, step):
    """h [B, D] hidden state of query `step` -> (tokens, logp, dist) for index step + 1."""
    logits = model.unembed(model.final_norm(h))                       # [B, V] fp32
    if scfg.logit_noise > 0:
      logits = logits + scfg.logit_noise * jax.random.normal(
          jax.random.fold_in(k_noise, step), logits.shape, jnp.float32)
    return sampling.sample(jax.random.fold_in(k_sample, step), logits, scfg)

  if phase == "decode":
    carry = tuple(carry)
  else:
    # --- (1) prefill: full-prompt attention, then per-layer compression ---------------------
    evicted_at = jnp.full((B, L, K, T), NEVER_EVICTED, jnp.int32)
    vis = LayerVisibility(segment_ids=valid.astype(jnp.int32))
    x = model.embed(prompt_ids)
    caches = []
    for l, layer in enumerate(model.layers):
      q, k, v = layer.attn.qkv(layer.input_norm(x), positions)
      x = x + layer.attn.out(attention(q, k, v, vis, impl=attn_impl))
      x = x + mlp(layer, layer.post_attn_norm(x), P - 1)
      score = eviction.prompt_scores(ccfg, q, k, valid)                 # [B, K, P]
      kept = eviction.select_prompt(ccfg, valid, score, keep, start=start, budget=budget,
                                    layer=l, rand_key=k_evict)          # [B, K, P]
      dropped = valid[:, None, :] & ~kept
      evicted_at = evicted_at.at[:, l, :, :P].set(
          jnp.where(dropped, P, evicted_at[:, l, :, :P]))
      caches.append(kv.from_prompt(k, v, kept, score if ccfg.policy == "h2o" else
                                   jnp.zeros_like(score), num_prompt_slots=Cp,
                                   num_total_slots=C))
    tok, logp, dist = next_token(x[:, -1], P - 1)

    # --- (2) output buffers ----------------------------------------------------------------
    tokens = jnp.concatenate([prompt_ids, jnp.full((B, N), scfg.pad_id, jnp.int32)], axis=1)
    tokens = tokens.at[:, P].set(tok)
    zeros = jnp.zeros((B, T), jnp.float32)
    out = dict(tokens=tokens, logp=zeros.at[:, P].set(logp),
               entropy=zeros.at[:, P].set(sampling.entropy(dist)),
               mask=jnp.zeros((B, T), jnp.int32).at[:, P].set(1))
    if scfg.keep_topk_logprobs:
      tv, ti = jax.lax.top_k(dist, scfg.keep_topk_logprobs)
      kk = scfg.keep_topk_logprobs
      out["topk_logp"] = jnp.zeros((B, T, kk), jnp.float32).at[:, P].set(tv)
      out["topk_ids"] = jnp.zeros((B, T, kk), jnp.int32).at[:, P].set(ti.astype(jnp.int32))
    if scfg.keep_full_logprobs:
      out["full_logp"] = jnp.zeros((B, T, dist.shape[-1]), jnp.float32).at[:, P].set(dist)
    done = _is_eos(tok, scfg.eos_ids)
    carry = (jnp.int32(P), out, tuple(caches), evicted_at, done)
    if phase == "prefill":
      return carry

  # --- (3) decode: query i feeds token i and samples token i + 1 ---------------------------
  def cond(carry):
    i, _, _, _, done = carry
    return (i < T - 1) & ~jnp.all(done)

  def body(carry):
    i, out, caches, evicted_at, done = carry
    tok_i = jax.lax.dynamic_slice_in_dim(out["tokens"], i, 1, axis=1)     # [B, 1]
    pos_i = (i - start)[:, None]                                        # [B, 1]
    x = model.embed(tok_i)
    new_caches = []
    for l, layer in enumerate(model.layers):
      q, k, v = layer.attn.qkv(layer.input_norm(x), pos_i)   # [B,1,N,H], [B,1,K,H]
      c = caches[l]
      if scope == "sequence":
        c, evicted_at, slot = eviction.evict(ccfg, c, evicted_at, layer=l, step=i,
                                             start=start, budget=budget, prompt_len=P,
                                             rand_key=k_evict)
        c = kv.insert(c, slot, k[:, 0], v[:, 0], i, uniform=False)
      else:
        s = i if scope is None else Cp + (i - P)
        c = kv.insert(c, jnp.full((B, K), s, jnp.int32), k[:, 0], v[:, 0], i, uniform=True)
      o, p = kv.attend(q[:, 0], c)                                      # p [B, K, G, C]
      if ccfg.policy == "h2o":
        c = c.replace(score=c.score + p.sum(axis=2))
      new_caches.append(c)
      x = x + layer.attn.out(o[:, None])
      x = x + mlp(layer, layer.post_attn_norm(x), i)
    tok, logp, dist = next_token(x[:, 0], i)
    alive = ~done
    tok = jnp.where(alive, tok, scfg.pad_id)
    put = lambda buf, val: jax.lax.dynamic_update_slice_in_dim(
        buf, val[:, None].astype(buf.dtype), i + 1, axis=1)
    out = dict(out)
    out["tokens"] = put(out["tokens"], tok)
    out["logp"] = put(out["logp"], jnp.where(alive, logp, 0.0))
    out["entropy"] = put(out["entropy"], jnp.where(alive, sampling.entropy(dist), 0.0))
    out["mask"] = put(out["mask"], alive.astype(jnp.int32))
    if scfg.keep_topk_logprobs:
      tv, ti = jax.lax.top_k(dist, scfg.keep_topk_logprobs)
      out["topk_logp"] = put(out["topk_logp"], jnp.where(alive[:, None], tv, 0.0))
      out["topk_ids"] = put(out["topk_ids"], jnp.where(alive[:, None], ti, 0))
    if scfg.keep_full_logprobs:
      out["full_logp"] = put(out["full_logp"], jnp.where(alive[:, None], dist, 0.0))
    done = done | (alive & _is_eos(tok, scfg.eos_ids))
    return i + 1, out, tuple(new_caches), evicted_at, done

  i, out, caches, evicted_at, done = jax.lax.while_loop(cond, body, carry)

  mask = out["mask"]
  return Rollout(
      tokens=out["tokens"],
      segment_ids=jnp.concatenate([valid.astype(jnp.int32), mask[:, P:]], axis=1),
      prompt_lengths=prompt_lengths,
      response_lengths=jnp.sum(mask, axis=1).astype(jnp.int32),
      response_mask=mask,
      logp=out["logp"],
      evicted_at=evicted_at,
      stats=RolloutStats(finished=done, decode_steps=i - P, entropy=out["entropy"],
                         cache_slots=C, cache_bytes=kv.nbytes([(c.k, c.v) for c in caches])),
      topk_ids=out.get("topk_ids"), topk_logp=out.get("topk_logp"),
      full_logp=out.get("full_logp"))


def _is_eos(tok: jax.Array, eos_ids) -> jax.Array:
  """tok [B] -> [B] bool."""
  if not eos_ids:
    return jnp.zeros(tok.shape, bool)
  return jnp.any(tok[:, None] == jnp.asarray(eos_ids, jnp.int32)[None, :], axis=1)
