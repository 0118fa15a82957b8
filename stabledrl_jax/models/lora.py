"""LoRA adapters on a model's projections, for any registered family (docs/training.md, "LoRA").

``add_adapters(model, spec)`` gives each targeted ``layers.Linear`` an ``Adapter``: y = x W +
(alpha / r) x A B, A [in, r] drawn as PEFT draws its lora_A (uniform in +-1/sqrt(in)), B [r, out]
zeros, so the model computes what it did until B moves. Targets are the official modeling
code's module names, matched as PEFT matches ``target_modules``: a module whose dotted name
equals a target or ends with "." + target (LLaDA's "q_proj" is every
``model.transformer.blocks.N.q_proj``; its "ff_out" also the output head, as in PEFT). The
names come from the family's checkpoint layout (``family.Checkpoint.param_names``), so a family
needs nothing of its own for LoRA.

The adapters are ``nnx.LoRAParam``s (a kind of ``nnx.Param``): ``split`` separates them from the
frozen base in a parameter state, ``join`` puts them back, and ``adapters_off`` zeroes them, the
base model itself (the reference policy of KL terms: no second copy of the weights).

LoRA dropout (PEFT's ``lora_dropout``: each adapter's input x, not the base's, dropped with rate p
and scaled by 1 / (1 - p)) is drawn only where ``with_dropout(model, key, p)`` gave the adapters
keys: the trainer does so in the forward pass that is differentiated, one key per microbatch,
and, with ``model.lora.dropout_passes='every'`` (the official trainers' way: their rollouts and
old log-probabilities run in train mode), in the rollouts' sampler and the l_old scoring too. A
sampler calls the model many times under one key: there (``per_call``) each call's masks are
keyed by the call's input as well, so that calls on different inputs (every denoising step's)
draw different masks, as a PyTorch module in train mode does. Evaluation and the reference (the
adapters off) run without.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from stabledrl_jax.models import family as family_lib, layers, sharding as sharding_lib

Array = jax.Array
_WEIGHT = ".weight"


@dataclasses.dataclass(frozen=True)
class LoRASpec:
  """``config.model.lora``: rank r (0: no adapters), alpha (scale alpha / r), and the official
  module names to adapt (PEFT's ``target_modules``)."""

  rank: int
  alpha: float
  targets: tuple[str, ...]
  dropout: float = 0.0

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def spec_of(config: Any) -> LoRASpec | None:
  """The ``config.model.lora`` section as a `LoRASpec`, None when its rank is 0."""
  if not config.rank:
    return None
  targets = tuple(t.strip() for t in str(config.targets).split(",") if t.strip())
  return LoRASpec(rank=int(config.rank), alpha=float(config.alpha), targets=targets,
                  dropout=float(config.get("dropout", 0.0)))


class Adapter(nnx.Module):
  """x [rows, in] -> (alpha / r) x A B [rows, out]; A [in, r] and B [r, out] are LoRAParams,
  sharded along the projection's own input and output axes."""

  def __init__(self, in_features: int, out_features: int, *, rank: int, scale: float,
               axes: tuple[str, str], param_dtype: Any, key: Array):
    bound = 1.0 / math.sqrt(in_features)  # PEFT: kaiming_uniform(a=sqrt(5)) on lora_A [r, in].
    a = jax.random.uniform(key, (in_features, rank), jnp.float32, -bound, bound)
    self.a = nnx.LoRAParam(a.astype(param_dtype), out_sharding=(axes[0], None),
                           eager_sharding=False)
    self.b = nnx.LoRAParam(jnp.zeros((rank, out_features), param_dtype),
                           out_sharding=(None, axes[1]), eager_sharding=False)
    self.scale = scale
    self.dropout_rate = 0.0  # Set with dropout_key by `with_dropout`, in a traced copy only.
    self.dropout_key = nnx.data(None)
    self.dropout_per_call = False  # The key folded with the call's input (a sampler's calls).

  def __call__(self, rows: Array, dtype: Any, out_dtype: Any) -> Array:
    if self.dropout_key is not None and self.dropout_rate > 0:
      keep = 1.0 - self.dropout_rate
      key = jax.random.wrap_key_data(self.dropout_key[...])
      if self.dropout_per_call:  # The input's sum, bit for bit: one key per distinct call.
        key = jax.random.fold_in(key, jax.lax.bitcast_convert_type(
            jnp.sum(rows, dtype=jnp.float32), jnp.uint32))
      rows = jnp.where(jax.random.bernoulli(key, keep, rows.shape), rows / keep,
                       jnp.zeros((), rows.dtype)).astype(rows.dtype)
    low = jnp.dot(rows, self.a[...].astype(dtype), preferred_element_type=dtype)
    return jnp.dot(low, self.b[...].astype(dtype), preferred_element_type=out_dtype) * self.scale

  def delta(self) -> Array:
    """(alpha / r) A B [in, out] in float32: what the adapter adds to the kernel."""
    return self.scale * (self.a[...].astype(jnp.float32) @ self.b[...].astype(jnp.float32))


def projections(model: nnx.Module) -> dict[str, tuple[Any, ...]]:
  """Official module name -> the path of its ``layers.Linear`` in ``model``, for every
  projection of the family's checkpoint layout (a head tied to the embedding is not one)."""
  config = model.config
  family = family_lib.of(config)
  names = family.checkpoint.param_names(config, family.checkpoint.config_to_hf(config))
  counts: dict[tuple[Any, ...], int] = {}
  for _, path, _ in names:
    counts[path] = counts.get(path, 0) + 1
  found = {}
  for hf_name, path, transposed in names:
    if not (transposed and hf_name.endswith(_WEIGHT) and path[-1] == "kernel"):
      continue
    module = _at(model, path[:-1])
    if isinstance(module, layers.Linear) and counts[path] == 1:
      found[hf_name[:-len(_WEIGHT)]] = tuple(path[:-1])
  return found


def _at(module: Any, path: Sequence[Any]) -> Any:
  for part in path:
    module = module[part] if isinstance(part, int) else getattr(module, part)
  return module


def matches(name: str, targets: Sequence[str]) -> bool:
  """PEFT's rule: ``name`` is a target, or ends with "." + a target."""
  return any(name == t or name.endswith("." + t) for t in targets)


def targeted(model: nnx.Module, spec: LoRASpec) -> dict[str, tuple[Any, ...]]:
  """The projections ``spec`` adapts (official name -> path); ValueError naming
  ``config.model.lora.targets`` if it adapts none, or one of its names matches nothing."""
  found = projections(model)
  family = family_lib.of(model.config).name
  known = sorted({name.rsplit(".", 1)[-1] for name in found})
  if not spec.targets:
    raise ValueError(f"config.model.lora.targets: empty; name {family}'s projections to adapt "
                     f"(comma-separated, of {known})")
  unknown = [t for t in spec.targets if not any(matches(name, [t]) for name in found)]
  if unknown:
    raise ValueError(f"config.model.lora.targets: {unknown} match no projection of {family} "
                     f"(its modules are named {known})")
  return {name: path for name, path in found.items() if matches(name, spec.targets)}


def add_adapters(model: nnx.Module, spec: LoRASpec, *, seed: int = 0,
                 mesh: jax.sharding.Mesh | None = None) -> nnx.Module:
  """``model`` with an `Adapter` on every projection ``spec`` targets (in place; returned).

  The adapters are created in ``model.config.param_dtype``, directly in their shards over
  ``mesh`` where one is given; target i's A draws from ``fold_in(key(seed), i)``.
  """
  chosen = targeted(model, spec)
  if any(_at(model, path).lora is not None for path in chosen.values()):
    raise ValueError("the model already has adapters")
  dtype = model.config.param_dtype
  plan = [(path, _at(model, path)) for path in chosen.values()]

  def build():
    key = jax.random.key(seed)
    return nnx.List([
        Adapter(*linear.kernel.shape, rank=spec.rank, scale=spec.scale,
                axes=sharding_lib.logical_axes(linear.kernel), param_dtype=dtype,
                key=jax.random.fold_in(key, i))
        for i, (_, linear) in enumerate(plan)])

  if mesh is None:
    adapters = build()
  else:
    adapters = sharding_lib.init_sharded(build, mesh)
  for (_, linear), adapter in zip(plan, adapters):
    linear.lora = nnx.data(adapter)
  return model


class DropoutKey(nnx.Variable):
  """An adapter's LoRA-dropout key (raw key data, uint32 [2]): no parameter, never trained or
  saved; stacked across layers like one (``scan.scan_layers``)."""


def with_dropout(model: nnx.Module, key: Array, rate: float, *,
                 per_call: bool = False) -> nnx.Module:
  """``model`` (in place; returned) with LoRA dropout of ``rate`` on every adapter, adapter i
  drawing from ``fold_in(key, i)`` (a fresh mask per call of ``key``), and with ``per_call``
  from that folded with each call's input (a sampler: many calls under one key). Meant for the
  model merged inside a traced function; ``rate`` 0 changes nothing."""
  if rate <= 0:
    return model
  for i, adapter in enumerate(adapters_of(model).values()):
    adapter.dropout_rate = float(rate)
    adapter.dropout_per_call = per_call
    adapter.dropout_key = DropoutKey(jax.random.key_data(jax.random.fold_in(key, i)))
  return model


def adapters_of(model: nnx.Module) -> dict[str, Adapter]:
  """Official module name -> its adapter, for every adapted projection of ``model``."""
  return {name: _at(model, path).lora for name, path in projections(model).items()
          if _at(model, path).lora is not None}


def has_adapters(model: nnx.Module) -> bool:
  return bool(adapters_of(model))


def split(params: nnx.State) -> tuple[nnx.State, nnx.State]:
  """A parameter state -> (adapters: its LoRAParams, base: the rest)."""
  adapters, base = nnx.split_state(params, nnx.LoRAParam, ...)
  return adapters, base


def join(adapters: nnx.State, base: nnx.State) -> nnx.State:
  """The inverse of `split`."""
  return nnx.merge_state(base, adapters)


# How a LoRA run's frozen base may be stored (``model.lora.base_dtype``).
BASE_DTYPES = ("bfloat16", "float32") + tuple(layers.QUANTIZED)


def store_base(model: nnx.Module, base_dtype: str) -> nnx.Module:
  """``model`` (in place; returned) with its frozen base stored as ``base_dtype``: bfloat16 or
  float32, or quantized (int8, int4, nf4: each projection's kernel a `layers.QuantizedKernel`
  except the output head, which stays in bfloat16 with the embeddings and norms). The adapters
  keep the model's parameter dtype."""
  if base_dtype not in BASE_DTYPES:
    raise ValueError(f"config.model.lora.base_dtype: {base_dtype!r} is not one of {BASE_DTYPES}")
  if base_dtype in layers.QUANTIZED:
    for path in projections(model).values():
      linear = _at(model, path)
      if len(path) > 1 and not isinstance(linear.kernel, layers.QuantizedKernel):
        linear.kernel = layers.QuantizedKernel(
            linear.kernel[...], base_dtype, sharding_lib.logical_axes(linear.kernel))
  dtype = jnp.float32 if base_dtype == "float32" else jnp.bfloat16
  floats = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam), nnx.Not(layers.QuantScale))
  nnx.update(model, jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
      nnx.state(model, floats)))
  return model


