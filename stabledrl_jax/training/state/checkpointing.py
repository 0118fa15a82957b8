"""Preemption-safe checkpoints of the whole training state with orbax's CheckpointManager.

A checkpoint holds the train state pytree (parameters, optimizer state, step,
PRNG key data, counters) and a JSON item with the data-iterator state and the
config. orbax writes each step into a temporary directory and renames it when
complete, so a process killed mid-save leaves the previous checkpoint intact
and the torn one invisible to ``latest_step``.

Workdirs are ``etils.epath`` paths: a local directory or a bucket (``gs://...``) alike. With
several processes every process calls ``save`` and ``restore``; orbax writes each process's
shards and agrees on completion.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import socket
import stat
import sys
import threading
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import flags, logging
from etils import epath

from stabledrl_jax import workdir_files
from stabledrl_jax.models import lora as lora_lib
from stabledrl_jax.training.state import lora_base
# The workdir's one way to write, and its error (``workdir_files``), as this module's names.
from stabledrl_jax.workdir_files import WorkdirError, is_local, writing  # pylint: disable=unused-import


CHECKPOINT_DIR = "checkpoints"
# Checkpoints that could not be restored are moved here (beside checkpoints/, out of orbax's
# sight), not deleted: the evidence stays.
DAMAGED_DIR = "checkpoints_damaged"
# Checkpoints of a trajectory the collapse guard undid (the steps after the one it restored) are
# moved here, out of the resume's way, for the same reason.
COLLAPSED_DIR = "checkpoints_collapsed"
# The state the collapse guard restored is saved here first, complete, then moved into
# checkpoints/ (``Checkpointer.adopt``): at no moment does a kill leave checkpoints/ without it
# or the trajectory it replaces.
RESTORE_DIR = "checkpoints_restore"


class SaveRefusedError(RuntimeError):
  """orbax declined a save (a step at or below its latest): the state was not written."""


def _use_distributed_barriers() -> None:
  """orbax's barriers through the jax.distributed key-value store, not device collectives.

  An asynchronous save waits at barriers in a background thread. As device computations
  (orbax's default) they interleave with the training step's computations in a different order
  on each process, and the processes deadlock; the coordination service's barriers launch
  nothing on the devices.
  """
  name = "experimental_orbax_use_distributed_barrier"
  if name in flags.FLAGS:
    if not flags.FLAGS.is_parsed():  # A library caller (notebook) that parsed no flags.
      flags.FLAGS.mark_as_parsed()
    flags.FLAGS[name].value = True


def resolve_workdir(workdir: epath.PathLike) -> epath.Path:
  """The workdir as an absolute ``epath.Path`` (remote paths as given).

  Raises:
    ImportError: a ``gs://`` path without a Cloud Storage backend installed.
  """
  path = epath.Path(workdir)
  if is_local(workdir):
    return path.expanduser().resolve()
  if str(workdir).startswith("gs://") and not any(
      importlib.util.find_spec(m) for m in ("gcsfs", "tensorflow")):
    raise ImportError(f"workdir {workdir}: gs:// paths need a Cloud Storage backend; install "
                      "the gcs extra: pip install 'stabledrl_jax[gcs]'")
  return path


def _closed_loop_noise(unraisable) -> bool:
  """Whether an unraisable exception is asyncio's "Event loop is closed" from
  ``call_soon_threadsafe``: after an orbax save or restore fails inside its event loop, the
  futures it was awaiting (tensorstore's) still complete, on their own threads, and their
  callbacks find the loop that awaited them closed. Nothing is lost; the failure itself was
  raised (and reported) where it happened."""
  error = unraisable.exc_value
  if not isinstance(error, RuntimeError) or str(error) != "Event loop is closed":
    return False
  frames = [frame.f_code.co_name for frame, _ in traceback.walk_tb(unraisable.exc_traceback)]
  return "call_soon_threadsafe" in frames


# Libraries whose background threads write the workdir; their OSErrors (a full disk) come back
# to the trainer through the library's own calls (orbax's wait, the writer's close), where they
# are one line naming the file (``writing``).
_WRITER_LIBRARIES = ("orbax", "tensorboardX")


def _library_write_error(error: BaseException | None, tb) -> bool:
  """Whether ``error`` is a file system's error (``workdir_files.os_error_of``) raised in a
  writer library."""
  if workdir_files.os_error_of(error) is None:
    return False
  files = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(tb)]
  return any(f"{os.sep}{name}{os.sep}" in file for file in files for name in _WRITER_LIBRARIES)


class _QuietWriteErrors:
  """A filter on absl's handler (every logger's records reach it): drops the ERROR records, with
  tracebacks, that orbax's threads log for an ``OSError`` of a save, and asyncio's "Task
  exception was never retrieved" for orbax's write tasks when they are collected, both of
  which ``Checkpointer.wait`` raises as one line. Only while absl logs at WARNING or above
  (``--verbosity=0`` shows them)."""

  def filter(self, record) -> bool:
    if logging.get_verbosity() > logging.WARNING or record.levelno < 40:  # 40: ERROR
      return True
    if "orbax" not in record.pathname and "asyncio" not in record.pathname:
      return True
    if not record.exc_info:
      return True
    return not _library_write_error(record.exc_info[1], record.exc_info[2])


def _quiet_library_noise() -> None:
  """Installed once: ``sys.unraisablehook`` drops ``_closed_loop_noise`` and a writer library's
  write errors at exit (tensorboardX's atexit flush); ``threading.excepthook`` drops a writer
  library's thread dying of a write error; absl's handler drops orbax's and asyncio's logged
  write errors (``_QuietWriteErrors``). Everything else passes on to the hooks set before."""
  previous = sys.unraisablehook
  if getattr(previous, "_stabledrl_quiet", False):
    return

  def unraisable_hook(unraisable):
    if not (_closed_loop_noise(unraisable)
            or _library_write_error(unraisable.exc_value, unraisable.exc_traceback)):
      previous(unraisable)

  previous_thread_hook = threading.excepthook

  def thread_hook(args):
    if not _library_write_error(args.exc_value, args.exc_traceback):
      previous_thread_hook(args)

  unraisable_hook._stabledrl_quiet = True  # pylint: disable=protected-access
  sys.unraisablehook = unraisable_hook
  threading.excepthook = thread_hook
  logging.get_absl_handler().addFilter(_QuietWriteErrors())


class Checkpointer:
  """Asynchronous saves of (state, meta) into ``<workdir>/checkpoints``, keeping the last N.

  ``read_only=True`` opens a workdir for restoring alone (an evaluation beside a running
  training): it neither creates the directory nor removes the temporary directory of a save in
  progress.
  """

  def __init__(self, workdir: epath.PathLike, *, max_to_keep: int = 3, async_save: bool = True,
               read_only: bool = False, subdir: str = CHECKPOINT_DIR):
    self.directory = resolve_workdir(workdir) / subdir
    _quiet_library_noise()
    if jax.process_count() > 1:
      _use_distributed_barriers()
    if read_only:
      options = ocp.CheckpointManagerOptions(read_only=True, max_to_keep=None, create=False,
                                             save_interval_steps=0)
    else:
      # A local directory's leftover temporary directories (a killed run's) are removed here,
      # before orbax starts; orbax's own clean-up runs in a thread that an exit right after a
      # one-line error interrupts with a traceback. A remote one keeps orbax's.
      options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                             enable_async_checkpointing=async_save,
                                             cleanup_tmp_directories=not is_local(self.directory))
    self._read_only = read_only
    self._pending = None  # The step of the save in flight, if any.
    self._failed = None  # The step of a save that failed: its temporary directory goes at close.
    self._threads_before_save = frozenset()  # The threads alive when the last save began.
    with writing(self.directory):
      if not read_only:
        workdir_files.make_dir(self.directory)  # A real directory, not a link out.
        if jax.process_index() == 0:
          self._remove_unfinished()
      # orbax reads each step's metadata as it starts: a FIFO there would hang it.
      for metadata in self.directory.glob("*/_CHECKPOINT_METADATA"):
        workdir_files.regular_file(metadata, "checkpoint metadata")
      self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    """Starts saving (returns before the write completes when asynchronous).

    Raises:
      WorkdirError: this save, or the asynchronous one before it, could not be written (one
        line naming the step's directory and the cause; what it staged is removed, and the
        last complete checkpoint stays the latest).
      SaveRefusedError: orbax declined to save ``step`` (it keeps only steps above its latest):
        never a silent loss of the state.
    """
    self.wait()  # The save before it: its failure names its own step.
    self._pending = step
    self._threads_before_save = frozenset(threading.enumerate())
    with self._failing_save():
      saved = self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
    if not saved:
      self._pending = None
      raise SaveRefusedError(
          f"checkpoint step {step} was not saved in {self.directory}: orbax saves only steps "
          f"above its latest ({self.latest_step()}); move the later steps aside first")

  @contextlib.contextmanager
  def _failing_save(self):
    """A failed save (``OSError`` anywhere in orbax) is a ``WorkdirError`` naming the pending
    step's directory; its temporary directory is removed (process 0)."""
    step = self._pending
    try:
      with writing(self.directory / str(step) if step is not None else self.directory):
        yield
    except BaseException:
      self._pending = None
      if step is not None:
        self._failed = step
        if jax.process_index() == 0:
          self._remove_unfinished(step)
      raise

  def _remove_unfinished(self, step: int | None = None) -> None:
    """Removes what a failed save of ``step`` left (orbax's ``<step>.orbax-checkpoint-tmp*``),
    or of any step (None); local directories only."""
    if not is_local(self.directory) or not os.path.isdir(self.directory):
      return
    pattern = re.compile(rf"{step if step is not None else '[0-9]+'}\.orbax-checkpoint-tmp")
    for name in os.listdir(self.directory):
      if pattern.match(name):
        workdir_files.remove(os.path.join(self.directory, name))

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """The state (placed like ``abstract_state``: shapes, dtypes, shardings) and meta of ``step``."""
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    return restored["state"], restored["meta"]

  def restore_meta(self, step: int) -> dict[str, Any]:
    """The JSON item of ``step`` alone (data-iterator state, the run's config)."""
    return self._manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))["meta"]

  def stored_fields(self, step: int) -> dict[str, list[tuple[int, ...]]]:
    """{top-level field of ``step``'s state item: the shapes of its arrays, sorted}, from the
    metadata alone."""
    metadata = ocp.PyTreeCheckpointer().metadata(self.directory / str(step) / "state")
    tree = getattr(metadata, "item_metadata", metadata)
    tree = getattr(tree, "tree", tree)
    is_array = lambda x: hasattr(x, "shape")
    fields = {name: sorted(tuple(x.shape) for x in jax.tree.leaves(value, is_leaf=is_array))
              for name, value in (tree.items() if hasattr(tree, "items") else ())}
    if not any(fields.values()):
      raise ValueError(f"{self.directory / str(step) / 'state'} has no readable array metadata")
    return fields

  def stored_shapes(self, step: int) -> list[tuple[int, ...]]:
    """The shapes of the arrays of ``step``'s state item, sorted (from its metadata alone)."""
    return sorted(shape for shapes in self.stored_fields(step).values() for shape in shapes)

  def set_aside(self, step: int, to: str = DAMAGED_DIR) -> epath.Path:
    """Moves checkpoint ``step`` to ``<workdir>/<to>/<step>`` (``<step>.<n>`` for the first
    free n if that exists; process 0, the others wait) and forgets it; returns where it went."""
    target = self.directory.parent / to / str(step)
    if jax.process_index() == 0:
      with writing(target.parent):
        workdir_files.make_dir(target.parent)
        n = 1
        while target.exists() or (is_local(target) and os.path.islink(target)):
          target, n = target.parent / f"{step}.{n}", n + 1
        (self.directory / str(step)).rename(target)
    self._sync_and_reload(f"set aside checkpoint {step}")
    return target

  def adopt(self, step: int, source: epath.PathLike) -> None:
    """Makes ``source``, a complete step directory of another ``Checkpointer`` in the same
    workdir, this one's checkpoint ``step`` (a rename; process 0, the others wait). ``step``
    must not exist here."""
    if jax.process_index() == 0:
      with writing(self.directory / str(step)):
        epath.Path(source).rename(self.directory / str(step))
    self._sync_and_reload(f"adopt checkpoint {step}")

  def _sync_and_reload(self, what: str) -> None:
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      multihost_utils.sync_global_devices(what)
    self._manager.reload()

  def delete(self, step: int) -> None:
    """Removes checkpoint ``step`` (orbax's delete: every process calls it)."""
    self.wait()
    self._manager.delete(step)

  def restore_params(self, step: int, abstract_params: Any) -> Any:
    """The parameters of ``step`` alone; the optimizer state is not read.

    ``abstract_params`` holds ShapeDtypeStructs (with shardings) in the structure of
    ``state.params``; the parameters are placed and cast like them.
    """
    item = {"params": abstract_params}
    restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
        partial_restore=True)))
    return restored["state"]["params"]

  def wait(self) -> None:
    """Until the saves in flight are written (``WorkdirError`` if one could not be)."""
    with self._failing_save():
      self._manager.wait_until_finished()
    self._pending = None

  def close(self) -> None:
    """Waits for the saves in flight (``WorkdirError`` if one failed), then closes; a failed
    save's temporary directory is removed once orbax's threads have all stopped (one of them may
    still be writing into it when the first one fails)."""
    try:
      self.wait()
    finally:
      try:
        self._manager.close()
      except Exception:  # pylint: disable=broad-except
        pass  # The failed save's own error again: ``wait`` raised it (or the save did).
      if self._failed is not None and jax.process_index() == 0:
        _join_save_threads(self._threads_before_save)
        self._remove_unfinished(self._failed)


