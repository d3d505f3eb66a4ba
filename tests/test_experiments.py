"""The experiment scripts end to end at a tiny size, and their report arithmetic.

Each script runs as a real process (real warm-up, real trainer cells through the sweep runner)
and must write results.csv, its plots and summary.md; the summary's numbers are recomputed
here from the cells' own metrics.jsonl. The default sizes (which take up to 30 minutes) are run
by hand and their outputs committed under experiments/results/.
"""
import csv
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from experiments import report  # the repository root is on sys.path (tests run from it)

pytestmark = pytest.mark.slow

# Every run's settings (no per-run curves.png: the experiments draw their own).
RUN = ["rl.group_size=4", "export_hf=False", "plot=False"]
TINY = ["warmup.steps=10", "warmup.batch_size=16", "task.synthetic.max_operands=3",
        "task.synthetic.max_value=9", *RUN]             # with a base model of its own


def _run(script, tmp, shared_run, *args, shared_base=False):
  """The experiment as a process, with the session's persistent compilation cache (its cells
  are trainer subprocesses that compile the same programs); shared_base: start from the
  session's tiny_trm base model (only for a script whose config is tiny_trm's) instead of
  warming up a base of its own."""
  if shared_base:
    sets = shared_run.cli_args(flag="") + [a for s in RUN for a in ("--set", s)]
  else:
    sets = [a for s in TINY + [f"warmup.cache_dir={tmp}/base"] for a in ("--set", s)]
  p = subprocess.run([sys.executable, "-m", f"experiments.{script}",
                      "--workdir", str(tmp / "w"), "--out", str(tmp / "out"), "--steps", "2",
                      "--batch", "8", "--eval-problems", "4", "--parallel", "1", "--seeds", "0",
                      *sets, *args],
                     cwd=ROOT, capture_output=True, text=True, timeout=900, env=shared_run.env())
  assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
  return p.stdout


def _results(tmp) -> dict:
  """OUT/results.csv: cell name -> its row."""
  with open(tmp / "out" / "results.csv") as f:
    return {r["cell"]: r for r in csv.DictReader(f)}


def _step_records(tmp, cell) -> list[dict]:
  """The training steps' records of a cell's metrics.jsonl (evaluation-only lines left out)."""
  with open(tmp / "w" / "cells" / cell / "metrics.jsonl") as f:
    return [r for r in map(json.loads, f) if "reward" in r]


def _first_last_reward(tmp, cell):
  rewards = [r["reward"] for r in _step_records(tmp, cell)]
  return report.first_last_mean(np.array([r for r in rewards if r is not None], float))


def _cell(summary: str, method: str, col: int) -> str:
  line = next(l for l in summary.splitlines() if l.startswith(f"| {method} |"))
  return line.split(" | ")[col].rstrip(" |")


def test_trm_mismatch_end_to_end(tmp_path, shared_run):
  # One method and the frozen control keep the suite short; the method table and claims code
  # are the same for nine.
  out = _run("trm_mismatch", tmp_path, shared_run, "--methods", "trm_max_kl,frozen")
  rows = _results(tmp_path)
  assert set(rows) == {"method=trm_max_kl,seed=0", "method=frozen,seed=0"}
  assert rows["method=trm_max_kl,seed=0"]["rl.objective"] == "trm_surrogate"
  assert rows["method=trm_max_kl,seed=0"]["trm.criteria"] == "trm_max_kl"
  assert rows["method=frozen,seed=0"]["optim.lr"] == "0.0"
  for f in ("curves.png", "reject_by_length.png"):
    assert os.path.getsize(tmp_path / "out" / f) > 0
  summary = (tmp_path / "out" / "summary.md").read_text()
  assert summary in out
  trm_f, trm_l = _first_last_reward(tmp_path, "method=trm_max_kl,seed=0")
  ctl_f, ctl_l = _first_last_reward(tmp_path, "method=frozen,seed=0")
  assert _cell(summary, "trm_max_kl", 2) == f"{trm_l:.3f}"
  # The control-adjusted change is recomputed from both cells' own metrics.
  assert _cell(summary, "trm_max_kl", 3) == f"{(trm_l - trm_f) - (ctl_l - ctl_f):.3f}"
  # Held-out avg@k at step 0 is the same base policy with the same sampling key for every
  # method; the frozen control's never moves (AdamW at lr 0 leaves it bitwise unchanged).
  assert _cell(summary, "trm_max_kl", 4) == _cell(summary, "frozen", 4) \
      == _cell(summary, "frozen", 5)
  assert rows["method=frozen,seed=0"]["eval_first/avg@4"] == \
      rows["method=frozen,seed=0"]["eval/avg@4"]
  assert "## The paper's claims on these runs" in summary


