"""Rewards of free-text answers: ROUGE-L for summaries, SQuAD F1 and exact match for short
answers. Each is a float in [0, 1].

ROUGE-L (`rouge_l`, `rouge_l_scores`) is the F-measure of Google's `rouge-score` package,
`RougeScorer(["rougeL"], use_stemmer=True).score(reference, prediction)["rougeL"]`, the
convention of TL;DR and GovReport results, to the last bit. Tokenisation and stemming are that
package's own code: `rouge_score.tokenize.tokenize` (lower-case, every run of characters
other than a-z / 0-9 is a separator, tokens longer than 3 characters Porter-stemmed) with
nltk's `PorterStemmer()` (NLTK_EXTENSIONS mode), the stemmer `rouge_score`'s DefaultTokenizer
builds, so they cannot drift from it; stems are memoised. What differs is how the longest
common subsequence is found: `rouge_score` fills an O(n * m) table in Python, here the
bit-parallel algorithm of Allison & Dix (1986) / Hyyro (2004) computes the same length with
one big-integer addition per prediction token (`python -m bench.rouge` times the two side by
side at TL;DR and GovReport sizes, where every step scores hundreds of pairs). Precision is
LCS / prediction tokens, recall LCS / reference tokens, F = 2 P R / (P + R), as there; an empty
side scores 0.

SQuAD v1.1 (`qa_f1`, `qa_exact_match`), the rules of its official evaluation script: lower-case,
drop ASCII punctuation, drop the articles a / an / the, squash whitespace; exact match compares
the normalised strings, F1 is the token-overlap F1 (bag of tokens); each is the maximum over
the reference answers. (HotpotQA's own script additionally scores 0 when exactly one side is
"yes", "no" or "noanswer"; SQuAD's rules do not, and these are SQuAD's.)
"""
from __future__ import annotations

import collections
import functools
import re
import string
from typing import Sequence


# ------------------------------------------------------------------------------ ROUGE-L
class _MemoStemmer:
  """nltk's PorterStemmer (rouge-score's), with each word's stem computed once."""

  def __init__(self):
    from nltk.stem import porter  # pylint: disable=g-import-not-at-top  (2 s: only when used)
    self.stem = functools.lru_cache(maxsize=1 << 17)(porter.PorterStemmer().stem)


@functools.lru_cache(maxsize=None)
def _stemmer() -> _MemoStemmer:
  return _MemoStemmer()


def rouge_tokens(text: str) -> list[str]:
  """`text` as rouge-score tokenises it with stemming (its own function and stemmer)."""
  from rouge_score import tokenize  # pylint: disable=g-import-not-at-top
  return tokenize.tokenize(text, _stemmer())


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
  """Length of the longest common subsequence of token lists `a` and `b`, bit-parallel.

  Bit i of `match[t]` is set when a[i] == t. V starts with the len(a) low bits set; for each
  token of b, U = V & match[t] and V = (V + U) | (V - U) (Hyyro 2004, eq. 3: the addition
  carries each run of set bits to the next match). The LCS length is the number of low bits
  then clear.
  """
  if not a or not b:
    return 0
  match: dict[str, int] = {}
  for i, t in enumerate(a):
    match[t] = match.get(t, 0) | (1 << i)
  full = (1 << len(a)) - 1
  v = full
  for t in b:
    u = v & match.get(t, 0)
    v = ((v + u) | (v - u)) & full
  return len(a) - v.bit_count()


def rouge_l_scores(prediction: str, reference: str) -> tuple[float, float, float]:
  """(precision, recall, F-measure) of ROUGE-L, as rouge-score's `_score_lcs`."""
  ref, pred = rouge_tokens(reference), rouge_tokens(prediction)
  if not ref or not pred:
    return 0.0, 0.0, 0.0
  lcs = lcs_length(ref, pred)
  precision = lcs / len(pred)
  recall = lcs / len(ref)
  f = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
  return precision, recall, f


def rouge_l(prediction: str, reference: str) -> float:
  """ROUGE-L F-measure of `prediction` against `reference`, stemmed (module docstring)."""
  return rouge_l_scores(prediction, reference)[2]


# ------------------------------------------------------------------------------ SQuAD v1.1
_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
  """SQuAD v1.1's normalisation: lower-case, no punctuation, no articles, single spaces."""
  s = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
  return " ".join(_ARTICLES.sub(" ", s).split())


def _f1(prediction: str, truth: str) -> float:
  pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
  same = sum((collections.Counter(pred) & collections.Counter(gold)).values())
  if same == 0:
    return 0.0
  precision, recall = same / len(pred), same / len(gold)
  return 2 * precision * recall / (precision + recall)


def _answers(answers: Sequence[str]) -> Sequence[str]:
  if isinstance(answers, str) or not answers:
    raise ValueError(f"answers must be a non-empty sequence of strings, got {answers!r}")
  return answers


def qa_f1(prediction: str, answers: Sequence[str]) -> float:
  """SQuAD v1.1 token F1 of `prediction`, the maximum over `answers`."""
  return max(_f1(prediction, a) for a in _answers(answers))


def qa_exact_match(prediction: str, answers: Sequence[str]) -> float:
  """1.0 when `prediction` equals one of `answers` after SQuAD v1.1's normalisation."""
  pred = normalize_answer(prediction)
  return float(any(pred == normalize_answer(a) for a in _answers(answers)))
