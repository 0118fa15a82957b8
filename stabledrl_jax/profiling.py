"""What a jitted computation costs: wall time (warm, interleaved) and memory (XLA's, the device's).

Used by the benchmarks in `experiments/` and by `experiments/memory_plan.py`.

    timings = time_interleaved({"a": fn_a, "b": fn_b}, repeats=3)
    timings.median["a"], timings.best["b"], timings.first_call["a"]    # seconds

    compiled = jax.jit(f).lower(*args).compile()
    compiled_memory(compiled)["total"]                                 # bytes, per device

Timing: every function is called once first (compilation, caches), then the functions are called
in turn `repeats` times, so that on a shared machine they all see the same load; each call is
waited for with `jax.block_until_ready`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Mapping

import jax


@dataclasses.dataclass(frozen=True)
class Timings:
  """Seconds per call of each named function.

  Attributes:
    outputs: the first call's result of each function.
    first_call: seconds of the first (warm-up, usually compiling) call.
    samples: seconds of each timed call, `repeats` per function.
  """

  outputs: dict[str, Any]
  first_call: dict[str, float]
  samples: dict[str, list[float]]

  @property
  def median(self) -> dict[str, float]:
    return {name: statistics.median(s) for name, s in self.samples.items()}

  @property
  def best(self) -> dict[str, float]:
    return {name: min(s) for name, s in self.samples.items()}


def time_interleaved(fns: Mapping[str, Callable[[], Any]], repeats: int) -> Timings:
  """Warms each function up, then times the functions in turn `repeats` times."""
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  outputs, first = {}, {}
  for name, fn in fns.items():
    start = time.perf_counter()
    outputs[name] = jax.block_until_ready(fn())
    first[name] = time.perf_counter() - start
  samples = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      samples[name].append(time.perf_counter() - start)
  return Timings(outputs=outputs, first_call=first, samples=samples)


def compiled_memory(compiled: jax.stages.Compiled) -> dict[str, int]:
  """Per-device bytes of a compiled computation, from XLA's buffer assignment.

  `total` = arguments + outputs - aliased (donated inputs reused as outputs) + temporaries: the
  live bytes at the peak of XLA's schedule, weights and inputs included. It is what the
  computation needs, measured without running it, so it works for abstract inputs and fake
  devices, and is the same on every backend (unlike the device allocator's peak).
  """
  analysis = compiled.memory_analysis()
  if analysis is None:
    raise RuntimeError("this backend has no compiled memory analysis")
  sizes = dict(argument=int(analysis.argument_size_in_bytes),
               output=int(analysis.output_size_in_bytes),
               alias=int(analysis.alias_size_in_bytes),
               temp=int(analysis.temp_size_in_bytes),
               generated_code=int(analysis.generated_code_size_in_bytes))
  sizes["total"] = sizes["argument"] + sizes["output"] - sizes["alias"] + sizes["temp"]
  return sizes


def device_peak_memory(device: jax.Device | None = None) -> int | None:
  """The device allocator's peak bytes in use since the process started (None on CPU)."""
  device = device or jax.local_devices()[0]
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if not stats or "peak_bytes_in_use" not in stats:
    return None
  return int(stats["peak_bytes_in_use"])


# Peak dense bf16 FLOP/s per device of the accelerators the paper configs run on (the vendors'
# figures), by `jax.Device.device_kind` prefix; the longest matching prefix wins.
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "NVIDIA A100": 312e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA B200": 2250e12,
}


def peak_flops_per_device(device: jax.Device | None = None) -> float | None:
  """The peak dense bf16 FLOP/s of ``device`` (default: the first), None if unknown (CPUs)."""
  kind = (device or jax.devices()[0]).device_kind
  matches = [prefix for prefix in PEAK_FLOPS if kind.startswith(prefix)]
  return PEAK_FLOPS[max(matches, key=len)] if matches else None


def rl_step_flops(num_params: int, *, rollout_positions: float, scored_positions: float,
                  num_updates: int, num_scorings: int) -> float:
  """Model FLOPs of one RL step, counted as 2 N per position of a forward pass and 6 N of a
  training pass (N parameters; attention and the sampler's savings not counted: the
  convention of MFU figures).

  Args:
    rollout_positions: positions the sampler ran through the model (calls x sequence length,
      summed over rollouts).
    scored_positions: positions of one likelihood pass over the batch (rows x K x length).
    num_updates: the training passes (``train.num_iterations``).
    num_scorings: the forward-only passes (l_old, l_ref estimates).
  """
  forward = rollout_positions + num_scorings * scored_positions
  return 2.0 * num_params * forward + 6.0 * num_params * num_updates * scored_positions
