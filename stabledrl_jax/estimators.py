"""Sequence log-likelihood estimators for masked diffusion LMs.

The likelihood log pi(y | x) of a masked diffusion LM is intractable; it is
estimated from forward passes on partially masked copies of z = [x; y]. Every
estimator here is model-agnostic: it takes ``logits_fn(tokens [B, L]) ->
logits [B, L, V]`` (bidirectional) and explicit PRNG keys, and is a pure,
jit-able function with static shapes.

An estimate is made in two steps, so that masks can be shared between the
numerator and the denominator of a ratio, or replaced (stress test):

1. ``sample_masks``: K Monte Carlo masks per sequence, as a :class:`MaskSample`
   (which positions are noised, which are scored, and with what weight).
2. ``estimate_from_masks``: one forward pass over all B * K noised rows, then a
   weighted sum of the scored token log-probs.

``estimate_logp`` does both. Methods (docs/algorithms.md):

* ``mean_field`` (d1): the whole completion masked; prompt tokens masked with
  probability ``prompt_mask_prob`` (0.15). Exact for a model whose logits ignore
  the input.
* ``elbo``: t ~ U(0, 1], stratified over the K samples. Sum form (LLaDA):
  ``(1/t) sum_{masked} log p(y_i | z_t)``; mean form: the mean over masked
  tokens. ``schedule="bernoulli"`` masks each completion token with
  probability t, conditioned on at least one mask (the weight
  ``(1 - (1 - t)^L) / t`` keeps the sum form an unbiased ELBO estimate);
  ``schedule="count"`` masks exactly ``m = ceil(t L)`` tokens with weight
  ``L / m``. ``coupled=True`` adds the complementary mask of each sample.
* ``block_random`` (SPG and StableDRL, by their official rules): one block of
  ``block_length`` per sample, drawn from a random permutation of the generation's
  blocks; a uniform count in [1, m] of its m completion tokens masked, every later
  position masked, every earlier one (prompt included) masked with probability
  ``prompt_mask_prob``; the mean log-prob over every masked completion token.
  ``block_random_unbiased`` is an unbiased variant (earlier blocks clean, only the
  chosen block scored, inverse-probability weights).
* ``espo_elbo`` (ESPO): exact mask counts stratified over the batch, each mask with
  its complement, the whole generation (past the first EOS too) masked and scored.

Positions after the completion (after its first EOS) are masked input for every
other method, never visible context, as in d1's, SPG's and StableDRL's code
(``past_completion``). docs/algorithms.md states each method with its sources.

``eubo_from_samples`` turns the same token log-probs into SPG's upper bound
EUBO_beta, and ``stress_masks`` builds the importance-weight-explosion masks
of docs/stress_test.md.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import chex
import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array
LogitsFn = Callable[[Array], Array]
NORMALIZATIONS = ("sum", "mean")


@flax.struct.dataclass
class MaskSample:
  """R mask rows for a batch of B sequences of length L (R = K, or 2K coupled), of either family.

  Row r's term of a sequence's estimate is ``scale[r] * sum_i weight[r, i] log p(z_i | row r)``
  over the row's scored positions i, with ``scale`` the row's ``sum_scale`` (log-likelihood) or
  ``mean_scale`` (length-normalized) (``combine_rows``). The full-attention methods weight every
  scored token of a row alike (``weight`` 1, built with :meth:`per_row`); the block ELBO weights
  each token by its own block (``weight`` L_j / m_j / K, ``block_estimators``).

  Attributes:
    noisy: [R, B, L] bool, positions replaced by the mask token.
    scored: [R, B, L] bool, positions whose log-prob enters the estimate.
    weight: [R, B, L] float32, each scored token's weight within its row.
    sum_scale: [R, B] the row's factor in the sum-form estimate (includes the 1/K of the
      Monte Carlo average where ``weight`` does not).
    mean_scale: [R, B] the same for the length-normalized (mean) form.
    rate: [R, B, L] t_hat, each token's mask rate, so that ``1[scored] / t_hat`` has
      expectation 1 for every completion token: the scored fraction of the completion
      (``m / L``) for ELBO and block_random rows, 1 for mean-field rows,
      ``m / (num_blocks * block size)`` for block_random_unbiased rows, and m_j / L_j of the
      token's block for the block ELBO (0 outside the completion there).
  """

  noisy: Array
  scored: Array
  weight: Array
  sum_scale: Array
  mean_scale: Array
  rate: Array

  @classmethod
  def per_row(cls, *, noisy: Array, scored: Array, sum_scale: Array, mean_scale: Array,
              rate: Array) -> "MaskSample":
    """Rows whose scored tokens weigh alike: scales and ``rate`` one per row, [R, B]."""
    return cls(noisy=noisy, scored=scored, weight=jnp.ones(noisy.shape, jnp.float32),
               sum_scale=sum_scale, mean_scale=mean_scale,
               rate=jnp.broadcast_to(rate[..., None], noisy.shape))

  @property
  def num_rows(self) -> int:
    return self.noisy.shape[0]


@flax.struct.dataclass
class Estimate:
  """An estimate with what it was made from.

  Attributes:
    value: [B] log-likelihood estimate, one per sequence.
    token_logp: [R, B, L] log p(z_i | noised row) at every position.
    masks: the :class:`MaskSample` used.
    row_values: [R, B] each row's term of ``value`` (``value`` is their sum over rows), for
      ``monte_carlo_variance``.
  """

  value: Array
  token_logp: Array
  masks: MaskSample
  row_values: Array | None = None


# ---------------------------------------------------------------------------
# Small mask utilities.
# ---------------------------------------------------------------------------


def check_token_batch(tokens: Array, prompt_mask: Array, completion_mask: Array) -> None:
  """tokens [B, L] integer ids with prompt and completion masks of the same shape."""
  chex.assert_rank(tokens, 2)
  chex.assert_shape([prompt_mask, completion_mask], tokens.shape)
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise TypeError(f"tokens must be integer ids, got dtype {tokens.dtype}.")


def _completion_rank(completion_mask: Array) -> Array:
  """[B, L] rank of each completion token among the completion (0-based); -1 elsewhere."""
  rank = jnp.cumsum(completion_mask.astype(jnp.int32), axis=-1) - 1
  return jnp.where(completion_mask, rank, -1)


def past_completion(prompt_mask: Array, completion_mask: Array) -> Array:
  """[..., L] bool: the generated positions after the completion (after its first EOS).

  Neither prompt nor completion, but after the first prompt or completion token (so left
  padding is not included). Every estimator feeds them as mask tokens, never as context.
  """
  content = prompt_mask | completion_mask
  return ~content & (jnp.cumsum(content.astype(jnp.int32), axis=-1) > 0)


def _bernoulli_subset(key: Array, eligible: Array, prob: float) -> Array:
  """``eligible`` [..., L] bool, each position kept independently with ``prob``."""
  if not 0.0 <= prob <= 1.0:
    raise ValueError(f"prompt_mask_prob must lie in [0, 1], got {prob}.")
  if prob == 0.0:
    return jnp.zeros_like(eligible)
  return eligible & jax.random.bernoulli(key, prob, eligible.shape)


def _mask_prompt(key: Array, prompt_mask: Array, num_rows: int, prob: float) -> Array:
  """[R, B, L] bool: each prompt token masked independently with ``prob``."""
  return _bernoulli_subset(key, jnp.broadcast_to(prompt_mask, (num_rows,) + prompt_mask.shape),
                           prob)


def _random_subset(key: Array, eligible: Array, count: Array) -> Array:
  """Exactly ``min(count, #eligible)`` uniformly chosen eligible positions.

  Args:
    key: PRNG key.
    eligible: [..., L] bool.
    count: [...] int.

  Returns:
    [..., L] bool.
  """
  priority = jnp.where(eligible, jax.random.uniform(key, eligible.shape), 2.0)
  order = jnp.argsort(jnp.argsort(priority, axis=-1), axis=-1)
  return eligible & (order < count[..., None])


def _stratified_times(key: Array, num_samples: int, batch: int) -> Array:
  """[K, B] t in (k/K, (k+1)/K] for sample k: stratified U(0, 1]."""
  u = jax.random.uniform(key, (num_samples, batch))
  return (jnp.arange(num_samples, dtype=jnp.float32)[:, None] + 1.0 - u) / num_samples


def safe_div(num: Array, den: Array) -> Array:
  """num / den, 0 where den == 0 (empty completions and empty blocks score nothing)."""
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1), 0.0)


def complementary(masked: Array, eligible: Array, count: Array,
                  length: Array) -> tuple[Array, Array, Array]:
  """Each count-schedule mask followed by its complement (the coupled ELBO of both families).

  With m uniform on {1..L}, a size-k set arises both as a mask and as a complement for k < L,
  and only as a mask for k = L; so a row of size k < L gets half the weight L / k, a full mask
  all of it, and the estimate stays unbiased.

  Args:
    masked: [R, ..., n] bool, the masks (R rows; n positions of a sequence or of a block).
    eligible: [..., n] bool (broadcast against ``masked``), the positions a mask draws from.
    count: [R, ...] their sizes m.
    length: [..., ] broadcastable to ``count``, the eligible positions L.

  Returns:
    rows [2R, ..., n]: the masks, then their complements; counts [2R, ...]: the positions each
    masks; shares [2R, ...]: the count that row's weight L / count divides by instead (2 m,
    or m for a full mask).
  """
  complement = eligible & ~masked
  count_c = length - count
  halves = jnp.where(count_c > 0, 2.0, 1.0)
  return (jnp.concatenate([masked, complement]), jnp.concatenate([count, count_c]),
          jnp.concatenate([count * halves, count_c * 2.0]))


# ---------------------------------------------------------------------------
# Mask samplers, one per method: (key, prompt_mask, completion_mask, K, **opts).
# ---------------------------------------------------------------------------


def _mean_field_masks(key: Array, prompt_mask: Array, completion_mask: Array,
                      num_samples: int, *, prompt_mask_prob: float = 0.15) -> MaskSample:
  k = num_samples
  generation = completion_mask | past_completion(prompt_mask, completion_mask)
  noisy = generation[None] | _mask_prompt(key, prompt_mask, k, prompt_mask_prob)
  scored = jnp.broadcast_to(completion_mask[None], noisy.shape)
  length = jnp.sum(completion_mask, axis=-1).astype(jnp.float32)
  ones = jnp.ones((k,) + length.shape, jnp.float32)
  return MaskSample.per_row(
      noisy=noisy,
      scored=scored,
      sum_scale=safe_div(ones, jnp.full_like(ones, k) * (length > 0)),
      mean_scale=safe_div(ones, k * length[None]),
      rate=ones,
  )


def _bernoulli_at_least_one(key: Array, rank: Array, length: Array,
                            t: Array) -> tuple[Array, Array]:
  """Bernoulli(t) masks of the completion conditioned on at least one mask.

  Exact sampler: the first masked rank J follows the truncated geometric law
  P(J = j) ~ t (1 - t)^j on [0, L); ranks after J are masked i.i.d. with
  probability t. Given the count, the masked set is uniform.

  Args:
    key: PRNG key.
    rank: [B, L] completion ranks (-1 outside the completion).
    length: [B] completion lengths L.
    t: [K, B] mask probabilities in (0, 1].

  Returns:
    masked: [K, B, L] bool; p_any: [K, B] = 1 - (1 - t)^L.
  """
  key_first, key_rest = jax.random.split(key)
  log_q = jnp.log1p(-t)  # -inf at t = 1, handled below.
  p_any = -jnp.expm1(length[None] * log_q)
  u = jax.random.uniform(key_first, t.shape)
  # Inverse CDF of the truncated geometric law; at t = 1 it gives J = 0.
  first = jnp.floor(jnp.log1p(-u * p_any) / log_q)
  first = jnp.clip(first, 0, jnp.maximum(length[None] - 1, 0)).astype(jnp.int32)
  draws = jax.random.uniform(key_rest, t.shape + rank.shape[-1:]) < t[..., None]
  rank = rank[None]
  masked = (rank == first[..., None]) | ((rank > first[..., None]) & draws)
  return masked & (rank >= 0), p_any


def _elbo_masks(key: Array, prompt_mask: Array, completion_mask: Array,
                num_samples: int, *, schedule: str = "bernoulli",
                coupled: bool = False, prompt_mask_prob: float = 0.0) -> MaskSample:
  if schedule not in ("bernoulli", "count"):
    raise ValueError(f"schedule must be 'bernoulli' or 'count', got {schedule!r}.")
  if coupled and schedule != "count":
    raise ValueError("coupled (complementary) masks need schedule='count'.")
  key_t, key_mask, key_prompt = jax.random.split(key, 3)
  k = num_samples
  length = jnp.sum(completion_mask, axis=-1).astype(jnp.float32)  # [B]
  t = _stratified_times(key_t, k, completion_mask.shape[0])  # [K, B]
  rank = _completion_rank(completion_mask)
  if schedule == "bernoulli":
    masked, p_any = _bernoulli_at_least_one(key_mask, rank, length, t)
    count = jnp.sum(masked, axis=-1).astype(jnp.float32)
    sum_scale = jnp.where(length[None] > 0, p_any / t, 0.0) / k
  else:
    count = jnp.clip(jnp.ceil(t * length[None]), 1, jnp.maximum(length[None], 1))
    count = count * (length[None] > 0)
    masked = _random_subset(key_mask, jnp.broadcast_to(completion_mask, (k,) + rank.shape),
                            count.astype(jnp.int32))
    sum_scale = safe_div(length[None], count) / k
  mean_scale = safe_div(jnp.ones_like(count), count) / k
  rate = safe_div(count, length[None])
  if coupled:  # Each mask with its complement (``complementary``).
    masked, counts, shares = complementary(masked, completion_mask[None], count, length[None])
    sum_scale = safe_div(length[None], shares) / k
    mean_scale = safe_div(jnp.ones_like(shares), shares) / k
    rate = safe_div(counts, length[None])
  rows = masked.shape[0]
  noisy = (masked | past_completion(prompt_mask, completion_mask)[None]
           | _mask_prompt(key_prompt, prompt_mask, rows, prompt_mask_prob))
  return MaskSample.per_row(noisy=noisy, scored=masked, sum_scale=sum_scale,
                            mean_scale=mean_scale, rate=rate)


def _espo_elbo_masks(key: Array, prompt_mask: Array, completion_mask: Array,
                     num_samples: int, *, coupled: bool = True) -> MaskSample:
  """ESPO's ELBO: exact counts stratified over the batch, each mask paired with its complement.

  The pool is the whole generation (the completion and the positions after it), all of it
  scored, as ESPO's code scores every generated position. Per sample k a shift u_k ~ U{0..L}
  sets row i's count ``x = round(u_k + i (L + 1) / B) mod (L + 1)`` (so x = 0 and x = L occur);
  x uniformly chosen positions are masked, weighted ``(L + 1) / x``, and the complement
  ``(L + 1) / (L - x)``; the two halves are averaged (each is unbiased on its own). Prompts stay
  clean. The mean form divides by L. ``coupled=False`` drops the complements: the masks alone,
  unhalved (an option; ESPO's code always pairs them, whatever its recipes' ``reduce_var``
  says: ``_get_elbo_mc`` never passes it on, espo_trainer.py:446).
  """
  key_shift, key_mask = jax.random.split(key)
  k = num_samples
  batch = completion_mask.shape[0]
  pool = completion_mask | past_completion(prompt_mask, completion_mask)
  length = jnp.sum(pool, axis=-1).astype(jnp.float32)  # [B] L
  shift = jnp.floor(jax.random.uniform(key_shift, (k, 1)) * (length[None] + 1))
  row = jnp.arange(batch, dtype=jnp.float32)[None]
  count = jnp.mod(jnp.round(shift + row * (length[None] + 1) / batch), length[None] + 1)
  masked = _random_subset(key_mask, jnp.broadcast_to(pool, (k,) + pool.shape),
                          count.astype(jnp.int32))
  if coupled:
    complement = pool[None] & ~masked
    scale = jnp.concatenate([safe_div(length[None] + 1, 2 * count),
                             safe_div(length[None] + 1, 2 * (length[None] - count))]) / k
    rows = jnp.concatenate([masked, complement])
    counts = jnp.concatenate([count, length[None] - count])
  else:
    scale, rows, counts = safe_div(length[None] + 1, count) / k, masked, count
  return MaskSample.per_row(noisy=rows, scored=rows, sum_scale=scale,
                            mean_scale=safe_div(scale, length[None]),
                            rate=safe_div(counts, jnp.broadcast_to(length[None], counts.shape)))


def _generation_blocks(prompt_mask: Array, completion_mask: Array,
                       block_length: int) -> tuple[Array, Array, Array, Array]:
  """The generation's blocks: (block of each position [B, L], -1 outside the generation;
  number of generation blocks [B]; number of blocks the completion spans [B], both >= 1;
  the positions after the completion [B, L], ``past_completion``)."""
  if block_length < 1:
    raise ValueError(f"block_length must be >= 1, got {block_length}.")
  past = past_completion(prompt_mask, completion_mask)
  generation = completion_mask | past
  rank = jnp.cumsum(generation.astype(jnp.int32), axis=-1) - 1
  block_of = jnp.where(generation, rank // block_length, -1)
  ceil_div = lambda n: jnp.maximum(-(-n // block_length), 1)
  return (block_of, ceil_div(jnp.sum(generation, axis=-1)),
          ceil_div(jnp.sum(completion_mask, axis=-1)), past)


def _block_random_masks(key: Array, prompt_mask: Array, completion_mask: Array,
                        num_samples: int, *, block_length: int = 32,
                        prompt_mask_prob: float = 0.15) -> MaskSample:
  """SPG's and StableDRL's block_random masks, by the official rules (docs/algorithms.md).

  Per row and sample k: the block is entry k of a random permutation of the generation's
  blocks, modulo the blocks the completion spans (entry k mod #blocks when K exceeds them); a
  uniform count in [1, m] of the block's m completion tokens is masked; every generation
  position after the block is masked; every earlier position (prompt and earlier completion
  blocks) is masked with probability ``prompt_mask_prob``; every completion token masked is
  scored. Length-normalized (the mean over the scored tokens); the sum form is that mean times
  the completion length. Not an unbiased ELBO: see ``_block_random_unbiased_masks``.
  """
  key_perm, key_count, key_mask, key_prompt = jax.random.split(key, 4)
  k = num_samples
  batch, length_max = completion_mask.shape
  block_of, gen_blocks, completion_blocks, past = _generation_blocks(
      prompt_mask, completion_mask, block_length)
  # A uniform permutation of each row's generation blocks: its first gen_blocks entries.
  slots = -(-length_max // block_length)
  priority = jnp.where(jnp.arange(slots) < gen_blocks[:, None],
                       jax.random.uniform(key_perm, (batch, slots)), 2.0)
  permutation = jnp.argsort(priority, axis=-1)  # [B, slots]
  entry = jnp.arange(k)[:, None] % gen_blocks[None]  # [K, B]
  block = jnp.take_along_axis(permutation, entry.T, axis=1).T % completion_blocks[None]
  length = jnp.sum(completion_mask, axis=-1).astype(jnp.int32)  # [B]
  valid = jnp.clip(length[None] - block * block_length, 0, block_length)  # [K, B] m
  count = jnp.floor(jax.random.uniform(key_count, (k, batch)) * valid).astype(jnp.int32) + 1
  count = jnp.minimum(count, valid)
  chosen = block_of[None] == block[..., None]  # [K, B, L]
  inside = _random_subset(key_mask, chosen & completion_mask[None], count)
  later = block_of[None] > block[..., None]
  earlier = (prompt_mask | completion_mask)[None] & ~chosen & ~later
  noisy = inside | later | past[None] | _bernoulli_subset(key_prompt, earlier, prompt_mask_prob)
  scored = noisy & completion_mask[None]
  scored_count = jnp.sum(scored, axis=-1).astype(jnp.float32)
  length_f = length[None].astype(jnp.float32)
  mean_scale = safe_div(jnp.ones_like(scored_count), scored_count) / k
  return MaskSample.per_row(noisy=noisy, scored=scored, sum_scale=mean_scale * length_f,
                            mean_scale=mean_scale, rate=safe_div(scored_count, length_f))


def _block_random_unbiased_masks(key: Array, prompt_mask: Array, completion_mask: Array,
                                 num_samples: int, *, block_length: int = 32,
                                 prompt_mask_prob: float = 0.15) -> MaskSample:
  """An unbiased variant of block_random: a uniformly chosen completion block, earlier blocks
  clean, later ones masked and not scored, a uniform count in [1, m] masked inside the block,
  each scored token weighted by the inverse of its probability of being scored."""
  key_block, key_count, key_mask, key_prompt = jax.random.split(key, 4)
  k = num_samples
  batch = completion_mask.shape[0]
  length = jnp.sum(completion_mask, axis=-1).astype(jnp.int32)  # [B]
  block_of, _, num_blocks, past = _generation_blocks(prompt_mask, completion_mask, block_length)
  num_blocks = num_blocks * (length > 0)
  block = jax.random.randint(key_block, (k, batch), 0, jnp.maximum(num_blocks, 1))
  block_size = jnp.clip(length[None] - block * block_length, 0, block_length)  # [K, B]
  count = jnp.floor(jax.random.uniform(key_count, (k, batch)) * block_size) + 1
  count = jnp.minimum(count, block_size).astype(jnp.int32)
  in_block = (block_of[None] == block[..., None]) & completion_mask[None]
  later = block_of[None] > block[..., None]
  masked = _random_subset(key_mask, in_block, count)
  noisy = masked | later | past[None] | _mask_prompt(key_prompt, prompt_mask, k, prompt_mask_prob)
  # One of num_blocks blocks, m of its n tokens: a token is scored with
  # probability m / (num_blocks * n), so weighting by the inverse makes the sum
  # form unbiased; dividing by L gives the per-token mean.
  count_f = count.astype(jnp.float32)
  total = (num_blocks[None] * block_size).astype(jnp.float32)
  sum_scale = safe_div(total, count_f) / k
  mean_scale = safe_div(total, count_f * length[None]) / k
  return MaskSample.per_row(noisy=noisy, scored=masked, sum_scale=sum_scale,
                            mean_scale=mean_scale, rate=safe_div(count_f, total))


# ---------------------------------------------------------------------------
# The method registry: ``config.estimator.method`` names one of these.
# ---------------------------------------------------------------------------

_METHODS: dict[str, Callable[..., MaskSample]] = {}


def register_method(name: str, sampler: Callable[..., MaskSample]) -> Callable[..., MaskSample]:
  """Registers a mask sampler as estimator method ``name`` (``config.estimator.method``).

  ``sampler(key, prompt_mask [B, L] bool, completion_mask [B, L] bool, num_samples, *, ...)``
  returns a :class:`MaskSample`; its keyword-only arguments are the method's options, which the
  config sets through the ``config.estimator`` fields of the same names (``method_options``).
  Everything else (validation, the likelihood spec, the sweeps) consults this registry.
  """
  if name in _METHODS:
    raise ValueError(f"estimator method {name!r} is already registered")
  _METHODS[name] = sampler
  return sampler


def unregister_method(name: str) -> None:
  """Removes a registered method (for tests that register their own)."""
  _METHODS.pop(name)


def methods() -> tuple[str, ...]:
  """The registered estimator methods."""
  return tuple(_METHODS)


def method_options(method: str) -> tuple[str, ...]:
  """The options ``method``'s mask sampler takes: its keyword-only arguments."""
  params = inspect.signature(_METHODS[method]).parameters.values()
  return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


register_method("mean_field", _mean_field_masks)
register_method("elbo", _elbo_masks)
register_method("block_random", _block_random_masks)
register_method("block_random_unbiased", _block_random_unbiased_masks)
register_method("espo_elbo", _espo_elbo_masks)


def sample_masks(key: Array, prompt_mask: Array, completion_mask: Array, *,
                 method: str, num_samples: int = 1, **options) -> MaskSample:
  """Monte Carlo masks for ``method`` (see the module docstring).

  Args:
    key: PRNG key; the same key gives the same masks (coupled ratios).
    prompt_mask: [B, L] bool, prompt tokens.
    completion_mask: [B, L] bool, completion tokens that count (no padding).
    method: a registered method (``methods()``).
    num_samples: K.
    **options: method options (``prompt_mask_prob``, ``schedule``,
      ``coupled``, ``block_length``).

  Returns:
    A :class:`MaskSample` with R = K rows (2K for coupled ELBO masks).
  """
  if method not in _METHODS:
    raise ValueError(f"Unknown estimator method {method!r}; choose one of {methods()}.")
  if num_samples < 1:
    raise ValueError(f"num_samples must be >= 1, got {num_samples}.")
  chex.assert_rank(prompt_mask, 2)
  chex.assert_equal_shape([prompt_mask, completion_mask])
  masks = _METHODS[method](key, prompt_mask.astype(bool), completion_mask.astype(bool),
                           num_samples, **options)
  check_masks(masks, prompt_mask.shape, where=f"estimator method {method!r}")
  return masks


def check_masks(masks: Any, batch_shape: tuple[int, int], where: str) -> None:
  """``masks`` is a :class:`MaskSample` of R rows for [B, L] = ``batch_shape``, else a
  ValueError naming ``where`` and the field."""
  if not isinstance(masks, MaskSample):
    raise ValueError(f"{where}: returned {type(masks).__name__}, not an estimators.MaskSample")
  rows = masks.noisy.shape[0] if masks.noisy.ndim == 3 else None
  want = {"noisy": (rows, *batch_shape), "scored": (rows, *batch_shape),
          "weight": (rows, *batch_shape), "rate": (rows, *batch_shape),
          "sum_scale": (rows, batch_shape[0]), "mean_scale": (rows, batch_shape[0])}
  for field, shape in want.items():
    got = tuple(getattr(masks, field).shape)
    if rows is None or got != shape:
      raise ValueError(f"{where}: MaskSample.{field} has shape {got}, expected {shape} "
                       "([R, B, L] masks, weights and rates; [R, B] scales)")


# ---------------------------------------------------------------------------
# Scoring.
# ---------------------------------------------------------------------------


def token_logprobs(logits_fn: LogitsFn, tokens: Array, noisy: Array,
                   mask_id: int, suffix: int | None = None) -> Array:
  """log p(z_i | noised z) at every position, all rows in one forward pass.

  Args:
    logits_fn: tokens [B * R, L] -> logits [B * R, L, V]; row b * R + r is the r-th noised
      copy of sequence b (sequence-major, so that a batch split over devices stays split: each
      device scores the samples of its own sequences). With ``suffix``, called as
      ``logits_fn(tokens, suffix=n)`` and returning the logits of the last n positions only,
      [B * R, n, V].
    tokens: [B, L] clean tokens z.
    noisy: [R, B, L] bool, positions to replace by ``mask_id``.
    mask_id: the mask token id.
    suffix: score only the last ``suffix`` positions (the completion, when every prompt is
      left-padded to the same length): the model skips the output head and the last block's
      queries everywhere else. The caller guarantees that no earlier position is scored.

  Returns:
    [R, B, L] float32 log-probs of the clean tokens (0 before the suffix).
  """
  rows, batch, length = noisy.shape
  noised = jnp.where(jnp.swapaxes(noisy, 0, 1), mask_id, tokens[:, None])  # [B, R, L]
  noised = noised.reshape(batch * rows, length)
  if suffix is None:
    scored, logits = tokens, logits_fn(noised)
  else:
    if not 0 < suffix <= length:
      raise ValueError(f"suffix must lie in [1, {length}], got {suffix}")
    scored, logits = tokens[:, length - suffix:], logits_fn(noised, suffix=suffix)
  chex.assert_shape(logits, (batch * rows, scored.shape[1], None))
  logits = logits.astype(jnp.float32)
  clean = jnp.repeat(scored, rows, axis=0)[..., None]
  logp = jnp.take_along_axis(logits, clean, axis=-1)[..., 0] - jax.nn.logsumexp(logits, axis=-1)
  logp = jnp.swapaxes(logp.reshape(batch, rows, -1), 0, 1)
  return jnp.pad(logp, ((0, 0), (0, 0), (length - logp.shape[-1], 0)))


def combine(token_logp: Array, masks: MaskSample, normalize: str = "sum") -> Array:
  """[B] estimate: the sum over rows of each row's scaled, weighted sum of scored log-probs.

  Args:
    token_logp: [R, B, L].
    masks: the rows' :class:`MaskSample`.
    normalize: 'sum' (log-likelihood) or 'mean' (per-token, length-normalized).
  """
  return jnp.sum(combine_rows(token_logp, masks, normalize), axis=0)


def combine_rows(token_logp: Array, masks: MaskSample, normalize: str = "sum") -> Array:
  """[R, B] each row's term of ``combine``: its scale times its scored log-probs' weighted sum
  (:class:`MaskSample`)."""
  if normalize not in NORMALIZATIONS:
    raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}.")
  scale = masks.sum_scale if normalize == "sum" else masks.mean_scale
  per_row = jnp.sum(jnp.where(masks.scored, masks.weight * token_logp, 0.0), axis=-1)
  return scale * per_row


