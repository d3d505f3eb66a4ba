r"""The SMD paper's run: Qwen3-4B-Instruct on GSM8K with 50% SnapKV-compressed rollouts.

  python -m trm_jax.train --config configs/qwen3_4b_smd_gsm8k.py --workdir /ckpt/smd_4b \
      --config.model.path=/ckpt/Qwen3-4B-Instruct

GSM8K is the Hugging Face dataset `openai/gsm8k`, subset "main": its train split trains, its
test split (1319 problems) is held out. `datasets` reads it from the local cache (filled once
with `datasets.load_dataset("openai/gsm8k", "main")`; set HF_DATASETS_OFFLINE=1 on hosts
without network). A `save_to_disk` copy with the same splits is
`--config.task.path=/data/gsm8k --config.task.subset=`, and jsonl files are
`--config.task.path=/data/gsm8k/train.jsonl --config.task.eval_path=/data/gsm8k/test.jsonl
--config.task.subset= --config.task.split= --config.task.eval_split=`.

Shadow masking replays SnapKV's retention record in the learner; lambda = 0.1 (the SMD paper's best;
0.8 degrades). `smd.mode` = dense | naive | sparse_rl | smd reproduces the SMD paper's comparison.
"""
from trm_jax import config as config_lib

# The shipped default job, by name: found in a checkout and in an installed wheel alike.
tiny_trm = config_lib.shipped_module("tiny_trm")


def get_config(arg=None):
  c = tiny_trm.get_config(arg)
  c.total_steps = 300
  c.eval_every = 50
  c.eval_problems = 1319             # GSM8K test split
  c.eval_batch_size = 128            # evaluation rows per call: all 1319 problems at once do
                                     #   not split over the chips, so each would hold every row
  c.ckpt_every = 25
  c.keep_ckpts = 3

  c.model.path = ""                  # must be set: a local Qwen3-4B-Instruct HF checkpoint
  c.model.dtype = "bfloat16"
  c.model.remat = True

  c.task.name = "gsm8k"
  c.task.path = "openai/gsm8k"       # the hub dataset (module docstring)
  c.task.subset = "main"
  c.task.split = "train"
  c.task.eval_split = "test"         # held out: GSM8K's test split of the same dataset
  c.task.max_prompt_len = 512
  c.task.max_new_tokens = 1024

  c.rollout.dtype = "bfloat16"
  c.rollout.logit_noise = 0.0
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.keep_full_logprobs = False
  c.rollout.slots = 0                # every row at once (no continuous batching)
  c.rollout.keep_topk_logprobs = 0
  c.rollout.cache = dict(policy="snapkv", ratio=0.5, capacity=0, window=32, kernel=7,
                         recent_frac=0.5, sinks=4)

  c.rl.group_size = 8
  c.rl.batch_size = 64 * 8
  c.rl.num_minibatches = 4
  c.rl.num_microbatches = 8
  c.rl.chunk = 256

  c.smd.mode = "smd"
  c.smd.lam = 0.1
  c.trm.criteria = ("k3_avg",)       # residual-mismatch monitor from sampled log-probs

  c.optim.lr = 1e-6
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.01
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
  return c