def test_smd_compression_end_to_end(tmp_path, shared_run):
  _run("smd_compression", tmp_path, shared_run, "--policies", "h2o", "--ratios", "0.5",
       "--methods", "naive,smd@0.1", "--lambdas", "", "--skip-memory")
  rows = _results(tmp_path)
  assert set(rows) == {"method=dense,seed=0", "method=naive,h2o_0.5,seed=0",
                       "method=smd_0.1,h2o_0.5,seed=0"}
  summary = (tmp_path / "out" / "summary.md").read_text()
  section = summary.split("## Training reward")[1].split("##")[0]
  smd = next(l for l in section.splitlines() if l.startswith("| smd@0.1 |"))
  assert smd.split(" | ")[1].rstrip(" |") == \
      f"{_first_last_reward(tmp_path, 'method=smd_0.1,h2o_0.5,seed=0')[1]:.3f}"
  # SMD replays the eviction record: its residual mismatch is rounding; naive's is not.
  mism = summary.split("## Residual mismatch")[1].split("##")[0]
  val = lambda m: float(next(l for l in mism.splitlines()
                             if l.startswith(f"| {m} |")).split(" | ")[1].rstrip(" |"))
  assert val("smd@0.1") < 1e-4 < val("naive")
  # Compressed runs are also evaluated with their own cache policy (what SMD trains for).
  with open(tmp_path / "w" / "cells" / "method=smd_0.1,h2o_0.5,seed=0" / "summary.json") as f:
    ev = json.load(f)["eval"]
  assert set(ev) == {"greedy_accuracy", "compressed_greedy_accuracy"}
  comp = summary.split("with the rollout's compressed cache")[1].split("##")[0]
  line = next(l for l in comp.splitlines() if l.startswith("| smd@0.1 |"))
  assert line.split(" | ")[1].rstrip(" |") == f"{ev['compressed_greedy_accuracy']:.3f}"
  # The memory table compiles five learners: measured at default size, skipped here.
  assert "(skipped)" in summary.split("## Learner memory")[1].split("##")[0]


def test_staleness_end_to_end(tmp_path, shared_run):
  _run("staleness", tmp_path, shared_run, "--methods", "trm_max_kl", "--staleness", "0,1",
       shared_base=True)
  rows = _results(tmp_path)
  assert set(rows) == {"method=trm_max_kl,k=0,seed=0", "method=trm_max_kl,k=1,seed=0",
                       "method=frozen,seed=0"}
  assert rows["method=trm_max_kl,k=1,seed=0"]["rl.staleness"] == "1"
  # Step 2 of a k = 1 run is sampled by version 0 while the learner is at version 1.
  recs = _step_records(tmp_path, "method=trm_max_kl,k=1,seed=0")
  assert [r["rollout/staleness"] for r in recs] == [0.0, 1.0]
  # Staleness is the only mismatch: at k = 0 sampler and learner agree to rounding.
  recs0 = _step_records(tmp_path, "method=trm_max_kl,k=0,seed=0")
  assert max(r["trm/delta_hat"] for r in recs0) < 1e-5
  summary = (tmp_path / "out" / "summary.md").read_text()
  line = next(l for l in summary.splitlines() if l.startswith("| trm_max_kl | 1 |"))
  assert line.split(" | ")[2] == f"{np.mean([r['trm/delta_hat'] for r in recs]):.3f}"
  assert "## What these runs show" in summary


def test_lora_end_to_end(tmp_path, shared_run):
  """Both arms on the shared base, side by side: the LoRA arm trains adapters only at its
  own learning rate, and the summary's step-time ratio is the runs' own."""
  _run("lora", tmp_path, shared_run, "--parallel", "2", shared_base=True)
  rows = _results(tmp_path)
  assert set(rows) == {"arm=full,seed=0", "arm=lora,seed=0"}
  assert rows["arm=lora,seed=0"]["model.lora.rank"] == "8"
  assert rows["arm=lora,seed=0"]["optim.lr"] == "0.0003"
  step_s = {arm: _step_records(tmp_path, f"arm={arm},seed=0")[-1]["time/step_s"]
            for arm in ("full", "lora")}
  summary = (tmp_path / "out" / "summary.md").read_text()
  assert f"side by side: {step_s['lora'] / step_s['full']:.3f}" in summary
  assert "## What these runs show" in summary and "LoRA learns the task" in summary


