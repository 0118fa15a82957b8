"""The device mesh: one ``jax.sharding.Mesh`` with axes (data, fsdp, tensor), sized from config.

``config.mesh.{data,fsdp,tensor}`` are the global sizes (one may be -1: the rest). The devices
are laid out by ``jax.make_mesh``, which follows the physical topology of TPU slices and GPU
nodes, so that the 'fsdp' and 'tensor' collectives run over neighbouring chips.

Multi-slice (several TPU slices joined by the data-center network, or GPU nodes treated as
slices): ``config.mesh.dcn_data = S`` splits the 'data' axis into S groups of slices (a hybrid
mesh, ``mesh_utils.create_hybrid_device_mesh``), so that only the data-parallel gradient
reduction crosses the slow network; 'fsdp' and 'tensor' stay inside each slice. Devices that do not report slices
(CPU, GPUs) count each process as a slice.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import mesh_utils
from jax.sharding import Mesh

MESH_AXES = ("data", "fsdp", "tensor")


def mesh_shape(config: ml_collections.ConfigDict, num_devices: int) -> tuple[int, int, int]:
  """Axis sizes from ``config.mesh.{data,fsdp,tensor}``; one of them may be -1 (the rest).

  Raises:
    ValueError naming the field when the sizes do not multiply to ``num_devices``.
  """
  sizes = [int(config[axis]) for axis in MESH_AXES]
  free = [axis for axis, size in zip(MESH_AXES, sizes) if size == -1]
  if len(free) > 1:
    raise ValueError(f"config.mesh: at most one axis may be -1, got {dict(zip(MESH_AXES, sizes))}.")
  for axis, size in zip(MESH_AXES, sizes):
    if size == 0 or size < -1:
      raise ValueError(f"config.mesh.{axis} must be a positive size or -1, got {size}.")
  fixed = math.prod(s for s in sizes if s != -1)
  if free:
    if num_devices % fixed:
      raise ValueError(f"config.mesh: {num_devices} devices are not divisible by the fixed axes "
                       f"({fixed}).")
    sizes[MESH_AXES.index(free[0])] = num_devices // fixed
  if math.prod(sizes) != num_devices:
    raise ValueError(f"config.mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} "
                     f"devices, but {num_devices} are available.")
  return tuple(sizes)


def make_mesh(config: ml_collections.ConfigDict, devices=None) -> Mesh:
  """The (data, fsdp, tensor) mesh over ``devices`` (default: all), topology-aware.

  Raises:
    ValueError naming the field when the sizes do not fit the devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(config, len(devices))
  axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  slices = int(config.get("dcn_data", 1) or 1)
  if slices == 1:
    try:
      return jax.make_mesh(shape, MESH_AXES, axis_types, devices=devices)
    except (ValueError, NotImplementedError, AssertionError) as error:
      # A subset of a TPU slice's chips that is no sub-grid of it (single-host evaluation of
      # a pod's checkpoint, a benchmark on part of a host): laid out in device order.
      logging.warning("mesh %s over %d devices in device order (%s)", shape, len(devices), error)
      return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=axis_types)
  if slices < 1 or shape[0] % slices:
    raise ValueError(f"config.mesh.dcn_data={slices} must divide the data axis ({shape[0]}); "
                     "each group of slices holds data / dcn_data of it")
  per_slice = (shape[0] // slices,) + tuple(shape[1:])
  # Devices that report no slices (CPU, GPUs: one slice index for all) count processes.
  by_process = len({getattr(d, "slice_index", 0) for d in devices}) == 1
  try:
    grid = mesh_utils.create_hybrid_device_mesh(per_slice, (slices, 1, 1), devices,
                                                process_is_granule=by_process)
  except (ValueError, AssertionError) as error:
    raise ValueError(f"config.mesh.dcn_data={slices}: the devices do not form {slices} slices "
                     f"of {math.prod(per_slice)} ({error})") from None
  return Mesh(grid, MESH_AXES, axis_types=axis_types)


def data_parallel_size(mesh: Mesh) -> int:
  """Ways the batch is split: data x fsdp."""
  return mesh.shape["data"] * mesh.shape["fsdp"]


def pad_rows(arrays: Sequence[np.ndarray], multiple: int) -> tuple[list[np.ndarray], int]:
  """Pads [B, ...] arrays with copies of their last row up to a multiple of `multiple` rows.

  A batch split over the mesh needs the same number of rows on every device; copies of a real row
  keep the padding harmless to compute. Returns the padded arrays and B, the real rows to keep.
  """
  real = len(arrays[0])
  pad = -real % multiple
  if pad:
    arrays = [np.concatenate([x, np.repeat(x[-1:], pad, axis=0)]) for x in arrays]
  return list(arrays), real