def monte_carlo_variance(row_values: Array) -> Array:
  """[B] the variance of an R-row estimate, estimated from its own rows.

  Row r's term c_r of an estimate ``value = sum_r c_r`` makes ``x_r = R c_r`` a one-row
  estimate, ``value`` their mean; with the rows taken as independent draws the variance of
  ``value`` is estimated by ``s^2 / R``, s^2 the unbiased sample variance of the x_r. Coupled
  rows (ESPO's complementary pairs) are negatively correlated, so for them it is an upper
  estimate. Needs R >= 2.

  Args:
    row_values: [R, B] (``Estimate.row_values``).
  """
  num_rows = row_values.shape[0]
  if num_rows < 2:
    raise ValueError(f"a variance needs at least 2 rows (K Monte Carlo samples), got {num_rows}")
  row_values = row_values.astype(jnp.float32)
  mean = jnp.mean(row_values, axis=0)
  return num_rows / (num_rows - 1) * jnp.sum(jnp.square(row_values - mean), axis=0)


def estimate_from_masks(logits_fn: LogitsFn, tokens: Array, masks: MaskSample, *,
                        mask_id: int, normalize: str = "sum",
                        suffix: int | None = None) -> Estimate:
  """Scores given masks: one forward pass of R * B rows (``suffix``: see ``token_logprobs``)."""
  token_logp = token_logprobs(logits_fn, tokens, masks.noisy, mask_id, suffix)
  # The rows' terms from a copy behind a barrier: the value's computation (and its fusion, so
  # its rounding) stays what it is without them.
  rows = combine_rows(jax.lax.optimization_barrier(token_logp), masks, normalize)
  return Estimate(value=combine(token_logp, masks, normalize), token_logp=token_logp,
                  masks=masks, row_values=rows)


