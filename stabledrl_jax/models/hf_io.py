"""Hugging Face checkpoints of every registered model family (LLaDA, SDAR): `from_pretrained`
and `save_pretrained`.

A checkpoint directory holds `config.json` and either one `model.safetensors` or shards listed in
`model.safetensors.index.json`. `from_pretrained` picks the model family from `model_type` in
config.json ('llada' when the key is absent, as in LLaDA's releases). Tensor names and layouts
are those of the official torch code: Linear weights are [out, in] and become [in, out] kernels
here.

Each family's tensor names and config.json keys are its record's ``Checkpoint``
(``models/llada/checkpoint.py``, ``models/sdar/checkpoint.py``); the file reader and the sharded
array construction here do not depend on the architecture.

With a mesh, each parameter is built with `jax.make_array_from_callback`: every device reads only
its own slice of the tensor from the memory-mapped file (`safe_open(...).get_slice`), so no
device-sized or full host copy of a sharded tensor is ever made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from stabledrl_jax import hub, input_files, workdir_files
from stabledrl_jax.models import family as family_lib, sharding as sharding_lib

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# The safetensors dtype codes a parameter may be stored in (cast to the parameter dtype).
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


class CheckpointError(ValueError):
  """A checkpoint that does not match the model: missing, unexpected or misshaped tensors."""


def first_id(value: Any) -> Any:
  """The first of a config.json token id field that may be a list."""
  return value[0] if isinstance(value, (list, tuple)) else value


def as_ids(value: Any) -> list[int]:
  """A config.json token id field (an id or a list of them) as a list."""
  return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def read_json_object(path: str, what: str = "") -> dict[str, Any]:
  """A JSON file that must hold an object.

  Raises:
    FileNotFoundError: no file at ``path``.
    CheckpointError: naming ``path``, when it is not JSON or not a JSON object.
  """
  reason = input_files.problem(path)
  if reason is not None:  # Missing, a FIFO (never opened), empty, unreadable.
    raise FileNotFoundError(f"no {what or os.path.basename(path)} at {path} ({reason})")
  try:  # Opened only as the regular file just checked (``workdir_files.open_regular``).
    with workdir_files.open_regular(path, "rb", what=what, error=CheckpointError) as f:
      value = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as error:
    raise CheckpointError(f"{path} is not valid JSON: {error}") from None
  if not isinstance(value, dict):
    raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an object "
                          f"(a {os.path.basename(path)} maps names to values)")
  return value


def family_of(hf: dict[str, Any]) -> family_lib.Family:
  """The model family of a config.json dict, by its ``model_type`` (none: the family that reads
  such checkpoints, ``family.untyped``)."""
  return family_lib.by_model_type(hf.get("model_type"))


# ---------------------------------------------------------------------------
# Reading.
# ---------------------------------------------------------------------------


class Reader:
  """Tensor name -> open safetensors file, for one checkpoint directory (``single``: the file
  name of an unsharded one; a PEFT adapter's is ``adapter_model.safetensors``)."""

  def __init__(self, path: str, stack: contextlib.ExitStack, single: str = SINGLE_FILE):
    index_path = os.path.join(path, INDEX_FILE)
    single_path = os.path.join(path, single)
    if os.path.exists(index_path):
      weight_map = read_json_object(index_path).get("weight_map")
      if not (isinstance(weight_map, dict)
              and all(isinstance(v, str) for v in weight_map.values())):
        raise CheckpointError(f"{index_path} has no \"weight_map\" object of tensor name -> "
                              "file name")
      files = sorted(set(weight_map.values()))
    elif os.path.exists(single_path):
      weight_map, files = None, [single]
    else:
      raise FileNotFoundError(f"{path} has neither {single} nor {INDEX_FILE}")
    handles = {}
    for name in files:
      file_path = os.path.join(path, name)
      if not os.path.exists(file_path):
        raise CheckpointError(f"{INDEX_FILE} lists {name}, which is not in {path}")
      # safetensors opens it by name: a FIFO would wait for a writer for good, a directory
      # fail with a traceback. Refused in one line first (``workdir_files``).
      workdir_files.regular_file(file_path, "adapter weights" if single != SINGLE_FILE
                                 else "checkpoint weights", error=CheckpointError)
      try:
        handles[name] = stack.enter_context(safe_open(file_path, framework="numpy"))
      except Exception as error:  # pylint: disable=broad-except  (safetensors' own errors)
        raise CheckpointError(f"{file_path} cannot be read as safetensors: {error}") from None
    self._files: dict[str, Any] = {}
    self._file_of: dict[str, str] = {}
    for name, handle in handles.items():
      for key in handle.keys():
        if weight_map is not None and weight_map.get(key) != name:
          continue
        self._files[key] = handle
        self._file_of[key] = os.path.join(path, name)
    if weight_map is not None:
      for key, name in weight_map.items():
        if key not in self._files:
          raise CheckpointError(f"tensor {key!r} is listed in {INDEX_FILE} but missing from {name}")

  @classmethod
  def of_arrays(cls, arrays: dict[str, np.ndarray], file: str) -> "Reader":
    """A reader over tensors already in memory (``file``: where they were read from, for the
    errors), as a PyTorch state dict is (``peft_io.reader``)."""
    reader = cls.__new__(cls)
    handle = _Arrays(arrays)
    reader._files = {name: handle for name in arrays}  # pylint: disable=protected-access
    reader._file_of = {name: file for name in arrays}  # pylint: disable=protected-access
    return reader

  def names(self) -> set[str]:
    return set(self._files)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._files[name].get_slice(name).get_shape())

  def dtype(self, name: str) -> str:
    """The tensor's safetensors dtype code: ``F32``, ``BF16``, ``I32``, ..."""
    return str(self._files[name].get_slice(name).get_dtype())

  def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
    """The tensor, or its `index` slice, as numpy (only that slice is read from the file).

    Raises:
      CheckpointError naming the tensor and its file: unreadable (truncated) or not finite.
    """
    try:
      value = (self._files[name].get_tensor(name) if index is None
               else _read_slice(self._files[name].get_slice(name), index))
    except Exception as error:  # pylint: disable=broad-except  (safetensors' own errors)
      raise CheckpointError(f"tensor {name!r} of {self.file(name)} cannot be read: "
                            f"{error}") from None
    if np.issubdtype(value.dtype, np.inexact) and not np.isfinite(value).all():
      raise CheckpointError(f"tensor {name!r} of {self.file(name)} holds non-finite values "
                            "(NaN or infinity)")
    return value

  def file(self, name: str) -> str:
    """The file that holds tensor ``name``."""
    return self._file_of.get(name, "?")


