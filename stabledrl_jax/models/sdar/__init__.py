"""SDAR: a block diffusion LM on the Qwen3 architecture (JetAstra/SDAR), and its family record.

Modules: ``config`` (SDARConfig and the named sizes), ``model`` (the NNX module with its
staircase likelihood layout and KV-cached decoding), ``staircase`` (the attention masks),
``checkpoint`` (the Hugging Face names and config.json keys), ``sampler`` (block-by-block
decoding with a KV cache of finished blocks). Its likelihoods are the block estimators of
``stabledrl_jax.block_estimators`` (docs/block_diffusion.md).
"""

from __future__ import annotations

from typing import Any

import jax

from stabledrl_jax import block_estimators, tokenizers
from stabledrl_jax.models import family
from stabledrl_jax.models.llada import QWEN_NAMES, flops
from stabledrl_jax.models.sdar import checkpoint, sampler
from stabledrl_jax.models.sdar.config import SDARConfig, SDAR_CONFIG_NAMES, get_sdar_config
from stabledrl_jax.models.sdar.model import KVCache, SDAR

Array = jax.Array

# rollout.remasking -> the sampler's name. LLaDA's 'low_confidence' (the even schedule, most
# confident first) is SDAR's static rule; SDAR has no random remasking.
REMASKING = {
    "low_confidence": "low_confidence_static",
    "low_confidence_static": "low_confidence_static",
    "low_confidence_dynamic": "low_confidence_dynamic",
}


def likelihood_fn(model: SDAR, attention_mask: Array):
  """(noisy [R, B, L], clean [B, L], attention_mask [B, L]) -> logits [R, B, L, V].

  The block estimator passes the attention mask itself (it may pad L to whole blocks).
  """
  del attention_mask
  return model.staircase


