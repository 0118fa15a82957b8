"""Dream: a masked diffusion LM on the Qwen2 architecture (Dream-org/Dream-v0-Instruct-7B), and
its family record (docs/models.md, "Dream").

Modules: ``config`` (DreamConfig and the named sizes), ``model`` (the NNX module; its
``predictions`` are the shifted logits every loss and the sampler read), ``checkpoint`` (the
Hugging Face names and config.json keys), ``tokenizer`` (Qwen2's with <|mask|> and the chat
template), ``sampler`` (the official diffusion generate: origin, maskgit_plus, topk_margin,
entropy). Its likelihoods are the Monte Carlo estimators of ``stabledrl_jax.estimators``, on the
shifted logits.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from stabledrl_jax import estimators
from stabledrl_jax.models import family
from stabledrl_jax.models.dream import checkpoint, sampler, tokenizer
from stabledrl_jax.models.dream.config import DREAM_CONFIG_NAMES, DreamConfig, get_dream_config
from stabledrl_jax.models.dream.model import Dream
from stabledrl_jax.models.llada import flops

Array = jax.Array

# LLaDA's field names -> Dream's (Qwen2's), for the shapes both have (``model.overrides``).
ALIASES = {
    "d_model": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "n_layers": "num_hidden_layers",
    "mlp_hidden_size": "intermediate_size",
    "max_sequence_length": "max_position_embeddings",
}


def likelihood_fn(model: Dream, attention_mask: Array) -> Callable[..., Array]:
  """tokens [B * R, L] -> Dream's shifted logits (row i predicts token i), the [B, L] mask
  repeated for each sequence's R rows; ``suffix=n``: the last n rows only, [B * R, n, V]."""

  def logits_fn(tokens, suffix=None):
    rows = tokens.shape[0] // attention_mask.shape[0]
    return model.predictions(tokens, jnp.repeat(attention_mask, rows, axis=0), suffix=suffix)

  return logits_fn


def sampling(decoding: Any, config: DreamConfig) -> sampler.Sampling:
  """``family.Family.sampling``: the common options in Dream's generate (``remasking`` is the
  official ``alg``), and its own ``rollout.family_options``: top_p, top_k, alg_temp, eps.
  Raises ValueError (one line) for an option it does not take, or a value out of the range
  ``sampler.OPTIONS`` declares (top_k at most ``config``'s vocabulary)."""
  if decoding.remasking not in sampler.ALGS:
    raise ValueError(f"remasking {decoding.remasking!r} is not one of Dream's generate algs "
                     f"{sampler.ALGS}")
  if decoding.cache != "none":
    raise ValueError(f"cache={decoding.cache!r}: Dream's sampler has no KV cache (the official "
                     "diffusion_generate runs the whole sequence each step); use cache='none'")
  if decoding.cfg_scale:
    raise ValueError(f"classifier-free guidance (cfg_scale={decoding.cfg_scale}) is LLaDA's; "
                     "Dream's sampler has none")
  if decoding.block_length != decoding.gen_length:
    raise ValueError(f"block_length={decoding.block_length}: Dream's sampler decodes the whole "
                     f"completion at once (no semi-autoregressive blocks); set block_length to "
                     f"gen_length={decoding.gen_length}")
  options = family.family_options(decoding, "Dream", sampler.OPTIONS, config)
  return sampler.Sampling(gen_length=decoding.gen_length, steps=decoding.steps,
                          alg=decoding.remasking, temperature=decoding.temperature, **options)


def generate(model: Dream, prompt_tokens: Array, prompt_mask: Array, key: Array,
             settings: sampler.Sampling) -> tuple[Array, Array]:
  """``family.Family.generate`` by ``sampler.sample``."""
  tokens, stats = sampler.sample(model, prompt_tokens, prompt_mask, key, settings)
  return tokens, stats["model_calls"]


def check_rollout(rollout: Any, config: DreamConfig) -> None:
  """Dream decodes the whole completion as one block: ``rollout.block_length`` must be
  ``rollout.gen_length``."""
  del config
  if rollout.block_length != rollout.gen_length:
    raise ValueError(f"config.rollout.block_length: {rollout.block_length} is not "
                     f"rollout.gen_length={rollout.gen_length}; Dream's sampler decodes the whole "
                     "completion at once (no semi-autoregressive blocks)")


def step_flops(shapes_: family.Shapes, config: DreamConfig, rollout: Any, num_samples: int,
               cache: str) -> tuple[float, float, float]:
  """``family.Family.step_flops``: each of the ``rollout.steps`` calls is a pass over the whole
  sequence, the last layer and the head on the completion's G rows (``predictions(suffix=G)``);
  the likelihoods are K such passes (no cache: ``cache`` is always 'none')."""
  del config, cache
  r = rollout
  rows, length = r.num_prompts * r.group_size, r.prompt_length + r.gen_length
  call = flops.forward_flops(shapes_, rows, length, span=r.gen_length)
  return (float(r.steps * call), float(num_samples * call),
          float(num_samples * flops.train_flops(shapes_, rows, length, span=r.gen_length)))


def eval_decoding(gen_length: int) -> dict[str, Any]:
  """``family.Family.eval_decoding``: ESPO's Dream evaluation (ML-GSAI/ESPO@b5f2dac
  eval/eval.py:83-93): the whole completion at once, alg 'entropy', alg_temp 0, top_p 1 at
  temperature 0 (d1's gen_length / 2 steps, eval.py:205, as the common default)."""
  return dict(block_length=gen_length, remasking="entropy",
              family_options=(("alg_temp", 0.0), ("top_p", 1.0)))


FAMILY = family.register(family.Family(
    name="dream", config_cls=DreamConfig, model_cls=Dream, config_names=DREAM_CONFIG_NAMES,
    get_config=get_dream_config,
    checkpoint=family.Checkpoint(
        model_type=checkpoint.MODEL_TYPE, config_from_hf=checkpoint.config_from_hf,
        config_to_hf=checkpoint.config_to_hf,
        param_names=lambda config, hf: checkpoint.param_names(
            config, tied=bool(hf.get("tie_word_embeddings", False))),
        ignored=lambda hf: {"lm_head.weight"} if hf.get("tie_word_embeddings") else set()),
    tokenizer=tokenizer.load,
    likelihood=estimators.FULL_ATTENTION, likelihood_fn=likelihood_fn, sampling=sampling,
    generate=generate, remasking=sampler.ALGS, check_rollout=check_rollout,
    # The official code ends a completion at its first EOS (<|endoftext|>).
    stop_ids=lambda config: (config.eos_token_id,), aliases=ALIASES,
    shapes=family.hf_shapes, step_flops=step_flops, holds_kv_cache=lambda cache: False,
    eval_decoding=eval_decoding, options=sampler.OPTIONS,
    max_positions=lambda config: config.max_position_embeddings))

__all__ = ["DREAM_CONFIG_NAMES", "Dream", "DreamConfig", "FAMILY", "get_dream_config"]
