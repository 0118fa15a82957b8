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
2. x0 ~ softmax(logits / T) (`sampler_lib.categorical`: the law of SDAR's Gumbel-max draw, one
   uniform per position; T = 0: argmax); confidence = that distribution's probability of x0
   (SDAR's x0_p);
3. among the still-masked positions of the block, reveal
   * `low_confidence_static`: the n_s most confident, n_s from the even schedule over the steps
     (`sampler_lib.num_transfer_tokens`: a block with n masked tokens and s steps reveals n // s per
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

Jitting follows LLaDA's sampler (`models/llada/sampler.py`): `generate` splits the NNX model
(`nnx.split`) and calls one `jax.jit`-compiled function with static shapes and options (a
`Sampling` record); `_Decoder.step` is one model call and reveal, `_Decoder.run_block` one block
(a `lax.while_loop` over its steps), and the blocks run in another `lax.while_loop` carrying a
`SamplerState`; each step draws its noise from `fold_in(key, block * steps + step)`, so results
are reproducible from the key.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from stabledrl_jax.models.sampler_lib import (categorical, check_prompts, fill_after_stop,
                                              num_transfer_tokens, outputs, rank_descending)

Array = jax.Array

REMASKING = ("low_confidence_static", "low_confidence_dynamic")


@dataclasses.dataclass(frozen=True)
class Sampling:
  """The options of one SDAR decoding (``generate`` documents each, with their defaults);
  static, hashable.

  ``steps`` is per block (at most: the dynamic rule and finished rows stop early);
  ``stop_ids`` the stop tokens, the first of which fills after a row's first one.
  """

  gen_length: int
  steps: int
  stop_ids: tuple[int, ...]
  temperature: float
  remasking: str
  threshold: float
  stop_at_eos: bool
  use_cache: bool

  def __post_init__(self):
    if self.gen_length <= 0 or self.steps <= 0:
      raise ValueError("gen_length and steps must be positive")
    if self.remasking not in REMASKING:
      raise ValueError(f"remasking must be one of {REMASKING}, got {self.remasking!r}")
    if self.temperature < 0:
      raise ValueError("temperature must be >= 0")
    if not self.stop_ids:
      raise ValueError("eos_token_ids must not be empty")

  def canonical(self) -> Sampling:
    """The same decoding with plain Python scalars (one compilation for equal values)."""
    return dataclasses.replace(
        self, stop_ids=tuple(int(t) for t in self.stop_ids), temperature=float(self.temperature),
        threshold=float(self.threshold), stop_at_eos=bool(self.stop_at_eos),
        use_cache=bool(self.use_cache))


@flax.struct.dataclass
class SamplerState:
  """What the block loop carries from block to block (T: the sequence padded to whole blocks)."""

  block: Array  # [] int32: the block decoded next.
  tokens: Array  # [B, T] int32: the prompt, decoded blocks, then mask tokens.
  cache: Any  # The model's KV cache of the finished blocks (() without a cache).
  done: Array  # [B] bool: the row's completion holds a stop token.
  reveal_step: Array  # [B, T] int32: the global step that revealed each position; -1: not yet.
  calls: Array  # [B] int32: the denoising calls each row has needed.


class _Decoder:
  """One traced decoding: the model, the options, the key and the sequence's block layout.

  Built inside ``_generate``'s trace; ``run_block`` maps a ``SamplerState`` to the next.
  """

  def __init__(self, model: Any, settings: Sampling, key: Array, prompt: Array,
               prompt_mask: Array | None):
    self.model, self.settings, self.key = model, settings, key
    config = model.config
    self.bs, self.mask_id = config.block_size, config.mask_token_id
    self.batch, self.prompt_len = prompt.shape
    self.end = self.prompt_len + settings.gen_length
    self.num_blocks = -(-self.end // self.bs)
    self.total = self.num_blocks * self.bs
    self.first_block = self.prompt_len // self.bs
    self.stops = jnp.asarray(settings.stop_ids, jnp.int32)
    self.eos_id = settings.stop_ids[0]
    self.key_mask = None
    if prompt_mask is not None:
      self.key_mask = jnp.concatenate(
          [prompt_mask.astype(bool), jnp.ones((self.batch, self.total - self.prompt_len), bool)],
          axis=1)
    self.valid = jnp.arange(config.vocab_size) != self.mask_id

  def init(self, prompt: Array) -> SamplerState:
    """Masks after the prompt; the prompt's full blocks prefilled into the cache."""
    tokens = jnp.concatenate(
        [prompt, jnp.full((self.batch, self.total - self.prompt_len), self.mask_id,
                          prompt.dtype)], axis=1)
    cache = ()
    if self.settings.use_cache:
      cache = self.model.init_cache(self.batch, self.total, self.key_mask)
      if self.first_block > 0:
        _, cache = self.model.extend(tokens[:, :self.first_block * self.bs], cache, commit=True)
    return SamplerState(block=jnp.int32(self.first_block), tokens=tokens, cache=cache,
                        done=jnp.zeros(self.batch, bool),
                        reveal_step=jnp.full((self.batch, self.total), -1, jnp.int32),
                        calls=jnp.zeros(self.batch, jnp.int32))

  def block_logits(self, tokens: Array, current: Array, start: Array, cache: Any) -> Array:
    """[B, bs, V] float32 logits of the block at `start` holding `current`."""
    if self.settings.use_cache:
      hidden, _ = self.model.extend(current, cache, commit=False)
    else:
      tokens = jax.lax.dynamic_update_slice_in_dim(tokens, current, start, axis=1)
      hidden = self.model.encode(tokens, self.key_mask, span=(start, self.bs))
    logits = self.model.unembed(hidden).astype(jnp.float32)
    return jnp.where(self.valid, logits, -jnp.inf)

  def step(self, state: SamplerState, i: Array, schedule: Array, free: Array, current: Array,
           reveal: Array) -> tuple[Array, Array, Array]:
    """Denoising step ``i`` of the current block: (its tokens, reveal steps [B, bs], and 1 for
    each row that still had a mask [B])."""
    s = self.settings
    global_step = state.block * s.steps + i
    noise_key = jax.random.fold_in(self.key, global_step)
    start = state.block * self.bs
    logits = self.block_logits(state.tokens, current, start, state.cache)
    if s.temperature > 0:
      x0 = categorical(noise_key, logits, s.temperature)
      logits = logits / s.temperature  # The confidence is the sampled distribution's.
    else:
      x0 = jnp.argmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, x0[..., None], axis=-1)[..., 0]
    confidence = jnp.exp(chosen - jax.nn.logsumexp(logits, axis=-1))
    masked = (current == self.mask_id) & free
    confidence = jnp.where(masked, confidence, -jnp.inf)
    count = jnp.maximum(schedule[:, i], 1)[:, None]
    reveal_now = masked & (rank_descending(confidence) < count)
    if s.remasking == "low_confidence_dynamic":
      confident = masked & (confidence > s.threshold)
      enough = jnp.sum(confident, axis=1, keepdims=True) >= count
      reveal_now = jnp.where(enough, confident, reveal_now)
    current = jnp.where(reveal_now, x0.astype(current.dtype), current)
    reveal = jnp.where(reveal_now, global_step, reveal)
    # The loop runs until the slowest row is done; a row counts the calls it still needed.
    return current, reveal, jnp.any(masked, axis=1).astype(jnp.int32)

  def run_block(self, state: SamplerState) -> SamplerState:
    """Denoises the block ``state.block`` (finished rows: filled with EOS) and caches it."""
    s, bs = self.settings, self.bs
    start = state.block * bs
    free = (start + jnp.arange(bs) >= self.prompt_len)[None, :]  # positions it may write
    current = jax.lax.dynamic_slice_in_dim(state.tokens, start, bs, axis=1)
    if s.stop_at_eos:  # finished rows are not decoded any further
      current = jnp.where(state.done[:, None] & free, self.eos_id, current)
    schedule = num_transfer_tokens(jnp.sum((current == self.mask_id) & free, axis=1), s.steps)
    reveal = jax.lax.dynamic_slice_in_dim(state.reveal_step, start, bs, axis=1)

    def keep_denoising(inner):
      i, current, _, _ = inner
      return (i < s.steps) & jnp.any((current == self.mask_id) & free)

    def denoise(inner):
      i, current, reveal, calls = inner
      current, reveal, called = self.step(state, i, schedule, free, current, reveal)
      return i + 1, current, reveal, calls + called

    _, current, reveal, calls = jax.lax.while_loop(keep_denoising, denoise,
                                                     (jnp.int32(0), current, reveal, state.calls))
    tokens = jax.lax.dynamic_update_slice_in_dim(state.tokens, current, start, axis=1)
    reveal_step = jax.lax.dynamic_update_slice_in_dim(state.reveal_step, reveal, start, axis=1)
    cache = state.cache
    if s.use_cache:
      _, cache = self.model.extend(current, cache, commit=True)
    in_completion = free & (start + jnp.arange(bs) < self.end)[None, :]
    done = state.done | jnp.any(jnp.isin(current, self.stops) & in_completion, axis=1)
    return SamplerState(block=state.block + 1, tokens=tokens, cache=cache, done=done,
                        reveal_step=reveal_step, calls=calls)

  def keep_going(self, state: SamplerState) -> Array:
    return (state.block < self.num_blocks) & ~(self.settings.stop_at_eos & jnp.all(state.done))


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"))
def _generate(graphdef: Any, state: Any, prompt: Array, prompt_mask: Array | None, key: Array, *,
              settings: Sampling) -> tuple[Array, Array, dict[str, Array]]:
  decoder = _Decoder(nnx.merge(graphdef, state), settings, key, prompt, prompt_mask)
  final = jax.lax.while_loop(decoder.keep_going, decoder.run_block, decoder.init(prompt))
  prompt_len, end, eos_id = decoder.prompt_len, decoder.end, decoder.eos_id
  tokens, reveal_step = final.tokens[:, :end], final.reveal_step[:, prompt_len:end]
  if settings.stop_at_eos:
    completion = fill_after_stop(tokens[:, prompt_len:], settings.stop_ids, eos_id)
    completion = jnp.where(completion == decoder.mask_id, eos_id, completion)  # blocks never run
    tokens = tokens.at[:, prompt_len:].set(completion)
  return tokens, reveal_step, {"model_calls": final.calls}


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
  settings = Sampling(gen_length=gen_length, steps=steps, temperature=temperature,
                      remasking=remasking, threshold=threshold, stop_at_eos=stop_at_eos,
                      stop_ids=tuple(eos_token_ids if eos_token_ids is not None
                                     else model.config.stop_token_ids), use_cache=use_cache)
  return outputs(sample(model, prompt_tokens, prompt_mask, key, settings), return_reveal_step,
                 return_stats)


def sample(model: nnx.Module, prompt_tokens: Array, prompt_mask: Array | None, key: Array,
           settings: Sampling) -> tuple[Array, Array, dict[str, Array]]:
  """``generate`` with its options as one record: tokens [B, P + G], reveal_step [B, G] and the
  stats (``model_calls`` [B])."""
  prompt_tokens, prompt_mask = check_prompts(prompt_tokens, prompt_mask)
  graphdef, state = nnx.split(model)
  return _generate(graphdef, state, prompt_tokens.astype(jnp.int32), prompt_mask, key,
                   settings=settings.canonical())
