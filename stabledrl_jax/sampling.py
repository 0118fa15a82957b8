"""Diffusion sampling: LLaDA's semi-autoregressive low-confidence remasking, as one jitted function.

The completion starts as `gen_length` mask tokens, split into blocks of `block_length` decoded
left to right; `steps` are split evenly over the blocks. At each step of a block:

1. logits of the current sequence (optionally with classifier-free guidance:
   logits = uncond + (cfg_scale + 1) * (cond - uncond), the unconditional pass seeing the prompt
   replaced by mask tokens);
2. x0 ~ softmax(logits / T): the law of LLaDA's Gumbel-max argmax(exp(logits) / (-log u)^T),
   drawn by inverse CDF with one uniform per position (`categorical`; T = 0: greedy argmax, no
   randomness);
3. confidence = p(x0) under softmax(logits) (`low_confidence`) or U(0, 1) (`random`), and -inf
   outside the still-masked positions of the current block;
4. the k most confident positions take their x0, with LLaDA's schedule: a block with n masked
   tokens and s steps reveals n // s tokens per step, the first n % s steps one more.

Threshold decoding (`remasking="threshold"`, as Fast-dLLM's parallel decoding) replaces the
schedule of step 4: every masked position of the block whose confidence exceeds tau is revealed,
and the most confident one in any case, until the block has no mask left. The number of model
calls then follows the model's confidence (one per block when it is sure of every token, one per
token when it is sure of none); `return_stats=True` reports it per sequence.

Block-wise KV caching (`cache`, Fast-dLLM's prefix and dual caches) trades exactness for
speed: a block's first call is the full pass and also returns every layer's keys and values of
every position; its later calls reuse them. "dual" runs only the block's positions (the prompt,
the decoded blocks and the masked suffix through the cache); "prefix" runs the positions from the
block to the end (the prompt and the decoded blocks through the cache). Attention is
bidirectional, so within a block the cached context is stale: the result is approximate, exact
with one step per block.

Only the current block can be revealed, so only its logits are computed: `model.encode(...,
span=(block start, block_length))` runs the last transformer block for the block's queries only,
and `model.unembed` projects those hidden states alone. The result equals slicing full logits;
the output projection, the largest matmul of a small model, shrinks by L / block_length.

Jitting: `generate` splits the NNX model into (graphdef, state) with `nnx.split` and calls one
`jax.jit`-compiled pure function that merges them back inside (`nnx.merge`); the shapes and the
sampling options are static arguments, the state, prompt and key are traced. The blocks run in a
`lax.while_loop` and the steps of a block in a `lax.fori_loop` (threshold decoding: a
`lax.while_loop` that ends when the block has no mask left): no host round trip per step. Each
step draws its noise from `fold_in(key, global_step)`, so results are reproducible from the key.

Differences from the reference loop, by design: the mask token and, with embedding_size >
vocab_size, the padding rows of the head are never sampled (their logits are set to -inf before
sampling and before the softmax of the confidence), so a revealed position never holds a mask
token, even for an untrained model; prompt positions are never rewritten (a mask token inside the
prompt stays as it is); ties in confidence go to the leftmost position.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array

REMASKING = ("low_confidence", "random", "threshold")
# Block-wise KV caching (Fast-dLLM): "none" (exact), "prefix" or "dual" (the module docstring).
CACHES = ("none", "prefix", "dual")


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


def _fill_after_eos(completion: Array, eos_token_id: int) -> Array:
  """Every token after the first EOS becomes EOS."""
  return jnp.where(completion_mask(completion, 0, eos_token_id), completion, eos_token_id)


def categorical(key: Array, logits: Array, temperature: float) -> Array:
  """Draws x ~ softmax(logits / T) over the last axis: [..., V] -> [...] int32.

  The same law as Gumbel-max, argmax(logits + T g), with one uniform per draw instead of V
  Gumbel variates (their generation took a fifth of a sampling step of the 16k-vocabulary `small`
  model on CPU): the inverse CDF, found in two levels (chunks of about sqrt(V) tokens, then a
  token inside the chunk) so that both cumulative sums are short, cheap and accurate in float32. Tokens with zero
  probability (logit -inf, or underflowing exp) are never drawn.
  """
  return categorical_from_uniform(jax.random.uniform(key, logits.shape[:-1]), logits,
                                  temperature)


def categorical_from_uniform(uniform: Array, logits: Array, temperature: float) -> Array:
  """``categorical`` given its uniform draw [...] in [0, 1): the inverse CDF of softmax(logits / T)."""
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


def _rank_descending(values: Array) -> Array:
  """[B, n] -> rank of each entry in descending order (0 = largest; ties: leftmost first)."""
  order = jnp.argsort(-values, axis=-1, stable=True)
  return jnp.argsort(order, axis=-1, stable=True)


def _reveal(confidence: Array, masked: Array, count: Array | None,
            threshold: float | None) -> Array:
  """[B, n] bool: the masked positions revealed at a step.

  With a schedule (`count` [B]), the `count` most confident; with a `threshold`, every position
  whose confidence exceeds it, and the most confident one in any case (so each step reveals at
  least one token while any is masked).
  """
  rank = _rank_descending(jnp.where(masked, confidence, -jnp.inf))
  if threshold is None:
    return masked & (rank < count[:, None])
  return masked & ((confidence > threshold) | (rank == 0))


def _constrain_kv(x: Array) -> Array:
  """A KV cache [n_layers, B, L, K, hd] pinned to the batch's mesh axes (``constrain``)."""
  from stabledrl_jax.models.sharding import constrain  # pylint: disable=g-import-not-at-top
  return constrain(x, (None, "batch") + (None,) * (x.ndim - 2))


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "gen_length", "steps", "block_length", "temperature",
                     "remasking", "threshold", "cfg_scale", "stop_at_eos", "cache"))
