"""What the samplers of every family share (``models/llada/sampler.py``,
``models/sdar/sampler.py``): the even reveal schedule, the draw of x0, the confidence ranking,
the stop-token masks and the prompt check. Pure functions of arrays.

A new family's sampler builds on these; its own rules (which positions a step may reveal, what
a model call sees) stay in its folder.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp

Array = jax.Array


def num_transfer_tokens(num_masked: Array, steps: int) -> Array:
  """Tokens revealed at each of `steps` steps: [B] masked counts -> [B, steps] int32.

  LLaDA's get_num_transfer_tokens: base = n // steps everywhere, the first n % steps steps +1.
  """
  num_masked = jnp.asarray(num_masked, jnp.int32)
  base = num_masked // steps
  remainder = num_masked % steps
  step = jnp.arange(steps, dtype=jnp.int32)
  return base[:, None] + (step[None, :] < remainder[:, None]).astype(jnp.int32)


def completion_mask(tokens: Array, prompt_len: int, eos_token_id: int | Sequence[int]) -> Array:
  """[B, G] bool: completion tokens up to and including the first EOS (all if there is none).

  ``eos_token_id``: one id, or several (any of them ends the completion).
  """
  completion = tokens[:, prompt_len:]
  is_eos = jnp.isin(completion, jnp.atleast_1d(jnp.asarray(eos_token_id)))
  before_or_at_eos = jnp.cumsum(is_eos, axis=1) - is_eos.astype(jnp.int32) == 0
  return before_or_at_eos


def fill_after_stop(completion: Array, stop_ids: int | Sequence[int], fill_id: int) -> Array:
  """[B, G]: every token after the first stop token (any of ``stop_ids``) becomes ``fill_id``."""
  return jnp.where(completion_mask(completion, 0, stop_ids), completion, fill_id)


def categorical(key: Array, logits: Array, temperature: float) -> Array:
  """Draws x ~ softmax(logits / T) over the last axis: [..., V] -> [...] int32.

  The same law as Gumbel-max, argmax(logits + T g), with one uniform per draw instead of V
  Gumbel variates (their generation took a fifth of a sampling step of the 16k-vocabulary `small`
  model on CPU): the inverse CDF, found in two levels (chunks of about sqrt(V) tokens, then a
  token inside the chunk) so that both cumulative sums are short, cheap and accurate in float32.
  Tokens with zero probability (logit -inf, or underflowing exp) are never drawn.
  """
  return categorical_from_uniform(jax.random.uniform(key, logits.shape[:-1]), logits,
                                  temperature)


def categorical_from_uniform(uniform: Array, logits: Array, temperature: float) -> Array:
  """``categorical`` given its uniform draw [...] in [0, 1): the inverse CDF of
  softmax(logits / T)."""
  vocab = logits.shape[-1]
  chunk = 1 << max(0, (math.isqrt(vocab - 1) + 1).bit_length() - 1)
  pad = -vocab % chunk
  x = jnp.pad(logits.astype(jnp.float32), [(0, 0)] * (logits.ndim - 1) + [(0, pad)],
              constant_values=-jnp.inf)
  weights = jnp.exp((x - jnp.max(x, axis=-1, keepdims=True)) / temperature)
  weights = weights.reshape(x.shape[:-1] + (-1, chunk))            # [..., chunks, chunk]
  totals = jnp.sum(weights, axis=-1)                                # [..., chunks]
  cdf = jnp.cumsum(totals, axis=-1)
  u = uniform * cdf[..., -1]

  def first_above(cdf, u, nonzero):
    """Index of the first cdf entry > u; rounding past the end falls on the last nonzero."""
    index = jnp.sum(cdf <= u[..., None], axis=-1)
    last = jnp.max(jnp.where(nonzero, jnp.arange(cdf.shape[-1]), 0), axis=-1)
    return jnp.minimum(index, last)

  c = first_above(cdf, u, totals > 0)
  # The mass before chunk c from the same cumulative sum (not cdf[c] - totals[c], which rounding
  # can push above u, sending the draw to the chunk's first token even at zero weight).
  exclusive = jnp.concatenate([jnp.zeros_like(cdf[..., :1]), cdf[..., :-1]], axis=-1)
  before = jnp.take_along_axis(exclusive, c[..., None], axis=-1)[..., 0]
  inside = jnp.take_along_axis(weights, c[..., None, None], axis=-2)[..., 0, :]
  j = first_above(jnp.cumsum(inside, axis=-1), u - before, inside > 0)
  return (c * chunk + j).astype(jnp.int32)


def rank_descending(values: Array) -> Array:
  """[B, n] -> rank of each entry in descending order (0 = largest; ties: leftmost first)."""
  order = jnp.argsort(-values, axis=-1, stable=True)
  return jnp.argsort(order, axis=-1, stable=True)



def check_prompts(prompt_tokens: Array, prompt_mask: Array | None) -> tuple[Array, Array | None]:
  """Validates [B, P] integer prompts and their optional [B, P] mask; returns them as arrays."""
  prompt_tokens = jnp.asarray(prompt_tokens)
  if prompt_tokens.ndim != 2 or not jnp.issubdtype(prompt_tokens.dtype, jnp.integer):
    raise ValueError(f"prompt_tokens must be [B, P] integers, got {prompt_tokens.shape} "
                     f"{prompt_tokens.dtype}")
  if prompt_mask is not None:
    prompt_mask = jnp.asarray(prompt_mask, bool)
    if prompt_mask.shape != prompt_tokens.shape:
      raise ValueError(f"prompt_mask shape {prompt_mask.shape} != prompt shape "
                       f"{prompt_tokens.shape}")
  return prompt_tokens, prompt_mask


def outputs(result: tuple[Array, Array, dict[str, Array]], return_reveal_step: bool,
            return_stats: bool) -> Array | tuple[Any, ...]:
  """What a sampler's ``generate`` returns of (tokens, reveal_step, stats): the tokens alone,
  or with the reveal steps and / or the stats, in that order."""
  tokens, reveal_step, stats = result
  out = (tokens,) + ((reveal_step,) if return_reveal_step else ()) + (
      (stats,) if return_stats else ())
  return out if len(out) > 1 else tokens
