"""What the user sees: per-step metrics to JSON lines, TensorBoard and a progress bar; curves; summary.

`MetricsLogger` writes, per logged step,
  <workdir>/metrics.jsonl  one JSON object per line: {"step", "wall_time", <metric>: float|null}
  <workdir>/tb/            TensorBoard event files (tensorboardX; no tensorflow needed)
  stderr                   a tqdm bar with ETA and a few key numbers
`plot_curves` turns metrics.jsonl into a PNG grid with rolling means, and `summarize` /
`format_summary` compute the numbers the run is judged by (mean of a key over the last 10% of
logged steps minus the first 10%).

Non-finite values (a NaN loss, an infinite ratio) are written as JSON null and left out of
TensorBoard, so one bad step neither crashes logging nor squashes a TensorBoard axis.

Resume: open the logger with `resume_step` = the step of the restored checkpoint. Lines with
step > resume_step (written after that checkpoint, by the run that died) are dropped and the
file is appended from there, so the resumed run leaves exactly one line per step; TensorBoard
gets `purge_step = resume_step + 1`, which hides the dead run's later events. A line torn by a
crash mid-write is dropped with a warning and the file rewritten without it; when that line
was the resumed step's own, `resume_record` (the copy the checkpoint holds) takes its place,
so the file again holds exactly the rows the checkpoint covers. `resume_step=None` (a fresh start) clears old lines
and hides all old TensorBoard events (purge_step 0).

TensorBoard tags are the metric names with `*` spelled `_star` and any other character
TensorBoard rejects replaced by `_` (so `B*` appears as `B_star`); the JSON keeps the names.

Multi-process: only process 0 writes (every method is a no-op elsewhere), so all processes
may call the logger unconditionally.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from typing import Iterable, Mapping, Optional, Sequence

import jax
import numpy as np

from trm_jax import workdir as wd

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
RESERVED_KEYS = ("step", "wall_time")  # every metrics.jsonl record has them; not metrics
# The trainer's metric names (trm_jax.step.rl_step, rl.learner, trm.monitors) shown by default.
DEFAULT_PROGRESS_KEYS = ("reward", "trm/reject_rate", "trm/ppl_gap", "bound/unified")
DEFAULT_PLOT_KEYS = ("reward", "trm/reject_rate", "trm/ppl_gap", "bound/unified",
                     "learner/entropy", "response_len")
# A key ending in "/" stands for every metric under it ("task/": a graded task's parts).
DEFAULT_SUMMARY_KEYS = ("reward", "accuracy", "task/", "trm/reject_rate", "trm/ppl_gap",
                        "bound/unified", "smd/distill_kl", "sparse_rl/wasted_frac",
                        "learner/entropy", "response_len", "learner/skipped",
                        "throughput/tokens_per_s", "memory/host_peak_rss_mb")


def tb_tag(name: str) -> str:
  """The TensorBoard tag for a metric name (tensorboardX would mangle `B*` to `B_`)."""
  return re.sub(r"[^-/\w.]", "_", name.replace("*", "_star")).lstrip("/")


def _finite_or_none(key: str, value) -> Optional[float]:
  try:
    v = float(value)
  except (TypeError, ValueError) as e:
    raise ValueError(f"metric {key!r} = {value!r} is not a number") from e
  return v if math.isfinite(v) else None


def read_metrics(path: str) -> list[dict]:
  """Records of a metrics.jsonl file, in order; a torn (unparseable) line is skipped."""
  records = []
  with open(path) as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError:
        log.warning("%s:%d: dropping unparseable line (torn write?): %.80s", path, lineno, line)
        continue
      records.append(rec)
  return records


def _summary_writer():
  """tensorboardX's SummaryWriter class, imported without torch when torch is not loaded yet.

  tensorboardX imports torch if it is installed (2 s of a trainer's start-up here) only to
  accept torch tensors as values; this logger writes floats. Imported on first use: heavy,
  and optional for callers."""
  import sys  # pylint: disable=g-import-not-at-top
  if "tensorboardX" in sys.modules or "torch" in sys.modules:
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    return SummaryWriter
  sys.modules["torch"] = None   # `import torch` raises ImportError while tensorboardX loads
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
  finally:
    del sys.modules["torch"]
  return SummaryWriter


class MetricsLogger:
  """Per-step metrics to metrics.jsonl, TensorBoard and a progress bar.

  Usage:
    logger = MetricsLogger(workdir, total_steps=cfg.steps, resume_step=restored_step)  # or None
    for step in range(first_step, cfg.steps + 1):
      ...
      logger.log(step, {"reward": r, "trm/reject_rate": m, "trm/ppl_gap": g})
    logger.close()

  `log` calls float() on every value (so a jax scalar is pulled to host there); steps must
  increase strictly (from 0 on a fresh start, from resume_step + 1 on resume), one call per
  step (merge train and eval dicts before logging).
  """

  def __init__(self, workdir: str, *, total_steps: int, enable_progress: bool = True,
               tb: bool = True, progress_keys: Sequence[str] = DEFAULT_PROGRESS_KEYS,
               resume_step: Optional[int] = None, resume_record: Optional[dict] = None):
    if total_steps < 1:
      raise ValueError(f"MetricsLogger total_steps={total_steps}; must be >= 1")
    if resume_step is not None and resume_step < 0:
      raise ValueError(f"MetricsLogger resume_step={resume_step}; must be >= 0 or None")
    self.workdir = os.fspath(workdir)
    self.path = os.path.join(self.workdir, METRICS_FILE)
    self._active = jax.process_index() == 0
    self._last_step = -1 if resume_step is None else resume_step
    self._progress_keys = tuple(progress_keys)
    self._file = self._writer = self._bar = None
    if not self._active:
      return
    os.makedirs(self.workdir, exist_ok=True)
    self._truncate_after(self._last_step, resume_record)
    self._file = open(self.path, "a")
    if tb:
      self._writer = _summary_writer()(
          logdir=os.path.join(self.workdir, TB_DIR),
          purge_step=self._last_step + 1,
          # tensorboardX names files by the second and opens them for writing: a resume within
          # the same second would overwrite the dead run's file. The ns suffix keeps names
          # unique and in time order (TensorBoard reads files sorted by name).
          filename_suffix=f".{time.time_ns()}")
    # The bar starts at the first training step this process logs: its rate (and so the
    # ETA) then counts only the steps after it, not the first step's compile (which made the
    # ETA of a 150-step run read 1:58:59 at step 1), nor the steps of a resumed run.
    self._total = total_steps
    self._first_step = max(self._last_step, 0)
    self._progress = enable_progress

  def _truncate_after(self, resume_step: int, resume_record: Optional[dict]) -> None:
    """Rewrites the file to the rows the resumed checkpoint covers (via tmp file + rename):
    the parseable lines with step <= resume_step (-1: none), then `resume_record`, the
    checkpoint's copy of its own step's line, if that line is not among them (torn by the
    crash). Left alone when it already is exactly that, so a clean resume rewrites nothing.
    """
    if not os.path.exists(self.path):
      return
    with open(self.path) as f:
      lines = f.read().splitlines(keepends=True)
    records = read_metrics(self.path)
    kept = [r for r in records if isinstance(r.get("step"), int) and r["step"] <= resume_step]
    if (resume_record is not None and resume_record.get("step") == resume_step and
        not any(r["step"] == resume_step for r in kept)):
      kept.append(resume_record)
      log.warning("%s: the line of step %d was lost (a crash mid-write?); restored it from "
                  "checkpoint step %d", self.path, resume_step, resume_step)
    # Unchanged only if every line parsed, each is kept, and the last ends with a newline (a
    # fragment without one would glue the next step's line to itself).
    if (len(kept) == len(records) == sum(1 for ln in lines if ln.strip()) and
        (not lines or lines[-1].endswith("\n"))):
      return
    log.info("%s: rewriting to the %d lines up to resumed step %d (was %d lines)", self.path,
             len(kept), resume_step, len(lines))
    wd.write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))

  def log(self, step: int, metrics: Mapping[str, float]) -> Optional[dict]:
    """Writes one step: a JSON line (null for non-finite), TB scalars (finite only), the bar.

    Returns the JSON record written (None on processes other than 0); the trainer stores it
    with the step's checkpoint, from which a resume restores a line torn by a crash."""
    step = int(step)
    if self._active and self._file is None:
      raise RuntimeError(f"MetricsLogger.log(step={step}) after close() ({self.path})")
    if step <= self._last_step:
      raise ValueError(f"MetricsLogger.log step={step} is not after the last logged (or "
                       f"resumed) step {self._last_step}")
    clash = [k for k in metrics if k in RESERVED_KEYS]
    if clash:
      raise ValueError(f"metric names {clash} are reserved for the JSON record")
    values = {k: _finite_or_none(k, v) for k, v in metrics.items()}
    self._last_step = step
    if not self._active:
      return None
    record = {"step": step, "wall_time": time.time(), **values}
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()  # A crash loses at most the line being written.
    if self._writer is not None:
      for k, v in values.items():
        if v is not None:
          self._writer.add_scalar(tb_tag(k), v, global_step=step)
    if self._bar is None and self._progress and step > self._first_step:
      from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
      self._bar = tqdm(total=self._total, initial=step, unit="step", dynamic_ncols=True)
    if self._bar is not None:
      self._bar.set_postfix({k: "nan" if values[k] is None else f"{values[k]:.4g}"
                             for k in self._progress_keys if k in values}, refresh=False)
      self._bar.update(step - self._bar.n)
    return record

  def close(self) -> None:
    """Flushes and closes the file, the event writer and the bar; safe to call twice."""
    if self._file is not None:
      self._file.close()
    if self._writer is not None:
      self._writer.close()
    if self._bar is not None:
      self._bar.close()
    self._file = self._writer = self._bar = None

  def __enter__(self) -> "MetricsLogger":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


# --- after the run ------------------------------------------------------------------------


def series(records: Iterable[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps, values) for records that carry `key`; null becomes NaN. Steps without the key
  (the step-0 evaluation line, `log_every` > 1) are left out, not NaN."""
  pairs = [(r["step"], np.nan if r[key] is None else r[key]) for r in records if key in r]
  if not pairs:
    return np.zeros(0, np.int64), np.zeros(0, np.float64)
  steps, values = zip(*pairs)
  return np.asarray(steps, np.int64), np.asarray(values, np.float64)


def rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
  """Trailing mean over the last `window` entries, ignoring NaN; NaN where none is finite."""
  if window < 1:
    raise ValueError(f"rolling_mean window={window}; must be >= 1")
  finite = np.isfinite(values)
  csum = np.concatenate([[0.0], np.cumsum(np.where(finite, values, 0.0))])
  ccount = np.concatenate([[0], np.cumsum(finite)])
  hi = np.arange(1, len(values) + 1)
  lo = np.maximum(hi - window, 0)
  count = ccount[hi] - ccount[lo]
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(count > 0, (csum[hi] - csum[lo]) / np.maximum(count, 1), np.nan)


def plot_curves(metrics_jsonl_path: str, out_png: str,
                keys: Sequence[str] = DEFAULT_PLOT_KEYS, *,
                window: Optional[int] = None) -> list[str]:
  """Writes `curves_figure` of the file as a PNG; returns its panels' keys."""
  fig, present = curves_figure(read_metrics(metrics_jsonl_path), keys, window=window,
                               source=metrics_jsonl_path)
  os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
  fig.savefig(out_png, dpi=100)
  return present


EVAL_PANEL = "held-out evaluation"


def curves_figure(records: Sequence[dict], keys: Sequence[str] = DEFAULT_PLOT_KEYS, *,
                  window: Optional[int] = None, source: str = "the records"):
  """(Figure, panel keys): a grid with one panel per key present in `records` (raw values and
  a rolling mean), then, when the run evaluated, a `EVAL_PANEL` panel with every `eval/*`
  metric at the steps it was measured (the numbers to read: training rewards move with the
  batches' difficulty). Every panel labels both axes.

  `window` defaults to 5% of the logged steps (at least 1). Keys the records do not have are
  skipped; if they have none of them (and no evaluation) the error lists what they have.
  """
  # A bare Figure (Agg canvas) leaves pyplot's backend alone: notebooks keep inline plots.
  from matplotlib.figure import Figure

  present = [k for k in keys if any(k in r for r in records)]
  evals = sorted({k for r in records for k in r if k.startswith("eval/")})
  panels = present + ([EVAL_PANEL] if evals else [])
  if not panels:
    available = sorted({k for r in records for k in r} - set(RESERVED_KEYS))
    raise ValueError(f"{source} has none of the keys {list(keys)}; it has {available}")
  ncols = min(3, len(panels))
  nrows = math.ceil(len(panels) / ncols)
  fig = Figure(figsize=(4.5 * ncols, 3.2 * nrows))
  axes = fig.subplots(nrows, ncols, squeeze=False)
  for ax, key in zip(axes.flat, present):
    steps, values = series(records, key)
    w = window or max(1, len(values) // 20)
    ax.plot(steps, values, alpha=0.3, lw=1, label="per step")
    ax.plot(steps, rolling_mean(values, w), lw=2, label=f"mean of last {w}")
    ax.set_title(key)
    ax.set_ylabel(key.rsplit("/", 1)[-1])
  if evals:
    ax = axes.flat[len(present)]
    for key in evals:
      ax.plot(*series(records, key), marker="o", lw=1.5, label=key[len("eval/"):])
    ax.set_title(EVAL_PANEL)
    ax.set_ylabel("score on held-out problems")
    ax.legend(fontsize=8)
  for ax in list(axes.flat)[:len(panels)]:
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  if present:
    axes.flat[0].legend(fontsize=8)
  for ax in list(axes.flat)[len(panels):]:
    ax.set_visible(False)
  fig.tight_layout()
  return fig, panels


def summarize(metrics_jsonl_path: str, key: str = "reward",
              final_keys: Optional[Sequence[str]] = None, eval_prefix: str = "eval/") -> dict:
  """The run's headline numbers for `key`.

  Over the n logged steps with a finite `key` (null steps are left out), with k = ceil(n/10):
    first_mean = mean of the first k values, last_mean = mean of the last k,
    delta = last_mean - first_mean (the number the main job must make positive).
  `final` maps each of `final_keys` (default: every metric in the file; a key ending in "/"
  stands for every metric under it) to its last finite value. `evals` maps each logged
  `eval_prefix` metric (prefix removed) to its first and last finite value and their steps:
  the held-out change, free of the training batches' varying difficulty that moves
  first_mean and last_mean.
  """
  records = read_metrics(metrics_jsonl_path)
  steps, values = series(records, key)
  ok = np.isfinite(values)
  steps, values = steps[ok], values[ok]
  if len(values) == 0:
    raise ValueError(f"{metrics_jsonl_path} has no finite values of {key!r}")
  k = math.ceil(len(values) / 10)
  first, last = values[:k], values[-k:]
  present = sorted({m for r in records for m in r} - set(RESERVED_KEYS))
  if final_keys is None:
    final_keys = present
  final_keys = [m for k in final_keys
                for m in ([p for p in present if p.startswith(k)] if k.endswith("/") else [k])]
  final = {}
  for m in final_keys:
    _, vals = series(records, m)
    vals = vals[np.isfinite(vals)]
    if len(vals):
      final[m] = float(vals[-1])
  evals = {}
  for m in sorted({m for r in records for m in r if m.startswith(eval_prefix)}):
    e_steps, e_vals = series(records, m)
    ok = np.isfinite(e_vals)
    if ok.any():
      e_steps, e_vals = e_steps[ok], e_vals[ok]
      evals[m[len(eval_prefix):]] = {"first_step": int(e_steps[0]), "first": float(e_vals[0]),
                                     "last_step": int(e_steps[-1]), "last": float(e_vals[-1])}
  return {
      "key": key,
      "evals": evals,
      "num_steps": len(values),
      "window": k,
      "first_steps": (int(steps[0]), int(steps[k - 1])),
      "last_steps": (int(steps[-k]), int(steps[-1])),
      "first_mean": float(first.mean()),
      "last_mean": float(last.mean()),
      "delta": float(last.mean() - first.mean()),
      "final": final,
  }


def format_summary(summary: dict) -> str:
  """A few console lines for a `summarize` result."""
  s = summary
  lines = [
      f"{s['key']}: first 10% (steps {s['first_steps'][0]}-{s['first_steps'][1]}) mean "
      f"{s['first_mean']:.4f} -> last 10% (steps {s['last_steps'][0]}-{s['last_steps'][1]}) "
      f"mean {s['last_mean']:.4f}  (change {s['delta']:+.4f}, over {s['num_steps']} steps)",
  ]
  for k, e in s.get("evals", {}).items():
    last = f"{e['last']:.4f} (step {e['last_step']})"
    lines.append(f"held-out {k}: " + (last if e["first_step"] == e["last_step"] else
                                      f"{e['first']:.4f} (step {e['first_step']}) -> {last}"))
  if s["final"]:
    lines.append("final: " + "  ".join(f"{k}={v:.4g}" for k, v in s["final"].items()))
  return "\n".join(lines)