# The long-horizon config on the session's shared base: its task set back to the base's.
LONG_ON_SHARED_BASE = ["task.synthetic.min_operands=2", "task.synthetic.min_value=1",
                       "task.synthetic.distinct=False"]


def test_trm_long_horizon_end_to_end(tmp_path, shared_run):
  # The sweep at one mismatch with one token-level method, then the comparison at the chosen
  # setting with methods whose runs the sweep already made, plus the control: three runs.
  out = _run("trm_long_horizon", tmp_path, shared_run, "--settings", "noise_1.0",
             "--sweep-methods", "ppo_clip", "--methods", "exact,ppo_clip,frozen",
             *[a for s in LONG_ON_SHARED_BASE for a in ("--set", s)], shared_base=True)
  rows = _results(tmp_path)
  assert set(rows) == {"method=exact,seed=0", "setting=noise_1.0,method=ppo_clip,seed=0",
                       "setting=noise_1.0,method=frozen,seed=0"}
  assert rows["setting=noise_1.0,method=ppo_clip,seed=0"]["rollout.logit_noise"] == "1.0"
  with open(tmp_path / "w" / "cells" / "method=exact,seed=0" / "config.json") as f:
    exact_rollout = json.load(f)["rollout"]   # the config's own sampler: no override
  assert (exact_rollout["dtype"], exact_rollout["logit_noise"]) == ("float32", 0.0)
  got = json.loads((tmp_path / "out" / "summary.json").read_text())
  assert got["setting"]["name"] == "noise_1.0" and set(got["methods"]) == {
      "exact", "ppo_clip", "frozen"}
  # The --set overrides every run shared (here the task set back to the shared base's) are
  # part of the setting, in the JSON and in both reports.
  assert got["setting"]["sets"]["task.synthetic.min_operands"] == 2
  assert "'task.synthetic.distinct': False" in (tmp_path / "out" / "sweep.md").read_text()
  for m, cell in (("exact", "method=exact,seed=0"),
                  ("ppo_clip", "setting=noise_1.0,method=ppo_clip,seed=0")):
    r = rows[cell]
    assert got["methods"][m]["heldout_gain_mean"] == pytest.approx(
        float(r["eval/avg@4"]) - float(r["eval_first/avg@4"]))
    assert got["methods"][m]["seeds"] == 1 and got["methods"][m]["heldout_gain_se"] is None
    lens = [r["response_len"] for r in _step_records(tmp_path, cell)]
    assert got["methods"][m]["mean_response_len"] == pytest.approx(np.mean(lens))
  assert got["methods"]["frozen"]["heldout_gain_mean"] == 0.0   # lr 0: bitwise unchanged
  summary = (tmp_path / "out" / "summary.md").read_text()
  assert summary in out and "## The sweep" in summary and "## The paper's claims" in summary
  assert (tmp_path / "out" / "sweep.md").read_text().strip() in summary
  assert os.path.getsize(tmp_path / "out" / "curves.png") > 0
  with open(tmp_path / "out" / "sweep.csv") as f:   # the sweep's runs, as the sweep left them
    assert {r["cell"] for r in csv.DictReader(f)} == {
        "method=exact,seed=0", "setting=noise_1.0,method=ppo_clip,seed=0"}
  # Continued "on another machine" in a phase of its own: a fresh workdir restored from
  # OUT/runs.jsonl.gz, the setting given by hand, one more seed planned but only reported on
  # (--report-only). Nothing runs; the summary quotes the earlier sweep, says the setting was
  # chosen by hand, gives the restored runs' numbers and says it is interim.
  assert got["complete"] and (got["runs_done"], got["runs_planned"]) == (3, 3)
  # OUT/base: a copy of the base the runs started from (here the session's shared base).
  from trm_jax import warmup  # pylint: disable=g-import-not-at-top
  assert got["base_sha256"] == warmup.model_digest(str(tmp_path / "out" / "base")) == (
      warmup.model_digest(shared_run.base_dir))
  shutil.rmtree(tmp_path / "w")
  _run("trm_long_horizon", tmp_path, shared_run, "--phase", "compare", "--setting", "noise_1.0",
       "--methods", "exact,ppo_clip,frozen", "--restore", "--report-only", "--seeds", "0,1",
       *[a for s in LONG_ON_SHARED_BASE for a in ("--set", s)], shared_base=True)
  assert os.listdir(tmp_path / "w" / "cells") and not any(
      os.path.exists(tmp_path / "w" / "cells" / c / "log.txt")
      for c in os.listdir(tmp_path / "w" / "cells"))
  interim = json.loads((tmp_path / "out" / "summary.json").read_text())
  assert (interim["runs_done"], interim["runs_planned"], interim["complete"]) == (3, 6, False)
  assert interim["methods"] == got["methods"]
  again = (tmp_path / "out" / "summary.md").read_text()
  assert (tmp_path / "out" / "sweep.md").read_text().strip() in again
  assert "chosen with --setting; the sweep below was run earlier" in again
  assert "**Interim: 3 of the comparison's 6 runs have finished**" in again