def estimate_logp(logits_fn: LogitsFn, tokens: Array, prompt_mask: Array,
                  completion_mask: Array, key: Array, *, method: str,
                  mask_id: int, num_samples: int = 1, normalize: str = "sum",
                  masks: MaskSample | None = None, return_details: bool = False,
                  suffix: int | None = None, **options) -> Array | Estimate:
  """Estimate log pi(y | x) for each sequence of a batch.

  Args:
    logits_fn: tokens [B', L] -> logits [B', L, V], bidirectional.
    tokens: [B, L] clean tokens z = [x; y] (int).
    prompt_mask: [B, L] bool, prompt tokens x.
    completion_mask: [B, L] bool, completion tokens y that count (no padding).
    key: PRNG key (unused when ``masks`` is given).
    method: a registered method (``methods()``).
    mask_id: the mask token id.
    num_samples: K Monte Carlo samples, scored in one batched forward pass.
    normalize: 'sum' (log-likelihood) or 'mean' (per completion token).
    masks: reuse these masks (e.g. the same masks for the numerator and the
      denominator of a ratio) instead of sampling.
    return_details: return an :class:`Estimate` (with token log-probs) instead
      of the [B] values.
    suffix: the completion is the last ``suffix`` positions of every row: only they get
      logits (``token_logprobs``); None: every position.
    **options: options of the method's mask sampler.

  Returns:
    [B] float32 estimates, or an :class:`Estimate`.
  """
  check_token_batch(tokens, prompt_mask, completion_mask)
  if masks is None:
    masks = sample_masks(key, prompt_mask, completion_mask, method=method,
                         num_samples=num_samples, **options)
  estimate = estimate_from_masks(logits_fn, tokens, masks, mask_id=mask_id,
                                 normalize=normalize, suffix=suffix)
  return estimate if return_details else estimate.value


