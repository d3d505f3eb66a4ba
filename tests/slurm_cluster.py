"""A one-node SLURM cluster on this machine, for the tests that need a real scheduler.

`SlurmCluster(root).start()` writes a one-node `slurm.conf` (node `localhost`, 2 CPUs, one
partition) with every state directory, socket and log under `root`, starts munged (with its
own key and socket, so it neither needs nor touches the system's), slurmctld and slurmd in the
foreground as children of this process, and waits until `sinfo` reports the node idle. `env()`
is what a client command (srun, sbatch, squeue, ...) needs: SLURM_CONF pointing at that file.
`stop()` ends the three daemons. Every failure to start raises `SlurmUnavailable` with the
reason and the tail of the daemon's log, which the fixture turns into a skip.

Debian's slurm-wlm and munge packages provide the daemons (`.ci/run` installs them). The
daemons run as root (SlurmUser=root), as they do in CI; plugins are the ones that need no
cgroup or database: proctrack/linuxproc, task/none, select/cons_tres, no accounting.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

START_TIMEOUT_S = 60.0
DAEMONS = ("munged", "slurmctld", "slurmd")


class SlurmUnavailable(RuntimeError):
  """The scheduler cannot run here; the message says why."""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _tail(path: str, n: int = 8) -> str:
  try:
    with open(path, errors="replace") as f:
      return " | ".join(line.strip() for line in f.readlines()[-n:])
  except OSError:
    return "(no log)"


class SlurmCluster:
  """One slurmctld + one slurmd (+ munged) under `root`; see the module docstring."""

  def __init__(self, root: str, cpus: int = 2):
    self.root, self.cpus = os.path.abspath(root), cpus
    self.conf = os.path.join(self.root, "slurm.conf")
    self.munge_socket = os.path.join(self.root, "munge", "munge.socket")
    self.procs: dict[str, subprocess.Popen] = {}
    self.start_s = None   # seconds from start() to an idle node

  def env(self, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env["SLURM_CONF"] = self.conf
    return env

  def _write_config(self) -> None:
    for d in ("munge", "state", "spool", "log"):
      os.makedirs(os.path.join(self.root, d), exist_ok=True)
    log = os.path.join(self.root, "log")
    lines = [
        "ClusterName=trmtest",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={self.munge_socket}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "MpiDefault=none",
        "SchedulerType=sched/builtin",
        "ReturnToService=2",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        "MailProg=/bin/true",
        # The node's CPUs are stated, not probed: a mismatch with the hardware must not drain it.
        "SlurmdParameters=config_overrides",
        # Killed steps (scancel) end fast; the defaults wait up to a minute.
        "KillWait=5",
        "MinJobAge=300",
        f"StateSaveLocation={self.root}/state",
        f"SlurmdSpoolDir={self.root}/spool",
        f"SlurmctldPidFile={self.root}/slurmctld.pid",
        f"SlurmdPidFile={self.root}/slurmd.pid",
        f"SlurmctldLogFile={log}/slurmctld.log",
        f"SlurmdLogFile={log}/slurmd.log",
        f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
        "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
    ]
    with open(self.conf, "w") as f:
      f.write("\n".join(lines) + "\n")

  def _spawn(self, name: str, argv: list[str]) -> None:
    log = open(os.path.join(self.root, "log", f"{name}.out"), "ab")
    self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=self.env())

  def _check_alive(self) -> None:
    for name, p in self.procs.items():
      if p.poll() is not None:
        logs = os.path.join(self.root, "log")
        raise SlurmUnavailable(
            f"{name} exited with {p.returncode}: {_tail(os.path.join(logs, name + '.out'))} "
            f"{_tail(os.path.join(logs, name + '.log'))}")

  def start(self) -> "SlurmCluster":
    t0 = time.time()
    missing = [d for d in (*DAEMONS, "sinfo", "srun", "sbatch") if shutil.which(d) is None]
    if missing:
      raise SlurmUnavailable(f"not installed: {', '.join(missing)} (apt-get install slurm-wlm "
                             "munge; .ci/run does)")
    if os.geteuid() != 0:
      raise SlurmUnavailable("the test cluster's daemons run as root (SlurmUser=root)")
    self._write_config()
    mdir = os.path.join(self.root, "munge")
    key = os.path.join(mdir, "munge.key")
    with open(key, "wb") as f:
      f.write(os.urandom(128))
    os.chmod(key, 0o400)
    os.chmod(mdir, 0o700)
    self._spawn("munged", ["munged", "--foreground", "--force", f"--key-file={key}",
                           f"--socket={self.munge_socket}",
                           f"--pid-file={mdir}/munged.pid",
                           f"--seed-file={mdir}/munged.seed",
                           f"--log-file={self.root}/log/munged.log"])
    while not os.path.exists(self.munge_socket):
      self._check_alive()
      if time.time() - t0 > START_TIMEOUT_S:
        raise SlurmUnavailable("munged did not create its socket within a minute")
      time.sleep(0.1)
    # -i: ignore state left by an earlier cluster; -c: start with no jobs.
    self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-c", "-f", self.conf])
    self._spawn("slurmd", ["slurmd", "-D", "-N", "localhost", "-f", self.conf])
    state = ""
    while time.time() - t0 < START_TIMEOUT_S:
      self._check_alive()
      r = subprocess.run(["sinfo", "-h", "-n", "localhost", "-o", "%T"], env=self.env(),
                         capture_output=True, text=True, timeout=30)
      state = (r.stdout.strip() or r.stderr.strip()).splitlines()[-1:] or [""]
      state = state[0]
      if r.returncode == 0 and state == "idle":
        self.start_s = time.time() - t0
        return self
      time.sleep(0.5)
    raise SlurmUnavailable(f"the node was not idle within {START_TIMEOUT_S:.0f}s (sinfo: "
                           f"{state!r}; slurmd log: {_tail(os.path.join(self.root, 'log', 'slurmd.log'))})")

  def stop(self) -> None:
    # slurmd first (it ends the steps it runs), then the controller, then munged.
    for name in reversed(DAEMONS):
      p = self.procs.pop(name, None)
      if p is None or p.poll() is not None:
        continue
      p.terminate()
      try:
        p.wait(timeout=20)
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()

  def wait_job(self, job_id: str, timeout: float) -> str:
    """Waits until `job_id` (all its array tasks) left the queue; returns its final state(s)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
      r = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=self.env(),
                         capture_output=True, text=True, timeout=30)
      if r.returncode == 0 and not r.stdout.strip():
        return "done"
      time.sleep(0.5)
    raise TimeoutError(f"job {job_id} still queued or running after {timeout:.0f}s")
