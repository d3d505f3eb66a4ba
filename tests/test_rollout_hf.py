"""Dense-cache greedy decoding against transformers `generate`, and the no-recompile guard.

Checkpoints are real `save_pretrained` output (tests/hf_fixtures.py); our model is loaded
from the same files. Prompts are left-padded with mixed lengths, as in RL batches.
"""
import jax
import jax.monitoring
import numpy as np
import pytest
import torch

from hf_fixtures import load_hf_model, make_hf_checkpoint
from trm_jax.kernels.visibility import NEVER_EVICTED, Visibility
from trm_jax.models import from_pretrained
from trm_jax.rollout import generate

P, N = 10, 8
LENS = np.array([10, 6, 3], np.int32)
EOS, PAD = 2, 0      # hf_fixtures' eos_token_id / pad_token_id


def _prompts(seed):
  rng = np.random.default_rng(seed)
  ids = np.full((len(LENS), P), PAD, np.int32)
  for b, n in enumerate(LENS):
    ids[b, P - n:] = rng.integers(3, 128, n)
  return ids


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  return {arch: make_hf_checkpoint(str(tmp_path_factory.mktemp(arch)), arch, seed=1)
          for arch in ("qwen3", "llama3", "qwen3_moe")}


def _hf_generate(path, ids, eos):
  hf = load_hf_model(path)
  mask = (np.arange(P)[None, :] >= P - LENS[:, None]).astype(np.int64)
  with torch.no_grad():
    out = hf.generate(input_ids=torch.tensor(np.array(ids), dtype=torch.long),
                      attention_mask=torch.as_tensor(mask), do_sample=False,
                      max_new_tokens=N, eos_token_id=eos, pad_token_id=PAD)
  return out.numpy()


def _check_against_hf(model, path, r, eos):
  ids = np.asarray(r.tokens[:, :P])
  ref = _hf_generate(path, ids, eos)                     # stops when every row hit EOS
  ours = np.asarray(r.tokens)
  np.testing.assert_array_equal(ours[:, :ref.shape[1]], ref)
  assert (ours[:, ref.shape[1]:] == PAD).all()
  # logp equals a teacher-forced forward of the same model (greedy: untempered softmax).
  logits = model(r.tokens, visibility=Visibility(segment_ids=r.segment_ids))
  logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  tf = np.take_along_axis(np.asarray(logp), ours[:, 1:, None], axis=-1)[..., 0]
  mask = np.asarray(r.response_mask[:, 1:]) == 1
  np.testing.assert_allclose(np.asarray(r.logp)[:, 1:][mask], tf[mask], atol=1e-5, rtol=0)
  assert np.all(np.asarray(r.logp)[:, 1:][~mask] == 0)
  assert (np.asarray(r.evicted_at) == NEVER_EVICTED).all()


@pytest.mark.parametrize("arch", ["qwen3", "llama3", "qwen3_moe"])
def test_greedy_dense_matches_transformers(checkpoints, arch):
  path = checkpoints[arch]
  model = from_pretrained(path)
  ids = _prompts(0)
  r = generate(model, ids, LENS, max_new_tokens=N, key=jax.random.key(0), greedy=True)
  _check_against_hf(model, path, r, EOS)

  if arch != "qwen3":
    return
  # --- EOS handling: stop on a token the first rollout emits mid-way in row 0 ------------
  eos = int(r.tokens[0, P + 3])
  r2 = generate(model, ids, LENS, max_new_tokens=N, key=jax.random.key(0), greedy=True,
                eos_ids=(eos,))
  _check_against_hf(model, path, r2, eos)
  tokens, mask = np.asarray(r2.tokens), np.asarray(r2.response_mask)
  stop = P + int(np.argmax(tokens[0, P:] == eos))
  assert mask[0, P:stop + 1].all() and not mask[0, stop + 1:].any()   # EOS included
  assert bool(r2.stats.finished[0]) and int(r2.response_lengths[0]) == stop + 1 - P
  assert np.array_equal(np.asarray(r2.segment_ids)[:, P:], mask[:, P:])

  # --- no recompilation between calls with the same shapes --------------------------------
  compiles = []

  def listener(name, *_, **__):
    if name == "/jax/core/compile/backend_compile_duration":
      compiles.append(name)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    lens = np.array([4, 10, 7], np.int32)
    ids2 = np.where(np.arange(P)[None, :] >= P - lens[:, None], _prompts(5), PAD)
    for seed in (1, 2):
      out = generate(model, ids2.astype(np.int32), lens, max_new_tokens=N,
                     key=jax.random.key(seed), greedy=True, eos_ids=(eos,))
      jax.block_until_ready(out.tokens)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert compiles == []
