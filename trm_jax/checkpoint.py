"""Checkpoints of the training state: periodic async saves, exact resume, corruption fallback.

One `Checkpointer` wraps an orbax `CheckpointManager`, which decides when to save (every
`save_every` steps) and which steps to keep (the newest `keep`). A checkpoint at step s is the
directory `<dir>/<s>/` with three orbax items:

  state/      the pytree of jax arrays (params, optimizer state), StandardSave
  meta/       the caller's JSON dict (step, data position, config, ...), JsonSave
  integrity/  our JSON record: per-leaf path, shape, dtype and a 64-bit fingerprint

What this module adds to orbax:

* Atomicity, requested explicitly (`AtomicityMode.ATOMIC_RENAME`, not the filesystem-dependent
  default; verified in orbax-checkpoint 0.12.8, `_src/path/atomicity.py`): every item is
  written into `<dir>/<s>.orbax-checkpoint-tmp/`, `commit_success.txt` last, then the directory
  is renamed to `<dir>/<s>/`. A process killed mid-save leaves a tmp directory that orbax never
  lists as a step and removes (`cleanup_tmp_directories`) when the next `Checkpointer` opens
  the directory; the last finalized step is never touched by a later save.
* Fallback past corruption after the fact (a truncated, deleted or overwritten file). Tensorstore
  catches most of it while decoding, but array files replaced by those of another step
  restore without error. So `restore_latest` walks the steps from the newest down, restores
  each and recomputes every leaf's fingerprint; the first step that restores and matches is
  returned, each step skipped is named in a warning with the reason, and then deleted (orbax
  refuses to overwrite a step, and keep-last-k would count the bad ones). The fingerprint is
  two uint32 sums over the leaf's bit pattern (plain and position-mixed): addition mod 2^32
  does not depend on reduction order, so it is the same for any sharding; it detects any
  single changed word and is not a cryptographic hash.
* A failed background save (disk full) is raised as `CheckpointSaveError`, one line naming the
  step, the directory and the OS error, by the next call after the save ended (`check` costs
  nothing while a save runs), instead of by the next save, `save_every` steps later.

Multi-process: orbax coordinates the save once `jax.distributed` is initialised (every process
calls `maybe_save` and `restore_latest` with the same arguments; each writes its own shards,
the primary process writes the JSON items and does the rename). Every leaf must be a global
jax.Array. Fingerprints come from a jitted global reduction, so every process takes the same
fallback decision. Limitations: a read error that only some processes hit (damage in their
shards only) makes those leave orbax's restore barrier early, and the others wait for its
timeout; a failed save is raised by each process that sees it, not always at the same step.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)

_ITEMS = ("state", "meta", "integrity")
_FORMAT = 1  # Version of the integrity record; bump if the fingerprint changes.


# --- pytree plumbing ----------------------------------------------------------------------


def _check_state(state) -> None:
  """Every leaf a plain jax.Array: orbax cannot write Python scalars or typed PRNG keys."""

  def check(path, x):
    name = jax.tree_util.keystr(path)
    if not isinstance(x, jax.Array):
      raise TypeError(f"checkpoint state leaf {name} is a {type(x).__name__}; every leaf must "
                      "be a jax.Array (wrap scalars with jnp.asarray)")
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      raise TypeError(f"checkpoint state leaf {name} is a typed PRNG key; save "
                      "jax.random.key_data(key), or rebuild the key from its seed on resume")

  jax.tree_util.tree_map_with_path(check, state)


def _abstract(abstract_state) -> Any:
  """ShapeDtypeStructs with the target shardings (from ShapeDtypeStructs or jax.Arrays)."""

  def convert(path, x):
    sharding = getattr(x, "sharding", None)
    if sharding is None:
      raise ValueError(f"abstract state leaf {jax.tree_util.keystr(path)} has no sharding; pass "
                       "jax.ShapeDtypeStruct(shape, dtype, sharding=...) or a jax.Array")
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  return jax.tree_util.tree_map_with_path(convert, abstract_state)


# --- fingerprints -------------------------------------------------------------------------


def _as_words(x: jax.Array) -> jax.Array:
  """Bit pattern of x as a flat uint32 vector (narrow dtypes zero-extended, 64-bit split)."""
  size = jnp.dtype(x.dtype).itemsize
  if x.dtype == jnp.bool_:
    words = x.astype(jnp.uint32)
  elif size == 4:
    words = jax.lax.bitcast_convert_type(x, jnp.uint32)
  elif size in (1, 2):
    unsigned = jnp.uint8 if size == 1 else jnp.uint16
    words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  elif size == 8:
    words = jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
  else:
    raise TypeError(f"cannot fingerprint dtype {x.dtype}")
  return words.reshape(-1)


def _fingerprint_leaf(x: jax.Array) -> jax.Array:
  """[2] uint32: sum of words, and sum of xorshift(word * odd position weight), all mod 2^32.

  Multiplying by an odd number and xorshift are both bijections on uint32, so changing any
  single word changes the second sum; the plain sum adds a second, independent check.
  """
  w = _as_words(x)  # [n] uint32
  pos = jnp.arange(w.shape[0], dtype=jnp.uint32)
  mixed = w * (pos * jnp.uint32(0x9E3779B1) | jnp.uint32(1))
  mixed = mixed ^ (mixed >> 15)
  return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(mixed, dtype=jnp.uint32)])


_fingerprint_many = jax.jit(lambda xs: [_fingerprint_leaf(x) for x in xs])


def _devices_key(x: jax.Array) -> tuple[int, ...]:
  s = x.sharding
  if isinstance(s, jax.sharding.NamedSharding):
    return tuple(d.id for d in s.mesh.devices.flat)
  return tuple(sorted(d.id for d in s.device_set))


def _fingerprint_tree(tree):
  """Same tree of [2] uint32 fingerprints. One jit per device set: a single jit over the tree
  fails when leaves live on different devices (an optimizer counter on one device, parameters
  on a mesh), and one jit per leaf would compile once per distinct leaf shape."""
  leaves, treedef = jax.tree.flatten(tree)
  groups: dict[tuple[int, ...], list[int]] = {}
  for i, x in enumerate(leaves):
    groups.setdefault(_devices_key(x), []).append(i)
  prints = [None] * len(leaves)
  for idx in groups.values():
    for i, fp in zip(idx, _fingerprint_many([leaves[i] for i in idx])):
      prints[i] = fp
  return jax.tree.unflatten(treedef, prints)


def _host(x: jax.Array) -> np.ndarray:
  # A full reduction comes back replicated; reading one local copy also works when the array
  # spans several processes (np.asarray would refuse a non-fully-addressable array).
  return np.asarray(x.addressable_data(0)) if x.is_fully_replicated else np.asarray(x)


def _integrity_record(state) -> dict:
  prints = _fingerprint_tree(state)
  leaves = {}
  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    name = jax.tree_util.keystr(path)
    leaves[name] = {"shape": list(x.shape), "dtype": str(x.dtype)}
  for path, fp in jax.tree_util.tree_flatten_with_path(prints)[0]:
    leaves[jax.tree_util.keystr(path)]["fingerprint"] = [int(v) for v in _host(fp)]
  return {"format": _FORMAT, "leaves": leaves}


def tree_digest(tree) -> str:
  """sha256 of every leaf's path, shape, dtype and content fingerprint (the integrity
  record's): the same for the same arrays, whatever their sharding or devices."""
  leaves = _integrity_record(tree)["leaves"]
  return hashlib.sha256(json.dumps(leaves, sort_keys=True).encode()).hexdigest()


