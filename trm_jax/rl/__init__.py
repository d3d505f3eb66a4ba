"""trm_jax.rl."""