# ---------------------------------------------------------------------------
# SPG's evidence upper bound.
# ---------------------------------------------------------------------------


def eubo_from_samples(token_logp: Array, masks, *, beta: float = 1.5) -> Array:
  """EUBO_beta: per token, log of the row average of ``p^beta / t_hat``, over beta.

  ``eubo_i = (1/beta) log((1/R) sum_r 1[i scored in r] p_r(y_i)^beta / t_hat_r)``,
  averaged over the tokens scored in at least one row. For a model whose
  logits ignore the input it tends to the per-token mean log-likelihood as R
  grows, because ``E[1[i scored] / t_hat] = 1`` (see :class:`MaskSample`);
  for beta > 1 it bounds the likelihood from above (SPG).

  Args:
    token_logp: [R, B, L] token log-probs of the rows.
    masks: the rows' :class:`MaskSample` (its per-token rates t_hat).
    beta: the Renyi order, > 0.

  Returns:
    [B] per-token EUBO estimates (0 for sequences with nothing scored).
  """
  if beta <= 0:
    raise ValueError(f"beta must be > 0, got {beta}.")
  rows = token_logp.shape[0]
  log_rate = jnp.log(jnp.where(masks.rate > 0, masks.rate, 1.0))
  terms = jnp.where(masks.scored, beta * token_logp - log_rate, -jnp.inf)
  scored_any = jnp.any(masks.scored, axis=0)  # [B, L]
  # Tokens scored in no row get a finite dummy (then dropped), so that neither
  # the value nor the gradient sees a logsumexp of only -inf.
  terms = jnp.where(scored_any[None], terms, 0.0)
  per_token = (jax.nn.logsumexp(terms, axis=0) - jnp.log(rows)) / beta
  per_token = jnp.where(scored_any, per_token, 0.0)
  return safe_div(jnp.sum(per_token, axis=-1), jnp.sum(scored_any, axis=-1))


