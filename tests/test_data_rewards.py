"""Math reward over a table of tricky answers; avg@k / pass@k against brute force; the held-out
and per-step metrics of binary and graded tasks."""
import itertools
from math import comb

import numpy as np
import pytest

from trm_jax.data.evaluation import (avg_at_k, heldout_metrics, pass_at_k, pass_at_k_per_problem,
                                     step_metrics, summarize)
from trm_jax.data.rewards import extract_answer, math_reward

# (completion, ground truth, expected reward)
REWARD_TABLE = [
    # --- extraction
    ("so the total is \\boxed{42}.", "42", 1.0),
    ("\\boxed{\\frac{3}{4}}", "3/4", 1.0),
    ("first \\boxed{1} then \\boxed{7}", "7", 1.0),                       # last box wins
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt{2}}{2}", 1.0),       # nested braces
    ("\\boxed 5", "5", 1.0),
    ("\\fbox{12}", "12", 1.0),
    ("\\boxed{7} and then a truncated \\boxed{8", "7", 1.0),              # unbalanced skipped
    ("3+4=7\n7+5=12\n#### 12", "12", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("blah\nAnswer: 34", "34", 1.0),                                      # DAPO format
    ("The answer is 17.", "17", 1.0),                                     # last number
    ("There were 3 apples and 5 pears, 8 in all", "8", 1.0),
    ("I have no idea.", "0", 0.0),
    ("", "3", 0.0),
    ("\\boxed{}", "0", 0.0),
    # --- numeric comparison
    ("\\boxed{0.50}", "1/2", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\frac12}", "0.5", 1.0),
    ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
    ("\\boxed{\\frac{-3}{4}}", "-3/4", 1.0),
    ("\\boxed{+3}", "3", 1.0),
    ("\\boxed{-3}", "3", 0.0),                                            # signs matter
    ("\\boxed{033}", "33", 1.0),                                          # AIME zero-padded
    ("\\boxed{1,234,567}", "1234567", 1.0),
    ("\\boxed{1,2}", "12", 0.0),                                          # not a thousands comma
    ("\\boxed{0.333}", "1/3", 0.0),                                       # exact, no tolerance
    ("\\boxed{2.0}", "2", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),                                        # percent sign dropped
    ("\\boxed{50%}", "0.5", 0.0),                                         # ... not divided
    ("\\boxed{\\$18}", "18", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{5 \\text{ cm}}", "5", 0.0),                                 # units not stripped
    ("\\boxed{\\text{5}}", "5", 1.0),
    ("$\\boxed{\\left( 3 \\right)}$", "(3)", 1.0),
    ("\\boxed{1/0}", "1/0", 1.0),                                         # string compare
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
    ("\\boxed{\\sqrt{3}}", "\\sqrt{2}", 0.0),
    ("#### \u221212", "-12", 1.0),                                        # unicode minus
    ("\\boxed{12}", "13", 0.0),
]


@pytest.mark.parametrize("completion,truth,expected", REWARD_TABLE)
def test_math_reward_table(completion, truth, expected):
  assert math_reward(completion, truth) == expected


def test_extract_answer_priorities():
  assert extract_answer("Answer: 3\n#### 4") == "4"           # #### before Answer:
  assert extract_answer("#### 4 \\boxed{5}") == "5"           # boxed before ####
  assert extract_answer("from 10 to -3.5 degrees") == "-3.5"
  assert extract_answer("nothing numeric") is None


def _pass_at_k_bruteforce(row, k):
  subsets = list(itertools.combinations(range(len(row)), k))
  return np.mean([any(row[i] for i in s) for s in subsets])


def test_pass_at_k_matches_bruteforce():
  rng = np.random.default_rng(0)
  correct = rng.random((20, 7)) < 0.3
  for k in range(1, 8):
    want = [_pass_at_k_bruteforce(r, k) for r in correct]
    np.testing.assert_allclose(pass_at_k_per_problem(correct, k), want, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(pass_at_k(correct, 1), correct.mean(), rtol=1e-12)


def test_pass_at_k_closed_form_and_edges():
  n, c, k = 32, 3, 8
  row = np.zeros((1, n), bool)
  row[0, :c] = True
  want = 1 - comb(n - c, k) / comb(n, k)
  assert pass_at_k(row, k) == pytest.approx(want, rel=1e-12)
  assert pass_at_k(np.ones((2, 4)), 4) == 1.0
  assert pass_at_k(np.zeros((2, 4)), 4) == 0.0
  assert avg_at_k(np.array([[1, 0, 0, 0], [1, 1, 0, 0]])) == 0.375
  assert summarize(np.array([[1, 0], [0, 0]]), ks=(1, 2, 4)) == {
      "avg@2": 0.25, "pass@1": 0.25, "pass@2": 0.5}


def test_evaluation_bad_input():
  with pytest.raises(ValueError, match="1 <= k <= n_samples; got k=5, n_samples=4"):
    pass_at_k(np.ones((2, 4)), 5)
  with pytest.raises(ValueError, match=r"\[num_problems, n_samples\], got shape \(4,\)"):
    avg_at_k(np.ones(4))
  with pytest.raises(ValueError, match="0/1"):
    avg_at_k(np.full((2, 2), 0.5))


def test_heldout_and_step_metrics_of_binary_and_graded_tasks():
  """Binary: accuracy, avg@n, pass@k. Graded: mean reward and the mean of each part, greedy
  and over n samples (avg@n is the mean reward either way); no pass@k for graded rewards."""
  binary = {"reward": np.array([1, 0, 0, 0, 1, 1, 0, 0], np.float32)}   # 4 problems x 2
  assert heldout_metrics(binary, binary=True, n=1) == {"greedy_accuracy": 0.375}
  assert heldout_metrics(binary, binary=True, n=2) == {
      "avg@2": 0.375, "pass@1": 0.375, "pass@2": 0.5}
  assert step_metrics(binary, binary=True) == {"reward": 0.375, "accuracy": 0.375}
  graded = {"reward": np.array([0.5, 0.25, 1.0, 0.0], np.float32),
            "exact_match": np.array([0.0, 0.0, 1.0, 0.0])}
  assert heldout_metrics(graded, binary=False, n=1) == {"greedy_reward": 0.4375,
                                                        "greedy_exact_match": 0.25}
  assert heldout_metrics(graded, binary=False, n=2) == {"avg@2": 0.4375, "exact_match@2": 0.25}
  assert step_metrics(graded, binary=False) == {"reward": 0.4375, "task/exact_match": 0.25}
  with pytest.raises(ValueError, match="correct must hold 0/1"):
    heldout_metrics(graded, binary=True, n=1)