def test_trm_long_horizon_chooses_the_mildest_breaking_setting():
  from experiments import trm_long_horizon as lh  # pylint: disable=g-import-not-at-top
  exact = {"gain": [0.2, 0.2]}
  st = lambda g: {"gain": [g, g]}
  # bf16 keeps 90 % and 60 %; noise_0.3 keeps 40 % with TIS: the mildest that breaks.
  sw = {("ppo_clip", "bf16"): st(0.18), ("tis", "bf16"): st(0.12),
        ("ppo_clip", "noise_0.3"): st(0.15), ("tis", "noise_0.3"): st(0.08),
        ("ppo_clip", "noise_1.0"): st(-0.1), ("tis", "noise_1.0"): st(0.0)}
  setting, why = lh.choose_setting(sw, exact)
  assert setting == "noise_0.3" and "(40%)" in why
  # Nothing breaks: the setting that keeps least, and the reason says so.
  sw = {k: v for k, v in sw.items() if k[1] != "noise_1.0" and k[1] != "noise_0.3"}
  setting, why = lh.choose_setting(sw, exact)
  assert setting == "bf16" and why.startswith("no setting broke") and "(60%)" in why
  # No exact gain: no fraction to compare; the strongest mismatch swept, saying why.
  setting, why = lh.choose_setting(sw | {("tis", "noise_1.0"): st(0.0)}, {"gain": [0.0]})
  assert setting == "noise_1.0" and why.startswith("the exact sampler gained nothing")


def test_trm_long_horizon_claims_say_whether_masking_learns():
  from experiments import trm_long_horizon as lh  # pylint: disable=g-import-not-at-top
  st = lambda gains, reject=0.0: {"gain": gains, "reject": [reject] * len(gains),
                                  "abs_gap_last": [0.01] * len(gains)}
  # TRM rejects everything and gains what the frozen control does; PPO-clip collapses.
  stats = {"exact": st([0.16, 0.18, 0.15]), "ppo_clip": st([-0.3, -0.25, -0.28]),
           "trm_max_kl": st([0.01, -0.01, 0.0], reject=0.99), "frozen": st([0.0, 0.01, -0.01])}
  lines = lh.claims(stats)
  masked = [l for l in lines if l.startswith("- trm_max_kl vs the frozen control")]
  assert len(masked) == 1 and "99.0% of sequences rejected" in masked[0]
  assert "still learns under this mismatch': not resolved at this size" in masked[0]
  assert any("'TRM does better than token-level corrections'" in l and ": yes (" in l
             for l in lines)


def test_report_helpers():
  recs = [{"trm/reject_rate/len_0_16": 0.5, "trm/reject_rate/len_0_16/count": 2,
           "trm/reject_rate/len_16_32": 0.0, "trm/reject_rate/len_16_32/count": 0},
          {"trm/reject_rate/len_0_16": 0.0, "trm/reject_rate/len_0_16/count": 6,
           "trm/reject_rate/len_16_32": 1.0, "trm/reject_rate/len_16_32/count": 3}]
  b = report.weighted_bucket_rates(recs)
  assert b["0_16"] == (pytest.approx(1 / 8), 8) and b["16_32"] == (1.0, 3)
  assert sorted(["16_32", "0_16", "4096_inf"], key=report.bucket_order) == [
      "0_16", "16_32", "4096_inf"]
  assert report.first_last_mean(np.array([1.0, np.nan] + [0.0] * 18 + [3.0])) == (0.5, 1.5)
  assert report.finite_mean([1.0, 3.0, math.nan]) == 2.0
  assert report.fmt_values([1.0, 3.0, math.nan]) == "2.000 ± 1.414"   # std sqrt(2), NaN dropped
  assert report.fmt_values([math.nan]) == "n/a" and report.fmt_values([0.5]) == "0.500"
  d = report.compare([0.5, 0.6, 0.7], [0.1, 0.2, 0.15])
  assert d.diff == pytest.approx(0.45) and d.verdict("higher").startswith("yes")
  assert d.verdict("lower").startswith("no, the opposite")
  assert report.compare([0.5, 0.6, 0.7], [0.5, 0.7, 0.6]).verdict("higher").startswith(
      "not resolved at this size")
  assert report.paired([1.0, 2.0], [0.0, 1.0]).verdict("higher").startswith(
      "not resolved: 2 replicate(s)")
  p = report.paired([1.0, 2.0, 3.5], [0.5, 1.0, 3.0])
  assert p.se == pytest.approx(np.std([0.5, 1.0, 0.5], ddof=1) / math.sqrt(3))
  assert report.markdown_table(["a", "b"], [[1, 2]]) == "| a | b |\n|---|---|\n| 1 | 2 |"


