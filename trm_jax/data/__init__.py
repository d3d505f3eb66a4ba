"""Tasks, rewards and evaluation: the task registry (data/tasks.py) with the synthetic running
sums, GSM8K / DAPO-Math / AIME, TL;DR / GovReport summarisation and HotpotQA; the math reward,
ROUGE-L and SQuAD F1 / exact match; avg@k / pass@k; the tokenizer, and the batching that turns
problems into padded int32 arrays.

Importing the package registers every shipped task (each module registers its own)."""
from trm_jax.data.batching import (PromptBatch, SFTBatch, encode_prompt, make_prompt_batch,
                                   make_sft_batch)
from trm_jax.data.evaluation import (avg_at_k, heldout_metrics, pass_at_k, pass_at_k_per_problem,
                                     step_metrics, summarize)
from trm_jax.data.hotpotqa import load_hotpotqa
from trm_jax.data.loaders import DataFileError
from trm_jax.data.math_tasks import DEFAULT_INSTRUCTION, load_aime, load_dapo_math, load_gsm8k
from trm_jax.data.problem import Problem
from trm_jax.data.rewards import answers_match, extract_answer, math_reward
from trm_jax.data.summarization import load_govreport, load_tldr
from trm_jax.data.synthetic import (SyntheticConfig, longest_prompt_problem,
                                    make_synthetic_tokenizer, max_completion_chars,
                                    max_completion_tokens, max_prompt_chars, max_prompt_tokens,
                                    problem_at, problem_batch)
from trm_jax.data.task import Task
from trm_jax.data.tasks import (TASKS, Generator, TaskSpec, get_task, load_problems,
                                register_task)
from trm_jax.data.text_rewards import qa_exact_match, qa_f1, rouge_l
from trm_jax.data.tokenizer import (Tokenizer, TokenizerMismatchError, check_tokenizer_fits,
                                    load_tokenizer, pad_sequences)
