"""What a run needs from a config: the check of every field, and the static specs it builds.

``validate`` runs before anything is compiled and raises a ValueError naming the offending field.
The estimator settings, the likelihood spec and the objective's hyperparameters are derived here
from the config and the registries (``objectives``, ``models.family`` for model families
and, through a family's ``likelihood``, the estimator methods), so that the config files
themselves (``training/config/config_lib.py``) import nothing heavy. ``model_config`` builds the
config of a fresh model from ``config.model``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from typing import Any

import ml_collections
from flax import nnx

from stabledrl_jax import estimators, hub, objectives, tasks
from stabledrl_jax.models import family as family_lib, layers, lora as lora_lib
from stabledrl_jax.training.config import optimizer as optimizer_lib, run_spec
from stabledrl_jax.training.inputs import data

# Every field of config.estimator but these is an estimator setting; left unset (None or ''), it
# takes the objective's official value (``objectives.Objective.estimator``). A plugin method's
# options are fields a config file adds (``c.estimator.my_option = ...``). ``block_length``
# falls back to this.
_NOT_ESTIMATOR_SETTINGS = ("stress",)
_DEFAULT_BLOCK_LENGTH = 32
# The estimator settings that belong to the objective whatever the method (the rest are options
# of the official method's mask sampler).
_OBJECTIVE_ESTIMATOR_FIELDS = ("num_samples", "normalize", "coupled_ratio")


def _finite(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class _Range:
  """The interval a float field must lie in (every float field is also finite: ``_numbers``)."""

  low: float = -math.inf
  high: float = math.inf
  low_open: bool = False
  high_open: bool = False
  note: str = ""

  def check(self, field: str, value: Any) -> None:
    above = value > self.low if self.low_open else value >= self.low
    below = value < self.high if self.high_open else value <= self.high
    if _finite(value) and above and below:
      return
    interval = (("(" if self.low_open else "[") + f"{self.low:g}, {self.high:g}"
                + (")" if self.high_open or self.high == math.inf else "]"))
    note = f" ({self.note})" if self.note else ""
    raise ValueError(f"config.{field}: must be a finite number in {interval}{note}, "
                     f"got {value!r}")


_RATE = _Range(0.0, 1.0, low_open=True, note="a learning rate")
# The range of every float field of ``config_lib.base_config()`` outside the objective sections
# (whose fields the objective's hyperparameter dataclass checks: ``objectives.Objective.
# make_hparams``); tests/test_validation.py holds base_config() to it. None values (an unset
# placeholder) are not checked here.
FLOAT_RANGES: dict[str, _Range] = {
    "rollout.temperature": _Range(0.0, 10.0, note="0: greedy; far above 1 the rollouts are "
                                  "close to uniform noise"),
    "rollout.threshold": _Range(0.0, 1.0, low_open=True, note="a confidence"),
    "optimizer.learning_rate": _RATE,
    "optimizer.b1": _Range(0.0, 1.0, high_open=True, note="Adam's first-moment decay"),
    "optimizer.b2": _Range(0.0, 1.0, high_open=True, note="Adam's second-moment decay"),
    # eps is added to Adam's sqrt(v), which is about the size of a gradient entry: above 1 every
    # update is about lr x g / eps (1e300: 0, with an overflow warning).
    "optimizer.eps": _Range(0.0, 1.0, low_open=True, note="added to Adam's denominator; above "
                            "1 it shrinks every update towards 0"),
    # Decoupled: each update multiplies the weights by 1 - lr x weight_decay.
    "optimizer.weight_decay": _Range(0.0, 1.0, note="decoupled: each update shrinks the weights "
                                     "by learning_rate x weight_decay"),
    "optimizer.grad_clip": _Range(0.0, 1e9, note="0: off"),
    "model.lora.alpha": _Range(0.0, 1e6, low_open=True, note="the adapters' scale is alpha / "
                               "rank"),
    "model.lora.dropout": _Range(0.0, 1.0, high_open=True, note="a probability below 1"),
    "optimizer.end_lr_factor": _Range(0.0, 1.0, note="the final fraction of the learning rate"),
    "sft.learning_rate": _RATE,
    "sft.demo_error_rate": _Range(0.0, 1.0, note="a probability"),
    "estimator.prompt_mask_prob": _Range(0.0, 1.0, note="a probability"),
    "estimator.stress.fraction": _Range(0.0, 1.0, note="0: off"),
    "estimator.stress.easy_rate": _Range(0.0, 1.0, low_open=True),
    "estimator.stress.hard_rate": _Range(0.0, 1.0, low_open=True),
    "checkpoint.every_seconds": _Range(0.0, 1e9, note="0: off; 1e9 s is 30 years"),
    # A timer's wait: at most a day (threading.TIMEOUT_MAX is about 9.2e9 s).
    "train.collapse_guard.lr_factor": _Range(0.0, 1.0, low_open=True),
    "train.collapse_guard.eval_margin": _Range(0.0, 100.0, note="eval points"),
    "train.collapse_guard.reward_margin": _Range(0.0, 1e6),
    "train.stop_grace_s": _Range(0.0, 86400.0, note="0: a SIGTERM waits for the step boundary "
                                 "however long"),
    # A wait longer than threading.TIMEOUT_MAX (about 9.2e9 s) raises OverflowError mid-run.
    "task.reward_timeout_s": _Range(0.0, 86400.0, low_open=True, note="seconds per answer, at "
                                    "most a day"),
    "logging.peak_tflops_per_device": _Range(0.0, 1e6, note="0: the device kind's"),
    "diagnostics.spike_factor": _Range(0.0, 1e6, note="0: record non-finite steps only"),
}
# seed + 1 seeds the evaluation data, and jax.random.key keeps 32 bits of a seed (2**32 would
# silently be seed 0).
_MAX_SEED = 2**32 - 2


@dataclasses.dataclass(frozen=True)
class _IntRange:
  """The interval [low, high] an integer field must lie in (a bool or a float is no integer).

  ``also``: values outside it that mean something (a mesh axis's -1); ``unset_ok``: None is an
  unset placeholder (left to the objective's official value).
  """

  low: int
  high: int
  also: tuple[int, ...] = ()
  unset_ok: bool = False
  note: str = ""

  def check(self, field: str, value: Any) -> None:
    if value is None and self.unset_ok:
      return
    if (isinstance(value, int) and not isinstance(value, bool)
        and (self.low <= value <= self.high or value in self.also)):
      return
    also = "".join(f" or {v}" for v in self.also)
    note = f" ({self.note})" if self.note else ""
    raise ValueError(f"config.{field}: must be an integer in [{self.low}, {self.high}]{also}"
                     f"{note}, got {value!r}")


# Counts of steps, updates or checkpoints: far beyond any run, and within int32 for jit.
_MAX_COUNT = 10**9
# Sizes (rows, tokens, examples, devices): what an int32 index holds.
_MAX_SIZE = 2**31 - 1
# The range of every integer field of ``config_lib.base_config()`` (tests/test_validation.py
# holds base_config() to it). 0 keeps the meaning the code gives it where it has one; the
# relations between fields (steps at most gen_length, ...) are checked by the sections below.
INT_RANGES: dict[str, _IntRange] = {
    "seed": _IntRange(0, _MAX_SEED, note="the PRNG key takes 32 bits"),
    "rollout.num_prompts": _IntRange(1, _MAX_SIZE),
    "rollout.group_size": _IntRange(1, _MAX_SIZE),  # >= 2: _validate_objective says why.
    "rollout.prompt_length": _IntRange(1, _MAX_SIZE, note="tokens"),
    "rollout.gen_length": _IntRange(1, _MAX_SIZE, note="tokens"),
    "rollout.steps": _IntRange(1, _MAX_COUNT, note="at most rollout.gen_length"),
    "rollout.block_length": _IntRange(1, _MAX_SIZE, note="tokens"),
    "rollout.microbatch_groups": _IntRange(0, _MAX_SIZE, note="0: all at once"),
    "model.lora.rank": _IntRange(0, 65536, note="0: every parameter trains"),
    "estimator.num_samples": _IntRange(1, _MAX_SIZE, unset_ok=True),
    "estimator.block_length": _IntRange(1, _MAX_SIZE, unset_ok=True, note="tokens"),
    "optimizer.warmup_steps": _IntRange(0, _MAX_COUNT, note="optimizer updates; 0: none"),
    "train.num_steps": _IntRange(0, _MAX_COUNT),
    "train.num_iterations": _IntRange(1, _MAX_COUNT),
    "train.microbatch_groups": _IntRange(0, _MAX_SIZE, note="0: the whole batch at once"),
    "train.max_consecutive_skips": _IntRange(1, _MAX_COUNT),
    "train.collapse_guard.max_restores": _IntRange(0, _MAX_COUNT),
    "train.collapse_guard.window": _IntRange(1, _MAX_COUNT),
    "train.collapse_guard.max_skipped": _IntRange(1, _MAX_COUNT),
    "eval.every_steps": _IntRange(0, _MAX_COUNT, note="0: never"),
    "eval.batch_size": _IntRange(1, _MAX_SIZE, note="prompts per sampler call"),
    "eval.steps": _IntRange(0, _MAX_COUNT, note="0: gen_length / 2; at most rollout.gen_length"),
    "logging.samples_every_steps": _IntRange(0, _MAX_COUNT, note="0: never"),
    # More than a step's rollouts logs them all (tests/test_logging.py logs a batch so).
    "logging.num_samples": _IntRange(0, _MAX_SIZE),
    "diagnostics.spike_window": _IntRange(1, _MAX_COUNT),
    "diagnostics.spike_min_history": _IntRange(1, _MAX_COUNT,
                                               note="at most diagnostics.spike_window"),
    "checkpoint.every_steps": _IntRange(1, _MAX_COUNT),
    "checkpoint.max_to_keep": _IntRange(1, _MAX_COUNT),
    "mesh.data": _IntRange(1, _MAX_SIZE, also=(-1,), note="-1: the devices the others leave"),
    "mesh.fsdp": _IntRange(1, _MAX_SIZE, also=(-1,), note="-1: the devices the others leave"),
    "mesh.tensor": _IntRange(1, _MAX_SIZE, also=(-1,), note="-1: the devices the others leave"),
    "mesh.dcn_data": _IntRange(0, _MAX_SIZE, note="slices; 0 or 1: one"),
    "data.train_size": _IntRange(0, _MAX_SIZE, note="0: the whole dataset"),
    "data.eval_size": _IntRange(0, _MAX_SIZE, note="0: the whole dataset"),
    # Worker processes on each host: far more than any host's cores.
    "task.reward_workers": _IntRange(0, 4096, note="0: in this process"),
    "sft.num_steps": _IntRange(0, _MAX_COUNT, note="0: no supervised start"),
    "sft.batch_size": _IntRange(1, _MAX_SIZE),
    # The imperfect demonstrator (data.noisy_demonstration) rewrites the first demo_error_cells
    # blank cells of a sudoku: never more than the grid's cells.
    "sft.demo_error_cells": _IntRange(0, tasks.sudoku.NUM_CELLS,
                                      note=f"blank cells rewritten; a {tasks.sudoku.SIZE}x"
                                      f"{tasks.sudoku.SIZE} sudoku has {tasks.sudoku.NUM_CELLS}"),
}
# optax counts optimizer updates (train.num_steps x train.num_iterations) in int32.
_MAX_UPDATES = 2**31 - 1


def _leaves(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
  """(dotted path, value) of every leaf of a ConfigDict (sequences' items as ``path[i]``)."""
  if hasattr(tree, "items") and callable(tree.items):
    out = []
    for key, value in tree.items():
      out.extend(_leaves(value, f"{prefix}{key}" if not prefix else f"{prefix}.{key}"))
    return out
  if isinstance(tree, (list, tuple)):
    return [leaf for i, item in enumerate(tree) for leaf in _leaves(item, f"{prefix}[{i}]")]
  return [(prefix, tree)]


def _numbers(config: ml_collections.ConfigDict) -> None:
  """Every number anywhere in the config is finite, then each float field of ``FLOAT_RANGES``
  and each integer field of ``INT_RANGES`` lies in its range: one NaN optimizer or clip setting
  poisons every update, and one huge count never ends a step."""
  for field, value in _leaves(config):
    if isinstance(value, float) and not math.isfinite(value):
      raise ValueError(f"config.{field}: must be a finite number, got {value!r}")
  for field, bounds in FLOAT_RANGES.items():
    value = _field_value(config, field)
    if value is not None:
      bounds.check(field, value)
  for field, int_bounds in INT_RANGES.items():
    int_bounds.check(field, _field_value(config, field))


def _field_value(config: ml_collections.ConfigDict, field: str) -> Any:
  """The value of the dotted ``field`` (None where it or a section above it is missing)."""
  holder = config
  *sections, name = field.split(".")
  for part in sections:
    holder = holder.get(part) if holder is not None else None
  return holder.get(name) if holder is not None else None


def _importable(module: str) -> bool:
  if module in sys.modules:  # Imported already (or blocked: None).
    return sys.modules[module] is not None
  return importlib.util.find_spec(module) is not None


def _require(condition: bool, field: str, message: str) -> None:
  if not condition:
    raise ValueError(f"config.{field}: {message}")


def objective_params(config: ml_collections.ConfigDict) -> Any:
  """The objective's hyperparameters (its registered dataclass): the official defaults, with
  the fields ``config.objective.<name>`` sets (a section is optional; unset fields are None).

  Raises:
    ValueError naming ``config.objective.<name>.<field>`` for an unknown field or a bad value.
  """
  name = config.objective.name
  objective = objectives.get_objective(name)
  section = config.objective.get(name)
  overrides = section.to_dict() if isinstance(section, ml_collections.ConfigDict) else {}
  try:
    return objective.make_hparams(overrides)
  except ValueError as error:
    raise ValueError(f"config.objective.{name}.{error}") from None


def token_level(config: ml_collections.ConfigDict) -> bool:
  """Whether the objective takes per-token log-probs [N, T] (d1's token-level GRPO)."""
  return objectives.get_objective(config.objective.name).token_level(objective_params(config))


def estimator_settings(config: ml_collections.ConfigDict, hparams: Any = None) -> dict[str, Any]:
  """The estimator fields, each unset one (None or '') filled in from the objective's official
  settings (``objectives.Objective.estimator``), then from the estimator's own defaults.

  ``hparams``: the objective's hyperparameters when already resolved (``objective_params``).
  """
  objective = objectives.get_objective(config.objective.name)
  settings = {"normalize": "mean", "block_length": _DEFAULT_BLOCK_LENGTH,
              "coupled_ratio": False, "num_samples": 1}
  official = objective.estimator(objective_params(config) if hparams is None else hparams)
  if config.estimator.method and config.estimator.method != official["method"]:
    # Another method than the official one: its options keep their own defaults.
    official = {k: v for k, v in official.items() if k in _OBJECTIVE_ESTIMATOR_FIELDS}
  settings.update(official)
  for field in _estimator_fields(config):
    value = config.estimator.get(field)
    if value is not None and value != "":
      settings[field] = value
  return settings


def _estimator_fields(config: ml_collections.ConfigDict) -> list[str]:
  return [field for field in config.estimator if field not in _NOT_ESTIMATOR_SETTINGS]


def estimator_method(config: ml_collections.ConfigDict) -> str:
  return estimator_settings(config)["method"]


def uses_reference(config: ml_collections.ConfigDict) -> bool:
  """Whether the objective, with these hyperparameters, needs a frozen reference policy."""
  return objectives.get_objective(config.objective.name).uses_reference(objective_params(config))


def advantage_baseline(config: ml_collections.ConfigDict) -> str:
  return (config.objective.advantage_baseline
          or objectives.get_objective(config.objective.name).baseline)


def run_options(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Model config fields beyond dtypes and remat that the run sets: ``scan_layers`` and
  ``attention`` (where set; '' keeps the model config's default, ``layers.DEFAULT_ATTENTION``)."""
  options = {"scan_layers": True} if config.model.get("scan_layers", False) else {}
  if config.model.get("attention", ""):
    options["attention"] = config.model.attention
  return options


def model_config(config: ml_collections.ConfigDict, tokenizer=None) -> Any:
  """The config of a fresh model: ``model.name`` of ``model.family`` with its overrides.

  ``model.overrides`` may name the shapes every family has in another family's spelling
  (``Family.aliases``: ``configs/quickstart.py``'s LLaDA-style ``d_model``, ``n_heads``, ...
  size an SDAR model too); a field the family does not have is a config error naming it.
  A character tokenizer sets the vocabulary and the mask and EOS ids (``tokenizer``, or built
  from ``config.tokenizer``: it needs no file); a Hugging Face tokenizer comes with a checkpoint,
  whose config.json holds them.
  """
  family = family_lib.get(config.model.family)
  overrides = family_lib.resolve_overrides(family, dict(config.model.overrides))
  overrides.update(dtype=config.model.dtype, param_dtype=config.model.param_dtype,
                   remat=config.model.remat, **run_options(config))
  if config.tokenizer.kind == "char":
    tokenizer = tokenizer or data.make_tokenizer(config.tokenizer)
    overrides.update({field: tokenizer.vocab_size for field in family.vocab_fields})
    overrides.update(mask_token_id=tokenizer.mask_id, eos_token_id=tokenizer.eos_id)
  return family.get_config(config.model.name, **overrides)


# How a LoRA run's frozen base is stored (model.lora.base_dtype).
LORA_BASE_DTYPES = lora_lib.BASE_DTYPES
# Where LoRA dropout applies (model.lora.dropout_passes): the update's pass, or every pass of
# the current policy (the rollouts' sampler, l_old, the update).
LORA_DROPOUT_PASSES = ("update", "every")


def _validate_model(config: ml_collections.ConfigDict) -> tuple[family_lib.Family, Any]:
  """model.family, model.name and model.overrides; returns the family and the named model's
  config (None for a checkpoint, whose config is known once it is loaded)."""
  family = family_lib.get(config.model.family)
  family_lib.resolve_overrides(family, dict(config.model.overrides))
  attention = config.model.get("attention", "")
  _require(attention in ("",) + layers.ATTENTION_IMPLS, "model.attention",
           f"{attention!r} is not one of {', '.join(layers.ATTENTION_IMPLS)} ('' = auto)")
  lora = config.model.lora
  _require(lora.base_dtype in LORA_BASE_DTYPES, "model.lora.base_dtype",
           f"{lora.base_dtype!r} is not one of {LORA_BASE_DTYPES}")
  _require(lora.get("dropout_passes", "update") in LORA_DROPOUT_PASSES, "model.lora.dropout_passes",
           f"{lora.get('dropout_passes')!r} is not one of {LORA_DROPOUT_PASSES}")
  _require(not lora.get("base") or config.model.checkpoint, "model.lora.base",
           f"{lora.get('base')!r} replaces the base of a PEFT adapter in model.checkpoint, which "
           "is empty")
  if config.model.checkpoint:  # Its targets are checked when it is loaded.
    return family, None
  _require(config.model.name in family.config_names, "model.name",
           f"{config.model.name!r} is not a {family.name} config; choose from "
           f"{family.config_names} (or set model.family)")
  try:
    named = model_config(config)
  except ValueError as err:
    raise ValueError(f"config.model.overrides: {err}") from None
  spec = lora_lib.spec_of(lora)
  if spec is not None:  # Every target names a projection of the family (abstractly: no arrays).
    lora_lib.targeted(nnx.eval_shape(lambda: family.model_cls(named, rngs=nnx.Rngs(0))), spec)
  return family, named


def validate(config: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
  """Raises ValueError naming the first bad field. Cheap: nothing is built or compiled.

  ``num_devices``: also check that the batches split over the mesh of that many devices.
  """
  _numbers(config)
  name = config.objective.name
  _require(name in objectives.objective_names(), "objective.name",
           f"{name!r} is not one of {objectives.objective_names()}")
  if config.tokenizer.kind == "char":  # Before the model, whose vocabulary is the alphabet's.
    try:
      data.make_tokenizer(config.tokenizer)
    except ValueError as err:
      raise ValueError(f"config.tokenizer.alphabet: {err}") from None
  family, named = _validate_model(config)
  _validate_rollout(config, family, named)
  _validate_objective(config, family)
  _validate_schedule(config)
  _validate_data(config)
  _validate_logging(config)
  _validate_collapse_guard(config)
  _validate_task_data(config)
  if num_devices is not None:
    _validate_mesh(config, num_devices)


def _validate_rollout(config: ml_collections.ConfigDict, family: family_lib.Family,
                      named: Any) -> None:
  """The rollout shapes, the layout ``named`` (the model config, unless a checkpoint gives it
  later) decodes, and the family's remasking rules and caches."""
  r = config.rollout  # Each size a positive integer: INT_RANGES.
  if named is not None:  # A checkpoint's layout is checked when it is loaded.
    family.check_rollout(r, named)  # Its steps bound among its rules.
  else:  # Every family's steps count denoising steps over the whole completion.
    _require(r.steps <= r.gen_length, "rollout.steps",
             f"{r.steps} exceeds rollout.gen_length={r.gen_length}: at most one denoising step "
             "per completion token (every step reveals at least one)")
  _require(r.remasking in family.remasking, "rollout.remasking",
           f"{r.remasking!r} is not one of {family.remasking} (model.family={family.name!r})")
  _require(r.get("cache", "none") in family.caches, "rollout.cache",
           f"{r.get('cache')!r} is not one of {family.caches} (model.family={family.name!r})")
  # The family's own options: each set one is declared by the family, in its range (a bound
  # the model sets, top_k's vocabulary, where the model config is known).
  for section in ("rollout", "eval"):
    family_lib.check_options(family, run_spec.set_options(config[section].get("family_options")),
                             f"{section}.family_options", named)
  if named is not None:  # The family's sampler takes the rollout's decoding, its options too.
    check_rollout_decoding(config, named)
  _validate_eval_steps(config, named)


def check_rollout_decoding(config: ml_collections.ConfigDict, model_config: Any) -> None:
  """Raises ValueError naming the ``config.rollout`` field (or family option) whose decoding
  the sampler of ``model_config``'s family does not take."""
  r = config.rollout
  try:
    run_spec.Decoding.of_rollout(r, temperature=r.temperature, steps=r.steps).check(model_config)
  except ValueError as err:
    where = "config." if str(err).startswith("rollout.") else "config.rollout: "
    raise ValueError(f"{where}{err}") from None


def validate_model(config: ml_collections.ConfigDict, model_config: Any, where: str) -> None:
  """The checks that need the model's config, for a checkpoint's (``where``: its path), known
  from its config.json before any weight is read: its family is ``model.family``, its sampler
  decodes the rollout layout and takes the rollout's and the evaluation's decoding with their
  family options (top_k within its vocabulary).

  Raises:
    ValueError: naming the config field.
  """
  family = family_lib.of(model_config)
  _require(family.name == config.model.family, "model.family",
           f"{config.model.family!r}, but {where} holds a {family.name} model")
  family.check_rollout(config.rollout, model_config)
  for section in ("rollout", "eval"):
    family_lib.check_options(family, run_spec.set_options(config[section].get("family_options")),
                             f"{section}.family_options", model_config)
  check_rollout_decoding(config, model_config)
  _validate_eval_steps(config, model_config)


def _validate_eval_steps(config: ml_collections.ConfigDict, named: Any) -> None:
  """eval.steps (0: ``run_spec.default_steps``) counts denoising steps over the completion, as
  rollout.steps does; where the model config is known (``named``) and the run evaluates, its
  family's sampler takes the evaluation's decoding (LLaDA: a multiple of the blocks)."""
  steps, gen_length = config.eval.steps, config.rollout.gen_length
  _require(steps <= gen_length, "eval.steps",
           f"{steps} exceeds rollout.gen_length={gen_length}: at most one denoising step per "
           "completion token (0: gen_length / 2)")
  if named is None or not config.eval.every_steps:
    return
  settings = run_spec.Decoding.of_eval(config)
  try:
    settings.check(named)
  except ValueError as err:
    if str(err).startswith("rollout.family_options."):  # The rollout's passed: eval's own.
      raise ValueError(f"config.eval.{str(err)[len('rollout.'):]}") from None
    raise ValueError(f"config.eval.steps: the evaluation's decoding at {settings.steps} steps "
                     f"(0: gen_length / 2): {err}") from None


def _validate_objective(config: ml_collections.ConfigDict, family: family_lib.Family) -> None:
  """The objective's hyperparameters, its estimator, the stress test and the advantages."""
  r = config.rollout
  objective_params(config)  # Its own checks, naming the field.
  _validate_estimator(config, family)
  stress = config.estimator.stress
  _require(stress.easy_rate <= stress.hard_rate, "estimator.stress.easy_rate",
           f"the easy masks must not mask more than the hard ones, got easy_rate="
           f"{stress.easy_rate} > hard_rate={stress.hard_rate}")
  _require(advantage_baseline(config) in objectives.ADVANTAGE_BASELINES,
           "objective.advantage_baseline",
           f"{config.objective.advantage_baseline!r} is not '' or one of "
           f"{objectives.ADVANTAGE_BASELINES}")
  _require(r.group_size >= 2, "rollout.group_size",
           f"{r.group_size}: the advantages are relative to the group, so a group of one "
           "gives every completion advantage 0 and nothing is learned; use at least 2")


def _validate_schedule(config: ml_collections.ConfigDict) -> None:
  """The optimizer, the training loop, checkpoints, rewards and evaluation."""
  r, name = config.rollout, config.objective.name
  o = config.optimizer  # The counts' ranges: INT_RANGES.
  _require(o.schedule in ("linear", "constant"), "optimizer.schedule",
           f"{o.schedule!r} is not 'linear' or 'constant'")
  t = config.train
  _require(t.num_steps * t.num_iterations <= _MAX_UPDATES, "train.num_steps",
           f"{t.num_steps} RL steps x train.num_iterations={t.num_iterations} = "
           f"{t.num_steps * t.num_iterations} optimizer updates, more than optax counts "
           f"(int32: at most {_MAX_UPDATES})")
  _require(not t.gradient_bound or objectives.get_objective(name).surrogate is not None,
           "train.gradient_bound",
           f"the convex-hull bound needs a registered surrogate; {name!r} has none")
  if t.microbatch_groups:
    _require(r.num_prompts % t.microbatch_groups == 0, "train.microbatch_groups",
             f"{t.microbatch_groups} does not divide rollout.num_prompts={r.num_prompts}")


def _validate_data(config: ml_collections.ConfigDict) -> None:
  """Dataset sizes, the supervised start, the task's reward and prompts, the model source."""
  r = config.rollout
  for split in ("train", "eval"):  # Sizes in INT_RANGES.
    size = config.data[f"{split}_size"]
    _require(size > 0 or config.data[split] != "synthetic", f"data.{split}_size",
             "0 means the whole dataset, but a synthetic generator has none: give a size")
  _require(config.data.train_size == 0 or config.data.train_size >= r.num_prompts,
           "data.train_size", f"{config.data.train_size} examples cannot fill one batch of "
           f"rollout.num_prompts={r.num_prompts}")
  _require(config.task.reward in tasks.REWARD_SCHEMES, "task.reward",
           f"{config.task.reward!r} is not one of {tasks.REWARD_SCHEMES}")
  style = config.task.get("prompt_style", tasks.DEFAULT_PROMPT_STYLE)
  _require(style in tasks.PROMPT_STYLES, "task.prompt_style",
           f"{style!r} is not one of {tasks.PROMPT_STYLES}")
  try:
    official = tasks.get_task(config.task.name).stabledrl_prompt is not None
  except KeyError:  # task.name's own check below names it.
    official = True
  _require(style != "stabledrl" or not config.task.with_instruction or official,
           "task.prompt_style",
           f"task {config.task.name!r} has no official StableDRL prompt; use 'd1'")
  _require(config.model.get("download", "each_host") in hub.DOWNLOAD_MODES, "model.download",
           f"{config.model.get('download')!r} is not one of {hub.DOWNLOAD_MODES}")
  for field, value in (("model.checkpoint", config.model.checkpoint),
                       ("tokenizer.path", config.tokenizer.path)):
    _require(not str(value).startswith("/path/to"), field,
             f"{value!r} is a placeholder: pass a Hub id (e.g. --config.{field}=GSAI-ML/LLaDA-8B-"
             "Instruct) or a local directory")


def check_chunks(rollout: Any, ways: int) -> None:
  """Raises ValueError (one line naming the field) unless ``rollout.microbatch_groups`` (groups
  of ``group_size`` rows per sampler call; 0: the whole batch at once) divides
  ``rollout.num_prompts`` and gives each of the ``ways`` = data x fsdp devices the same number of
  rows, at least one, per call."""
  groups = rollout.get("microbatch_groups", 0)
  if not isinstance(groups, int) or isinstance(groups, bool) or groups < 0:
    raise ValueError(f"rollout.microbatch_groups must be an integer >= 0, got {groups!r}")
  if groups and rollout.num_prompts % groups:
    raise ValueError(f"rollout.microbatch_groups={groups} does not divide rollout.num_prompts="
                     f"{rollout.num_prompts}")
  if groups and (groups * rollout.group_size) % ways:
    raise ValueError(f"rollout.microbatch_groups={groups} gives {groups * rollout.group_size} "
                     f"rows per sampler call, not a multiple of the {ways} data x fsdp devices")


def chunk_rows_of(rollout: Any) -> int:
  """Rows per sampler call of a rollout batch (``rollout.microbatch_groups`` x group_size; 0:
  all at once)."""
  return rollout.get("microbatch_groups", 0) * rollout.group_size


def _validate_collapse_guard(config: ml_collections.ConfigDict) -> None:
  """train.collapse_guard's values; its restore needs evaluations (the best checkpoint by
  eval)."""
  guard = run_spec.GuardSettings.of(config.train.get("collapse_guard"))
  if guard.enabled and guard.action == "restore":
    _require(config.eval.every_steps > 0, "train.collapse_guard.action",
             "'restore' restores the best checkpoint by eval: it needs eval.every_steps > 0 "
             "(or action='stop')")


def _validate_logging(config: ml_collections.ConfigDict) -> None:
  """Logging, diagnostics and the tokenizer's kind."""
  lg = config.logging  # Its counts' ranges: INT_RANGES.
  _require(not lg.wandb.project or _importable("wandb"),
           "logging.wandb.project", f"{lg.wandb.project!r} is set, but the `wandb` package is "
           "not installed: pip install wandb (or unset the project)")
  dg = config.diagnostics
  _require(dg.spike_min_history <= dg.spike_window, "diagnostics.spike_min_history",
           f"{dg.spike_min_history} exceeds diagnostics.spike_window={dg.spike_window}: the "
           "window never holds that many steps, so no spike would ever be recorded")
  kinds = ("char",) + family_lib.names()
  _require(config.tokenizer.kind in kinds, "tokenizer.kind",
           f"{config.tokenizer.kind!r} is not one of {kinds} ('char' or a model family)")


def _validate_mesh(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """The mesh of ``num_devices`` devices, and batches that split over its data x fsdp axes."""
  r, t = config.rollout, config.train
  from stabledrl_jax.training.parallel import mesh as mesh_lib  # Needs no devices, only counts.
  try:
    sizes = dict(zip(mesh_lib.MESH_AXES, mesh_lib.mesh_shape(config.mesh, num_devices)))
  except ValueError as err:
    raise ValueError(str(err)) from None
  ways = sizes["data"] * sizes["fsdp"]
  check_chunks(r, ways)  # rollout.microbatch_groups: the sampler's calls split too.
  _require(sizes["data"] % int(config.mesh.get("dcn_data", 1) or 1) == 0, "mesh.dcn_data",
           f"{config.mesh.dcn_data} does not divide the data axis ({sizes['data']})")
  per_microbatch = r.num_prompts // num_microbatches(config)
  if per_microbatch * r.group_size % ways:
    fits = microbatch_groups_for(config, ways)
    advice = (f"on this mesh set train.microbatch_groups to one of {fits} (e.g. "
              f"--config.train.microbatch_groups={fits[0]})" if fits else
              f"no microbatch fits: make rollout.num_prompts x rollout.group_size a multiple "
              f"of {ways}")
    _require(False, "train.microbatch_groups" if t.microbatch_groups else "rollout.num_prompts",
             f"a microbatch of {per_microbatch} prompts x {r.group_size} completions does not "
             f"split over data x fsdp = {ways} devices; {advice}")
  if config.sft.num_steps and not config.model.checkpoint:
    _require(config.sft.batch_size % ways == 0, "sft.batch_size",
             f"{config.sft.batch_size} does not split over data x fsdp = {ways} devices")


def _validate_task_data(config: ml_collections.ConfigDict) -> None:
  """task.name is registered, and a character tokenizer's alphabet spells the answers of the
  synthetic examples (``data.make_examples`` checks them; a dataset's are checked when it is
  loaded)."""
  try:
    tasks.get_task(config.task.name)
  except KeyError:
    raise ValueError(f"config.task.name: {config.task.name!r} is not a registered task; choose "
                     f"from {tasks.list_tasks()}") from None
  for split in ("train", "eval"):
    if config.data[split] != "synthetic":  # Loading a dataset is not cheap.
      continue
    try:
      data.make_examples(config, split)  # Lazy: only the examples the alphabet check reads.
    except TypeError as err:  # An option the task's generator does not take.
      raise ValueError(f"config.data.generator: {err}") from None
  # The supervised start's imperfect demonstrator (data.noisy_demonstration) is the task's:
  # without one, its first step would fail, after the workdir was made.
  sft = config.sft
  if sft.num_steps and not config.model.checkpoint and sft.demo_error_rate > 0:
    task = tasks.get_task(config.task.name)
    _require(task.demonstrate is not None, "sft.demo_error_rate",
             f"{sft.demo_error_rate:g} > 0 needs a task with an imperfect demonstrator "
             f"(Task.demonstrate), and {task.name!r} has none: set it to 0")


def _validate_estimator(config: ml_collections.ConfigDict, family: family_lib.Family) -> None:
  settings = estimator_settings(config)
  likelihood = family.likelihood
  method, methods = settings["method"], likelihood.methods()
  _require(method in methods, "estimator.method",
           f"{method!r} is not one of {methods} (model.family={family.name!r})")
  if token_level(config):
    _require(method == "mean_field", "estimator.method",
             "token-level GRPO scores every completion token, so it needs 'mean_field'")
  _require(settings["normalize"] in ("sum", "mean"), "estimator.normalize",
           f"{settings['normalize']!r} is not '', 'sum' or 'mean'")
  _require(isinstance(settings["num_samples"], int) and settings["num_samples"] >= 1,
           "estimator.num_samples", f"must be an integer >= 1, got {settings['num_samples']!r}")
  _require(0 <= settings.get("prompt_mask_prob", 0.0) <= 1, "estimator.prompt_mask_prob",
           "must lie in [0, 1]")
  _require(settings["block_length"] >= 1, "estimator.block_length", "must be >= 1")
  # A set option that the method does not take would be silently ignored.
  taken = likelihood.options(method)
  for field in _estimator_fields(config):
    value = config.estimator.get(field)
    if field in _OBJECTIVE_ESTIMATOR_FIELDS or field == "method":
      continue
    meaning = likelihood.meaning(method)
    _require(value is None or value == "" or field in taken, f"estimator.{field}",
             f"the {method!r} estimator of a {family.name} model"
             + (f" ({meaning})" if meaning else "")
             + f" takes no {field!r} (it takes {taken or 'none'}); unset it")


def estimator_note(config: ml_collections.ConfigDict) -> str:
  """A line saying what ``estimator.method`` is for the configured model family when it is not
  what its name says (a block model's names all mean its block ELBO or mean field), else ''."""
  family = family_lib.get(config.model.family)
  method = estimator_settings(config)["method"]
  meaning = family.likelihood.meaning(method)
  return (f"note: estimator.method={method!r} on a {family.name} model is {meaning}"
          if meaning else "")


def microbatch_groups_for(config: ml_collections.ConfigDict, ways: int) -> list[int]:
  """The ``train.microbatch_groups`` whose microbatches split over ``ways`` = data x fsdp
  devices (each device needs whole rows)."""
  r = config.rollout
  return [g for g in range(1, r.num_prompts + 1)
          if r.num_prompts % g == 0 and g * r.group_size % ways == 0]


def num_microbatches(config: ml_collections.ConfigDict) -> int:
  groups = config.train.microbatch_groups or config.rollout.num_prompts
  return config.rollout.num_prompts // groups


def likelihood_spec(config: ml_collections.ConfigDict, model_config: Any, hparams: Any = None,
                    settings: dict[str, Any] | None = None) -> estimators.LikelihoodSpec:
  """The static estimator settings of the configured objective for a model of ``model_config``
  (its family estimates the likelihoods: see ``rl_loss``); ``hparams`` and ``settings`` when
  already resolved (``objective_params``, ``estimator_settings``)."""
  name = config.objective.name
  params = objective_params(config) if hparams is None else hparams
  settings = estimator_settings(config, params) if settings is None else settings
  method, e = settings["method"], config.estimator
  family = family_lib.of(model_config)
  options = {k: settings[k] for k in family.likelihood.options(method) if k in settings}
  if "coupled" in options:
    options["coupled"] = bool(options["coupled"])
  stress_rates = None
  if e.stress.fraction > 0:
    stress_rates = (float(e.stress.easy_rate), float(e.stress.hard_rate))
  objective = objectives.get_objective(name)
  block_size = family.block_size(model_config)
  return estimators.LikelihoodSpec(
      method=method, num_samples=settings["num_samples"], normalize=settings["normalize"],
      token_level=objective.token_level(params), eubo_beta=objective.eubo_beta(params),
      mask_id=model_config.mask_token_id, options=tuple(sorted(options.items())),
      stress_rates=stress_rates, family=family.name, block_size=block_size,
      # Completions fill the last gen_length positions of every rollout row.
      scored_suffix=config.rollout.gen_length if block_size is None else None)


def resolve_run(config: ml_collections.ConfigDict, model_config: Any) -> run_spec.RunSpec:
  """The run spec of a (validated) ``config`` for a model of ``model_config``: everything the
  update and the scoring take from the config, derived once."""
  objective, hparams = objectives.get_objective(config.objective.name), objective_params(config)
  settings = estimator_settings(config, hparams)
  return run_spec.RunSpec(
      objective=config.objective.name, hparams=hparams,
      likelihood=likelihood_spec(config, model_config, hparams, settings),
      group_size=config.rollout.group_size, gen_length=config.rollout.gen_length,
      num_microbatches=num_microbatches(config),
      coupled_ratio=bool(settings["coupled_ratio"]),
      uses_reference=objective.uses_reference(hparams), baseline=advantage_baseline(config),
      scale_advantages_by_std=bool(config.objective.scale_advantages_by_std),
      gradient_bound=bool(config.train.gradient_bound), lora=bool(config.model.lora.rank),
      lora_dropout=float(config.model.lora.dropout) if config.model.lora.rank else 0.0,
      lora_dropout_every_pass=bool(config.model.lora.rank and config.model.lora.dropout
                                   and config.model.lora.get("dropout_passes") == "every"))


def resolve_rollout(config: ml_collections.ConfigDict) -> run_spec.RolloutSpec:
  """The rollout spec of a (validated) ``config``: everything the rollouts, the prompts and the
  held-out evaluation take from it, derived once."""
  r = config.rollout
  return run_spec.RolloutSpec(
      num_prompts=r.num_prompts, group_size=r.group_size, prompt_length=r.prompt_length,
      with_instruction=bool(config.task.with_instruction), prompt_style=config.task.prompt_style,
      sampling=run_spec.Decoding.of_rollout(r, temperature=r.temperature, steps=r.steps),
      evaluation=run_spec.Decoding.of_eval(config),
      chunk_rows=chunk_rows_of(r), stress_fraction=float(config.estimator.stress.fraction))


def resolve_loop(config: ml_collections.ConfigDict) -> run_spec.LoopSpec:
  """The loop spec of a (validated) ``config``: its counts and cadences."""
  t, lg, dg = config.train, config.logging, config.diagnostics
  return run_spec.LoopSpec(
      num_steps=t.num_steps, num_iterations=t.num_iterations, seed=config.seed,
      eval_every_steps=config.eval.every_steps, eval_batch_size=config.eval.batch_size,
      checkpoint_every_steps=config.checkpoint.every_steps,
      checkpoint_every_seconds=float(config.checkpoint.every_seconds),
      max_to_keep=config.checkpoint.max_to_keep,
      samples_every_steps=lg.samples_every_steps, num_samples=lg.num_samples,
      max_consecutive_skips=t.max_consecutive_skips,
      kl_to_start=bool(dg.get("kl_to_start", False)), stop_grace_s=float(t.stop_grace_s),
      spike_factor=float(dg.spike_factor), spike_window=dg.spike_window,
      spike_min_history=dg.spike_min_history,
      peak_tflops_per_device=float(lg.peak_tflops_per_device))


def resolve_data(config: ml_collections.ConfigDict) -> run_spec.DataSpec:
  """The data spec of a (validated) ``config``: the task and its reward."""
  t = config.task
  return run_spec.DataSpec(task=t.name, reward=t.reward, reward_workers=t.reward_workers,
                           reward_timeout_s=float(t.reward_timeout_s))


def resolve(config: ml_collections.ConfigDict, num_devices: int | None = None, *,
            model: Any = None, check: bool = True) -> run_spec.Resolved:
  """``config`` resolved once: every check (``validate``: over a mesh of ``num_devices`` where
  given), then the record the run is built from. After it nothing reads the config's values
  (``Resolved.with_model`` and ``with_lr_scale`` derive the records of a loaded model and of the
  collapse guard's restores).

  Args:
    config: the experiment config.
    num_devices: the devices the mesh spans (None: no mesh checks, no ``mesh_shape``).
    model: the model's config where it is known otherwise (a loaded checkpoint's); default
      ``model_config(config)``.
    check: False where the caller validated this config already.

  Raises:
    ValueError: naming the first bad field.
  """
  if check:
    validate(config, num_devices)
  from stabledrl_jax.training.parallel import mesh as mesh_lib  # Needs no devices, only counts.
  model = model_config(config) if model is None else model
  num_updates = config.train.num_steps * config.train.num_iterations
  shape = (None if num_devices is None else
           tuple(zip(mesh_lib.MESH_AXES, mesh_lib.mesh_shape(config.mesh, num_devices))))
  return run_spec.Resolved(
      model=model, run=resolve_run(config, model), rollout=resolve_rollout(config),
      loop=resolve_loop(config), data=resolve_data(config),
      guard=run_spec.GuardSettings.of(config.train.get("collapse_guard")),
      family=config.model.family,
      optimizer=optimizer_lib.OptimizerSpec.of(config.optimizer, num_updates),
      mesh_shape=shape)
