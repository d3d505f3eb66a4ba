"""Tasks, rewards and evaluation: synthetic running sums, GSM8K / DAPO-Math / AIME files, the
math reward, avg@k / pass@k, the tokenizer, and the batching that turns problems into padded
int32 arrays."""
from trm_jax.data.batching import (PromptBatch, SFTBatch, encode_prompt, make_prompt_batch,
                                   make_sft_batch)
from trm_jax.data.evaluation import avg_at_k, pass_at_k, pass_at_k_per_problem, summarize
from trm_jax.data.loaders import (DEFAULT_INSTRUCTION, DataFileError, load_aime, load_dapo_math,
                                  load_gsm8k, load_problems)
from trm_jax.data.problem import Problem
from trm_jax.data.rewards import answers_match, extract_answer, math_reward
from trm_jax.data.synthetic import (SyntheticConfig, longest_prompt_problem,
                                    make_synthetic_tokenizer, max_completion_chars,
                                    max_completion_tokens, max_prompt_chars, max_prompt_tokens,
                                    problem_at, problem_batch)
from trm_jax.data.task import Task
from trm_jax.data.tokenizer import (Tokenizer, TokenizerMismatchError, check_tokenizer_fits,
                                    load_tokenizer, pad_sequences)
