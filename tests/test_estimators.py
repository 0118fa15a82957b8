"""Likelihood estimators: exactness, unbiasedness, mask structure and stress masks."""

import functools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from stabledrl_jax import estimators
from examples import examples

B, L, V = 3, 14, 7
MASK_ID = V - 1
PROMPT = 4


def make_batch(seed=0):
  """Three sequences: 4 prompt tokens, completions of 10, 6 (right-padded) and 1 tokens."""
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, V - 1, size=(B, L)), jnp.int32)
  prompt_mask = jnp.zeros((B, L), bool).at[:, :PROMPT].set(True)
  lengths = np.array([L - PROMPT, 6, 1])
  completion = np.zeros((B, L), bool)
  for b, n in enumerate(lengths):
    completion[b, PROMPT:PROMPT + n] = True
  return tokens, prompt_mask, jnp.asarray(completion)


def input_independent_model(seed=1):
  """Logits depend on the position only: log pi(y) = sum_i log p_i(y_i) exactly."""
  table = jnp.asarray(np.random.default_rng(seed).normal(size=(L, V)), jnp.float32)
  logits_fn = lambda tokens: jnp.broadcast_to(table[None], tokens.shape + (V,))
  return logits_fn, jax.nn.log_softmax(table)


def exact_logp(log_table, tokens, completion):
  per_token = jnp.take_along_axis(log_table[None], tokens[..., None], -1)[..., 0]
  total = np.asarray(jnp.sum(jnp.where(completion, per_token, 0.0), -1), np.float64)
  return total, total / np.asarray(completion.sum(-1))


def context_model(tokens):
  """Logits grow with the count of each visible token: more context, more confidence."""
  visible = jax.nn.one_hot(tokens, V) * (tokens != MASK_ID)[..., None]
  return jnp.broadcast_to(1.5 * visible.sum(1, keepdims=True), tokens.shape + (V,))


def monte_carlo(method, normalize, draws=3000, num_samples=4, **options):
  tokens, prompt_mask, completion = make_batch()
  logits_fn, _ = input_independent_model()
  fn = jax.jit(jax.vmap(lambda key: estimators.estimate_logp(
      logits_fn, tokens, prompt_mask, completion, key, method=method, mask_id=MASK_ID,
      num_samples=num_samples, normalize=normalize, **options)))
  values = np.asarray(fn(jax.random.split(jax.random.key(0), draws)), np.float64)
  return values.mean(0), values.std(0) / np.sqrt(draws)


def test_mean_field_is_exact_for_input_independent_model():
  tokens, prompt_mask, completion = make_batch()
  logits_fn, table = input_independent_model()
  total, mean = exact_logp(table, tokens, completion)
  for normalize, expected in [("sum", total), ("mean", mean)]:
    got = estimators.estimate_logp(logits_fn, tokens, prompt_mask, completion,
                                   jax.random.key(3), method="mean_field", mask_id=MASK_ID,
                                   num_samples=2, normalize=normalize)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


ELBO_VARIANTS = [
    ("elbo", {}),
    ("elbo", {"schedule": "count"}),
    ("elbo", {"schedule": "count", "coupled": True}),
    ("block_random_unbiased", {"block_length": 4}),
]


@pytest.mark.parametrize("method,options", ELBO_VARIANTS)
@pytest.mark.parametrize("normalize", ["sum", "mean"])
def test_elbo_is_unbiased_for_input_independent_model(method, options, normalize):
  tokens, _, completion = make_batch()
  _, table = input_independent_model()
  total, mean = exact_logp(table, tokens, completion)
  expected = total if normalize == "sum" else mean
  got, stderr = monte_carlo(method, normalize, **options)
  assert np.all(np.abs(got - expected) < 4.5 * stderr + 1e-5), (got, expected, stderr)


def test_coupled_masks_reduce_variance():
  _, plain = monte_carlo("elbo", "sum", schedule="count")
  _, coupled = monte_carlo("elbo", "sum", schedule="count", coupled=True)
  assert np.all(coupled[:2] < plain[:2])


def test_stratified_times_cover_each_stratum():
  t = estimators._stratified_times(jax.random.key(0), 8, 100)
  k = np.arange(8)[:, None]
  assert np.all((t > k / 8) & (t <= (k + 1) / 8))