# ---------------------------------------------------------------------------
# Stress test: importance-weight explosion (docs/stress_test.md).
# ---------------------------------------------------------------------------


def stress_masks(prompt_mask: Array, completion_mask: Array, *, mode: str,
                 rate: float, num_samples: int = 1) -> MaskSample:
  """Deliberately biased ELBO masks that make log rho explode.

  ``mode="easy"`` masks the last ``ceil(rate * L)`` completion tokens (little
  to predict, with the most context: a high estimate); ``mode="hard"`` masks
  the first ``ceil(rate * L)`` (a low estimate). Used for the numerator
  (easy, rate t_min) and the denominator (hard, rate t_max) of a ratio. Rows
  are weighted like count-schedule ELBO samples (``L / m`` and ``1 / m``).

  Args:
    prompt_mask: [B, L] bool (prompts stay clean).
    completion_mask: [B, L] bool.
    mode: 'easy' or 'hard'.
    rate: fraction of the completion to mask, in (0, 1].
    num_samples: K, so that the result can replace K-row masks.
  """
  if mode not in ("easy", "hard"):
    raise ValueError(f"mode must be 'easy' or 'hard', got {mode!r}.")
  if not 0.0 < rate <= 1.0:
    raise ValueError(f"rate must lie in (0, 1], got {rate}.")
  completion_mask = completion_mask.astype(bool)
  past = past_completion(prompt_mask.astype(bool), completion_mask)
  length = jnp.sum(completion_mask, axis=-1)
  count = jnp.clip(jnp.ceil(rate * length), 1, jnp.maximum(length, 1)) * (length > 0)
  rank = _completion_rank(completion_mask)
  if mode == "easy":
    masked = completion_mask & (rank >= (length - count)[:, None])
  else:
    masked = completion_mask & (rank < count[:, None])
  masked = jnp.broadcast_to(masked[None], (num_samples,) + masked.shape)
  count = jnp.broadcast_to(count[None].astype(jnp.float32), (num_samples,) + count.shape)
  length_f = jnp.broadcast_to(length[None].astype(jnp.float32), count.shape)
  return MaskSample.per_row(noisy=masked | past[None], scored=masked,
                            sum_scale=safe_div(length_f, count) / num_samples,
                            mean_scale=safe_div(jnp.ones_like(count), count) / num_samples,
                            rate=safe_div(count, length_f))


