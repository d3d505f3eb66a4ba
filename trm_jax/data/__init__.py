"""trm_jax.data."""
