"""LoRA adapters in PEFT's format: what ``peft`` writes and reads (docs/training.md, "LoRA").

An adapter directory holds

* ``adapter_config.json``: ``peft_type`` "LORA", ``r``, ``lora_alpha`` (scale alpha / r),
  ``target_modules``, ``base_model_name_or_path`` (the Hub id or directory of the base model),
  ``lora_dropout`` and PEFT's other fields at the values our adapters mean (no bias, no rsLoRA,
  no DoRA);
* ``adapter_model.safetensors``: for each adapted module N of the official modeling code
  (``model.transformer.blocks.0.q_proj``), ``base_model.model.N.lora_A.weight`` [r, in] and
  ``base_model.model.N.lora_B.weight`` [out, r]: the transposes of our A [in, r] and B [r, out].

``save_adapter`` writes one for a model with adapters (``models.lora``), ``load_adapter`` gives a
model the adapters of one, and ``from_pretrained`` reads the base that ``adapter_config.json``
names with the adapter on it. What we cannot represent (rsLoRA, DoRA, biases, per-module ranks,
fan_in_fan_out) is refused in one line naming the field.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from stabledrl_jax import hub, input_files, workdir_files
from stabledrl_jax.models import hf_io, lora as lora_lib

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"
# The files of an adapter repository on the Hub.
FILES = (CONFIG_FILE, WEIGHTS_FILE)
# PEFT's LoraConfig fields whose value must be the one our adapters mean ("falsy": unset).
_MUST_BE = {"peft_type": "LORA", "bias": "none", "use_rslora": False, "use_dora": False,
            "fan_in_fan_out": False, "lora_bias": False}
_MUST_BE_EMPTY = ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform",
                  "layer_replication", "trainable_token_indices")


def is_adapter_dir(path: str) -> bool:
  """A PEFT adapter directory: ``adapter_config.json`` and no model ``config.json``."""
  return (os.path.isfile(os.path.join(path, CONFIG_FILE))
          and not os.path.isfile(os.path.join(path, hf_io.CONFIG_FILE)))


def read_config(path: str) -> dict[str, Any]:
  """``path/adapter_config.json``, checked: ValueError naming the file and the field."""
  file = os.path.join(path, CONFIG_FILE)
  config = hf_io.read_json_object(file, "adapter config")

  def bad(field: str, why: str) -> ValueError:
    return ValueError(f"{file}: {field}: {why}")

  for field, want in _MUST_BE.items():
    got = config.get(field, want)
    if (got or False) != (want or False):
      raise bad(field, f"{got!r}; only {want!r} is supported (plain LoRA)")
  for field in _MUST_BE_EMPTY:
    if config.get(field):
      raise bad(field, f"{config[field]!r}; only an empty value is supported")
  rank = config.get("r")
  if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
    raise bad("r", f"{rank!r} is not a positive integer")
  alpha = config.get("lora_alpha")
  if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
    raise bad("lora_alpha", f"{alpha!r} is not a positive number")
  base = config.get("base_model_name_or_path")
  if not isinstance(base, str) or not base:
    raise bad("base_model_name_or_path", f"{base!r}: the adapter does not name its base model")
  return config


def adapted_modules(path: str, reader: hf_io.Reader) -> list[str]:
  """The module names ``path``'s tensors adapt, each with both its lora_A and lora_B."""
  file = os.path.join(path, WEIGHTS_FILE)
  names = reader.names()
  for name in sorted(names):
    if not (name.startswith(PREFIX) and name.endswith((_A, _B))):
      raise hf_io.CheckpointError(f"{file}: tensor {name!r} is no LoRA weight "
                                  f"({PREFIX}<module>{_A} or {_B})")
  halves = {suffix: {n[len(PREFIX):-len(suffix)] for n in names if n.endswith(suffix)}
            for suffix in (_A, _B)}
  for suffix, other in ((_A, _B), (_B, _A)):
    lone = sorted(halves[suffix] - halves[other])
    if lone:
      raise hf_io.CheckpointError(f"{file}: {PREFIX}{lone[0]}{suffix} has no "
                                  f"{PREFIX}{lone[0]}{other}")
  if not names:
    raise hf_io.CheckpointError(f"{file} holds no LoRA weights")
  return sorted(halves[_A])


