"""The block-diffusion ELBO: every block of a sequence scored in one staircase forward pass.

A block diffusion LM (SDAR) factorizes the likelihood over blocks of ``block_size`` positions,
fixed by absolute position (block j = positions [j bs, (j + 1) bs), prompt included):

    log pi(y | x) = sum_j log p(z_j | z_<j),   z = [x; y]

and bounds each factor by a masked-diffusion ELBO inside the block. With m_j of the block's L_j
completion tokens masked uniformly at random (m_j uniform on {1..L_j}, the count form of the
ELBO),

    log p(z_j | z_<j) >= E[(L_j / m_j) sum_{i masked} log p(z_i | z_<j, masked block j)]

(prompt tokens are never masked; they condition every block). The staircase layout [x_t ; x_0]
(``models/sdar/staircase.py``) computes log p(z_i | z_<j, masked block j) for *every* block j in one
forward pass: noisy block j sees itself and the clean blocks < j only. A naive estimator needs one
pass per block (``per_block_token_logprobs``, kept as the reference and the benchmark baseline).

As in ``estimators.py``, an estimate is made in two steps, so that masks can be shared between the
numerator and the denominator of a ratio:

1. ``sample_block_masks``: K Monte Carlo masks per sequence, every block masked in each (t_j
   stratified over the K samples, independently per block), as an ``estimators.MaskSample``
   with the unbiased weight of each scored token (the one mask representation of both families).
2. ``estimate_from_block_masks``: one staircase pass over the K noisy copies (the clean stream is
   shared by the K samples), then the weighted sum of the scored token log-probs.

``estimate_block_elbo`` does both. ``fixed_block_masks`` gives deterministic masks in the same
form: whole blocks (the block model's mean-field per-token log-probs) or the head / tail of each
block (the stress test's "hard" and "easy" masks). ``normalize="sum"`` estimates log pi(y | x);
``normalize="mean"`` estimates the per-token mean (1/L) log pi(y | x), L = completion length. For a
model whose logits ignore the input, both are unbiased for the exact values (tests check it).

Everything here is a pure function of arrays and explicit keys, with static shapes; the model is
seen only as ``staircase_fn(noisy [R, B, L], clean [B, L], attention_mask [B, L]) -> logits
[R, B, L, V]`` (e.g. ``lambda n, c, m: model.staircase(n, c, m)`` for an SDAR model), with L a
multiple of block_size (``estimate_block_elbo`` pads to one).
"""

from __future__ import annotations

from typing import Callable

import chex
import jax
import jax.numpy as jnp

from stabledrl_jax import estimators
from stabledrl_jax.estimators import safe_div

Array = jax.Array
StaircaseFn = Callable[[Array, Array, Array], Array]
LogitsFn = Callable[[Array, Array], Array]



def _check_block_size(block_size: int) -> None:
  if block_size < 1:
    raise ValueError(f"block_size must be >= 1, got {block_size}.")


