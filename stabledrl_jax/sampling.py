"""Diffusion sampling: LLaDA's semi-autoregressive low-confidence remasking, as one jitted function.

The completion starts as `gen_length` mask tokens, split into blocks of `block_length` decoded
left to right; `steps` are split evenly over the blocks. At each step of a block:

1. logits of the current sequence (optionally with classifier-free guidance:
   logits = uncond + (cfg_scale + 1) * (cond - uncond), the unconditional pass seeing the prompt
   replaced by mask tokens);
2. x0 = argmax(logits + T * g), g ~ Gumbel(0, 1): Gumbel-max sampling at temperature T, the log of
   LLaDA's exp(logits) / (-log u)^T (T = 0: greedy, no randomness);
3. confidence = p(x0) under softmax(logits) (`low_confidence`) or U(0, 1) (`random`), and -inf
   outside the still-masked positions of the current block;
4. the k most confident positions take their x0, with LLaDA's schedule: a block with n masked
   tokens and s steps reveals n // s tokens per step, the first n % s steps one more.

Only the current block can be revealed, so only its logits are computed: `model.encode(...,
span=(block start, block_length))` runs the last transformer block for the block's queries only,
and `model.unembed` projects those hidden states alone. The result equals slicing full logits;
the output projection, the largest matmul of a small model, shrinks by L / block_length.

Jitting: `generate` splits the NNX model into (graphdef, state) with `nnx.split` and calls one
`jax.jit`-compiled pure function that merges them back inside (`nnx.merge`); the shapes and the
sampling options are static arguments, the state, prompt and key are traced. The blocks run in a
`lax.while_loop` and the steps of a block in a `lax.fori_loop`: no host round trip per step. Each
step draws its noise from `fold_in(key, global_step)`, so results are reproducible from the key.

Differences from the reference loop, by design: the mask token and, with embedding_size >
vocab_size, the padding rows of the head are never sampled (their logits are set to -inf before
sampling and before the softmax of the confidence), so a revealed position never holds a mask
token, even for an untrained model; prompt positions are never rewritten (a mask token inside the
prompt stays as it is); ties in confidence go to the leftmost position.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array

REMASKING = ("low_confidence", "random")


def num_transfer_tokens(num_masked: Array, steps: int) -> Array:
  """Tokens revealed at each of `steps` steps: [B] masked counts -> [B, steps] int32.

  LLaDA's get_num_transfer_tokens: base = n // steps everywhere, the first n % steps steps +1.
  """
  num_masked = jnp.asarray(num_masked, jnp.int32)
  base = num_masked // steps
  remainder = num_masked % steps
  step = jnp.arange(steps, dtype=jnp.int32)
  return base[:, None] + (step[None, :] < remainder[:, None]).astype(jnp.int32)


def completion_mask(tokens: Array, prompt_len: int, eos_token_id: int) -> Array:
  """[B, G] bool: completion tokens up to and including the first EOS (all if there is none)."""
  completion = tokens[:, prompt_len:]
  is_eos = completion == eos_token_id
  before_or_at_eos = jnp.cumsum(is_eos, axis=1) - is_eos.astype(jnp.int32) == 0
  return before_or_at_eos


def _fill_after_eos(completion: Array, eos_token_id: int) -> Array:
  """Every token after the first EOS becomes EOS."""
  return jnp.where(completion_mask(completion, 0, eos_token_id), completion, eos_token_id)


def _rank_descending(values: Array) -> Array:
  """[B, n] -> rank of each entry in descending order (0 = largest; ties: leftmost first)."""
  order = jnp.argsort(-values, axis=-1, stable=True)
  return jnp.argsort(order, axis=-1, stable=True)


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "gen_length", "steps", "block_length", "temperature",
                     "remasking", "cfg_scale", "stop_at_eos"))
def _generate(graphdef: Any, state: Any, prompt: Array, prompt_mask: Array | None, key: Array, *,
              gen_length: int, steps: int, block_length: int, temperature: float,
              remasking: str, cfg_scale: float, stop_at_eos: bool) -> tuple[Array, Array]:
  model = nnx.merge(graphdef, state)
  config = model.config
  mask_id, eos_id = config.mask_token_id, config.eos_token_id
  batch, prompt_len = prompt.shape
  num_blocks = gen_length // block_length
  steps_per_block = steps // num_blocks

  tokens = jnp.concatenate(
      [prompt, jnp.full((batch, gen_length), mask_id, prompt.dtype)], axis=1)
  if prompt_mask is None:
    attention_mask = None
  else:
    attention_mask = jnp.concatenate(
        [prompt_mask.astype(bool), jnp.ones((batch, gen_length), bool)], axis=1)
  if cfg_scale > 0:
    is_prompt = jnp.arange(prompt_len + gen_length) < prompt_len
    if attention_mask is not None:
      attention_mask = jnp.concatenate([attention_mask, attention_mask], axis=0)

  def block_logits(tokens: Array, start: Array) -> Array:
    """[B, block_length, V] float32 logits of the block starting at `start`."""
    inputs = tokens
    if cfg_scale > 0:
      unconditional = jnp.where(is_prompt[None, :], mask_id, tokens)
      inputs = jnp.concatenate([tokens, unconditional], axis=0)
    hidden = model.encode(inputs, attention_mask, span=(start, block_length))
    logits = model.unembed(hidden).astype(jnp.float32)
    if cfg_scale > 0:
      cond, uncond = logits[:batch], logits[batch:]
      logits = uncond + (cfg_scale + 1.0) * (cond - uncond)
    vocab = jnp.arange(logits.shape[-1])
    valid = (vocab < config.vocab_size) & (vocab != mask_id)
    return jnp.where(valid, logits, -jnp.inf)

  def step(block: Array, step_in_block: Array, schedule: Array, tokens: Array,
           reveal_step: Array) -> tuple[Array, Array]:
    global_step = block * steps_per_block + step_in_block
    step_key = jax.random.fold_in(key, global_step)
    noise_key, confidence_key = jax.random.split(step_key)
    start = prompt_len + block * block_length
    logits = block_logits(tokens, start)
    if temperature > 0:
      gumbel = jax.random.gumbel(noise_key, logits.shape, jnp.float32)
      x0 = jnp.argmax(logits + temperature * gumbel, axis=-1)
    else:
      x0 = jnp.argmax(logits, axis=-1)
    if remasking == "low_confidence":
      chosen = jnp.take_along_axis(logits, x0[..., None], axis=-1)[..., 0]
      confidence = jnp.exp(chosen - jax.nn.logsumexp(logits, axis=-1))
    else:
      confidence = jax.random.uniform(confidence_key, x0.shape)
    current = jax.lax.dynamic_slice_in_dim(tokens, start, block_length, axis=1)
    masked = current == mask_id
    confidence = jnp.where(masked, confidence, -jnp.inf)
    count = schedule[:, step_in_block]
    reveal = masked & (_rank_descending(confidence) < count[:, None])
    current = jnp.where(reveal, x0.astype(tokens.dtype), current)
    tokens = jax.lax.dynamic_update_slice_in_dim(tokens, current, start, axis=1)
    offset = block * block_length
    seen = jax.lax.dynamic_slice_in_dim(reveal_step, offset, block_length, axis=1)
    seen = jnp.where(reveal, global_step, seen)
    reveal_step = jax.lax.dynamic_update_slice_in_dim(reveal_step, seen, offset, axis=1)
    return tokens, reveal_step

  def run_block(carry):
    block, tokens, reveal_step, _ = carry
    start = prompt_len + block * block_length
    current = jax.lax.dynamic_slice_in_dim(tokens, start, block_length, axis=1)
    schedule = num_transfer_tokens(jnp.sum(current == mask_id, axis=1), steps_per_block)
    tokens, reveal_step = jax.lax.fori_loop(
        0, steps_per_block,
        lambda i, c: step(block, i, schedule, *c), (tokens, reveal_step))
    decoded = jnp.arange(gen_length) < (block + 1) * block_length
    has_eos = jnp.any((tokens[:, prompt_len:] == eos_id) & decoded[None, :], axis=1)
    done = stop_at_eos & jnp.all(has_eos)
    return block + 1, tokens, reveal_step, done

  def keep_going(carry):
    block, _, _, done = carry
    return (block < num_blocks) & ~done

  reveal_step = jnp.full((batch, gen_length), -1, jnp.int32)
  init = (jnp.int32(0), tokens, reveal_step, jnp.bool_(False))
  _, tokens, reveal_step, _ = jax.lax.while_loop(keep_going, run_block, init)
  if stop_at_eos:
    completion = _fill_after_eos(tokens[:, prompt_len:], eos_id)
    tokens = tokens.at[:, prompt_len:].set(completion)
  return tokens, reveal_step


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


def check_settings(*, gen_length: int, steps: int, block_length: int, temperature: float = 0.0,
                   remasking: str = "low_confidence", cfg_scale: float = 0.0) -> None:
  """Raises ValueError unless `generate` accepts these options (cheap: nothing is compiled)."""
  if gen_length <= 0 or block_length <= 0 or steps <= 0:
    raise ValueError("gen_length, block_length and steps must be positive")
  if gen_length % block_length:
    raise ValueError(f"gen_length ({gen_length}) must be a multiple of block_length "
                     f"({block_length})")
  num_blocks = gen_length // block_length
  if steps % num_blocks:
    raise ValueError(f"steps ({steps}) must be a multiple of the number of blocks ({num_blocks})")
  if remasking not in REMASKING:
    raise ValueError(f"remasking must be one of {REMASKING}, got {remasking!r}")
  if temperature < 0 or cfg_scale < 0:
    raise ValueError("temperature and cfg_scale must be >= 0")


def generate(model: nnx.Module, prompt_tokens: Array, *, key: Array, gen_length: int, steps: int,
             block_length: int, temperature: float = 0.0, remasking: str = "low_confidence",
             cfg_scale: float = 0.0, prompt_mask: Array | None = None, stop_at_eos: bool = False,
             return_reveal_step: bool = False) -> Array | tuple[Array, Array]:
  """Sample completions of `prompt_tokens` by low-confidence remasking (SPEC section 7).

  Args:
    model: an NNX module with `config` (mask_token_id, eos_token_id, vocab_size, embedding_size),
      `encode(tokens, attention_mask, span=(start, n)) -> [B, n, D]` (hidden states of positions
      start..start+n-1) and `unembed(hidden) -> logits`, e.g. LLaDA.
    prompt_tokens: [B, P] int prompts (left-pad ragged prompts and pass `prompt_mask`).
    key: PRNG key; greedy decoding (temperature 0, low_confidence) does not use it.
    gen_length: completion length G, a multiple of block_length.
    steps: total denoising steps, a multiple of G / block_length (the number of blocks).
    block_length: semi-autoregressive block size.
    temperature: Gumbel-max temperature T (0: argmax).
    remasking: "low_confidence" (reveal the most probable predictions first) or "random".
    cfg_scale: classifier-free guidance weight (0: off; > 0 doubles the batch of each forward).
    prompt_mask: [B, P] bool, True for real prompt tokens; False positions (padding) are excluded
      from attention. None: all prompt positions are real.
    stop_at_eos: after each block, stop once every row has an EOS in its decoded part, and set
      every token after a row's first EOS to EOS. The tokens up to the first EOS are the same as
      without stopping (those positions are already final when a block ends).
    return_reveal_step: also return the global step at which each completion position was revealed.

  Returns:
    tokens [B, P + G]: the prompt untouched, then the completion (no mask token left unless
    stop_at_eos filled it with EOS). With return_reveal_step, also reveal_step [B, G] int32
    (-1 for positions never decoded because of stop_at_eos).
  """
  prompt_tokens, prompt_mask = check_prompts(prompt_tokens, prompt_mask)
  check_settings(gen_length=gen_length, steps=steps, block_length=block_length,
                 temperature=temperature, remasking=remasking, cfg_scale=cfg_scale)
  graphdef, state = nnx.split(model)
  tokens, reveal_step = _generate(
      graphdef, state, prompt_tokens.astype(jnp.int32), prompt_mask, key,
      gen_length=gen_length, steps=steps, block_length=block_length,
      temperature=float(temperature), remasking=remasking, cfg_scale=float(cfg_scale),
      stop_at_eos=bool(stop_at_eos))
  return (tokens, reveal_step) if return_reveal_step else tokens