def _read_slice(tensor_slice: Any, index: tuple[slice, ...]) -> np.ndarray:
  return tensor_slice[index]


class _Arrays:
  """Numpy arrays behind the part of safetensors' ``safe_open`` handle that ``Reader`` uses."""

  _CODES = {"float32": "F32", "float16": "F16", "float64": "F64", "int64": "I64",
            "int32": "I32", "int8": "I8", "uint8": "U8", "bool": "BOOL"}

  def __init__(self, arrays: dict[str, np.ndarray]):
    self._arrays = arrays

  def keys(self):
    return self._arrays.keys()

  def get_tensor(self, name: str) -> np.ndarray:
    return self._arrays[name]

  def get_slice(self, name: str) -> "_ArraySlice":
    return _ArraySlice(self._arrays[name], self._CODES.get(self._arrays[name].dtype.name, "?"))


@dataclasses.dataclass(frozen=True)
class _ArraySlice:
  array: np.ndarray
  code: str

  def get_shape(self) -> list[int]:
    return list(self.array.shape)

  def get_dtype(self) -> str:
    return self.code

  def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
    return self.array[index]


def _load_array(reader: Reader, name: str, shape: tuple[int, ...], transpose: bool, dtype: Any,
                sharding: NamedSharding | None) -> jax.Array:
  np_dtype = np.dtype(dtype)

  def host_slice(index: tuple[slice, ...] | None) -> np.ndarray:
    if transpose:
      hf_index = None if index is None else tuple(index[::-1])
      value = reader.read(name, hf_index).T
    else:
      value = reader.read(name, None if index is None else tuple(index))
    return np.ascontiguousarray(value.astype(np_dtype, copy=False))

  if sharding is None:
    return jnp.asarray(host_slice(None))
  return jax.make_array_from_callback(shape, sharding, host_slice)


