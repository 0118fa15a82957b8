"""The device mesh: one ``jax.sharding.Mesh`` with axes (data, fsdp, tensor), sized from config."""

from __future__ import annotations

import math
from typing import Sequence

import jax
import ml_collections
import numpy as np
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
  """The (data, fsdp, tensor) mesh over ``devices`` (default: all)."""
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape(config, len(devices))
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


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
