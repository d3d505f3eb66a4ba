"""trm_jax.trm."""
