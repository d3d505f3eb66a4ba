"""Checkpointer: bitwise resume on a 2x4 mesh, corruption fallback on real files, SIGKILL."""
import gc
import glob
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from trm_jax import checkpoint as ckpt_lib
from trm_jax.checkpoint import Checkpointer

from shared_run import xla_flags


def _mesh(shape=(2, 4)):
  return jax.make_mesh(shape, ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      tree)


def _bits(x):
  """Raw bit pattern, so NaN payloads and -0.0 count in equality."""
  x = np.asarray(x)
  return x.view(np.dtype(f"u{x.dtype.itemsize}")) if x.dtype != np.bool_ else x


def _assert_bitwise(got, want):
  leaves_g, tree_g = jax.tree_util.tree_flatten_with_path(got)
  leaves_w, tree_w = jax.tree_util.tree_flatten_with_path(want)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, g), (_, w) in zip(leaves_g, leaves_w):
    name = jax.tree_util.keystr(path)
    assert g.dtype == w.dtype, name
    assert g.shape == w.shape, name
    np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=name)


def _train_state(mesh):
  """Params sharded over the mesh, adamw state after two real updates, a uint32 key."""
  shard = lambda spec: NamedSharding(mesh, spec)
  rng = np.random.default_rng(0)  # numpy, not jax.random: no per-op compiles in the test
  params = {
      "w": jax.device_put(rng.normal(size=(8, 16)).astype(np.float32), shard(P("data", "model"))),
      "b": jax.device_put(rng.normal(size=(16,)).astype(np.float32), shard(P("model"))),
      "emb": jax.device_put(jnp.asarray(rng.normal(size=(4, 8)), jnp.bfloat16), shard(P())),
  }
  tx = optax.adamw(1e-2, weight_decay=0.1)
  # The step counter is replicated over the mesh, as a trainer's out_shardings would put it.
  opt_state = jax.tree.map(lambda x: x if x.ndim else jax.device_put(x, shard(P())),
                           tx.init(params))
  state = {"params": params, "opt": opt_state,
           "rng": jax.device_put(jax.random.PRNGKey(42), shard(P()))}
  step = _make_step(tx)
  for _ in range(2):
    params, opt_state, _ = step(state)
    state = dict(state, params=params, opt=opt_state)
  return step, state


def _make_step(tx):
  """One adamw update with gradients that depend on the params, plus a draw from the key."""

  @jax.jit
  def step(s):
    grads = jax.tree.map(lambda p: jnp.sin(p.astype(jnp.float32)).astype(p.dtype), s["params"])
    updates, opt = tx.update(grads, s["opt"], s["params"])
    return optax.apply_updates(s["params"], updates), opt, jax.random.normal(s["rng"], (3,))

  return step


def test_round_trip_is_bitwise_on_2x4_mesh_and_resumed_update_matches(tmp_path):
  mesh = _mesh()
  step_fn, state = _train_state(mesh)
  meta = {"step": 20, "data": {"epoch": 1, "position": 1234}, "config_hash": "ab12",
          "lr": 1e-2}
  with Checkpointer(tmp_path, save_every=10, keep=2) as ck:
    assert ck.maybe_save(20, state, meta=meta)
  abstract = _abstract(state)
  with Checkpointer(tmp_path, save_every=10, keep=2) as ck:
    step, restored, meta_back = ck.restore_latest(abstract)
  assert step == 20
  assert meta_back == meta
  _assert_bitwise(restored, state)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract)):
    assert got.sharding == want.sharding
  assert restored["params"]["w"].sharding.spec == P("data", "model")
  # The restored run takes the same next step, bit for bit.
  _assert_bitwise(step_fn(restored), step_fn(state))


def test_restore_into_a_different_sharding(tmp_path):
  _, state = _train_state(_mesh((2, 4)))
  with Checkpointer(tmp_path, save_every=1, keep=1) as ck:
    ck.maybe_save(3, state, meta={})
  other = _mesh((8, 1))
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, P())),
      state)
  with Checkpointer(tmp_path, save_every=1, keep=1) as ck:
    step, restored, _ = ck.restore_latest(abstract)
  assert step == 3
  _assert_bitwise(restored, state)
  assert restored["params"]["w"].sharding == NamedSharding(other, P())


