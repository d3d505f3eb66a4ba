"""The run's directory: one trainer at a time, and a resume that continues the same experiment.

Two things corrupt a run's record silently, and this module refuses both:

  * Two trainers on one workdir interleave their steps in metrics.jsonl and race on the
    checkpoints. `WorkdirLock` takes an exclusive `flock` on `<workdir>/.lock`; the kernel drops
    it when the process dies (SIGKILL included), so a crash never leaves a stale lock. The
    holder writes its pid, host and start time into the file, and a second trainer is refused
    with a message naming them.
  * A rerun with another learning rate, seed or noise level would resume from the old
    optimizer state and quietly continue a different experiment. The config is stored with
    every checkpoint (its `meta`); `config_changes` lists what differs, and the trainer refuses
    a change to anything that alters the trajectory unless `--allow_config_change` is given
    (then both configs are kept in the workdir). The keys in `FREE_KEYS` only change what is
    logged, evaluated, saved or where it runs; they may change on resume.

Multi-process runs: only process 0 takes the lock (the other processes run on other hosts,
and `flock` is not reliable across hosts on network filesystems); a second job is stopped by
its process 0.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from typing import Any, Mapping, Optional

LOCK_FILE = ".lock"
CONFIG_FILE = "config.json"

# Config keys whose change on resume does not alter the training trajectory (logging,
# evaluation, checkpoint cadence, export, placement). A prefix ending in "." covers a section.
FREE_KEYS = ("log_every", "eval_every", "eval_problems", "eval_samples", "eval_temperature",
             "eval_top_p", "ckpt_every", "keep_ckpts", "export_hf", "plot", "warmup.cache_dir",
             "compilation_cache", "mesh.")


# Settings the config gained after runs were made, each at the value under which the code does
# what it did before the setting existed: a run recorded without the key is not changed by a
# config that holds it at this value (the sampler of a LoRA run made before it was a setting
# was unmerged; the all-to-all chunk is read only with mesh.expert > 1; long prompts were
# refused, not dropped; the scoring pass's rows were one group), nor, while LoRA is off
# (rank 0), by any value of a LoRA key, which nothing then reads. Any other value, or a key
# added later not listed here, counts as a change.
ADDED_KEYS = {"model.lora.rank": 0, "model.lora.alpha": 32.0, "model.lora.base_quant": "none",
              "model.lora.export": "adapter", "model.lora.path": "",
              "model.lora.sampler": "unmerged",
              "model.lora.targets": ["q", "k", "v", "o", "gate", "up", "down"],
              "model.moe_chunk": 4096, "task.drop_long_prompts": False,
              "rl.score_microbatches": 1}


class WorkdirError(RuntimeError):
  """The workdir cannot be used (a file, read-only, busy, or holding another experiment)."""


def prepare(workdir: str) -> str:
  """Creates `workdir` if needed; one-line errors for a path that is a file or not writable."""
  if "://" in workdir:
    # os.makedirs would quietly create a local directory named "gs:"; the lock (flock) and the
    # metrics writer need a filesystem, which on a pod is a mount every host sees.
    raise WorkdirError(f"--workdir {workdir} is a URL; give a filesystem path every host sees "
                       "(a bucket mounted with gcsfuse, Filestore/NFS), e.g. /mnt/gcs/run")
  path = os.path.abspath(os.path.expanduser(workdir))
  if os.path.exists(path) and not os.path.isdir(path):
    raise WorkdirError(f"--workdir {path} is a file, not a directory")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise WorkdirError(f"--workdir {path} cannot be created: {e.strerror or e}") from e
  probe = os.path.join(path, f".write_test.{os.getpid()}")
  try:
    with open(probe, "w"):
      pass
    os.remove(probe)
  except OSError as e:
    raise WorkdirError(f"--workdir {path} is not writable: {e.strerror or e}") from e
  return path


class WorkdirLock:
  """An exclusive, process-lifetime lock on a workdir (a `flock` on `<workdir>/.lock`).

    lock = WorkdirLock(workdir)   # raises WorkdirError naming the holder if taken
    ...
    lock.release()                # or let the process exit: the kernel releases it
  """

  def __init__(self, workdir: str, *, name: str = LOCK_FILE, holder: str = "trainer"):
    """`name`: the lock file; `holder`: what holds it, in the refusal ("another trainer")."""
    self.path = os.path.join(workdir, name)
    # Opened without truncation: the holder's record must survive a refused second opener.
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      what, holder = holder, _read_holder(fd)
      os.close(fd)
      raise WorkdirError(
          f"another {what} is running in {workdir} ({holder}); wait for it to finish or stop "
          f"it, or use another --workdir") from None
    except OSError as e:
      os.close(fd)
      raise WorkdirError(f"cannot lock {self.path}: {e.strerror or e}") from e
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                         "started": time.strftime("%Y-%m-%d %H:%M:%S")})
    try:
      os.ftruncate(fd, 0)
      os.pwrite(fd, record.encode(), 0)
    except OSError as e:  # a full disk or quota (the lock itself is held: the write failed)
      os.close(fd)
      raise WorkdirError(f"cannot write {self.path}: {e.strerror or e} (is the disk holding "
                         f"{workdir} full?)") from None
    self._fd: Optional[int] = fd

  def release(self) -> None:
    if self._fd is not None:
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None

  def __enter__(self) -> "WorkdirLock":
    return self

  def __exit__(self, *exc) -> None:
    self.release()


def _read_holder(fd: int) -> str:
  try:
    rec = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    return f"pid {rec['pid']} on {rec['host']}, started {rec['started']}"
  except (ValueError, KeyError, OSError):
    return "holder unknown"


# --- the config a run was started with ---------------------------------------------------------


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """{dotted key: value} of a nested config dict (tuples and lists compare equal)."""
  out = {}
  for k, v in config.items():
    if isinstance(v, Mapping):
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
  return out


def _free(key: str) -> bool:
  return any(key == f or (f.endswith(".") and key.startswith(f)) for f in FREE_KEYS)


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple]:
  """{key: (old value, new value)} for every trajectory key that differs (FREE_KEYS aside).

  A key present on one side only counts as a change (a config file that gained or lost a
  setting), unless `old` predates it and `new` holds it at its ADDED_KEYS value."""
  a, b = flatten(old), flatten(new)
  missing = object()
  out = {}
  for key in sorted(set(a) | set(b)):
    va, vb = a.get(key, missing), b.get(key, missing)
    if va is missing and key in ADDED_KEYS and (vb == ADDED_KEYS[key] or (   # flatten: lists
        key.startswith("model.lora.") and b.get("model.lora.rank") == 0)):   # LoRA off: unread
      continue
    if va != vb and not _free(key):
      out[key] = tuple(None if v is missing else v for v in (va, vb))
  return out


def describe(changes: Mapping[str, tuple]) -> str:
  return "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())


def write_text_atomic(path: str, text: str) -> None:
  """Writes `text` to `path` through a temporary file and a rename: a reader (or a crash)
  sees the old file or the new one, never half of one."""
  tmp = f"{path}.tmp.{os.getpid()}"
  try:
    with open(tmp, "w") as f:
      f.write(text)
    os.replace(tmp, path)
  except BaseException:   # a full disk, an interrupt: no temporary file left behind
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def write_json_atomic(path: str, obj: Any) -> None:
  write_text_atomic(path, json.dumps(obj, indent=2))
