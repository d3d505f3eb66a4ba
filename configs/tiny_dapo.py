r"""DAPO's recipe (Yu et al. 2025) with TRM on the synthetic task, on CPU.

  python -m trm_jax.train --config configs/tiny_dapo.py --workdir /tmp/dapo_tiny

The main job (`tiny_trm.py`: bf16 sampler with logit noise, TRM-max) trained the way DAPO
trains: PPO-clip with the decoupled clip ("clip-higher", 0.2 / 0.28), token-level loss
aggregation, no KL term, dynamic sampling (groups whose rewards are all equal are replaced by
groups of further prompts, dapo/fill_rate), the soft overlong punishment and overlong
filtering (responses cut at the limit leave the loss). The generation limit is 80 tokens, above
the task's longest worked solution (55), with the penalty over its last 16 (DAPO: 4096 of
20480, a fifth): finished solutions are never penalised, only responses that ramble towards
the limit. docs/algorithms.md has the papers and their settings.
"""
from trm_jax import config as config_lib

tiny_trm = config_lib.shipped_module("tiny_trm")


def get_config(arg=None):
  c = tiny_trm.get_config(arg)
  c.rl.objective = "ppo_clip"
  c.rl.clip_eps_low, c.rl.clip_eps_high = 0.2, 0.28   # DAPO's clip-higher
  c.rl.loss_agg = "token-mean"                        # DAPO's token-level policy loss
  c.rl.kl_beta = 0.0                                  # DAPO drops the KL term
  c.rl.dynamic_sampling = True
  c.rl.dynamic_sampling_max_rounds = 4
  c.task.max_new_tokens = 80
  c.rl.overlong_buffer = 16
  c.rl.overlong_penalty = 1.0
  c.rl.mask_truncated = True
  return c