@hypothesis.settings(deadline=None, max_examples=examples(15))
@hypothesis.given(seed=st.integers(0, 2**31 - 1), length=st.integers(1, 9),
                  method=st.sampled_from(["elbo-bernoulli", "elbo-count", "elbo-coupled",
                                          "block_random", "block_random_unbiased",
                                          "mean_field"]),
                  num_samples=st.integers(1, 3))
def test_every_scored_sequence_has_a_masked_token(seed, length, method, num_samples):
  completion = jnp.zeros((2, 12), bool).at[:, 2:2 + length].set(True).at[1].set(False)
  prompt = jnp.zeros((2, 12), bool).at[:, :2].set(True)
  name = method.partition("-")[0]
  options = {"elbo-bernoulli": {}, "elbo-count": {"schedule": "count"},
             "elbo-coupled": {"schedule": "count", "coupled": True},
             "block_random": {"block_length": 4}, "block_random_unbiased": {"block_length": 4},
             "mean_field": {}}[method]
  masks = estimators.sample_masks(jax.random.key(seed), prompt, completion, method=name,
                                  num_samples=num_samples, **options)
  scored = np.asarray(masks.scored)
  counts = scored[:, 0].sum(-1)
  if method == "elbo-coupled":
    # Each (mask, complement) pair masks every token once; the mask is never empty.
    assert np.all(counts[:num_samples] >= 1)
    pair_union = scored[:num_samples, 0] ^ scored[num_samples:, 0]
    np.testing.assert_array_equal(
        pair_union, np.broadcast_to(np.asarray(completion[0]), pair_union.shape))
  else:
    assert np.all(counts >= 1)
  assert not scored[:, 1].any()  # Empty completion: nothing scored ...
  assert np.all(np.asarray(masks.sum_scale)[:, 1] == 0)  # ... and zero weight.
  assert np.all(scored <= np.asarray(masks.noisy))  # Scored tokens are masked.
  assert not (scored & ~np.asarray(completion)[None]).any()


def test_empty_completion_estimates_zero():
  tokens, prompt_mask, _ = make_batch()
  empty = jnp.zeros((B, L), bool)
  logits_fn, _ = input_independent_model()
  for method in ["mean_field", "elbo", "block_random", "block_random_unbiased"]:
    got = estimators.estimate_logp(logits_fn, tokens, prompt_mask, empty, jax.random.key(0),
                                   method=method, mask_id=MASK_ID, normalize="mean")
    np.testing.assert_array_equal(got, 0.0)


