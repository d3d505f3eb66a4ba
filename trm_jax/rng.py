"""Counter-based random draws: pure functions of (key, integer ids), one value per id.

Why. The rollout engine promises that a row's draws are its own: the token sampled at array
index i of row b, the logit noise added there, the router jitter of that token and a random
eviction decision are functions of (key, b, i) alone, whatever batch, slot or decode step
computed them (`rollout.sampler`'s `slots`). `jax.random` draws a whole array from one key, so
a value depends on its place in the array; here each value is a hash of its ids, keyed by two
threefry words of the key (`seed`), so any program that knows the ids recomputes the value.

The hash is MurmurHash3's 32-bit finaliser (`fmix32`, a bijection with full avalanche), chained
over the ids: h = fmix32(... fmix32(fmix32(s0 ^ id_0) + s1) ^ id_1 ...). Uniforms take its top
24 bits (exact in fp32); normals map them through the inverse normal CDF (`normal_from_bits`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def fmix32(x: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finaliser: a bijective mixer on uint32 with full avalanche."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def seed(key: jax.Array) -> jax.Array:
  """The two uint32 words [2] a stream's hashes are keyed by (one threefry call per key)."""
  return jax.random.bits(key, (2,), jnp.uint32)


def bits(s: jax.Array, *ids) -> jax.Array:
  """uint32 hash of integer ids (broadcast together) under seed s [2]."""
  h = s[0]
  for x in ids:
    h = fmix32(fmix32(h ^ jnp.asarray(x).astype(jnp.uint32)) + s[1])
  return h


def uniform(s: jax.Array, *ids) -> jax.Array:
  """Uniform draws on {0, 1, ..., 2^24 - 1} * 2^-24 (exact in fp32), one per id."""
  return (bits(s, *ids) >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def normal(s: jax.Array, *ids) -> jax.Array:
  """Standard normal fp32 draws, one per id (`normal_from_bits`)."""
  return normal_from_bits(bits(s, *ids))


def normal_from_bits(h: jax.Array) -> jax.Array:
  """uint32 -> standard normal fp32 through sqrt(2) erfinv(2u - 1), u = (a + 1/2) 2^-24 for
  the top 24 bits a. 2u - 1 = (2a + 1 - 2^24) 2^-24 is formed in integers: an odd integer of
  magnitude < 2^24 is exact in fp32, so the argument stays strictly inside (-1, 1) and |z| <
  5.5. (In floating point, a + 1/2 rounds up to 2^24 for a = 2^24 - 1, and erfinv(1) = inf
  turned one noise draw in 2^24 into a NaN distribution.)"""
  a = (h >> 8).astype(jnp.int32)
  x = (2 * a + (1 - (1 << 24))).astype(jnp.float32) * np.float32(1.0 / (1 << 24))
  return np.float32(np.sqrt(2.0)) * jax.lax.erf_inv(x)
