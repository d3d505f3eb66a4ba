"""Shared test inputs: left-padded prompt batches of mixed lengths, as the sampler takes them."""
import numpy as np


def left_padded_prompts(lengths, P: int, *, low: int = 3, high: int = 128,
                        seed: int = 0) -> np.ndarray:
  """[len(lengths), P] int32 ids; row b holds lengths[b] random ids right-aligned, zeros left.

  Ids start at `low` so they never collide with pad/bos/eos ids of the tiny test models.
  """
  rng = np.random.default_rng(seed)
  ids = np.zeros((len(lengths), P), np.int32)
  for b, n in enumerate(lengths):
    ids[b, P - n:] = rng.integers(low, high, n)
  return ids