def _to_blocks(x: Array, block_size: int, fill) -> Array:
  """[..., L] -> [..., nb, block_size], padding the last block with `fill`."""
  length = x.shape[-1]
  padded = -(-length // block_size) * block_size
  pad = [(0, 0)] * (x.ndim - 1) + [(0, padded - length)]
  x = jnp.pad(x, pad, constant_values=fill)
  return x.reshape(x.shape[:-1] + (padded // block_size, block_size))


def _from_blocks(x: Array, length: int) -> Array:
  """[..., nb, block_size] -> [..., L] (dropping the padding of the last block)."""
  return x.reshape(x.shape[:-2] + (-1,))[..., :length]


# ---------------------------------------------------------------------------
# Masks.
# ---------------------------------------------------------------------------


def sample_block_masks(key: Array, completion_mask: Array, *, block_size: int,
                       num_samples: int = 1, coupled: bool = False) -> estimators.MaskSample:
  """K masks per sequence, each masking every block that holds completion tokens.

  For sample k and block j with L_j > 0 completion tokens: t ~ U((k/K, (k+1)/K]) (stratified
  over the K samples, independent across blocks and sequences), m_j = ceil(t L_j) tokens of the
  block's completion masked uniformly at random, weight L_j / m_j. Given m_j every token of the
  block is masked with probability m_j / L_j, so the weighted sum is unbiased for the block's
  log-likelihood (and m_j is uniform on {1..L_j}: the count form of the masked-diffusion ELBO).

  ``coupled=True`` adds, for each sample, the complementary mask of every block (its other
  L_j - m_j tokens): 2K rows; sizes m < L_j then get half the weight L_j / m (a size-m set arises
  both as a mask and as a complement), so the estimate stays unbiased.

  Args:
    key: PRNG key; the same key gives the same masks.
    completion_mask: [B, L] bool, the completion tokens that count (no padding, no prompt).
    block_size: the model's block size; blocks are position // block_size.
    num_samples: K.
    coupled: add the complementary masks.

  Returns:
    A :class:`estimators.MaskSample` with R = K rows (2K if coupled).
  """
  _check_block_size(block_size)
  if num_samples < 1:
    raise ValueError(f"num_samples must be >= 1, got {num_samples}.")
  chex.assert_rank(completion_mask, 2)
  completion_mask = completion_mask.astype(bool)
  batch, length = completion_mask.shape
  k = num_samples
  key_t, key_order = jax.random.split(key)
  eligible = _to_blocks(completion_mask, block_size, False)  # [B, nb, bs]
  num_blocks = eligible.shape[1]
  block_len = jnp.sum(eligible, axis=-1).astype(jnp.float32)  # [B, nb] L_j
  u = jax.random.uniform(key_t, (k, batch, num_blocks))
  t = (jnp.arange(k, dtype=jnp.float32)[:, None, None] + 1.0 - u) / k  # in (k/K, (k+1)/K]
  count = jnp.clip(jnp.ceil(t * block_len[None]), 1, jnp.maximum(block_len[None], 1))
  count = count * (block_len[None] > 0)  # [K, B, nb] m_j
  # A uniformly random subset of `count` eligible tokens in each block.
  priority = jnp.where(eligible[None], jax.random.uniform(key_order, (k,) + eligible.shape), 2.0)
  rank = jnp.argsort(jnp.argsort(priority, axis=-1), axis=-1)
  masked = eligible[None] & (rank < count[..., None])  # [K, B, nb, bs]
  weight = safe_div(block_len[None], count)
  rate = safe_div(count, block_len[None])
  if coupled:  # Each block's mask with its complement (``estimators.complementary``).
    masked, counts, shares = estimators.complementary(masked, eligible[None], count,
                                                      block_len[None])
    weight = safe_div(block_len[None], shares)
    rate = safe_div(counts, block_len[None])
  return _pack(masked, eligible, weight, rate, length, k)


def _pack(masked: Array, eligible: Array, weight: Array, rate: Array, length: int,
          num_samples: int) -> estimators.MaskSample:
  """Blocked masks [R, B, nb, bs] with per-block weight and rate [R, B, nb] -> per token.

  The weight is divided by K (the Monte Carlo average) and kept on masked tokens only, the
  rate on every completion token of the block; the rows' sum scale is 1 and their mean scale
  1 / (completion length). Noised and scored positions are the same.
  """
  weight = jnp.where(masked, weight[..., None] / num_samples, 0.0)
  rate = jnp.where(eligible[None], rate[..., None], 0.0)
  noisy = _from_blocks(masked, length)
  completion_length = jnp.sum(eligible, axis=(-2, -1)).astype(jnp.float32)  # [B]
  ones = jnp.ones(noisy.shape[:2], jnp.float32)
  return estimators.MaskSample(noisy=noisy, scored=noisy,
                               weight=_from_blocks(weight, length).astype(jnp.float32),
                               sum_scale=ones, mean_scale=safe_div(ones, completion_length),
                               rate=_from_blocks(rate, length).astype(jnp.float32))


FIXED_POSITIONS = ("head", "tail")


def fixed_block_masks(completion_mask: Array, *, block_size: int, rate: float = 1.0,
                      position: str = "head", num_samples: int = 1) -> estimators.MaskSample:
  """Deterministic masks: in every block, the first or last ceil(rate L_j) completion tokens.

  Weighted like `sample_block_masks` rows of that count (L_j / m_j), so the estimate is the
  block ELBO's term at a fixed mask instead of a random one. Two uses:

  * ``rate=1`` (either position): every completion token of every block masked, weight 1. Each
    token is scored given the clean blocks before its own and nothing of its block: the block
    model's mean-field (d1's one-pass per-token log-probs, blockwise). Deterministic, so one row
    suffices.
  * the stress test (docs/stress_test.md, per block): ``position="tail"`` with a small rate masks
    only the last tokens of each block, which see the rest of their block ("easy": a high
    estimate, the numerator); ``position="head"`` with rate 1 masks whole blocks ("hard": a low
    estimate, the denominator).

  Args:
    completion_mask: [B, L] bool, the completion tokens that count.
    block_size: the model's block size; blocks are position // block_size.
    rate: the fraction of each block's completion tokens to mask, in (0, 1]; at least one.
    position: 'head' (the block's first completion tokens) or 'tail' (its last).
    num_samples: R identical rows, so that the result can replace R-row masks
      (``estimators.select_masks``); each row carries 1/R of the weight.

  Returns:
    A :class:`estimators.MaskSample` with R = num_samples rows.
  """
  _check_block_size(block_size)
  if position not in FIXED_POSITIONS:
    raise ValueError(f"position must be one of {FIXED_POSITIONS}, got {position!r}.")
  if not 0.0 < rate <= 1.0:
    raise ValueError(f"rate must lie in (0, 1], got {rate}.")
  if num_samples < 1:
    raise ValueError(f"num_samples must be >= 1, got {num_samples}.")
  chex.assert_rank(completion_mask, 2)
  length = completion_mask.shape[1]
  eligible = _to_blocks(completion_mask.astype(bool), block_size, False)  # [B, nb, bs]
  block_len = jnp.sum(eligible, axis=-1).astype(jnp.float32)  # [B, nb] L_j
  count = jnp.clip(jnp.ceil(rate * block_len), 1, jnp.maximum(block_len, 1)) * (block_len > 0)
  rank = jnp.cumsum(eligible, axis=-1) - 1.0  # rank among the block's completion tokens
  if position == "head":
    masked = eligible & (rank < count[..., None])
  else:
    masked = eligible & (rank >= (block_len - count)[..., None])
  tile = lambda x: jnp.broadcast_to(x[None], (num_samples,) + x.shape)
  return _pack(tile(masked), eligible, tile(safe_div(block_len, count)),
               tile(safe_div(count, block_len)), length, num_samples)


# ---------------------------------------------------------------------------
# Scoring.
# ---------------------------------------------------------------------------


def _pad_to_blocks(tokens: Array, noisy: Array, attention_mask: Array | None,
                   block_size: int) -> tuple[Array, Array, Array]:
  """Right-pads L to a multiple of block_size; the padding is excluded from attention."""
  batch, length = tokens.shape
  padded = -(-length // block_size) * block_size
  mask = jnp.ones((batch, length), bool) if attention_mask is None else attention_mask.astype(bool)
  extra = padded - length
  if extra:
    tokens = jnp.pad(tokens, ((0, 0), (0, extra)))
    noisy = jnp.pad(noisy, ((0, 0), (0, 0), (0, extra)))
    mask = jnp.pad(mask, ((0, 0), (0, extra)))
  return tokens, noisy, mask


def _logp_of(logits: Array, tokens: Array) -> Array:
  """logits [..., L, V], tokens broadcastable to [..., L] -> log p(token) [..., L] in float32."""
  logits = logits.astype(jnp.float32)
  tokens = jnp.broadcast_to(tokens, logits.shape[:-1])
  picked = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


def staircase_token_logprobs(staircase_fn: StaircaseFn, tokens: Array, noisy: Array, *,
                             mask_id: int, block_size: int,
                             attention_mask: Array | None = None) -> Array:
  """log p(z_i | z_<j, noised block j) at every position, all blocks and rows in one pass.

  Args:
    staircase_fn: (noisy [R, B, L'], clean [B, L'], attention_mask [B, L']) -> logits
      [R, B, L', V] of the noisy streams, L' a multiple of block_size.
    tokens: [B, L] clean tokens z.
    noisy: [R, B, L] bool, positions replaced by ``mask_id`` in x_t.
    mask_id: the mask token id.
    block_size: the model's block size.
    attention_mask: [B, L] bool, False for padding (e.g. a left-padded prompt), or None.

  Returns:
    [R, B, L] float32 log-probs of the clean tokens.
  """
  _check_block_size(block_size)
  rows, batch, length = noisy.shape
  chex.assert_shape(tokens, (batch, length))
  padded_tokens, padded_noisy, mask = _pad_to_blocks(tokens, noisy, attention_mask, block_size)
  noised = jnp.where(padded_noisy, mask_id, padded_tokens[None])
  logits = staircase_fn(noised, padded_tokens, mask)
  chex.assert_shape(logits, (rows, batch, padded_tokens.shape[1], None))
  return _logp_of(logits, padded_tokens[None])[..., :length]


def per_block_token_logprobs(logits_fn: LogitsFn, tokens: Array, noisy: Array, *, mask_id: int,
                             block_size: int, attention_mask: Array | None = None) -> Array:
  """The same log-probs as `staircase_token_logprobs`, from one block-causal pass per block.

  The naive estimator (reference and benchmark baseline): for block j, a plain block-causal pass
  over z with only block j noised (later blocks do not affect block j under block-causal
  attention), keeping block j's logits. num_blocks sequential passes of R * B rows.

  Args:
    logits_fn: (tokens [N, L'], attention_mask [N, L']) -> logits [N, L', V], block-causal
      (e.g. ``lambda t, m: model(t, m)`` for an SDAR model).
    tokens, noisy, mask_id, block_size, attention_mask: as in `staircase_token_logprobs`.

  Returns:
    [R, B, L] float32.
  """
  _check_block_size(block_size)
  rows, batch, length = noisy.shape
  padded_tokens, padded_noisy, mask = _pad_to_blocks(tokens, noisy, attention_mask, block_size)
  padded = padded_tokens.shape[1]
  num_blocks = padded // block_size
  block_of = jnp.arange(padded) // block_size
  rows_mask = jnp.broadcast_to(mask[None], (rows, batch, padded)).reshape(rows * batch, padded)

  def one_block(j):
    inputs = jnp.where(padded_noisy & (block_of == j), mask_id, padded_tokens[None])
    logits = logits_fn(inputs.reshape(rows * batch, padded), rows_mask)
    logits = jax.lax.dynamic_slice_in_dim(logits, j * block_size, block_size, axis=1)
    block_tokens = jax.lax.dynamic_slice_in_dim(padded_tokens, j * block_size, block_size, axis=1)
    return _logp_of(logits.reshape(rows, batch, block_size, -1), block_tokens[None])

  per_block = jax.lax.map(one_block, jnp.arange(num_blocks))  # [nb, R, B, bs]
  return jnp.moveaxis(per_block, 0, 2).reshape(rows, batch, padded)[..., :length]


def estimate_from_block_masks(staircase_fn: StaircaseFn, tokens: Array,
                              masks: estimators.MaskSample, *, mask_id: int, block_size: int,
                              normalize: str = "sum",
                              attention_mask: Array | None = None) -> estimators.Estimate:
  """Scores given masks: one staircase pass over the R noisy rows and the shared clean stream."""
  token_logp = staircase_token_logprobs(staircase_fn, tokens, masks.noisy, mask_id=mask_id,
                                        block_size=block_size, attention_mask=attention_mask)
  # The rows' terms from a copy behind a barrier: the value's fusion stays as it is.
  rows = estimators.combine_rows(jax.lax.optimization_barrier(token_logp), masks, normalize)
  return estimators.Estimate(value=estimators.combine(token_logp, masks, normalize),
                             token_logp=token_logp, masks=masks, row_values=rows)


def estimate_block_elbo(staircase_fn: StaircaseFn, tokens: Array, prompt_mask: Array,
                        completion_mask: Array, key: Array, *, mask_id: int, block_size: int,
                        num_samples: int = 1, normalize: str = "sum", coupled: bool = False,
                        masks: estimators.MaskSample | None = None,
                        attention_mask: Array | None = None,
                        return_details: bool = False) -> Array | estimators.Estimate:
  """Estimate log pi(y | x) of a block diffusion model, every block scored in one pass.

  Args:
    staircase_fn: (noisy [R, B, L'], clean [B, L'], attention_mask [B, L']) -> logits
      [R, B, L', V] (see the module docstring).
    tokens: [B, L] clean tokens z = [x; y] (int); blocks are position // block_size.
    prompt_mask: [B, L] bool, prompt tokens x (never masked; they condition every block).
    completion_mask: [B, L] bool, completion tokens y that count (no padding).
    key: PRNG key (unused when ``masks`` is given).
    mask_id: the mask token id.
    block_size: the model's block size.
    num_samples: K Monte Carlo samples, scored in the same pass.
    normalize: 'sum' (log-likelihood) or 'mean' (per completion token).
    coupled: also score the complementary mask of every block (2K rows).
    masks: reuse these masks (e.g. for both sides of a ratio) instead of sampling.
    attention_mask: [B, L] bool, False for padding positions (left-padded prompts), or None.
    return_details: return a :class:`estimators.Estimate` instead of the [B] values.

  Returns:
    [B] float32 estimates, or a :class:`estimators.Estimate`.
  """
  estimators.check_token_batch(tokens, prompt_mask, completion_mask)
  if masks is None:
    masks = sample_block_masks(key, completion_mask, block_size=block_size,
                               num_samples=num_samples, coupled=coupled)
  chex.assert_shape(masks.noisy, (None,) + tokens.shape)
  estimate = estimate_from_block_masks(staircase_fn, tokens, masks,
                                       mask_id=mask_id, block_size=block_size,
                                       normalize=normalize, attention_mask=attention_mask)
  return estimate if return_details else estimate.value


# ---------------------------------------------------------------------------
# A block diffusion model's likelihood (``models.Family.likelihood``).
# ---------------------------------------------------------------------------

# The estimator methods a block model takes keep their full-attention meaning by analogy
# (``training/step/rl_loss.py``'s docstring): 'mean_field' scores every block fully masked, each
# token given the clean blocks before its own; every ELBO method is the block ELBO, all blocks
# scored in one staircase pass (for blocks fixed by position, averaging SPG's one random block
# over the choice of block gives exactly that).
METHODS = ("mean_field", "elbo", "block_random", "block_random_unbiased", "espo_elbo")


def _options(method: str) -> tuple[str, ...]:
  return () if method == "mean_field" else ("coupled",)


def _spec_masks(key: Array, prompt_mask: Array, completion_mask: Array,
                spec: estimators.LikelihoodSpec) -> estimators.MaskSample:
  del prompt_mask  # Prompts are never masked.
  if spec.method == "mean_field":
    return fixed_block_masks(completion_mask, block_size=spec.block_size)
  return sample_block_masks(key, completion_mask, block_size=spec.block_size,
                            num_samples=spec.num_samples, **dict(spec.options))


def _spec_stress_masks(prompt_mask: Array, completion_mask: Array,
                       spec: estimators.LikelihoodSpec, *, mode: str, rate: float,
                       num_rows: int) -> estimators.MaskSample:
  """Per block of L_j completion tokens: 'easy' masks only the last ceil(rate L_j), 'hard' the
  first ceil(rate L_j)."""
  del prompt_mask
  return fixed_block_masks(completion_mask, block_size=spec.block_size, rate=rate,
                           position="tail" if mode == "easy" else "head", num_samples=num_rows)


def _spec_estimate(staircase_fn: StaircaseFn, tokens: Array, prompt_mask: Array,
                   completion_mask: Array, attention_mask: Array, masks: estimators.MaskSample,
                   spec: estimators.LikelihoodSpec) -> estimators.Estimate:
  return estimate_block_elbo(staircase_fn, tokens, prompt_mask, completion_mask, None,
                             mask_id=spec.mask_id, block_size=spec.block_size,
                             normalize=spec.normalize, masks=masks,
                             attention_mask=attention_mask, return_details=True)


def _meaning(method: str) -> str:
  """What each name means for a block model (``training/step/rl_loss.py``, docs/algorithms.md)."""
  if method == "mean_field":
    return ("the whole-block mean field: every completion block fully masked, each token scored "
            "given the clean blocks before it (one deterministic row)")
  return ("the block ELBO: every block scored in one staircase pass (count form); the name's "
          "own block / prompt rules do not apply to a block model")


BLOCK = estimators.Likelihood(methods=lambda: METHODS, options=_options, masks=_spec_masks,
                              stress_masks=_spec_stress_masks, estimate=_spec_estimate,
                              meaning=_meaning)
