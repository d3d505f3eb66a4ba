"""Two processes x 2 simulated CPU devices on localhost (gloo collectives) run the learner step
of tests/test_train_sharding.py on a (data=2, fsdp=2) mesh spanning both processes; the result
equals one process with 4 devices.

What is covered across processes: `jax.distributed.initialize` via the trainer's
`init_distributed` (the standard JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
variables), the mesh over all processes' devices, batches handed in as per-process shards
(`sharding.put_batch`), the sharded update, and gathering the result to a host
(`step.host`). A second test runs the whole trainer (`python -m trm_jax.train`) in two
processes (one device each, parameters sharded across them) started with only the variables
`srun -n 2` sets (no JAX_* variables: JAX's SLURM detection finds the coordinator) and checks
it against the same run in one process with 2 devices. tests/test_slurm.py runs it under a
real scheduler.

Run as a script, this file is the worker: `python tests/test_distributed.py OUT.npz`.
"""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from shared_run import xla_flags

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MESH = dict(data=2, fsdp=2)
TIMEOUT = 600


def _worker(out_path: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  from trm_jax import sharding as shd  # pylint: disable=g-import-not-at-top
  from trm_jax import step as train_step  # pylint: disable=g-import-not-at-top
  from trm_jax import train  # pylint: disable=g-import-not-at-top
  assert train.init_distributed()
  assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
  sys.path.insert(0, HERE)
  import test_train_sharding as tts  # pylint: disable=g-import-not-at-top
  mesh = shd.mesh_from_config(MESH)
  # The mesh's data axis runs across the processes: each holds half of the batch.
  assert {d.process_index for d in mesh.devices[0].flat} == {0}
  assert {d.process_index for d in mesh.devices[1].flat} == {1}
  params, opt_state, aux, _ = tts.learner_step(mesh)
  leaves = [train_step.host(x) for x in jax.tree.leaves((params, opt_state))]
  aux = {k: float(v) for k, v in aux.items()}
  if jax.process_index() == 0:
    np.savez(out_path, *leaves, aux_keys=np.array(sorted(aux)),
             aux_values=np.array([aux[k] for k in sorted(aux)]))
  jax.distributed.shutdown()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_equal_one_process_with_four_devices(tmp_path):
  import jax  # pylint: disable=g-import-not-at-top
  from trm_jax import sharding as shd  # pylint: disable=g-import-not-at-top
  from trm_jax import step as train_step  # pylint: disable=g-import-not-at-top
  import test_train_sharding as tts  # pylint: disable=g-import-not-at-top

  out = str(tmp_path / "two_process.npz")
  port = _free_port()
  procs = []
  for i in range(2):
    env = dict(os.environ, XLA_FLAGS=xla_flags(2),
               JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i))
    procs.append(subprocess.Popen([sys.executable, __file__, out], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=TIMEOUT)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for i, (p, log) in enumerate(zip(procs, logs)):
    assert p.returncode == 0, f"process {i}:\n{log[-4000:]}"

  mesh = shd.make_mesh(shd.resolve_mesh_shape(MESH, 4), jax.devices()[:4])
  params, opt_state, aux, _ = tts.learner_step(mesh)
  ref = [np.asarray(train_step.host(x)) for x in jax.tree.leaves((params, opt_state))]
  got = np.load(out)
  assert len(got.files) == len(ref) + 2
  for i, r in enumerate(ref):
    np.testing.assert_allclose(got[f"arr_{i}"], r, rtol=1e-5, atol=1e-6)
  got_aux = dict(zip(got["aux_keys"].tolist(), got["aux_values"].tolist()))
  assert sorted(got_aux) == sorted(aux)
  for k, v in aux.items():
    assert got_aux[k] == pytest.approx(float(v), rel=1e-5, abs=1e-6), k


def _slurm_env(task: int, job_id: int, n: int = 2, base: dict | None = None) -> dict:
  """`base` (os.environ) with what `srun -n N` on one node sets for task `task` (and no
  JAX_* variable). JAX's SlurmCluster puts the coordinator on the step's first node at port
  61440 + job id % 4096, so the job id is chosen for a free port."""
  base = os.environ if base is None else base
  env = {k: v for k, v in base.items() if not k.startswith(("JAX_COORDINATOR",
                                                                  "JAX_NUM_PROC",
                                                                  "JAX_PROCESS_ID", "SLURM_"))}
  env.update(SLURM_JOB_ID=str(job_id), SLURM_NTASKS=str(n), SLURM_PROCID=str(task),
             SLURM_LOCALID=str(task), SLURM_NODEID="0", SLURM_NNODES="1",
             SLURM_STEP_NODELIST="localhost", SLURM_NODELIST="localhost",
             SLURM_STEP_NUM_TASKS=str(n), SLURM_STEP_ID="0")
  return env


def _free_slurm_job_id() -> int:
  for _ in range(100):
    job = int.from_bytes(os.urandom(2), "little") % 4096
    with socket.socket() as s:
      try:
        s.bind(("127.0.0.1", 61440 + job))
        return job + 4096 * 7
      except OSError:
        continue
  raise RuntimeError("no free port in SLURM's coordinator range")



# The trainer runs: one device per process and the parameters sharded across the two processes
# (fsdp = 2), the pod case, where each process writes its own shards of a checkpoint.
# tests/test_slurm.py's srun run imports these settings: one configuration, started by hand
# here and by the scheduler there.
TRAINER_SETTINGS = ("--config.rl.batch_size=8", "--config.rl.group_size=4",
                    "--config.eval_problems=0", "--config.mesh.data=1", "--config.mesh.fsdp=2")


def _trainer_args(shared_run, workdir):
  # ckpt_every=2 over 2 steps: step 1 is checkpointed only when a stop request forces it.
  return [sys.executable, "-m", "trm_jax.train", "--config", "configs/tiny_trm.py",
          "--workdir", workdir, "--config.total_steps=2", "--config.ckpt_every=2",
          *TRAINER_SETTINGS, *shared_run.cli_args()]


def _two_processes(shared_run, workdir, **extra_env):
  """Runs the trainer as two processes of one job, one CPU device each, started from SLURM's
  variables alone (what `srun -n 2` sets); returns [(exit code, output)] per process."""
  job_id = _free_slurm_job_id()
  procs = []
  for i in range(2):
    env = _slurm_env(i, job_id, base=shared_run.env(
        devices=1, JAX_PLATFORMS="cpu", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo", **extra_env))
    procs.append(subprocess.Popen(_trainer_args(shared_run, workdir), cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=2 * TIMEOUT)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return [(p.returncode, log) for p, log in zip(procs, logs)]


def _describe(results):
  return "\n".join(f"--- process {i} (exit {rc}):\n{log[-3000:]}"
                   for i, (rc, log) in enumerate(results))


def _ckpt_state(workdir, step):
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  path = os.path.join(workdir, "ckpt", str(step), "state")
  ckptr = ocp.StandardCheckpointer()
  # Saved on the two processes' mesh: restored onto one local device of this process.
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  meta = ckptr.metadata(path)
  meta = getattr(meta, "item_metadata", meta)
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), meta)
  flat, _ = jax.tree_util.tree_flatten_with_path(ckptr.restore(path, target))
  return {jax.tree_util.keystr(p): np.asarray(x).tobytes() for p, x in flat}


@pytest.mark.slow
def test_trainer_in_two_processes_from_srun_variables_matches_one_process(tmp_path, shared_run):
  """The full loop from SLURM's variables alone: process 0 provides the base model (the
  session's, shared_run.py) while process 1 waits for it, both roll out and update their
  shards, checkpoints are written together, metrics and the HF export by process 0 only; the
  result equals one process with both devices.

  Then preemption across processes: the same job again, where process 0 gets SIGTERM in the
  middle of step 1's rollout and process 1 in the middle of step 1's update (real signals,
  preemption.debug_point). Both finish step 1, agree to stop there, checkpoint it together
  (not a ckpt_every step) and exit 143 saying so; the rerun resumes from step 1 and ends
  bitwise equal to the uninterrupted two-process run."""
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  tmp = str(tmp_path)
  multi, single = os.path.join(tmp, "multi"), os.path.join(tmp, "single")
  results = _two_processes(shared_run, multi)
  assert all(rc == 0 for rc, _ in results), _describe(results)
  assert "2 processes" in results[0][1]
  for i, (_, log) in enumerate(results):   # the first line says how the processes found each other
    first = next(l for l in log.splitlines() if "multi-host start-up" in l)
    assert first.endswith(f"multi-host start-up: SlurmCluster (JAX's cluster detection): "
                          f"process {i} of 2, 1 local of 2 devices"), first
  p = subprocess.run(_trainer_args(shared_run, single), cwd=ROOT, env=shared_run.env(),
                     capture_output=True, text=True, timeout=2 * TIMEOUT)
  assert p.returncode == 0, p.stderr[-4000:]

  assert sorted(os.listdir(os.path.join(multi, "ckpt"))) == ["2"]
  with open(os.path.join(multi, "metrics.jsonl")) as f:
    assert [json.loads(line)["step"] for line in f] == [1, 2]  # one writer
  got = load_file(os.path.join(multi, "hf", "model.safetensors"))
  want = load_file(os.path.join(single, "hf", "model.safetensors"))
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)

  # --- preempted on both processes at different moments of step 1, then resumed -------------
  stopped = os.path.join(tmp, "preempted")
  results = _two_processes(shared_run, stopped, TRM_DEBUG_SIGNAL="rollout@1#0,update@1#1")
  assert all(rc == 143 for rc, _ in results), _describe(results)
  for _, log in results:
    assert log.strip().splitlines()[-1] == (
        f"preempted by SIGTERM after step 1 of 2: checkpoint step 1 is saved in "
        f"{stopped}/ckpt; rerun the same command to resume (exit code 143)")
    assert "SIGTERM received: finishing the current step" in log
    assert "Traceback" not in log
  assert sorted(os.listdir(os.path.join(stopped, "ckpt"))) == ["1"]
  results = _two_processes(shared_run, stopped)
  assert all(rc == 0 for rc, _ in results), _describe(results)
  assert "resumed from step 1 " in results[0][1]
  with open(os.path.join(stopped, "metrics.jsonl")) as f:
    assert [json.loads(line)["step"] for line in f] == [1, 2]
  assert _ckpt_state(stopped, 2) == _ckpt_state(multi, 2)
  got = load_file(os.path.join(stopped, "hf", "model.safetensors"))
  want = load_file(os.path.join(multi, "hf", "model.safetensors"))
  assert all(got[k].tobytes() == want[k].tobytes() for k in want) and sorted(got) == sorted(want)


def test_start_up_says_how_and_refuses_a_partial_set_of_variables(monkeypatch, caplog):
  import logging  # pylint: disable=g-import-not-at-top
  from trm_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from trm_jax import distributed  # pylint: disable=g-import-not-at-top
  for k in list(os.environ):
    if k.startswith(("SLURM_", "OMPI_")) or k in distributed.EXPLICIT:
      monkeypatch.delenv(k)
  with caplog.at_level(logging.INFO, logger="trm_jax.distributed"):
    assert not distributed.init_distributed()
  assert caplog.messages == [
      "multi-host start-up: one process (no cluster environment, no JAX_* variables)"]
  # A one-task SLURM step is one process: nothing to coordinate, no port opened.
  for k, v in _slurm_env(0, job_id=7, n=1).items():
    if k.startswith("SLURM_"):
      monkeypatch.setenv(k, v)
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="trm_jax.distributed"):
    assert not distributed.init_distributed()
  assert caplog.messages == ["multi-host start-up: one process (SlurmCluster reports one task)"]
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  with pytest.raises(config_lib.ConfigError) as e:
    distributed.init_distributed()
  assert str(e.value) == ("JAX_NUM_PROCESSES set but JAX_COORDINATOR_ADDRESS, JAX_PROCESS_ID "
                          "not: set all three for a multi-process run")


