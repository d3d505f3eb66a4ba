r"""The SMD paper's HotpotQA run: Qwen3-4B-Instruct on HotpotQA (distractor setting), 50%
SnapKV-compressed rollouts, rewarded by SQuAD token F1 of the extracted answer (graded; exact
match logged beside it).

  python -m trm_jax.train --config configs/qwen3_4b_smd_hotpotqa.py --workdir /ckpt/smd_hotpot \
      --config.model.path=/ckpt/Qwen3-4B-Instruct

HotpotQA is the Hugging Face dataset `hotpotqa/hotpot_qa`, subset "distractor": its train split
trains, the first eval_problems rows of its validation split are held out (the test split has
no answers). `datasets` reads it from the local cache (filled once with
`datasets.load_dataset("hotpotqa/hotpot_qa", "distractor")`; HF_DATASETS_OFFLINE=1 on hosts
without network); the original JSON files (`context` as [title, sentences] pairs) work too.
Each prompt holds the ten paragraphs (two gold, eight distractors), then the question and the
instruction to end with "Answer: ...", the question last where SnapKV's observation window
looks (trm_jax/data/hotpotqa.py). Held-out metrics: greedy mean F1 and exact match, with the
dense cache and with the rollouts' compressed one.

Ten Wikipedia lead paragraphs are about 1,200 tokens, rarely above 3,000: prompts get 4096
tokens, responses 256 (a short answer, perhaps after a sentence of reasoning). At that length
the sampler decodes 256 of the 512 rows at a time (rollout.slots) and evaluation runs in calls
of 32 rows. Everything else is the GSM8K run's (SMD at lambda = 0.1).
"""
from trm_jax import config as config_lib

# The GSM8K run this one varies, by name: found in a checkout and in an installed wheel alike.
smd_gsm8k = config_lib.shipped_module("qwen3_4b_smd_gsm8k")


def get_config(arg=None):
  c = smd_gsm8k.get_config(arg)
  c.eval_problems = 512              # the first 512 rows of the validation split (7405)
  c.eval_samples = 1                 # greedy F1 / exact match, the reported numbers

  c.task.name = "hotpotqa"
  c.task.path = "hotpotqa/hotpot_qa"  # the hub dataset (module docstring)
  c.task.subset = "distractor"
  c.task.split = "train"
  c.task.eval_split = "validation"
  c.task.max_prompt_len = 4096
  c.task.max_new_tokens = 256
  c.task.drop_long_prompts = True    # a context longer than 4096 tokens is left out, counted

  c.rollout.slots = 256              # rows decoding at once (continuous batching): at most
                                     #   256 of the 512 rows' caches are live at a time
  c.eval_batch_size = 32             # held-out rows per call: a compressed-cache evaluation
                                     #   holds the prompt's keys beside the compressed cache
  return c