# How long ``close`` waits for the threads of a failed save to stop before removing what it
# staged (they end within milliseconds of their last write; a full disk fails each write fast).
SAVE_THREADS_JOIN_S = 30.0


def _join_save_threads(before: frozenset, timeout_s: float = SAVE_THREADS_JOIN_S) -> None:
  """Waits, up to ``timeout_s`` in all, for the threads a save started that may still write:
  orbax's own (the first failure is raised while the other items' threads run on) and the
  asyncio executor threads its coroutines write through (``asyncio_N``)."""
  end = time.monotonic() + timeout_s
  for thread in threading.enumerate():
    if thread in before or thread is threading.current_thread():
      continue
    if type(thread).__module__.startswith("orbax") or thread.name.startswith("asyncio_"):
      # threading.Thread.join: orbax's own join re-raises the thread's error (already raised).
      threading.Thread.join(thread, max(end - time.monotonic(), 0.0))


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs (with shardings) of a concrete pytree, for ``restore``."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
      tree)


def nonfinite_leaves(tree: Any) -> list[str]:
  """The paths (``jax.tree_util.keystr``) of the floating arrays of ``tree`` that hold a NaN or
  an infinity. Every process gets the same answer for global arrays."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  floating = [(path, x) for path, x in flat if jnp.issubdtype(x.dtype, jnp.inexact)]
  if not floating:
    return []
  finite = jax.device_get(_all_finite([x for _, x in floating]))
  return [jax.tree_util.keystr(path) for (path, _), ok in zip(floating, finite) if not ok]


@jax.jit
def _all_finite(xs: list[jax.Array]) -> list[jax.Array]:
  """Whether each array holds only finite values (a scalar bool each)."""
  return [jnp.all(jnp.isfinite(x)) for x in xs]


# Fields that define what a workdir's checkpoints hold: a resume must not change them.
RUN_IDENTITY = ("model.family", "model.name", "model.overrides", "model.checkpoint",
                "model.param_dtype", "model.scan_layers", "tokenizer.kind", "tokenizer.path",
                "tokenizer.alphabet", "objective.name", "task.name", "rollout.num_prompts",
                "rollout.group_size", "rollout.prompt_length", "rollout.gen_length")


def _field(config: Any, dotted: str) -> Any:
  node = config
  for part in dotted.split("."):
    if hasattr(node, "to_dict"):
      node = node.to_dict()
    if not isinstance(node, dict) or part not in node:
      return None
    node = node[part]
  return node.to_dict() if hasattr(node, "to_dict") else node


def check_resume(config: Any, saved: dict[str, Any], where: str) -> None:
  """Raises ValueError, one line, naming every ``RUN_IDENTITY`` field in which ``config`` differs
  from ``saved`` (the config stored with the checkpoint ``where``)."""
  diffs = []
  for name in RUN_IDENTITY:
    want, have = _field(saved, name), _field(config, name)
    if want is not None and have != want:
      diffs.append(f"{name} {have!r} here, {want!r} in the checkpoint")
  if diffs:
    raise ValueError(f"config does not match {where}: " + "; ".join(diffs) + ". Resume with the "
                     "checkpoint's values, or start a new --workdir.")


# ---------------------------------------------------------------------------
# Resuming a run: the newest checkpoint that restores, older layouts, damage set aside.
# ---------------------------------------------------------------------------

# Top-level fields of older checkpoints' states that now live in ``TrainState.objective_state``:
# StableDRL's clip bound was ``TrainState.log_clip_hi``.
_LEGACY_OBJECTIVE_FIELDS = ("log_clip_hi",)


def _restore_item(fields: dict[str, Any], stored: dict[str, list[tuple[int, ...]]],
                  where: str) -> dict[str, Any]:
  """What to restore of a checkpoint whose state has ``stored`` fields, as a dict of abstract
  arrays: this state's ``fields``, with an older checkpoint's layout where it has one.

  A checkpoint without ``objective_state`` (or with an empty one) restores the rest, and the
  missing subtree starts as a fresh run's (``_restored_state``), except a legacy top-level
  leaf that the objective state holds under the same name (StableDRL's ``log_clip_hi``).

  Raises:
    ValueError: the stored arrays do not have this state's shapes (another model).
  """
  objective_state = fields["objective_state"]
  item = {name: value for name, value in fields.items() if name in stored}
  for name in _LEGACY_OBJECTIVE_FIELDS:
    if name in stored and name not in fields:  # Read and dropped unless the state holds it.
      like = objective_state.get(name) if isinstance(objective_state, dict) else None
      item[name] = like if like is not None else jax.ShapeDtypeStruct(
          (), jnp.float32, sharding=fields["step"].sharding)
  want = sorted(tuple(x.shape) for x in jax.tree.leaves(item))
  have = sorted(shape for shapes in stored.values() for shape in shapes)
  required = set(fields) - {"objective_state"}
  if want != have or not required <= set(stored):
    full = sorted(tuple(x.shape) for x in jax.tree.leaves(fields))
    mismatch = next(((a, b) for a, b in zip(have, full) if a != b), (len(have), len(full)))
    raise ValueError(f"config does not match {where}: its {len(have)} arrays do not have "
                     f"the shapes of this model's state ({len(full)}; e.g. "
                     f"{mismatch[0]} stored vs {mismatch[1]}). Resume with the "
                     "checkpoint's model config, or start a new --workdir.")
  return item


def _restored_state(fresh: Any, restored: dict[str, Any]) -> Any:
  """The state of a restored ``_restore_item``: missing objective state from ``fresh``."""
  objective_state = restored.pop("objective_state", None)
  if objective_state is None or not jax.tree.leaves(objective_state):
    objective_state = fresh.objective_state
    if isinstance(objective_state, dict):
      objective_state = {**objective_state, **{
          name: restored[name] for name in _LEGACY_OBJECTIVE_FIELDS
          if name in restored and name in objective_state}}
  for name in _LEGACY_OBJECTIVE_FIELDS:
    restored.pop(name, None)
  return fresh.replace(**restored, objective_state=objective_state)


def restore_run(checkpointer: Checkpointer, state: Any, config: Any, *,
                base_identity: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
  """The newest checkpoint of ``checkpointer`` that restores whole and finite into ``state``
  (a fresh ``TrainState``, placed as the run places it), and its meta; after checking that it
  is this run's (``check_resume``, before anything is written).

  Checkpoints newer than it that cannot be read (a FIFO or a device among its files, found by
  kind before orbax opens anything: ``workdir_files.check_tree``), or whose parameters are not
  all finite, are moved to ``<workdir>/checkpoints_damaged/`` with a warning naming why. If
  none restores, nothing is moved (a fault that hits every step is not damage) and the error
  says why the latest failed. A checkpoint of another run (other model, objective, tokenizer)
  is an error, never damage. ``base_identity`` (a LoRA run's ``lora_base.identity``): a
  checkpoint of the adapters alone is checked against it and joined with ``state``'s base.
  """
  abstract = abstract_like(state)
  fields = {f.name: getattr(abstract, f.name) for f in dataclasses.fields(abstract)}
  damaged = []
  for step in reversed(checkpointer.all_steps()):
    where = f"{checkpointer.directory}/{step}"
    try:  # orbax and tensorstore would open a FIFO planted among the step's files, for good.
      workdir_files.check_tree(where)
    except WorkdirError as error:
      damaged.append((step, f"its files cannot be read ({error})"))
      continue
    try:
      meta = checkpointer.restore_meta(step)
      stored = checkpointer.stored_fields(step)
    except Exception as error:  # pylint: disable=broad-except
      damaged.append((step, f"its metadata cannot be read ({one_line(error)})"))
      continue
    if "config" in meta:
      check_resume(config, meta["config"], where)
    adapters_only = base_identity is not None and lora_base.holds_adapters_only(
        stored.get("params", []), state.params)
    if adapters_only:  # This version's LoRA checkpoint: the base is this run's own.
      lora_base.check(meta.get(lora_base.META_KEY), base_identity, where)
      fields["params"] = lora_base.saved_params(abstract.params)
    else:
      fields["params"] = abstract.params
    item = _restore_item(fields, stored, where)
    try:
      restored, meta = checkpointer.restore(step, item)
    except Exception as error:  # pylint: disable=broad-except
      damaged.append((step, f"it cannot be restored ({one_line(error)})"))
      continue
    if adapters_only:
      restored["params"] = lora_lib.join(restored["params"], lora_lib.split(state.params)[1])
    restored = _restored_state(state, restored)
    bad = nonfinite_leaves(restored.params)
    if bad:
      damaged.append((step, f"{len(bad)} parameters are not finite ({', '.join(bad[:3])}"
                            + (", ..." if len(bad) > 3 else "") + ")"))
      continue
    for bad_step, why in damaged:
      target = checkpointer.set_aside(bad_step)
      message = (f"checkpoint step {bad_step} is damaged: {why[:300]}; moved to {target}; "
                 f"resuming from step {step}")
      if jax.process_index() == 0:
        logging.warning(message)
        print(f"warning: {message}", file=sys.stderr, flush=True)
    return restored, meta
  latest, why = damaged[0]
  raise ValueError(f"no checkpoint in {checkpointer.directory} can be restored; the latest "
                   f"(step {latest}): {why[:300]}. Nothing was moved; fix the cause, or start "
                   "a new --workdir")


def one_line(error: BaseException) -> str:
  """``error``'s type and message on one line (tensorstore's span many), at most 300 chars."""
  return " ".join(f"{type(error).__name__}: {error}".split())[:300]


class WorkdirLock:
  """``<workdir>/LOCK``: the host and pid of the trainer that owns the workdir (process 0).

  A second trainer on the same workdir is refused while the owner lives: on this host its pid
  is checked; on another host the lock counts as live until it is ``stale_after_s`` old (the
  owner touches it every step). A lock of a dead process is taken over with a warning.

  The lock is written into a new file of the workdir that then replaces ``LOCK`` (atomically,
  locally): a ``LOCK`` that is a symbolic link is replaced, never followed, so nothing outside
  the workdir is read or written. A ``LOCK`` that is a directory, or a workdir that cannot be
  written, is a ``WorkdirError`` naming the path.
  """

  NAME = "LOCK"

  def __init__(self, workdir: epath.PathLike, *, stale_after_s: float = 3600.0):
    self.path = epath.Path(workdir) / self.NAME
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    owner = self._read()
    if owner and (owner.get("pid"), owner.get("host")) != (me["pid"], me["host"]):
      if self._alive(owner, me, stale_after_s):
        raise RuntimeError(
            f"workdir {workdir} is in use by process {owner.get('pid')} on host "
            f"{owner.get('host')!r} (started {time.ctime(owner.get('started', 0))}). Stop it "
            f"or choose another --workdir; if no trainer runs there, delete {self.path}.")
      logging.warning("taking over the stale lock of process %s on %s (%s)",
                      owner.get("pid"), owner.get("host"), self.path)
    self._me = me
    self._write()

  def _read(self) -> dict[str, Any]:
    """The owner recorded in ``LOCK`` ({} if there is none, or it is not a lock)."""
    if not is_local(self.path):
      if not self.path.exists():
        return {}
      try:
        return json.loads(self.path.read_text())
      except (OSError, ValueError):
        return {}
    try:
      info = os.lstat(self.path)
    except FileNotFoundError:
      return {}
    except OSError as error:
      raise WorkdirError(f"cannot read the workdir lock {self.path}: {error.strerror}") from None
    if stat.S_ISDIR(info.st_mode):
      raise WorkdirError(f"the workdir lock {self.path} is a directory, not a file: remove it "
                         "(no trainer makes it)")
    if stat.S_ISLNK(info.st_mode):  # Not one of ours: replaced, never followed.
      logging.warning("the workdir lock %s is a symbolic link (to %s); replacing the link with "
                      "a lock file", self.path, os.readlink(self.path))
      return {}
    # A FIFO (whose open would wait for a writer for good, deaf to Ctrl-C) or a device is
    # refused in one line, never opened (``workdir_files.open_regular``).
    data = workdir_files.read_bytes(self.path, "the workdir lock", follow_links=False,
                                    missing_ok=True)
    try:
      owner = json.loads(data or b"")  # Not JSON (or not UTF-8): not a lock of ours.
    except ValueError:
      return {}
    return owner if isinstance(owner, dict) else {}

  def _write(self) -> None:
    """``LOCK`` holds ``self._me``: a new file in the workdir renamed over it (over a symbolic
    link, not through it)."""
    workdir_files.write_text(self.path, json.dumps(self._me))

  def _alive(self, owner: dict[str, Any], me: dict[str, Any], stale_after_s: float) -> bool:
    if owner.get("host") == me["host"]:
      try:
        os.kill(int(owner.get("pid", 0)), 0)
      except (ProcessLookupError, ValueError):
        return False
      except PermissionError:  # Another user's live process.
        return True
      return int(owner.get("pid", 0)) > 0
    try:
      age = time.time() - self.path.stat().mtime
    except (OSError, AttributeError):
      return True
    return age < stale_after_s

  def touch(self) -> None:
    """Marks the owner alive (for trainers on other hosts): its modification time, which needs
    no space on a full disk (a remote lock is rewritten)."""
    if not is_local(self.path):
      self._write()
      return
    try:
      os.utime(self.path, follow_symlinks=False)
    except OSError:  # Gone or replaced since: written anew.
      self._write()

  def release(self) -> None:
    """Removes ``LOCK`` (a link in its place included; never what a link points to)."""
    if not is_local(self.path):
      if self.path.exists():
        self.path.unlink()
      return
    with contextlib.suppress(FileNotFoundError):
      if not os.path.isdir(self.path) or os.path.islink(self.path):
        os.unlink(self.path)
