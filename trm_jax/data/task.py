"""The RL task: training prompts by data position, held-out problems, and the static lengths the
sampler is compiled for.

  task = Task(c.task, seed=c.seed, tokenizer=tok, eval_problems=c.eval_problems)
  problems = task.batch(pos, n)                 # training problems pos .. pos+n-1
  pb = task.prompts(problems, group_size)       # PromptBatch [n*G, max_prompt_len]
  held_out = task.eval_problems(n)              # never returned by `batch`
  P, R = task.max_prompt_len, task.max_new_tokens

Config keys read (the `task` section of configs/tiny_trm.py):
  name            synthetic | gsm8k | dapo_math | aime: the training source and its format.
  path            the training data (file tasks): a local file, a `save_to_disk` directory or
                  a Hugging Face dataset id (data/loaders.py).
  subset, split   the dataset's subset and the split trained on ("" = default / the only one).
  eval_path       the held-out data; "" = a held-out split of `path`, or rows of it (below).
  eval_subset, eval_split   the same for `eval_path`; with eval_path "", eval_split names
                  another split of `path` (read with `subset`).
  eval_name       the format of `eval_path`; "" = same as `name` (a DAPO-Math training file
                  with an AIME evaluation file: name="dapo_math", eval_name="aime").
  synthetic       `SyntheticConfig` fields (synthetic task).
  max_prompt_len  P; 0 = derived (synthetic task only; file tasks must set it).
  max_new_tokens  R; 0 = derived (synthetic task only; file tasks must set it).

Held-out problems never reach training:
  * synthetic: evaluation draws stream `seed + 2`, training stream `seed` (warm-up SFT uses
    `warmup.seed + 1`, one base for every seed): independent draws, a fresh test set from the
    same distribution.
  * file task with eval_path: the evaluation data; training uses all of `path`'s split.
  * file task with eval_split but no eval_path: that split of `path` (a dataset's own held-out
    split, GSM8K's test); training uses all of `split`, which must be another one.
  * file task with neither: `eval_problems` rows of `path` are held out, chosen by a
    permutation with the fixed seed HOLDOUT_SEED (not the run's seed, so every run, seed and
    sweep cell evaluates on the same rows; a larger eval_problems holds out a superset). A
    random rather than a trailing slice because files are often ordered by source or
    difficulty. Training cycles through the remaining rows in file order.

Derived lengths (synthetic task): P is the length of the longest prompt the task can draw
(`synthetic.longest_prompt_problem`) tokenized through `make_prompt_batch`, the path every
training prompt takes; R is `synthetic.max_completion_tokens` (the longest worked solution
plus <eos>). Both are exact for the synthetic tokenizer (one token per character).
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import ml_collections
import numpy as np

from trm_jax.config import ConfigError, synthetic_config, validate_task
from trm_jax.data import fingerprint
from trm_jax.data import synthetic
from trm_jax.data.batching import PromptBatch, encode_prompt, make_prompt_batch
from trm_jax.data.loaders import DataFileError, load_problems
from trm_jax.data.problem import Problem
from trm_jax.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

HOLDOUT_SEED = 0  # the held-out rows of a file task without eval_path (module docstring)
# Stream offsets from the run seed: RL prompts use `seed` (warm-up SFT `warmup.seed + 1`).
SYNTHETIC_EVAL_STREAM = 2
# Prompts per source whose tokens `check_prompts` counts as known or unknown to the tokenizer.
COVERAGE_SAMPLE = 64


def holdout_split(n_rows: int, n_eval: int) -> tuple[np.ndarray, np.ndarray]:
  """(train rows [n_rows - n_eval] ascending, eval rows [n_eval]) of a file of n_rows rows.

  Eval rows are the first n_eval of a fixed permutation (HOLDOUT_SEED), so they depend only on
  (n_rows, n_eval) and grow as a superset with n_eval.
  """
  perm = np.random.default_rng(HOLDOUT_SEED).permutation(n_rows)
  eval_rows = perm[:n_eval]
  return np.sort(perm[n_eval:]), eval_rows


class Task:
  """Training and held-out problems of one task, and the sampler's static lengths.

  Args:
    task_config: the config's `task` section (keys in the module docstring).
    seed: the run seed (`c.seed`): the synthetic training stream is `seed`, its held-out
      stream `seed + 2`. File tasks do not use it (their held-out rows are run-independent).
    tokenizer: the policy's tokenizer (prompts, and the synthetic prompt length).
    eval_problems: how many held-out problems evaluation asks for (`c.eval_problems`); a file
      task without `eval_path` holds out this many rows of `path`.

  Attributes:
    max_prompt_len: P, the prompt width of every `prompts` batch.
    max_new_tokens: R, the rollout's response length.
    synthetic: the SyntheticConfig, or None for a file task.
    train_set / eval_set: the problem lists of a file task (None for synthetic).

  Raises ConfigError (one line naming the keys) for a file task without `path`, without
  max_prompt_len / max_new_tokens, with an unknown eval_name or one without eval_path, or whose
  file is too small to hold out eval_problems rows and still train. Bad rows in the files raise
  `loaders.DataFileError` naming the file and row.
  """

  def __init__(self, task_config: ml_collections.ConfigDict, seed: int, tokenizer: Tokenizer,
               eval_problems: int):
    t = task_config
    validate_task(t)
    self.name, self.seed, self.tok = t.name, int(seed), tokenizer
    self.synthetic: Optional[synthetic.SyntheticConfig] = None
    self.train_set: Optional[list[Problem]] = None
    self.eval_set: Optional[list[Problem]] = None
    # What was read, per config key naming a file (data/fingerprint.py); stored with every
    # checkpoint so a resume on changed data is refused. Empty for the synthetic task.
    self.fingerprint: dict[str, dict] = {}
    if t.name == "synthetic":
      self.synthetic = synthetic_config(t.synthetic)
      self.max_prompt_len = t.max_prompt_len or synthetic.max_prompt_tokens(self.synthetic,
                                                                             tokenizer)
      self.max_new_tokens = t.max_new_tokens or synthetic.max_completion_tokens(self.synthetic)
      return
    eval_name = t.eval_name or t.name
    self.max_prompt_len, self.max_new_tokens = t.max_prompt_len, t.max_new_tokens
    problems = load_problems(t.name, t.path, split=t.split, subset=t.subset)
    self.fingerprint["task.path"] = fingerprint.source_fingerprint(t.path, problems,
                                                                   split=t.split,
                                                                   subset=t.subset)
    if t.eval_path:
      self.train_set = problems
      self.eval_set = load_problems(eval_name, t.eval_path, split=t.eval_split,
                                    subset=t.eval_subset)
      self.fingerprint["task.eval_path"] = fingerprint.source_fingerprint(
          t.eval_path, self.eval_set, split=t.eval_split, subset=t.eval_subset)
    elif t.eval_split:   # a held-out split of the same dataset (validate_task: not `split`)
      self.train_set = problems
      self.eval_set = load_problems(t.name, t.path, split=t.eval_split, subset=t.subset)
      self.fingerprint["task.eval_split"] = fingerprint.source_fingerprint(
          t.path, self.eval_set, split=t.eval_split, subset=t.subset)
    elif eval_problems:
      if len(problems) <= eval_problems:
        raise ConfigError(
            f"task.path={t.path} has {len(problems)} problems; holding out "
            f"eval_problems={eval_problems} of them for evaluation (task.eval_path is empty) "
            "leaves none to train on. Set task.eval_path or lower eval_problems")
      train_rows, eval_rows = holdout_split(len(problems), eval_problems)
      self.train_set = [problems[i] for i in train_rows]
      self.eval_set = [problems[i] for i in eval_rows]
    else:  # no evaluation asked for: train on every row
      self.train_set, self.eval_set = problems, []
    if eval_problems > len(self.eval_set):
      # Said once, here; evaluation then uses every row (eval_problems(n) caps at it).
      source = (f"task.eval_path={t.eval_path}" if t.eval_path else
                f"task.eval_split={t.eval_split!r} of {t.path}")
      log.warning("eval_problems=%d, but %s has %d problems: evaluating on all %d",
                  eval_problems, source, len(self.eval_set), len(self.eval_set))

  def check_prompts(self, eval_problems: int) -> None:
    """Every prompt the run can draw fits max_prompt_len, else `DataFileError` naming the
    file, the row and the key (a too-long prompt would otherwise fail mid-run, at the step
    that first draws it); warns once when sampled prompts are mostly unknown tokens.

    File tasks encode every training and held-out prompt once (the chat template, as
    `prompts` does); the synthetic task's widest prompt is `longest_prompt_problem`.
    """
    if self.synthetic is not None:
      sources = [("task.max_prompt_len", [synthetic.longest_prompt_problem(self.synthetic)])]
    else:
      held = next((k for k in ("task.eval_path", "task.eval_split") if k in self.fingerprint),
                  "task.path")
      sources = [("task.path", self.train_set), (held, self.eval_set[:eval_problems])]
    unk = self.tok.token_to_id(self.tok.special_tokens.get("unk_token", "")) \
        if self.tok.special_tokens.get("unk_token") else None
    unreadable, sampled, example = 0, 0, None
    for key, problems in sources:
      for i, p in enumerate(problems):
        ids = encode_prompt(self.tok, p)
        if len(ids) > self.max_prompt_len:
          where = (f"{self.fingerprint[key]['path']}, problem {p.uid}" if key in
                   self.fingerprint else f"the synthetic task's longest prompt {p.prompt!r}")
          raise DataFileError(f"{where}: the prompt is {len(ids)} tokens, more than "
                              f"task.max_prompt_len={self.max_prompt_len}; raise it (or drop "
                              "the row)")
        if unk is not None and i < COVERAGE_SAMPLE:
          sampled += 1
          n_unk = sum(1 for t in ids if t == unk)
          if 2 * n_unk > len(ids):
            unreadable += 1
            example = example or (p.uid, n_unk, len(ids))
    if unreadable:
      uid, n_unk, n = example
      log.warning("%d of %d sampled prompts are mostly unknown tokens to the tokenizer at %s "
                  "(problem %s: %d of %d tokens are %s): the model cannot read them; train a "
                  "model whose tokenizer covers the data (model.path)", unreadable, sampled,
                  self.tok.path, uid, n_unk, n, self.tok.special_tokens["unk_token"])

  def batch(self, pos: int, n: int) -> list[Problem]:
    """Training problems pos .. pos+n-1: a pure function of (config, seed, pos), so the data
    position is all a checkpoint needs to resume. File tasks cycle through `train_set`."""
    if self.synthetic is not None:
      return synthetic.problem_batch(self.synthetic, self.seed, pos, n)
    return [self.train_set[(pos + i) % len(self.train_set)] for i in range(n)]

  def eval_problems(self, n: int) -> list[Problem]:
    """The first n held-out problems (fewer if the evaluation file has fewer); the same list at
    every call. File tasks: no row `batch` returns. Synthetic: another stream of the same
    distribution, so a short problem can recur in both by chance, as in any fresh test set."""
    if self.synthetic is not None:
      return synthetic.problem_batch(self.synthetic, self.seed + SYNTHETIC_EVAL_STREAM, 0, n)
    return self.eval_set[:n]

  def prompts(self, problems: Sequence[Problem], group_size: int) -> PromptBatch:
    """Left-padded chat prompts [len(problems) * group_size, max_prompt_len]; a prompt longer
    than max_prompt_len is an error naming the problem."""
    return make_prompt_batch(self.tok, problems, group_size, max_prompt_len=self.max_prompt_len)
