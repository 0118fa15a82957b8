"""Hugging Face checkpoints of LLaDA and SDAR: `from_pretrained` and `save_pretrained`.

A checkpoint directory holds `config.json` and either one `model.safetensors` or shards listed in
`model.safetensors.index.json`. `from_pretrained` picks the model family from `model_type` in
config.json: 'llada' (also when the key is absent) or 'sdar'. Tensor names and layouts are those
of the torch code: Linear weights are [out, in] and become [in, out] kernels here.

LLaDA:

    HF name (prefix model.transformer.)     JAX path                       transpose
    wte.weight                              wte.embedding                  no
    blocks.{i}.attn_norm.weight             blocks.{i}.attn_norm.weight    no
    blocks.{i}.ff_norm.weight               blocks.{i}.ff_norm.weight      no
    blocks.{i}.{q,k,v}_proj.weight          blocks.{i}.attn.{q,k,v}_proj   yes
    blocks.{i}.attn_out.weight              blocks.{i}.attn.attn_out       yes
    blocks.{i}.{ff_proj,up_proj,ff_out}     blocks.{i}.mlp.{...}           yes
    ln_f.weight                             ln_f.weight                    no
    ff_out.weight                           lm_head.kernel                 yes

SDAR (Qwen3 names):

    HF name                                          JAX path                           transpose
    model.embed_tokens.weight                        embed_tokens.embedding             no
    model.layers.{i}.input_layernorm.weight          layers.{i}.input_layernorm.weight  no
    model.layers.{i}.post_attention_layernorm.weight layers.{i}.post_attention_layernorm no
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight layers.{i}.self_attn.{q,k,v,o}_proj yes
    model.layers.{i}.self_attn.{q,k}_norm.weight     layers.{i}.self_attn.{q,k}_norm    no
    model.layers.{i}.mlp.gate_proj.weight            layers.{i}.mlp.ff_proj             yes
    model.layers.{i}.mlp.up_proj.weight              layers.{i}.mlp.up_proj             yes
    model.layers.{i}.mlp.down_proj.weight            layers.{i}.mlp.ff_out              yes
    model.norm.weight                                norm.weight                        no
    lm_head.weight                                   lm_head.kernel                     yes

A checkpoint with `tie_word_embeddings: true` loads its embedding into lm_head as well (a stored
lm_head.weight is not read, as transformers re-ties it); the two are then separate parameters,
and `save_pretrained` writes them untied.

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
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from stabledrl_jax.models import sharding as sharding_lib
from stabledrl_jax.models.config import ModelConfig
from stabledrl_jax.models.llada import LLaDA
from stabledrl_jax.models.sdar import SDAR
from stabledrl_jax.models.sdar_config import SDARConfig

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_PREFIX = "model.transformer."

# config.json keys LLaDA's code reads that select architecture variants this model does not
# implement, with the only value supported here. A key that is absent takes LLaDA's default.
_FIXED_KEYS = {
    "activation_type": "silu",
    "alibi": False,
    "attention_layer_norm": False,
    "bias_for_layer_norm": False,
    "block_group_size": 1,
    "block_type": "llama",
    "include_bias": False,
    "include_qkv_bias": False,
    "input_emb_norm": False,
    "layer_norm_type": "rms",
    "layer_norm_with_affine": True,
    "rope": True,
    "scale_logits": False,
    "weight_tying": False,
}
_OPTIONAL_NONE_KEYS = ("bias_for_layer_norm",)


class CheckpointError(ValueError):
  """A checkpoint that does not match the model: missing, unexpected or misshaped tensors."""


# ---------------------------------------------------------------------------
# Names and configs.
# ---------------------------------------------------------------------------


def param_names(config: ModelConfig) -> list[tuple[str, tuple[Any, ...], bool]]:
  """(HF tensor name, JAX state path, transpose?) for every parameter of `LLaDA(config)`."""
  names = [(_PREFIX + "wte.weight", ("wte", "embedding"), False)]
  for i in range(config.n_layers):
    block = f"{_PREFIX}blocks.{i}."
    names += [
        (block + "attn_norm.weight", ("blocks", i, "attn_norm", "weight"), False),
        (block + "ff_norm.weight", ("blocks", i, "ff_norm", "weight"), False),
    ]
    names += [(block + f"{proj}.weight", ("blocks", i, "attn", proj, "kernel"), True)
              for proj in ("q_proj", "k_proj", "v_proj", "attn_out")]
    names += [(block + f"{proj}.weight", ("blocks", i, "mlp", proj, "kernel"), True)
              for proj in ("ff_proj", "up_proj", "ff_out")]
  names += [
      (_PREFIX + "ln_f.weight", ("ln_f", "weight"), False),
      (_PREFIX + "ff_out.weight", ("lm_head", "kernel"), True),
  ]
  return names


def config_from_hf(hf: dict[str, Any], **overrides) -> ModelConfig:
  """ModelConfig from a LLaDA config.json dict; `overrides` set ModelConfig fields (dtypes...)."""
  for key, supported in _FIXED_KEYS.items():
    if key in hf and hf[key] != supported:
      if key in _OPTIONAL_NONE_KEYS and hf[key] is None:
        continue
      raise NotImplementedError(f"config.json: {key}={hf[key]!r} is not supported "
                                f"(this model implements {key}={supported!r})")
  if hf.get("rope_scaling"):
    raise NotImplementedError(f"config.json: rope_scaling={hf['rope_scaling']!r} is not supported")
  for key in ("d_model", "n_heads", "n_layers", "vocab_size"):
    if key not in hf:
      raise CheckpointError(f"config.json has no {key!r}")
  n_kv_heads = hf.get("n_kv_heads")
  if n_kv_heads is None:
    n_kv_heads = 1 if hf.get("multi_query_attention") else hf["n_heads"]
  mlp_hidden = hf.get("mlp_hidden_size") or hf.get("mlp_ratio", 4) * hf["d_model"]
  fields = dict(
      d_model=hf["d_model"], n_heads=hf["n_heads"], n_kv_heads=n_kv_heads,
      n_layers=hf["n_layers"], mlp_hidden_size=mlp_hidden, vocab_size=hf["vocab_size"],
      embedding_size=hf.get("embedding_size") or hf["vocab_size"],
      rope_theta=float(hf.get("rope_theta", 10000.0)),
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
  )
  for key in ("mask_token_id", "eos_token_id", "max_sequence_length"):
    if hf.get(key) is not None:
      fields[key] = _first_id(hf[key])
  fields.update(overrides)
  return ModelConfig(**fields)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
  """A LLaDA config.json dict describing `config` (architecture keys at their fixed values)."""
  hf = dict(
      architectures=["LLaDAModelLM"], model_type="llada",
      d_model=config.d_model, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads,
      n_layers=config.n_layers, mlp_hidden_size=config.mlp_hidden_size,
      vocab_size=config.vocab_size, embedding_size=config.embedding_size,
      rope_theta=config.rope_theta, rms_norm_eps=config.rms_norm_eps,
      mask_token_id=config.mask_token_id, eos_token_id=config.eos_token_id,
      pad_token_id=config.eos_token_id, max_sequence_length=config.max_sequence_length,
      multi_query_attention=None, rope_full_precision=True, rope_scaling=None,
      torch_dtype=jnp.dtype(config.param_dtype).name,
  )
  hf.update(_FIXED_KEYS)
  return hf


# SDAR: config.json keys that select Qwen3 variants this model does not implement, with the only
# value supported here (an absent key takes that value).
_SDAR_FIXED_KEYS = {
    "attention_bias": False,
    "hidden_act": "silu",
    "use_sliding_window": False,
}


def sdar_param_names(config: SDARConfig, *, tied: bool = False
                     ) -> list[tuple[str, tuple[Any, ...], bool]]:
  """(HF tensor name, JAX state path, transpose?) for every parameter of `SDAR(config)`.

  tied: the checkpoint ties the output head to the embedding (lm_head reads
  model.embed_tokens.weight).
  """
  names = [("model.embed_tokens.weight", ("embed_tokens", "embedding"), False)]
  for i in range(config.num_hidden_layers):
    layer = f"model.layers.{i}."
    names += [
        (layer + "input_layernorm.weight", ("layers", i, "input_layernorm", "weight"), False),
        (layer + "post_attention_layernorm.weight",
         ("layers", i, "post_attention_layernorm", "weight"), False),
    ]
    names += [(layer + f"self_attn.{proj}.weight", ("layers", i, "self_attn", proj, "kernel"), True)
              for proj in ("q_proj", "k_proj", "v_proj", "o_proj")]
    names += [(layer + f"self_attn.{norm}.weight", ("layers", i, "self_attn", norm, "weight"),
               False) for norm in ("q_norm", "k_norm")]
    names += [(layer + f"mlp.{hf}.weight", ("layers", i, "mlp", ours, "kernel"), True)
              for hf, ours in (("gate_proj", "ff_proj"), ("up_proj", "up_proj"),
                               ("down_proj", "ff_out"))]
  names.append(("model.norm.weight", ("norm", "weight"), False))
  head = "model.embed_tokens.weight" if tied else "lm_head.weight"
  names.append((head, ("lm_head", "kernel"), True))
  return names


def _first_id(value: Any) -> Any:
  return value[0] if isinstance(value, (list, tuple)) else value


def _as_ids(value: Any) -> list[int]:
  return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def sdar_config_from_hf(hf: dict[str, Any], **overrides) -> SDARConfig:
  """SDARConfig from an SDAR config.json dict; `overrides` set SDARConfig fields (dtypes...)."""
  for key, supported in _SDAR_FIXED_KEYS.items():
    if key in hf and hf[key] != supported:
      raise NotImplementedError(f"config.json: {key}={hf[key]!r} is not supported "
                                f"(this model implements {key}={supported!r})")
  if hf.get("rope_scaling"):
    raise NotImplementedError(f"config.json: rope_scaling={hf['rope_scaling']!r} is not supported")
  if hf.get("num_experts") or hf.get("num_local_experts"):
    raise NotImplementedError("config.json describes a mixture-of-experts model; only dense SDAR "
                              "is implemented")
  for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
              "vocab_size", "block_size", "mask_token_id"):
    if key not in hf:
      raise CheckpointError(f"config.json has no {key!r}")
  fields = dict(
      hidden_size=hf["hidden_size"], num_hidden_layers=hf["num_hidden_layers"],
      num_attention_heads=hf["num_attention_heads"],
      num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
      head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
      intermediate_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      rope_theta=float(hf.get("rope_theta", 10000.0)),
      block_size=hf["block_size"], mask_token_id=hf["mask_token_id"],
  )
  if hf.get("eos_token_id") is not None:
    fields["eos_token_id"] = _first_id(hf["eos_token_id"])
    fields["stop_token_ids"] = tuple(_as_ids(hf["eos_token_id"]))
  if hf.get("max_position_embeddings") is not None:
    fields["max_position_embeddings"] = hf["max_position_embeddings"]
  fields.update(overrides)
  return SDARConfig(**fields)


def sdar_config_to_hf(config: SDARConfig) -> dict[str, Any]:
  """An SDAR config.json dict describing `config` (variant keys at their fixed values)."""
  hf = dict(
      architectures=["SDARForCausalLM"], model_type="sdar",
      hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
      num_attention_heads=config.num_attention_heads,
      num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
      intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
      rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
      block_size=config.block_size, mask_token_id=config.mask_token_id,
      eos_token_id=config.eos_token_id, max_position_embeddings=config.max_position_embeddings,
      max_window_layers=config.num_hidden_layers, sliding_window=None, rope_scaling=None,
      tie_word_embeddings=False, attention_dropout=0.0,
      torch_dtype=jnp.dtype(config.param_dtype).name,
  )
  hf.update(_SDAR_FIXED_KEYS)
  return hf


@dataclasses.dataclass(frozen=True)
class _Family:
  """How one model family maps onto a checkpoint directory."""

  model_cls: type
  config_from_hf: Callable[..., Any]
  config_to_hf: Callable[[Any], dict[str, Any]]
  param_names: Callable[[Any, dict[str, Any]], list[tuple[str, tuple[Any, ...], bool]]]
  # Tensors a checkpoint may hold that are not read (config.json dict -> names).
  ignored: Callable[[dict[str, Any]], set[str]] = lambda hf: set()


FAMILIES = {
    "llada": _Family(LLaDA, config_from_hf, config_to_hf,
                     lambda config, hf: param_names(config)),
    "sdar": _Family(SDAR, sdar_config_from_hf, sdar_config_to_hf,
                    lambda config, hf: sdar_param_names(
                        config, tied=bool(hf.get("tie_word_embeddings", False))),
                    # A tied checkpoint that also stores lm_head.weight loads tied, as
                    # transformers loads it (the stored head is not read).
                    lambda hf: {"lm_head.weight"} if hf.get("tie_word_embeddings") else set()),
}


def model_family(hf: dict[str, Any]) -> str:
  """The family of a config.json dict: its `model_type` ('llada' when absent)."""
  model_type = hf.get("model_type", "llada")
  if model_type not in FAMILIES:
    raise NotImplementedError(f"config.json: model_type={model_type!r} is not supported; "
                              f"choose from {sorted(FAMILIES)}")
  return model_type


# ---------------------------------------------------------------------------
# Reading.
# ---------------------------------------------------------------------------


class _Reader:
  """Tensor name -> open safetensors file, for one checkpoint directory."""

  def __init__(self, path: str, stack: contextlib.ExitStack):
    index_path = os.path.join(path, INDEX_FILE)
    single_path = os.path.join(path, SINGLE_FILE)
    if os.path.exists(index_path):
      with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
      files = sorted(set(weight_map.values()))
    elif os.path.exists(single_path):
      weight_map, files = None, [SINGLE_FILE]
    else:
      raise FileNotFoundError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    handles = {}
    for name in files:
      file_path = os.path.join(path, name)
      if not os.path.exists(file_path):
        raise CheckpointError(f"{INDEX_FILE} lists {name}, which is not in {path}")
      handles[name] = stack.enter_context(safe_open(file_path, framework="numpy"))
    self._files: dict[str, Any] = {}
    for name, handle in handles.items():
      for key in handle.keys():
        if weight_map is not None and weight_map.get(key) != name:
          continue
        self._files[key] = handle
    if weight_map is not None:
      for key, name in weight_map.items():
        if key not in self._files:
          raise CheckpointError(f"tensor {key!r} is listed in {INDEX_FILE} but missing from {name}")

  def names(self) -> set[str]:
    return set(self._files)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._files[name].get_slice(name).get_shape())

  def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
    """The tensor, or its `index` slice, as numpy (only that slice is read from the file)."""
    if index is None:
      return self._files[name].get_tensor(name)
    return _read_slice(self._files[name].get_slice(name), index)


def _read_slice(tensor_slice: Any, index: tuple[slice, ...]) -> np.ndarray:
  return tensor_slice[index]


def _load_array(reader: _Reader, name: str, shape: tuple[int, ...], transpose: bool, dtype: Any,
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
  with open(os.path.join(path, CONFIG_FILE)) as f:
    hf = json.load(f)
  generation = os.path.join(path, GENERATION_CONFIG_FILE)
  if os.path.exists(generation):
    with open(generation) as f:
      stops = json.load(f).get("eos_token_id")
    if stops is not None:
      own = _as_ids(hf["eos_token_id"]) if hf.get("eos_token_id") is not None else []
      merged = list(dict.fromkeys(own + _as_ids(stops)))
      hf["eos_token_id"] = merged[0] if len(merged) == 1 else merged
  return hf


def load_config(path: str, **overrides) -> ModelConfig | SDARConfig:
  """The model config of a checkpoint directory (its config.json; no tensor is read)."""
  hf_config = _read_hf_config(path)
  return FAMILIES[model_family(hf_config)].config_from_hf(hf_config, **overrides)


def from_pretrained(path: str, *, dtype: Any = jnp.float32, mesh: Mesh | None = None,
                    rules: sharding_lib.LogicalRules = sharding_lib.LOGICAL_AXIS_RULES,
                    **config_overrides) -> LLaDA | SDAR:
  """Load a LLaDA or SDAR model (by config.json's model_type) from a checkpoint directory.

  Args:
    path: directory with config.json and model.safetensors (or shards + index).
    dtype: parameter and compute dtype (e.g. jnp.bfloat16); logits stay float32 unless
      `logits_dtype` is overridden.
    mesh: if given, parameters are created sharded over it by the logical-axis `rules`, each
      device reading only its slice from disk. Use a mesh with `AxisType.Auto` axes.
    rules: logical axis rules (see `sharding.py`).
    **config_overrides: ModelConfig (LLaDA) or SDARConfig (SDAR) fields, e.g. remat=True,
      param_dtype=..., logits_dtype=...

  Raises:
    CheckpointError: a tensor is missing, unexpected or has the wrong shape (the error names it).
    NotImplementedError: config.json selects a model type or an architecture variant not
      implemented here.
  """
  if mesh is not None:
    sharding_lib.check_auto_mesh(mesh)
  hf_config = _read_hf_config(path)
  family = FAMILIES[model_family(hf_config)]
  overrides = dict(param_dtype=dtype, dtype=dtype)
  overrides.update(config_overrides)
  config = family.config_from_hf(hf_config, **overrides)

  abstract = nnx.eval_shape(lambda: family.model_cls(config, rngs=nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract)
  flat = dict(nnx.to_flat_state(abstract_state))
  entries = family.param_names(config, hf_config)
  unmapped = set(flat) - {state_path for _, state_path, _ in entries}
  assert not unmapped, f"model parameters without a checkpoint name: {sorted(unmapped)}"

  with contextlib.ExitStack() as stack:
    reader = _Reader(path, stack)
    present = reader.names()
    expected = {name for name, _, _ in entries}
    missing = [name for name, _, _ in entries if name not in present]
    if missing:
      raise CheckpointError(f"checkpoint {path} is missing tensor {missing[0]!r}"
                            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unexpected = sorted(present - expected - family.ignored(hf_config))
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


def save_pretrained(model: LLaDA | SDAR, path: str, *, max_shard_bytes: int = 5 * 2**30) -> None:
  """Write `model` as a Hugging Face checkpoint directory (readable by `from_pretrained`).

  A LLaDA model is written with LLaDA's names and config keys, an SDAR model with Qwen3 / SDAR's
  (model_type 'sdar', untied head).

  Tensors are stored in the parameter dtype. If they exceed `max_shard_bytes` in total they are
  split into model-0000k-of-0000n.safetensors files plus model.safetensors.index.json, as
  transformers does; a file holds at most one shard's tensors in host memory at a time.
  Single-process only: each array is gathered to the host.
  """
  config = model.config
  family = next((f for f in FAMILIES.values() if isinstance(model, f.model_cls)), None)
  if family is None:
    raise TypeError(f"save_pretrained: no checkpoint format for {type(model).__name__}")
  hf_config = family.config_to_hf(config)
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, CONFIG_FILE), "w") as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
  stops = list(getattr(config, "stop_token_ids", ()))
  if len(stops) > 1:  # As the releases: the chat model's stop tokens in generation_config.json.
    with open(os.path.join(path, GENERATION_CONFIG_FILE), "w") as f:
      json.dump({"eos_token_id": stops, "pad_token_id": config.eos_token_id}, f, indent=2)
  flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  entries = family.param_names(config, hf_config)
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
    save_file(tensors, os.path.join(path, file_name), metadata={"format": "pt"})
    weight_map.update({name: file_name for name in tensors})
  if len(groups) > 1:
    with open(os.path.join(path, INDEX_FILE), "w") as f:
      json.dump({"metadata": {"total_size": int(sum(sizes))}, "weight_map": weight_map}, f,
                indent=2, sort_keys=True)
