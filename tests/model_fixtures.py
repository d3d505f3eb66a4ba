"""The tests' tiny model: `make_test_model(seed, **ModelConfig overrides)`."""
from flax import nnx

from trm_jax.models import Decoder, ModelConfig


def make_test_model(seed: int = 0, **overrides) -> Decoder:
  """A tiny random decoder (defaults: qwen3, D=64, L=2, N=4, K=2, H=16, V=128)."""
  return Decoder(ModelConfig(**overrides), rngs=nnx.Rngs(seed))


def assert_learner_replays(model: Decoder, rollout, *, max_new_tokens: int, eos_ids,
                           atol: float) -> None:
  """SMD's exact replay: the learner's log-probs of the sampled tokens under the rollout's
  recorded visibility equal the sampler's on every response token."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from trm_jax.kernels.visibility import Visibility  # pylint: disable=g-import-not-at-top
  from trm_jax.rollout import sampler as sampler_lib, token_logprobs  # pylint: disable=g-import-not-at-top
  scfg = sampler_lib.sampling_config(model.config, max_new_tokens=max_new_tokens,
                                     eos_ids=eos_ids)
  logits = model(rollout.tokens, visibility=Visibility(segment_ids=rollout.segment_ids,
                                                       evicted_at=rollout.evicted_at))
  lp = token_logprobs(logits[:, :-1], rollout.tokens[:, 1:], scfg)
  m = np.asarray(rollout.response_mask[:, 1:]) > 0
  np.testing.assert_allclose(np.asarray(lp)[m], np.asarray(rollout.logp[:, 1:])[m], atol=atol)
