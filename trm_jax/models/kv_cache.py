"""The KV cache a decoder layer reads and writes during cached decoding, and the policy hook.

A cache is a functional value, passed into `Attention` / `Block` / `Decoder.decode_step` and
returned updated. It holds C slots per (row, kv head); which key sits in which slot, and which
key leaves when a row's budget is full, is decided by a `CachePolicy` that the caller supplies
(the rollout engine's eviction policies). The model only writes the new key where the policy
says and attends over the slots, so `trm_jax.models` never depends on a policy.

Keys keep their RoPE rotation (applied before caching, never re-rotated), and `pos` records the
*array index* of each key, so a teacher-forced forward with
`Visibility(segment_ids, evicted_at)` replays exactly the attention a cached decode did.

Attention over the cache mirrors `kernels.attention_ref` op for op (fp32 logits, -inf on empty
slots, guarded softmax, probabilities cast to the value dtype): that is what makes cached
log-probs equal the teacher-forced ones to float rounding.
"""
from __future__ import annotations

import functools
from typing import Optional, Protocol, Tuple

import jax
import jax.numpy as jnp
from flax import struct

from trm_jax.kernels.attention import decode_kernel
from trm_jax.kernels.attention_ref import guarded_softmax


@struct.dataclass
class KVCache:
  """One layer's cache."""
  k: jax.Array          # [B, K, H, C] keys (RoPE applied), compute dtype; transposed (slots
                        #   last) so that a decode query's logits are a [G, H] x [H, C] matmul:
                        #   contracting the last axis of [C, H] ran 4.4x slower on XLA:CPU
  v: jax.Array          # [B, K, C, H] values
  pos: jax.Array        # [B, K, C] int32 array index of the key in each slot, -1 = empty
  score: Optional[jax.Array] = None  # [B, K, C] fp32 per-slot score the policy keeps (H2O:
                        #   accumulated attention), reset to 0 when a key is written; None for
                        #   policies that keep none (nothing to carry or write per step)
  evicted_at: Optional[jax.Array] = None  # [B, K, T] int32 retention record: key j was
                        #   visible to queries j <= i < evicted_at[b, k, j]; None = no record


class CachePolicy(Protocol):
  """What a cached attention layer asks of whoever owns the cache (builds and evicts it).

  `layer` is the asking layer's index; `index` the array index of the token being decoded:
  [] int32 (the same for every row) or [B] int32 (one per row: the rollout engine's slots
  decode rows that started at different times). All methods are pure: they return new values.

  A policy may set `observes_attention = False` to say `observe` never reads the
  probabilities; the layer then attends with the impl's decode kernel where there is one
  (`kv_cache.attend`). Without the attribute the layer assumes it reads them.
  """

  def prefill(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array):
    """q [B, P, N, H], k/v [B, P, K, H] of the prompt (RoPE applied) -> what the policy keeps
    of this layer's prompt (a `KVCache`, or the policy's own record of the prompt that it
    later turns into caches: the rollout engine prefills a group's shared prompt once)."""
    ...

  def free_slot(self, layer: int, cache: KVCache, index: jax.Array
                ) -> Tuple[KVCache, jax.Array]:
    """Where the key at `index` goes: (cache with that slot released, slot).

    slot is [] int32 (one slot for every row and head: written with one
    dynamic_update_slice) or [B, K] int32 (per row and head: a scatter; a slot >= C drops
    that row's write).
    """
    ...

  def observe(self, layer: int, cache: KVCache, probs: Optional[jax.Array]) -> KVCache:
    """After the decode query attended: probs [B, K, G, C] fp32 (0 on empty slots), or None
    when the policy said it does not read them (`observes_attention` False: the attention
    then may run as a kernel that never forms them)."""
    ...


def _bits(x: jax.Array) -> jax.Array:
  """16-bit floats viewed as uint16 (a free bitcast), other dtypes unchanged.

  Why: XLA:CPU has no bf16 dynamic-update-slice or scatter; it rewrites one into a conversion
  of the whole cache to fp32 and back, a full pass over every layer's K and V at every decode
  step. The same update on the uint16 view stays in place.
  """
  if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2:
    return jax.lax.bitcast_convert_type(x, jnp.uint16)
  return x


def _update(buf: jax.Array, new: jax.Array, put) -> jax.Array:
  """put(bits of buf, bits of new) in buf's dtype (see `_bits`)."""
  out = put(_bits(buf), _bits(new.astype(buf.dtype)))
  return out if out.dtype == buf.dtype else jax.lax.bitcast_convert_type(out, buf.dtype)


# The axis that holds the C slots in each per-slot field (keys are stored slots-last, see
# `KVCache.k`). Every cut, write and restart of slots reads it here.
SLOT_AXIS = {"k": 3, "v": 2, "pos": 2, "score": 2}


def _slot_index(name: str, *index) -> tuple:
  """The index tuple that puts `index` (a slot, or (rows, heads, slot)) on `name`'s axes:
  (b, h, slot) for v/pos/score, (b, h, :, slot) for k."""
  *lead, slot = index
  return (*lead, *(slice(None),) * (SLOT_AXIS[name] - len(lead)), slot)


def _per_slot(cache: KVCache) -> dict:
  return {n: getattr(cache, n) for n in SLOT_AXIS if getattr(cache, n) is not None}


def empty(B: int, K: int, H: int, C: int, T: int, dtype, *, keeps_score: bool,
          never: int) -> KVCache:
  """B rows of C empty slots (pos -1) and a retention record of T indices, all `never`."""
  return KVCache(k=jnp.zeros((B, K, H, C), dtype), v=jnp.zeros((B, K, C, H), dtype),
                 pos=jnp.full((B, K, C), -1, jnp.int32),
                 score=jnp.zeros((B, K, C), jnp.float32) if keeps_score else None,
                 evicted_at=jnp.full((B, K, T), never, jnp.int32))


