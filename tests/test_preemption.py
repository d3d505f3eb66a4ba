"""The stop-on-signal handler itself, in a real subprocess that sends itself real signals: the
first SIGTERM or SIGINT is recorded (no KeyboardInterrupt), a second one ends the process at
once with 128 + the signal number, and the handlers before it are back on exit. The trainer's
use of it (finish the step, checkpoint, resume bitwise) is tested end to end in
tests/test_train_resume.py and, across two processes, in tests/test_distributed.py."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from trm_jax import preemption
    sig = getattr(signal, sys.argv[1])
    before = signal.getsignal(sig)
    with preemption.StopOnSignal() as stop:
      assert stop.should_stop() is None
      os.kill(os.getpid(), sig)           # handled at the next bytecode: recorded only
      print("still running", stop.should_stop() == sig, flush=True)
      if sys.argv[2] == "twice":
        os.kill(os.getpid(), sig)         # exits here
        print("not reached", flush=True)
    print("restored", signal.getsignal(sig) is before, flush=True)
""")


# Each signal once and twice would be four processes; these two cover both signals and both
# behaviours (the handler does not depend on which of the two it is).
@pytest.mark.parametrize("sig,times", [("SIGTERM", "once"), ("SIGINT", "twice")])
def test_first_signal_requests_a_stop_and_a_second_exits_at_once(sig, times):
  p = subprocess.run([sys.executable, "-c", _SCRIPT, sig, times], cwd=ROOT, capture_output=True,
                     text=True, timeout=120)
  name, code = sig, 128 + getattr(signal, sig)
  assert "Traceback" not in p.stderr and "KeyboardInterrupt" not in p.stderr, p.stderr
  assert (f"{name} received: finishing the current step, then saving a checkpoint and "
          "exiting (send it again to exit at once)") in p.stderr
  if times == "once":
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["still running True", "restored True"]
  else:
    assert p.returncode == code, p.stderr
    assert p.stdout.splitlines() == ["still running True"]
    assert p.stderr.strip().splitlines()[-1] == (
        f"{name} again: exiting at once without saving the current step (exit code {code})")


def test_exit_codes_are_the_shells():
  from trm_jax import preemption  # pylint: disable=g-import-not-at-top
  assert preemption.exit_code(signal.SIGTERM) == 143
  assert preemption.exit_code(signal.SIGINT) == 130
