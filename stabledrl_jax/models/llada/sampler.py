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
options (a `Sampling` record) are static arguments, the state, prompt and key are traced. The
loop carries a `SamplerState` (tokens, reveal steps, model calls, KV cache); `_Decoder.step` is
one model call and reveal, `_Decoder.decode_block` the steps of one block. The blocks run in a
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

import dataclasses
import functools
import inspect
from typing import Any

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from stabledrl_jax.models import sharding
from stabledrl_jax.models.sampler_lib import (categorical, check_prompts, fill_after_stop,
                                              num_transfer_tokens, outputs, rank_descending)

Array = jax.Array

REMASKING = ("low_confidence", "random", "threshold")
# Block-wise KV caching (Fast-dLLM): "none" (exact), "prefix" or "dual" (the module docstring).
CACHES = ("none", "prefix", "dual")


@dataclasses.dataclass(frozen=True)
class Sampling:
  """The options of one LLaDA decoding (``generate`` documents each, with their defaults);
  static, hashable.

  ``steps`` is the total over the completion (unused, 0, by threshold decoding); ``threshold``
  only matters to threshold decoding (0.0 otherwise, so that one compilation serves any value).
  """

  gen_length: int
  steps: int
  block_length: int
  temperature: float
  remasking: str
  threshold: float
  cfg_scale: float
  stop_at_eos: bool
  cache: str

  def __post_init__(self):
    options = dataclasses.asdict(self)
    del options["stop_at_eos"]
    check_settings(**options)

  @property
  def dynamic(self) -> bool:
    """Threshold decoding: a block's steps follow the model's confidence."""
    return self.remasking == "threshold"

  @property
  def num_blocks(self) -> int:
    return self.gen_length // self.block_length

  @property
  def max_steps(self) -> int:
    """Steps of a block: fixed, or at most one per token when each step reveals at least one.

    Step keys are fold_in(key, block * max_steps + step), so threshold decoding with nothing
    above the threshold draws the same noise as low_confidence with steps = gen_length.
    """
    return self.block_length if self.dynamic else self.steps // self.num_blocks

  def canonical(self) -> Sampling:
    """The same decoding with the options it does not use zeroed (one compilation for all)."""
    return dataclasses.replace(
        self, steps=0 if self.dynamic else self.steps,
        threshold=float(self.threshold) if self.dynamic else 0.0,
        temperature=float(self.temperature), cfg_scale=float(self.cfg_scale),
        stop_at_eos=bool(self.stop_at_eos))


@flax.struct.dataclass
class SamplerState:
  """What the decode loop carries from step to step."""

  tokens: Array  # [B, P + G] int32: the prompt, then the completion (mask_id where masked).
  reveal_step: Array  # [B, G] int32: the global step that revealed each position; -1: not yet.
  calls: Array  # [B] int32: the model calls each row has needed.
  kv: Any  # The KV cache, [n_layers, B', P + G, K, hd] keys and values; None when exact.


def _reveal(confidence: Array, masked: Array, count: Array | None,
            threshold: float | None) -> Array:
  """[B, n] bool: the masked positions revealed at a step.

  With a schedule (`count` [B]), the `count` most confident; with a `threshold`, every position
  whose confidence exceeds it, and the most confident one in any case (so each step reveals at
  least one token while any is masked).
  """
  rank = rank_descending(jnp.where(masked, confidence, -jnp.inf))
  if threshold is None:
    return masked & (rank < count[:, None])
  return masked & ((confidence > threshold) | (rank == 0))


def _constrain_kv(x: Array) -> Array:
  """A KV cache [n_layers, B, L, K, hd] pinned to the batch's mesh axes (``constrain``)."""
  return sharding.constrain(x, (None, "batch") + (None,) * (x.ndim - 2))


