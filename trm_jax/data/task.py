"""The RL task of a run: training prompts by data position, held-out problems, their rewards,
and the static lengths the sampler is compiled for.

  task = Task(c.task, seed=c.seed, tokenizer=tok, eval_problems=c.eval_problems)
  problems = task.batch(pos, n)                 # training problems pos .. pos+n-1
  pb = task.prompts(problems, group_size)       # PromptBatch [n*G, max_prompt_len]
  held_out = task.eval_problems(n)              # never returned by `batch`
  scores = task.score(completions, problems)    # {"reward": [B], part: [B], ...}
  P, R = task.max_prompt_len, task.max_new_tokens

What a task is (its source of problems, reward, metrics) is its registry entry
(data/tasks.py); this class applies one entry to one run's settings.

Config keys read (the `task` section of configs/tiny_trm.py):
  name            a registered task (data/tasks.py): the training source, its format and
                  its reward.
  path            the training data (file tasks): a local file, a `save_to_disk` directory or
                  a Hugging Face dataset id (data/loaders.py).
  subset, split   the dataset's subset and the split trained on ("" = default / the only one).
  eval_path       the held-out data; "" = a held-out split of `path`, or rows of it (below).
  eval_subset, eval_split   the same for `eval_path`; with eval_path "", eval_split names
                  another split of `path` (read with `subset`).
  eval_name       the format of `eval_path` (a file task); "" = same as `name` (a DAPO-Math
                  training file with an AIME evaluation file: name="dapo_math",
                  eval_name="aime"). Held-out completions get that task's reward and metrics.
  <section>       a generated task's settings (`task.synthetic`: `SyntheticConfig` fields).
  max_prompt_len  P; 0 = derived (generated tasks only; file tasks must set it).
  max_new_tokens  R; 0 = derived (generated tasks only; file tasks must set it).
  drop_long_prompts  False: a prompt longer than P is an error naming its row; True: such rows
                  are left out of training and evaluation, counted in the log (for data whose
                  longest documents would set P, GovReport's reports).

Held-out problems never reach training:
  * generated: evaluation draws stream `seed + 2`, training stream `seed` (warm-up SFT uses
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

Derived lengths (generated tasks): P is the length of the longest prompt the task can draw
(`Generator.longest_prompt`) tokenized as every training prompt is (`encode_prompt`: the chat
template with its generation prompt); R is `Generator.max_new_tokens` (for the synthetic task
the longest worked solution plus <eos>, exact for its tokenizer: one token per character).
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import ml_collections
import numpy as np

from trm_jax.config import ConfigError
from trm_jax.data import fingerprint
from trm_jax.data import tasks
from trm_jax.data.batching import PromptBatch, encode_prompt, make_prompt_batch
from trm_jax.data.loaders import DataFileError
from trm_jax.data.problem import Problem
from trm_jax.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

HOLDOUT_SEED = 0  # the held-out rows of a file task without eval_path (module docstring)
# Stream offsets from the run seed: RL prompts use `seed` (warm-up SFT `warmup.seed + 1`).
EVAL_STREAM = 2
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
    seed: the run seed (`c.seed`): a generated task's training stream is `seed`, its
      held-out stream `seed + 2`. File tasks do not use it (their held-out rows are
      run-independent).
    tokenizer: the policy's tokenizer (prompts, and a generated task's prompt length).
    eval_problems: how many held-out problems evaluation asks for (`c.eval_problems`); a file
      task without `eval_path` holds out this many rows of `path`.

  Attributes:
    spec / eval_spec: the registry entries of task.name and of the held-out format
      (task.eval_name, else task.name): rewards and metrics of training and evaluation.
    max_prompt_len: P, the prompt width of every `prompts` batch.
    max_new_tokens: R, the rollout's response length.
    settings: a generated task's settings (`Generator.settings`), or None for a file task.
    train_set / eval_set: the problem lists of a file task (None for a generated one).

  Raises ConfigError (one line naming the keys) for a file task without `path`, without
  max_prompt_len / max_new_tokens, with an unknown eval_name or one without eval_path, or whose
  file is too small to hold out eval_problems rows and still train. Bad rows in the files raise
  `loaders.DataFileError` naming the file and row.
  """

  def __init__(self, task_config: ml_collections.ConfigDict, seed: int, tokenizer: Tokenizer,
               eval_problems: int):
    t = task_config
    self.spec = tasks.check_section(t)
    self.name, self.seed, self.tok = t.name, int(seed), tokenizer
    self.eval_name = t.eval_name or t.name
    self.eval_spec = tasks.get_task(self.eval_name)
    self.drop_long_prompts = bool(t.drop_long_prompts)
    self.generator = self.spec.generator
    self.settings = None
    self.train_set: Optional[list[Problem]] = None
    self.eval_set: Optional[list[Problem]] = None
    # What was read, per config key naming a file (data/fingerprint.py); stored with every
    # checkpoint so a resume on changed data is refused. Empty for a generated task.
    self.fingerprint: dict[str, dict] = {}
    if self.generator is not None:
      g = self.generator
      self.settings = g.settings(t[g.section])
      self.max_prompt_len = t.max_prompt_len or len(
          encode_prompt(tokenizer, g.longest_prompt(self.settings)))
      self.max_new_tokens = t.max_new_tokens or g.max_new_tokens(self.settings)
      return
    self.max_prompt_len, self.max_new_tokens = t.max_prompt_len, t.max_new_tokens
    problems = tasks.load_problems(t.name, t.path, split=t.split, subset=t.subset)
    self.fingerprint["task.path"] = fingerprint.source_fingerprint(t.path, problems,
                                                                   split=t.split,
                                                                   subset=t.subset)
    if t.eval_path:
      self.train_set = problems
      self.eval_set = tasks.load_problems(self.eval_name, t.eval_path, split=t.eval_split,
                                    subset=t.eval_subset)
      self.fingerprint["task.eval_path"] = fingerprint.source_fingerprint(
          t.eval_path, self.eval_set, split=t.eval_split, subset=t.eval_subset)
    elif t.eval_split:   # a held-out split of the same dataset (check_section: not `split`)
      self.train_set = problems
      self.eval_set = tasks.load_problems(t.name, t.path, split=t.eval_split, subset=t.subset)
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
    that first draws it), or with task.drop_long_prompts the row is left out (training and
    held-out rows alike, counted in one warning per source); warns once when sampled prompts
    are mostly unknown tokens.

    File tasks encode every training prompt and the held-out ones evaluation asks for once
    (the chat template, as `prompts` does); a generated task's widest prompt is its
    `Generator.longest_prompt`.
    """
    if self.generator is not None:
      sources = [("task.max_prompt_len", [self.generator.longest_prompt(self.settings)], 1)]
    else:
      held = next((k for k in ("task.eval_path", "task.eval_split") if k in self.fingerprint),
                  "task.path")
      sources = [("task.path", self.train_set, len(self.train_set)),
                 (held, self.eval_set, eval_problems)]
    drop = self.drop_long_prompts and self.generator is None
    unk = self.tok.token_to_id(self.tok.special_tokens.get("unk_token", "")) \
        if self.tok.special_tokens.get("unk_token") else None
    unreadable, sampled, example = 0, 0, None
    kept = []
    for key, problems, wanted in sources:
      keep, dropped = [], []
      for i, p in enumerate(problems):
        if len(keep) >= wanted:
          break   # held-out rows evaluation never asks for
        ids = encode_prompt(self.tok, p)
        if len(ids) > self.max_prompt_len:
          if drop:
            dropped.append((len(ids), p.uid))
            continue
          where = (f"{self.fingerprint[key]['path']}, problem {p.uid}" if key in
                   self.fingerprint else f"task {self.name!r}'s longest prompt {p.prompt!r}")
          raise DataFileError(f"{where}: the prompt is {len(ids)} tokens, more than "
                              f"task.max_prompt_len={self.max_prompt_len}; raise it (or drop "
                              "the row, or set task.drop_long_prompts)")
        keep.append(p)
        if unk is not None and i < COVERAGE_SAMPLE:
          sampled += 1
          n_unk = sum(1 for t in ids if t == unk)
          if 2 * n_unk > len(ids):
            unreadable += 1
            example = example or (p.uid, n_unk, len(ids))
      if dropped:
        n, uid = max(dropped)
        where = self.fingerprint.get(key, {}).get("path", key)
        if not keep:
          raise DataFileError(f"{where}: every prompt is longer than task.max_prompt_len="
                              f"{self.max_prompt_len} (the longest, problem {uid}, is {n} "
                              "tokens); raise it")
        log.warning("%s (%s): left out %d of %d problems whose prompt is longer than "
                    "task.max_prompt_len=%d (task.drop_long_prompts; the longest, problem %s, "
                    "is %d tokens)", key, where, len(dropped), len(dropped) + len(keep),
                    self.max_prompt_len, uid, n)
      kept.append(keep)
    if drop:
      self.train_set, self.eval_set = kept
    if unreadable:
      uid, n_unk, n = example
      log.warning("%d of %d sampled prompts are mostly unknown tokens to the tokenizer at %s "
                  "(problem %s: %d of %d tokens are %s): the model cannot read them; train a "
                  "model whose tokenizer covers the data (model.path)", unreadable, sampled,
                  self.tok.path, uid, n_unk, n, self.tok.special_tokens["unk_token"])

  def batch(self, pos: int, n: int) -> list[Problem]:
    """Training problems pos .. pos+n-1: a pure function of (config, seed, pos), so the data
    position is all a checkpoint needs to resume. File tasks cycle through `train_set`."""
    if self.generator is not None:
      return self.generator.problems(self.settings, self.seed, pos, n)
    return [self.train_set[(pos + i) % len(self.train_set)] for i in range(n)]

  def eval_problems(self, n: int) -> list[Problem]:
    """The first n held-out problems (fewer if the evaluation file has fewer); the same list at
    every call. File tasks: no row `batch` returns. Generated: another stream of the same
    distribution, so a short problem can recur in both by chance, as in any fresh test set."""
    if self.generator is not None:
      return self.generator.problems(self.settings, self.seed + EVAL_STREAM, 0, n)
    return self.eval_set[:n]

  def score(self, completions: Sequence[str], problems: Sequence[Problem], *,
            held_out: bool = False) -> dict[str, np.ndarray]:
    """{"reward": [B] float32 in [0, 1], part: [B] for each logged part} of completion b
    against problems[b], by the training task's entry, or with `held_out` by the held-out
    format's (task.eval_name)."""
    if held_out:
      return tasks.score(self.eval_spec, self.eval_name, completions, problems)
    return tasks.score(self.spec, self.name, completions, problems)

  def prompts(self, problems: Sequence[Problem], group_size: int) -> PromptBatch:
    """Left-padded chat prompts [len(problems) * group_size, max_prompt_len]; a prompt longer
    than max_prompt_len is an error naming the problem."""
    return make_prompt_batch(self.tok, problems, group_size, max_prompt_len=self.max_prompt_len)
