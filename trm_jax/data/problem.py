"""The one problem record every task source (synthetic, GSM8K, DAPO-Math, AIME) is normalised to."""
from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Problem:
  prompt: str                    # the user turn, instructions included
  answer: str                    # ground truth for `math_reward`
  solution: str = ""             # worked solution (the SFT target) when the source has one
  system: Optional[str] = None   # a system turn, when the source has one
  source: str = ""               # "synthetic", "gsm8k", "dapo_math", "aime"
  uid: str = ""                  # stable id: "<file>:<row>" or "synthetic:<seed>:<index>"

  def messages(self) -> list[dict[str, str]]:
    """Chat messages for `Tokenizer.apply_chat_template`."""
    msgs = [] if self.system is None else [{"role": "system", "content": self.system}]
    return msgs + [{"role": "user", "content": self.prompt}]
