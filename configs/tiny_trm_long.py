r"""A long-horizon task with headroom: the TRM experiment's base (experiments/trm_long_horizon.py).

  python -m trm_jax.train --config configs/tiny_trm_long.py --workdir /tmp/trm_long

Running sums of 14-22 distinct two-digit operands, every step written out ("313+86=399"), so a
worked solution is 140-265 tokens (mean 198) and one slip anywhere makes the answer wrong: a
per-step accuracy p gives about p^steps, the regime where a sequence's trust region matters
(TRM paper Sec. 3). KV eviction shortens responses; at 14 or more operands they stay above
128 tokens under it (144-181 on average in the committed grid).
The operands are distinct, so the next operand is "the one after the operand just added", a
lookup a 2-layer model can learn; with repeated values it cannot (it writes the same operand
again). The sampler is exact here (fp32, no logit noise, synchronous): the experiment adds the
mismatch. The base model is the same 2-layer decoder as the main job's, warmed up on this task
with the main job's mix of worked and answer-only demonstrations: its headroom is partly the
form (a quarter of its answers skip the working and are wrong), partly the arithmetic.
"""
from trm_jax import config as config_lib

tiny_trm = config_lib.shipped_module("tiny_trm")


def get_config(arg=None):
  c = tiny_trm.get_config(arg)
  c.total_steps = 300
  c.eval_every = 50
  c.ckpt_every = 50
  c.export_hf = False
  c.warmup.steps = 1000     # the worked skill appears abruptly between 700 and 1000 steps;
                            #   the committed base (experiments/results/trm_long_horizon/base,
                            #   built on an AMD EPYC: the warm-up differs by CPU) scores
                            #   held-out avg@4 0.230, greedy 0.534
  c.warmup.cache_dir = "~/.cache/trm_jax/tiny_long_base"
  c.warmup.answer_only_frac = 0.2   # a fifth of the demonstrations give the answer alone (the
                                    #   main job: 0.3): the base then answers part of its
                                    #   problems unworked and wrong, and the exact sampler
                                    #   gains +0.191 held-out in 100 steps (five seeds,
                                    #   docs/results.md); 0.4 leaves too weak a base
  c.task.synthetic.update(dict(min_operands=14, max_operands=22, min_value=10, max_value=99,
                               distinct=True))
  c.rollout.dtype = "float32"
  c.rollout.logit_noise = 0.0
  c.trm.criteria = ()
  c.rl.objective = "ppo_clip"
  return c
