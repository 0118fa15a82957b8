"""What a checkpoint path points at, and the model and tokenizer it holds, for inference.

Three kinds of path:

- a training workdir (``python -m stabledrl_jax.train --workdir``, with ``checkpoints/``): the
  parameters of its latest orbax checkpoint or of a chosen step; the architecture and tokenizer
  come from its ``config.json``. Only the parameters are read (not the optimizer state), and the
  workdir is opened read-only, so training can go on beside an evaluation.
- a Hugging Face checkpoint directory (``config.json`` and ``model.safetensors`` or its index),
  read by ``models.from_pretrained``, of either model family (LLaDA or SDAR). Its tokenizer is
  its ``tokenizer.json`` or else the training config's tokenizer. The training config (prompt
  style, tokenizer, the task's data settings) is that of ``stabledrl_jax.json`` in the directory
  (written by ``python -m stabledrl_jax.export``), else, for the supervised start
  ``<workdir>/sft_model``, the enclosing workdir's config.json; a plain Hugging Face checkpoint
  has none.
- a PEFT LoRA adapter directory (``adapter_config.json`` and ``adapter_model.safetensors``, as
  ``peft`` and ``python -m stabledrl_jax.export`` write them; ``models.peft_io``): the base model
  its ``base_model_name_or_path`` names (a Hugging Face directory or Hub id) with the adapter on
  it. Its training config is its ``stabledrl_jax.json``, if it has one.

Any of them may be a Hub id. Either way each parameter is created directly in its shards over the mesh.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import ml_collections
from etils import epath
from flax import nnx

from stabledrl_jax import hub, input_files, models, tokenizers, workdir_files
from stabledrl_jax.models import family as family_lib, hf_io, lora as lora_lib, peft_io
from stabledrl_jax.training.config import config_lib, specs
from stabledrl_jax.training.inputs import data
from stabledrl_jax.training.state import checkpointing, lora_base, supervised
from stabledrl_jax.training.step import build

WORKDIR = "workdir"
HUGGING_FACE = "huggingface"
PEFT = "peft"
# The training config an exported Hugging Face directory carries (export.py writes it):
# {"format": 1, "exported_from": PATH, "step": N | null, "config": {<the run's config.json>}}.
EXPORT_FILE = "stabledrl_jax.json"
EXPORT_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class CheckpointSource:
  """A resolved checkpoint path.

  Attributes:
    kind: WORKDIR, HUGGING_FACE or PEFT.
    path: the directory, absolute.
    step: the orbax step of a workdir (None for a Hugging Face directory).
    config: the training config of a workdir, of an exported Hugging Face directory (its
      ``stabledrl_jax.json``), or of the workdir a Hugging Face directory sits in (its
      supervised start ``sft_model``); else None. Prompts, tokenizer and synthetic test sets
      follow it.
    config_file: the file ``config`` was read from ('' for none).
    lora_base: a PEFT adapter's base in place of the one it names (``--lora_base``; '' keeps
      it). A LoRA workdir's run records its own (``model.lora.base``).
  """

  kind: str
  path: str
  step: int | None = None
  config: ml_collections.ConfigDict | None = None
  config_file: str = ""
  lora_base: str = ""

  @property
  def name(self) -> str:
    """"<workdir>-step<N>"; a Hugging Face directory's name ("<workdir>-<name>" in a workdir)."""
    path = epath.Path(self.path)
    if self.kind == WORKDIR:
      return f"{path.name}-step{self.step}"
    if os.path.basename(self.config_file) == "config.json":  # The enclosing workdir's.
      return f"{path.parent.name}-{path.name}"
    return path.name

  @property
  def checkpoint_path(self) -> str:
    """Where the parameters are: the step's orbax directory, or the Hugging Face directory."""
    if self.kind == WORKDIR:
      return str(epath.Path(self.path) / checkpointing.CHECKPOINT_DIR / str(self.step))
    return self.path


def is_huggingface_dir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, hf_io.CONFIG_FILE)) and any(
      os.path.isfile(os.path.join(path, name)) for name in (hf_io.SINGLE_FILE, hf_io.INDEX_FILE))


def is_workdir(path: epath.PathLike) -> bool:
  """A training workdir, local or remote (``gs://``)."""
  return (epath.Path(path) / checkpointing.CHECKPOINT_DIR).is_dir()