def _generate(graphdef: Any, state: Any, prompt: Array, prompt_mask: Array | None, key: Array, *,
              gen_length: int, steps: int, block_length: int, temperature: float,
              remasking: str, threshold: float, cfg_scale: float, stop_at_eos: bool,
              cache: str = "none") -> tuple[Array, Array, dict[str, Array]]:
  model = nnx.merge(graphdef, state)
  config = model.config
  mask_id, eos_id = config.mask_token_id, config.eos_token_id
  batch, prompt_len = prompt.shape
  num_blocks = gen_length // block_length
  dynamic = remasking == "threshold"
  # Steps of a block: fixed, or at most one per token when each step reveals at least one. Step
  # keys are fold_in(key, block * max_steps + step), so threshold decoding with nothing above the
  # threshold draws the same noise as low_confidence with steps = gen_length.
  max_steps = block_length if dynamic else steps // num_blocks

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

  def model_inputs(tokens: Array) -> Array:
    if cfg_scale > 0:
      unconditional = jnp.where(is_prompt[None, :], mask_id, tokens)
      return jnp.concatenate([tokens, unconditional], axis=0)
    return tokens

  def block_hidden(inputs: Array, start: Array, kv: Any, refresh: bool) -> tuple[Array, Any]:
    """Hidden states [B', block_length, D] of the block at `start`, and the KV cache.

    Exact (cache "none"): a pass over the whole sequence, the last layer for the block's
    queries only. Cached: the block's first step (`refresh`, static) is that pass, which also
    writes every layer's keys and values of every position into the carried cache `kv`; later
    steps read it and return it untouched: they run only the block (dual: the prefix's and the
    suffix's keys and values from the cache) or the sequence from the block on (prefix: the
    decoded blocks' and the prompt's keys and values from the cache; one branch per block, each
    of static length, the cache an operand of the branches, never one of their results).
    """
    if cache == "none":
      return model.encode(inputs, attention_mask, span=(start, block_length)), kv
    if refresh:
      if writes_in_place:  # Into the loop-carried buffer: no second copy of the cache.
        hidden, kv = model.encode_kv(inputs, attention_mask, span=(start, block_length), cache=kv)
      else:
        hidden, kv = model.encode_kv(inputs, attention_mask, span=(start, block_length))
      return hidden, jax.tree.map(_constrain_kv, kv)
    if cache == "dual":
      block = jax.lax.dynamic_slice_in_dim(inputs, start, block_length, axis=1)
      return model.encode_cached(block, start, kv, attention_mask), kv

    def reuse_from(b):
      """Prefix cache in block b: positions from the block to the end run (a static length
      per block, hence one branch per block)."""
      begin = prompt_len + b * block_length

      def run(inputs, kv):
        return model.encode_cached(inputs[:, begin:], begin, kv, attention_mask)[:, :block_length]

      return run

    branches = [reuse_from(b) for b in range(num_blocks)]
    return jax.lax.switch((start - prompt_len) // block_length, branches, inputs, kv), kv

  def block_logits(tokens: Array, start: Array, kv: Any, refresh: bool) -> tuple[Array, Any]:
    """[B, block_length, V] float32 logits of the block starting at `start`, and the cache."""
    hidden, kv = block_hidden(model_inputs(tokens), start, kv, refresh)
    logits = model.unembed(hidden).astype(jnp.float32)
    if cfg_scale > 0:
      cond, uncond = logits[:batch], logits[batch:]
      logits = uncond + (cfg_scale + 1.0) * (cond - uncond)
    vocab = jnp.arange(logits.shape[-1])
    valid = (vocab < config.vocab_size) & (vocab != mask_id)
    return jnp.where(valid, logits, -jnp.inf), kv

  def step(block: Array, step_in_block: Array, schedule: Array | None, carry, refresh=False):
    """One model call: predict the current block, reveal some of its masked positions
    (`refresh`: the cached samplers' first step of a block, which rebuilds the cache)."""
    tokens, reveal_step, calls, kv = carry
    global_step = block * max_steps + step_in_block
    step_key = jax.random.fold_in(key, global_step)
    noise_key, confidence_key = jax.random.split(step_key)
    start = prompt_len + block * block_length
    logits, kv = block_logits(tokens, start, kv, refresh)
    if temperature > 0:
      x0 = categorical(noise_key, logits, temperature)
    else:
      x0 = jnp.argmax(logits, axis=-1)
    if remasking == "random":
      confidence = jax.random.uniform(confidence_key, x0.shape)
    else:
      chosen = jnp.take_along_axis(logits, x0[..., None], axis=-1)[..., 0]
      confidence = jnp.exp(chosen - jax.nn.logsumexp(logits, axis=-1))
    current = jax.lax.dynamic_slice_in_dim(tokens, start, block_length, axis=1)
    masked = current == mask_id
    count = None if dynamic else schedule[:, step_in_block]
    reveal = _reveal(confidence, masked, count, threshold if dynamic else None)
    # A fixed schedule calls the model at every step; threshold decoding runs until the slowest
    # row of the batch is done, and a row counts the steps at which it still had masks.
    calls = calls + (jnp.any(masked, axis=1).astype(jnp.int32) if dynamic else 1)
    current = jnp.where(reveal, x0.astype(tokens.dtype), current)
    tokens = jax.lax.dynamic_update_slice_in_dim(tokens, current, start, axis=1)
    offset = block * block_length
    seen = jax.lax.dynamic_slice_in_dim(reveal_step, offset, block_length, axis=1)
    seen = jnp.where(reveal, global_step, seen)
    reveal_step = jax.lax.dynamic_update_slice_in_dim(reveal_step, seen, offset, axis=1)
    return tokens, reveal_step, calls, kv

  def decode_block(block: Array, carry):
    """Runs the steps of one block; returns the carry and the number of model calls made.

    Cached: the block's first step, which rebuilds the cache, runs before the loop over the
    others (no `lax.cond` between a rebuilding and a reading step, whose result would need a
    buffer of its own for the cache); a block starts fully masked, so threshold decoding always
    runs that step too.
    """
    tokens = carry[0]
    start = prompt_len + block * block_length
    first = 0
    if cache != "none":
      if not dynamic:
        current = jax.lax.dynamic_slice_in_dim(tokens, start, block_length, axis=1)
        schedule = num_transfer_tokens(jnp.sum(current == mask_id, axis=1), max_steps)
      carry = step(block, jnp.int32(0), None if dynamic else schedule, carry, refresh=True)
      first = 1
    if not dynamic:
      if cache == "none":
        current = jax.lax.dynamic_slice_in_dim(tokens, start, block_length, axis=1)
        schedule = num_transfer_tokens(jnp.sum(current == mask_id, axis=1), max_steps)
      carry = jax.lax.fori_loop(first, max_steps, lambda i, c: step(block, i, schedule, c),
                                carry)
      return carry, jnp.int32(max_steps)

    def any_masked(inner):
      i, (tokens, _, _, _) = inner
      current = jax.lax.dynamic_slice_in_dim(tokens, start, block_length, axis=1)
      return (i < max_steps) & jnp.any(current == mask_id)

    num_steps, carry = jax.lax.while_loop(
        any_masked, lambda inner: (inner[0] + 1, step(block, inner[0], None, inner[1])),
        (jnp.int32(first), carry))
    return carry, num_steps

  def run_block(outer):
    block, carry, passes, _ = outer
    carry, num_steps = decode_block(block, carry)
    tokens = carry[0]
    decoded = jnp.arange(gen_length) < (block + 1) * block_length
    has_eos = jnp.any((tokens[:, prompt_len:] == eos_id) & decoded[None, :], axis=1)
    done = stop_at_eos & jnp.all(has_eos)
    return block + 1, carry, passes + num_steps, done

  def keep_going(outer):
    block, _, _, done = outer
    return (block < num_blocks) & ~done

  reveal_step = jnp.full((batch, gen_length), -1, jnp.int32)
  calls = jnp.zeros((batch,), jnp.int32)
  kv = None
  # Whether the model's encode_kv writes into a given cache (LLaDA's does).
  writes_in_place = cache != "none" and "cache" in inspect.signature(model.encode_kv).parameters
  if cache != "none":  # Filled at each block's first step.
    shapes = jax.eval_shape(lambda t: model.encode_kv(model_inputs(t), attention_mask,
                                                      span=(prompt_len, block_length))[1], tokens)
    # Rows split as the batch's (without the pin GSPMD may keep the whole cache on every device).
    kv = jax.tree.map(lambda x: _constrain_kv(jnp.zeros(x.shape, x.dtype)), shapes)
  init = (jnp.int32(0), (tokens, reveal_step, calls, kv), jnp.int32(0), jnp.bool_(False))
  _, (tokens, reveal_step, calls, _), passes, _ = jax.lax.while_loop(keep_going, run_block, init)
  if stop_at_eos:
    completion = _fill_after_eos(tokens[:, prompt_len:], eos_id)
    tokens = tokens.at[:, prompt_len:].set(completion)
  return tokens, reveal_step, {"model_calls": calls, "forward_passes": passes}


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
                   remasking: str = "low_confidence", threshold: float = 0.9,
                   cfg_scale: float = 0.0, cache: str = "none") -> None:
  """Raises ValueError unless `generate` accepts these options (cheap: nothing is compiled).

  Threshold decoding does not use `steps`.
  """
  if remasking not in REMASKING:
    raise ValueError(f"remasking must be one of {REMASKING}, got {remasking!r}")
  if cache not in CACHES:
    raise ValueError(f"cache must be one of {CACHES}, got {cache!r}")
  dynamic = remasking == "threshold"
  if gen_length <= 0 or block_length <= 0 or (steps <= 0 and not dynamic):
    raise ValueError("gen_length, block_length and steps must be positive")
  if gen_length % block_length:
    raise ValueError(f"gen_length ({gen_length}) must be a multiple of block_length "
                     f"({block_length})")
  num_blocks = gen_length // block_length
  if not dynamic and steps % num_blocks:
    raise ValueError(f"steps ({steps}) must be a multiple of the number of blocks ({num_blocks})")
  if dynamic and not 0.0 <= threshold <= 1.0:
    raise ValueError(f"threshold must lie in [0, 1], got {threshold}")
  if temperature < 0 or cfg_scale < 0:
    raise ValueError("temperature and cfg_scale must be >= 0")


