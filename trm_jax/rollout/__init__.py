"""trm_jax.rollout."""
