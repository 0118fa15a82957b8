"""What differs between the model families the trainer runs; everything else is shared.

``config.model.family`` picks one, 'llada' or 'sdar'. The seams:

* the model config: ``models.get_config(model.name)`` (LLaDA) or
  ``models.get_sdar_config(model.name)`` (SDAR), with ``model.overrides``;
* ``block_size``: None for LLaDA (full attention), the model's block size for SDAR;
* ``likelihood_fn``: the model as the estimators see it: tokens [B * R, L] -> logits for LLaDA
  (``estimators.py``), the staircase function for SDAR (``block_estimators.py``);
* ``generate``: ``sampling.generate`` over ``block_length`` blocks (LLaDA),
  ``block_sampling.generate`` over the model's blocks with a KV cache (SDAR).

The likelihood estimates dispatch on ``LikelihoodSpec.block_size`` in ``rl_loss.estimate``
(the SFT loss goes through it too), so the objectives, the update step, checkpoints and the loop
never ask which family they run.

``model.overrides`` may name fields in either family's spelling: the shapes both families have
(width, heads, layers, MLP width, maximum length) are accepted under the other family's name
too, so that ``configs/quickstart.py``'s LLaDA-style overrides (``d_model``, ``n_heads``, ...)
size an SDAR model as well. A field the family does not have (LLaDA's ``embedding_size`` for
SDAR, SDAR's ``head_dim`` or ``block_size`` for LLaDA) is a config error naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import ml_collections

from stabledrl_jax import block_sampling, models, sampling
from stabledrl_jax.training import data

Array = jax.Array

# LLaDA's name -> SDAR's (Qwen3's) name of the shapes both configs have.
_SHARED_FIELDS = {
    "d_model": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "n_layers": "num_hidden_layers",
    "mlp_hidden_size": "intermediate_size",
    "max_sequence_length": "max_position_embeddings",
}


def _llada_likelihood_fn(model: Any, attention_mask: Array) -> Callable[[Array], Array]:
  """tokens [B * R, L] -> logits, the [B, L] attention mask repeated for each sequence's R rows
  (``estimators.token_logprobs`` orders the rows sequence-major).

  ``suffix=n``: the logits of the last n positions only, [B * R, n, V]; the last block runs
  only their queries and the head only their hidden states.
  """

  def logits_fn(tokens, suffix=None):
    rows = tokens.shape[0] // attention_mask.shape[0]
    mask = jnp.repeat(attention_mask, rows, axis=0)
    if suffix is None:
      return model(tokens, attention_mask=mask)
    length = tokens.shape[1]
    return model.unembed(model.encode(tokens, mask, span=(length - suffix, suffix)))

  return logits_fn


def _sdar_likelihood_fn(model: Any, attention_mask: Array) -> Callable[..., Array]:
  """(noisy [R, B, L], clean [B, L], attention_mask [B, L]) -> logits [R, B, L, V].

  The block estimator passes the attention mask itself (it may pad L to whole blocks).
  """
  del attention_mask
  return model.staircase


def _llada_generate(model: Any, prompt_tokens: Array, prompt_mask: Array, key: Array, *,
                    gen_length: int, steps: int, block_length: int, temperature: float,
                    remasking: str, threshold: float, cfg_scale: float,
                    stop_at_eos: bool) -> tuple[Array, Array]:
  tokens, stats = sampling.generate(
      model, prompt_tokens, key=key, gen_length=gen_length, steps=steps,
      block_length=block_length, temperature=temperature, remasking=remasking,
      threshold=threshold, cfg_scale=cfg_scale, prompt_mask=prompt_mask,
      stop_at_eos=stop_at_eos, return_stats=True)
  return tokens, stats["model_calls"]


# rollout.remasking -> block_sampling's name. LLaDA's 'low_confidence' (the even schedule, most
# confident first) is SDAR's static rule; SDAR has no random remasking.
_SDAR_REMASKING = {
    "low_confidence": "low_confidence_static",
    "low_confidence_static": "low_confidence_static",
    "low_confidence_dynamic": "low_confidence_dynamic",
}


def _sdar_generate(model: Any, prompt_tokens: Array, prompt_mask: Array, key: Array, *,
                   gen_length: int, steps: int, block_length: int, temperature: float,
                   remasking: str, threshold: float, cfg_scale: float,
                   stop_at_eos: bool) -> tuple[Array, Array]:
  # SDAR decodes by its model's blocks (block_length does not apply) and stops finished rows on
  # its own; `steps` counts denoising steps over the whole completion, as for LLaDA, and the
  # block sampler takes them per block (at most: the dynamic rule and finished rows stop early).
  del block_length, stop_at_eos
  if cfg_scale:
    raise ValueError(f"classifier-free guidance (cfg_scale={cfg_scale}) is LLaDA's; SDAR's "
                     "sampler has none")
  if remasking not in _SDAR_REMASKING:
    raise ValueError(f"remasking {remasking!r} is not one of SDAR's {tuple(_SDAR_REMASKING)}")
  num_blocks = gen_length // model.config.block_size
  tokens, stats = block_sampling.generate(
      model, prompt_tokens, key=key, gen_length=gen_length,
      steps=-(-steps // num_blocks), temperature=temperature,
      remasking=_SDAR_REMASKING[remasking], threshold=threshold, prompt_mask=prompt_mask,
      return_stats=True)
  return tokens, stats["model_calls"]


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family.

  Attributes:
    name: the ``config.model.family`` value.
    config_cls: its config dataclass.
    config_names: the named configs ``model.name`` may take.
    get_config: (name, **overrides) -> config.
    aliases: the other family's field names accepted in ``model.overrides``, -> this one's.
    vocab_fields: the fields a character tokenizer's vocabulary size sets.
    remasking: the ``rollout.remasking`` values this family's sampler takes.
    block_size: model config -> its block size (None: full attention, no fixed blocks).
    likelihood_fn: (model, attention_mask [B, L]) -> the model as the estimator sees it.
    generate: (model, prompt_tokens [B, P], prompt_mask [B, P], key, *, gen_length, steps,
      block_length, temperature, remasking, threshold, cfg_scale, stop_at_eos)
      -> (tokens [B, P + G], model calls [B]).
    stop_ids: model config -> the tokens that end a completion (its first EOS or any of them).
  """

  name: str
  config_cls: type
  config_names: tuple[str, ...]
  get_config: Callable[..., Any]
  aliases: Mapping[str, str]
  vocab_fields: tuple[str, ...]
  remasking: tuple[str, ...]
  block_size: Callable[[Any], int | None]
  likelihood_fn: Callable[[Any, Array], Callable[..., Array]]
  generate: Callable[..., tuple[Array, Array]]
  stop_ids: Callable[[Any], tuple[int, ...]]

  @property
  def fields(self) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(self.config_cls))