def adapters_off(params: nnx.State) -> nnx.State:
  """``params`` with every adapter zeroed: the base model's computation."""
  adapters, base = split(params)
  return join(jax.tree.map(jnp.zeros_like, adapters), base)


def merge_adapters(model: nnx.Module) -> nnx.Module:
  """``model`` with each adapter folded into its kernel (W + (alpha / r) A B) and removed, and
  every quantized kernel stored as the values it stands for, in place (returned): the model a
  Hugging Face checkpoint holds."""
  for path, kernel in merged_kernels(model).items():
    linear = _at(model, path[:-1])
    if isinstance(linear.kernel, layers.QuantizedKernel):
      axes = sharding_lib.logical_axes(linear.kernel.qvalue)
      linear.kernel = nnx.Param(kernel, out_sharding=axes, eager_sharding=False)
    else:
      linear.kernel.set_value(kernel)
    linear.lora = nnx.data(None)
  return model


def kernel_value(linear: layers.Linear) -> Array:
  """A projection's kernel [in, out]: its parameter, or what a quantized one stands for."""
  if isinstance(linear.kernel, layers.QuantizedKernel):
    return linear.kernel.dequantized().astype(linear.kernel.scale.dtype)
  return linear.kernel[...]


def merged_kernels(model: nnx.Module) -> dict[tuple[Any, ...], Array]:
  """Path of each adapted or quantized kernel -> W + (alpha / r) A B [in, out] (W dequantized;
  no adapter: W alone) in the model's parameter dtype, not the frozen base's storage (what
  PEFT's merge computes, W_torch + (alpha / r) B_torch A_torch, in our [in, out] layout)."""
  dtype = model.config.param_dtype
  merged = {}
  for path in projections(model).values():
    linear = _at(model, path)
    if linear.lora is not None or isinstance(linear.kernel, layers.QuantizedKernel):
      kernel = kernel_value(linear)
      delta = 0.0 if linear.lora is None else linear.lora.delta()
      merged[path + ("kernel",)] = (kernel.astype(jnp.float32) + delta).astype(dtype)
  return merged
