"""trm_jax.rollout: jit-compiled sampling with dense or evicted KV caches.

`generate(model, prompt_ids, prompt_lengths, *, max_new_tokens, key, ...) -> Rollout`; the
rollout's `evicted_at` [B, L, K, T] replays the sampler's attention in the learner through
`trm_jax.kernels.visibility.Visibility`. The KV-cache eviction policies are the entries of
`policies.POLICIES` (`register_policy` adds one).
"""
from trm_jax.rollout.cache import num_slots
from trm_jax.rollout.eviction import CacheEviction
from trm_jax.rollout.policies import POLICIES, EvictionPolicy, get_policy, register_policy
from trm_jax.rollout.sampler import (DecodeState, generate, generate_from_state, run_phase,
                                     sampler_graphdef, sampling_config)
from trm_jax.rollout.sampling import sampled_logprobs, token_logprobs
from trm_jax.rollout.types import (BatchingConfig, CacheConfig, Rollout, RolloutStats,
                                   SamplingConfig)

__all__ = ["POLICIES", "BatchingConfig", "CacheConfig", "CacheEviction", "DecodeState", "EvictionPolicy",
           "Rollout", "RolloutStats", "SamplingConfig", "generate", "get_policy",
           "register_policy", "generate_from_state", "num_slots", "run_phase",
           "sampled_logprobs", "sampler_graphdef", "sampling_config", "token_logprobs"]