FAMILIES: dict[str, Family] = {
    "llada": Family(
        name="llada", config_cls=models.ModelConfig, config_names=models.CONFIG_NAMES,
        get_config=models.get_config, aliases={v: k for k, v in _SHARED_FIELDS.items()},
        vocab_fields=("vocab_size", "embedding_size"), remasking=sampling.REMASKING,
        block_size=lambda config: None, likelihood_fn=_llada_likelihood_fn,
        generate=_llada_generate,
        # The official code ends a completion at its first EOS (126081) only.
        stop_ids=lambda config: (config.eos_token_id,)),
    "sdar": Family(
        name="sdar", config_cls=models.SDARConfig, config_names=models.SDAR_CONFIG_NAMES,
        get_config=models.get_sdar_config, aliases=_SHARED_FIELDS, vocab_fields=("vocab_size",),
        remasking=tuple(_SDAR_REMASKING), block_size=lambda config: config.block_size,
        likelihood_fn=_sdar_likelihood_fn, generate=_sdar_generate,
        stop_ids=lambda config: config.stop_token_ids),
}


def get(name: str) -> Family:
  """The family called ``name``; ValueError naming ``config.model.family`` otherwise."""
  if name not in FAMILIES:
    raise ValueError(f"config.model.family: {name!r} is not one of {tuple(FAMILIES)}")
  return FAMILIES[name]


