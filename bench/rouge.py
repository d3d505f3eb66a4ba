"""ROUGE-L per pair: `trm_jax.data.rouge_l` against `rouge_score`'s RougeScorer, side by side.

  python -m bench.rouge            # writes bench/results/rouge.json

Both compute the same numbers (tests/test_data_text_rewards.py checks them bit for bit); this
times them at the sizes the summarisation tasks score every step: TL;DR (responses of about
40 words against 30-word references) and GovReport (about 700 words against 550). Texts are
drawn from a fixed English word list with punctuation and capitals, so that the stemmer sees
repeated words as real summaries have. Rounds alternate between the two implementations, each
round timing every pair once; the reported ratio is the median over rounds of
rouge_score's time / ours, and each round records the machine's load (`bench.hygiene`). Our
stems are memoised across calls, as they are over a training run (the first round pays for
them).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics

from rouge_score import rouge_scorer

from bench import hygiene
from trm_jax.data import rouge_l

HERE = os.path.dirname(os.path.abspath(__file__))
WORDS = ("the agency reported that its programs were not fully implemented and that officials "
         "had identified weaknesses in oversight of contracts grants funding spending "
         "assessments recommendations congress department defense federal government "
         "management systems security information technology requirements performance "
         "GAO recommends DOD should improve data collection monitoring 2019 $4.5 billion "
         "my friend cancels plans at the last minute should I pay off a car loan or invest "
         "boyfriend girlfriend relationship months years job apartment rent advice").split()
SIZES = {"tldr": (40, 30), "govreport": (700, 550)}


def text(rng: random.Random, n: int) -> str:
  words = [rng.choice(WORDS) for _ in range(n)]
  return " ".join(w.capitalize() + "." if rng.random() < 0.06 else w for w in words)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--pairs", type=int, default=20, help="pairs per size and round")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--out", default=os.path.join(HERE, "results", "rouge.json"))
  args = p.parse_args()
  scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
  rng = random.Random(0)
  result = {"what": "ROUGE-L F per pair (stemmed): trm_jax.data.rouge_l vs rouge_score",
            "machine": hygiene.machine(), "pairs": args.pairs, "rounds": args.rounds,
            "sizes": {}}
  for name, (n_pred, n_ref) in SIZES.items():
    pairs = [(text(rng, n_pred), text(rng, n_ref)) for _ in range(args.pairs)]
    rounds = []
    for _ in range(args.rounds):
      t_pkg, probe_pkg, f_pkg = hygiene.timed(
          lambda: [scorer.score(ref, pred)["rougeL"].fmeasure for pred, ref in pairs])
      t_ours, probe_ours, f_ours = hygiene.timed(
          lambda: [rouge_l(pred, ref) for pred, ref in pairs])
      assert f_pkg == f_ours, "rouge_l differs from rouge_score"
      rounds.append({"rouge_score_s_per_pair": t_pkg / len(pairs),
                     "ours_s_per_pair": t_ours / len(pairs), "ratio": t_pkg / t_ours,
                     "probe_rouge_score": probe_pkg, "probe_ours": probe_ours})
    result["sizes"][name] = {
        "prediction_words": n_pred, "reference_words": n_ref, "rounds": rounds,
        "median_ratio": statistics.median(r["ratio"] for r in rounds),
        "median_rouge_score_s_per_pair": statistics.median(
            r["rouge_score_s_per_pair"] for r in rounds),
        "median_ours_s_per_pair": statistics.median(r["ours_s_per_pair"] for r in rounds)}
    s = result["sizes"][name]
    print(f"{name}: rouge_score {s['median_rouge_score_s_per_pair'] * 1e3:.2f} ms / pair, "
          f"ours {s['median_ours_s_per_pair'] * 1e3:.3f} ms, ratio {s['median_ratio']:.1f}x")
  hygiene.write_json(result, args.out)


if __name__ == "__main__":
  main()
