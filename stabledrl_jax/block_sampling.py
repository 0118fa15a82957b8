"""Block diffusion sampling (SDAR): blocks decoded left to right, a KV cache of finished blocks.

Blocks are fixed by absolute position (block j = positions [j bs, (j + 1) bs), bs = the model's
block_size), as in SDAR's `generate.py`: the prompt fills the first P positions, the completion
the next G, and the sequence is decoded up to the end of the block holding position P + G - 1
(positions past P + G are decoded with their block, then dropped). The prompt's full blocks are
prefilled into the cache in one pass; the block holding the prompt's tail (if P is not a multiple
of bs) is decoded with its prompt positions fixed.

Each block starts as mask tokens and is denoised in at most `steps` steps. One step:

1. logits of the block (the model sees the cache of the finished blocks and the block itself);
   the mask token is never predicted;
2. x0 ~ softmax(logits / T) (`sampling.categorical`: the law of SDAR's Gumbel-max draw, one
   uniform per position; T = 0: argmax); confidence = that distribution's probability of x0
   (SDAR's x0_p);
3. among the still-masked positions of the block, reveal
   * `low_confidence_static`: the n_s most confident, n_s from the even schedule over the steps
     (`sampling.num_transfer_tokens`: a block with n masked tokens and s steps reveals n // s per
     step, the first n % s steps one more), at least one;
   * `low_confidence_dynamic`: every position whose confidence exceeds `threshold` (tau, 0.9),
     or the n_s most confident if fewer than n_s pass it (SDAR's rule), at least one;
   a block whose positions are all revealed stops early (the dynamic rule often needs fewer
   steps than `steps`).
4. once the block is complete, one more pass writes its keys and values into the cache
   (`model.extend(..., commit=True)`), as SDAR's `store_kv` pass does.

EOS (`stop_at_eos`, the default): after each block, a row whose completion holds a stop token is
finished; its later blocks are filled with EOS without being denoised, the loop ends once every
row is finished, and every token after a row's first stop token is set to EOS.

`use_cache=False` decodes the same way without a cache: every step runs the block-causal model
over the whole sequence (the last layer and the output head on the current block only). Greedy
decoding gives the same tokens either way (a test checks it); the cache makes a step cost
O(bs x T) attention and O(bs) everything else, instead of O(T).

Jitting follows `sampling.py`: `generate` splits the NNX model (`nnx.split`) and calls one
`jax.jit`-compiled function with static shapes and options; the blocks run in a
`lax.while_loop`, the steps of a block in another; each step draws its noise from
`fold_in(key, block * steps + step)`, so results are reproducible from the key.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from stabledrl_jax.sampling import categorical, check_prompts, num_transfer_tokens

Array = jax.Array

REMASKING = ("low_confidence_static", "low_confidence_dynamic")


def _rank_descending(values: Array) -> Array:
  """[B, n] -> rank of each entry in descending order (0 = largest; ties: leftmost first)."""
  order = jnp.argsort(-values, axis=-1, stable=True)
  return jnp.argsort(order, axis=-1, stable=True)


def _fill_after_stop(completion: Array, stop_ids: Array, eos_id: int) -> Array:
  """Every token after the first stop token becomes `eos_id`."""
  is_stop = jnp.isin(completion, stop_ids)
  after = jnp.cumsum(is_stop, axis=1) - is_stop.astype(jnp.int32) > 0
  return jnp.where(after, eos_id, completion)


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "gen_length", "steps", "temperature", "remasking", "threshold",
                     "stop_at_eos", "stop_ids", "use_cache"))
def _generate(graphdef: Any, state: Any, prompt: Array, prompt_mask: Array | None, key: Array, *,
              gen_length: int, steps: int, temperature: float, remasking: str, threshold: float,
              stop_at_eos: bool, stop_ids: tuple[int, ...],
              use_cache: bool) -> tuple[Array, Array, dict[str, Array]]:
  model = nnx.merge(graphdef, state)
  config = model.config
  bs, mask_id = config.block_size, config.mask_token_id
  batch, prompt_len = prompt.shape
  end = prompt_len + gen_length
  num_blocks = -(-end // bs)
  total = num_blocks * bs
  first_block = prompt_len // bs
  stops = jnp.asarray(stop_ids, jnp.int32)
  eos_id = stop_ids[0]

  tokens = jnp.concatenate([prompt, jnp.full((batch, total - prompt_len), mask_id, prompt.dtype)],
                           axis=1)
  key_mask = None
  if prompt_mask is not None:
    key_mask = jnp.concatenate(
        [prompt_mask.astype(bool), jnp.ones((batch, total - prompt_len), bool)], axis=1)
  vocab = jnp.arange(config.vocab_size)
  valid = vocab != mask_id

  cache = ()
  if use_cache:
    cache = model.init_cache(batch, total, key_mask)
    if first_block > 0:
      _, cache = model.extend(tokens[:, :first_block * bs], cache, commit=True)

  def block_logits(tokens: Array, current: Array, start: Array, cache: Any) -> Array:
    """[B, bs, V] float32 logits of the block at `start` holding `current`."""
    if use_cache:
      hidden, _ = model.extend(current, cache, commit=False)
    else:
      tokens = jax.lax.dynamic_update_slice_in_dim(tokens, current, start, axis=1)
      hidden = model.encode(tokens, key_mask, span=(start, bs))
    logits = model.unembed(hidden).astype(jnp.float32)
    return jnp.where(valid, logits, -jnp.inf)

  def step(block, i, schedule, free, current, reveal, tokens, cache):
    global_step = block * steps + i
    noise_key = jax.random.fold_in(key, global_step)
    start = block * bs
    logits = block_logits(tokens, current, start, cache)
    if temperature > 0:
      x0 = categorical(noise_key, logits, temperature)
      logits = logits / temperature  # The confidence is the sampled distribution's.
    else:
      x0 = jnp.argmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, x0[..., None], axis=-1)[..., 0]
    confidence = jnp.exp(chosen - jax.nn.logsumexp(logits, axis=-1))
    masked = (current == mask_id) & free
    confidence = jnp.where(masked, confidence, -jnp.inf)
    count = jnp.maximum(schedule[:, i], 1)[:, None]
    reveal_now = masked & (_rank_descending(confidence) < count)
    if remasking == "low_confidence_dynamic":
      confident = masked & (confidence > threshold)
      enough = jnp.sum(confident, axis=1, keepdims=True) >= count
      reveal_now = jnp.where(enough, confident, reveal_now)
    current = jnp.where(reveal_now, x0.astype(current.dtype), current)
    reveal = jnp.where(reveal_now, global_step, reveal)
    # The loop runs until the slowest row is done; a row counts the calls it still needed.
    return current, reveal, jnp.any(masked, axis=1).astype(jnp.int32)

  def run_block(carry):
    block, tokens, cache, done, reveal_step, calls = carry
    start = block * bs
    free = (start + jnp.arange(bs) >= prompt_len)[None, :]  # positions the sampler may write
    current = jax.lax.dynamic_slice_in_dim(tokens, start, bs, axis=1)
    if stop_at_eos:  # finished rows are not decoded any further
      current = jnp.where(done[:, None] & free, eos_id, current)
    schedule = num_transfer_tokens(jnp.sum((current == mask_id) & free, axis=1), steps)
    reveal = jax.lax.dynamic_slice_in_dim(reveal_step, start, bs, axis=1)

    def keep_denoising(inner):
      i, current, _, _ = inner
      return (i < steps) & jnp.any((current == mask_id) & free)

    def denoise(inner):
      i, current, reveal, calls = inner
      current, reveal, called = step(block, i, schedule, free, current, reveal, tokens, cache)
      return i + 1, current, reveal, calls + called

    _, current, reveal, calls = jax.lax.while_loop(keep_denoising, denoise,
                                                     (jnp.int32(0), current, reveal, calls))
    tokens = jax.lax.dynamic_update_slice_in_dim(tokens, current, start, axis=1)
    reveal_step = jax.lax.dynamic_update_slice_in_dim(reveal_step, reveal, start, axis=1)
    if use_cache:
      _, cache = model.extend(current, cache, commit=True)
    in_completion = free & (start + jnp.arange(bs) < end)[None, :]
    done = done | jnp.any(jnp.isin(current, stops) & in_completion, axis=1)
    return block + 1, tokens, cache, done, reveal_step, calls

  def keep_going(carry):
    block, _, _, done, _, _ = carry
    return (block < num_blocks) & ~(stop_at_eos & jnp.all(done))

  reveal_step = jnp.full((batch, total), -1, jnp.int32)
  init = (jnp.int32(first_block), tokens, cache, jnp.zeros(batch, bool), reveal_step,
          jnp.zeros(batch, jnp.int32))
  _, tokens, _, _, reveal_step, calls = jax.lax.while_loop(keep_going, run_block, init)
  tokens, reveal_step = tokens[:, :end], reveal_step[:, prompt_len:end]
  if stop_at_eos:
    completion = _fill_after_stop(tokens[:, prompt_len:], stops, eos_id)
    completion = jnp.where(completion == mask_id, eos_id, completion)  # blocks never run
    tokens = tokens.at[:, prompt_len:].set(completion)
  return tokens, reveal_step, {"model_calls": calls}


def generate(model: nnx.Module, prompt_tokens: Array, *, key: Array, gen_length: int,
             steps: int, temperature: float = 0.0, remasking: str = "low_confidence_dynamic",
             threshold: float = 0.9, prompt_mask: Array | None = None, stop_at_eos: bool = True,
             eos_token_ids: Sequence[int] | None = None, use_cache: bool = True,
             return_reveal_step: bool = False,
             return_stats: bool = False) -> Array | tuple[Array, ...]:
  """Sample completions block by block from a block diffusion model (docs/block_diffusion.md).

  Args:
    model: an SDAR model (or any NNX module with `config` (block_size, mask_token_id,
      eos_token_id, vocab_size), `init_cache`, `extend`, `encode(tokens, mask, span=...)` and
      `unembed`).
    prompt_tokens: [B, P] int prompts (left-pad ragged prompts and pass `prompt_mask`; blocks are
      fixed by absolute position, so padding by a multiple of block_size leaves the result as
      without padding).
    key: PRNG key; greedy decoding (temperature 0) does not use it.
    gen_length: completion length G.
    steps: denoising steps per block, at most (SDAR's `denoising_steps`).
    temperature: sampling temperature T (0: argmax).
    remasking: 'low_confidence_static' or 'low_confidence_dynamic' (see the module docstring).
    threshold: tau of 'low_confidence_dynamic'.
    prompt_mask: [B, P] bool, True for real prompt tokens; False positions are never attended to.
    stop_at_eos: stop decoding a row after the block holding its first stop token, and set every
      token after that stop token to EOS (False: decode every block).
    eos_token_ids: stop tokens (default: the config's stop_token_ids); the first one fills.
    use_cache: decode with the KV cache of finished blocks (True) or recompute every step.
    return_reveal_step: also return the global step (block * steps + step) at which each
      completion position was revealed (-1: filled after a stop token, never decoded).
    return_stats: also return a dict with `model_calls` [B] int32, the denoising calls each
      sequence needed (steps at which its current block still had a mask; the cache writes of
      finished blocks are not counted).

  Returns:
    tokens [B, P + G]: the prompt untouched, then the completion. With return_reveal_step, also
    reveal_step [B, G] int32; with return_stats, then the stats.
  """
  prompt_tokens, prompt_mask = check_prompts(prompt_tokens, prompt_mask)
  if gen_length <= 0 or steps <= 0:
    raise ValueError("gen_length and steps must be positive")
  if remasking not in REMASKING:
    raise ValueError(f"remasking must be one of {REMASKING}, got {remasking!r}")
  if temperature < 0:
    raise ValueError("temperature must be >= 0")
  stop_ids = tuple(int(t) for t in (eos_token_ids if eos_token_ids is not None
                                    else model.config.stop_token_ids))
  if not stop_ids:
    raise ValueError("eos_token_ids must not be empty")
  graphdef, state = nnx.split(model)
  tokens, reveal_step, stats = _generate(
      graphdef, state, prompt_tokens.astype(jnp.int32), prompt_mask, key,
      gen_length=gen_length, steps=steps, temperature=float(temperature), remasking=remasking,
      threshold=float(threshold), stop_at_eos=bool(stop_at_eos), stop_ids=stop_ids,
      use_cache=bool(use_cache))
  out = (tokens,) + ((reveal_step,) if return_reveal_step else ()) + (
      (stats,) if return_stats else ())
  return out if len(out) > 1 else tokens