def test_other_processes_wait_for_process_0s_base_model(shared_run, tmp_path):
  """Processes other than 0 poll the shared filesystem until process 0 publishes the warm-up
  base (atomically: a rename), and give up after the timeout naming the directory."""
  import shutil  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  from trm_jax import train  # pylint: disable=g-import-not-at-top
  from trm_jax import warmup  # pylint: disable=g-import-not-at-top
  c = shared_run.config()
  out = tmp_path / "base"
  c.warmup.cache_dir = str(out)

  def publish():   # what process 0's warm-up does at its end: the base, then its marker
    time.sleep(1.5)
    staging = tmp_path / "staging"
    shutil.copytree(shared_run.base_dir, staging)
    marker = staging / warmup.MARKER
    fingerprint = json.loads(marker.read_text())
    fingerprint["warmup"]["cache_dir"] = str(out)   # the marker names the base's own directory
    marker.write_text(json.dumps(fingerprint))
    os.rename(staging, out)

  writer = threading.Thread(target=publish)
  t0 = time.time()
  writer.start()
  try:
    assert train.wait_for_base_model(c, timeout_s=120) == str(out)
  finally:
    writer.join()
  assert time.time() - t0 >= 1.5
  c.warmup.cache_dir = str(tmp_path / "never")
  with pytest.raises(TimeoutError, match=r"process 0: no base model at .*never "
                                         r"\(warmup.cache_dir\) after 0s; it must be on a "
                                         r"filesystem all processes share"):
    train.wait_for_base_model(c, timeout_s=0)


if __name__ == "__main__":
  _worker(sys.argv[1])