def first_slots(cache: KVCache, n: int) -> KVCache:
  """The cache cut to its first n slots (decoding over fewer slots; the record is kept)."""
  return cache.replace(**{k: x[_slot_index(k, slice(0, n))] for k, x in _per_slot(cache).items()})


def take_rows(cache: KVCache, rows: jax.Array) -> KVCache:
  """The cache of rows `rows` [n] int32 (every per-slot field and the retention record)."""
  return cache.replace(**{k: x[rows] for k, x in _per_slot(cache).items()},
                       evicted_at=cache.evicted_at[rows])


def pad_slots(cache: KVCache, C: int) -> KVCache:
  """`cache` with empty slots (pos -1, zeros elsewhere) appended up to C slots."""
  n = cache.pos.shape[-1]
  pad = lambda k, x: jnp.pad(x, [(0, C - n) if a == SLOT_AXIS[k] else (0, 0)
                                 for a in range(x.ndim)], constant_values=-1 if k == "pos" else 0)
  return cache.replace(**{k: pad(k, x) for k, x in _per_slot(cache).items()})


def restart_rows(cache: KVCache, new: KVCache, take: jax.Array) -> KVCache:
  """`cache` with the rows `take` [B] restarted from `new` (n <= C slots): its n slots first,
  the other slots emptied (pos -1, score 0), its retention record.

  Only the restarted rows are written, and of their keys and values only the first n slots:
  the slots after them keep stale keys that pos -1 masks (attention gives them probability 0
  exactly). A select over every row and slot here cost a pass over every layer's cache at
  each refill of a continuous batch."""
  B, _, C = cache.pos.shape
  n = new.pos.shape[-1]
  rows = jnp.where(take, jnp.arange(B, dtype=jnp.int32), B)                # B: dropped
  full = pad_slots(new.replace(k=None, v=None), C)                          # pos, score
  out = {}
  for name, x in _per_slot(cache).items():
    if name in ("k", "v"):
      idx = _slot_index(name, rows, slice(0, n))
      out[name] = _update(x, getattr(new, name),
                          lambda buf, val, idx=idx: buf.at[idx].set(val, mode="drop"))
    else:
      out[name] = x.at[rows].set(getattr(full, name), mode="drop")
  return cache.replace(**out, evicted_at=cache.evicted_at.at[rows].set(new.evicted_at,
                                                                         mode="drop"))


def write(cache: KVCache, slot: jax.Array, k_new: jax.Array, v_new: jax.Array,
          index: jax.Array) -> KVCache:
  """Writes the key at array index `index` into `slot` (see `CachePolicy.free_slot`).

  Args:
    slot: [] int32 (same slot for all rows and heads) or [B, K] int32 (a slot >= C drops the
      write: rows that are not decoding leave their cache as it is).
    k_new, v_new: [B, K, H].
    index: [] or [B] int32 array index of the new key.
  """
  B, K = cache.pos.shape[:2]
  index = jnp.asarray(index, jnp.int32)
  new = {"k": k_new, "v": v_new,
         "pos": jnp.broadcast_to(index[:, None] if index.ndim == 1 else index, (B, K)),
         "score": jnp.zeros((B, K), jnp.float32)}
  if jnp.ndim(slot) == 0:
    # One dynamic_update_slice per field: the new values as a one-slot block at `slot`.
    put = lambda k, buf, x: jax.lax.dynamic_update_slice(
        buf, jnp.expand_dims(x, SLOT_AXIS[k]),
        [slot if a == SLOT_AXIS[k] else 0 for a in range(buf.ndim)])
  else:
    b, h = jnp.arange(B)[:, None], jnp.arange(K)[None, :]
    put = lambda k, buf, x: buf.at[_slot_index(k, b, h, slot)].set(x, mode="drop")
  return cache.replace(**{k: _update(buf, new[k], functools.partial(put, k))
                          for k, buf in _per_slot(cache).items()})


def attend(q: jax.Array, cache: KVCache, *, scale: Optional[float] = None,
           impl: str = "reference", probs: bool = True):
  """One decode query per row over the cache's filled slots.

  Args:
    q: [B, N, H] query (RoPE applied).
    impl: a `kernels.attention` impl. One with a decode kernel (the TPU impls: each row reads
      only its filled slots) is used when `probs` is False; otherwise the XLA einsums below
      read every slot of the (bucketed) cache.
    probs: whether the caller needs the attention probabilities (a policy that observes
      them, H2O); the kernel does not form them.
  Returns:
    o [B, N, H] in q.dtype, and probs [B, K, G, C] fp32 (0 on empty slots), or None when
    the kernel ran.
  """
  kernel = None if probs else decode_kernel(impl)
  if kernel is not None:
    return kernel(q, cache.k, cache.v, cache.pos, scale=scale), None
  B, N, H = q.shape
  K = cache.k.shape[1]
  G = N // K
  scale = H ** -0.5 if scale is None else scale
  qg = q.reshape(B, K, G, H)
  logits = jnp.einsum("BKGH,BKHC->BKGC", qg, cache.k,
                      preferred_element_type=jnp.float32) * scale   # [B, K, G, C]
  # The reference's guarded softmax (a decoding row always sees at least its own key).
  p = guarded_softmax(jnp.where((cache.pos >= 0)[:, :, None, :], logits, -jnp.inf))
  o = jnp.einsum("BKGC,BKCH->BKGH", p.astype(cache.v.dtype), cache.v,
                 preferred_element_type=jnp.float32)
  return o.reshape(B, N, H).astype(q.dtype), p
