"""Model families: one record per family, and the registry everything else consults.

A family (LLaDA, SDAR) is one folder under ``models/`` whose ``__init__.py`` registers a
:class:`Family`. The record owns everything that differs between families: the config class and
its named configs, the NNX module, the Hugging Face checkpoint layout (:class:`Checkpoint`), the
tokenizer conventions, the sampler, the likelihood function and estimators, and the rollout layout
check. The trainer, the estimators (``training/step/rl_loss.py``), the evaluation harness,
checkpoint IO (``hf_io``) and the memory plan look a family up here (``get(name)`` by
``config.model.family``, ``of(config_or_model)``, ``by_model_type(config.json's model_type)``)
and never ask which family they run.

Adding a family: a folder ``models/<name>/`` with its config, module and checkpoint names, whose
``__init__.py`` calls ``register(Family(...))``, and one import in ``models/__init__.py``
(docs/models.md, "Adding a model family").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

Array = Any

# (HF tensor name, state path in the NNX module, transposed?) of every parameter.
ParamNames = list[tuple[str, tuple[Any, ...], bool]]


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """How a family maps onto a Hugging Face checkpoint directory (``hf_io``).

  Attributes:
    model_type: config.json's ``model_type`` of the family.
    config_from_hf: (config.json dict, **config field overrides) -> config.
    config_to_hf: config -> config.json dict.
    param_names: (config, config.json dict) -> :data:`ParamNames`, in the official modeling
      code's names and layouts.
    ignored: config.json dict -> stored tensors that are not read (e.g. a tied head).
    untyped: a config.json without ``model_type`` is this family's (LLaDA's releases have
      none); at most one registered family says so. Its tokenizer conventions are also those of
      a bare tokenizer.json.
  """

  model_type: str
  config_from_hf: Callable[..., Any]
  config_to_hf: Callable[[Any], dict[str, Any]]
  param_names: Callable[[Any, dict[str, Any]], ParamNames]
  ignored: Callable[[dict[str, Any]], set[str]] = lambda hf: set()
  untyped: bool = False


@dataclasses.dataclass(frozen=True)
class Shapes:
  """What the FLOP counter (``models/llada/flops.py``'s formulas) and the planner read of a
  model, in one spelling for every family: width D, layers, query and key/value heads, head
  width, SwiGLU width F, logit width V; ``remat`` recomputes the blocks in the backward pass."""

  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  mlp_hidden_size: int
  embedding_size: int
  remat: bool = False


def hf_shapes(config: Any) -> Shapes:
  """``Family.shapes`` for a config with the Hugging Face (Qwen2, Qwen3) field names:
  hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
  intermediate_size, vocab_size (and ``remat``)."""
  return Shapes(
      d_model=config.hidden_size, n_layers=config.num_hidden_layers,
      n_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads,
      head_dim=config.head_dim, mlp_hidden_size=config.intermediate_size,
      embedding_size=config.vocab_size, remat=config.remat)


@dataclasses.dataclass(frozen=True)
class Option:
  """One option of a family's own sampler (``rollout.family_options.<name>``, and the
  evaluation's ``eval.family_options.<name>``): its type, its default and the values it takes,
  declared once (``Family.options``) and checked by ``check_option``.

  ``config_lib.base_config`` lists every registered family's options, each an unset (None)
  field of ``kind``, so that ``--config.rollout.family_options.<name>=value`` works; a value
  left None takes ``default``.

  Attributes:
    kind: ``int`` or ``float`` (an int is a float too; a bool is neither).
    default: the sampler's value where none is set (None: off).
    low, high: the closed (or, with ``low_open`` / ``high_open``, open) interval it lies in.
    high_of: model config -> a tighter upper bound known once the model is (the vocabulary
      size), or None.
    high_name: what ``high_of`` measures, in words.
    note: what the option means, for the error.
  """

  kind: type
  default: Any = None
  low: float = -math.inf
  high: float = math.inf
  low_open: bool = False
  high_open: bool = False
  high_of: Callable[[Any], int | None] | None = None
  high_name: str = ""
  note: str = ""

  def interval(self, model_config: Any = None) -> tuple[float, str, str]:
    """The upper bound for ``model_config`` (None: the static one), the interval in words, and
    where a model sets the bound, what it is ('' otherwise)."""
    high, what = self.high, ""
    if self.high_of is not None and model_config is not None:
      bound = self.high_of(model_config)
      if bound is not None and bound < high:
        high, what = bound, f"{bound}: {self.high_name}" if self.high_name else ""
    text = ("(" if self.low_open else "[") + f"{self.low:g}, {high:g}" + (
        ")" if self.high_open or high == math.inf else "]")
    return high, text, what


def check_option(field: str, option: Option, value: Any, model_config: Any = None) -> None:
  """Raises ValueError ``<field>: must be ...`` (one line) unless ``value`` is None (unset) or
  lies in ``option``'s interval (for ``model_config`` where given)."""
  if value is None:
    return
  number = isinstance(value, (int, float)) and not isinstance(value, bool)
  if option.kind is int:
    number = number and isinstance(value, int)
  high, interval, what = option.interval(model_config)
  if number and math.isfinite(value):
    above = value > option.low if option.low_open else value >= option.low
    below = value < high if option.high_open else value <= high
    if above and below:
      return
  kind = "an integer" if option.kind is int else "a finite number"
  notes = "; ".join(n for n in (option.note, what) if n)
  raise ValueError(f"{field}: must be {kind} in {interval}" + (f" ({notes})" if notes else "")
                   + f", got {value!r}")


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family.

  Attributes:
    name: ``config.model.family`` (and ``config.tokenizer.kind`` of its tokenizer).
    config_cls: its config dataclass.
    model_cls: its NNX module, built as ``model_cls(config, rngs=...)``.
    config_names: the named configs ``model.name`` may take.
    get_config: (name, **overrides) -> config.
    checkpoint: its Hugging Face checkpoint layout.
    tokenizer: tokenizer.json path -> a ``tokenizers.HFTokenizer`` with the family's chat
      template and special tokens.
    likelihood: how its likelihoods are estimated (``estimators.Likelihood``).
    likelihood_fn: (model, attention_mask [B, L]) -> the model as ``likelihood.estimate``
      takes it.
    sampling: (decoding, config) -> the family's own sampler settings record, from the common
      options (``training/run_spec.Decoding``: gen_length, steps over the completion,
      block_length, temperature, remasking, threshold, cfg_scale, stop_at_eos, cache); raises
      ValueError naming an option its sampler does not take.
    generate: (model, prompt_tokens [B, P], prompt_mask [B, P], key, settings) -> (tokens
      [B, P + G], model calls [B] int32), ``settings`` the record ``sampling`` returns.
    remasking: the ``rollout.remasking`` values its sampler takes.
    caches: the ``rollout.cache`` values its sampler takes.
    check_rollout: (config.rollout, model config) -> None; raises ValueError naming the
      ``config.rollout`` field whose layout the model cannot decode.
    block_size: config -> its fixed block size (prompts are padded to whole blocks), or None.
    stop_ids: config -> the tokens that end a completion.
    aliases: field names of other families accepted in ``model.overrides`` -> this family's
      (``configs/quickstart.py`` sizes any family with LLaDA's names).
    vocab_fields: the config fields a character tokenizer's vocabulary size sets.
    shapes: config -> its :class:`Shapes` (the FLOP counter's and the planner's view), or None
      (the planner then refuses the family by name).
    step_flops: (shapes, config, rollout, K, cache) -> (the sampler's FLOPs for the rollout
      rows, one forward likelihood pass of K samples over them, one training pass): the parts
      of ``profiling.rl_step_flops_of_run``, by the family's own sampler and estimator.
    holds_kv_cache: cache -> whether its sampler keeps a KV cache of every position (the
      planner's ``kv_cache_bytes``) with ``rollout.cache`` = cache.
    eval_decoding: gen_length -> the ``run_spec.Decoding`` fields its official evaluation sets
      where ``stabledrl_jax.evaluate``'s command line names none (block_length, remasking,
      family_options); {}: d1's protocol (blocks of 32, low-confidence remasking).
    options: its sampler's own options ({name: :class:`Option`}; ``rollout.family_options``),
      the one place each is declared; a family with none refuses every name.
    max_positions: config -> the positions its model is made for (prompt and completion
      together; ``stabledrl_jax.evaluate`` bounds ``--gen_lengths`` by it), or None.
  """

  name: str
  config_cls: type
  model_cls: type
  config_names: tuple[str, ...]
  get_config: Callable[..., Any]
  checkpoint: Checkpoint
  tokenizer: Callable[[str], Any]
  likelihood: Any
  likelihood_fn: Callable[[Any, Array], Callable[..., Array]]
  sampling: Callable[[Any, Any], Any]
  generate: Callable[[Any, Array, Array, Array, Any], tuple[Array, Array]]
  remasking: tuple[str, ...]
  check_rollout: Callable[[Any, Any], None]
  caches: tuple[str, ...] = ("none",)
  block_size: Callable[[Any], int | None] = lambda config: None
  stop_ids: Callable[[Any], tuple[int, ...]] = lambda config: (config.eos_token_id,)
  aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
  vocab_fields: tuple[str, ...] = ("vocab_size",)
  shapes: Callable[[Any], Shapes] | None = None
  step_flops: Callable[..., tuple[float, float, float]] | None = None
  holds_kv_cache: Callable[[str], bool] = lambda cache: cache != "none"
  eval_decoding: Callable[[int], Mapping[str, Any]] = lambda gen_length: {}
  options: Mapping[str, Option] = dataclasses.field(default_factory=dict)
  max_positions: Callable[[Any], int | None] = lambda config: None

  @property
  def fields(self) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(self.config_cls))


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
  """Registers ``family`` under ``family.name``; returns it."""
  if family.name in _FAMILIES:
    raise ValueError(f"model family {family.name!r} is already registered")
  clash = [f.name for f in _FAMILIES.values()
           if f.checkpoint.model_type == family.checkpoint.model_type]
  if clash:
    raise ValueError(f"model family {family.name!r}: model_type "
                     f"{family.checkpoint.model_type!r} is already {clash[0]!r}'s")
  untyped = [f.name for f in _FAMILIES.values() if f.checkpoint.untyped]
  if family.checkpoint.untyped and untyped:
    raise ValueError(f"model family {family.name!r}: a config.json without model_type is "
                     f"already {untyped[0]!r}'s")
  _FAMILIES[family.name] = family
  return family


def unregister(name: str) -> None:
  """Removes a registered family (for tests that register their own)."""
  _FAMILIES.pop(name)


def names() -> tuple[str, ...]:
  """The registered families."""
  return tuple(_FAMILIES)


def get(name: str) -> Family:
  """The family called ``name``; ValueError naming ``config.model.family`` otherwise."""
  if name not in _FAMILIES:
    raise ValueError(f"config.model.family: {name!r} is not one of {names()}")
  return _FAMILIES[name]


def of(config_or_model: Any) -> Family:
  """The family of a model config, or of a model (through its ``config``)."""
  config = getattr(config_or_model, "config", config_or_model)
  for family in _FAMILIES.values():
    if type(config) is family.config_cls:
      return family
  raise TypeError(f"{type(config).__name__} is not the config of a registered model family "
                  f"({names()})")


def by_model_type(model_type: str | None) -> Family:
  """The family whose checkpoints have config.json ``model_type`` (None: a config.json without
  one, ``untyped``)."""
  if model_type is None:
    return untyped()
  for family in _FAMILIES.values():
    if family.checkpoint.model_type == model_type:
      return family
  raise NotImplementedError(f"config.json: model_type={model_type!r} is not supported; choose "
                            f"from {sorted(f.checkpoint.model_type for f in _FAMILIES.values())}")


def untyped() -> Family:
  """The family of a config.json without ``model_type`` and of a bare tokenizer.json
  (``Checkpoint.untyped``); NotImplementedError if no registered family claims them."""
  for family in _FAMILIES.values():
    if family.checkpoint.untyped:
      return family
  raise NotImplementedError("config.json has no model_type, and no registered model family "
                            f"reads such checkpoints; choose from {names()}")


def caches() -> tuple[str, ...]:
  """Every ``rollout.cache`` value some registered family's sampler takes."""
  return tuple(dict.fromkeys(c for family in _FAMILIES.values() for c in family.caches))


def block_size(config_or_model: Any) -> int | None:
  """The fixed block size of a block diffusion model; None for full attention."""
  config = getattr(config_or_model, "config", config_or_model)
  return of(config).block_size(config)


def stop_ids(config_or_model: Any) -> tuple[int, ...]:
  """The tokens that end a completion of this model (``Family.stop_ids``)."""
  config = getattr(config_or_model, "config", config_or_model)
  return of(config).stop_ids(config)


def likelihood_fn(model: Any, attention_mask: Array) -> Callable[..., Array]:
  """The model as its family's likelihood estimator sees it, the [B, L] mask bound."""
  return of(model).likelihood_fn(model, attention_mask)


def generate(model: Any, prompt_tokens: Array, prompt_mask: Array, key: Array, decoding: Any
             ) -> tuple[Array, Array]:
  """Completions of left-padded prompts [B, P] by the model's own sampler, with the common
  decoding options ``decoding`` (``training/run_spec.Decoding``) in its family's settings.

  Returns:
    tokens [B, P + G] and the model calls each sequence needed [B] int32.
  """
  family = of(model)
  return family.generate(model, prompt_tokens, prompt_mask, key,
                         family.sampling(decoding, model.config))


def family_options(decoding: Any, family_name: str, allowed: Mapping[str, Any],
                   model_config: Any = None) -> dict[str, Any]:
  """``decoding.family_options`` over the defaults of a family's sampler options ``allowed``
  ({name: :class:`Option`}, or {name: default}); ValueError (one line) naming
  ``rollout.family_options.<name>`` for a name it lacks or a value out of its ``Option``'s
  range (for ``model_config``, where given: top_k at most its vocabulary). A None value is
  unset: the default stays."""
  given = {k: v for k, v in dict(getattr(decoding, "family_options", ())).items()
           if v is not None}
  unknown = sorted(set(given) - set(allowed))
  if unknown:
    takes = f"takes {sorted(allowed)}" if allowed else "takes none"
    raise ValueError(f"rollout.family_options.{unknown[0]}: {family_name}'s sampler {takes}")
  defaults = {}
  for name, option in allowed.items():
    if isinstance(option, Option):
      check_option(f"rollout.family_options.{name}", option, given.get(name), model_config)
      defaults[name] = option.default
    else:
      defaults[name] = option
  return {**defaults, **given}


def check_options(family: Family, options: Mapping[str, Any], field: str,
                  model_config: Any = None) -> None:
  """Raises ValueError ``config.<field>.<name>: ...`` (one line) for a set option (not None)
  that ``family`` does not declare (``Family.options``) or a value out of its range; cheap (no
  model: the bounds a model sets are checked where ``model_config`` is given)."""
  for name, value in options.items():
    if value is None:
      continue
    if name not in family.options:
      takes = f"takes {sorted(family.options)}" if family.options else "takes none"
      raise ValueError(f"config.{field}.{name}: the {family.name} family's sampler {takes} "
                       f"(model.family={family.name!r})")
    check_option(f"config.{field}.{name}", family.options[name], value, model_config)


def resolve_overrides(family: Family, overrides: Mapping[str, Any]) -> dict[str, Any]:
  """``model.overrides`` in the family's field names; ValueError naming a field it lacks."""
  fields = family.fields
  resolved = {}
  for name, value in overrides.items():
    target = name if name in fields else family.aliases.get(name)
    if target is None:
      raise ValueError(f"config.model.overrides.{name}: the {family.name} config "
                       f"({family.config_cls.__name__}) has no field {name!r}; its fields are "
                       f"{fields}")
    if target in resolved:
      raise ValueError(f"config.model.overrides.{name}: sets {family.config_cls.__name__}."
                       f"{target}, which another override sets too")
    resolved[target] = value
  return resolved
