"""Two processes x 2 simulated CPU devices on localhost (gloo collectives) run the learner step
of tests/test_train_sharding.py on a (data=2, fsdp=2) mesh spanning both processes; the result
equals one process with 4 devices.

What is covered across processes: `jax.distributed.initialize` via the trainer's
`init_distributed` (the standard JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
variables), the mesh over all processes' devices, batches handed in as per-process shards
(`sharding.put_batch`), the sharded update, and gathering the result to a host
(`step.host`). A second test runs the whole trainer (`python -m trm_jax.train`) in two
processes and checks it against the same run in one process with 4 devices.

Run as a script, this file is the worker: `python tests/test_distributed.py OUT.npz`.
"""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

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
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
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


def _trainer_args(tmp, workdir):
  return [sys.executable, "-m", "trm_jax.train", "--config", "configs/tiny_trm.py",
          "--workdir", workdir, "--config.total_steps=2", "--config.ckpt_every=1",
          "--config.rl.batch_size=8", "--config.rl.group_size=4", "--config.eval_problems=0",
          "--config.warmup.steps=10", "--config.warmup.batch_size=16",
          "--config.task.synthetic.max_operands=3", "--config.task.synthetic.max_value=9",
          "--config.mesh.data=2", "--config.mesh.fsdp=2",
          f"--config.warmup.cache_dir={tmp}/base"]


@pytest.mark.slow
def test_trainer_in_two_processes_matches_one_process(tmp_path):
  """The full loop: process 0 builds the base model, both roll out and update their shards,
  checkpoints are written together, metrics and the HF export by process 0 only."""
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  tmp = str(tmp_path)
  multi, single = os.path.join(tmp, "multi"), os.path.join(tmp, "single")
  port = _free_port()
  procs = []
  for i in range(2):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i),
               JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
    procs.append(subprocess.Popen(_trainer_args(tmp, multi), cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=2 * TIMEOUT)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert all(p.returncode == 0 for p in procs), "\n".join(
      f"--- process {i} (exit {p.returncode}):\n{log[-3000:]}"
      for i, (p, log) in enumerate(zip(procs, logs)))
  assert "2 processes" in logs[0]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  p = subprocess.run(_trainer_args(tmp, single), cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=2 * TIMEOUT)
  assert p.returncode == 0, p.stderr[-4000:]

  assert sorted(os.listdir(os.path.join(multi, "ckpt"))) == ["1", "2"]
  with open(os.path.join(multi, "metrics.jsonl")) as f:
    assert [json.loads(line)["step"] for line in f] == [1, 2]  # one writer
  got = load_file(os.path.join(multi, "hf", "model.safetensors"))
  want = load_file(os.path.join(single, "hf", "model.safetensors"))
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


if __name__ == "__main__":
  _worker(sys.argv[1])
