"""The workdir guards, through the real trainer CLI where a user meets them.

  * a second trainer on a busy workdir is refused, naming the holder; the lock dies with its
    process (SIGKILL leaves no stale lock);
  * a workdir that is a file, or on a read-only filesystem, fails in one line naming the path;
  * `config_changes` names exactly the keys that alter the trajectory.

Every CLI case here fails before any model is built, so each costs one interpreter start.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from trm_jax import workdir as wd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train_cli(workdir, *extra):
  return subprocess.run(
      [sys.executable, "-m", "trm_jax.train", "--config", "configs/tiny_trm.py", "--workdir",
       workdir, "--config.total_steps=2", *extra],
      cwd=ROOT, capture_output=True, text=True, timeout=300)


def _last_line(p):
  return p.stderr.strip().splitlines()[-1]


def _hold_lock(workdir):
  """A process holding the workdir lock until killed (what a running trainer holds)."""
  code = ("import sys, time; from trm_jax.workdir import WorkdirLock; "
          "lock = WorkdirLock(sys.argv[1]); print('locked', flush=True); time.sleep(600)")
  proc = subprocess.Popen([sys.executable, "-c", code, workdir], cwd=ROOT,
                          stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "locked"
  return proc


def test_a_second_trainer_is_refused_naming_the_holder(tmp_path):
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  holder = _hold_lock(workdir)
  try:
    p = _train_cli(workdir)
    assert p.returncode != 0
    line = _last_line(p)
    assert line.startswith(f"error: another trainer is running in {workdir} (pid {holder.pid} "
                           "on "), line
    assert "use another --workdir" in line
    # Nothing of a run was written by the refused trainer.
    assert sorted(os.listdir(workdir)) == [wd.LOCK_FILE]
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  # SIGKILL released the lock: no stale lock survives the holder.
  lock = wd.WorkdirLock(workdir)
  with open(os.path.join(workdir, wd.LOCK_FILE)) as f:
    assert json.load(f)["pid"] == os.getpid()
  lock.release()


def test_lock_is_exclusive_within_one_process_too(tmp_path):
  with wd.WorkdirLock(str(tmp_path)):
    with pytest.raises(wd.WorkdirError, match=f"pid {os.getpid()} on "):
      wd.WorkdirLock(str(tmp_path))
  wd.WorkdirLock(str(tmp_path)).release()  # released on exit


def test_workdir_that_is_a_file(tmp_path):
  path = tmp_path / "a_file"
  path.write_text("not a directory")
  p = _train_cli(str(path))
  assert p.returncode != 0
  assert _last_line(p) == f"error: --workdir {path} is a file, not a directory"


@pytest.fixture
def read_only_dir(tmp_path):
  """A directory nobody can write to: a read-only tmpfs as root (root ignores mode bits),
  mode 0o555 otherwise."""
  path = tmp_path / "ro"
  path.mkdir()
  if os.geteuid() == 0:
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
      pytest.skip(f"root without mount permission here: {r.stderr.strip()}")
    yield path
    subprocess.run(["umount", str(path)], check=True)
  else:
    path.chmod(0o555)
    yield path
    path.chmod(0o755)


def test_read_only_workdir(read_only_dir):
  p = _train_cli(str(read_only_dir))
  assert p.returncode != 0
  assert _last_line(p) == (f"error: --workdir {read_only_dir} is not writable: "
                           "Read-only file system" if os.geteuid() == 0 else
                           f"error: --workdir {read_only_dir} is not writable: "
                           "Permission denied")
  p = _train_cli(str(read_only_dir / "sub"))
  assert p.returncode != 0
  assert _last_line(p).startswith(f"error: --workdir {read_only_dir / 'sub'} cannot be created")


def test_a_full_disk_at_start_is_one_line(tmp_path):
  """A workdir on a filesystem with no space left: the lock's record cannot be written (the
  empty probe file of `prepare` still can). A real full tmpfs as root; elsewhere a file size
  limit of 0 bytes makes the same write fail (EFBIG instead of ENOSPC)."""
  path = tmp_path / "full"
  path.mkdir()
  if os.geteuid() == 0 and subprocess.run(
      ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)]).returncode == 0:
    try:
      fd = os.open(path / "filler", os.O_WRONLY | os.O_CREAT)
      with pytest.raises(OSError):   # fill it up
        while True:
          os.write(fd, b"\0" * 4096)
      os.close(fd)
      p = _train_cli(str(path))
    finally:
      subprocess.run(["umount", str(path)], check=True)
    reason = "No space left on device"
  else:
    code = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN);"
            " resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY));"
            " sys.argv = ['trm_jax.train'] + sys.argv[1:];"
            " runpy.run_module('trm_jax.train', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code, "--workdir", str(path),
                        "--config.total_steps=2"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    reason = "File too large"
  assert p.returncode == 1
  assert _last_line(p) == (f"error: cannot write {path}/.lock: {reason} (is the disk holding "
                           f"{path} full?)")
  assert "Traceback" not in p.stderr


def test_config_changes_name_trajectory_keys_only():
  old = {"seed": 0, "log_every": 1, "optim": {"lr": 3e-5, "b1": 0.9}, "mesh": {"data": -1},
         "trm": {"criteria": ["trm_max_kl"]}, "eval_every": 50}
  new = {"seed": 1, "log_every": 5, "optim": {"lr": 1e-4, "b1": 0.9}, "mesh": {"data": 2},
         "trm": {"criteria": ("trm_max_kl", "ser")}, "eval_every": 10, "extra": 3}
  changes = wd.config_changes(old, new)
  assert changes == {"seed": (0, 1), "optim.lr": (3e-5, 1e-4),
                     "trm.criteria": (["trm_max_kl"], ["trm_max_kl", "ser"]),
                     "extra": (None, 3)}
  assert wd.config_changes(old, old) == {}
  # Tuples and lists are the same value (a config read back from JSON has lists).
  assert wd.config_changes({"a": (1, 2)}, {"a": [1, 2]}) == {}
  assert wd.describe({"optim.lr": (3e-5, 1e-4)}) == "optim.lr: 3e-05 -> 0.0001"
  # A setting added since the old run was made: no change at the value that keeps what the code
  # did before it existed, a change at any other, and a change if the new side drops it.
  added = {"model": {"lora": {"rank": 0, "targets": ("q", "k", "v", "o", "gate", "up", "down")},
                     "moe_chunk": 4096}}
  assert wd.config_changes({"model": {}}, added) == {}
  added["model"]["lora"]["rank"] = 8
  assert wd.config_changes({"model": {}}, added) == {"model.lora.rank": (None, 8)}
  assert wd.config_changes({"model": {"moe_chunk": 4096}}, {"model": {}}) == {
      "model.moe_chunk": (4096, None)}
  # LoRA off: its other settings are unread, so a new one at any value changes nothing; with
  # LoRA on, the sampler of a run made before the setting existed was the unmerged one.
  sampler = {"model": {"lora": {"rank": 0, "sampler": "auto"}}}
  assert wd.config_changes({"model": {"lora": {"rank": 0}}}, sampler) == {}
  sampler["model"]["lora"]["rank"] = 8
  assert wd.config_changes({"model": {"lora": {"rank": 8}}}, sampler) == {
      "model.lora.sampler": (None, "auto")}
  sampler["model"]["lora"]["sampler"] = "unmerged"
  assert wd.config_changes({"model": {"lora": {"rank": 8}}}, sampler) == {}


def test_prepare_creates_and_probes(tmp_path):
  path = wd.prepare(str(tmp_path / "new" / "dir"))
  assert os.path.isdir(path) and os.listdir(path) == []
  t0 = time.time()
  assert wd.prepare(path) == path and time.time() - t0 < 5


def test_url_workdir_is_refused_before_any_work(tmp_path):
  """A bare gs:// URL would become a local directory named "gs:"; the trainer says to mount."""
  r = subprocess.run(
      [sys.executable, "-m", "trm_jax.train", "--config", "tiny_trm", "--workdir",
       "gs://bucket/run", "--config.total_steps=2"],
      cwd=tmp_path, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])))
  assert r.returncode != 0
  assert r.stderr.strip().splitlines()[-1] == (
      "error: --workdir gs://bucket/run is a URL; give a filesystem path every host sees (a "
      "bucket mounted with gcsfuse, Filestore/NFS), e.g. /mnt/gcs/run")
  assert not os.listdir(tmp_path)


def test_metrics_writer_on_a_mounted_path(tmp_path):
  """The pod README's workdir: a path under a mount point (here a local directory standing for
  the gcsfuse mount) is prepared, locked, and written and read back by the metrics writer."""
  from trm_jax.metrics import MetricsLogger, read_metrics  # pylint: disable=g-import-not-at-top
  mount = tmp_path / "mnt" / "gcs"
  mount.mkdir(parents=True)
  path = wd.prepare(str(mount / "qwen3_8b_trm"))
  lock = wd.WorkdirLock(path)
  logger = MetricsLogger(path, total_steps=2, enable_progress=False)
  logger.log(1, {"reward": 0.5})
  logger.log(2, {"reward": 0.75})
  logger.close()
  lock.release()
  assert [(r["step"], r["reward"]) for r in read_metrics(os.path.join(path, "metrics.jsonl"))] \
      == [(1, 0.5), (2, 0.75)]
