"""What a jitted computation costs: wall time (warm, interleaved) and memory (XLA's, the device's).

Used by the benchmarks in `experiments/` and by the plan command (`stabledrl_jax/plan/`).

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


# Peak dense bf16 FLOP/s of one chip of each TPU generation, by the generation's topology name
# (`stabledrl_jax.plan`'s time projections; the same vendor figures as PEAK_FLOPS).
TPU_CHIP_PEAK_FLOPS = {"v4": 275e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12}


def flops_shapes(model_cfg: Any) -> Any:
  """A model config as its family declares it to the FLOP counter (``family.Family.shapes``,
  the field names of ``models.llada.flops``), with remat off: model FLOPs count no
  recomputation."""
  from stabledrl_jax.models import family as family_lib  # pylint: disable=g-import-not-at-top
  family = family_lib.of(model_cfg)
  if family.shapes is None or family.step_flops is None:
    raise ValueError(f"model family {family.name!r} declares no shapes / step_flops "
                     "(models.family.Family): its FLOPs and plan cannot be counted")
  return dataclasses.replace(family.shapes(model_cfg), remat=False)


def rl_step_flops_of_run(model_cfg: Any, rollout: Any, run: Any, *, num_iterations: int,
                         cache: str | None = None) -> dict[str, Any]:
  """The analytic matmul FLOPs of one RL step, by part (``plan.rl_step_flops`` from a config).

  Counted with ``models.llada.flops`` (every matrix product at 2 FLOPs per multiply-add,
  attention included) over the family's shapes (``family.Family.shapes``), for the P x G
  rollout rows of L = prompt_length + gen_length positions; the family's ``step_flops`` counts
  its own sampler and likelihood passes:

    rollout   the sampler's model calls, ``rollout.steps`` of them (the dynamic rules, threshold
              and low_confidence_dynamic, stop earlier: an upper bound for them); LLaDA's and
              SDAR's KV caches, Dream's full passes, as each family's docstring says.
    scoring   the forward-only likelihood passes before the updates (l_old when the objective
              takes it, l_ref when it has a KL term): K MC samples each, one set per step
              (mu sets with a coupled ratio).
    updates   mu = ``train.num_iterations`` gradient passes over the same K samples: forward +
              backward = 3 x the forward (``flops.TRAIN_MULTIPLIER``; no remat recomputation:
              model FLOPs, as MFU counts them).

  Not counted: elementwise work, the optimizer, reward scoring on the host.

  Args:
    model_cfg: the model's config (any registered family's).
    rollout: the rollout settings (``config.rollout``: prompts, group size, lengths, steps,
      block length, cache).
    run: the run spec (``training/run_spec.RunSpec``: K samples, coupling, l_old, reference).
    num_iterations: mu, the updates per step (``train.num_iterations``).
    cache: the sampler's cache (default ``rollout.cache``).

  Returns:
    {"rollout", "scoring", "updates", "total"}: FLOPs per step, and "sampler_calls",
    "scoring_passes" (the sets of K), "num_samples" (K).
  """
  from stabledrl_jax.models import family as family_lib  # pylint: disable=g-import-not-at-top
  shapes = flops_shapes(model_cfg)
  cache = rollout.get("cache", "none") if cache is None else cache
  k = int(run.likelihood.num_samples)
  mu = int(num_iterations)
  sampled, forward, train = family_lib.of(model_cfg).step_flops(shapes, model_cfg, rollout, k,
                                                                cache)
  sets = mu if run.coupled_ratio else 1
  passes = sets * (int(run.needs_old) + int(run.uses_reference))
  out = dict(rollout=float(sampled), scoring=float(passes * forward), updates=float(mu * train))
  out["total"] = out["rollout"] + out["scoring"] + out["updates"]
  out.update(sampler_calls=int(rollout.steps), scoring_passes=int(passes), num_samples=k)
  return out


def projected_step_time(step_flops: float, chips: int, peak_per_chip: float,
                        mfu: float) -> float:
  """Seconds of a step of ``step_flops`` on ``chips`` chips of ``peak_per_chip`` FLOP/s at
  model-FLOPs utilization ``mfu`` (a projection, not a measurement)."""
  if not 0 < mfu <= 1:
    raise ValueError(f"mfu must be in (0, 1], got {mfu}")
  return step_flops / (chips * peak_per_chip * mfu)
