"""Rule-based math reward: extract the final answer of a completion and compare it numerically.

`math_reward(completion, ground_truth)` is 1.0 when the completion's final answer equals the
ground truth and 0.0 otherwise (the paper's binary outcome reward).

Extraction (`extract_answer`), first rule that finds something wins:
  1. the last `\\boxed{...}` / `\\fbox{...}` (nested braces balanced; `\\boxed 5` also accepted);
  2. the last `#### ...` line (GSM8K's format);
  3. the last `Answer: ...` line (DAPO-Math's prompt asks for this);
  4. the last number anywhere in the text.

Comparison (`answers_match`): both sides are normalised (drop `$`, `\\left`/`\\right`, `\\!`-style
spacing, `\\text{}` wrappers, degree signs, a leading `x =`, a trailing period); if both then parse
as numbers they are compared as exact rationals (`fractions.Fraction`), so 0.50 == 1/2 ==
\\frac{1}{2} == \\dfrac12, 1,000 == 1000, +3 == 3, -0 == 0, 033 == 33. Decimals are exact:
0.333 != 1/3 (no tolerance, on purpose: a reward must not be gamed by rounding).
Percent: a trailing `%` / `\\%` is dropped, so "50%" matches "50" (not "0.5"); this follows the
common math-eval convention where ground truths are written without the sign.
Anything that does not parse as a number is compared as a string after normalisation, with
whitespace removed; LaTeX or symbolic equivalence (\\sqrt{2} vs \\sqrt2, x+1 vs 1+x) is out of
scope.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_HASH_RE = re.compile(r"####\s*([^\n]*)")
_ANSWER_RE = re.compile(r"(?i)answer\s*:\s*([^\n]*)")
# A number: thousands-separated or plain, optional sign, decimals and a simple /denominator.
_NUMBER_RE = re.compile(
    r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|[-+]?\.\d+")


def _last_boxed(text: str) -> Optional[str]:
  """Content of the last complete \\boxed{...}, with nested braces balanced."""
  for m in reversed(list(_BOX_RE.finditer(text))):
    i = m.end()
    if i < len(text) and text[i] != "{":
      # `\boxed 5`: the argument is the next token.
      arg = re.match(r"[^\s$]+", text[i:])
      if arg:
        return arg.group(0)
      continue
    depth = 0
    for j in range(i, len(text)):
      if text[j] == "{":
        depth += 1
      elif text[j] == "}":
        depth -= 1
        if depth == 0:
          return text[i + 1:j]
    # Unbalanced (e.g. a truncated completion): try an earlier box.
  return None


def extract_answer(text: str) -> Optional[str]:
  """The final answer string of a completion, or None when it has none (see module doc)."""
  boxed = _last_boxed(text)
  if boxed is not None:
    return boxed.strip()
  for pattern in (_HASH_RE, _ANSWER_RE):
    matches = pattern.findall(text)
    if matches and matches[-1].strip():
      return matches[-1].strip()
  numbers = _NUMBER_RE.findall(text)
  return numbers[-1].strip() if numbers else None


def _strip_text_wrappers(s: str) -> str:
  # \text{cm} -> cm, \mathrm{x} -> x (one level, no nested braces inside: that is all we need).
  return re.sub(r"\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}", r"\1", s)


def normalize_answer(s: str) -> str:
  """Canonical text form of an answer (see module doc for what is forgiven)."""
  s = s.strip().replace("\u2212", "-")  # unicode minus
  s = _strip_text_wrappers(s)
  s = s.replace("\\$", "").replace("$", "")
  s = re.sub(r"\\(?:left|right)\b", "", s)
  s = re.sub(r"\\[!,;:> ]", "", s)
  s = s.replace("~", "")
  s = re.sub(r"\\[dt]frac", r"\\frac", s)
  s = re.sub(r"\^\s*\{?\\circ\}?|°", "", s)
  s = re.sub(r"\\?%$", "", s.strip())
  s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 5" -> "5"
  s = s.strip().rstrip(".").strip()
  return re.sub(r"\s+", "", s)


def _plain_number(s: str) -> Optional[Fraction]:
  if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
    s = s.replace(",", "")
  if re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)", s):
    return Fraction(s)
  return None


def parse_number(s: str) -> Optional[Fraction]:
  """A normalised answer as an exact rational, or None when it is not a plain number."""
  sign = 1
  if s[:1] in "+-" and s[1:].startswith("\\frac"):
    sign, s = (-1 if s[0] == "-" else 1), s[1:]
  m = (re.fullmatch(r"\\frac\{([^{}]+)\}\{([^{}]+)\}", s)
       or re.fullmatch(r"\\frac(\d)(\d)", s)
       or re.fullmatch(r"\\frac(\d)\{([^{}]+)\}", s)
       or re.fullmatch(r"\\frac\{([^{}]+)\}(\d)", s)
       or re.fullmatch(r"([^/]+)/([^/]+)", s))
  if m:
    num, den = _plain_number(m.group(1)), _plain_number(m.group(2))
    if num is None or den is None or den == 0:
      return None
    return sign * num / den
  return _plain_number(s)


def answers_match(predicted: str, ground_truth: str) -> bool:
  """Numeric equality when both parse as numbers, else normalised string equality."""
  p, g = normalize_answer(predicted), normalize_answer(ground_truth)
  if not p or not g:
    return False
  pn, gn = parse_number(p), parse_number(g)
  if pn is not None and gn is not None:
    return pn == gn
  return p == g


def math_reward(completion: str, ground_truth: str) -> float:
  """1.0 if the completion's final answer equals `ground_truth`, else 0.0."""
  answer = extract_answer(completion)
  if answer is None:
    return 0.0
  return 1.0 if answers_match(answer, str(ground_truth)) else 0.0