def test_answer_forms_counts_what_it_samples(shared_run):
  """experiments.answer_forms on the session's base: every sampled response is counted once,
  in its form and operand count, and the accuracies are those counts' means."""
  from experiments import answer_forms  # pylint: disable=g-import-not-at-top
  assert answer_forms.answer_only("#### 12") and answer_forms.answer_only("\\boxed{3}\n")
  assert not answer_forms.answer_only("3+9=12\n#### 12")
  c = shared_run.config()
  r = answer_forms.forms(str(shared_run.base_dir), c, problems=8, samples=3, seed=0)
  assert r["n"] == 24 == r["answer_only"]["n"] + r["worked"]["n"]
  assert r["answer_only_frac"] == r["answer_only"]["n"] / 24
  by_k = r["by_operands"]
  assert {int(k) for k in by_k} <= set(range(2, c.task.synthetic.max_operands + 1))
  assert sum(s["n"] for s in by_k.values()) == 24
  correct = sum(s["accuracy"] * s["n"] for s in by_k.values())
  assert math.isclose(r["accuracy"] * 24, correct, abs_tol=1e-9)
  parts = [r[f]["accuracy"] * r[f]["n"] for f in ("answer_only", "worked") if r[f]["n"]]
  assert math.isclose(sum(parts), correct, abs_tol=1e-9)


def test_algorithms_long_horizon_report_is_what_its_archives_give(tmp_path):
  """The committed comparison of GSPO, CISPO and PPO-clip + seq_mis / geo_mean with TRM-max,
  PPO-clip and the exact sampler (experiments/results/algorithms_long_horizon) is recomputed
  from the committed run archives alone, its own and the references': the runs it counts and
  names missing, every method's numbers, and each paired difference's mean and 2 s.e. over
  the seeds both methods have (none for one seed)."""
  from experiments import algorithms_long_horizon as alh  # pylint: disable=g-import-not-at-top
  from trm_jax import run_archive, sweep  # pylint: disable=g-import-not-at-top
  out = os.path.join(alh.RESULTS, "algorithms_long_horizon")
  committed = json.loads(open(os.path.join(out, "summary.json")).read())
  w = str(tmp_path / "w")
  for a in sorted({a for parts in alh.REFERENCE.values() for a, _ in parts}):
    run_archive.restore_runs(os.path.join(alh.RESULTS, a), w, alh.CONFIG)
  archived = set(run_archive.restore_runs(os.path.join(out, alh.ARCHIVE), w, alh.CONFIG))
  grid = [f"setting={alh.SETTING},method={m},seed={s}" for s in (0, 1, 2) for m in alh.METHODS]
  assert archived <= set(grid)
  assert committed["runs_done"] == len(archived)
  assert committed["missing"] == [n for n in grid if n not in archived]
  assert committed["complete"] == (not committed["missing"])
  _, planned = sweep.load_plan(w)
  new = {m: [c for c in planned if c.name.startswith(f"setting={alh.SETTING},method={m},")]
         for m in alh.METHODS}
  _, _, methods = alh.tables(w, {**alh.reference_cells(w), **new}, 4)
  assert json.loads(json.dumps(methods)) == committed["methods"]
  for m in alh.METHODS:
    if m not in committed["methods"]:
      assert not new[m]
      continue
    for ref in alh.REFERENCE:
      for key, _, _ in alh.MEASURES:
        a, b = (committed["methods"][x]["per_seed"][key] for x in (m, ref))
        d = np.array([a[s] - b[s] for s in sorted(set(a) & set(b))])
        got = committed["methods"][m]["minus"][ref][key]
        assert got["seeds"] == len(d) and got["diff"] == pytest.approx(d.mean(), abs=1e-12)
        if len(d) > 1:
          assert got["two_se"] == pytest.approx(2 * d.std(ddof=1) / math.sqrt(len(d)), abs=1e-12)
        else:
          assert got["two_se"] is None
