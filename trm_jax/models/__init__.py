"""trm_jax.models."""
