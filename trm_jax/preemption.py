"""Preemption: SIGTERM / SIGINT become a stop request that the trainer honours between steps.

A TPU VM, GKE or SLURM sends SIGTERM some seconds before it takes the machine; Ctrl-C sends
SIGINT. Python's defaults would kill the run (SIGTERM) or raise KeyboardInterrupt wherever
the main thread happens to be (SIGINT), losing every step since the last periodic checkpoint
and any save in flight. Under `StopOnSignal`:

  * the first signal only records the request (and says so on stderr);
  * the trainer finishes the step it is in (rollout, updates, its evaluation), writes a
    checkpoint of it, flushes the metrics and exits with `exit_code(signum)`: 128 + the
    signal number (143 for SIGTERM, 130 for SIGINT), the shell's convention for a process
    ended by that signal, so a scheduler or a sweep never reads a preempted run as finished;
  * a second signal exits at once (`os._exit`), for when the grace period is shorter than a
    step; the last finalized checkpoint is intact (orbax writes into a temporary directory
    and renames it last).

A process that runs others (the sweep and its cells) uses `Forward` instead: it passes the
signal on, once, to each child, which then stops as above; the sweep waits for them.

Multi-process: a signal may reach one process, all of them, or all at slightly different
steps, and every process must stop after the same step (a checkpoint is a collective).
`should_stop` therefore gathers every process's flag (`multihost_utils.process_allgather`)
and stops when any is set; it is called at the same point of every step by every process,
so the collectives line up. We do not use `multihost_utils.reached_preemption_sync_point`:
it needs jax.distributed's preemption service, which learns of SIGTERM only (not SIGINT)
through its own C++ handler and does not exist in a single-process run, where this module
must behave the same. The gather costs one tiny collective per step.

Test hook: TRM_DEBUG_SIGNAL="phase@step[#process][:SIGNAL][,...]" makes the process (every
process, or only the one with that jax.process_index) send itself the signal (default TERM)
when it reaches `debug_point(phase, step)`, so tests deliver real signals at named moments
(phases: rollout, update, eval, save). A run reaches only the steps after the one it resumed
from, so one value serves a chain of resumed runs.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable, Mapping, Optional

import numpy as np

DEBUG_ENV = "TRM_DEBUG_SIGNAL"
SIGNALS = (signal.SIGTERM, signal.SIGINT)
# What a run writes to stderr when it takes a stop request (`trm_jax.sweep` reads it in a
# cell's log to tell whether the cell already heard a signal it would otherwise forward).
HEARD = "received: finishing the current step"


def exit_code(signum: int) -> int:
  """The exit status of a run stopped by `signum`: 128 + signum (SIGTERM: 143, SIGINT: 130)."""
  return 128 + int(signum)


class Preempted(Exception):
  """The run stopped early on a signal after checkpointing its last step; `code` is the exit
  status the CLI ends with."""

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.signum = signum
    self.code = exit_code(signum)


class _Handlers:
  """While entered, the subclass's `_handle(signum, frame)` handles SIGTERM and SIGINT; the
  previous handlers come back on exit. Only in the main thread (Python allows no other);
  elsewhere inert."""

  _previous: dict

  def __enter__(self):
    self._previous = {}
    if threading.current_thread() is threading.main_thread():
      for s in SIGNALS:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for s, h in self._previous.items():
      signal.signal(s, h)
    self._previous = {}


class StopOnSignal(_Handlers):
  """Context manager: SIGTERM and SIGINT request a stop; a second one exits at once.

    with StopOnSignal() as stop:
      while ...:
        if stop.should_stop():   # every process, same point of every step
          ...save, raise Preempted(...)

  Installs the handlers only in the main thread (Python allows no other) and restores the
  previous ones on exit; elsewhere it is inert and `should_stop` is always False.
  """

  def __init__(self):
    self.signum: Optional[int] = None   # the first signal received by this process

  def _handle(self, signum, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    # os.write, not print or logging: the handler runs between two bytecodes of the main
    # thread, which may be inside a write to the same stream (the progress bar's).
    if self.signum is not None:
      os.write(2, f"\n{name} again: exiting at once without saving the current step "
                  f"(exit code {exit_code(signum)})\n".encode())
      os._exit(exit_code(signum))
    self.signum = signum
    os.write(2, f"\n{name} {HEARD}, then saving a checkpoint and exiting (send it again to "
                f"exit at once)\n".encode())

  def should_stop(self) -> Optional[int]:
    """The signal number if any process has been asked to stop, else None (a collective when
    jax.process_count() > 1: call it at the same point on every process)."""
    import jax  # pylint: disable=g-import-not-at-top  (keeps this module light)
    mine = self.signum or 0
    if jax.process_count() == 1:
      return mine or None
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    flags = np.asarray(multihost_utils.process_allgather(np.int32(mine)))
    got = int(flags.max())
    if got and not mine:
      self.signum = got  # so the exit code and message are the same on every process
    return got or None


class Forward(_Handlers):
  """Context manager for a process that runs others (the sweep runs its cells): SIGTERM and
  SIGINT to it (Ctrl-C, `kill`, `docker stop`, a pod's termination) reach its children once.

    with Forward("cell") as stop:
      ...                       # a signal here raises Preempted: no child runs yet
      stop.armed = True
      while ...:
        if stop.signum is None: ...start children...
        stop.forward({key: (process, heard), ...})   # every loop turn

  Once armed, the first signal is recorded (`signum`, `at`) and forwarded to every running
  child, which finishes its step, checkpoints it and exits (`StopOnSignal`); a second one is
  forwarded too (the children then exit at once). The children should run in process groups
  of their own, so that a terminal's Ctrl-C reaches them only through here. A scheduler that
  signals every process of a job (SLURM, systemd) reaches them directly as well: a child whose
  `heard()` says it took the signal within `settle_s` is not sent a second copy, which would
  end it before it saved. Inert outside the main thread.
  """

  def __init__(self, what: str, settle_s: float = 1.0):
    self.what = what                 # what the children are, for the messages ("cell")
    self.armed = False               # children may be running: forward rather than raise
    self.signum: Optional[int] = None
    self.count = 0                   # signals received
    self.at = 0.0                    # time of the first
    self.settle_s = settle_s
    self._sent: dict = {}            # child key -> signals it has had

  def _handle(self, signum, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    if not self.armed:
      raise Preempted(f"stopped by {name} before any {self.what} started: nothing to save",
                      signum)
    self.count += 1
    if self.signum is None:
      self.signum, self.at = signum, time.time()
    more = (f"forwarding it to the {self.what}s, which stop at once" if self.count > 1 else
            f"no more {self.what}s start; the running ones finish their step and checkpoint "
            "it (send it again to stop them at once)")
    os.write(2, f"\n{name} received: {more}\n".encode())

  def forward(self, children: Mapping) -> None:
    """Sends each running child {key: (subprocess.Popen, heard: () -> bool)} the signals it
    has not had, once `settle_s` has passed since the first."""
    if self.signum is None or time.time() < self.at + self.settle_s:
      return
    for key, (proc, heard) in children.items():
      n = self._sent.get(key, 0)
      if n == 0 and heard():
        n = self._sent[key] = 1          # the scheduler's own copy reached it
      if n < self.count and proc.poll() is None:
        proc.send_signal(self.signum)
        self._sent[key] = n + 1


def _debug_moments() -> dict[tuple[str, int, Optional[int]], int]:
  """{(phase, step, process index or None = every process): signal} from TRM_DEBUG_SIGNAL."""
  out = {}
  for item in filter(None, (s.strip() for s in os.environ.get(DEBUG_ENV, "").split(","))):
    where, _, sig = item.partition(":")
    where, _, proc = where.partition("#")
    phase, _, step = where.partition("@")
    out[(phase, int(step), int(proc) if proc else None)] = getattr(signal, "SIG" + (sig or "TERM"))
  return out


def debug_point(phase: str, step: int) -> None:
  """Test hook (module docstring): sends this process the signal TRM_DEBUG_SIGNAL names for
  (phase, step), if any; free when the variable is unset."""
  if DEBUG_ENV not in os.environ:
    return
  import jax  # pylint: disable=g-import-not-at-top
  moments = _debug_moments()
  for proc in (None, jax.process_index()):
    signum = moments.get((phase, int(step), proc))
    if signum is not None:
      os.kill(os.getpid(), signum)
      return
