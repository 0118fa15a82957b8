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

import importlib.util
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import flags
from etils import epath


CHECKPOINT_DIR = "checkpoints"


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


def is_local(path: epath.PathLike) -> bool:
  """Whether ``path`` is on this machine's file system (not ``gs://`` and the like)."""
  return "://" not in str(path)


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


class Checkpointer:
  """Asynchronous saves of (state, meta) into ``<workdir>/checkpoints``, keeping the last N.

  ``read_only=True`` opens a workdir for restoring alone (an evaluation beside a running
  training): it neither creates the directory nor removes the temporary directory of a save in
  progress.
  """

  def __init__(self, workdir: epath.PathLike, *, max_to_keep: int = 3, async_save: bool = True,
               read_only: bool = False):
    self.directory = resolve_workdir(workdir) / CHECKPOINT_DIR
    if jax.process_count() > 1:
      _use_distributed_barriers()
    if read_only:
      options = ocp.CheckpointManagerOptions(read_only=True, max_to_keep=None, create=False,
                                             save_interval_steps=0)
    else:
      options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                             enable_async_checkpointing=async_save,
                                             cleanup_tmp_directories=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    """Starts saving (returns before the write completes when asynchronous)."""
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """The state (placed like ``abstract_state``: shapes, dtypes, shardings) and meta of ``step``."""
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    return restored["state"], restored["meta"]

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
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs (with shardings) of a concrete pytree, for ``restore``."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
      tree)