def _read_hf_config(path: str) -> dict[str, Any]:
  """config.json, its ``eos_token_id`` extended by generation_config.json's stop tokens (a chat
  model's end-of-turn token, e.g. SDAR's <|im_end|>), config.json's own first."""
  hf = read_json_object(os.path.join(path, CONFIG_FILE))
  generation = os.path.join(path, GENERATION_CONFIG_FILE)
  if os.path.exists(generation):
    stops = read_json_object(generation).get("eos_token_id")
    if stops is not None:
      own = as_ids(hf["eos_token_id"]) if hf.get("eos_token_id") is not None else []
      merged = list(dict.fromkeys(own + as_ids(stops)))
      hf["eos_token_id"] = merged[0] if len(merged) == 1 else merged
  return hf


def load_config(path: str, **overrides) -> Any:
  """The model config of a checkpoint directory or Hub id (its config.json; no tensor is read)."""
  path = hub.local_path(path, files=(CONFIG_FILE,))
  input_files.check(path, "directory", what="checkpoint")
  hf_config = _read_hf_config(path)
  return family_of(hf_config).checkpoint.config_from_hf(hf_config, **overrides)


def from_pretrained(path: str, *, dtype: Any = jnp.float32, mesh: Mesh | None = None,
                    rules: sharding_lib.LogicalRules = sharding_lib.LOGICAL_AXIS_RULES,
                    **config_overrides) -> Any:
  """Load a model of a registered family (by config.json's model_type) from a checkpoint directory.

  Args:
    path: directory with config.json and model.safetensors (or shards + index), or a Hugging
      Face Hub id (``GSAI-ML/LLaDA-8B-Instruct``: fetched into the Hub cache, ``hub.py``). A
      PEFT LoRA adapter's directory loads through ``models.from_pretrained``.
    dtype: parameter and compute dtype (e.g. jnp.bfloat16); logits stay float32 unless
      `logits_dtype` is overridden.
    mesh: if given, parameters are created sharded over it by the logical-axis `rules`, each
      device reading only its slice from disk. Use a mesh with `AxisType.Auto` axes.
    rules: logical axis rules (see `sharding.py`).
    **config_overrides: fields of the family's config (ModelConfig for LLaDA, SDARConfig for
      SDAR), e.g. remat=True, param_dtype=..., logits_dtype=...

  Raises:
    CheckpointError: a tensor is missing, unexpected or has the wrong shape (the error names it).
    NotImplementedError: config.json selects a model type or an architecture variant not
      implemented here.
  """
  if mesh is not None:
    sharding_lib.check_auto_mesh(mesh)
  path = hub.local_path(path)
  input_files.check(path, "directory", what="checkpoint")
  hf_config = _read_hf_config(path)
  family = family_of(hf_config)
  layout = family.checkpoint
  overrides = dict(param_dtype=dtype, dtype=dtype)
  overrides.update(config_overrides)
  config = layout.config_from_hf(hf_config, **overrides)

  abstract = nnx.eval_shape(lambda: family.model_cls(config, rngs=nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract)
  flat = dict(nnx.to_flat_state(abstract_state))
  entries = layout.param_names(config, hf_config)
  unmapped = set(flat) - {state_path for _, state_path, _ in entries}
  assert not unmapped, f"model parameters without a checkpoint name: {sorted(unmapped)}"

  with contextlib.ExitStack() as stack:
    reader = Reader(path, stack)
    present = reader.names()
    expected = {name for name, _, _ in entries}
    missing = [name for name, _, _ in entries if name not in present]
    if missing:
      raise CheckpointError(f"checkpoint {path} is missing tensor {missing[0]!r}"
                            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unexpected = sorted(present - expected - layout.ignored(hf_config))
    if unexpected:
      raise CheckpointError(f"checkpoint {path} has unexpected tensor {unexpected[0]!r}"
                            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                            + "; it may be a different architecture")
    for name, state_path, transpose in entries:
      variable = flat[state_path]
      shape = tuple(variable.shape)
      want = shape[::-1] if transpose else shape
      got = reader.shape(name)
      if got != want:
        raise CheckpointError(f"tensor {name!r} has shape {got}, expected {want}")
      # Parameters are floats: integer (or boolean) weights would be cast to whole numbers.
      if reader.dtype(name) not in _FLOAT_DTYPES:
        raise CheckpointError(f"tensor {name!r} of {reader.file(name)} has dtype "
                              f"{reader.dtype(name)}, not a float ({', '.join(_FLOAT_DTYPES)})")
    for name, state_path, transpose in entries:
      variable = flat[state_path]
      shape = tuple(variable.shape)
      sharding = None
      if mesh is not None:
        axes = sharding_lib.logical_axes(variable) or (None,) * len(shape)
        spec = sharding_lib.partition_spec(axes, shape, mesh, rules)
        sharding = NamedSharding(mesh, spec)
      array = _load_array(reader, name, shape, transpose, variable.dtype, sharding)
      flat[state_path] = variable.replace(array)
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ---------------------------------------------------------------------------
# Writing.
# ---------------------------------------------------------------------------


def _shard_groups(sizes: list[int], max_bytes: int) -> Iterator[list[int]]:
  """Consecutive index groups of at most `max_bytes` (a larger tensor gets a group of its own)."""
  group, total = [], 0
  for i, size in enumerate(sizes):
    if group and total + size > max_bytes:
      yield group
      group, total = [], 0
    group.append(i)
    total += size
  if group:
    yield group


def save_pretrained(model: Any, path: str, *, max_shard_bytes: int = 5 * 2**30) -> None:
  """Write `model` as a Hugging Face checkpoint directory (readable by `from_pretrained`).

  In its family's tensor names and config keys: LLaDA's for LLaDA, Qwen3 / SDAR's for SDAR
  (model_type 'sdar', untied head).

  Tensors are stored in the parameter dtype. If they exceed `max_shard_bytes` in total they are
  split into model-0000k-of-0000n.safetensors files plus model.safetensors.index.json, as
  transformers does; a file holds at most one shard's tensors in host memory at a time.
  Single-process only: each array is gathered to the host.
  """
  config = model.config
  layout = family_lib.of(config).checkpoint
  hf_config = layout.config_to_hf(config)
  adapters = list(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))
  if adapters:  # The checkpoint layout has no place for them: never dropped without a word.
    raise ValueError(f"the model has {len(adapters)} LoRA adapter arrays, which a Hugging Face "
                     "checkpoint does not hold: merge them first (models.lora.merge_adapters)")
  quantized = [s for s in nnx.to_flat_state(nnx.state(model, nnx.Param))
               if s[0][-1] == "qvalue"]
  if quantized:
    raise ValueError(f"the model has {len(quantized)} quantized kernels, which a Hugging Face "
                     "checkpoint does not hold: merge them first (models.lora.merge_adapters)")
  workdir_files.make_dir(path)
  workdir_files.write_text(os.path.join(path, CONFIG_FILE),
                           json.dumps(hf_config, indent=2, sort_keys=True))
  stops = list(getattr(config, "stop_token_ids", ()))
  if len(stops) > 1:  # As the releases: the chat model's stop tokens in generation_config.json.
    workdir_files.write_text(os.path.join(path, GENERATION_CONFIG_FILE), json.dumps(
        {"eos_token_id": stops, "pad_token_id": config.eos_token_id}, indent=2))
  flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  entries = layout.param_names(config, hf_config)
  sizes = [int(np.prod(flat[p].shape)) * jnp.dtype(flat[p].dtype).itemsize for _, p, _ in entries]
  groups = list(_shard_groups(sizes, max_shard_bytes))
  for name in os.listdir(path):  # files of an earlier save would confuse the reader
    if name in (SINGLE_FILE, INDEX_FILE) or _SHARD_FILE.fullmatch(name):
      os.remove(os.path.join(path, name))

  def host(state_path, transpose) -> np.ndarray:
    value = np.asarray(jax.device_get(flat[state_path][...]))
    return np.ascontiguousarray(value.T if transpose else value)

  weight_map = {}
  for k, group in enumerate(groups):
    file_name = (SINGLE_FILE if len(groups) == 1
                 else f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors")
    tensors = {entries[i][0]: host(entries[i][1], entries[i][2]) for i in group}
    # Written aside and renamed (never through a link), with the mode of any new file (0666
    # less the umask; safetensors alone writes 0600).
    with workdir_files.replacing(os.path.join(path, file_name)) as staging:
      save_file(tensors, staging, metadata={"format": "pt"})
    weight_map.update({name: file_name for name in tensors})
  if len(groups) > 1:
    workdir_files.write_text(os.path.join(path, INDEX_FILE), json.dumps(
        {"metadata": {"total_size": int(sum(sizes))}, "weight_map": weight_map}, indent=2,
        sort_keys=True))