def generate(model: nnx.Module, prompt_tokens: Array, *, key: Array, gen_length: int, steps: int,
             block_length: int, temperature: float = 0.0, remasking: str = "low_confidence",
             threshold: float = 0.9, cfg_scale: float = 0.0, prompt_mask: Array | None = None,
             stop_at_eos: bool = False, return_reveal_step: bool = False,
             return_stats: bool = False, cache: str = "none") -> Array | tuple[Array, ...]:
  """Sample completions of `prompt_tokens` by low-confidence remasking (docs/models.md, "Sampling").

  Args:
    model: an NNX module with `config` (mask_token_id, eos_token_id, vocab_size, embedding_size),
      `encode(tokens, attention_mask, span=(start, n)) -> [B, n, D]` (hidden states of positions
      start..start+n-1) and `unembed(hidden) -> logits`, e.g. LLaDA.
    prompt_tokens: [B, P] int prompts (left-pad ragged prompts and pass `prompt_mask`).
    key: PRNG key; greedy decoding (temperature 0, low_confidence or threshold) does not use it.
    gen_length: completion length G, a multiple of block_length.
    steps: total denoising steps, a multiple of G / block_length (the number of blocks); ignored
      by threshold decoding, whose number of steps depends on the model's confidence.
    block_length: semi-autoregressive block size.
    temperature: Gumbel-max temperature T (0: argmax).
    remasking: "low_confidence" (reveal the most probable predictions first, LLaDA's schedule),
      "random" (random positions, LLaDA's schedule) or "threshold" (each step reveals every
      masked position of the block whose confidence p(x0) exceeds `threshold`, and the most
      confident one in any case; a block ends when no mask is left, after 1 to block_length
      model calls).
    threshold: tau of threshold decoding, in [0, 1]: tau = 1 reveals one token per step (the
      low_confidence order with steps = gen_length), tau = 0 a whole block per step.
    cfg_scale: classifier-free guidance weight (0: off; > 0 doubles the batch of each forward).
    prompt_mask: [B, P] bool, True for real prompt tokens; False positions (padding) are excluded
      from attention. None: all prompt positions are real.
    stop_at_eos: after each block, stop once every row has an EOS in its decoded part, and set
      every token after a row's first EOS to EOS. The tokens up to the first EOS are the same as
      without stopping (those positions are already final when a block ends).
    return_reveal_step: also return the global step at which each completion position was revealed
      (block * steps_per_block + step in block; threshold decoding: block * block_length + step).
    cache: "none" (exact), or block-wise KV caching (Fast-dLLM; approximate, since attention is
      bidirectional): each block's first step runs the whole sequence and keeps every layer's
      keys and values; the block's later steps reuse them. "dual": only the block's positions
      run, the prefix and the suffix seen through the cache. "prefix": the sequence from the
      block on runs (its suffix of masks fresh at every step), the prompt and the decoded blocks
      through the cache. With one step per block both equal the exact sampler. The model needs
      ``encode_kv`` and ``encode_cached`` (LLaDA has them).
    return_stats: also return a dict with `model_calls` [B] int32, the model calls each sequence
      needed (every step of every decoded block with a fixed schedule; with threshold decoding the
      steps at which it still had masked tokens in the current block), and `forward_passes` [],
      the batched forward passes run (threshold decoding: each block runs until its slowest row
      is done).

  Returns:
    tokens [B, P + G]: the prompt untouched, then the completion (no mask token left unless
    stop_at_eos filled it with EOS). With return_reveal_step, also reveal_step [B, G] int32
    (-1 for positions never decoded because of stop_at_eos); with return_stats, then the stats.
  """
  prompt_tokens, prompt_mask = check_prompts(prompt_tokens, prompt_mask)
  check_settings(gen_length=gen_length, steps=steps, block_length=block_length,
                 temperature=temperature, remasking=remasking, threshold=threshold,
                 cfg_scale=cfg_scale, cache=cache)
  dynamic = remasking == "threshold"
  graphdef, state = nnx.split(model)
  tokens, reveal_step, stats = _generate(
      graphdef, state, prompt_tokens.astype(jnp.int32), prompt_mask, key,
      gen_length=gen_length, steps=0 if dynamic else steps, block_length=block_length,
      temperature=float(temperature), remasking=remasking,
      threshold=float(threshold) if dynamic else 0.0, cfg_scale=float(cfg_scale),
      stop_at_eos=bool(stop_at_eos), cache=cache)
  out = (tokens,) + ((reveal_step,) if return_reveal_step else ()) + (
      (stats,) if return_stats else ())
  return out if len(out) > 1 else tokens