def test_interval_keep_force_and_fresh_start(tmp_path):
  ck = Checkpointer(tmp_path, save_every=2, keep=2, async_save=False)
  assert ck.restore_latest({"x": jnp.zeros(3)}) is None
  saved = [s for s in range(1, 8) if ck.maybe_save(s, {"x": jnp.full(3, s)}, meta={"s": s})]
  assert saved == [2, 4, 6]
  assert ck.maybe_save(7, {"x": jnp.full(3, 7)}, meta={"s": 7}, force=True)
  assert not ck.maybe_save(7, {"x": jnp.full(3, 7)}, meta={"s": 7}, force=True)  # exists
  ck.close()
  assert sorted(os.listdir(tmp_path)) == ["6", "7"]
  with Checkpointer(tmp_path, save_every=2, keep=2) as ck:
    step, state, meta = ck.restore_latest({"x": jnp.zeros(3, jnp.int32)})
  assert (step, meta) == (7, {"s": 7})
  np.testing.assert_array_equal(state["x"], [7, 7, 7])


def test_nnx_split_state_round_trips(tmp_path):
  # nnx.State of a model and its optimizer: Variables are pytree nodes around the arrays.
  from flax import nnx
  model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  objects = (model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param))
  _, state = nnx.split(objects)
  with Checkpointer(tmp_path, save_every=1, keep=1) as ck:
    ck.maybe_save(1, state, meta={})
    _, restored, _ = ck.restore_latest(_abstract(state))
  assert type(restored) is type(state)
  _assert_bitwise(restored, state)


def test_state_may_be_deleted_as_soon_as_async_save_returns(tmp_path):
  # The trainer donates its state to the next step; orbax must have copied it to host already.
  state = {"w": jnp.arange(1 << 16, dtype=jnp.float32) * 3, "n": jnp.arange(7) - 3}
  want = jax.tree.map(lambda x: np.asarray(_bits(x)).copy(), state)
  abstract = _abstract(state)
  with Checkpointer(tmp_path, save_every=1, keep=1, async_save=True) as ck:
    assert ck.maybe_save(1, state, meta={})
    for x in jax.tree.leaves(state):
      x.delete()
    ck.wait()
    _, restored, _ = ck.restore_latest(abstract)
  for k in want:
    np.testing.assert_array_equal(_bits(restored[k]), want[k], err_msg=k)


# --- corruption ---------------------------------------------------------------------------

_STEPS = (1, 2, 3)


@pytest.fixture
def _collect_orbax_leaks():
  # orbax 0.12.8 leaves a read coroutine un-awaited when tensorstore fails on a damaged file:
  # harmless, and the failure is what these tests provoke. Collect it here, under the filter
  # below, rather than as a stray warning in whichever test runs next.
  yield
  gc.collect()


def _orbax_leak(test):
  test = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")(test)
  return pytest.mark.usefixtures("_collect_orbax_leaks")(test)


def _state_at(step):
  return {"w": jnp.arange(4096, dtype=jnp.float32) * step,
          "h": (jnp.arange(64) % 3 == step % 3),
          "n": jnp.full((5,), step, jnp.int32)}


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
  """A directory with good checkpoints at steps 1, 2, 3 (copied per test, written once)."""
  d = tmp_path_factory.mktemp("three_steps")
  with Checkpointer(d, save_every=1, keep=5) as ck:
    for s in _STEPS:
      ck.maybe_save(s, _state_at(s), meta={"step": s})
  return d


def _array_files(step_dir):
  files = glob.glob(os.path.join(step_dir, "state", "ocdbt.process_*", "d", "*"))
  assert files, f"no array data files under {step_dir}"
  return files


