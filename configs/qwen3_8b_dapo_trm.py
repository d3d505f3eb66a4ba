r"""The TRM paper's run: Qwen3-8B on DAPO-Math-17k with TRM-max, evaluated avg@32 on AIME25.

  python -m trm_jax.train --config configs/qwen3_8b_dapo_trm.py --workdir /mnt/gcs/qwen3_8b_trm \
      --config.model.path=/ckpt/Qwen3-8B --config.task.path=/data/dapo-math-17k.parquet \
      --config.task.eval_path=/data/aime25.jsonl

Either path may also be a `save_to_disk` directory or a Hugging Face dataset id (with
`--config.task.split=train`, `--config.task.eval_split=...`; trm_jax/data/loaders.py).

Settings from the paper's experimental section: group 16, batch 32 prompts, lr 1e-6;
evaluation at top-p 0.95, temperature 1.0 (the paper states these for evaluation). Training
rollouts are untruncated (top-p 1): a nucleus cut changes pi_roll by up to -log(top_p) nats
per token (0.051 at 0.95), which TRM-max at delta = 0.05 would count as mismatch and reject.
The sampler runs in bf16 (the realistic source of pi_roll != pi_theta together with
staleness). Needs an accelerator pod; nothing here runs on CPU.
"""
from trm_jax import config as config_lib

# The shipped default job, by name: found in a checkout and in an installed wheel alike.
tiny_trm = config_lib.shipped_module("tiny_trm")


def get_config(arg=None):
  c = tiny_trm.get_config(arg)
  c.total_steps = 500
  c.eval_every = 50
  c.eval_problems = 30               # AIME25 has 30 problems
  c.eval_batch_size = 512            # evaluation rows per call: 30 x 32 = 960 at once do not
                                     #   split over 64 chips and would be replicated on each
  c.eval_samples = 32                # avg@32
  c.eval_temperature = 1.0
  c.eval_top_p = 0.95
  c.ckpt_every = 25
  c.keep_ckpts = 3

  c.model.path = ""                  # must be set: a local Qwen3-8B HF checkpoint
  c.model.dtype = "bfloat16"
  c.model.remat = True

  c.task.name = "dapo_math"
  c.task.eval_name = "aime"          # the evaluation file (task.eval_path) is AIME-formatted
  c.task.max_prompt_len = 1024
  c.task.max_new_tokens = 4096       # T = 4096, the paper's horizon

  c.rollout.dtype = "bfloat16"
  c.rollout.logit_noise = 0.0
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0              # untruncated: see the module docstring
  c.rollout.keep_full_logprobs = False   # V = 151,936: keep top-k (a lower bound on KL/TV)
  c.rollout.slots = 0                # every row at once (no continuous batching)
  c.rollout.keep_topk_logprobs = 20

  c.rl.group_size = 16
  c.rl.batch_size = 32 * 16          # 32 prompts x 16 samples
  c.rl.num_minibatches = 4
  c.rl.num_microbatches = 16
  c.rl.loss_agg = "seq-mean-token-sum"
  c.rl.chunk = 512

  c.trm.criteria = ("trm_max_kl",)
  c.trm.delta = 0.05

  c.optim.lr = 1e-6
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.01
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
  return c