def stress_selection(key: Array, batch_size: int, fraction: float) -> Array:
  """[B] bool with exactly ``round(fraction * B)`` randomly chosen samples."""
  if not 0.0 <= fraction <= 1.0:
    raise ValueError(f"fraction must lie in [0, 1], got {fraction}.")
  count = round(fraction * batch_size)
  order = jnp.argsort(jax.random.uniform(key, (batch_size,)))
  return jnp.zeros(batch_size, bool).at[order[:count]].set(True)


def select_masks(selected: Array, when_selected: MaskSample,
                 otherwise: MaskSample) -> MaskSample:
  """Per sequence, the masks of ``when_selected`` where ``selected`` [B], else ``otherwise``.

  Both must have the same number of rows.
  """
  chex.assert_rank(selected, 1)
  if when_selected.num_rows != otherwise.num_rows:
    raise ValueError(
        f"Masks differ in rows: {when_selected.num_rows} vs {otherwise.num_rows}.")

  def pick(a: Array, b: Array) -> Array:
    sel = selected.reshape((1, -1) + (1,) * (a.ndim - 2))
    return jnp.where(sel, a, b)

  return jax.tree.map(pick, when_selected, otherwise)


# ---------------------------------------------------------------------------
# How a model family's likelihoods are estimated.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LikelihoodSpec:
  """How an objective's likelihoods are estimated (static: hashable, no arrays).

  Attributes:
    method: estimator method ('mean_field', 'elbo', 'block_random').
    num_samples: K Monte Carlo samples.
    normalize: 'sum' or 'mean' (ignored at token level).
    token_level: per-token log-probs [N, L] instead of per-sequence estimates.
    eubo_beta: compute SPG's EUBO_beta from the same forward pass (None: no EUBO).
    mask_id: the mask token id.
    family: the model family (``config.model.family``), whose record's ``Likelihood`` says how
      its likelihoods are estimated (``training/step/rl_loss.py``).
    options: sorted (name, value) pairs for the estimator's mask sampler.
    stress_rates: (t_min, t_max), the mask rates of the stress test's "easy"
      (numerator) and "hard" (denominator) masks; None: no stress test.
    block_size: the block size of a block diffusion model; None: full attention.
    scored_suffix: full attention: every completion lies in the last ``scored_suffix``
      positions (prompts left-padded to one length), so the model computes logits there
      alone (``token_logprobs``); None: at every position.
  """

  method: str
  num_samples: int
  normalize: str
  token_level: bool
  eubo_beta: float | None
  mask_id: int
  family: str
  options: tuple[tuple[str, Any], ...] = ()
  stress_rates: tuple[float, float] | None = None
  block_size: int | None = None
  scored_suffix: int | None = None



