"""Synthetic running-sum task, its tokenizer (a real tokenizer.json) and the batching helpers."""
import dataclasses
import math

import numpy as np
import pytest

from trm_jax.data.batching import make_prompt_batch, make_sft_batch
from trm_jax.data.problem import Problem
from trm_jax.data.rewards import math_reward
from trm_jax.data.synthetic import (SyntheticConfig, SyntheticConfigError, format_problem,
                                    make_synthetic_tokenizer, max_completion_chars,
                                    max_completion_tokens, max_prompt_chars, max_prompt_tokens,
                                    demonstration_at, demonstration_batch, problem_at,
                                    problem_batch)

CONFIGS = [
    SyntheticConfig(),
    SyntheticConfig(min_operands=3, max_operands=12, max_value=99, allow_subtraction=True),
    SyntheticConfig(max_operands=7, show_every=3, answer_format="boxed"),
    SyntheticConfig(show_every=0, min_value=0, max_value=20),
    SyntheticConfig(max_operands=6, max_value=19, filler=2),
    SyntheticConfig(max_operands=5, max_value=99, allow_subtraction=True, filler=1),
    SyntheticConfig(min_operands=10, max_operands=18, min_value=10, max_value=99, distinct=True),
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return make_synthetic_tokenizer(str(tmp_path_factory.mktemp("synth_tok")))


def _apply(a, op, b):
  return a + b if op == "+" else a - b


def _eval_expr(expr):
  """Left-to-right +/- evaluation, independent of the generator's code."""
  import re  # pylint: disable=g-import-not-at-top
  parts = re.findall(r"[+-]?\d+", expr.replace(" ", ""))
  return sum(int(p) for p in parts)


@pytest.mark.parametrize("config", CONFIGS, ids=range(len(CONFIGS)))
def test_problems_are_correct_and_rewarded(config):
  for i in range(200):
    p = problem_at(config, seed=3, index=i)
    n = len([c for c in p.prompt if c in "+-"]) + 1
    assert config.min_operands <= n <= config.max_operands
    assert int(p.answer) == _eval_expr(p.prompt)
    lines = p.solution.split("\n")
    steps = math.ceil((n - 1) / config.show_every) if config.show_every else 0
    assert len(lines) == steps + 1
    for line in lines[:-1]:
      lhs, rhs = line.split("=")
      assert _eval_expr(lhs) == int(rhs)
    assert math_reward(p.solution, p.answer) == 1.0
    wrong = p.solution.replace(lines[-1], lines[-1].replace(p.answer, str(int(p.answer) + 1)))
    assert math_reward(wrong, p.answer) == 0.0
    assert len(p.prompt) <= max_prompt_chars(config)
    assert len(p.solution) <= max_completion_chars(config)


@pytest.mark.parametrize("config", [c for c in CONFIGS if not c.allow_subtraction])
def test_length_bounds_are_exact_without_subtraction(config):
  n = config.max_operands
  worst = format_problem(config, [config.max_value] * n, ["+"] * (n - 1))
  assert len(worst.solution) == max_completion_chars(config)
  assert len(worst.prompt) == max_prompt_chars(config)


@pytest.mark.parametrize("config", CONFIGS, ids=range(len(CONFIGS)))
def test_token_bounds(tok, config):
  worst_prompt = max_prompt_tokens(config, tok)
  assert worst_prompt == max_prompt_chars(config) + len(
      tok.apply_chat_template([{"role": "user", "content": ""}], tokenize=True))
  for p in problem_batch(config, 5, 0, 100):
    assert len(tok.apply_chat_template(p.messages(), tokenize=True)) <= worst_prompt
    assert len(tok.encode(p.solution)) + 1 <= max_completion_tokens(config)


def test_filler_only_spaces_the_prompt():
  plain, spaced = SyntheticConfig(max_value=19), SyntheticConfig(max_value=19, filler=3)
  for i in range(20):
    a, b = problem_at(plain, 1, i), problem_at(spaced, 1, i)
    assert b.prompt.replace(" ", "") == a.prompt and (b.solution, b.answer) == (a.solution,
                                                                                  a.answer)
    assert b.prompt.count(" ") == 6 * a.prompt.count("+")


def test_distinct_operands_are_distinct_and_cover_the_range():
  cfg = SyntheticConfig(min_operands=5, max_operands=5, min_value=3, max_value=7, distinct=True)
  seen = set()
  for i in range(50):
    ops = [int(x) for x in problem_at(cfg, 2, i).prompt.split("+")]
    assert sorted(ops) == [3, 4, 5, 6, 7]      # 5 distinct of 5 values: a permutation
    seen.add(tuple(ops))
  assert len(seen) > 30


def test_deterministic_by_seed_and_index():
  cfg = SyntheticConfig()
  a = problem_batch(cfg, seed=7, start=10, n=5)
  assert a == [problem_at(cfg, 7, 10 + i) for i in range(5)]
  assert a == problem_batch(cfg, seed=7, start=10, n=5)
  assert a[0].uid == "synthetic:7:10"
  assert len({p.prompt for p in problem_batch(cfg, 7, 0, 50)}) > 40
  assert [p.prompt for p in problem_batch(cfg, 8, 10, 5)] != [p.prompt for p in a]


def test_demonstrations_are_the_problems_some_written_answer_only():
  """The warm-up's mix (`warmup.answer_only_frac`): same problems and answers as `problem_at`,
  the solution's form drawn per (seed, index); 0 is exactly the worked stream."""
  config = SyntheticConfig(max_operands=6, max_value=19)
  problems = problem_batch(config, 3, 100, 2000)
  assert demonstration_batch(config, 3, 100, 2000, 0.0) == problems
  demos = demonstration_batch(config, 3, 100, 2000, 0.3)
  assert demos == [demonstration_at(config, 3, 100 + i, 0.3) for i in range(2000)]
  answer_only = dataclasses.replace(config, show_every=0)
  n_short = 0
  for p, d in zip(problems, demos):
    assert (d.prompt, d.answer, d.uid) == (p.prompt, p.answer, p.uid)
    if d.solution != p.solution:
      assert d == problem_at(answer_only, 3, int(p.uid.rsplit(":", 1)[1]))
      assert d.solution == f"#### {p.answer}"
      n_short += 1
  # Binomial(2000, 0.3): s.e. 0.0102; 5 s.e. either side.
  assert abs(n_short / 2000 - 0.3) < 0.051
  # A larger fraction only adds answer-only rows (one uniform draw per index).
  more = demonstration_batch(config, 3, 100, 2000, 0.6)
  assert all(m == d for m, d, p in zip(more, demos, problems) if d.solution != p.solution)
  every = demonstration_batch(config, 3, 100, 2000, 1.0)
  assert all(d.solution == f"#### {p.answer}" for d, p in zip(every, problems))
  with pytest.raises(ValueError, match="answer_only_frac must be in"):
    demonstration_at(config, 3, 0, -0.1)


@pytest.mark.parametrize("bad,fields,detail", [
    (dict(min_operands=1), ("min_operands",), "must be >= 2, got 1"),
    (dict(min_operands=5, max_operands=3), ("min_operands", "max_operands"),
     "min_operands=5 > max_operands=3"),
    (dict(min_value=5, max_value=2), ("min_value", "max_value"),
     "need 0 <= min_value <= max_value, got 5, 2"),
    (dict(show_every=-1), ("show_every",), "must be >= 0, got -1"),
    (dict(filler=-1), ("filler",), "must be >= 0, got -1"),
    (dict(max_operands=6, min_value=3, max_value=7, distinct=True), ("distinct", "max_operands"),
     "distinct operands need at least max_operands=6 values in [min_value, max_value] = [3, 7]"),
    (dict(answer_format="latex"), ("answer_format",),
     "unknown value 'latex'; expected one of ####, boxed"),
])
def test_config_validation_names_the_fields(bad, fields, detail):
  with pytest.raises(SyntheticConfigError) as e:
    SyntheticConfig(**bad)
  assert (e.value.fields, e.value.detail) == (fields, detail)
  assert str(e.value) == f"SyntheticConfig [{', '.join(fields)}]: {detail}"


@pytest.mark.parametrize("config", CONFIGS, ids=range(len(CONFIGS)))
def test_problem_count_counts_what_problem_at_draws(config):
  small = dataclasses.replace(config, min_operands=2, max_operands=3, min_value=1, max_value=4)
  drawn = {problem_at(small, 0, i).prompt.replace(" ", "") for i in range(6000)}
  assert len(drawn) == small.problem_count()   # 6000 draws see all of these few


def test_tokenizer_files_and_roundtrip(tok):
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.stop_ids == (2,)
  unk = tok.token_to_id("<unk>")
  for cfg in CONFIGS:
    for p in problem_batch(cfg, 0, 0, 20):
      for text in (p.prompt, p.solution):
        ids = tok.encode(text)
        assert len(ids) == len(text) and unk not in ids  # one token per character
        assert tok.decode(ids) == text


def test_tokenizer_matches_transformers(tok):
  from transformers import AutoTokenizer  # pylint: disable=g-import-not-at-top
  ref = AutoTokenizer.from_pretrained(tok.path)
  p = problem_at(SyntheticConfig(), 0, 0)
  chat = p.messages() + [{"role": "assistant", "content": p.solution}]
  for msgs, gen in ((p.messages(), True), (chat, False)):
    want = ref.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
    assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == want
    assert tok.encode(want) == ref(want, add_special_tokens=False)["input_ids"]


def test_prompt_batch_groups_and_left_padding(tok):
  problems = [problem_at(SyntheticConfig(), 1, i) for i in range(3)]
  G = 4
  batch = make_prompt_batch(tok, problems, G)
  prompts = [tok.apply_chat_template(p.messages(), tokenize=True) for p in problems]
  T = max(map(len, prompts))
  assert batch.tokens.shape == (3 * G, T) and batch.tokens.dtype == np.int32
  np.testing.assert_array_equal(batch.problem_ids, np.repeat(np.arange(3), G))
  for r in range(3 * G):
    s = prompts[r // G]
    assert batch.tokens[r].tolist() == [tok.pad_id] * (T - len(s)) + s
    assert batch.lengths[r] == len(s)
  assert tok.decode(batch.tokens[0]).endswith("\nA:")
  fixed = make_prompt_batch(tok, problems, G, max_prompt_len=40)
  assert fixed.tokens.shape == (3 * G, 40)
  with pytest.raises(ValueError, match="synthetic:1:.* more than max_prompt_len=3"):
    make_prompt_batch(tok, problems, G, max_prompt_len=3)
  with pytest.raises(ValueError, match="group_size must be >= 1"):
    make_prompt_batch(tok, problems, 0)


def test_sft_batch_targets_are_the_solution(tok):
  cfg = SyntheticConfig(max_operands=5)
  problems = problem_batch(cfg, 2, 0, 4)
  batch = make_sft_batch(tok, problems)
  assert batch.tokens.dtype == np.int32 and batch.loss_mask.dtype == np.float32
  for b, p in enumerate(problems):
    row = batch.tokens[b, :batch.lengths[b]].tolist()
    full = tok.apply_chat_template(
        p.messages() + [{"role": "assistant", "content": p.solution}],
        add_generation_prompt=False, tokenize=True)
    assert row == full  # prompt + solution + eos is exactly the rendered two-turn chat
    targets = batch.tokens[b][batch.loss_mask[b] == 1]
    assert targets[-1] == tok.eos_id
    assert tok.decode(targets) == p.solution
    assert batch.loss_mask[b, batch.lengths[b]:].sum() == 0
  with pytest.raises(ValueError, match="no solution"):
    make_sft_batch(tok, [dataclasses.replace(problems[0], solution="")])


def test_prompt_batch_without_chat_template(tok):
  p = Problem(prompt="1+2", answer="3")
  batch = make_prompt_batch(tok, [p], 2, use_chat_template=False)
  assert batch.tokens[0].tolist() == tok.encode("1+2")
