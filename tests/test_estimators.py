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
    ("block_random", {"block_length": 4}),
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


@hypothesis.settings(deadline=None, max_examples=15)
@hypothesis.given(seed=st.integers(0, 2**31 - 1), length=st.integers(1, 9),
                  method=st.sampled_from(["elbo-bernoulli", "elbo-count", "elbo-coupled",
                                          "block_random", "mean_field"]),
                  num_samples=st.integers(1, 3))
def test_every_scored_sequence_has_a_masked_token(seed, length, method, num_samples):
  completion = jnp.zeros((2, 12), bool).at[:, 2:2 + length].set(True).at[1].set(False)
  prompt = jnp.zeros((2, 12), bool).at[:, :2].set(True)
  name = method.partition("-")[0]
  options = {"elbo-bernoulli": {}, "elbo-count": {"schedule": "count"},
             "elbo-coupled": {"schedule": "count", "coupled": True},
             "block_random": {"block_length": 4}, "mean_field": {}}[method]
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
  for method in ["mean_field", "elbo", "block_random"]:
    got = estimators.estimate_logp(logits_fn, tokens, prompt_mask, empty, jax.random.key(0),
                                   method=method, mask_id=MASK_ID, normalize="mean")
    np.testing.assert_array_equal(got, 0.0)


def test_block_random_scores_only_its_block():
  tokens, prompt_mask, completion = make_batch()
  block = 4
  masks = estimators.sample_masks(jax.random.key(5), prompt_mask, completion,
                                  method="block_random", num_samples=64, block_length=block,
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
      assert not noisy[r, b][~np.asarray(completion[b])].any()  # prompt clean at p = 0


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
