r"""How a checkpoint answers the synthetic task: with the sum worked out, or the answer alone.

  python -m experiments.answer_forms --checkpoint ~/.cache/trm_jax/tiny_base \
      --checkpoint /tmp/trm_tiny/hf --out /tmp/answer_forms.json

The main job's base is warmed up on a mix (`warmup.answer_only_frac` of the demonstrations give
the answer alone), so it sometimes answers a sum without working it out. This script says how
often each checkpoint does, on the main job's held-out problems (the trainer's
`Task.eval_problems` for the config and seed), sampled as the trainer's evaluation samples
(temperature `eval_temperature`, top-p `eval_top_p`, the learner's fp32, a fixed key), and how
often each form is right, per operand count. Comparing the base with the trained policy shows
what GRPO changed. A response is answer-only when its first line is the answer line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "tiny_trm.py")


def answer_only(completion: str) -> bool:
  """The response's first line is its answer (`#### N` or `\\boxed{N}`): no worked line."""
  first = completion.split("\n", 1)[0].lstrip()
  return first.startswith("####") or first.startswith("\\boxed")


def forms(checkpoint: str, c, problems: int, samples: int, seed: int) -> dict:
  """How `checkpoint` answers `problems` held-out problems of config `c`, `samples` draws
  each from sampling key `seed`: {n, accuracy, answer_only_frac, answer_only: {n, accuracy},
  worked: {n, accuracy}, by_operands: {operand count: the same without by_operands}}."""
  import jax  # pylint: disable=g-import-not-at-top
  from trm_jax.data.rewards import math_reward  # pylint: disable=g-import-not-at-top
  from trm_jax.data.task import Task  # pylint: disable=g-import-not-at-top
  from trm_jax.data.tokenizer import load_tokenizer  # pylint: disable=g-import-not-at-top
  from trm_jax.models import from_pretrained  # pylint: disable=g-import-not-at-top
  from trm_jax.rollout import generate  # pylint: disable=g-import-not-at-top
  from trm_jax.step import completions_of  # pylint: disable=g-import-not-at-top

  tok = load_tokenizer(checkpoint)
  model = from_pretrained(checkpoint)
  task = Task(c.task, seed=c.seed, tokenizer=tok, eval_problems=problems)
  probs = task.eval_problems(problems)
  pb = task.prompts(probs, samples)                                  # [problems * samples, P]
  P = pb.tokens.shape[1]
  roll = generate(model, pb.tokens, pb.lengths, max_new_tokens=task.max_new_tokens,
                  key=jax.random.key(seed), temperature=c.eval_temperature,
                  top_p=c.eval_top_p)
  rows = []
  for b, text in enumerate(completions_of(tok, roll, P)):
    p = probs[b // samples]
    rows.append((p.prompt.count("+") + p.prompt.count("-") + 1, answer_only(text),
                 math_reward(text, p.answer) > 0))

  def summary(sel):
    n = len(sel)
    out = {"n": n, "accuracy": float(np.mean([r[2] for r in sel])) if n else None}
    for name, flag in (("answer_only", True), ("worked", False)):
      part = [r for r in sel if r[1] == flag]
      out[name] = {"n": len(part),
                   "accuracy": float(np.mean([r[2] for r in part])) if part else None}
    out["answer_only_frac"] = out["answer_only"]["n"] / n if n else None
    return out

  by_k = defaultdict(list)
  for r in rows:
    by_k[r[0]].append(r)
  return {**summary(rows), "by_operands": {str(k): summary(v) for k, v in sorted(by_k.items())}}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--checkpoint", action="append", required=True,
                  help="an HF checkpoint directory (repeat to compare several)")
  ap.add_argument("--config", default=CONFIG, help="the config whose task and seed say which "
                  "held-out problems (default: the main job's)")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=V",
                  help="config override (e.g. seed=1)")
  ap.add_argument("--problems", type=int, default=256)
  ap.add_argument("--samples", type=int, default=4)
  ap.add_argument("--key", type=int, default=0, help="sampling key")
  ap.add_argument("--out", default="", help="also write the JSON here")
  args = ap.parse_args(argv)
  from trm_jax import sweep  # pylint: disable=g-import-not-at-top
  c = sweep.cell_config(args.config, sweep.parse_sets(args.set).items())
  result = {"config": os.path.relpath(args.config, REPO) if args.config.startswith(REPO)
            else args.config, "overrides": args.set, "problems": args.problems,
            "samples": args.samples,
            "checkpoints": {ck: forms(os.path.expanduser(ck), c, args.problems, args.samples,
                                      args.key) for ck in args.checkpoint}}
  f = lambda x: "-" if x is None else f"{x:.3f}"   # pylint: disable=unnecessary-lambda-assignment
  for ck, r in result["checkpoints"].items():
    print(f"{ck}: accuracy {f(r['accuracy'])}; answer-only {f(r['answer_only_frac'])} of "
          f"responses (accuracy {f(r['answer_only']['accuracy'])}), worked accuracy "
          f"{f(r['worked']['accuracy'])}")
    for k, s in r["by_operands"].items():
      print(f"  {k} operands: {s['n']} responses, answer-only {f(s['answer_only_frac'])} "
            f"(accuracy {f(s['answer_only']['accuracy'])}), worked accuracy "
            f"{f(s['worked']['accuracy'])}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
