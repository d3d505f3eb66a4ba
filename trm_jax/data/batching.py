"""Problems -> padded int32 arrays: GRPO prompt batches (left padded, each prompt repeated
`group_size` times) and SFT batches (right padded, loss on the solution tokens only).

Group layout: row r of a prompt batch is problem r // G, sample r % G, so the trainer's
[B*G] rewards reshape to [B, G] for group normalisation (GRPO, Shao et al. 2024, eq. 3).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
from flax import struct

from trm_jax.data.problem import Problem
from trm_jax.data.tokenizer import Tokenizer, pad_sequences


@struct.dataclass
class PromptBatch:
  tokens: np.ndarray       # [B*G, T] int32, left padded with pad_id
  lengths: np.ndarray      # [B*G] int32, real prompt tokens per row
  problem_ids: np.ndarray  # [B*G] int32, index into the problems list (r // G)
  group_size: int = struct.field(pytree_node=False)


@struct.dataclass
class SFTBatch:
  tokens: np.ndarray     # [B, T] int32, prompt + solution + eos, right padded with pad_id
  loss_mask: np.ndarray  # [B, T] float32, 1 where tokens[b, t] is a solution/eos target
  lengths: np.ndarray    # [B] int32, real tokens per row


def encode_prompt(tokenizer: Tokenizer, problem: Problem, *, use_chat_template: bool = True,
                  **template_kwargs) -> list[int]:
  """Prompt ids: the chat template with a generation prompt, or the raw text."""
  if use_chat_template:
    return tokenizer.apply_chat_template(problem.messages(), add_generation_prompt=True,
                                         tokenize=True, **template_kwargs)
  return tokenizer.encode(problem.prompt, add_special_tokens=True)


def make_prompt_batch(tokenizer: Tokenizer, problems: Sequence[Problem], group_size: int, *,
                      max_prompt_len: Optional[int] = None, pad_to_multiple_of: int = 1,
                      use_chat_template: bool = True, **template_kwargs) -> PromptBatch:
  """Left-padded prompts for the sampler, each repeated `group_size` times (adjacent rows).

  Left padding puts every prompt's last token in column T-1, so decoding starts at one column
  for the whole batch. `max_prompt_len` fixes T (one compiled shape); a longer prompt is an
  error naming its uid rather than a silent truncation that would drop the question.
  """
  if group_size < 1:
    raise ValueError(f"group_size must be >= 1, got {group_size}")
  if not problems:
    raise ValueError("make_prompt_batch needs at least one problem")
  ids = [encode_prompt(tokenizer, p, use_chat_template=use_chat_template, **template_kwargs)
         for p in problems]
  if max_prompt_len is not None:
    for p, s in zip(problems, ids):
      if len(s) > max_prompt_len:
        raise ValueError(f"prompt of problem {p.uid or p.prompt[:40]!r} has {len(s)} tokens, "
                         f"more than max_prompt_len={max_prompt_len}")
  tokens, lengths = pad_sequences(ids, tokenizer.pad_id, padding_side="left",
                                  max_length=max_prompt_len,
                                  pad_to_multiple_of=pad_to_multiple_of)  # [B, T], [B]
  return PromptBatch(tokens=np.repeat(tokens, group_size, axis=0),             # [B*G, T]
                     lengths=np.repeat(lengths, group_size, axis=0),           # [B*G]
                     problem_ids=np.repeat(np.arange(len(problems), dtype=np.int32), group_size),
                     group_size=group_size)


def make_sft_batch(tokenizer: Tokenizer, problems: Sequence[Problem], *,
                   max_len: Optional[int] = None, pad_to_multiple_of: int = 1,
                   **template_kwargs) -> SFTBatch:
  """Teacher-forcing batch: prompt (chat template + generation prompt), then solution + eos.

  `loss_mask[b, t]` marks the *target* positions: a next-token loss reads logits at t-1 and
  the label at t, so the mask covers the solution and its eos, never the prompt or padding.
  """
  rows, masks = [], []
  for p in problems:
    if not p.solution:
      raise ValueError(f"problem {p.uid!r} has no solution to train on")
    prompt = encode_prompt(tokenizer, p, **template_kwargs)
    target = tokenizer.encode(p.solution) + [tokenizer.eos_id]
    rows.append(prompt + target)
    masks.append([0] * len(prompt) + [1] * len(target))
  tokens, lengths = pad_sequences(rows, tokenizer.pad_id, padding_side="right",
                                  max_length=max_len, pad_to_multiple_of=pad_to_multiple_of)
  mask, _ = pad_sequences(masks, 0, padding_side="right", max_length=tokens.shape[1])
  return SFTBatch(tokens=tokens, loss_mask=mask.astype(np.float32), lengths=lengths)