def training_config(path: epath.PathLike) -> ml_collections.ConfigDict | None:
  """The training config in ``path`` (a workdir or its config.json), if there is one."""
  path = epath.Path(path)
  if path.is_dir():
    path = path / "config.json"
  # A FIFO or a device there is one line naming it, never opened (``workdir_files``).
  text = workdir_files.read_bytes(path, "training config", error=input_files.InputError,
                                  missing_ok=True)
  if text is None:
    return None
  try:
    config = json.loads(text)
  except ValueError:
    return None
  if not _is_training_config(config):
    return None
  return _over_defaults(config)


def _is_training_config(config: Any) -> bool:
  return isinstance(config, dict) and "tokenizer" in config and "model" in config


def _over_defaults(config: dict[str, Any]) -> ml_collections.ConfigDict:
  """``config`` over the current defaults: a workdir written before a field existed gets its
  default."""
  merged = config_lib.base_config()
  merged.update(config)
  return merged


def exported_config(path: str) -> ml_collections.ConfigDict | None:
  """The training config in ``path/stabledrl_jax.json`` (an exported checkpoint), if there is
  that file.

  Raises:
    ValueError: the file is there but unreadable, or holds no training config.
  """
  file = os.path.join(path, EXPORT_FILE)
  # Absent: none. A FIFO or a device there is one line naming it, never opened.
  text = workdir_files.read_bytes(file, "export record", error=input_files.InputError,
                                  missing_ok=True)
  if text is None:
    return None
  try:
    record = json.loads(text)
  except ValueError as error:
    raise ValueError(f"{file} is not readable JSON ({error}); delete it to evaluate {path} as a "
                     "plain Hugging Face checkpoint") from None
  config = record.get("config") if isinstance(record, dict) else None
  if not _is_training_config(config):
    raise ValueError(f"{file} holds no training config (a 'config' object with 'model' and "
                     "'tokenizer'); delete it to evaluate the directory as a plain Hugging Face "
                     "checkpoint")
  return _over_defaults(config)


def export_record(source: "CheckpointSource") -> dict[str, Any] | None:
  """What ``python -m stabledrl_jax.export`` writes to EXPORT_FILE for ``source`` (None: it has
  no training config to carry)."""
  if source.config is None:
    return None
  return {"format": EXPORT_FORMAT, "exported_from": source.path, "step": source.step,
          "config": json.loads(source.config.to_json_best_effort())}


def resolve(path: str, step: int | None = None, *, lora_base: str = "") -> CheckpointSource:
  """Which kind of checkpoint ``path`` is, and which step of a workdir to read.

  Args:
    path: a training workdir, a Hugging Face checkpoint directory or a Hub id.
    step: a workdir's checkpoint step (None: the latest).
    lora_base: a PEFT adapter's base in place of its ``base_model_name_or_path`` (a Hub id or a
      directory); only for an adapter.

  Raises:
    FileNotFoundError: ``path`` does not exist.
    ValueError: ``path`` is neither kind, the workdir has no (such) step, ``step`` was given
      for a Hugging Face directory, or ``lora_base`` for what is no adapter.
  """
  source = _resolve(path, step)
  if lora_base and source.kind != PEFT:
    what = ("a training workdir, whose run records its own base" if source.kind == WORKDIR
            else "a Hugging Face checkpoint, with no base")
    raise ValueError(f"--lora_base {lora_base!r} replaces a PEFT adapter's base, and "
                     f"{source.path} is {what}")
  return dataclasses.replace(source, lora_base=lora_base)


