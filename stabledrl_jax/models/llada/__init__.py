"""LLaDA: a full-attention masked diffusion LM (GSAI-ML/LLaDA-8B-Instruct), and its family record.

Modules: ``config`` (ModelConfig and the named sizes), ``model`` (the NNX module), ``checkpoint``
(the Hugging Face names and config.json keys), ``flops`` (the matmul FLOPs of a pass),
``sampler`` (semi-autoregressive low-confidence remasking, threshold decoding, Fast-dLLM's KV
caches). Its likelihoods are the Monte Carlo estimators of ``stabledrl_jax.estimators``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from stabledrl_jax import estimators, tokenizers
from stabledrl_jax.models import family
from stabledrl_jax.models.llada import checkpoint, flops, sampler
from stabledrl_jax.models.llada.config import CONFIG_NAMES, ModelConfig, get_config
from stabledrl_jax.models.llada.model import LLaDA

Array = jax.Array


def likelihood_fn(model: Any, attention_mask: Array) -> Callable[..., Array]:
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


def sampling(decoding: Any, config: ModelConfig) -> sampler.Sampling:
  """``family.Family.sampling``: LLaDA's sampler takes every common decoding option (and no
  family options)."""
  del config
  family.family_options(decoding, "LLaDA", {})
  return sampler.Sampling(
      gen_length=decoding.gen_length, steps=decoding.steps, block_length=decoding.block_length,
      temperature=decoding.temperature, remasking=decoding.remasking,
      threshold=decoding.threshold, cfg_scale=decoding.cfg_scale,
      stop_at_eos=decoding.stop_at_eos, cache=decoding.cache)


def generate(model: Any, prompt_tokens: Array, prompt_mask: Array, key: Array,
             settings: sampler.Sampling) -> tuple[Array, Array]:
  """``family.Family.generate`` by ``sampler.sample``."""
  tokens, _, stats = sampler.sample(model, prompt_tokens, prompt_mask, key, settings)
  return tokens, stats["model_calls"]


def check_rollout(rollout: Any, config: ModelConfig) -> None:
  """Semi-autoregressive decoding: whole blocks of ``block_length``, steps split evenly, at most
  one per token (``sampler.check_settings``: a step beyond reveals nothing, yet calls the
  model)."""
  del config
  if rollout.gen_length % rollout.block_length:
    raise ValueError(f"config.rollout.gen_length: {rollout.gen_length} is not a multiple of "
                     f"rollout.block_length={rollout.block_length}")
  num_blocks = rollout.gen_length // rollout.block_length
  if rollout.steps > rollout.gen_length:
    raise ValueError(f"config.rollout.steps: {rollout.steps} exceeds rollout.gen_length="
                     f"{rollout.gen_length}: at most one denoising step per completion token "
                     f"(rollout.block_length={rollout.block_length} a block); a step beyond "
                     "reveals nothing, yet calls the model")
  if rollout.steps % num_blocks:
    raise ValueError(f"config.rollout.steps: {rollout.steps} is not a multiple of the number "
                     f"of blocks ({num_blocks})")


# Field names of SDAR's (Qwen3's) config -> LLaDA's, for the shapes both have.
QWEN_NAMES = {
    "hidden_size": "d_model",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "num_hidden_layers": "n_layers",
    "intermediate_size": "mlp_hidden_size",
    "max_position_embeddings": "max_sequence_length",
}

def shapes(config: ModelConfig) -> family.Shapes:
  """``family.Family.shapes``: LLaDA's own field names."""
  return family.Shapes(d_model=config.d_model, n_layers=config.n_layers, n_heads=config.n_heads,
                       n_kv_heads=config.n_kv_heads, head_dim=config.head_dim,
                       mlp_hidden_size=config.mlp_hidden_size,
                       embedding_size=config.embedding_size, remat=config.remat)


FAMILY = family.register(family.Family(
    name="llada", config_cls=ModelConfig, model_cls=LLaDA, config_names=CONFIG_NAMES,
    get_config=get_config,
    checkpoint=family.Checkpoint(
        model_type="llada", config_from_hf=checkpoint.config_from_hf,
        config_to_hf=checkpoint.config_to_hf,
        param_names=lambda config, hf: checkpoint.param_names(config),
        untyped=True),  # Its releases' config.json has no model_type.
    tokenizer=tokenizers.HFTokenizer.llada,
    likelihood=estimators.FULL_ATTENTION, likelihood_fn=likelihood_fn, sampling=sampling,
    generate=generate, remasking=sampler.REMASKING, check_rollout=check_rollout,
    caches=sampler.CACHES,
    # The official code ends a completion at its first EOS (126081) only.
    stop_ids=lambda config: (config.eos_token_id,),
    aliases=QWEN_NAMES, vocab_fields=("vocab_size", "embedding_size"),
    shapes=shapes, step_flops=flops.rl_step_parts,
    max_positions=lambda config: config.max_sequence_length))

__all__ = ["CONFIG_NAMES", "FAMILY", "LLaDA", "ModelConfig", "get_config"]