def sampling(decoding: Any, config: SDARConfig) -> sampler.Sampling:
  """``family.Family.sampling``: SDAR decodes by its model's blocks (``block_length`` does not
  apply) and stops finished rows on its own; ``steps`` counts denoising steps over the whole
  completion, as for LLaDA, and its sampler takes them per block (at most: the dynamic rule and
  finished rows stop early)."""
  family.family_options(decoding, "SDAR", {})
  if decoding.cache != "none":
    raise ValueError(f"cache={decoding.cache!r}: SDAR's sampler always keeps the keys and values "
                     "of its finished blocks (exactly: attention is block-causal); there is no "
                     "other cache to choose")
  if decoding.cfg_scale:
    raise ValueError(f"classifier-free guidance (cfg_scale={decoding.cfg_scale}) is LLaDA's; "
                     "SDAR's sampler has none")
  if decoding.remasking not in REMASKING:
    raise ValueError(f"remasking {decoding.remasking!r} is not one of SDAR's "
                     f"{tuple(REMASKING)}")
  num_blocks = max(decoding.gen_length // config.block_size, 1)
  return sampler.Sampling(
      gen_length=decoding.gen_length, steps=-(-decoding.steps // num_blocks),
      stop_ids=tuple(config.stop_token_ids), temperature=decoding.temperature,
      remasking=REMASKING[decoding.remasking], threshold=decoding.threshold,
      # Finished rows stop on their own; the KV cache of finished blocks is exact.
      stop_at_eos=True, use_cache=True)


def generate(model: SDAR, prompt_tokens: Array, prompt_mask: Array, key: Array,
             settings: sampler.Sampling) -> tuple[Array, Array]:
  """``family.Family.generate`` by ``sampler.sample``."""
  tokens, _, stats = sampler.sample(model, prompt_tokens, prompt_mask, key, settings)
  return tokens, stats["model_calls"]


def check_rollout(rollout: Any, config: SDARConfig) -> None:
  """A block diffusion model's rollouts fit its blocks, which are fixed by absolute position.

  The left-padded prompt and the completion must fill whole blocks (so that the sampler and the
  block estimators see the same blocks, and no block mixes prompt and completion), and
  ``rollout.steps`` must split evenly over the completion's blocks, at most ``block_size`` a
  block (one per token: each step reveals at least one).
  """
  size = config.block_size
  for field in ("prompt_length", "gen_length"):
    value = getattr(rollout, field)
    if value % size:
      raise ValueError(f"config.rollout.{field}: {value} is not a multiple of the model's "
                       f"block_size={size} (SDAR blocks are fixed by absolute position: prompt "
                       "and completion must fill whole blocks)")
  num_blocks = rollout.gen_length // size
  if rollout.steps > rollout.gen_length:
    raise ValueError(f"config.rollout.steps: {rollout.steps} exceeds rollout.gen_length="
                     f"{rollout.gen_length}: the steps split over the {num_blocks} completion "
                     f"blocks, at most one per token, so at most the model's block_size={size} "
                     "a block")
  if rollout.steps % num_blocks:
    raise ValueError(f"config.rollout.steps: {rollout.steps} is not a multiple of the number of "
                     f"completion blocks ({num_blocks} of the model's block_size={size})")


def step_flops(shapes_: family.Shapes, config: SDARConfig, rollout: Any, num_samples: int,
               cache: str) -> tuple[float, float, float]:
  """``family.Family.step_flops``: one prefill of the prompt, then per block its steps on the
  block's positions against the cache plus one pass committing the block's keys and values;
  likelihoods are one staircase pass over (K + 1) x L positions, each query seeing about L / 2
  keys, the head on the K x G completion positions."""
  del cache  # Always the exact cache of finished blocks.
  r = rollout
  rows, prompt, gen = r.num_prompts * r.group_size, r.prompt_length, r.gen_length
  length, bs = prompt + gen, config.block_size
  blocks = -(-length // bs) - prompt // bs  # The blocks after the prompt's full ones.
  per_block = max(r.steps // max(gen // bs, 1), 1)
  sampled = flops.cached_forward_flops(shapes_, rows, prompt, queries=prompt, logit_positions=0)
  for j in range(blocks):
    keys = (prompt // bs + j + 1) * bs
    call = flops.cached_forward_flops(shapes_, rows, keys, queries=bs, logit_positions=bs)
    commit = flops.cached_forward_flops(shapes_, rows, keys, queries=bs, logit_positions=0)
    sampled += per_block * call + commit
  positions = (num_samples + 1) * length
  blocks_fwd = shapes_.n_layers * flops.block_flops(shapes_, keys=length // 2, queries=positions,
                                                    projected=positions)
  forward = rows * (blocks_fwd + flops.head_flops(shapes_, num_samples * gen))
  return float(sampled), float(forward), float(flops.TRAIN_MULTIPLIER * forward)


FAMILY = family.register(family.Family(
    name="sdar", config_cls=SDARConfig, model_cls=SDAR, config_names=SDAR_CONFIG_NAMES,
    get_config=get_sdar_config,
    checkpoint=family.Checkpoint(
        model_type="sdar", config_from_hf=checkpoint.config_from_hf,
        config_to_hf=checkpoint.config_to_hf,
        param_names=lambda config, hf: checkpoint.param_names(
            config, tied=bool(hf.get("tie_word_embeddings", False))),
        # A tied checkpoint that also stores lm_head.weight loads tied, as transformers loads
        # it (the stored head is not read).
        ignored=lambda hf: {"lm_head.weight"} if hf.get("tie_word_embeddings") else set()),
    tokenizer=tokenizers.HFTokenizer.sdar,
    likelihood=block_estimators.BLOCK, likelihood_fn=likelihood_fn, sampling=sampling,
    generate=generate,
    remasking=tuple(REMASKING), check_rollout=check_rollout,
    block_size=lambda config: config.block_size, stop_ids=lambda config: config.stop_token_ids,
    aliases={llada: qwen for qwen, llada in QWEN_NAMES.items()},
    shapes=family.hf_shapes, step_flops=step_flops, holds_kv_cache=lambda cache: True,
    max_positions=lambda config: config.max_position_embeddings))

__all__ = ["FAMILY", "KVCache", "SDAR", "SDARConfig", "SDAR_CONFIG_NAMES", "get_sdar_config"]