def _resolve(path: str, step: int | None) -> CheckpointSource:
  path = hub.local_path(path)  # A Hub id: its snapshot in the Hub cache.
  if not epath.Path(path).exists():
    raise FileNotFoundError(f"checkpoint {path} does not exist")
  path = str(checkpointing.resolve_workdir(path))
  if is_workdir(path):
    config = training_config(path)
    if config is None:
      raise ValueError(f"{path} has checkpoints/ but no training config.json beside it")
    checkpointer = checkpointing.Checkpointer(path, read_only=True)
    steps = checkpointer.all_steps()
    checkpointer.close()
    if not steps:
      start = str(epath.Path(path) / supervised.SFT_DIR)
      hint = (f"; its supervised start is the Hugging Face directory {start}"
              if is_huggingface_dir(start) else "")
      raise ValueError(f"workdir {path} has no finished checkpoint yet{hint}")
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise ValueError(f"workdir {path} has no checkpoint of step {step}; it has {steps}")
    return CheckpointSource(WORKDIR, path, step=step, config=config,
                            config_file=str(epath.Path(path) / "config.json"))
  if is_huggingface_dir(path):
    if step is not None:
      raise ValueError(f"a step ({step}) selects a checkpoint of a training workdir; {path} is a "
                       "Hugging Face checkpoint directory")
    config, config_file = exported_config(path), os.path.join(path, EXPORT_FILE)
    if config is None:  # The supervised start <workdir>/sft_model: the workdir's config.
      config_file = os.path.join(os.path.dirname(path), "config.json")
      config = training_config(config_file)
    return CheckpointSource(HUGGING_FACE, path, config=config,
                            config_file=config_file if config is not None else "")
  if peft_io.is_adapter_dir(path):
    if step is not None:
      raise ValueError(f"a step ({step}) selects a checkpoint of a training workdir; {path} is a "
                       "PEFT adapter directory")
    peft_io.read_config(path)  # Checked now: one line naming the field.
    config = exported_config(path)
    return CheckpointSource(PEFT, path, config=config,
                            config_file=os.path.join(path, EXPORT_FILE) if config else "")
  raise ValueError(
      f"{path} is neither a training workdir (it has no checkpoints/ directory), a Hugging "
      f"Face checkpoint directory ({hf_io.CONFIG_FILE} with {hf_io.SINGLE_FILE} or "
      f"{hf_io.INDEX_FILE}) nor a PEFT adapter ({peft_io.CONFIG_FILE})")


def load_tokenizer(source: CheckpointSource, spec: str = ""):
  """The tokenizer of ``source``, or the one ``spec`` names.

  Args:
    source: a resolved checkpoint.
    spec: '' (the checkpoint's own: a Hugging Face directory's tokenizer.json, else the
      config.tokenizer of its workdir), 'char' (`CharTokenizer` with the default
      alphabet), a tokenizer.json (or a directory holding one; LLaDA's special tokens), or a
      training workdir or its config.json (its config.tokenizer).

  Raises:
    ValueError: no tokenizer is found.
  """
  if spec == "char":
    return tokenizers.CharTokenizer()
  if spec:
    config = training_config(spec)
    if config is not None:
      return data.make_tokenizer(config.tokenizer)
    if os.path.isfile(spec) or os.path.isfile(os.path.join(spec, "tokenizer.json")):
      return _hf_tokenizer(spec, source)
    raise ValueError(f"tokenizer {spec!r} is not 'char', a tokenizer.json (or a directory "
                     "holding one), nor a training workdir or its config.json")
  if source.kind in (HUGGING_FACE, PEFT) and os.path.isfile(
      os.path.join(source.path, "tokenizer.json")):
    return _hf_tokenizer(source.path, source)
  if source.config is not None:
    if source.config.tokenizer.kind != "char" and not os.path.exists(
        source.config.tokenizer.path):
      raise ValueError(f"the workdir's tokenizer {source.config.tokenizer.path!r} does not "
                       "exist here; pass the tokenizer.json explicitly")
    return data.make_tokenizer(source.config.tokenizer)
  raise ValueError(f"{source.path} has no tokenizer.json and is not inside a training workdir; "
                   "name the tokenizer explicitly ('char', a tokenizer.json or a workdir)")


def _hf_tokenizer(path: str, source: CheckpointSource):
  """A tokenizer.json with the conventions (chat template, special tokens) of the checkpoint's
  model family (``Family.tokenizer``): its config.json's, or its workdir's ``model.family``;
  for a bare tokenizer.json, the family of untyped checkpoints (``family.untyped``: LLaDA)."""
  family = family_lib.untyped()
  if source.kind in (HUGGING_FACE, PEFT):
    family = family_lib.of(models.load_config(model_dir(source)))
  elif source.config is not None:
    family = family_lib.get(source.config.model.family)
  return family.tokenizer(path)


def model_dir(source: CheckpointSource) -> str:
  """The Hugging Face directory (or Hub id) of ``source``'s architecture: its own, or a PEFT
  adapter's base."""
  if source.kind == PEFT:
    return peft_io.base_of(source.path, source.lora_base)
  return source.path


def model_has_adapters(source: CheckpointSource) -> bool:
  """Whether ``source``'s model carries LoRA adapters (a LoRA run's workdir, a PEFT adapter)."""
  if source.kind == PEFT:
    return True
  if source.kind != WORKDIR:
    return False
  lora = source.config.model.get("lora")  # A workdir of an older version has none.
  return bool(lora and lora.rank)


