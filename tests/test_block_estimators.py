"""The block-diffusion ELBO: one staircase pass equals per-block passes, masks are per block with
unbiased weights, and the estimate is exact / unbiased for a model whose logits ignore the input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stabledrl_jax import block_estimators as be, models

CONFIG = models.get_sdar_config("tiny")
BS, MASK = CONFIG.block_size, CONFIG.mask_token_id

# Jitted once per shape (an eager call compiles every operation separately).
sample_masks = jax.jit(be.sample_block_masks,
                       static_argnames=("block_size", "num_samples", "coupled"))


def make_batch(length=18, prompt=5, lengths=(13, 6, 1), seed=0, vocab=100):
  """Prompts of 5 tokens, right-padded completions of the given lengths; L = 18 is not a multiple
  of the block size (the estimator pads), and block 1 mixes prompt and completion."""
  rng = np.random.default_rng(seed)
  batch = len(lengths)
  tokens = jnp.asarray(rng.integers(0, vocab, size=(batch, length)), jnp.int32)
  prompt_mask = jnp.zeros((batch, length), bool).at[:, :prompt].set(True)
  completion = np.zeros((batch, length), bool)
  for b, n in enumerate(lengths):
    completion[b, prompt:prompt + n] = True
  return tokens, prompt_mask, jnp.asarray(completion)


@pytest.fixture(scope="module")
def tiny():
  return models.SDAR(CONFIG, rngs=nnx.Rngs(0))


@nnx.jit
def score(model, tokens, prompt_mask, completion, masks, attention_mask):
  """The one-pass block ELBO of an SDAR model on given masks (jitted once per shape)."""
  fn = lambda noisy, clean, mask: model.staircase(noisy, clean, mask)
  return be.estimate_block_elbo(fn, tokens, prompt_mask, completion, None, mask_id=MASK,
                                block_size=BS, masks=masks, attention_mask=attention_mask)


def test_one_pass_equals_the_sum_of_per_block_passes(tiny):
  tokens, prompt_mask, completion = make_batch()
  key = jax.random.key(0)

  @nnx.jit
  def one_pass(model, tokens):
    fn = lambda noisy, clean, mask: model.staircase(noisy, clean, mask)
    return be.estimate_block_elbo(fn, tokens, prompt_mask, completion, key, mask_id=MASK,
                                  block_size=BS, num_samples=2, return_details=True)

  est = one_pass(tiny, tokens)
  masks = est.masks
  assert est.token_logp.shape == masks.noisy.shape == (2,) + tokens.shape

  # The reference: for every sample and block, a plain block-causal pass over the clean prefix
  # followed by that one noisy block (the last block is cut at L = 18: 2 of its 4 positions).
  forward = nnx.jit(lambda model, t: model(t))
  length = tokens.shape[1]
  weight = np.asarray(masks.weight, np.float64)
  noisy, clean = np.asarray(masks.noisy), np.asarray(tokens)
  value = np.zeros(tokens.shape[0])
  for r in range(2):
    x_t = np.where(noisy[r], MASK, clean)
    for j in range(-(-length // BS)):
      lo, hi = j * BS, min((j + 1) * BS, length)
      inputs = np.concatenate([clean[:, :lo], x_t[:, lo:hi]], axis=1)
      logits = np.asarray(forward(tiny, inputs), np.float64)[:, lo:]
      logp = logits - logits.max(-1, keepdims=True)
      logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
      picked = np.take_along_axis(logp, clean[:, lo:hi, None], -1)[..., 0]
      scored = noisy[r, :, lo:hi]
      np.testing.assert_allclose(np.asarray(est.token_logp[r, :, lo:hi])[scored],
                                 picked[scored], atol=1e-5)
      value += np.sum(np.where(scored, weight[r, :, lo:hi] * picked, 0.0), axis=1)
  np.testing.assert_allclose(np.asarray(est.value), value, atol=1e-5, rtol=1e-5)

  # The library's naive estimator (one full-length pass per block) agrees too.
  naive = nnx.jit(lambda model, t: be.per_block_token_logprobs(
      lambda x, m: model(x, m), t, masks.noisy, mask_id=MASK, block_size=BS))(tiny, tokens)
  np.testing.assert_allclose(np.where(masks.noisy, naive, 0.0),
                             np.where(masks.noisy, est.token_logp, 0.0), atol=1e-5)


def test_left_padding_by_whole_blocks_changes_nothing(tiny):
  tokens, prompt_mask, completion = make_batch(length=16, lengths=(11, 4, 2))
  masks = sample_masks(jax.random.key(1), completion, block_size=BS, num_samples=2)
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (BS, 0)) if x.ndim == 3 else ((0, 0), (BS, 0)))
  padded_masks = jax.tree.map(lambda x: pad(x) if x.ndim == 3 else x, masks)  # Not [R, B].
  attention_mask = jnp.arange(16 + BS)[None].repeat(3, 0) >= BS
  want = score(tiny, tokens, prompt_mask, completion, masks, None)
  got = score(tiny, pad(tokens), pad(prompt_mask), pad(completion), padded_masks, attention_mask)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_masks_cover_every_block_inside_the_completion_only():
  tokens, _, completion = make_batch()
  k = 4
  masks = sample_masks(jax.random.key(2), completion, block_size=BS, num_samples=k)
  noisy, weight, rate = map(np.asarray, (masks.noisy, masks.weight, masks.rate))
  comp = np.asarray(completion)
  assert noisy.shape == (k,) + tokens.shape
  assert not np.any(noisy & ~comp[None])  # prompts and padding never masked
  assert np.all(weight[~noisy] == 0)
  blocks = np.arange(tokens.shape[1]) // BS
  for r in range(k):
    for b in range(tokens.shape[0]):
      for j in np.unique(blocks):
        in_block = (blocks == j) & comp[b]
        size = in_block.sum()
        m = noisy[r, b, in_block].sum()
        if size == 0:
          assert m == 0
          continue
        assert 1 <= m <= size  # every block with completion tokens is masked
        # Stratified: sample r's rate m / L_j lies in its stratum (r/K, ceil((r+1) L_j / K) / L_j].
        assert r / k < m / size <= np.ceil((r + 1) * size / k) / size
        np.testing.assert_allclose(weight[r, b, noisy[r, b] & in_block], size / m / k)
        np.testing.assert_allclose(rate[r, b, in_block], m / size)


def test_coupled_masks_pair_each_block_mask_with_its_complement():
  _, _, completion = make_batch()
  masks = sample_masks(jax.random.key(3), completion, block_size=BS, num_samples=3, coupled=True)
  noisy = np.asarray(masks.noisy)
  assert noisy.shape[0] == 6
  np.testing.assert_array_equal(noisy[:3] ^ noisy[3:], np.broadcast_to(completion, noisy[:3].shape))
  assert not np.any(noisy[:3] & noisy[3:])


def input_independent(length, vocab, seed=1):
  table = jnp.asarray(np.random.default_rng(seed).normal(size=(length, vocab)), jnp.float32)
  fn = lambda noisy, clean, mask: jnp.broadcast_to(table[None, None, :noisy.shape[-1]],
                                                   noisy.shape + (vocab,))
  return fn, jax.nn.log_softmax(table)


def exact(log_table, tokens, completion):
  per_token = jnp.take_along_axis(log_table[None, :tokens.shape[1]], tokens[..., None], -1)[..., 0]
  total = np.asarray(jnp.sum(jnp.where(completion, per_token, 0.0), -1), np.float64)
  return total, total / np.asarray(completion.sum(-1))


def test_exact_when_every_block_holds_one_completion_token():
  tokens, prompt_mask, completion = make_batch(vocab=16)
  fn, log_table = input_independent(20, 16)
  want_sum, want_mean = exact(log_table, tokens, completion)
  run = jax.jit(lambda key: jnp.stack([
      be.estimate_block_elbo(fn, tokens, prompt_mask, completion, key, mask_id=15, block_size=1,
                             normalize=normalize) for normalize in ("sum", "mean")]))
  got = run(jax.random.key(4))
  np.testing.assert_allclose(got[0], want_sum, rtol=1e-5)
  np.testing.assert_allclose(got[1], want_mean, rtol=1e-5)


def test_unbiased_for_a_model_whose_logits_ignore_the_input():
  tokens, prompt_mask, completion = make_batch(vocab=16)
  fn, log_table = input_independent(20, 16)
  want = np.stack(exact(log_table, tokens, completion))  # [sum / mean, B]
  draws = 2000
  options = [(normalize, coupled) for coupled in (False, True) for normalize in ("sum", "mean")]
  run = jax.jit(jax.vmap(lambda key: jnp.stack([
      be.estimate_block_elbo(fn, tokens, prompt_mask, completion, key, mask_id=15,
                             block_size=BS, num_samples=2, normalize=normalize, coupled=coupled)
      for normalize, coupled in options])))
  values = np.asarray(run(jax.random.split(jax.random.key(5), draws)), np.float64)
  values = values.reshape(draws, 2, 2, -1)  # [draw, coupled, sum / mean, B]
  mean, stderr = values.mean(0), values.std(0) / np.sqrt(draws)
  for coupled in range(2):
    np.testing.assert_array_less(np.abs(mean[coupled] - want), 4 * stderr[coupled] + 1e-6)
  # 'mean' is 'sum' over the completion length, draw by draw.
  np.testing.assert_allclose(values[:, :, 1] * np.asarray(completion.sum(-1)), values[:, :, 0],
                             rtol=1e-5, atol=1e-5)
  # The masks do vary (the check above is not vacuous), except for the one-token completion,
  # whose only mask is exact; the coupled estimate (2K rows) has the lower variance.
  spread = values[:, :, 0].std(0)  # [coupled, B]
  assert np.all(spread[:, :2] > 1e-2)
  np.testing.assert_allclose(values[:, :, 0, 2], want[0, 2], rtol=1e-5)
  assert np.all(spread[1, :2] < spread[0, :2])


def test_shared_masks_give_the_same_estimate_and_fresh_keys_do_not(tiny):
  tokens, prompt_mask, completion = make_batch(length=16, lengths=(11, 4, 2))
  sample = lambda seed: sample_masks(jax.random.key(seed), completion, block_size=BS,
                                     num_samples=2)
  first = score(tiny, tokens, prompt_mask, completion, sample(6), None)
  again = score(tiny, tokens, prompt_mask, completion, sample(6), None)
  np.testing.assert_array_equal(again, first)
  fresh = score(tiny, tokens, prompt_mask, completion, sample(7), None)
  assert not np.allclose(fresh, first)
  assert np.all(np.asarray(first) < 0)


def test_gradient_reaches_every_layer(tiny):
  tokens, prompt_mask, completion = make_batch(length=16, lengths=(11, 6, 3))

  def loss(model):
    fn = lambda noisy, clean, mask: model.staircase(noisy, clean, mask)
    return -jnp.mean(be.estimate_block_elbo(fn, tokens, prompt_mask, completion,
                                            jax.random.key(8), mask_id=MASK, block_size=BS,
                                            normalize="mean"))

  grads = nnx.jit(nnx.grad(loss))(tiny)
  for path, g in nnx.to_flat_state(grads):
    g = np.asarray(g[...])
    assert np.all(np.isfinite(g)) and np.any(g != 0), path


def test_fixed_masks_take_the_head_or_tail_of_every_block():
  """Per block of L_j completion tokens: the first / last ceil(rate L_j), weight L_j / m_j."""
  tokens, _, completion = make_batch()
  comp = np.asarray(completion)
  blocks = np.arange(tokens.shape[1]) // BS
  for position, rate in [("head", 1.0), ("head", 0.5), ("tail", 0.1), ("tail", 0.6)]:
    masks = be.fixed_block_masks(completion, block_size=BS, rate=rate, position=position,
                                 num_samples=3)
    noisy, weight, rate_arr = map(np.asarray, (masks.noisy, masks.weight, masks.rate))
    assert noisy.shape == (3,) + tokens.shape and not np.any(noisy & ~comp[None])
    np.testing.assert_array_equal(np.asarray(masks.scored), noisy)
    np.testing.assert_array_equal(noisy[0], noisy[2])
    for b in range(tokens.shape[0]):
      for j in np.unique(blocks):
        positions = np.flatnonzero((blocks == j) & comp[b])
        if not positions.size:
          continue
        m = int(np.ceil(rate * positions.size))
        want = positions[:m] if position == "head" else positions[positions.size - m:]
        np.testing.assert_array_equal(np.flatnonzero(noisy[0, b] & (blocks == j)), want)
        np.testing.assert_allclose(weight[:, b, want], positions.size / m / 3)
        np.testing.assert_allclose(rate_arr[:, b, positions], m / positions.size)
  with pytest.raises(ValueError, match="position"):
    be.fixed_block_masks(completion, block_size=BS, position="middle")
  with pytest.raises(ValueError, match="rate"):
    be.fixed_block_masks(completion, block_size=BS, rate=0.0)


def test_whole_block_masks_are_the_exact_mean_field_for_an_input_independent_model():
  tokens, prompt_mask, completion = make_batch(vocab=16)
  fn, log_table = input_independent(20, 16)
  want_sum, want_mean = exact(log_table, tokens, completion)
  masks = be.fixed_block_masks(completion, block_size=BS)
  for normalize, want in (("sum", want_sum), ("mean", want_mean)):
    got = be.estimate_block_elbo(fn, tokens, prompt_mask, completion, None, mask_id=15,
                                 block_size=BS, masks=masks, normalize=normalize)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_block_eubo_equals_likelihood_under_whole_blocks_and_tends_to_it_under_elbo():
  """SPG's EUBO from block masks (one mask rate per block) as from flat ones."""
  from stabledrl_jax import estimators  # pylint: disable=g-import-not-at-top
  tokens, prompt_mask, completion = make_batch(vocab=16)
  fn, log_table = input_independent(20, 16)
  _, want = exact(log_table, tokens, completion)
  details = be.estimate_block_elbo(fn, tokens, prompt_mask, completion, None, mask_id=15,
                                   block_size=BS, masks=be.fixed_block_masks(completion,
                                                                             block_size=BS),
                                   return_details=True)
  for beta in (1.0, 1.5):
    np.testing.assert_allclose(
        estimators.eubo_from_samples(details.token_logp, details.masks, beta=beta), want,
        rtol=1e-5)
  details = be.estimate_block_elbo(fn, tokens, prompt_mask, completion, jax.random.key(9),
                                   mask_id=15, block_size=BS, num_samples=4096,
                                   return_details=True)
  eubo = estimators.eubo_from_samples(details.token_logp, details.masks, beta=1.0)
  np.testing.assert_allclose(eubo, want, atol=0.05)


