"""The slices the planner knows: Cloud TPU accelerator types and libtpu topology names, their
chips and HBM, and their devices (libtpu's compile-only ones, or fake CPU ones for XLA:CPU)."""

from __future__ import annotations

import math
import os
import re
from typing import Any

# Chips of a 2-D slice (v5e, v6e) and of a 3-D one (v4, v5p): Cloud TPU's shapes.
_SHAPES_2D = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
              256: "16x16"}
_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
              256: "4x8x8", 512: "8x8x8"}
# Accelerator type prefix -> (topology generation, TensorCores counted per chip in the name).
_ACCELERATORS = {"v5litepod": ("v5e", 1), "v5e": ("v5e", 1), "v6e": ("v6e", 1),
                 "v5p": ("v5p", 2), "v4": ("v4", 2)}
# device_kind by generation (tpu_compile.CHIP_HBM_BYTES's keys).
_KINDS = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite"}
# Compile-only devices per chip: libtpu lists a v4 chip's two TensorCores as two devices.
_DEVICES_PER_CHIP = {"v4": 2}


def topology_name(text: str) -> str:
  """An accelerator type or topology name as libtpu's topology name.

  ``v5litepod-64`` -> ``v5e:8x8``; ``v5p-8`` (8 TensorCores, 4 chips) -> ``v5p:2x2x1``;
  ``v4-8`` -> ``v4:2x2x1``; ``v6e-64`` -> ``v6e:8x8``; ``v5e:8x8`` as is; ``cpu:N``: N
  devices of ``--chip_gb`` each (default 80 GB, an 80 GB GPU), compiled by XLA:CPU only.

  Raises:
    ValueError: an unknown accelerator type or size (naming it and the sizes there are).
  """
  text = text.strip()
  if re.fullmatch(r"cpu:\d+", text) and int(text[4:]) > 0:
    return text
  if ":" in text:
    generation = text.split(":", 1)[0]
    if generation not in _KINDS:
      raise ValueError(f"--topology {text!r}: unknown TPU generation {generation!r}; one of "
                       f"{sorted(_KINDS)}")
    return text
  match = re.fullmatch(r"(v5litepod|v5e|v5p|v6e|v4)-(\d+)", text)
  if not match:
    raise ValueError(f"--topology {text!r}: not an accelerator type (v4-8, v5litepod-64, v5p-8, "
                     "v6e-64, ...) nor a topology name (v5e:8x8)")
  generation, cores = _ACCELERATORS[match.group(1)]
  size = int(match.group(2))
  chips, rest = divmod(size, cores)
  shapes = _SHAPES_3D if generation in ("v4", "v5p") else _SHAPES_2D
  if rest or chips not in shapes:
    sizes = sorted(c * cores for c in shapes)
    raise ValueError(f"--topology {text!r}: {match.group(1)} comes in sizes {sizes}")
  return f"{generation}:{shapes[chips]}"


def generation(name: str) -> str:
  return name.split(":", 1)[0]


def chips(name: str) -> int:
  if name.startswith("cpu:"):
    return int(name[4:])
  return math.prod(int(d) for d in name.split(":", 1)[1].split("x"))


def chip_bytes(name: str, chip_gb: float = 0.0) -> int:
  """One chip's HBM (bytes) of a topology name's generation (``chip_gb`` > 0: that many GB)."""
  from stabledrl_jax import tpu_compile  # pylint: disable=g-import-not-at-top
  if chip_gb > 0:
    return int(chip_gb * 1e9)
  if name.startswith("cpu:"):
    return int(80e9)
  return tpu_compile.CHIP_HBM_BYTES[_KINDS[generation(name)]]


def resolve_compiler(choice: str) -> str:
  """'tpu' or 'cpu' for ``--compiler`` (auto: tpu where libtpu imports)."""
  from stabledrl_jax import tpu_compile  # pylint: disable=g-import-not-at-top
  if choice == "auto":
    return "tpu" if tpu_compile.libtpu_available() else "cpu"
  if choice == "tpu" and not tpu_compile.libtpu_available():
    raise RuntimeError("--compiler=tpu needs libtpu: pip install 'jax[tpu]' (or the test extra: "
                       "pip install -e '.[test]'), or --compiler=cpu")
  return choice


def num_devices(name: str) -> int:
  """The devices of a topology name: its chips, times two TensorCores per chip on v4."""
  return chips(name) * _DEVICES_PER_CHIP.get(generation(name), 1)


def cpu_devices_needed(names: list[str]) -> int:
  return max(num_devices(n) for n in names)


def prepare_cpu_devices(count: int) -> None:
  """Asks for ``count`` fake CPU devices (before JAX starts its CPU backend).

  Raises:
    RuntimeError: JAX's backends already started with fewer.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  if not xla_bridge.backends_are_initialized():
    jax.config.update("jax_platforms", "cpu")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
      jax.config.update("jax_num_cpu_devices", count)
  have = len(jax.devices("cpu"))
  if have < count:
    raise RuntimeError(f"the cpu compiler needs {count} fake CPU devices and JAX already started "
                       f"with {have}: run the plan in a fresh process (or set XLA_FLAGS="
                       f"--xla_force_host_platform_device_count={count})")


def devices_for(name: str, compiler: str) -> list[Any]:
  """The slice's devices: libtpu's compile-only ones, or fake CPU ones."""
  from stabledrl_jax import tpu_compile  # pylint: disable=g-import-not-at-top
  if compiler == "tpu":
    if name.startswith("cpu:"):
      raise RuntimeError(f"--topology {name}: fake CPU devices need --compiler=cpu")
    return tpu_compile.topology_devices(name)
  import jax  # pylint: disable=g-import-not-at-top
  count = num_devices(name)
  prepare_cpu_devices(count)
  return jax.devices("cpu")[:count]