def _truncate(step_dir):
  for f in _array_files(step_dir):
    os.truncate(f, os.path.getsize(f) // 2)


def _garbage(step_dir):
  rng = np.random.default_rng(0)
  for f in _array_files(step_dir):
    with open(f, "r+b") as fh:
      fh.write(rng.bytes(os.path.getsize(f)))


def _zero_tail(step_dir):
  for f in _array_files(step_dir):
    n = os.path.getsize(f)
    with open(f, "r+b") as fh:
      fh.seek(n // 2)
      fh.write(b"\0" * (n - n // 2))


def _delete_arrays(step_dir):
  for f in _array_files(step_dir):
    os.remove(f)


def _delete_meta_metadata(step_dir):
  os.remove(os.path.join(step_dir, "meta", "metadata"))


def _delete_integrity(step_dir):
  shutil.rmtree(os.path.join(step_dir, "integrity"))


def _truncate_manifest(step_dir):
  os.truncate(os.path.join(step_dir, "state", "manifest.ocdbt"), 0)


def _stale_arrays(step_dir):
  # Array files from another step: decodes without error, wrong numbers. Only the
  # fingerprint can catch this.
  state_dir = os.path.join(step_dir, "state")
  older = os.path.join(os.path.dirname(step_dir), "1", "state")
  shutil.rmtree(state_dir)
  shutil.copytree(older, state_dir)


@_orbax_leak
@pytest.mark.parametrize("corrupt,reason", [
    (_truncate, "OUT_OF_RANGE"),
    (_garbage, "Error reading"),
    (_zero_tail, "Error reading"),
    (_delete_arrays, "Error"),
    (_delete_meta_metadata, "meta"),
    (_delete_integrity, "integrity"),
    (_truncate_manifest, "DATA_LOSS"),
    (_stale_arrays, "fingerprint mismatch in leaf"),
])
def test_corrupt_newest_falls_back_with_warning(three_steps, tmp_path, caplog, corrupt, reason):
  d = tmp_path / "ckpt"
  shutil.copytree(three_steps, d)
  corrupt(str(d / "3"))
  ck = Checkpointer(d, save_every=1, keep=5)
  with caplog.at_level(logging.WARNING, logger="trm_jax.checkpoint"):
    step, state, meta = ck.restore_latest(_abstract(_state_at(0)))
  assert (step, meta) == (2, {"step": 2})
  _assert_bitwise(state, _state_at(2))
  warnings = [r.getMessage() for r in caplog.records if r.name == "trm_jax.checkpoint"]
  assert any(f"checkpoint step 3 in {d} is unusable" in w and reason in w for w in warnings), \
      warnings
  assert any("resumed from checkpoint step 2" in w for w in warnings), warnings
  # The bad step is gone, so the resumed run can write step 3 again.
  assert ck.maybe_save(3, _state_at(3), meta={"step": 3})
  ck.close()
  with Checkpointer(d, save_every=1, keep=5) as ck:
    assert ck.restore_latest(_abstract(_state_at(0)))[0] == 3


@_orbax_leak
def test_two_bad_steps_fall_back_twice(three_steps, tmp_path, caplog):
  d = tmp_path / "ckpt"
  shutil.copytree(three_steps, d)
  _garbage(str(d / "3"))
  _delete_integrity(str(d / "2"))
  with caplog.at_level(logging.WARNING, logger="trm_jax.checkpoint"), \
      Checkpointer(d, save_every=1, keep=5) as ck:
    step, state, _ = ck.restore_latest(_abstract(_state_at(0)))
  assert step == 1
  _assert_bitwise(state, _state_at(1))
  text = caplog.text
  assert "checkpoint step 3" in text and "checkpoint step 2" in text
  assert "deleted unusable newer steps [3, 2]" in text


@_orbax_leak
def test_all_bad_raises_naming_directory(three_steps, tmp_path):
  d = tmp_path / "ckpt"
  shutil.copytree(three_steps, d)
  for s in _STEPS:
    _truncate(str(d / str(s)))
  with Checkpointer(d, save_every=1, keep=5) as ck, \
      pytest.raises(RuntimeError, match=f"no usable checkpoint in {d}"):
    ck.restore_latest(_abstract(_state_at(0)))
  assert sorted(os.listdir(d)) == ["1", "2", "3"]  # nothing deleted when nothing is good


def test_structure_mismatch_is_an_error_not_a_fallback(three_steps, tmp_path):
  d = tmp_path / "ckpt"
  shutil.copytree(three_steps, d)
  wrong = _abstract(_state_at(0))
  wrong["w"] = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=wrong["w"].sharding)
  with Checkpointer(d, save_every=1, keep=5) as ck, \
      pytest.raises(ValueError, match=r"\['w'\]: checkpoint \(\[4096\], 'float32'\)"):
    ck.restore_latest(wrong)
  assert sorted(os.listdir(d)) == ["1", "2", "3"]


def test_bad_inputs_name_the_problem(tmp_path):
  ck = Checkpointer(tmp_path, save_every=1, keep=1)
  with pytest.raises(ValueError, match="round-trip"):
    ck.maybe_save(1, {"x": jnp.zeros(2)}, meta={"shape": (1, 2)})
  with pytest.raises(ValueError, match="not JSON"):
    ck.maybe_save(1, {"x": jnp.zeros(2)}, meta={"loss": float("nan")})
  with pytest.raises(TypeError, match=r"leaf \['lr'\] is a float"):
    ck.maybe_save(1, {"x": jnp.zeros(2), "lr": 0.1}, meta={})
  with pytest.raises(TypeError, match=r"leaf \['rng'\] is a typed PRNG key; save "
                     r"jax.random.key_data\(key\)"):
    ck.maybe_save(1, {"x": jnp.zeros(2), "rng": jax.random.key(0)}, meta={})
  with pytest.raises(ValueError, match="save_every=0"):
    Checkpointer(tmp_path, save_every=0, keep=1)
  ck.close()


def test_fingerprint_sees_one_changed_element_and_ignores_sharding():
  base = np.arange(64) % 5
  changed = base.copy()
  changed[17] = 0  # was 2
  dtypes = (np.float32, jnp.bfloat16, np.int8, np.bool_, np.uint16)
  xs = {str(np.dtype(d)): jnp.asarray(base.astype(d)) for d in dtypes}
  ys = {str(np.dtype(d)): jnp.asarray(changed.astype(d)) for d in dtypes}
  sharded = {k: jax.device_put(x, NamedSharding(_mesh(), P(("data", "model"))))
             for k, x in xs.items()}
  fx, fy, fs = (jax.tree.map(np.asarray, ckpt_lib._fingerprint_tree(t))
                for t in (xs, ys, sharded))
  for k in xs:
    assert not np.array_equal(fx[k], fy[k]), k
    np.testing.assert_array_equal(fs[k], fx[k], err_msg=k)


# --- SIGKILL ------------------------------------------------------------------------------

_CHILD = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    from trm_jax.checkpoint import Checkpointer
    ck = Checkpointer(sys.argv[1], save_every=1, keep=2)
    base = jnp.arange(1 << 21, dtype=jnp.float32)  # 8 MiB: each save takes a while
    for step in range(1, 10_000):
      ck.maybe_save(step, {"w": base + step}, meta={"step": step})
""")


def _run_and_kill_mid_save(d) -> bool:
  """Starts the saving child, SIGKILLs it while a save is in flight; True if a tmp dir stayed."""
  proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(d)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 60
  try:
    while time.time() < deadline and proc.poll() is None:
      names = os.listdir(d) if d.exists() else []
      # Kill only once a step is finalized and an async write of a later one is in flight.
      if any(n.isdigit() for n in names) and any(".orbax-checkpoint-tmp" in n for n in names):
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        return any(".orbax-checkpoint-tmp" in n for n in os.listdir(d))
      time.sleep(0.002)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  raise AssertionError(f"child never got to its second save (exit code {proc.returncode})")


def test_sigkill_mid_save_keeps_last_good_checkpoint(tmp_path):
  # The rename can land between our listdir and the kill (a sub-millisecond window in a
  # ~100 ms save); then try again, so that the kill provably lands mid-save.
  for attempt in range(3):
    d = tmp_path / f"ckpt{attempt}"
    if _run_and_kill_mid_save(d):
      break
  else:
    raise AssertionError("three kills all missed the in-flight save")

  abstract = {"w": jax.ShapeDtypeStruct((1 << 21,), jnp.float32,
                                        sharding=jax.sharding.SingleDeviceSharding(
                                            jax.devices()[0]))}
  newest = max(int(n) for n in os.listdir(d) if n.isdigit())
  ck = Checkpointer(d, save_every=1, keep=2)
  step, state, meta = ck.restore_latest(abstract)
  assert step == newest and meta == {"step": step}
  _assert_bitwise(state, {"w": jnp.arange(1 << 21, dtype=jnp.float32) + step})
  # The resumed run saves the step that was in flight: orbax removes the dead run's tmp dir
  # (in the background from open, awaited before the next save) and writes it afresh.
  assert ck.maybe_save(step + 1, state, meta={"step": step + 1})
  ck.close()
  names = os.listdir(d)
  assert str(step + 1) in names
  assert not any(".orbax-checkpoint-tmp" in n for n in names), names


# --- a save that fails on disk ------------------------------------------------------------

_FULL_DISK = textwrap.dedent("""
    import resource, signal, sys, time
    import jax.numpy as jnp
    from trm_jax.checkpoint import Checkpointer
    d, async_save = sys.argv[1], sys.argv[2] == "async"
    # Past the limit the OS refuses a write with EFBIG, as a full disk refuses with ENOSPC;
    # ignoring SIGXFSZ makes it an error return instead of a killed process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    ck = Checkpointer(d, save_every=100, keep=3, async_save=async_save)
    base = jnp.arange(1 << 18, dtype=jnp.float32)  # 1 MiB
    for step in range(1, 301):
      if step == 101:  # step 100 is on disk; from now on no file may grow past 64 KiB
        ck.wait()
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))
      print(f"step {step}", flush=True)
      ck.maybe_save(step, {"w": base + step}, meta={"step": step})
      time.sleep(0.1 if step > 200 else 0)  # a trainer step; the failed write is long over
    ck.close()
""")


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_failed_save_is_raised_at_once_in_one_line_and_last_good_one_restores(tmp_path, mode):
  d = tmp_path / "ckpt"
  p = subprocess.run([sys.executable, "-c", _FULL_DISK, str(d), mode], capture_output=True,
                     text=True, timeout=300)
  assert p.returncode == 1, p.stderr[-3000:]
  last = p.stderr.strip().splitlines()[-1]
  want = (f"trm_jax.checkpoint.CheckpointSaveError: checkpoint step 200 at {d} failed to save: "
          "OSError: [Errno 27] File too large (ValueError: OUT_OF_RANGE: Error writing")
  assert last.startswith(want), last
  # orbax's own tracebacks (one per background thread of the failed save, four of them) are
  # kept off the console: what is left is this script's uncaught error (with, synchronous,
  # its chained cause), which the trainer's CLI prints as the one line above.
  assert "ERROR:absl" not in p.stderr and "_SignalingThread" not in p.stderr, p.stderr[-3000:]
  assert p.stderr.count("Traceback") == (1 if mode == "async" else 2), p.stderr[-3000:]
  # Raised by the next step's call (or, synchronous, by the save itself), not at step 300,
  # when the next save would have waited for this one.
  raised_at = int(p.stdout.strip().splitlines()[-1].split()[1])
  assert raised_at == 200 if mode == "sync" else 200 < raised_at < 300, p.stdout[-200:]
  # The failed step never became a step; the one before restores, and the resumed run
  # writes step 200 afresh over the dead run's temporary directory.
  assert "100" in os.listdir(d) and "200" not in os.listdir(d)
  abstract = {"w": jax.ShapeDtypeStruct((1 << 18,), jnp.float32,
                                        sharding=jax.sharding.SingleDeviceSharding(
                                            jax.devices()[0]))}
  with Checkpointer(d, save_every=100, keep=3) as ck:
    step, state, meta = ck.restore_latest(abstract)
    assert (step, meta) == (100, {"step": 100})
    _assert_bitwise(state, {"w": jnp.arange(1 << 18, dtype=jnp.float32) + 100})
    assert ck.maybe_save(200, state, meta={"step": 200})
  assert sorted(os.listdir(d)) == ["100", "200"]


# --- two processes ------------------------------------------------------------------------

_MULTI = textwrap.dedent("""
    import glob, os, sys
    pid, port, d = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    import jax, numpy as np
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P
    from trm_jax.checkpoint import Checkpointer

    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    full = np.arange(4096, dtype=np.float32).reshape(64, 64)

    def state(step):  # rows sharded over both processes' devices, a count replicated
      w = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("data")),
                                       lambda idx: full[idx] * step)
      n = jax.jit(lambda: jax.numpy.full((3,), step), out_shardings=NamedSharding(mesh, P()))()
      return {"w": w, "n": n}

    with Checkpointer(d, save_every=1, keep=3) as ck:
      for step in (1, 2):
        ck.maybe_save(step, state(step), meta={"step": step})
    multihost_utils.sync_global_devices("saved")
    if pid == 0:  # both processes' shard files of step 2, plus the merged root
      for f in glob.glob(os.path.join(d, "2", "state", "**", "d", "*"), recursive=True):
        os.truncate(f, os.path.getsize(f) // 2)
    multihost_utils.sync_global_devices("corrupted")
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state(0))
    with Checkpointer(d, save_every=1, keep=3) as ck:
      step, got, meta = ck.restore_latest(abstract)
    want = state(step)
    same = all(np.array_equal(a.data, b.data)
               for a, b in zip(got["w"].addressable_shards, want["w"].addressable_shards))
    same &= all(np.array_equal(a.data, b.data) for a, b in zip(
        got["n"].addressable_shards, want["n"].addressable_shards))
    print(f"RESULT pid={pid} step={step} meta={meta} same={same}", flush=True)
""")


def test_two_processes_save_and_fall_back_together(tmp_path):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, XLA_FLAGS=xla_flags(2))   # 2 devices per process
  procs = [subprocess.Popen([sys.executable, "-c", _MULTI, str(i), str(port), str(tmp_path)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = []
  for p in procs:
    try:
      out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    assert p.returncode == 0, err[-3000:]
    outs.append((out, err))
  for i, (out, err) in enumerate(outs):
    assert f"RESULT pid={i} step=1 meta={{'step': 1}} same=True" in out, out + err[-3000:]
    assert "checkpoint step 2" in err and "unusable" in err
