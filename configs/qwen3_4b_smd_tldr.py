r"""The SMD paper's TL;DR run: Qwen3-4B-Instruct on Reddit TL;DR, 50% SnapKV-compressed rollouts,
rewarded by ROUGE-L F against the reference summary (a graded reward).

  python -m trm_jax.train --config configs/qwen3_4b_smd_tldr.py --workdir /ckpt/smd_tldr \
      --config.model.path=/ckpt/Qwen3-4B-Instruct

TL;DR is the Hugging Face dataset `trl-lib/tldr` (`prompt`: the post, "SUBREDDIT: ... TITLE:
... POST: ... TL;DR:"; `completion`: the reference summary): its train split trains, the
first eval_problems rows of its test split are held out. `datasets` reads it from the local
cache (filled once with `datasets.load_dataset("trl-lib/tldr")`; HF_DATASETS_OFFLINE=1 on
hosts without network); a `save_to_disk` copy or jsonl / parquet files work as for GSM8K
(configs/qwen3_4b_smd_gsm8k.py). Held-out metrics: greedy mean ROUGE-L and its precision and
recall, with the dense cache and with the rollouts' compressed one.

Everything else is the GSM8K run's (SMD at lambda = 0.1, the SMD paper's best; `smd.mode` =
dense | naive | sparse_rl | smd gives its comparison). The posts are at most about 550 tokens
(the dataset keeps posts under 512 GPT-2 tokens, plus subreddit and title), summaries at most
48: prompts get 1024 tokens with the chat template and the instruction, responses 128.
"""
from trm_jax import config as config_lib

# The GSM8K run this one varies, by name: found in a checkout and in an installed wheel alike.
smd_gsm8k = config_lib.shipped_module("qwen3_4b_smd_gsm8k")


def get_config(arg=None):
  c = smd_gsm8k.get_config(arg)
  c.eval_problems = 512              # the first 512 rows of the test split (6553)
  c.eval_samples = 1                 # greedy ROUGE-L, the reported number

  c.task.name = "tldr"
  c.task.path = "trl-lib/tldr"       # the hub dataset (module docstring)
  c.task.subset = ""
  c.task.split = "train"
  c.task.eval_split = "test"
  c.task.max_prompt_len = 1024
  c.task.max_new_tokens = 128
  c.task.drop_long_prompts = True    # a post longer than 1024 tokens is left out, counted
  return c