def _check_structure(record: dict, abstract, directory: str, step: int) -> None:
  """A structural mismatch is a caller error (changed model/optimizer), not corruption."""
  want = {jax.tree_util.keystr(p): (list(x.shape), str(x.dtype))
          for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
  have = {k: (v["shape"], v["dtype"]) for k, v in record["leaves"].items()}
  if want == have:
    return
  missing = sorted(set(want) - set(have))
  extra = sorted(set(have) - set(want))
  differ = sorted(k for k in set(want) & set(have) if want[k] != have[k])
  detail = [f"missing from checkpoint: {missing[:5]}"] if missing else []
  detail += [f"not in abstract_state: {extra[:5]}"] if extra else []
  detail += [f"{k}: checkpoint {have[k]}, abstract_state {want[k]}" for k in differ[:5]]
  raise CheckpointStructureError(
      f"checkpoint {directory}/{step} does not match abstract_state (did the model or "
      "optimizer config change?): " + "; ".join(detail), step=step)


def _verify(state, record: dict) -> None:
  prints = _fingerprint_tree(state)
  for path, fp in jax.tree_util.tree_flatten_with_path(prints)[0]:
    name = jax.tree_util.keystr(path)
    got = [int(v) for v in _host(fp)]
    if got != record["leaves"][name]["fingerprint"]:
      raise _Corrupt(f"fingerprint mismatch in leaf {name}: array data differs from what was "
                     "saved")


def _check_meta(meta) -> None:
  if not isinstance(meta, dict):
    raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
  try:
    decoded = json.loads(json.dumps(meta, allow_nan=False))
  except (TypeError, ValueError) as e:
    raise ValueError(f"meta is not JSON-serialisable: {e}") from e
  if decoded != meta:
    raise ValueError("meta must round-trip through JSON unchanged (string keys, lists not "
                     f"tuples): {meta!r} comes back as {decoded!r}")


# --- the checkpointer ---------------------------------------------------------------------


class _QuietOrbaxErrors(logging.Filter):
  """Keeps orbax's ERROR records (a failed background save logs one traceback per thread it
  ran: four for one full disk) off the console, re-logged here at DEBUG: the
  `CheckpointSaveError` this module raises says the same in one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname:
      return True
    log.debug("orbax: %s", record.getMessage(), exc_info=record.exc_info)
    return False


_QUIET = _QuietOrbaxErrors()


class CheckpointStructureError(ValueError):
  """A checkpoint's tree differs from the abstract state it is restored into (a caller
  error, e.g. a changed model or staleness; never a fallback); `step` names the checkpoint."""

  def __init__(self, message: str, *, step: int):
    super().__init__(message)
    self.step = step


class CheckpointSaveError(RuntimeError):
  """A checkpoint could not be written; the one-line message names the step, the directory and
  the root cause. orbax's tracebacks are logged at DEBUG (`trm_jax.checkpoint`), or chained."""