def test_invalid_options_are_rejected():
  tokens, prompt_mask, completion = make_batch()
  fn, _ = input_independent(20, 16)
  kw = dict(mask_id=15, block_size=BS)
  with pytest.raises(ValueError, match="normalize"):
    be.estimate_block_elbo(fn, tokens, prompt_mask, completion, jax.random.key(0),
                           normalize="max", **kw)
  with pytest.raises(ValueError, match="block_size"):
    be.estimate_block_elbo(fn, tokens, prompt_mask, completion, jax.random.key(0), mask_id=15,
                           block_size=0)
  with pytest.raises(ValueError, match="num_samples"):
    sample_masks(jax.random.key(0), completion, block_size=BS, num_samples=0)


@pytest.mark.parametrize("family", ["llada", "sdar"])
@pytest.mark.parametrize("normalize", ["sum", "mean"])
def test_both_families_masks_combine_as_the_float64_formula(family, normalize):
  """One mask representation for both families: ``estimators.combine`` is
  sum_r scale_r sum_i 1[scored] w_ri logp_ri, re-derived in float64, and the mean form of a
  block sample is its sum form over the completion length."""
  from stabledrl_jax import estimators  # pylint: disable=g-import-not-at-top
  _, prompt_mask, completion = make_batch()
  key = jax.random.key(3)
  if family == "llada":
    masks = estimators.sample_masks(key, prompt_mask, completion, method="elbo",
                                    num_samples=3, schedule="count", coupled=True)
    assert np.all(np.asarray(masks.weight) == 1.0)  # A weight per row, in its scales.
  else:
    masks = sample_masks(key, completion, block_size=BS, num_samples=3, coupled=True)
  assert isinstance(masks, estimators.MaskSample)
  shape = masks.noisy.shape
  assert masks.weight.shape == masks.rate.shape == masks.scored.shape == shape
  assert masks.sum_scale.shape == masks.mean_scale.shape == shape[:2]
  logp = -jax.random.exponential(jax.random.key(4), shape)
  scale = np.asarray(masks.sum_scale if normalize == "sum" else masks.mean_scale, np.float64)
  terms = np.where(np.asarray(masks.scored), np.asarray(masks.weight, np.float64)
                   * np.asarray(logp, np.float64), 0.0)
  want = np.sum(scale * terms.sum(-1), axis=0)
  got = estimators.combine(logp, masks, normalize)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  rows = estimators.combine_rows(logp, masks, normalize)
  np.testing.assert_allclose(np.sum(rows, axis=0), got, rtol=1e-5, atol=1e-5)
  if family == "sdar" and normalize == "mean":
    length = np.asarray(completion, np.float64).sum(-1)
    np.testing.assert_allclose(got, estimators.combine(logp, masks, "sum") / length, rtol=1e-5)