def load_adapter(model: nnx.Module, path: str, *, mesh: jax.sharding.Mesh | None = None,
                 seed: int = 0) -> nnx.Module:
  """``model`` (in place; returned) with the adapter of directory ``path`` (or Hub id) on it.

  Raises:
    ValueError / hf_io.CheckpointError naming the file and the field or tensor at fault: the
    adapter targets a module ``model`` does not have, a tensor is missing or misshapen.
  """
  path = hub.local_path(path, files=FILES)
  input_files.check(path, "directory", what="adapter")
  config = read_config(path)
  with contextlib.ExitStack() as stack:
    reader = hf_io.Reader(path, stack, single=WEIGHTS_FILE)
    modules = adapted_modules(path, reader)
    known = lora_lib.projections(model)
    unknown = [m for m in modules if m not in known]
    if unknown:
      raise hf_io.CheckpointError(
          f"{os.path.join(path, WEIGHTS_FILE)}: {unknown[0]!r} is no projection of this "
          f"{model.config.__class__.__name__} (its are named like {next(iter(known))!r}); is "
          f"{config['base_model_name_or_path']!r} its base?")
    spec = lora_lib.LoRASpec(rank=config["r"], alpha=float(config["lora_alpha"]),
                             targets=tuple(modules))
    lora_lib.add_adapters(model, spec, seed=seed, mesh=mesh)
    for module, adapter in lora_lib.adapters_of(model).items():
      for suffix, variable in ((_A, adapter.a), (_B, adapter.b)):
        name = PREFIX + module + suffix
        want = tuple(variable.shape)[::-1]
        got = reader.shape(name)
        if got != want:
          raise hf_io.CheckpointError(f"{os.path.join(path, WEIGHTS_FILE)}: tensor {name!r} has "
                                      f"shape {got}, expected {want} (r={spec.rank})")
        value = jnp.asarray(reader.read(name).T.astype(np.float32), variable.dtype)
        sharding = getattr(variable[...], "sharding", None)
        variable[...] = value if sharding is None else jax.device_put(value, sharding)
  return model


def unwrapped(checkpoint: str) -> str:
  """A checkpoint path or Hub id, or the base it names if it is a PEFT adapter."""
  local = hub.local_path(checkpoint, files=(hf_io.CONFIG_FILE,) + FILES)
  if is_adapter_dir(local):
    return read_config(local)["base_model_name_or_path"]
  return checkpoint


def from_pretrained(path: str, **kwargs) -> nnx.Module:
  """The base model that the adapter directory (or Hub id) ``path`` names, with the adapter on it.

  ``kwargs`` go to ``models.from_pretrained`` for the base (dtype, mesh, config fields).
  """
  local = hub.local_path(path, files=FILES)
  input_files.check(local, "directory", what="adapter")
  base = read_config(local)["base_model_name_or_path"]
  if base == path or os.path.abspath(base) == os.path.abspath(local):
    raise ValueError(f"{os.path.join(local, CONFIG_FILE)}: base_model_name_or_path names the "
                     "adapter itself")
  if is_adapter_dir(hub.local_path(base, files=FILES)):
    raise ValueError(f"{os.path.join(local, CONFIG_FILE)}: base_model_name_or_path {base!r} is "
                     "itself an adapter; merge it first (python -m stabledrl_jax.export --merge)")
  model = hf_io.from_pretrained(base, **kwargs)
  return load_adapter(model, local, mesh=kwargs.get("mesh"))


def _target_modules(modules: list[str], every: dict[str, Any]) -> list[str]:
  """PEFT's target_modules for exactly ``modules``: their last names if those select no other
  projection of the model (PEFT's suffix rule), else the full names."""
  short = sorted({m.rsplit(".", 1)[-1] for m in modules})
  if {m for m in every if lora_lib.matches(m, short)} == set(modules):
    return short
  return sorted(modules)


def save_adapter(model: nnx.Module, path: str, *, base: str, dropout: float = 0.0,
                 dtype: Any = jnp.float32) -> None:
  """Write ``model``'s adapters to directory ``path`` in PEFT's format, naming ``base`` (a Hub id
  or a directory) as the model they adapt. Single process: each array is gathered to the host.

  Raises:
    ValueError: ``model`` has no adapters, or adapters of different ranks or scales.
  """
  adapters = lora_lib.adapters_of(model)
  if not adapters:
    raise ValueError("the model has no LoRA adapters to write")
  shapes = {(a.a.shape[1], a.scale) for a in adapters.values()}
  if len(shapes) != 1:
    raise ValueError(f"adapters of several ranks and scales {sorted(shapes)}: PEFT's format "
                     "holds one r and lora_alpha")
  (rank, scale), = shapes
  tensors = {}
  for module, adapter in adapters.items():
    for suffix, variable in ((_A, adapter.a), (_B, adapter.b)):
      value = np.asarray(jax.device_get(variable[...].astype(dtype)))
      tensors[PREFIX + module + suffix] = np.ascontiguousarray(value.T)
  config = {
      "alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": base,
      "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
      "init_lora_weights": True, "layers_pattern": None, "layers_to_transform": None,
      "lora_alpha": float(scale * rank), "lora_bias": False, "lora_dropout": float(dropout),
      "modules_to_save": None, "peft_type": "LORA", "r": int(rank), "rank_pattern": {},
      "revision": None, "target_modules": _target_modules(sorted(adapters),
                                                          lora_lib.projections(model)),
      "task_type": "CAUSAL_LM", "use_dora": False, "use_rslora": False}
  workdir_files.make_dir(path)
  workdir_files.write_text(os.path.join(path, CONFIG_FILE),
                           json.dumps(config, indent=2, sort_keys=True))
  with workdir_files.replacing(os.path.join(path, WEIGHTS_FILE)) as staging:
    save_file(tensors, staging, metadata={"format": "pt"})