class Checkpointer:
  """Saves every `save_every` steps, keeps the newest `keep`, resumes from the newest good one.

  Usage:
    ckpt = Checkpointer(workdir + "/ckpt", save_every=100, keep=3)
    restored = ckpt.restore_latest(abstract_state)   # None on a fresh start
    ...
    ckpt.maybe_save(step, state, meta={"step": step, "data_pos": pos, "config": cfg_hash})
    ckpt.close()   # waits for the last async save

  With `async_save=True`, `maybe_save` returns once the arrays are copied to host memory; the
  files are written in the background, so the caller may donate or overwrite `state` at once.
  A background save that fails is raised as `CheckpointSaveError` by the first `maybe_save`,
  `check`, `wait`, `restore_latest` or `close` call after it has ended.
  """

  def __init__(self, directory: str, *, save_every: int, keep: int, async_save: bool = True):
    if save_every < 1:
      raise ValueError(f"Checkpointer save_every={save_every}; must be >= 1")
    if keep < 1:
      raise ValueError(f"Checkpointer keep={keep}; must be >= 1")
    self.directory = os.path.abspath(os.fspath(directory))
    self._in_flight: Optional[int] = None  # step of the last save started and not yet checked
    logging.getLogger("absl").addFilter(_QUIET)  # orbax logs through absl; added once
    options = ocp.CheckpointManagerOptions(
        # The policies alone: `save_interval_steps` would add orbax's InitialSavePolicy (save
        # the first step of a fresh run), and `max_to_keep` is deprecated for LatestN.
        save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(save_every),
        preservation_policy=ocp.checkpoint_managers.LatestN(keep),
        enable_async_checkpointing=async_save,
        # Removes `*.orbax-checkpoint-tmp` left by a process killed mid-save.
        cleanup_tmp_directories=True,
        # Explicit, not the filesystem-dependent AUTO: the atomicity argument above rests on it.
        atomicity_options=ocp.options.AtomicityOptions(
            mode=ocp.options.AtomicityMode.ATOMIC_RENAME),
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)

  def maybe_save(self, step: int, state, *, meta: dict, force: bool = False) -> bool:
    """Saves `state` (pytree of jax.Array) and `meta` (JSON dict) if step % save_every == 0.

    `force=True` saves regardless of the interval (e.g. the final step). A step that already
    has a checkpoint is not saved again. Returns whether a save was started. Call it at every
    step: it raises `CheckpointSaveError` as soon as a previous background save has failed.
    """
    step = int(step)
    _check_meta(meta)  # On every call, so a bad meta fails at the first step, not the first save.
    self.check()
    if step in self._manager.all_steps() or not (force or self._manager.should_save(step)):
      return False
    _check_state(state)
    integrity = _integrity_record(state)
    self._wait()  # orbax's save waits for the previous one too, but would not name it
    self._in_flight = step
    try:
      self._manager.save(
          step,
          args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  meta=ocp.args.JsonSave(meta),
                                  integrity=ocp.args.JsonSave(integrity)),
          force=True)  # decided above
    except Exception as e:  # the blocking part (or all of a synchronous save) failed
      raise self._failed(e) from e
    return True

  def check(self) -> None:
    """Raises `CheckpointSaveError` if the last background save has ended in failure.

    Cheap (no wait, no file access) while a save is still running or none is pending.
    """
    if self._in_flight is not None and not self._manager.is_saving_in_progress():
      self._wait()

  def restore_latest(self, abstract_state) -> Optional[tuple[int, Any, dict]]:
    """(step, state, meta) of the newest good checkpoint, or None if there is none at all.

    `abstract_state` gives the tree structure, shapes, dtypes and target shardings: a pytree of
    `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` (e.g. from `jax.eval_shape`) or of
    jax.Arrays. Newer checkpoints that fail to restore or to verify are skipped with a warning
    naming the step and the reason, then deleted (through orbax) so the resumed run can write
    those step numbers again. Raises RuntimeError naming the directory if checkpoints exist but
    none is good, and `CheckpointStructureError` (a ValueError) if a checkpoint's tree does not
    match `abstract_state`.
    """
    self._wait()  # a save of ours in flight is not yet a step
    self._manager.reload()  # pick up steps written by a previous process
    steps = sorted(self._manager.all_steps(), reverse=True)
    if not steps:
      return None
    abstract = _abstract(abstract_state)
    bad = []
    for step in steps:
      try:
        found = self._restore_verified(step, abstract)
      except _Corrupt as e:
        reason = _root_cause(e)
        log.warning("checkpoint step %d in %s is unusable (%s); falling back to an older one",
                    step, self.directory, reason)
        bad.append(step)
        continue
      state, meta = found
      for b in bad:
        self._manager.delete(b)
      if bad:
        log.warning("resumed from checkpoint step %d in %s; deleted unusable newer steps %s",
                    step, self.directory, bad)
      return step, state, meta
    raise RuntimeError(f"no usable checkpoint in {self.directory}: steps {steps} all failed to "
                       "restore or verify (see the warnings above)")

  def read_meta(self, step: int) -> Optional[dict]:
    """The `meta` dict saved with `step`, without its arrays; None if it cannot be read."""
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore()))["meta"]
    except Exception:  # pylint: disable=broad-except  (a damaged step: no meta to offer)
      return None
    return meta if isinstance(meta, dict) else None

  def _restore_verified(self, step: int, abstract):
    try:
      small = self._manager.restore(step, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore(), integrity=ocp.args.JsonRestore()))
      record, meta = small["integrity"], small["meta"]
      if not isinstance(record, dict) or record.get("format") != _FORMAT:
        raise ValueError(f"integrity record missing or of unknown format: {record!r:.80}")
      if not isinstance(meta, dict):
        raise ValueError(f"meta missing or not a dict: {meta!r:.80}")
      fields = {"shape", "dtype", "fingerprint"}
      if not all(fields <= set(v) for v in record.get("leaves", {}).values()):
        raise ValueError(f"integrity record lacks some of the fields {sorted(fields)}")
    except Exception as e:  # orbax raises many types for a damaged directory
      raise _Corrupt() from e
    _check_structure(record, abstract, self.directory, step)  # a caller error: raise
    try:
      stored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract)))["state"]
    except Exception as e:
      raise _Corrupt() from e
    _verify(stored, record)
    return stored, meta

  def wait(self) -> None:
    """Blocks until the in-flight async save (if any) is finalized on disk."""
    self._wait()

  def close(self) -> None:
    """Waits for pending saves and releases orbax's threads."""
    try:
      self._wait()
    finally:
      self._manager.close()

  def _wait(self) -> None:
    try:
      self._manager.wait_until_finished()
    except Exception as e:
      raise self._failed(e) from None  # orbax has logged the traceback; ours is one line
    self._in_flight = None

  def _failed(self, e: BaseException) -> CheckpointSaveError:
    step, self._in_flight = self._in_flight, None
    self._manager.reload()  # orbax's step list may still hold the failed step
    return CheckpointSaveError(f"checkpoint step {step} at {self.directory} failed to save: "
                               f"{_save_cause(e)}")

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _root_cause(e: BaseException) -> str:
  """'Type: first line' of the innermost exception; orbax wraps tensorstore's useful message."""
  if isinstance(e, _Corrupt) and e.args:
    return str(e)
  while (e.__cause__ or e.__context__) is not None:
    e = e.__cause__ or e.__context__
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0][:600] if lines else ''}"


def _save_cause(e: BaseException) -> str:
  """`_root_cause`, led by the OS error when tensorstore reports one (disk full, quota)."""
  cause = _root_cause(e)
  m = re.search(r"os_error_code='?(\d+)", cause)
  if m is None:
    return cause
  code = int(m.group(1))
  return f"OSError: [Errno {code}] {os.strerror(code)} ({cause})"


class _Corrupt(Exception):
  """Internal: this step's files cannot be trusted; the cause is chained."""
