r"""The SMD paper's GovReport run: Qwen3-4B-Instruct summarising U.S. government reports, 50%
SnapKV-compressed rollouts, rewarded by ROUGE-L F against the reference summary (graded).

  python -m trm_jax.train --config configs/qwen3_4b_smd_govreport.py --workdir /ckpt/smd_gov \
      --config.model.path=/ckpt/Qwen3-4B-Instruct

GovReport is the Hugging Face dataset `ccdv/govreport-summarization` (`report`, `summary`): its
train split (17,517 reports) trains, its test split (973) is held out. `datasets` reads it from
the local cache (filled once with `datasets.load_dataset("ccdv/govreport-summarization")`;
HF_DATASETS_OFFLINE=1 on hosts without network); a `save_to_disk` copy or jsonl / parquet
files work as for GSM8K (configs/qwen3_4b_smd_gsm8k.py). Held-out metric: greedy mean
ROUGE-L (and its precision and recall), with the dense cache and with the rollouts'
compressed one.

Lengths. Reports average about 9,400 words (about 12K tokens), many run past 16K, a few past
50K; summaries average about 550 words (about 700 tokens). Prompts get 16384 tokens, the
usual input length of long-document summarisation, and the reports that do not fit are left
out of training and evaluation (task.drop_long_prompts; the count is logged at start-up):
raise task.max_prompt_len to keep more of them, at the memory the AOT report shows. Responses
get 1024 tokens.

Memory: the KV cache of a 16K prompt is 2.6 GB per row dense and half that compressed, so the
sampler decodes rollout.slots = 64 rows at once (continuous batching) instead of all 512, and
evaluation runs in calls of 32 rows. Everything else is the GSM8K run's (SMD at lambda = 0.1).
"""
from trm_jax import config as config_lib

# The GSM8K run this one varies, by name: found in a checkout and in an installed wheel alike.
smd_gsm8k = config_lib.shipped_module("qwen3_4b_smd_gsm8k")


def get_config(arg=None):
  c = smd_gsm8k.get_config(arg)
  c.eval_problems = 973              # the whole test split
  c.eval_samples = 1                 # greedy ROUGE-L, the reported number
  c.eval_batch_size = 32             # held-out rows per call: 32 dense 17K-token caches

  c.task.name = "govreport"
  c.task.path = "ccdv/govreport-summarization"   # the hub dataset (module docstring)
  c.task.subset = ""
  c.task.split = "train"
  c.task.eval_split = "test"
  c.task.max_prompt_len = 16384
  c.task.max_new_tokens = 1024
  c.task.drop_long_prompts = True    # reports longer than 16384 tokens are left out, counted

  c.rollout.slots = 64               # rows decoding at once (continuous batching)
  return c