@dataclasses.dataclass(frozen=True)
class Likelihood:
  """How the sequence likelihoods of one kind of model are estimated.

  A model family's record (``models.Family.likelihood``) holds one; ``training/step/rl_loss.py``
  consults only it. ``spec`` is the run's ``LikelihoodSpec`` (method, num_samples, options,
  mask_id, normalize, block_size, scored_suffix).

  Attributes:
    methods: () -> the ``config.estimator.method`` values it takes.
    options: method -> the ``config.estimator`` fields that method takes.
    masks: (key, prompt_mask [B, L], completion_mask [B, L], spec) -> masks [R, B, L].
    stress_masks: (prompt_mask, completion_mask, spec, *, mode, rate, num_rows) -> the stress
      test's biased masks ('easy' or 'hard', docs/stress_test.md), ``num_rows`` rows.
    estimate: (logits_fn, tokens [B, L], prompt_mask, completion_mask, attention_mask, masks,
      spec) -> an estimate with ``value`` [B], ``token_logp`` [R, B, L] and ``masks``.
    meaning: method -> what the method is for this kind of model when it is not what its name
      says ('' when it is), e.g. a block model's 'block_random' is its block ELBO.
  """

  methods: Callable[[], tuple[str, ...]]
  options: Callable[[str], tuple[str, ...]]
  masks: Callable[..., Any]
  stress_masks: Callable[..., Any]
  estimate: Callable[..., Any]
  meaning: Callable[[str], str] = lambda method: ""


