"""Static configuration and the output record of the rollout engine.

`CacheConfig` and `SamplingConfig` are frozen, hashable dataclasses: they are static arguments
of the jitted sampler, so one compiled program serves every call with the same config and the
same (bucketed) shapes. `Rollout` is the pytree the learner consumes.

Dimension letters: B batch, P prompt length (bucket), R max new tokens, T = P + R, L layers,
K kv heads, V vocab, C cache slots.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax
from flax import struct

DENSE = "none"   # CacheConfig.policy of the dense cache; any other value names an entry of
                 #   rollout.policies.POLICIES (snapkv, h2o, recent, random, ...)
SCOPES = ("prompt", "sequence")
# Compression ratios are resolved on a 1e-4 grid so that budgets are computed with integer
# arithmetic, identically in numpy (static capacity) and in jnp (per-row budgets).
RATIO_GRID = 10_000


@dataclasses.dataclass(frozen=True)
class CacheConfig:
  """Which KV cache the sampler keeps and how it evicts.

  Budget, per row b with valid prompt length len_b (exactly one of `ratio` / `capacity` for
  every policy but "none"):
    scope="prompt"   (SnapKV's setting; default for snapkv): after prefill the prompt keeps
                     ceil((1 - ratio) * len_b) keys (or min(capacity, len_b)); every generated
                     key is kept. No eviction during decoding.
    scope="sequence" (default for h2o / recent / random): the cache holds at most
                     ceil((1 - ratio) * (len_b + max_new_tokens)) keys (or `capacity`) at any
                     time, so a full-length rollout ends with a fraction `ratio` evicted; the
                     prompt is compressed to that budget after prefill, and one key is evicted
                     before each decode step that would overflow it.
  The cache memory is its static slot count C (see `cache.num_slots`), never T.

  The defaults below are the papers' values, for direct use of the library; the trainer
  always passes the config's `rollout.cache` settings the policy reads (programs.cache_config).
  """
  policy: str = DENSE           # "none" or a registered policy (rollout.policies.POLICIES)
  ratio: Optional[float] = None  # fraction of keys removed, in [0, 1)
  capacity: Optional[int] = None  # absolute budget in keys (alternative to ratio)
  scope: Optional[str] = None   # "prompt" | "sequence"; None = the policy's default
  window: int = 32              # SnapKV observation window (queries; SnapKV paper: 32)
  kernel: int = 7               # SnapKV pooling kernel over keys (odd; SnapKV paper: 7)
  pooling: str = "max"          # SnapKV pooling: "max" | "avg"
  recent_frac: float = 0.5      # H2O: share of the budget reserved for the most recent keys
  sinks: int = 4                # StreamingLLM: first valid tokens never evicted

  def __post_init__(self):
    policy = self.eviction_policy          # raises for an unregistered name
    if policy is None:
      if self.ratio is not None or self.capacity is not None:
        raise ValueError("CacheConfig(policy='none') takes neither ratio nor capacity")
    elif (self.ratio is None) == (self.capacity is None):
      raise ValueError(f"CacheConfig(policy={self.policy!r}) needs exactly one of ratio= "
                       f"or capacity= (got ratio={self.ratio}, capacity={self.capacity})")
    if self.ratio is not None and not 0.0 <= self.ratio < 1.0:
      raise ValueError(f"CacheConfig.ratio={self.ratio} must be in [0, 1)")
    if self.capacity is not None and self.capacity < 1:
      raise ValueError(f"CacheConfig.capacity={self.capacity} must be >= 1")
    if self.scope is not None and self.scope not in SCOPES:
      raise ValueError(f"CacheConfig.scope={self.scope!r}; expected one of {SCOPES}")
    if policy is not None:
      if self.scope is not None and self.scope not in policy.scopes:
        raise ValueError(f"CacheConfig: policy {self.policy!r} supports scope "
                         f"{' or '.join(map(repr, policy.scopes))}, not {self.scope!r}")
      policy.check(self)

  @property
  def compresses(self) -> bool:
    """False for the dense cache (policy "none"), True for every eviction policy."""
    return self.policy != DENSE

  @property
  def eviction_policy(self):
    """The `rollout.policies.EvictionPolicy` registered as `policy`; None for the dense cache."""
    from trm_jax.rollout.policies import get_policy  # pylint: disable=g-import-not-at-top
    return get_policy(self.policy) if self.compresses else None   # (policies imports us)

  @property
  def resolved_scope(self) -> Optional[str]:
    """None for the dense cache, else "prompt" or "sequence"."""
    if not self.compresses:
      return None
    return self.scope if self.scope is not None else self.eviction_policy.scopes[0]

  @property
  def keep_num(self) -> Optional[int]:
    """(1 - ratio) on the RATIO_GRID, as an integer numerator; None when capacity is set."""
    if self.ratio is None:
      return None
    return int(round((1.0 - self.ratio) * RATIO_GRID))


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How tokens are drawn. All fields are static: changing one recompiles the sampler.

  The distribution sampled from is softmax(trunc((logits + noise) / temperature)) where trunc
  keeps the top_k logits and then the smallest top-p nucleus (ties at the threshold are all
  kept). `greedy` takes the argmax of logits + noise; its `logp` is then the untempered,
  untruncated log-softmax (the point mass would always give 0, useless to a learner).
  """
  max_new_tokens: int
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0                 # 0 = no top-k truncation
  greedy: bool = False
  eos_ids: Tuple[int, ...] = ()
  pad_id: int = 0                # written after EOS (and expected in the prompt's padding)
  keep_topk_logprobs: int = 0    # also return the top-k log-probs of each sampled distribution
  keep_full_logprobs: bool = False  # also return [B, T, V] log-probs (small vocabularies)
  logit_noise: float = 0.0       # std of additive Gaussian noise on the logits (mismatch knob)
  router_noise_scale: float = 0.0  # MoE router jitter passed to every layer.mlp (mismatch knob)
  record_routing: bool = False   # also return the MoE layers' expert choices (routing replay)

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
    if not self.greedy and not self.temperature > 0:
      raise ValueError(f"temperature={self.temperature} must be > 0 (use greedy=True)")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
    if self.top_k < 0 or self.keep_topk_logprobs < 0:
      raise ValueError(f"top_k={self.top_k} and keep_topk_logprobs="
                       f"{self.keep_topk_logprobs} must be >= 0")
    if self.logit_noise < 0 or self.router_noise_scale < 0:
      raise ValueError(f"logit_noise={self.logit_noise} and router_noise_scale="
                       f"{self.router_noise_scale} must be >= 0")
    object.__setattr__(self, "eos_ids", tuple(int(e) for e in self.eos_ids))

  @property
  def truncates(self) -> bool:
    return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


@dataclasses.dataclass(frozen=True)
class BatchingConfig:
  """How the sampler schedules a batch's rows (static: part of the compiled program).

  slots: S rows decode at once; when one finishes (EOS or max_new_tokens) the next row is
    loaded into its slot, on device. 0 (or >= B) = every row at once. Any S gives every row
    the same draws (they are keyed by row and array index), so it changes speed, not results
    beyond float rounding.
  group_size: G, rows [g*G, (g+1)*G) share one prompt (GRPO's rollouts of a problem); it is
    prefilled once per group and every row starts from that KV (B must be a multiple of G),
    unless the B / G prompts do not split over the mesh's batch shards: then every row is
    prefilled on its own (`sampler.prefill_group`).
  chunk: decode steps between two looks at the batch: after each chunk, free slots are
    refilled and the caches are cut to the smallest `cache.slot_buckets` size that holds
    every slot the next chunk can fill (so a step reads the live part of the cache, not its
    capacity). A row that finishes mid-chunk idles until the chunk ends.
  bucket: the granularity of those sizes in slots (`cache.slot_buckets`: at most 8 sizes,
    so at most 8 compiled decode chunks). Any value >= 1 works with any prompt length: the
    sizes start at the first one that holds a loaded prompt and one chunk of keys.
  refill: load rows into free slots once at least this many are free (fewer when fewer rows
    are left); 0 = max(1, S // 8). Loading copies the prompt's KV into the slots and samples
    their first tokens: cheaper batched than one row at a time.
  tail: once every row is loaded and at most S // tail slots still decode, they are packed
    into S // tail slots for the rest (the longest rows of a batch with EOS then stop paying
    for S slots); 1 = never. Unused when S = B.
  """
  slots: int = 0
  group_size: int = 1
  chunk: int = 16
  refill: int = 0
  bucket: int = 128
  tail: int = 4

  def __post_init__(self):
    if (self.slots < 0 or self.group_size < 1 or self.refill < 0 or self.chunk < 1
        or self.bucket < 1 or self.tail < 1):
      raise ValueError(f"BatchingConfig(slots={self.slots}, group_size={self.group_size}, "
                       f"chunk={self.chunk}, refill={self.refill}, bucket={self.bucket}, "
                       f"tail={self.tail}): "
                       f"slots and refill must be >= 0, the others >= 1")

  def sizes(self, B: int) -> Tuple[int, int]:
    """(S slots, refill threshold) for a batch of B rows."""
    if B % self.group_size:
      raise ValueError(f"batch of {B} rows is not a multiple of group_size={self.group_size}")
    S = B if self.slots == 0 or self.slots >= B else self.slots
    return S, min(S, self.refill or max(1, S // 8))


@struct.dataclass
class RolloutStats:
  """Sampler-side statistics."""
  finished: jax.Array          # [B] bool: the row emitted an EOS id
  decode_steps: jax.Array      # [] int32: decode steps run (each advances every decoding slot;
                               #   the loop exits when every row has finished)
  entropy: jax.Array           # [B, T] fp32 entropy of each sampled distribution; 0 elsewhere
  cache_slots: int = struct.field(pytree_node=False, default=0)   # C per layer per kv head
  cache_bytes: int = struct.field(pytree_node=False, default=0)   # K/V bytes of the cache
  stage_steps: Optional[jax.Array] = None  # [stages] int32 decode steps run in each stage of
                                           #   the loop: each cache bucket, then the tail


@struct.dataclass
class Rollout:
  """A batch of sampled sequences, in array indices along T = P + R (prompt left-padded)."""
  tokens: jax.Array            # [B, T] int32: prompt, response, pad_id after EOS
  segment_ids: jax.Array       # [B, T] int32: 1 on real prompt and response tokens, 0 on pads
  prompt_lengths: jax.Array    # [B] int32 valid prompt tokens (right-aligned at [P - len, P))
  response_lengths: jax.Array  # [B] int32 generated tokens, EOS included
  response_mask: jax.Array     # [B, T] int32: 1 on generated tokens up to and including EOS
  logp: jax.Array              # [B, T] fp32 log-prob of each sampled token under the
                               #   distribution it was drawn from; 0 off the response
  evicted_at: jax.Array        # [B, L, K, T] int32: key j visible to query i iff
                               #   j <= i < evicted_at[b, l, k, j] (NEVER_EVICTED if kept)
  stats: RolloutStats
  topk_ids: Optional[jax.Array] = None   # [B, T, k] int32 (keep_topk_logprobs > 0)
  topk_logp: Optional[jax.Array] = None  # [B, T, k] fp32, sorted descending
  full_logp: Optional[jax.Array] = None  # [B, T, V] fp32 (keep_full_logprobs); -inf where
                                         #   truncation removed a token, 0 off the response
  policy_version: Optional[jax.Array] = None  # [B] int32: updates applied to the parameters
                                              #   that sampled each row (set by the trainer)
  routed_experts: Optional[jax.Array] = None  # [B, L_moe, T, k] int8 (int16 past 127
                                              #   experts): the experts each MoE layer ran
                                              #   for token j (record_routing); -1 at the
                                              #   last index, which no query fed