def adapter_base(source: CheckpointSource) -> str | None:
  """What a PEFT adapter of ``source`` names as its base (a Hub id or an absolute directory): a
  PEFT source's own base; a workdir's ``model.checkpoint`` (an adapter's base, if it is one) or
  its supervised start ``sft_model``. None: the run began from a fresh initialization."""
  if source.kind == PEFT:
    return model_dir(source)
  if source.kind != WORKDIR:
    return None
  start = source.config.model.checkpoint
  if start:
    start = peft_io.unwrapped(start, lora_base.replaced_base(source.config))
    return start if hub.is_hub_id(start) else os.path.abspath(start)
  sft = os.path.join(source.path, supervised.SFT_DIR)
  return sft if is_huggingface_dir(sft) else None


def _workdir_model_config(config: ml_collections.ConfigDict, dtype: Any) -> Any:
  if config.model.checkpoint:  # The run started from a Hugging Face checkpoint: its shapes.
    start = hub.local_path(peft_io.unwrapped(config.model.checkpoint, lora_base.replaced_base(config)),
                           files=(hf_io.CONFIG_FILE,))
    if not os.path.isfile(os.path.join(start, hf_io.CONFIG_FILE)):
      raise ValueError(f"the workdir's start checkpoint {config.model.checkpoint!r}, whose "
                       f"{hf_io.CONFIG_FILE} gives the architecture, does not exist here")
    return models.load_config(start, dtype=dtype, param_dtype=dtype)
  return dataclasses.replace(specs.model_config(config), dtype=dtype,
                             param_dtype=dtype, remat=False)


def model_config(source: CheckpointSource, *, dtype: Any) -> Any:
  """The model config of ``source`` (its family's, in ``dtype``): no tensor is read."""
  if source.kind in (HUGGING_FACE, PEFT):
    return models.load_config(model_dir(source), dtype=dtype, param_dtype=dtype)
  return _workdir_model_config(source.config, dtype)


def _base_model(source: CheckpointSource, model_config: Any, dtype: Any, mesh) -> Any:
  """The model a LoRA workdir's run began from (``lora_base.source``), in ``dtype``."""
  where = lora_base.source(source.config, source.path)
  if where == "init":
    return models.init_model(model_config, seed=source.config.seed, mesh=mesh)
  return models.from_pretrained(where, dtype=dtype, mesh=mesh,
                                lora_base=lora_base.replaced_base(source.config))


def load_model(source: CheckpointSource, *, mesh: jax.sharding.Mesh, dtype: Any) -> Any:
  """The model of ``source`` (of any registered family) in ``dtype`` (parameters and
  compute), sharded over ``mesh``."""
  if source.kind == HUGGING_FACE:
    return models.from_pretrained(source.path, dtype=dtype, mesh=mesh)
  if source.kind == PEFT:
    return peft_io.from_pretrained(source.path, base=source.lora_base or None, dtype=dtype,
                                   mesh=mesh)
  config = source.config
  model_config = _workdir_model_config(config, dtype)
  abstract = nnx.eval_shape(lambda: build.with_lora(
      config, models.init_model(model_config, seed=0)))
  graphdef, params = nnx.split(abstract, nnx.Param)
  checkpointer = checkpointing.Checkpointer(source.path, read_only=True)
  try:
    stored = checkpointer.stored_fields(source.step).get("params", [])
    base = None
    if model_has_adapters(source) and lora_base.holds_adapters_only(stored, params):
      # The checkpoint holds the adapters; the frozen base is rebuilt where the run began.
      lora_base.check(checkpointer.restore_meta(source.step).get(lora_base.META_KEY),
                      lora_base.identity(config, source.path),
                      f"{source.path}/checkpoints/{source.step}")
      model = build.with_lora(config, _base_model(source, model_config, dtype, mesh), mesh)
      graphdef, full = nnx.split(model, nnx.Param)
      params, base = lora_lib.split(full)
    target = jax.tree.map(lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                   sharding=sharding),
                          params, models.param_shardings(params, mesh))
    params = checkpointer.restore_params(source.step, target)
  finally:
    checkpointer.close()
  if base is not None:
    params = lora_lib.join(params, base)
  bad = checkpointing.nonfinite_leaves(params)
  if bad:
    raise ValueError(f"checkpoint step {source.step} of {source.path} holds non-finite "
                     f"parameters: {', '.join(bad[:5])}" + (", ..." if len(bad) > 5 else ""))
  return nnx.merge(graphdef, params)
