"""The one problem record every task source (data/tasks.py) is normalised to."""
from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Problem:
  prompt: str                    # the user turn, instructions included
  answer: str                    # the reference the task's reward compares against: a math
                                 #   answer, a summary, a short answer
  solution: str = ""             # worked solution (the SFT target) when the source has one
  system: Optional[str] = None   # a system turn, when the source has one
  source: str = ""               # the task that made it: "synthetic", "gsm8k", "tldr", ...
  uid: str = ""                  # stable id: "<file>:<row>" or "synthetic:<seed>:<index>"

  def messages(self) -> list[dict[str, str]]:
    """Chat messages for `Tokenizer.apply_chat_template`."""
    msgs = [] if self.system is None else [{"role": "system", "content": self.system}]
    return msgs + [{"role": "user", "content": self.prompt}]
