r"""TRM under injected rollout/learner mismatch: a tiny Qwen3-MoE-shaped policy, on CPU.

  python -m trm_jax.train --config configs/tiny_moe_mismatch.py --workdir /tmp/trm_moe

The base experiment of `experiments/trm_mismatch.py`. The policy is a 2-layer decoder whose
MLPs are 8-expert top-2 MoE blocks (the Qwen3-MoE layout), warmed up on the synthetic task like
the dense default. The sampler runs in bf16 and adds Gaussian jitter to the router logits, so
some tokens are routed to different experts than the fp32 learner routes them: the "MoE
routing flip" source of pi_roll != pi_theta in the TRM paper (Sec. 1), which gives a few tokens
a large divergence rather than every token a small one. The experiment varies the objective
and the masking criteria over this config.
"""
from trm_jax import config as config_lib

# The shipped default job, by name: found in a checkout and in an installed wheel alike.
tiny_trm = config_lib.shipped_module("tiny_trm")


def get_config(arg=None):
  c = tiny_trm.get_config(arg)
  c.total_steps = 60
  c.ckpt_every = 30
  c.export_hf = False
  c.eval_problems = 64
  c.model.arch.update(dict(intermediate_size=384, num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=96))
  c.warmup.cache_dir = "~/.cache/trm_jax/tiny_moe_base"
  c.warmup.answer_only_frac = 0.0   # worked demonstrations only, as its committed results
  c.rollout.dtype = "bfloat16"
  c.rollout.logit_noise = 0.0
  c.rollout.router_noise = 1.0
  c.rl.batch_size = 64
  c.optim.lr = 3e-5
  return c
