r"""A long-horizon task with headroom: the TRM experiment's base (experiments/trm_long_horizon.py).

  python -m trm_jax.train --config configs/tiny_trm_long.py --workdir /tmp/trm_long

Running sums of 14-22 distinct two-digit operands, every step written out ("313+86=399"), so a
worked solution is 140-265 tokens (mean 198) and one slip anywhere makes the answer wrong: a
per-step accuracy p gives about p^steps, the regime where a sequence's trust region matters
(TRM paper Sec. 3). It was 10-18 operands until that grid's comparison
(experiments/results/trm_long_horizon_10_18) measured responses of 106-109 tokens under KV
eviction, under the 128 the experiment asks for.
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
  c.warmup.steps = 1000     # at 10-18 operands 400 left held-out greedy accuracy at 0.05 and
                            #   1000 gave 0.92 with the mix below (avg@4 0.645, Intel Xeon);
                            #   at 14-22 greedy 0.672, avg@4 0.297 (AMD EPYC)
  c.warmup.cache_dir = "~/.cache/trm_jax/tiny_long_base"
  c.warmup.answer_only_frac = 0.2   # a fifth of the demonstrations give the answer alone (the
                                    #   main job's mix): the base then answers a quarter of its
                                    #   problems unworked and wrong, and GRPO's exact sampler
                                    #   gains +0.18 held-out by learning to work them out (10-18
                                    #   operands; +0.215 in 100 steps at 14-22). Worked only,
                                    #   it gained +0.105 in 300 steps; 0.4 or 700 warm-up steps
                                    #   leave too weak a base (docs/results.md)
  c.task.synthetic.update(dict(min_operands=14, max_operands=22, min_value=10, max_value=99,
                               distinct=True))
  c.rollout.dtype = "float32"
  c.rollout.logit_noise = 0.0
  c.trm.criteria = ()
  c.rl.objective = "ppo_clip"
  return c
