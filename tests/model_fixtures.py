"""The tests' tiny model: `make_test_model(seed, **ModelConfig overrides)`."""
from flax import nnx

from trm_jax.models import Decoder, ModelConfig


def make_test_model(seed: int = 0, **overrides) -> Decoder:
  """A tiny random decoder (defaults: qwen3, D=64, L=2, N=4, K=2, H=16, V=128)."""
  return Decoder(ModelConfig(**overrides), rngs=nnx.Rngs(seed))
