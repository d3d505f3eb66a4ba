"""MetricsLogger files read back for real (JSONL, TensorBoard TFRecords), resume, plot, summary."""
import glob
import json
import math
import os
import struct

import numpy as np
import pytest
from tensorboardX.crc32c import crc32c
from tensorboardX.proto import event_pb2

from trm_jax import metrics as metrics_lib
from trm_jax.metrics import MetricsLogger, format_summary, plot_curves, summarize


def _masked_crc(data: bytes) -> int:
  # TFRecord's masked CRC32C (tensorflow/core/lib/hash/crc32c.h).
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _read_events(logdir):
  """(step, tag, value) for every scalar in every event file, CRCs checked."""
  out = []
  files = sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*")))
  assert files, f"no event files in {logdir}"
  for path in files:
    data = open(path, "rb").read()
    pos = 0
    while pos < len(data):
      header = data[pos:pos + 8]
      (length,) = struct.unpack("<Q", header)
      (len_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
      assert len_crc == _masked_crc(header), path
      body = data[pos + 12:pos + 12 + length]
      (body_crc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
      assert body_crc == _masked_crc(body), path
      pos += 16 + length
      event = event_pb2.Event.FromString(body)
      for v in event.summary.value:
        out.append((event.step, v.tag, v.simple_value))
  return out


def _lines(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_jsonl_and_tensorboard_hold_what_was_logged(tmp_path):
  with MetricsLogger(tmp_path, total_steps=3, enable_progress=False) as logger:
    logger.log(1, {"reward": 0.25, "B*": 7.0, "loss": float("nan")})
    logger.log(2, {"reward": np.float32(0.5), "B*": 8, "loss": float("inf")})
    logger.log(3, {"reward": 0.75, "B*": 9.0, "loss": 1.5})
  lines = _lines(tmp_path)
  assert [line["step"] for line in lines] == [1, 2, 3]
  assert [line["reward"] for line in lines] == [0.25, 0.5, 0.75]
  assert [line["B*"] for line in lines] == [7.0, 8.0, 9.0]
  assert [line["loss"] for line in lines] == [None, None, 1.5]  # non-finite -> null
  assert all(isinstance(line["wall_time"], float) for line in lines)
  assert lines[0]["wall_time"] <= lines[1]["wall_time"] <= lines[2]["wall_time"]
  events = _read_events(tmp_path / "tb")
  assert sorted(events) == sorted([
      (1, "reward", 0.25), (2, "reward", 0.5), (3, "reward", 0.75),
      (1, "B_star", 7.0), (2, "B_star", 8.0), (3, "B_star", 9.0),
      (3, "loss", 1.5),  # the NaN and inf steps are absent
  ])


def test_resume_drops_later_lines_and_appends(tmp_path):
  with MetricsLogger(tmp_path, total_steps=10, enable_progress=False, tb=False) as logger:
    for step in range(6):
      logger.log(step, {"reward": step / 10})
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 6, "rew')  # torn by a crash mid-write
  # The checkpoint was at step 3: steps 4, 5 and the torn 6 belong to the dead run.
  with MetricsLogger(tmp_path, total_steps=10, enable_progress=False, tb=False,
                     resume_step=3) as logger:
    with pytest.raises(ValueError, match="step=3 is not after"):
      logger.log(3, {"reward": 0.0})
    for step in (4, 5, 6):
      logger.log(step, {"reward": 1.0})
  lines = _lines(tmp_path)
  assert [line["step"] for line in lines] == [0, 1, 2, 3, 4, 5, 6]
  assert [line["reward"] for line in lines] == [0.0, 0.1, 0.2, 0.3, 1.0, 1.0, 1.0]
  # A fresh start in the same workdir clears the old lines.
  with MetricsLogger(tmp_path, total_steps=10, enable_progress=False, tb=False) as logger:
    logger.log(0, {"reward": 9.0})
  assert _lines(tmp_path) == [{"step": 0, "wall_time": _lines(tmp_path)[0]["wall_time"],
                               "reward": 9.0}]


@pytest.mark.parametrize("with_record", [True, False])
def test_a_torn_last_line_is_repaired_on_resume(tmp_path, with_record):
  """Issue 22's case: ckpt_every=1, killed right after the 5th metrics line, that line cut in
  half by the crash. Before, every parsed row was at or before the resumed step, so the file
  was left as it was: step 5 gone, step 6 glued to the fragment."""
  records = []
  with MetricsLogger(tmp_path, total_steps=10, enable_progress=False, tb=False) as logger:
    for step in range(1, 6):
      records.append(logger.log(step, {"reward": step / 10}))
  path = tmp_path / "metrics.jsonl"
  text = path.read_text()
  last = text.splitlines(keepends=True)[-1]
  path.write_text(text[:len(text) - len(last)] + last[:len(last) // 2])   # no newline
  # The checkpoint of step 5 holds the record of its line (what the trainer stores).
  with MetricsLogger(tmp_path, total_steps=10, enable_progress=False, tb=False,
                     resume_step=5, resume_record=records[-1] if with_record else None) as lg:
    for step in (6, 7):
      lg.log(step, {"reward": 1.0})
  lines = _lines(tmp_path)   # every line parses: nothing glued to the fragment
  if with_record:
    assert lines[:5] == records and [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6, 7]
  else:   # a checkpoint without the record (older version): the torn row cannot come back
    assert lines[:4] == records[:4] and [r["step"] for r in lines] == [1, 2, 3, 4, 6, 7]


def test_resume_purges_later_tensorboard_events(tmp_path):
  with MetricsLogger(tmp_path, total_steps=5, enable_progress=False) as logger:
    for step in range(1, 4):
      logger.log(step, {"reward": float(step)})
  with MetricsLogger(tmp_path, total_steps=5, enable_progress=False, resume_step=1) as logger:
    logger.log(2, {"reward": 20.0})
  files = sorted(glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*")))
  assert len(files) == 2
  # The second file opens with a SessionLog.START at step 2: TensorBoard's signal to hide the
  # first run's events from step 2 on.
  data = open(files[-1], "rb").read()
  events, pos = [], 0
  while pos < len(data):
    (length,) = struct.unpack("<Q", data[pos:pos + 8])
    events.append(event_pb2.Event.FromString(data[pos + 12:pos + 12 + length]))
    pos += 16 + length
  starts = [e.step for e in events if e.HasField("session_log")]
  assert starts == [2]
  assert [(e.step, e.summary.value[0].simple_value) for e in events
          if e.summary.value] == [(2, 20.0)]


def test_bad_input_is_named(tmp_path):
  with MetricsLogger(tmp_path, total_steps=2, enable_progress=False, tb=False) as logger:
    with pytest.raises(ValueError, match="metric 'reward' = 'high' is not a number"):
      logger.log(1, {"reward": "high"})
    with pytest.raises(ValueError, match=r"\['step'\] are reserved"):
      logger.log(1, {"step": 1.0})
  with pytest.raises(RuntimeError, match=r"log\(step=2\) after close"):
    logger.log(2, {"reward": 1.0})
  with pytest.raises(ValueError, match="total_steps=0"):
    MetricsLogger(tmp_path, total_steps=0)


def test_progress_bar_shows_key_numbers(tmp_path, capsys):
  with MetricsLogger(tmp_path, total_steps=4, tb=False, progress_keys=("reward", "B*")) as lg:
    lg.log(1, {"reward": 0.125, "B*": 3.0, "loss": 2.0})
    lg.log(2, {"reward": 0.5, "B*": float("nan"), "loss": 2.0})
  err = capsys.readouterr().err
  assert "2/4" in err
  assert "reward=0.5" in err and "B*=nan" in err
  assert "loss" not in err


def test_the_eta_starts_after_the_first_step(tmp_path):
  """The bar's clock starts once the first training step of this process is logged, so its
  rate and ETA leave out that step's compile (the ETA read 1:58:59 at step 1 of a run of
  minutes) and the step-0 evaluation; a resumed run's starts at its first new step."""
  import time  # pylint: disable=g-import-not-at-top
  with MetricsLogger(tmp_path, total_steps=150, tb=False) as lg:
    lg.log(0, {"eval/avg@4": 0.5})
    assert lg._bar is None                              # pylint: disable=protected-access
    before = time.time()
    lg.log(1, {"reward": 0.1})                          # ... after a long first step
    bar = lg._bar                                       # pylint: disable=protected-access
    assert bar.start_t >= before and bar.n == 1 and bar.format_dict["rate"] is None
    lg.log(2, {"reward": 0.2})
    assert bar.n == 2 and bar.format_dict["initial"] == 1   # the rate counts step 2 only
  with MetricsLogger(tmp_path, total_steps=150, tb=False, resume_step=2) as lg:
    lg.log(3, {"reward": 0.3})
    assert lg._bar.format_dict["initial"] == 3          # pylint: disable=protected-access


def test_curves_draw_the_held_out_evaluations_and_label_the_axes(tmp_path):
  with MetricsLogger(tmp_path, total_steps=6, enable_progress=False, tb=False) as lg:
    for step in range(7):
      m = {} if step == 0 else {"reward": step / 10, "response_len": 20.0 - step}
      if step % 3 == 0:
        m.update({"eval/avg@4": 0.4 + step / 100, "eval/greedy_accuracy": 0.8})
      lg.log(step, m)
  records = metrics_lib.read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
  fig, panels = metrics_lib.curves_figure(records)
  assert panels == ["reward", "response_len", metrics_lib.EVAL_PANEL]
  axes = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
  assert sorted(axes) == sorted(panels)
  for ax in axes.values():
    assert ax.get_xlabel() == "step" and ax.get_ylabel()
  held = axes[metrics_lib.EVAL_PANEL]
  assert held.get_ylabel() == "score on held-out problems"
  drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
           for line in held.get_lines()}
  assert drawn == {"avg@4": ([0, 3, 6], [0.4, 0.4 + 3 / 100, 0.4 + 6 / 100]),
                   "greedy_accuracy": ([0, 3, 6], [0.8, 0.8, 0.8])}


def test_rolling_mean_exact():
  v = np.array([1.0, 3.0, np.nan, 5.0, 7.0])
  np.testing.assert_array_equal(metrics_lib.rolling_mean(v, 2), [1.0, 2.0, 3.0, 5.0, 6.0])
  np.testing.assert_array_equal(metrics_lib.rolling_mean(v, 1), [1.0, 3.0, np.nan, 5.0, 7.0])
  np.testing.assert_array_equal(metrics_lib.rolling_mean(v, 10), [1.0, 2.0, 2.0, 3.0, 4.0])


def _write_series(workdir, n=40):
  """reward = step / 100 (with a null at step 5), rej_rate constant, loss decreasing."""
  with MetricsLogger(workdir, total_steps=n, enable_progress=False, tb=False) as logger:
    for step in range(1, n + 1):
      logger.log(step, {"reward": float("nan") if step == 5 else step / 100,
                        "rej_rate": 0.25, "loss": 10.0 - step / 10})
  return os.path.join(workdir, "metrics.jsonl")


def test_summary_numbers(tmp_path):
  path = _write_series(tmp_path)
  s = summarize(path, key="reward")
  # 39 finite rewards (step 5 is null) -> k = ceil(39 / 10) = 4.
  assert s["num_steps"] == 39 and s["window"] == 4
  assert s["first_steps"] == (1, 4) and s["last_steps"] == (37, 40)
  assert s["first_mean"] == pytest.approx((1 + 2 + 3 + 4) / 400, abs=1e-15)
  assert s["last_mean"] == pytest.approx((37 + 38 + 39 + 40) / 400, abs=1e-15)
  assert s["delta"] == pytest.approx(36 / 100, abs=1e-15)
  assert s["final"] == {"loss": 6.0, "rej_rate": 0.25, "reward": 0.4}
  text = format_summary(s)
  assert "reward: first 10% (steps 1-4) mean 0.0250 -> last 10% (steps 37-40) mean 0.3850" \
      in text
  assert "change +0.3600" in text and "rej_rate=0.25" in text
  assert summarize(path, key="loss", final_keys=["loss"])["final"] == {"loss": 6.0}
  with pytest.raises(ValueError, match="no finite values of 'accuracy'"):
    summarize(path, key="accuracy")


def test_summary_reports_first_and_last_evaluation(tmp_path):
  with MetricsLogger(tmp_path, total_steps=6, enable_progress=False, tb=False) as logger:
    logger.log(0, {"eval/avg@4": 0.5, "eval/greedy_accuracy": float("nan")})
    for step in range(1, 7):
      ev = {"eval/avg@4": 0.5 + step / 20, "eval/greedy_accuracy": step / 10} if step % 3 == 0 \
          else {}
      logger.log(step, {"reward": 1.0 - step / 10, **ev})
  s = summarize(tmp_path / "metrics.jsonl", key="reward")
  # The step-0 line has no reward: the training-reward window starts at step 1.
  assert s["num_steps"] == 6 and s["first_steps"] == (1, 1)
  assert s["evals"] == {
      "avg@4": {"first_step": 0, "first": 0.5, "last_step": 6, "last": 0.8},
      "greedy_accuracy": {"first_step": 3, "first": 0.3, "last_step": 6, "last": 0.6}}
  assert "held-out avg@4: 0.5000 (step 0) -> 0.8000 (step 6)" in format_summary(s)
  s["evals"] = {"greedy_accuracy": {"first_step": 6, "first": 0.6, "last_step": 6, "last": 0.6}}
  assert "held-out greedy_accuracy: 0.6000 (step 6)\n" in format_summary(s)


def test_plot_is_a_png(tmp_path):
  path = _write_series(tmp_path)
  out = tmp_path / "plots" / "curves.png"
  plotted = plot_curves(path, str(out), keys=["reward", "rej_rate", "missing", "loss"])
  assert plotted == ["reward", "rej_rate", "loss"]
  data = out.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n"
  width, height = struct.unpack(">II", data[16:24])  # IHDR
  assert width == 3 * 450 and height == 320  # 1 x 3 grid at figsize (4.5, 3.2) per panel
  with pytest.raises(ValueError, match=r"has none of the keys \['acc'\]; it has \['loss'"):
    plot_curves(path, str(out), keys=["acc"])