class _Decoder:
  """One traced decoding: the model, the options, the key and the fixed inputs of every step.

  Built inside ``_generate``'s trace; its methods map a ``SamplerState`` to the next.
  """

  def __init__(self, model: Any, settings: Sampling, key: Array, prompt: Array,
               prompt_mask: Array | None):
    self.model, self.settings, self.key = model, settings, key
    config = model.config
    self.mask_id, self.eos_id, self.vocab_size = (config.mask_token_id, config.eos_token_id,
                                                  config.vocab_size)
    self.batch, self.prompt_len = prompt.shape
    gen_length = settings.gen_length
    self.attention_mask = None
    if prompt_mask is not None:
      self.attention_mask = jnp.concatenate(
          [prompt_mask.astype(bool), jnp.ones((self.batch, gen_length), bool)], axis=1)
    if settings.cfg_scale > 0:
      self.is_prompt = jnp.arange(self.prompt_len + gen_length) < self.prompt_len
      if self.attention_mask is not None:
        self.attention_mask = jnp.concatenate([self.attention_mask, self.attention_mask], axis=0)
    # Whether the model's encode_kv writes into a given cache (LLaDA's does).
    self.writes_in_place = (settings.cache != "none"
                            and "cache" in inspect.signature(model.encode_kv).parameters)

  def init(self, prompt: Array) -> SamplerState:
    """The state before the first step: the completion all masks, no cache written yet."""
    gen_length, block_length = self.settings.gen_length, self.settings.block_length
    tokens = jnp.concatenate(
        [prompt, jnp.full((self.batch, gen_length), self.mask_id, prompt.dtype)], axis=1)
    kv = None
    if self.settings.cache != "none":  # Filled at each block's first step.
      shapes = jax.eval_shape(lambda t: self.model.encode_kv(
          self.model_inputs(t), self.attention_mask, span=(self.prompt_len, block_length))[1],
                              tokens)
      # Rows split as the batch's (without the pin GSPMD may keep the whole cache on every
      # device).
      kv = jax.tree.map(lambda x: _constrain_kv(jnp.zeros(x.shape, x.dtype)), shapes)
    return SamplerState(tokens=tokens,
                        reveal_step=jnp.full((self.batch, gen_length), -1, jnp.int32),
                        calls=jnp.zeros((self.batch,), jnp.int32), kv=kv)

  def model_inputs(self, tokens: Array) -> Array:
    """[B', P + G]: the tokens, and with guidance their unconditional copy (prompt masked)."""
    if self.settings.cfg_scale > 0:
      unconditional = jnp.where(self.is_prompt[None, :], self.mask_id, tokens)
      return jnp.concatenate([tokens, unconditional], axis=0)
    return tokens

  def block_hidden(self, inputs: Array, start: Array, kv: Any, refresh: bool
                   ) -> tuple[Array, Any]:
    """Hidden states [B', block_length, D] of the block at `start`, and the KV cache.

    Exact (cache "none"): a pass over the whole sequence, the last layer for the block's
    queries only. Cached: the block's first step (`refresh`, static) is that pass, which also
    writes every layer's keys and values of every position into the carried cache `kv`; later
    steps read it and return it untouched: they run only the block (dual: the prefix's and the
    suffix's keys and values from the cache) or the sequence from the block on (prefix: the
    decoded blocks' and the prompt's keys and values from the cache; one branch per block, each
    of static length, the cache an operand of the branches, never one of their results).
    """
    model, cache = self.model, self.settings.cache
    block_length, mask = self.settings.block_length, self.attention_mask
    if cache == "none":
      return model.encode(inputs, mask, span=(start, block_length)), kv
    if refresh:
      if self.writes_in_place:  # Into the loop-carried buffer: no second copy of the cache.
        hidden, kv = model.encode_kv(inputs, mask, span=(start, block_length), cache=kv)
      else:
        hidden, kv = model.encode_kv(inputs, mask, span=(start, block_length))
      return hidden, jax.tree.map(_constrain_kv, kv)
    if cache == "dual":
      block = jax.lax.dynamic_slice_in_dim(inputs, start, block_length, axis=1)
      return model.encode_cached(block, start, kv, mask), kv

    def reuse_from(b):
      """Prefix cache in block b: positions from the block to the end run (a static length
      per block, hence one branch per block)."""
      begin = self.prompt_len + b * block_length

      def run(inputs, kv):
        return model.encode_cached(inputs[:, begin:], begin, kv, mask)[:, :block_length]

      return run

    branches = [reuse_from(b) for b in range(self.settings.num_blocks)]
    return jax.lax.switch((start - self.prompt_len) // block_length, branches, inputs, kv), kv

  def block_logits(self, tokens: Array, start: Array, kv: Any, refresh: bool
                   ) -> tuple[Array, Any]:
    """[B, block_length, V] float32 logits of the block starting at `start`, and the cache."""
    hidden, kv = self.block_hidden(self.model_inputs(tokens), start, kv, refresh)
    logits = self.model.unembed(hidden).astype(jnp.float32)
    cfg_scale = self.settings.cfg_scale
    if cfg_scale > 0:
      cond, uncond = logits[:self.batch], logits[self.batch:]
      logits = uncond + (cfg_scale + 1.0) * (cond - uncond)
    vocab = jnp.arange(logits.shape[-1])
    valid = (vocab < self.vocab_size) & (vocab != self.mask_id)
    return jnp.where(valid, logits, -jnp.inf), kv

  def step(self, state: SamplerState, block: Array, step_in_block: Array,
           schedule: Array | None, refresh: bool = False) -> SamplerState:
    """One model call: predict the current block, reveal some of its masked positions
    (`refresh`: the cached samplers' first step of a block, which rebuilds the cache)."""
    s = self.settings
    block_length = s.block_length
    global_step = block * s.max_steps + step_in_block
    noise_key, confidence_key = jax.random.split(jax.random.fold_in(self.key, global_step))
    start = self.prompt_len + block * block_length
    logits, kv = self.block_logits(state.tokens, start, state.kv, refresh)
    if s.temperature > 0:
      x0 = categorical(noise_key, logits, s.temperature)
    else:
      x0 = jnp.argmax(logits, axis=-1)
    if s.remasking == "random":
      confidence = jax.random.uniform(confidence_key, x0.shape)
    else:
      chosen = jnp.take_along_axis(logits, x0[..., None], axis=-1)[..., 0]
      confidence = jnp.exp(chosen - jax.nn.logsumexp(logits, axis=-1))
    current = jax.lax.dynamic_slice_in_dim(state.tokens, start, block_length, axis=1)
    masked = current == self.mask_id
    count = None if s.dynamic else schedule[:, step_in_block]
    reveal = _reveal(confidence, masked, count, s.threshold if s.dynamic else None)
    # A fixed schedule calls the model at every step; threshold decoding runs until the slowest
    # row of the batch is done, and a row counts the steps at which it still had masks.
    calls = state.calls + (jnp.any(masked, axis=1).astype(jnp.int32) if s.dynamic else 1)
    current = jnp.where(reveal, x0.astype(state.tokens.dtype), current)
    tokens = jax.lax.dynamic_update_slice_in_dim(state.tokens, current, start, axis=1)
    offset = block * block_length
    seen = jax.lax.dynamic_slice_in_dim(state.reveal_step, offset, block_length, axis=1)
    seen = jnp.where(reveal, global_step, seen)
    reveal_step = jax.lax.dynamic_update_slice_in_dim(state.reveal_step, seen, offset, axis=1)
    return SamplerState(tokens=tokens, reveal_step=reveal_step, calls=calls, kv=kv)

  def schedule(self, tokens: Array, start: Array) -> Array:
    """[B, max_steps]: the tokens each step of the block at `start` reveals (LLaDA's even
    schedule of its masked count)."""
    current = jax.lax.dynamic_slice_in_dim(tokens, start, self.settings.block_length, axis=1)
    return num_transfer_tokens(jnp.sum(current == self.mask_id, axis=1), self.settings.max_steps)

  def decode_block(self, block: Array, state: SamplerState) -> tuple[SamplerState, Array]:
    """Runs the steps of one block; returns the state and the number of model calls made.

    Cached: the block's first step, which rebuilds the cache, runs before the loop over the
    others (no `lax.cond` between a rebuilding and a reading step, whose result would need a
    buffer of its own for the cache); a block starts fully masked, so threshold decoding always
    runs that step too.
    """
    s = self.settings
    start = self.prompt_len + block * s.block_length
    schedule = None if s.dynamic else self.schedule(state.tokens, start)
    first = 0
    if s.cache != "none":
      state = self.step(state, block, jnp.int32(0), schedule, refresh=True)
      first = 1
    if not s.dynamic:
      state = jax.lax.fori_loop(first, s.max_steps,
                                lambda i, st: self.step(st, block, i, schedule), state)
      return state, jnp.int32(s.max_steps)

    def any_masked(inner):
      i, st = inner
      current = jax.lax.dynamic_slice_in_dim(st.tokens, start, s.block_length, axis=1)
      return (i < s.max_steps) & jnp.any(current == self.mask_id)

    num_steps, state = jax.lax.while_loop(
        any_masked, lambda inner: (inner[0] + 1, self.step(inner[1], block, inner[0], None)),
        (jnp.int32(first), state))
    return state, num_steps

  def run(self, state: SamplerState) -> tuple[SamplerState, Array]:
    """Every block in turn (with ``stop_at_eos``, until every row has an EOS); the final state
    and the batched forward passes run."""
    s = self.settings

    def run_block(outer):
      block, state, passes, _ = outer
      state, num_steps = self.decode_block(block, state)
      decoded = jnp.arange(s.gen_length) < (block + 1) * s.block_length
      has_eos = jnp.any((state.tokens[:, self.prompt_len:] == self.eos_id) & decoded[None, :],
                        axis=1)
      done = s.stop_at_eos & jnp.all(has_eos)
      return block + 1, state, passes + num_steps, done

    def keep_going(outer):
      block, _, _, done = outer
      return (block < s.num_blocks) & ~done

    init = (jnp.int32(0), state, jnp.int32(0), jnp.bool_(False))
    _, state, passes, _ = jax.lax.while_loop(keep_going, run_block, init)
    return state, passes


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"))
def _generate(graphdef: Any, state: Any, prompt: Array, prompt_mask: Array | None, key: Array, *,
              settings: Sampling) -> tuple[Array, Array, dict[str, Array]]:
  decoder = _Decoder(nnx.merge(graphdef, state), settings, key, prompt, prompt_mask)
  final, passes = decoder.run(decoder.init(prompt))
  tokens, prompt_len = final.tokens, decoder.prompt_len
  if settings.stop_at_eos:
    completion = fill_after_stop(tokens[:, prompt_len:], decoder.eos_id, decoder.eos_id)
    tokens = tokens.at[:, prompt_len:].set(completion)
  return tokens, final.reveal_step, {"model_calls": final.calls, "forward_passes": passes}


def check_settings(*, gen_length: int, steps: int, block_length: int, temperature: float = 0.0,
                   remasking: str = "low_confidence", threshold: float = 0.9,
                   cfg_scale: float = 0.0, cache: str = "none") -> None:
  """Raises ValueError unless `generate` accepts these options (cheap: nothing is compiled).

  Threshold decoding does not use `steps`; the schedule takes at most one step per token (a
  step beyond reveals nothing, yet calls the model).
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
  if not dynamic and steps > gen_length:
    raise ValueError(f"steps ({steps}) must be at most gen_length ({gen_length}): one step per "
                     "token at most (the steps beyond reveal nothing, yet each calls the model)")
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
  settings = Sampling(gen_length=gen_length, steps=steps, block_length=block_length,
                      temperature=temperature, remasking=remasking, threshold=threshold,
                      cfg_scale=cfg_scale, stop_at_eos=stop_at_eos, cache=cache)
  return outputs(sample(model, prompt_tokens, prompt_mask, key, settings), return_reveal_step,
                 return_stats)


def sample(model: nnx.Module, prompt_tokens: Array, prompt_mask: Array | None, key: Array,
           settings: Sampling) -> tuple[Array, Array, dict[str, Array]]:
  """``generate`` with its options as one record: tokens [B, P + G], reveal_step [B, G] and the
  stats (``model_calls`` [B], ``forward_passes`` [])."""
  prompt_tokens, prompt_mask = check_prompts(prompt_tokens, prompt_mask)
  graphdef, state = nnx.split(model)
  return _generate(graphdef, state, prompt_tokens.astype(jnp.int32), prompt_mask, key,
                   settings=settings.canonical())