def test_block_random_unbiased_scores_only_its_block():
  tokens, prompt_mask, completion = make_batch()
  block = 4
  masks = estimators.sample_masks(jax.random.key(5), prompt_mask, completion,
                                  method="block_random_unbiased", num_samples=64,
                                  block_length=block,
                                  prompt_mask_prob=0.0)
  scored, noisy = np.asarray(masks.scored), np.asarray(masks.noisy)
  rank = np.asarray(estimators._completion_rank(completion))
  for r in range(scored.shape[0]):
    for b in range(B):
      blocks = set(rank[b][scored[r, b]] // block)
      assert len(blocks) == 1
      (chosen,) = blocks
      block_of = np.where(rank[b] >= 0, rank[b] // block, -1)
      in_block = block_of == chosen
      assert 1 <= scored[r, b].sum() <= in_block.sum()
      np.testing.assert_array_equal(noisy[r, b][block_of > chosen], True)  # later: masked
      np.testing.assert_array_equal(noisy[r, b][(block_of >= 0) & (block_of < chosen)], False)
      assert not noisy[r, b][np.asarray(prompt_mask[b])].any()  # prompt clean at p = 0
      past = np.asarray(estimators.past_completion(prompt_mask, completion))[b]
      np.testing.assert_array_equal(noisy[r, b][past], True)  # after the completion: masked


def test_prompt_masking_probability():
  tokens, prompt_mask, completion = make_batch()
  masks = estimators.sample_masks(jax.random.key(0), prompt_mask, completion,
                                  method="mean_field", num_samples=2000, prompt_mask_prob=0.15)
  frac = np.asarray(masks.noisy)[:, :, :PROMPT].mean()
  assert abs(frac - 0.15) < 0.01
  assert not np.asarray(masks.scored)[:, :, :PROMPT].any()


def test_same_key_or_shared_masks_give_zero_log_ratio():
  tokens, prompt_mask, completion = make_batch()
  estimate = functools.partial(estimators.estimate_logp, context_model, tokens, prompt_mask,
                               completion, method="elbo", mask_id=MASK_ID, num_samples=2)
  key = jax.random.key(7)
  np.testing.assert_array_equal(estimate(key), estimate(key))
  masks = estimators.sample_masks(key, prompt_mask, completion, method="elbo", num_samples=2)
  np.testing.assert_array_equal(estimate(None, masks=masks), estimate(key))
  assert np.any(estimate(jax.random.key(8)) != estimate(key))  # independent masks: noise


def test_eubo_equals_likelihood_under_mean_field_and_tends_to_it_under_elbo():
  tokens, prompt_mask, completion = make_batch()
  logits_fn, table = input_independent_model()
  _, mean = exact_logp(table, tokens, completion)
  details = estimators.estimate_logp(logits_fn, tokens, prompt_mask, completion,
                                     jax.random.key(0), method="mean_field", mask_id=MASK_ID,
                                     return_details=True)
  for beta in [1.0, 1.5]:
    np.testing.assert_allclose(
        estimators.eubo_from_samples(details.token_logp, details.masks, beta=beta), mean,
        rtol=1e-5)
  details = estimators.estimate_logp(logits_fn, tokens, prompt_mask, completion,
                                     jax.random.key(0), method="elbo", mask_id=MASK_ID,
                                     num_samples=4096, schedule="count", return_details=True)
  eubo = estimators.eubo_from_samples(details.token_logp, details.masks, beta=1.0)
  np.testing.assert_allclose(eubo, mean, atol=0.05)


def test_eubo_is_finite_with_gradients():
  tokens, prompt_mask, completion = make_batch()

  def eubo(scale):
    fn = lambda t: scale * context_model(t)
    details = estimators.estimate_logp(fn, tokens, prompt_mask, completion, jax.random.key(2),
                                       method="block_random", mask_id=MASK_ID, num_samples=2,
                                       block_length=4, return_details=True)
    return jnp.sum(estimators.eubo_from_samples(details.token_logp, details.masks))

  value, grad = jax.value_and_grad(eubo)(1.0)
  assert np.isfinite(value) and np.isfinite(grad)


def test_stress_masks_make_log_ratio_explode():
  # A repetitive answer after a prompt without its token: context makes it easy.
  tokens = jnp.full((B, L), 2, jnp.int32).at[:, :PROMPT].set(jnp.array([0, 1, 3, 4]))
  _, prompt_mask, completion = make_batch()
  selected = estimators.stress_selection(jax.random.key(0), B, 2 / 3)
  assert int(selected.sum()) == 2
  normal = estimators.sample_masks(jax.random.key(1), prompt_mask, completion, method="elbo",
                                   num_samples=2)
  easy = estimators.select_masks(
      selected, estimators.stress_masks(prompt_mask, completion, mode="easy", rate=0.05,
                                        num_samples=2), normal)
  hard = estimators.select_masks(
      selected, estimators.stress_masks(prompt_mask, completion, mode="hard", rate=1.0,
                                        num_samples=2), normal)
  score = lambda m, norm: estimators.estimate_logp(context_model, tokens, prompt_mask,
                                                   completion, None, method="elbo",
                                                   mask_id=MASK_ID, masks=m, normalize=norm)
  for norm, threshold in [("mean", 1.0), ("sum", 5.0)]:
    log_ratio = np.asarray(score(easy, norm) - score(hard, norm))
    sel = np.asarray(selected) & (np.asarray(completion.sum(-1)) > 1)
    assert np.all(log_ratio[sel] > threshold), log_ratio
    np.testing.assert_allclose(log_ratio[~np.asarray(selected)], 0.0, atol=1e-6)


def test_bad_options_fail_clearly():
  tokens, prompt_mask, completion = make_batch()
  with pytest.raises(ValueError, match="Unknown estimator method"):
    estimators.sample_masks(jax.random.key(0), prompt_mask, completion, method="exact")
  with pytest.raises(ValueError, match="coupled"):
    estimators.sample_masks(jax.random.key(0), prompt_mask, completion, method="elbo",
                            coupled=True)
  with pytest.raises(ValueError, match="normalize"):
    estimators.estimate_logp(context_model, tokens, prompt_mask, completion, jax.random.key(0),
                             method="elbo", mask_id=MASK_ID, normalize="avg")
  with pytest.raises(TypeError, match="integer"):
    estimators.estimate_logp(context_model, tokens.astype(jnp.float32), prompt_mask,
                             completion, jax.random.key(0), method="elbo", mask_id=MASK_ID)


def test_one_forward_pass_of_all_samples():
  tokens, prompt_mask, completion = make_batch()
  shapes = []

  def logits_fn(t):
    shapes.append(t.shape)
    return context_model(t)

  estimators.estimate_logp(logits_fn, tokens, prompt_mask, completion, jax.random.key(0),
                           method="elbo", mask_id=MASK_ID, num_samples=5)
  assert shapes == [(5 * B, L)]


class JitAgreementTest(chex.TestCase, parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(
      ("mean_field", {}), ("elbo", {}), ("elbo", {"schedule": "count", "coupled": True}),
      ("block_random", {"block_length": 4}))
  def test_estimate(self, method, options):
    tokens, prompt_mask, completion = make_batch()
    fn = functools.partial(estimators.estimate_logp, context_model, method=method,
                           mask_id=MASK_ID, num_samples=3, normalize="mean", **options)
    got = self.variant(fn)(tokens, prompt_mask, completion, jax.random.key(4))
    expected = fn(tokens, prompt_mask, completion, jax.random.key(4))
    np.testing.assert_allclose(got, expected, rtol=1e-5)


# ---------------------------------------------------------------------------
# block_random against a numpy re-derivation of the official rules (SPG's
# forward_process 'block_random', as the StableDRL repository's networks/llada_svpo.py
# runs it; docs/algorithms.md).
# ---------------------------------------------------------------------------

OFFICIAL_P, OFFICIAL_G, OFFICIAL_BLOCK = 3, 12, 4  # prompt, generation, block: 3 blocks
OFFICIAL_LENGTHS = np.array([12, 7, 1, 4, 9])  # completion lengths (up to and with EOS)
OFFICIAL_PAD = np.array([0, 1, 0, 2, 0])  # left padding inside the prompt region


def official_batch():
  """Rows laid out as the official code lays them: [left pad, prompt | generation]."""
  b, length = len(OFFICIAL_LENGTHS), OFFICIAL_P + OFFICIAL_G
  prompt = np.zeros((b, length), bool)
  completion = np.zeros((b, length), bool)
  for i, (n, pad) in enumerate(zip(OFFICIAL_LENGTHS, OFFICIAL_PAD)):
    prompt[i, pad:OFFICIAL_P] = True
    completion[i, OFFICIAL_P:OFFICIAL_P + n] = True
  return prompt, completion


def official_block_random_numpy(rng, num_samples, prob):
  """One draw of the official masks: (noisy [K, B, L], blocks [K, B]), loops as the original.

  Block ids: a permutation of the generation's blocks modulo the completion's; the block's
  first m = min(block, n - block * id) positions get a random subset of randint[1, m] masks;
  everything from the block on is masked unless it is in that block's first m positions and
  not drawn; positions before the block are masked with probability ``prob``; positions
  outside prompt and completion are always masked.
  """
  prompt, completion = official_batch()
  b, length = prompt.shape
  num_blocks = OFFICIAL_G // OFFICIAL_BLOCK
  noisy = np.zeros((num_samples, b, length), bool)
  blocks = np.zeros((num_samples, b), int)
  for i in range(b):
    n = OFFICIAL_LENGTHS[i]
    completion_blocks = (n - 1) // OFFICIAL_BLOCK + 1
    ids = rng.permutation(num_blocks) % completion_blocks
    # K > the number of blocks has no official meaning (an assertion there); the permutation
    # is reused from its start.
    ids = ids[np.arange(num_samples) % num_blocks]
    for j in range(num_samples):
      start = OFFICIAL_P + ids[j] * OFFICIAL_BLOCK
      is_mask = np.zeros(length, bool)
      is_mask[start:] = True
      following = np.ones(length, bool)
      m = min(OFFICIAL_BLOCK, n - OFFICIAL_BLOCK * ids[j])
      count = rng.integers(1, m + 1)
      following[start:start + m] = rng.permutation(np.arange(m) < count)
      completion_append = np.concatenate([np.ones(OFFICIAL_P, bool),
                                          completion[i, OFFICIAL_P:]])
      early = ~is_mask & (rng.random(length) < prob)
      # Left padding is never attended to (official attention mask): compare the rest.
      noisy[j, i] = (early | (is_mask & following) | ~completion_append) & (
          np.arange(length) >= OFFICIAL_PAD[i])
      blocks[j, i] = ids[j]
  return noisy, blocks


def _jax_block_random(num_keys, num_samples, prob):
  prompt, completion = official_batch()
  sample = jax.jit(jax.vmap(lambda key: estimators.sample_masks(
      key, jnp.asarray(prompt), jnp.asarray(completion), method="block_random",
      num_samples=num_samples, block_length=OFFICIAL_BLOCK, prompt_mask_prob=prob)))
  return jax.tree.map(np.asarray, sample(jax.random.split(jax.random.key(11), num_keys)))


def _chosen_blocks(noisy):
  """[..., B] the chosen block, read off prompt-masking-free masks: the first generation block
  with a masked position."""
  gen = noisy[..., OFFICIAL_P:].reshape(noisy.shape[:-1] + (-1, OFFICIAL_BLOCK)).any(-1)
  return np.argmax(gen, axis=-1)


@pytest.mark.parametrize("num_samples", [2, 4])
def test_block_random_matches_official_rules_in_distribution(num_samples):
  draws, rng = 4000, np.random.default_rng(0)
  _, completion = official_batch()
  ref = [official_block_random_numpy(rng, num_samples, 0.15)[0] for _ in range(draws)]
  ref = np.stack(ref)  # [D, K, B, L]
  got = _jax_block_random(draws, num_samples, 0.15)
  # Every left-padding position is neither masked nor scored; the rest as the official rules.
  noisy = got.noisy & (np.arange(OFFICIAL_P + OFFICIAL_G) >= OFFICIAL_PAD[:, None])
  np.testing.assert_array_equal(got.scored, got.noisy & completion)
  # Marginal mask probability of every position of every row and sample.
  p_ref, p_got = ref.mean(0), noisy.mean(0)
  se = np.sqrt((p_ref * (1 - p_ref) + p_got * (1 - p_got)) / draws) + 1e-9
  assert np.all(np.abs(p_ref - p_got) <= 4.5 * se + 1e-6), np.max(np.abs(p_ref - p_got) / se)
  # The scored count per row and sample, and t_hat = scored / completion length.
  counts_ref = (ref & completion).sum(-1)
  np.testing.assert_allclose((got.scored.sum(-1)).mean(0), counts_ref.mean(0),
                             atol=4.5 * counts_ref.std(0).max() / np.sqrt(draws) * 1.5 + 1e-6)
  np.testing.assert_allclose(got.rate,  # One rate per row, at every position.
                             np.broadcast_to((got.scored.sum(-1) / OFFICIAL_LENGTHS)[..., None],
                                             got.rate.shape))


def test_block_random_chosen_blocks_follow_the_permutation():
  """Without prompt masking the chosen blocks can be read off the masks: their joint law over
  the K = 2 samples of a row is the official permutation's (distinct where the completion spans
  enough blocks)."""
  draws, rng = 4000, np.random.default_rng(1)
  ref = np.stack([official_block_random_numpy(rng, 2, 0.0)[1] for _ in range(draws)])
  got = _chosen_blocks(_jax_block_random(draws, 2, 0.0).noisy)  # [D, K, B]
  num_blocks = OFFICIAL_G // OFFICIAL_BLOCK
  for i, n in enumerate(OFFICIAL_LENGTHS):
    pairs = lambda a: np.bincount(a[:, 0, i] * num_blocks + a[:, 1, i],
                                  minlength=num_blocks ** 2) / draws
    p_ref, p_got = pairs(ref), pairs(got)
    se = np.sqrt((p_ref * (1 - p_ref) + p_got * (1 - p_got)) / draws) + 1e-9
    assert np.all(np.abs(p_ref - p_got) <= 4.5 * se + 1e-6), (i, p_ref, p_got)
    if (n - 1) // OFFICIAL_BLOCK + 1 == num_blocks:
      assert np.all(got[:, 0, i] != got[:, 1, i])


def test_block_random_expected_estimate_matches_official_rules():
  """E[estimate] for a model whose logits depend on the position only: the mean over the
  masked completion tokens of each sample, averaged over K, under both samplers."""
  draws, k, rng = 3000, 2, np.random.default_rng(2)
  prompt, completion = official_batch()
  length = OFFICIAL_P + OFFICIAL_G
  table = np.random.default_rng(3).normal(size=(length, V))
  log_table = table - np.log(np.exp(table).sum(-1, keepdims=True))
  tokens = np.random.default_rng(4).integers(0, V - 1, size=prompt.shape)
  token_logp = np.take_along_axis(log_table[None], tokens[..., None], -1)[..., 0]  # [B, L]

  def numpy_estimate(noisy):
    scored = noisy & completion
    return (np.where(scored, token_logp, 0).sum(-1) / scored.sum(-1)).mean(0)

  ref = np.stack([numpy_estimate(official_block_random_numpy(rng, k, 0.15)[0])
                  for _ in range(draws)])
  logits_fn = lambda t: jnp.broadcast_to(jnp.asarray(table, jnp.float32)[None], t.shape + (V,))
  fn = jax.jit(jax.vmap(lambda key: estimators.estimate_logp(
      logits_fn, jnp.asarray(tokens), jnp.asarray(prompt), jnp.asarray(completion), key,
      method="block_random", mask_id=MASK_ID, num_samples=k, normalize="mean",
      block_length=OFFICIAL_BLOCK)))
  got = np.asarray(fn(jax.random.split(jax.random.key(5), draws)), np.float64)
  se = np.sqrt((ref.var(0) + got.var(0)) / draws) + 1e-9
  assert np.all(np.abs(ref.mean(0) - got.mean(0)) <= 4.5 * se + 1e-5), (ref.mean(0), got.mean(0))
  # The sum form is the mean times the completion length.
  got_sum = np.asarray(jax.vmap(lambda key: estimators.estimate_logp(
      logits_fn, jnp.asarray(tokens), jnp.asarray(prompt), jnp.asarray(completion), key,
      method="block_random", mask_id=MASK_ID, num_samples=k, normalize="sum",
      block_length=OFFICIAL_BLOCK))(jax.random.split(jax.random.key(5), 8)))
  np.testing.assert_allclose(got_sum, got[:8] * OFFICIAL_LENGTHS, rtol=1e-5)


def visibility_model(past):
  """Logits that jump when any position of ``past`` [B, L] (after the completion) is visible."""
  def logits_fn(tokens):
    rows = tokens.shape[0] // past.shape[0]
    seen = jnp.repeat(past, rows, axis=0) & (tokens != MASK_ID)
    leak = jnp.any(seen, axis=-1).astype(jnp.float32)[:, None, None]
    return jnp.zeros(tokens.shape + (V,)) + 5.0 * leak * jax.nn.one_hot(0, V)
  return logits_fn


@pytest.mark.parametrize("method,options", [
    ("mean_field", {}), ("elbo", {}), ("elbo", {"schedule": "count", "coupled": True}),
    ("block_random", {"block_length": 4}), ("block_random_unbiased", {"block_length": 4})])
def test_no_estimator_sees_tokens_after_the_completion(method, options):
  tokens, prompt_mask, completion = make_batch()
  past = estimators.past_completion(prompt_mask, completion)
  assert np.asarray(past).sum() == (L - PROMPT - 6) + (L - PROMPT - 1)  # rows 1 and 2
  leaky = visibility_model(past)
  blind = visibility_model(jnp.zeros_like(past))
  estimate = lambda fn: estimators.estimate_logp(
      fn, tokens, prompt_mask, completion, jax.random.key(9), method=method, mask_id=MASK_ID,
      num_samples=3, **options)
  np.testing.assert_array_equal(estimate(leaky), estimate(blind))
  # The same model does see a visible token there (the test can fail).
  no_mask = estimators.MaskSample.per_row(
      noisy=jnp.zeros((1, B, L), bool), scored=jnp.zeros((1, B, L), bool),
      sum_scale=jnp.ones((1, B)), mean_scale=jnp.ones((1, B)), rate=jnp.ones((1, B)))
  shown = estimators.token_logprobs(leaky, tokens, no_mask.noisy, MASK_ID)
  hidden = estimators.token_logprobs(blind, tokens, no_mask.noisy, MASK_ID)
  assert not np.allclose(shown[:, 1:], hidden[:, 1:])


def test_stress_masks_hide_tokens_after_the_completion():
  _, prompt_mask, completion = make_batch()
  past = np.asarray(estimators.past_completion(prompt_mask, completion))
  for mode in ["easy", "hard"]:
    masks = estimators.stress_masks(prompt_mask, completion, mode=mode, rate=0.3)
    assert np.all(np.asarray(masks.noisy)[0][past])


@pytest.mark.parametrize("coupled", [True, False])
def test_espo_elbo_is_unbiased_over_the_whole_generation(coupled):
  """ESPO scores every generated position, past the first EOS too: for a model whose logits
  ignore the input its sum form is unbiased for the generation's log-likelihood, with each mask's
  complement and without (ESPO's reduce_var false)."""
  tokens, prompt_mask, completion = make_batch()
  logits_fn, table = input_independent_model()
  generation = completion | estimators.past_completion(prompt_mask, completion)
  total, _ = exact_logp(table, tokens, generation)
  rows = estimators.sample_masks(jax.random.key(0), prompt_mask, completion, method="espo_elbo",
                                 num_samples=2, coupled=coupled).noisy.shape[0]
  assert rows == (4 if coupled else 2)
  fn = jax.jit(jax.vmap(lambda key: estimators.estimate_logp(
      logits_fn, tokens, prompt_mask, completion, key, method="espo_elbo", mask_id=MASK_ID,
      num_samples=2, coupled=coupled)))
  values = np.asarray(fn(jax.random.split(jax.random.key(0), 3000)), np.float64)
  stderr = values.std(0) / np.sqrt(len(values))
  assert np.all(np.abs(values.mean(0) - total) < 4.5 * stderr + 1e-4), (values.mean(0), total)
  mean = estimators.estimate_logp(logits_fn, tokens, prompt_mask, completion, jax.random.key(1),
                                  method="espo_elbo", mask_id=MASK_ID, normalize="mean")
  np.testing.assert_allclose(mean * np.asarray(generation.sum(-1)), estimators.estimate_logp(
      logits_fn, tokens, prompt_mask, completion, jax.random.key(1), method="espo_elbo",
      mask_id=MASK_ID), rtol=1e-5)


def test_espo_elbo_counts_are_stratified_over_the_batch():
  """B = L + 1 rows of one generation length L: one shift gives every count 0..L exactly once,
  and each row's mask and its complement partition the generation; prompts stay clean."""
  gen = 6
  rows = gen + 1
  prompt = jnp.zeros((rows, 3 + gen), bool).at[:, :3].set(True)
  completion = jnp.zeros((rows, 3 + gen), bool).at[:, 3:3 + 4].set(True)  # 2 tokens past EOS
  for seed in range(5):
    masks = estimators.sample_masks(jax.random.key(seed), prompt, completion,
                                    method="espo_elbo", num_samples=2)
    scored = np.asarray(masks.scored)
    counts = scored[:2].sum(-1)  # [K, B]
    for k in range(2):
      assert sorted(counts[k]) == list(range(gen + 1))
    np.testing.assert_array_equal(scored[:2] ^ scored[2:], np.broadcast_to(
        np.arange(3 + gen) >= 3, scored[:2].shape))
    assert not np.asarray(masks.noisy)[..., :3].any()
