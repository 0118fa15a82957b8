"""LoRA adapters in PEFT's format: what ``peft`` writes and reads (docs/training.md, "LoRA").

An adapter directory holds

* ``adapter_config.json``: ``peft_type`` "LORA", ``r``, ``lora_alpha`` (scale alpha / r),
  ``target_modules``, ``base_model_name_or_path`` (the Hub id or directory of the base model),
  ``lora_dropout`` and PEFT's other fields at the values our adapters mean (no bias, no rsLoRA,
  no DoRA);
* ``adapter_model.safetensors`` (or an older peft's ``adapter_model.bin``, a PyTorch state dict
  read with ``torch.load(weights_only=True)`` where torch is installed): for each adapted module
  N of the official modeling code (``model.transformer.blocks.0.q_proj``),
  ``base_model.model.N.lora_A.weight`` [r, in] and ``base_model.model.N.lora_B.weight``
  [out, r]: the transposes of our A [in, r] and B [r, out].

A tensor is applied only where ``target_modules`` and ``exclude_modules`` select its module, as
peft selects them (``selects``); a tensor for a module they do not select is refused in one line
(peft would load it and leave it unused).

``save_adapter`` writes one for a model with adapters (``models.lora``), ``load_adapter`` gives a
model the adapters of one, and ``from_pretrained`` reads the base that ``adapter_config.json``
names with the adapter on it. What we cannot represent (rsLoRA, DoRA, biases, per-module ranks,
fan_in_fan_out) is refused in one line naming the field.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from stabledrl_jax import hub, input_files, workdir_files
from stabledrl_jax.models import family as family_lib, hf_io, lora as lora_lib

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# An older peft's weights, read only where there is no WEIGHTS_FILE.
TORCH_WEIGHTS_FILE = "adapter_model.bin"
PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"
# The files of an adapter repository on the Hub.
FILES = (CONFIG_FILE, WEIGHTS_FILE, TORCH_WEIGHTS_FILE)
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


def _module_names(config: dict[str, Any], field: str) -> str | list[str] | None:
  """``target_modules`` or ``exclude_modules``: None, a regular expression (a string), or a
  list of names; ValueError naming the file's field otherwise."""
  value = config.get(field)
  if value is None or value == []:
    return None
  if isinstance(value, str):
    if value != "all-linear":
      try:
        re.compile(value)
      except re.error as error:
        raise ValueError(f"{CONFIG_FILE}: {field}: {value!r} is no regular expression ({error})"
                         ) from None
    return value
  if isinstance(value, list) and all(isinstance(v, str) and v for v in value):
    return value
  raise ValueError(f"{CONFIG_FILE}: {field}: {value!r}; a list of module names or a regular "
                   "expression")


def selects(config: dict[str, Any], module: str) -> bool:
  """Whether an adapter config selects ``module`` (``model.transformer.blocks.0.q_proj``), as
  peft does (``peft.tuners.tuners_utils.check_target_module_exists``): not when
  ``exclude_modules`` holds it (a regular expression matching it whole, or a list with the name
  or a dotted suffix of it); else when ``target_modules`` is a regular expression matching it
  whole, is "all-linear" (every projection), or is a list with its name or a dotted suffix of
  it. Without target_modules peft picks its defaults for the model type: every module is
  taken."""
  def listed(names: str | list[str], full: bool) -> bool:
    if isinstance(names, str):
      return full or re.fullmatch(names, module) is not None
    return module in names or any(module.endswith("." + name) for name in names)

  exclude = _module_names(config, "exclude_modules")
  if exclude is not None and listed(exclude, full=False):
    return False
  target = _module_names(config, "target_modules")
  return target is None or listed(target, full=target == "all-linear")


def open_weights(path: str, stack: contextlib.ExitStack) -> hf_io.Reader:
  """The tensors of adapter directory ``path``: ``adapter_model.safetensors``, else
  ``adapter_model.bin`` through ``torch.load(weights_only=True)`` (no pickled code runs).

  Raises:
    FileNotFoundError: neither file is there; hf_io.CheckpointError: the .bin cannot be read
    (torch missing: what to install), or is not a state dict of tensors.
  """
  torch_file = os.path.join(path, TORCH_WEIGHTS_FILE)
  if os.path.exists(os.path.join(path, WEIGHTS_FILE)) or not os.path.exists(torch_file):
    if not os.path.exists(os.path.join(path, WEIGHTS_FILE)):
      raise FileNotFoundError(f"{path} has neither {WEIGHTS_FILE} nor {TORCH_WEIGHTS_FILE}: no "
                              "adapter weights")
    return hf_io.Reader(path, stack, single=WEIGHTS_FILE)
  workdir_files.regular_file(torch_file, "adapter weights", error=hf_io.CheckpointError)
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise hf_io.CheckpointError(
        f"{torch_file}: a PyTorch file, which needs torch to read (pip install torch, the CPU "
        f"build is enough), or convert it to {WEIGHTS_FILE}") from None
  try:
    state = torch.load(torch_file, map_location="cpu", weights_only=True)
  except Exception as error:  # pylint: disable=broad-except  (torch's unpickler raises many)
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise hf_io.CheckpointError(f"{torch_file} cannot be read as a PyTorch state dict: "
                                f"{message[:300]}") from None
  if not (isinstance(state, dict) and all(
      isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())):
    raise hf_io.CheckpointError(f"{torch_file} is not a state dict (tensor name -> tensor)")
  arrays = {name: (value.float() if value.dtype == torch.bfloat16 else value).numpy()
            for name, value in state.items()}
  return hf_io.Reader.of_arrays(arrays, torch_file)


