"""Compile for a TPU topology from any host: libtpu's real compiler, no TPU needed.

With libtpu installed (``pip install 'jax[tpu]'``; the ``test`` extra has it),
``jax.experimental.topologies`` describes a TPU slice ("v5e:2x2": 4 chips on one host;
"v5e:4x4": 16 chips on 4 hosts) as compile-only devices. A mesh over them and abstract inputs
(``jax.ShapeDtypeStruct`` with their shardings) let ``jit(...).lower(...).compile()`` run the TPU
compiler on this machine: the Pallas kernels (splash attention) are lowered for real, and
``profiling.compiled_memory`` of the result gives the bytes per chip. Nothing is allocated or run.

    devices = tpu_compile.topology_devices("v5e:2x2")
    result = tpu_compile.compile_train_step(config, devices)   # rl_step.abstract_programs
    result = tpu_compile.compile_decode(config, devices, tpu_compile.rollout_decoding(config))
    result.memory["total"], result.seconds, result.fits

The samplers compile through ``training.step.decoding.generate`` (the path the trainer's rollouts
and evaluations take) under the mesh's abstract mesh, the model from
``training.config.specs.model_config``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from stabledrl_jax import libtpu_env, models, profiling
from stabledrl_jax.training.config import run_spec, specs
from stabledrl_jax.training.parallel import mesh as mesh_lib
from stabledrl_jax.training.step import build, decoding as decoding_lib, rl_step

# HBM per chip (bytes), by `device_kind` (Cloud TPU's published sizes).
CHIP_HBM_BYTES = {
    "TPU v4": 32 * 2**30,
    "TPU v5 lite": 16 * 2**30,  # v5e
    "TPU v5": 95 * 2**30,  # v5p
    "TPU v6 lite": 32 * 2**30,  # v6e (Trillium)
}


def libtpu_available() -> bool:
  """Whether libtpu (the TPU compiler) can be imported here."""
  return importlib.util.find_spec("libtpu") is not None


def topology_devices(topology: str = "v5e:2x2") -> list[jax.Device]:
  """The compile-only devices of a TPU slice, e.g. "v5e:2x2" (1 host) or "v5e:4x4" (4 hosts).

  Raises:
    RuntimeError: libtpu is not installed (one line, with the install command).
    ValueError: libtpu does not know the topology name.
  """
  libtpu_env.quiet_without_tpu()
  if not libtpu_available():
    raise RuntimeError("compiling for a TPU topology needs libtpu: pip install 'jax[tpu]' "
                       "(or the test extra: pip install -e '.[test]')")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    return list(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)
  except Exception as error:  # pylint: disable=broad-except
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise ValueError(f"TPU topology {topology!r}: {first}") from None


@dataclasses.dataclass
class Result:
  """One compiled computation.

  Attributes:
    what: a label.
    seconds: lowering and compiling, wall clock.
    memory: ``profiling.compiled_memory`` (bytes per chip: argument, output, alias, temp, total).
    hbm_bytes: one chip's memory (CHIP_HBM_BYTES), or None for an unknown kind.
    compiled: the ``jax.stages.Compiled`` (``.as_text()``: the optimized HLO).
    programs: for a train step, each program's ``memory['total']`` by name (the update and
      the scoring passes: ``rl_step.abstract_programs``); ``memory`` is the largest one's, as
      they run one after the other.
  """

  what: str
  seconds: float
  memory: dict[str, int]
  hbm_bytes: int | None
  compiled: Any
  programs: dict[str, int] = dataclasses.field(default_factory=dict)

  @property
  def fits(self) -> bool | None:
    return None if self.hbm_bytes is None else self.memory["total"] <= self.hbm_bytes

  def row(self) -> dict[str, Any]:
    """A JSON-able summary."""
    return dict(what=self.what, compile_seconds=round(self.seconds, 2),
                per_chip_bytes=self.memory["total"], hbm_bytes=self.hbm_bytes, fits=self.fits,
                xla=self.memory, **({"programs": self.programs} if self.programs else {}))


@contextlib.contextmanager
def no_persistent_cache():
  """JAX's persistent compilation cache off: an executable for compile-only devices cannot be
  read back ("PjRtCompiler must be constructed with a Client"), so writing it only costs disk
  and every later read a warning. JAX decides once per process whether its cache is in use, so
  the decision is reset on the way in (and out, to take the cache up again after)."""
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.compilation_cache import compilation_cache
  previous = jax.config.jax_enable_compilation_cache
  compilation_cache.reset_cache()
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", previous)
    compilation_cache.reset_cache()


def _result(what: str, start: float, compiled: Any, devices) -> Result:
  return Result(what=what, seconds=time.perf_counter() - start,
                memory=profiling.compiled_memory(compiled),
                hbm_bytes=CHIP_HBM_BYTES.get(devices[0].device_kind), compiled=compiled)


def compile_train_step(config: ml_collections.ConfigDict, devices, *,
                       what: str = "train_step") -> Result:
  """Every program of ``config``'s train step but the sampler (``rl_step.abstract_programs``:
  the update, and the l_old / l_ref scoring passes) compiled on ``devices``. The result's
  ``compiled`` is the update's; its ``memory`` the largest program's."""
  start = time.perf_counter()
  compiled, memories = {}, {}
  with no_persistent_cache():
    for name, (fn, args, keywords) in rl_step.abstract_programs(config, devices).items():
      compiled[name] = fn.lower(*args, **keywords).compile()
      memories[name] = profiling.compiled_memory(compiled[name])
  result = _result(what, start, compiled["update"], devices)
  largest = max(memories, key=lambda name: memories[name]["total"])
  return dataclasses.replace(result, memory=memories[largest],
                             programs={name: m["total"] for name, m in memories.items()})


def rollout_decoding(config: ml_collections.ConfigDict, **overrides) -> run_spec.Decoding:
  """The trainer's rollout sampler settings (``specs.resolve_rollout``; overrides: cache,
  remasking, ...)."""
  return specs.resolve_rollout(config).sampling.with_options(**overrides)


def compile_decode(config: ml_collections.ConfigDict, devices, settings: run_spec.Decoding,
                   *, rows: int | None = None, what: str = "decode", model: Any = None) -> Result:
  """The model's sampler (``decoding.generate``) with ``settings`` on ``devices``, for ``rows``
  prompts of ``rollout.prompt_length`` (default: the rollout batch, P x G), split as the trainer
  splits them; ``model``: the model config where resolved already (``specs.resolve``)."""
  start = time.perf_counter()
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  model_cfg = specs.model_config(config) if model is None else model
  # A LoRA run samples with its adapters on the base as stored (bfloat16, int8, 4-bit).
  graphdef, state = build.abstract_params(config, mesh, model_cfg)
  r = config.rollout
  n = r.num_prompts * r.group_size if rows is None else rows
  sharding = models.batch_sharding(mesh, ndim=2)
  prompt = jax.ShapeDtypeStruct((n, r.prompt_length), jnp.int32, sharding=sharding)
  prompt_mask = jax.ShapeDtypeStruct((n, r.prompt_length), jnp.bool_, sharding=sharding)
  key = jax.eval_shape(lambda: jax.random.key(0))
  key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec()))

  def generate(state, prompt, prompt_mask, key):
    return decoding_lib.generate(nnx.merge(graphdef, state), prompt, prompt_mask, key, settings)

  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), no_persistent_cache():
    compiled = jax.jit(generate).lower(state, prompt, prompt_mask, key).compile()
  return _result(what, start, compiled, devices)
