r"""Shadow Mask Distillation on the synthetic task, on CPU: 50% H2O-compressed rollouts.

  python -m trm_jax.train --config configs/tiny_smd.py --workdir /tmp/smd_tiny

The task is `tiny_trm.py`'s with filler spaces in the prompt (see below); the rollout keeps a
KV cache with half the keys of each sequence (H2O: heavy hitters + recent window, evicting
while decoding) and records
`evicted_at`; the learner replays it as attention visibility (pi_shadow == pi_sparse exactly)
and distils from the dense stop-gradient teacher with lambda = 0.1 (SMD paper, Sec. 2).
Switch `smd.mode` to naive | sparse_rl to run the SMD paper's baselines on the same rollouts, or
set `rollout.cache.policy=none` with `smd.mode=dense` for the uncompressed reference.
"""
from trm_jax import config as config_lib

# The shipped default job, by name: found in a checkout and in an installed wheel alike.
tiny_trm = config_lib.shipped_module("tiny_trm")


def get_config(arg=None):
  c = tiny_trm.get_config(arg)
  # The SMD comparison is about the KV cache, not about dtype or noise mismatch.
  c.rollout.dtype = "float32"
  c.rollout.logit_noise = 0.0
  # Two spaces around each operator: filler the cache policy can evict. Without it a 50 %
  # budget must drop operands and the tiny model's compressed rollouts all score 0, which
  # leaves GRPO no signal to compare the learners by. Its own base model (task differs).
  c.task.synthetic.filler = 2
  c.warmup.cache_dir = "~/.cache/trm_jax/tiny_filler_base"
  c.warmup.answer_only_frac = 0.0   # worked demonstrations only, as its committed results
  c.rollout.cache.policy = "h2o"
  c.rollout.cache.ratio = 0.5
  c.smd.mode = "smd"
  c.smd.lam = 0.1
  # TRM stays on as a monitor of the residual mismatch: with exact replay it rejects nothing.
  c.trm.criteria = ("trm_max_kl",)
  return c
