"""Several processes, one program (docs/pods.md): start-up, each process's rows, reductions.

A TPU pod slice or a GPU cluster runs one copy of the trainer per host. Every copy runs the
same jitted steps on global arrays; what differs is the host-side work, done for this process's
rows only:

* ``initialize`` connects the processes (``jax.distributed``) before JAX touches a device.
* ``RowSplit`` says which rows of a batch sharded over the mesh's batch axes live on
  this process's devices. The trainer draws, encodes, samples, decodes and scores only those.
* ``to_global`` assembles global arrays from each process's rows
  (``jax.make_array_from_process_local_data``); ``local_rows`` reads this process's rows of a
  global array back. No process converts a globally sharded array to numpy.
* ``gather_rows`` and ``sum_over_rows`` reduce host-side per-row values (rewards, scores) over
  the whole batch, each row counted once even where processes share rows.

With one process every function is the identity or a plain numpy operation.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

# Environment variables that mark a launch of several processes that ``jax.distributed``
# detects on its own (TPU pod slices and multi-slice, Slurm, Open MPI).
_CLUSTER_VARIABLES = {
    "TPU_WORKER_HOSTNAMES": lambda v: "," in v,
    "MEGASCALE_COORDINATOR_ADDRESS": bool,
    "SLURM_STEP_NUM_TASKS": lambda v: v.isdigit() and int(v) > 1,
    "OMPI_COMM_WORLD_SIZE": lambda v: v.isdigit() and int(v) > 1,
}


def detected_cluster() -> str | None:
  """What shows a multi-process launch: an environment variable of the launcher, or a Cloud TPU
  VM that JAX's own cluster detection recognizes (its metadata server; an ssh session on a pod
  worker has no launcher variables). None: one process alone."""
  for name, test in _CLUSTER_VARIABLES.items():
    value = os.environ.get(name, "")
    if value and test(value):
      return name
  return _jax_detected_tpu()


def _jax_detected_tpu() -> str | None:
  """The TPU cluster type JAX detects, if any. JAX's detection is internal API: if it moves,
  this returns None and TPU pods need the explicit flags."""
  try:
    from jax._src import clusters  # pylint: disable=g-import-not-at-top
    candidates = [c for c in clusters.ClusterEnv._cluster_types if "Tpu" in c.__name__]  # pylint: disable=protected-access
    return next((c.__name__ for c in candidates if c.is_env_present()), None)
  except Exception:  # pylint: disable=broad-exception-caught
    return None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, force: bool = False) -> bool:
  """Connects this process to the others; call before anything touches a device.

  * ``coordinator_address`` ('HOST:PORT'), ``num_processes`` and ``process_id`` given: those
    (a CPU cluster, GPU nodes without Slurm, tests);
  * none given, on a TPU pod, under Slurm or Open MPI (or ``force``): ``jax.distributed``
    detects them;
  * otherwise one process alone, as on a laptop: nothing happens.

  CPU processes exchange collectives over gloo.

  Returns:
    whether ``jax.distributed`` was initialized.

  Raises:
    ValueError: only some of the three settings given, or inconsistent ones.
  """
  given = [coordinator_address, num_processes, process_id]
  if any(v is not None and v != "" for v in given):
    if not coordinator_address or num_processes is None or process_id is None:
      raise ValueError("--coordinator_address, --num_processes and --process_id go together; "
                       f"got {coordinator_address!r}, {num_processes!r}, {process_id!r}")
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ValueError(f"--process_id must lie in [0, --num_processes={num_processes}), got "
                       f"{process_id}")
    if num_processes == 1:
      return False
  elif not (force or detected_cluster()):
    return False
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if coordinator_address:
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
  else:
    jax.distributed.initialize()
  return True


def define_flags() -> None:
  """``--coordinator_address``, ``--num_processes``, ``--process_id`` (absl)."""
  from absl import flags  # Only the command-line entry points need absl here.
  flags.DEFINE_string("coordinator_address", None,
                      "HOST:PORT of process 0, for a launch of several processes that JAX does "
                      "not detect (TPU pods, Slurm and Open MPI need no flags).")
  flags.DEFINE_integer("num_processes", None, "How many processes run the program.")
  flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")


def initialize_from_flags(force: bool = False) -> bool:
  from absl import flags
  f = flags.FLAGS
  return initialize(f.coordinator_address, f.num_processes, f.process_id, force=force)


def is_primary() -> bool:
  """Process 0: the one that writes logs, metrics and files outside the checkpoints."""
  return jax.process_index() == 0


@dataclasses.dataclass(frozen=True)
class RowSplit:
  """This process's rows of an [N, ...] batch sharded over the mesh's batch axes.

  Attributes:
    rows: the sorted indices of the rows on this process's devices (runs of consecutive rows,
      one per device; on a pod mesh that follows the TPU topology the runs of one host need
      not be adjacent). Host-side arrays of this process's rows follow this order, as
      ``jax.make_array_from_process_local_data`` expects.
    num_rows: N.
    primary: whether this process is the first to hold these rows (processes that differ only
      in a replicated mesh axis hold the same rows; host-side sums count them once).
  """

  rows: np.ndarray
  num_rows: int
  primary: bool

  @property
  def size(self) -> int:
    return len(self.rows)

  def groups(self, group_size: int) -> np.ndarray:
    """The indices of the groups of ``group_size`` consecutive rows this process holds.

    Raises:
      ValueError: a group would span two processes.
    """
    groups = self.rows[::group_size] // group_size
    if (len(self.rows) % group_size
        or not np.array_equal(np.repeat(groups, group_size) * group_size
                              + np.tile(np.arange(group_size), len(groups)), self.rows)):
      raise ValueError(
          f"process {jax.process_index()} holds {self.size} of {self.num_rows} rows, which "
          f"splits a group of {group_size} completions across processes; make "
          "rollout.num_prompts (and eval.batch_size) a multiple of the number of processes, "
          "with whole groups on every device or process")
    return groups


def row_split(sharding: jax.sharding.Sharding, num_rows: int) -> RowSplit:
  """Which of ``num_rows`` rows sharded by ``sharding`` live on this process."""
  indices = sharding.addressable_devices_indices_map((num_rows,))
  spans = sorted({(s.start or 0, num_rows if s.stop is None else s.stop)
                  for s, *_ in indices.values()})
  rows = np.unique(np.concatenate([np.arange(lo, hi) for lo, hi in spans]))
  primary = True
  if not sharding.is_fully_addressable:  # A mesh over several processes: all call this.
    first = multihost_utils.process_allgather(rows[:1].astype(np.int32)).reshape(-1)
    primary = int(np.flatnonzero(first == rows[0])[0]) == jax.process_index()
  return RowSplit(rows, num_rows, primary)


def to_global(tree: Any, sharding: jax.sharding.Sharding, num_rows: int) -> Any:
  """Global [num_rows, ...] arrays from this process's rows (numpy leaves [rows, ...]); None
  leaves stay None."""

  def one(x):
    x = np.asarray(x)
    return jax.make_array_from_process_local_data(sharding, x, (num_rows,) + x.shape[1:])

  return jax.tree.map(one, tree)


def local_rows(array: jax.Array, split: RowSplit) -> np.ndarray:
  """The rows ``split.rows`` of a global [N, ...] array, read from this process's shards (the
  array may be split over its leading axis in any way, or replicated)."""
  if array.is_fully_addressable:
    return np.asarray(array)[split.rows]
  out = np.empty((split.size,) + array.shape[1:], array.dtype)
  filled = np.zeros(split.size, bool)
  seen = set()
  for shard in array.addressable_shards:
    index = shard.index[0] if shard.index else slice(None)
    lo, hi = index.start or 0, array.shape[0] if index.stop is None else index.stop
    if (lo, hi) in seen:
      continue
    seen.add((lo, hi))
    take = (split.rows >= lo) & (split.rows < hi)
    if take.any():
      out[take] = np.asarray(shard.data)[split.rows[take] - lo]
      filled |= take
  if not filled.all():
    raise ValueError(f"rows {split.rows[~filled].tolist()} are not on process "
                     f"{jax.process_index()}'s devices")
  return out


def gather_rows(values: np.ndarray, split: RowSplit) -> np.ndarray:
  """All rows [N, ...] of per-row host values, from each process's rows [split.size, ...]."""
  values = np.asarray(values)
  if jax.process_count() == 1:
    return values
  everything = multihost_utils.process_allgather(values)  # [processes, rows, ...]
  where = multihost_utils.process_allgather(split.rows.astype(np.int32))  # [processes, rows]
  out = np.empty((split.num_rows,) + values.shape[1:], values.dtype)
  for rows, part in zip(where, everything):
    out[rows] = part
  return out


def sum_over_rows(values: Sequence[float], split: RowSplit) -> np.ndarray:
  """The sums over all processes of host-side totals of their rows (each row counted once)."""
  values = np.asarray(values, np.float64)
  if jax.process_count() == 1:
    return values
  mine = (values if split.primary else np.zeros_like(values)).astype(np.float32)
  return multihost_utils.process_allgather(mine).astype(np.float64).sum(axis=0)


def agree(flag: bool) -> bool:
  """Process 0's ``flag`` on every process (a decision that must be taken together)."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


def sync(name: str) -> None:
  """Waits until every process gets here."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)
