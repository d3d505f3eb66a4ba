"""trm_jax: long-horizon LLM RL that stays correct when pi_roll != pi_theta.

Two papers, one pipeline:
  * Trust Region Masking (TRM): token-level divergences, the bound family and sequence masks
    (`trm_jax.trm`).
  * Shadow Mask Distillation (SMD): rollouts with evicted KV caches record per-key eviction
    steps; the learner replays them as attention visibility (`trm_jax.rollout`,
    `trm_jax.kernels`, `trm_jax.rl`).

Dimension letters used in shape comments and einsums throughout the package:
  B batch, T query length, S key length, N query heads, K kv heads, G query heads per kv head
  (N = K * G), H head dim, D model dim, F mlp hidden dim, E experts, V vocab, L layers.
"""

__version__ = "0.1.0"