def adapted_modules(path: str, reader: hf_io.Reader) -> list[str]:
  """The module names ``path``'s tensors adapt, each with both its lora_A and lora_B, each
  selected by its config's target_modules and exclude_modules (``selects``)."""
  names = reader.names()
  file = reader.file(min(names)) if names else os.path.join(path, WEIGHTS_FILE)
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
  config = read_config(path)
  unselected = [m for m in sorted(halves[_A]) if not selects(config, m)]
  if unselected:
    fields = {f: config.get(f) for f in ("target_modules", "exclude_modules") if config.get(f)}
    raise hf_io.CheckpointError(
        f"{file}: tensors for {unselected[0]!r}"
        f"{f' (and {len(unselected) - 1} more modules)' if len(unselected) > 1 else ''}, which "
        f"{CONFIG_FILE}'s {' and '.join(f'{k} {v!r}' for k, v in fields.items())} does not "
        "select: peft would not apply them")
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
    tensors = open_weights(path, stack)
    modules = adapted_modules(path, tensors)
    known = lora_lib.projections(model)
    unknown = [m for m in modules if m not in known]
    if unknown:
      raise hf_io.CheckpointError(
          f"{tensors.file(PREFIX + unknown[0] + _A)}: {unknown[0]!r} is no projection of the "
          f"{family_lib.of(model.config).name} model (its projections: "
          f"{', '.join(sorted({m.rsplit('.', 1)[-1] for m in known}))}, named like "
          f"{next(iter(known))!r}); is {config['base_model_name_or_path']!r} its base?")
    spec = lora_lib.LoRASpec(rank=config["r"], alpha=float(config["lora_alpha"]),
                             targets=tuple(modules))
    lora_lib.add_adapters(model, spec, seed=seed, mesh=mesh)
    for module, adapter in lora_lib.adapters_of(model).items():
      for suffix, variable in ((_A, adapter.a), (_B, adapter.b)):
        name = PREFIX + module + suffix
        want = tuple(variable.shape)[::-1]
        got = tensors.shape(name)
        if got != want:
          raise hf_io.CheckpointError(f"{tensors.file(name)}: tensor {name!r} has "
                                      f"shape {got}, expected {want} (r={spec.rank})")
        value = jnp.asarray(tensors.read(name).T.astype(np.float32), variable.dtype)
        sharding = getattr(variable[...], "sharding", None)
        variable[...] = value if sharding is None else jax.device_put(value, sharding)
  return model


def base_of(path: str, base: str | None = None) -> str:
  """The base model of adapter directory ``path``: ``base`` where given (a Hub id or directory
  that replaces the one the adapter names, ``model.lora.base`` / ``--lora_base``: an adapter
  written on its authors' machine names their local directory), else its
  ``base_model_name_or_path``."""
  return base or read_config(path)["base_model_name_or_path"]


def unwrapped(checkpoint: str, base: str | None = None) -> str:
  """A checkpoint path or Hub id, or the base it names (``base_of``) if it is a PEFT adapter.

  Raises:
    ValueError: ``base`` is given and ``checkpoint`` is not an adapter.
  """
  local = hub.local_path(checkpoint, files=(hf_io.CONFIG_FILE,) + FILES)
  if is_adapter_dir(local):
    return base_of(local, base)
  if base:
    raise ValueError(f"a LoRA base ({base!r}) replaces a PEFT adapter's, but {checkpoint!r} is "
                     "no adapter (it has no adapter_config.json)")
  return checkpoint


def from_pretrained(path: str, *, base: str | None = None, **kwargs) -> nnx.Module:
  """The base model that the adapter directory (or Hub id) ``path`` names (or ``base``:
  ``base_of``), with the adapter on it.

  ``kwargs`` go to ``models.from_pretrained`` for the base (dtype, mesh, config fields).
  """
  local = hub.local_path(path, files=FILES)
  input_files.check(local, "directory", what="adapter")
  base = base_of(local, base)
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
