"""Tasks as registered variants: where a task's problems come from, its reward, its metrics.

A task is one `TaskSpec` in the `TASKS` registry, registered by the module that defines it and
named by the config's `task.name` (what trains) and `task.eval_name` (the format of
`task.eval_path`). Nothing else names a task: `data.task.Task` reads or generates its problems
through the entry, `step.rl_step` and `step.evaluate` score completions with its `reward`,
its `binary` flag picks the held-out metrics (data/evaluation.py), and `config.validate` runs
`validate` here (the checks of its kind and its own `check` hook).

    TASKS["tldr"].reward(completion, problem)    # a float in [0, 1]
    load_problems("hotpotqa", "hotpotqa/hotpot_qa", subset="distractor", split="validation")

The shipped tasks and the modules that register them:
  synthetic              running sums, generated (data/synthetic.py); math reward, binary
  gsm8k, dapo_math, aime math problems from files (data/math_tasks.py); math reward, binary
  tldr, govreport        summarisation from files (data/summarization.py); ROUGE-L F, graded
  hotpotqa               multi-hop QA with distractors (data/hotpotqa.py); SQuAD token F1,
                         graded, exact match logged beside it

A task's problems come from one of two places:
  * `load(paths, *, split, subset) -> [Problem]`: a file task. The config names its data
    (task.path, task.subset, task.split, the eval_* keys) and sets task.max_prompt_len and
    task.max_new_tokens; data/loaders.py reads every source kind (files, `save_to_disk`
    directories, hub ids).
  * `generator`: problems as a pure function of (settings, seed, index) (`Generator`). Its
    settings are the config section `task.<generator.section>`; the sampler's lengths are
    derived from its widest prompt and longest solution when the config leaves them 0.

Rewards and metrics. `reward(completion, problem)` is what GRPO's advantages see; a binary
task's is 0.0 or 1.0, a graded task's anywhere in [0, 1] (`score` refuses anything else,
naming the task and the problem). `parts(completion, problem)`, optional, gives the numbers
a graded reward is made of or sits beside (ROUGE-L's precision and recall, QA exact match);
they are logged next to the reward, never trained on. Binary tasks report accuracy, avg@k
and pass@k; graded ones the mean reward and the mean of each part.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence

import ml_collections
import numpy as np

from trm_jax import config as config_lib
from trm_jax.data.problem import Problem
from trm_jax.registry import Registry

# (completion, problem) -> reward in [0, 1]; -> {part name: value} for the logged parts.
Reward = Callable[[str, Problem], float]
Parts = Callable[[str, Problem], Mapping[str, float]]
# (paths, *, split, subset) -> problems; task-specific keyword arguments (an instruction) may
# follow with defaults.
Loader = Callable[..., list[Problem]]


@dataclasses.dataclass(frozen=True)
class Generator:
  """A task whose problems are computed, not read: the synthetic running sums, or a testbed.

  Every callable takes the generator's own settings object (what `settings` returns)."""
  section: str                                   # its settings: the config's task.<section>
  settings: Callable[[ml_collections.ConfigDict], Any]   # that section -> settings; bad
                                                 #   values raise ConfigError naming the keys
  problems: Callable[[Any, int, int, int], list[Problem]]   # (settings, seed, start, n):
                                                 #   problems start .. start+n-1 of stream
                                                 #   `seed`, a pure function of its arguments
  longest_prompt: Callable[[Any], Problem]       # a problem whose prompt is the widest it can
                                                 #   draw (sizes task.max_prompt_len = 0)
  max_new_tokens: Callable[[Any], int]           # the longest solution + <eos>, in tokens of
                                                 #   the warm-up tokenizer (task.max_new_tokens
                                                 #   = 0)
  problem_count: Callable[[Any], int]            # distinct problems it can draw (eval_problems
                                                 #   may not ask for more)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """A registered task. Exactly one of `load` and `generator` is set."""
  reward: Reward                       # (completion, problem) -> [0, 1]
  binary: bool                         # rewards are 0 or 1: accuracy, avg@k, pass@k; else
                                       #   graded: mean reward and the mean of each part
  load: Optional[Loader] = None        # a file task's reader
  generator: Optional[Generator] = None   # a generated task's problems
  parts: Optional[Parts] = None        # logged beside the reward (graded tasks)
  check: Optional[Callable[[ml_collections.ConfigDict], None]] = None
                                       # the task's own setting checks on the whole config
                                       #   (config.validate); raise ConfigError naming keys

  def __post_init__(self):
    if (self.load is None) == (self.generator is None):
      raise ValueError("a TaskSpec has exactly one source of problems: load (a file task) or "
                       "generator (a generated task)")
    if self.binary and self.parts is not None:
      raise ValueError("a binary task's metrics are accuracy, avg@k and pass@k: parts are for "
                       "graded tasks")


TASKS: Registry[TaskSpec] = Registry("task")


def register_task(name: str, spec: TaskSpec) -> TaskSpec:
  """Adds `spec` under `name` (the value of `task.name` / `task.eval_name`)."""
  return TASKS.register(name, spec)


def get_task(name: str) -> TaskSpec:
  return TASKS.get(name)