def _spec_masks(key: Array, prompt_mask: Array, completion_mask: Array,
                spec: LikelihoodSpec) -> MaskSample:
  return sample_masks(key, prompt_mask, completion_mask, method=spec.method,
                      num_samples=spec.num_samples, **dict(spec.options))


def _spec_stress_masks(prompt_mask: Array, completion_mask: Array, spec: LikelihoodSpec, *,
                       mode: str, rate: float, num_rows: int) -> MaskSample:
  del spec
  return stress_masks(prompt_mask, completion_mask, mode=mode, rate=rate, num_samples=num_rows)


def _spec_estimate(logits_fn: LogitsFn, tokens: Array, prompt_mask: Array,
                   completion_mask: Array, attention_mask: Array, masks: MaskSample,
                   spec: LikelihoodSpec) -> Estimate:
  del attention_mask  # Bound into logits_fn by the family's likelihood_fn.
  return estimate_logp(logits_fn, tokens, prompt_mask, completion_mask, None,
                       method=spec.method, mask_id=spec.mask_id, normalize=spec.normalize,
                       masks=masks, return_details=True, suffix=spec.scored_suffix)


# A full-attention masked diffusion model (LLaDA): the registered methods and their options.
FULL_ATTENTION = Likelihood(methods=methods, options=method_options, masks=_spec_masks,
                            stress_masks=_spec_stress_masks, estimate=_spec_estimate)
