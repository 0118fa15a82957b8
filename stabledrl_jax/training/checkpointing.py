"""Preemption-safe checkpoints of the whole training state with orbax's CheckpointManager.

A checkpoint holds the train state pytree (parameters, optimizer state, step,
PRNG key data, counters) and a JSON item with the data-iterator state and the
config. orbax writes each step into a temporary directory and renames it when
complete, so a process killed mid-save leaves the previous checkpoint intact
and the torn one invisible to ``latest_step``.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Asynchronous saves of (state, meta) into ``<workdir>/checkpoints``, keeping the last N."""

  def __init__(self, workdir: str, *, max_to_keep: int = 3, async_save: bool = True):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                             enable_async_checkpointing=async_save,
                                             cleanup_tmp_directories=True))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    """Starts saving (returns before the write completes when asynchronous)."""
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """The state (placed like ``abstract_state``: shapes, dtypes, shardings) and meta of ``step``."""
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    return restored["state"], restored["meta"]

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