def load_problems(name: str, paths: str | Sequence[str], **kwargs) -> list[Problem]:
  """The problems of file task `name` in `paths` (a file, files, a `save_to_disk` directory
  or a hub id; `split=`, `subset=` and the task's own keyword arguments, data/loaders.py)."""
  spec = get_task(name)
  if spec.load is None:
    raise ValueError(f"task {name!r} generates its problems; it reads no files")
  return spec.load(paths, **kwargs)


# ------------------------------------------------------------------------------ scoring
def score(spec: TaskSpec, name: str, completions: Sequence[str],
          problems: Sequence[Problem]) -> dict[str, np.ndarray]:
  """{"reward": [B] float32, part: [B] float64 for each of the task's parts} of completion b
  against problems[b]. A reward outside [0, 1] (or not 0 / 1 for a binary task) is a
  ValueError naming the task and the problem: a bug in the reward, caught at the step that
  meets it rather than as advantages of the wrong scale."""
  if len(completions) != len(problems):
    raise ValueError(f"{len(completions)} completions for {len(problems)} problems")
  rewards = np.array([spec.reward(t, p) for t, p in zip(completions, problems)], np.float32)
  for r, p in zip(rewards, problems):
    if not (0.0 <= r <= 1.0) or (spec.binary and r not in (0.0, 1.0)):
      want = "0 or 1 (a binary task)" if spec.binary else "in [0, 1]"
      raise ValueError(f"task {name!r}: the reward of a completion of problem {p.uid!r} is "
                       f"{float(r)!r}, not {want}")
  out = {"reward": rewards}
  if spec.parts is not None:
    rows = [spec.parts(t, p) for t, p in zip(completions, problems)]
    for key in rows[0] if rows else ():
      out[key] = np.array([float(r[key]) for r in rows], np.float64)
  return out


# ------------------------------------------------------------------------------ checks
def check_section(t: ml_collections.ConfigDict) -> TaskSpec:
  """Checks of the `task` section that its kind implies (file or generated task); returns
  the entry of `task.name`. Run by `validate` and by `data.task.Task`."""
  require = config_lib.require
  require(t.name in TASKS, ["task.name"],
          f"unknown value {t.name!r}; expected one of {', '.join(map(repr, sorted(TASKS)))}")
  files = sorted(n for n, s in TASKS.items() if s.load is not None)
  require(t.eval_name in ("", *files), ["task.eval_name"],
          f"unknown value {t.eval_name!r}; expected '' or a task that reads files: "
          f"{', '.join(map(repr, files))}")
  require(t.max_prompt_len >= 0 and t.max_new_tokens >= 0,
          ["task.max_prompt_len", "task.max_new_tokens"], "must be >= 0 (0 = derived)")
  spec = TASKS[t.name]
  if spec.generator is not None:
    require(not (t.path or t.eval_path or t.eval_name),
            ["task.name", "task.path", "task.eval_path", "task.eval_name"],
            f"task.name={t.name!r} generates its problems and reads no files; leave "
            "task.path, task.eval_path and task.eval_name empty")
    require(not (t.subset or t.split or t.eval_subset or t.eval_split),
            ["task.name", "task.subset", "task.split", "task.eval_subset", "task.eval_split"],
            f"task.name={t.name!r} reads no dataset; leave the subsets and splits empty")
    return spec
  require(bool(t.path), ["task.name", "task.path"],
          f"task.name={t.name!r} needs task.path (a local jsonl/json/parquet file, a "
          "save_to_disk directory or a Hugging Face dataset id)")
  require(t.max_prompt_len > 0 and t.max_new_tokens > 0,
          ["task.name", "task.max_prompt_len", "task.max_new_tokens"],
          f"task.name={t.name!r} needs task.max_prompt_len and task.max_new_tokens > 0 (only "
          "generated tasks derive them)")
  require(not t.eval_name or bool(t.eval_path), ["task.eval_name", "task.eval_path"],
          f"task.eval_name={t.eval_name!r} is the format of task.eval_path, which is empty "
          "(held-out rows of task.path have task.name's format)")
  require(not t.eval_subset or bool(t.eval_path), ["task.eval_subset", "task.eval_path"],
          f"task.eval_subset={t.eval_subset!r} selects within task.eval_path, which is empty "
          "(a held-out split of task.path is read with task.subset)")
  # Held out from the same dataset, the evaluation split must be another one: the same split
  # would evaluate on the problems training draws.
  require(bool(t.eval_path) or not t.eval_split or t.eval_split != t.split,
          ["task.split", "task.eval_split"],
          f"task.eval_split={t.eval_split!r} is the training split of task.path; name "
          "another split, or leave task.eval_split empty to hold out rows of the training split")
  return spec


def validate(c: ml_collections.ConfigDict) -> None:
  """The task's part of `config.validate`: its section, a generator's settings and problem
  count against eval_problems, and the entry's own `check`."""
  spec = check_section(c.task)
  g = spec.generator
  if g is not None:
    n = g.problem_count(g.settings(c.task[g.section]))
    config_lib.require(c.eval_problems <= n, ["eval_problems"],
                       f"{c.eval_problems} held-out problems, but task.{g.section} can draw "
                       f"only {n} distinct problems; lower eval_problems")
  if spec.check is not None:
    spec.check(c)


def reads_files(name: str) -> bool:
  """Whether task `name` is a file task (False for a generated or unknown one)."""
  return name in TASKS and TASKS[name].load is not None

