"""A synthetic worked-arithmetic task for CPU-sized RL: running sums, every step written out.

Problem `12+7-3+9`; solution (show_every=1):

    12+7=19
    19-3=16
    16+9=25
    #### 25

Why this task. A 2-4 layer decoder learns the *format* and single steps quickly in SFT, but each
step needs two skills a tiny model only half-masters: finding the next operand in the prompt
(operands repeat, so an induction head is ambiguous and position counting is needed) and carrying
in multi-digit addition. Per-step accuracy p gives a final-answer accuracy of roughly p^steps, so
with the number of operands drawn per problem from [min_operands, max_operands] the reward of an
SFT'd model is graded rather than all-or-nothing: short problems are mostly solved, long ones
mostly not. That gives GRPO groups with mixed rewards (non-zero advantages), and every gain in p
compounds over the horizon, which is what RL can improve in minutes.

Knobs (`SyntheticConfig`): operand count (the horizon), value range (digits, hence carries),
`distinct` operands, subtraction, `show_every` (operands folded per written step; 0 = answer only, no worked
solution), the answer format (`#### N` or `\\boxed{N}`, both read by `math_reward`), and
`filler` (spaces around each operator in the prompt). Filler gives a KV-cache policy tokens it
can drop without losing the problem: at 50 % compression a filler-free prompt loses operands
and a tiny model scores 0, so the SMD experiments use filler = 2.

Long horizons need `distinct`. With repeated values, "the operand after the one just added"
is ambiguous, and a 2-layer model warmed up on 12-24 operands of 1-19 writes the same operand
over and over (held-out accuracy about 0.01); with distinct two-digit operands each value
names one place in the prompt and the same model learns the lookup (configs/tiny_trm_long.py).

Determinism: `problem_at(config, seed, index)` is a pure function of its arguments (numpy
`SeedSequence([seed, index])`), so a data position is one integer: checkpoint `index` and resume
exactly. Use a different seed for evaluation problems.

Vocabulary: one fixed character set (independent of the knobs) written as a real HF
`tokenizer.json` (WordLevel over single characters, `Fuse` decoder) with <pad>, <bos>, <eos>, <unk>
and a chat template, so the trainer loads it through `load_tokenizer` like any checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import ml_collections
import numpy as np

from trm_jax import config as config_lib
from trm_jax.data import tasks
from trm_jax.data.batching import make_prompt_batch
from trm_jax.data.problem import Problem
from trm_jax.data.rewards import math_reward
from trm_jax.data.tokenizer import Tokenizer, load_tokenizer

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
# Every character the task can write, plus "\boxed{}" spelled out; fixed so one tokenizer serves
# every knob setting.
ALPHABET = "0123456789+-=#:QA \n\\boxed{}"
# User turn -> "Q:<problem>\n"; assistant turn -> "A:<solution><eos>"; the generation prompt is
# "A:", so (prompt + solution + eos) renders exactly like the two-turn chat (what SFT trains on).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ 'Q:' + m['content'] + '\\n' }}"
    "{% elif m['role'] == 'assistant' %}{{ 'A:' + m['content'] + eos_token }}"
    "{% else %}{{ raise_exception('synthetic task: unsupported role ' + m['role']) }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'A:' }}{% endif %}")


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
  min_operands: int = 2            # operands per problem ~ U{min_operands..max_operands}
  max_operands: int = 8            # the horizon knob: steps = operands - 1
  min_value: int = 1               # operands ~ U{min_value..max_value}
  max_value: int = 9               # 9: one-digit operands; 99: two digits, more carries
  allow_subtraction: bool = False  # draw each operator from {+, -} instead of {+}
  show_every: int = 1              # operands folded per written step; 0 = answer line only
  answer_format: str = "####"      # "####" -> "#### N"; "boxed" -> "\boxed{N}"
  filler: int = 0                  # spaces around each operator in the prompt: tokens a
                                   #   KV-cache policy can evict without losing the problem
  distinct: bool = False           # operands drawn without replacement: each names one place
                                   #   in the prompt, so "the operand after the one just
                                   #   added" is a lookup an induction head can make

  def __post_init__(self):
    n, lo, hi = self.max_operands, self.min_value, self.max_value
    _check(self.min_operands >= 2, ["min_operands"], f"must be >= 2, got {self.min_operands!r}")
    _check(n >= self.min_operands, ["min_operands", "max_operands"],
           f"min_operands={self.min_operands} > max_operands={n}")
    _check(0 <= lo <= hi, ["min_value", "max_value"],
           f"need 0 <= min_value <= max_value, got {lo}, {hi}")
    _check(self.show_every >= 0, ["show_every"], f"must be >= 0, got {self.show_every!r}")
    _check(self.filler >= 0, ["filler"], f"must be >= 0, got {self.filler!r}")
    _check(not self.distinct or hi - lo + 1 >= n, ["distinct", "max_operands"],
           f"distinct operands need at least max_operands={n} values in [min_value, "
           f"max_value] = [{lo}, {hi}]")
    _check(self.answer_format in ("####", "boxed"), ["answer_format"],
           f"unknown value {self.answer_format!r}; expected one of ####, boxed")

  def problem_count(self) -> int:
    """How many distinct problems `problem_at` can draw: operand sequences (ordered, without
    repeats when `distinct`) times operator choices, over every operand count."""
    values = self.max_value - self.min_value + 1
    ops = 2 if self.allow_subtraction else 1
    seqs = (lambda k: math.perm(values, k)) if self.distinct else (lambda k: values ** k)
    return sum(seqs(k) * ops ** (k - 1) for k in range(self.min_operands, self.max_operands + 1))


class SyntheticConfigError(ValueError):
  """A bad `SyntheticConfig`: `fields` name the offending settings, `detail` says why (the
  trainer's config check reports them as task.synthetic.<field>)."""

  def __init__(self, fields, detail: str):
    self.fields, self.detail = tuple(fields), detail
    super().__init__(f"SyntheticConfig [{', '.join(self.fields)}]: {detail}")


def _check(ok: bool, fields, detail: str) -> None:
  if not ok:
    raise SyntheticConfigError(fields, detail)


def from_config(section: ml_collections.ConfigDict) -> SyntheticConfig:
  """The config's `task.synthetic` section as a `SyntheticConfig`, whose checks are the only
  ones: their errors are ConfigErrors naming task.synthetic.<field>."""
  try:
    return SyntheticConfig(**section.to_dict())
  except SyntheticConfigError as e:
    config_lib.require(False, [f"task.synthetic.{f}" for f in e.fields], e.detail)
  except TypeError as e:   # a key the generator does not have
    raise config_lib.ConfigError(f"bad config value [task.synthetic]: {e}") from None


def _answer_line(config: SyntheticConfig, value: int) -> str:
  return f"#### {value}" if config.answer_format == "####" else f"\\boxed{{{value}}}"


def format_problem(config: SyntheticConfig, operands: list[int], ops: list[str]) -> Problem:
  """The problem with these operands and operators (ops[i] joins operands[i] and [i+1])."""
  pad = " " * config.filler
  prompt = str(operands[0]) + "".join(pad + o + pad + str(x) for o, x in zip(ops, operands[1:]))
  acc, lines, i = operands[0], [], 1
  n = len(operands)
  while config.show_every and i < n:
    chunk = range(i, min(i + config.show_every, n))
    expr = str(acc) + "".join(ops[j - 1] + str(operands[j]) for j in chunk)
    for j in chunk:
      acc = acc + operands[j] if ops[j - 1] == "+" else acc - operands[j]
    lines.append(f"{expr}={acc}")
    i = chunk.stop
  if not config.show_every:
    for j in range(1, n):
      acc = acc + operands[j] if ops[j - 1] == "+" else acc - operands[j]
  lines.append(_answer_line(config, acc))
  return Problem(prompt=prompt, answer=str(acc), solution="\n".join(lines), source="synthetic")


def problem_at(config: SyntheticConfig, seed: int, index: int) -> Problem:
  """Problem number `index` of stream `seed`: a pure function, the same on every host and run."""
  if seed < 0 or index < 0:
    raise ValueError(f"seed and index must be >= 0, got seed={seed}, index={index}")
  rng = np.random.default_rng(np.random.SeedSequence([seed, index]))
  n = int(rng.integers(config.min_operands, config.max_operands + 1))
  if config.distinct:
    operands = [int(v) + config.min_value for v in
                rng.choice(config.max_value - config.min_value + 1, size=n, replace=False)]
  else:
    operands = [int(v) for v in rng.integers(config.min_value, config.max_value + 1, size=n)]
  if config.allow_subtraction:
    ops = ["+" if b else "-" for b in rng.integers(0, 2, size=n - 1)]
  else:
    ops = ["+"] * (n - 1)
  p = format_problem(config, operands, ops)
  return dataclasses.replace(p, uid=f"synthetic:{seed}:{index}")


def problem_batch(config: SyntheticConfig, seed: int, start: int, n: int) -> list[Problem]:
  """Problems start .. start+n-1 of stream `seed`; the trainer's data position is `start + n`."""
  return [problem_at(config, seed, start + i) for i in range(n)]


def demonstration_at(config: SyntheticConfig, seed: int, index: int,
                     answer_only_frac: float) -> Problem:
  """Warm-up demonstration `index` of stream `seed`: `problem_at`'s problem, its solution
  written answer-only (`show_every=0`) with probability `answer_only_frac`, else worked.

  The draw is its own pure function of (seed, index), so the operands, the answer and the
  uid are `problem_at`'s whatever the fraction; only the solution's form changes.
  """
  if not 0.0 <= answer_only_frac <= 1.0:
    raise ValueError(f"answer_only_frac must be in [0, 1], got {answer_only_frac!r}")
  u = np.random.default_rng(np.random.SeedSequence([seed, index, 1])).random()
  form = dataclasses.replace(config, show_every=0) if u < answer_only_frac else config
  return problem_at(form, seed, index)


def demonstration_batch(config: SyntheticConfig, seed: int, start: int, n: int,
                        answer_only_frac: float) -> list[Problem]:
  """Demonstrations start .. start+n-1 of stream `seed` (`demonstration_at`)."""
  return [demonstration_at(config, seed, start + i, answer_only_frac) for i in range(n)]


def max_completion_chars(config: SyntheticConfig) -> int:
  """An upper bound on len(solution) (one token per character with the synthetic tokenizer).

  `max_completion_tokens` adds the <eos>. Exact for addition-only configs
  (all operands at max_value with max_operands is the longest case); with subtraction every
  number is bounded by the same magnitude plus a sign character.
  """
  n, s = config.max_operands, config.show_every
  sign = 1 if config.allow_subtraction else 0
  w = len(str(config.max_value))                       # widest operand
  acc_w = len(str(n * config.max_value)) + sign        # widest running value
  widths = [len(str(k * config.max_value)) + sign for k in range(1, n + 1)]  # after k operands
  total, i = 0, 1
  while s and i < n:
    j = min(i + s, n)
    # "<acc><op><x>...=<new>" ; acc after i operands, new after j operands.
    total += widths[i - 1] + (j - i) * (1 + w) + 1 + widths[j - 1] + 1  # + "\n"
    i = j
  answer = len(_answer_line(config, 0)) - 1 + acc_w
  return total + answer


def max_prompt_chars(config: SyntheticConfig) -> int:
  """Exact maximum of len(problem.prompt): max_operands widest operands and their operators."""
  return config.max_operands * (len(str(config.max_value)) + 1 + 2 * config.filler) - 1 \
      - 2 * config.filler


def longest_prompt_problem(config: SyntheticConfig) -> Problem:
  """A problem with the longest prompt the config can draw: max_operands operands, all
  max_value (a point of `problem_at`'s support; "-" is as wide as "+")."""
  n = config.max_operands
  return format_problem(config, [config.max_value] * n, ["+"] * (n - 1))


def max_prompt_tokens(config: SyntheticConfig, tokenizer: Tokenizer) -> int:
  """Prompt length in tokens of `longest_prompt_problem`, tokenized by `make_prompt_batch`
  (the chat template with its generation prompt, as the trainer builds prompts). Exact for
  the synthetic tokenizer (one token per character); sizes the sampler's static prompt width.
  """
  batch = make_prompt_batch(tokenizer, [longest_prompt_problem(config)], 1)
  return int(batch.lengths[0])


def max_completion_tokens(config: SyntheticConfig) -> int:
  """Upper bound on generated tokens for a correct solution: the solution plus <eos>."""
  return max_completion_chars(config) + 1


def make_synthetic_tokenizer(path: str) -> Tokenizer:
  """Writes tokenizer.json + tokenizer_config.json for the task into `path` and loads them."""
  from tokenizers import Regex, decoders, models, pre_tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import Tokenizer as HFTokenizer  # pylint: disable=g-import-not-at-top
  chars = list(dict.fromkeys(ALPHABET))
  vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *chars])}
  tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # 1 char/token
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens(list(SPECIAL_TOKENS))
  os.makedirs(path, exist_ok=True)
  tok.save(os.path.join(path, "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
            "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
            "chat_template": CHAT_TEMPLATE}
  with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)
  return load_tokenizer(path)


# ------------------------------------------------------------------------------ the task
def _reward(completion: str, problem: Problem) -> float:
  return math_reward(completion, problem.answer)


tasks.register_task("synthetic", tasks.TaskSpec(
    reward=_reward, binary=True,
    generator=tasks.Generator(
        section="synthetic", settings=from_config, problems=problem_batch,
        longest_prompt=longest_prompt_problem, max_new_tokens=max_completion_tokens,
        problem_count=lambda cfg: cfg.problem_count())))