def of(model_config: Any) -> Family:
  """The family of a model config (or of a model, through its ``config``)."""
  model_config = getattr(model_config, "config", model_config)
  for family in FAMILIES.values():
    if isinstance(model_config, family.config_cls):
      return family
  raise TypeError(f"{type(model_config).__name__} is not the config of a known model family")


def block_size(model_config: Any) -> int | None:
  """The block size of a block diffusion model's config; None for full attention."""
  return of(model_config).block_size(model_config)


def stop_ids(model_config: Any) -> tuple[int, ...]:
  """The tokens that end a completion of this model (see ``Family.stop_ids``)."""
  return of(model_config).stop_ids(getattr(model_config, "config", model_config))


def likelihood_fn(model: Any, attention_mask: Array) -> Callable[..., Array]:
  """The model as ``rl_loss.estimate`` sees it (see the module docstring), mask [B, L] bound."""
  return of(model).likelihood_fn(model, attention_mask)


def generate(model: Any, prompt_tokens: Array, prompt_mask: Array, key: Array, *,
             gen_length: int, steps: int, block_length: int, temperature: float,
             remasking: str, threshold: float, cfg_scale: float = 0.0,
             stop_at_eos: bool = False) -> tuple[Array, Array]:
  """Completions of left-padded prompts [B, P] by the model's sampler.

  ``steps`` denoising steps over the completion of ``gen_length`` tokens (at most, for
  threshold rules); ``training/decoding.Decoding`` documents the rest.

  Returns:
    tokens [B, P + G] and the model calls each sequence needed [B] int32.
  """
  return of(model).generate(
      model, prompt_tokens, prompt_mask, key, gen_length=gen_length, steps=steps,
      block_length=block_length, temperature=temperature, remasking=remasking,
      threshold=threshold, cfg_scale=cfg_scale, stop_at_eos=stop_at_eos)


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


def named_block_size(config: ml_collections.ConfigDict) -> int | None:
  """The block size ``model.name`` and ``model.overrides`` give, without building anything.

  None for full attention. (A checkpoint's own block size is known once it is loaded.)
  """
  family = get(config.model.family)
  overrides = resolve_overrides(family, dict(config.model.overrides))
  size = family.block_size(family.get_config(config.model.name))
  return None if size is None else int(overrides.get("block_size", size))


def run_options(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Model config fields beyond dtypes and remat that the run sets: ``scan_layers``."""
  return {"scan_layers": True} if config.model.get("scan_layers", False) else {}


def model_config(config: ml_collections.ConfigDict, tokenizer=None) -> Any:
  """The config of a fresh model: ``model.name`` of ``model.family`` with its overrides.

  A character tokenizer sets the vocabulary and the mask and EOS ids (``tokenizer``, or built
  from ``config.tokenizer``: it needs no file); a Hugging Face tokenizer comes with a checkpoint,
  whose config.json holds them.
  """
  family = get(config.model.family)
  overrides = resolve_overrides(family, dict(config.model.overrides))
  overrides.update(dtype=config.model.dtype, param_dtype=config.model.param_dtype,
                   remat=config.model.remat, **run_options(config))
  if config.tokenizer.kind == "char":
    tokenizer = tokenizer or data.make_tokenizer(config.tokenizer)
    overrides.update({field: tokenizer.vocab_size for field in family.vocab_fields})
    overrides.update(mask_token_id=tokenizer.mask_id, eos_token_id=tokenizer.eos_id)
  return family.get_config(config.model.name, **overrides)
