"""Objectives against float64 numpy re-derivations, and the paper's claims as properties."""

import functools

import chex
import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from stabledrl_jax import objectives
from stabledrl_jax.objectives import stabledrl as sdrl
from examples import examples

# ---------------------------------------------------------------------------
# Independent float64 references (written from the formulas of docs/algorithms.md, not the code).
# ---------------------------------------------------------------------------


def np_advantages(r, g, scale=False, eps=1e-6):
  r = np.asarray(r, np.float64).reshape(-1, g)
  a = r - r.mean(1, keepdims=True)
  if scale:
    a = a / (r.std(1, keepdims=True) + eps)
  return a.reshape(-1)


def np_snis(log_ratio, g, lo=0.0, hi=5.0, valid=None):
  x = np.asarray(log_ratio, np.float64)
  x = np.minimum(x, np.log(hi))
  if lo > 0:
    x = np.maximum(x, np.log(lo))
  valid = np.ones_like(x, bool) if valid is None else np.asarray(valid)
  out = np.zeros_like(x)
  for start in range(0, len(x), g):
    sl = slice(start, start + g)
    xs, vs = x[sl], valid[sl]
    if not vs.any():
      continue
    e = np.where(vs, np.exp(xs - xs[vs].max()), 0.0)
    out[sl] = e / e.sum()
  return out


def np_stabledrl(s, log_ratio, adv, g, lo=0.0, hi=5.0, valid=None):
  w = np_snis(log_ratio, g, lo, hi, valid)
  return -np.sum(w * np.asarray(adv, np.float64) * np.asarray(s, np.float64)) / (len(s) // g)


def np_grpo(logp, old, adv, el=0.2, eh=0.2, mask=None, ref=None, beta=0.0, kl="k3"):
  logp, old = np.asarray(logp, np.float64), np.asarray(old, np.float64)
  adv = np.asarray(adv, np.float64)
  if logp.ndim == 2:
    adv = adv[:, None] * np.ones_like(logp)
  mask = np.ones(logp.shape, bool) if mask is None else np.asarray(mask)
  with np.errstate(over="ignore"):  # padded entries may overflow; masked below
    rho = np.exp(logp - old)
  obj = np.minimum(rho * adv, np.clip(rho, 1 - el, 1 + eh) * adv)
  per = -obj
  if beta:
    d = np.asarray(ref, np.float64) - logp
    k = {"k1": -d, "k2": 0.5 * d**2, "k3": np.exp(d) - d - 1}[kl]
    per = per + beta * k
  return per[mask].mean()


def np_wd1(l, adv, g):
  l = np.asarray(l, np.float64).reshape(-1, g)
  a = np.asarray(adv, np.float64).reshape(-1, g)
  sm = lambda z: np.exp(z - z.max(1, keepdims=True)) / np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True)
  return np.mean(-(sm(a) * l).sum(1) + (sm(-a) * l).sum(1))


def np_spg(s, adv, lengths, valid=None):
  valid = np.ones(len(s), bool) if valid is None else np.asarray(valid)
  lengths = np.where(valid, np.asarray(lengths, np.float64), 0.0)
  return -np.sum(np.asarray(adv, np.float64) * np.asarray(s, np.float64) * lengths) / lengths.sum()


def random_batch(seed, groups=3, g=4):
  rng = np.random.default_rng(seed)
  n = groups * g
  rewards = rng.integers(0, 3, n).astype(np.float32)
  return (rng.normal(size=n).astype(np.float32) - 2.0,  # logp
          rng.normal(scale=1.5, size=n).astype(np.float32),  # log ratio
          np_advantages(rewards, g).astype(np.float32), n, g)


# ---------------------------------------------------------------------------
# Advantages.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [False, True])
def test_group_advantages_matches_numpy(scale):
  rewards = np.random.default_rng(0).normal(size=24).astype(np.float32)
  got = objectives.group_advantages(jnp.asarray(rewards), 6, scale_by_std=scale)
  np.testing.assert_allclose(got, np_advantages(rewards, 6, scale), rtol=1e-5, atol=1e-6)


def test_group_advantages_zero_for_equal_rewards_and_sum_to_zero():
  rewards = jnp.array([1.0, 1.0, 1.0, 0.0, 1.0, 2.0])
  adv = objectives.group_advantages(rewards, 3, scale_by_std=True)
  np.testing.assert_allclose(adv[:3], 0.0)
  np.testing.assert_allclose(adv.reshape(2, 3).sum(1), 0.0, atol=1e-6)


def test_group_advantages_rejects_partial_groups():
  with pytest.raises(ValueError, match="multiple of group_size"):
    objectives.group_advantages(jnp.zeros(7), 4)


# ---------------------------------------------------------------------------
# SNIS weights.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("lo,hi", [(0.0, 5.0), (0.8, 1.2)])
def test_snis_weights_match_numpy(lo, hi):
  _, log_ratio, _, _, g = random_batch(1)
  got = sdrl.snis_weights(jnp.asarray(log_ratio), g, min_ratio=lo, max_ratio=hi)
  np.testing.assert_allclose(got, np_snis(log_ratio, g, lo, hi), rtol=1e-5, atol=1e-7)


@hypothesis.settings(deadline=None, max_examples=examples(60))
@hypothesis.given(
    groups=st.integers(1, 4), g=st.integers(1, 6),
    data=st.data(), symmetric=st.booleans())
def test_snis_weights_finite_nonnegative_normalized(groups, g, data, symmetric):
  log_ratio = data.draw(hnp.arrays(
      np.float32, groups * g,
      elements=st.one_of(st.floats(-1e4, 1e4, width=32), st.sampled_from([-1e4, 1e4]))))
  lo, hi = (0.8, 1.2) if symmetric else (0.0, 5.0)
  w = np.asarray(sdrl.snis_weights(jnp.asarray(log_ratio), g, min_ratio=lo, max_ratio=hi))
  assert np.all(np.isfinite(w)) and np.all(w >= 0)
  np.testing.assert_allclose(w.reshape(groups, g).sum(1), 1.0, rtol=1e-5)


def test_snis_weights_survive_infinite_ratios():
  log_ratio = jnp.array([jnp.inf, 0.0, -jnp.inf, -jnp.inf, -jnp.inf, -jnp.inf])
  w = np.asarray(sdrl.snis_weights(log_ratio, 3))
  assert np.all(np.isfinite(w))
  np.testing.assert_allclose(w[:3], np_snis([np.log(5.0), 0.0, -np.inf], 3))
  # Every ratio exactly zero: no preference, uniform weights.
  np.testing.assert_allclose(w[3:], 1 / 3)


def test_snis_weights_have_no_gradient():
  grad = jax.grad(lambda x: jnp.sum(sdrl.snis_weights(x, 2) * jnp.arange(4.0)))(jnp.ones(4))
  np.testing.assert_array_equal(grad, 0.0)


def test_snis_sample_mask_zeroes_weight():
  w = sdrl.snis_weights(jnp.array([3.0, 1.0, 2.0, 0.0]), 4,
                          sample_mask=jnp.array([False, True, True, True]))
  np.testing.assert_allclose(w, np_snis([3.0, 1.0, 2.0, 0.0], 4, valid=[0, 1, 1, 1]), rtol=1e-6)


def test_ratio_bounds_are_validated():
  with pytest.raises(ValueError, match="min_ratio < max_ratio"):
    sdrl.snis_weights(jnp.zeros(2), 2, min_ratio=2.0, max_ratio=1.0)


# ---------------------------------------------------------------------------
# StableDRL loss and its convex-hull bound.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("lo,hi", [(0.0, 5.0), (0.8, 1.2)])
def test_stabledrl_loss_matches_numpy(lo, hi):
  logp, log_ratio, adv, _, g = random_batch(2)
  loss, metrics = sdrl.stabledrl_loss(jnp.asarray(logp), jnp.asarray(log_ratio),
                                        jnp.asarray(adv), g, min_ratio=lo, max_ratio=hi)
  np.testing.assert_allclose(loss, np_stabledrl(logp, log_ratio, adv, g, lo, hi), rtol=1e-5)
  w = np_snis(log_ratio, g, lo, hi).reshape(-1, g)
  np.testing.assert_allclose(metrics["snis/ess"], np.mean(1 / (w**2).sum(1)), rtol=1e-5)
  np.testing.assert_allclose(metrics["log_ratio/max"], log_ratio.max(), rtol=1e-6)
  np.testing.assert_allclose(metrics["clip/frac_upper"], np.mean(log_ratio > np.log(hi)))
  np.testing.assert_allclose(
      metrics["clip/frac_upper_neg_adv"], np.mean((log_ratio > np.log(hi)) & (adv < 0)))
  entropy = -np.sum(np.where(w > 0, w * np.log(np.where(w > 0, w, 1)), 0), 1).mean()
  np.testing.assert_allclose(metrics["snis/weight_entropy"], entropy, rtol=1e-5)


def test_stabledrl_loss_with_padding_matches_numpy():
  logp, log_ratio, adv, n, g = random_batch(3)
  valid = np.random.default_rng(3).random(n) > 0.3
  # Padded samples hold garbage that must not leak into the loss.
  log_ratio = np.where(valid, log_ratio, 1e30).astype(np.float32)
  loss, _ = sdrl.stabledrl_loss(jnp.asarray(logp), jnp.asarray(log_ratio), jnp.asarray(adv),
                                  g, sample_mask=jnp.asarray(valid))
  np.testing.assert_allclose(loss, np_stabledrl(logp, log_ratio, adv, g, valid=valid), rtol=1e-5)


def test_stabledrl_batch_normalization_scope():
  logp, log_ratio, adv, n, g = random_batch(4)
  loss, _ = sdrl.stabledrl_loss(jnp.asarray(logp), jnp.asarray(log_ratio), jnp.asarray(adv),
                                  g, normalize_over="batch")
  w = np_snis(log_ratio, n)
  np.testing.assert_allclose(loss, -np.sum(w * adv * logp), rtol=1e-5)


def test_stabledrl_gradient_is_snis_weighted_policy_gradient():
  logp, log_ratio, adv, _, g = random_batch(5)
  grad = jax.grad(lambda s: sdrl.stabledrl_loss(s, jnp.asarray(log_ratio),
                                                  jnp.asarray(adv), g)[0])(jnp.asarray(logp))
  expected = -np_snis(log_ratio, g) * adv / (len(logp) // g)
  np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-8)


@hypothesis.settings(deadline=None, max_examples=examples(40))
@hypothesis.given(seed=st.integers(0, 2**31 - 1), groups=st.integers(1, 3),
                  g=st.integers(2, 6), log_scale=st.sampled_from([1.0, 30.0, 1e4]),
                  symmetric=st.booleans())
def test_gradient_stays_in_convex_hull(seed, groups, g, log_scale, symmetric):
  """||grad J|| <= max_j |A_j| ||grad s_j|| for any ratios, with s linear in theta."""
  rng = np.random.default_rng(seed)
  n, dim = groups * g, 5
  features = rng.normal(size=(n, dim)).astype(np.float32)  # grad s_j = features[j]
  adv = rng.normal(size=n).astype(np.float32)
  log_ratio = (rng.normal(size=n) * log_scale).astype(np.float32)
  lo, hi = (0.8, 1.2) if symmetric else (0.0, 5.0)

  def loss_fn(theta):
    return sdrl.stabledrl_loss(jnp.asarray(features) @ theta, jnp.asarray(log_ratio),
                                 jnp.asarray(adv), g, min_ratio=lo, max_ratio=hi)[0]

  grad = np.asarray(jax.grad(loss_fn)(jnp.zeros(dim)), np.float64)
  bound = np.max(np.abs(adv) * np.linalg.norm(features, axis=1))
  assert np.all(np.isfinite(grad))
  assert np.linalg.norm(grad) <= bound * (1 + 1e-5)


def np_advantage_sums(weights, adv, g):
  """Per group |sum_j w_j A_j| in float64."""
  return np.abs((np.asarray(weights, np.float64) * np.asarray(adv, np.float64)).reshape(-1, g)
                .sum(1))


def test_the_weighted_advantage_sums_match_numpy_and_vanish_for_uniform_weights():
  logp, log_ratio, adv, _, g = random_batch(6)
  _, metrics = sdrl.stabledrl_loss(jnp.asarray(logp), jnp.asarray(log_ratio), jnp.asarray(adv), g)
  sums = np_advantage_sums(np_snis(log_ratio, g), adv, g)
  np.testing.assert_allclose(metrics["weights/adv_sum_abs_mean"], sums.mean(), rtol=1e-5)
  np.testing.assert_allclose(metrics["weights/adv_sum_abs_max"], sums.max(), rtol=1e-5)
  assert sums.max() > 1e-3  # Noisy ratios: the groups are pushed.
  # On-policy (every ratio 1) the weights are uniform: S_g is the group's mean advantage, 0.
  centred = adv - adv.reshape(-1, g).mean(1).repeat(g)
  _, metrics = sdrl.stabledrl_loss(jnp.asarray(logp), jnp.zeros_like(jnp.asarray(log_ratio)),
                                   jnp.asarray(centred), g)
  assert float(metrics["weights/adv_sum_abs_max"]) < 1e-6
  # GRPO's PPO coefficient over G, and zero where no weights exist (SPG).
  inputs = objectives.base.ObjectiveInputs(
      logp=jnp.asarray(log_ratio), old_logp=jnp.zeros(len(log_ratio)), advantages=jnp.asarray(adv),
      lengths=jnp.full(len(adv), 10.0), ref_logp=jnp.zeros(len(adv)))
  grpo = objectives.get_objective("grpo")
  _, metrics = grpo.loss(inputs, grpo.make_hparams({"level": "sequence", "beta": 0.0}), g)
  ratio = np.exp(log_ratio.astype(np.float64))
  active = ~(np.clip(ratio, 0.5, 1.5) * adv < ratio * adv)
  sums = np_advantage_sums(np.where(active, ratio, 0.0) / g, adv, g)
  np.testing.assert_allclose(metrics["weights/adv_sum_abs_mean"], sums.mean(), rtol=1e-4)
  spg = objectives.get_objective("spg")  # No importance weights: 0 by construction.
  _, metrics = spg.loss(inputs, spg.make_hparams({"surrogate": "elbo"}), g)
  assert float(metrics["weights/adv_sum_abs_mean"]) == float(
      metrics["weights/adv_sum_abs_max"]) == 0.0


@hypothesis.settings(deadline=None, max_examples=examples(40))
@hypothesis.given(seed=st.integers(0, 2**31 - 1), groups=st.integers(1, 3),
                  g=st.integers(2, 6), log_scale=st.sampled_from([1.0, 30.0, 1e4]),
                  symmetric=st.booleans())
def test_snis_centred_advantages_keep_the_update_bounded(seed, groups, g, log_scale, symmetric):
  """advantage_centering='snis': A'_j = A_j - sum_k w_k A_k, so sum_j w_j A'_j = 0 per group,
  |A'_j| <= 2 max_k |A_k|, the gradient is -(1/P) w_j A'_j per sample (a convex combination of
  the centred terms A'_j grad s_j) and ||grad J|| <= 2 max_k |A_k| max_j ||grad s_j||; all
  against a float64 re-derivation."""
  rng = np.random.default_rng(seed)
  n, dim = groups * g, 5
  features = rng.normal(size=(n, dim)).astype(np.float32)
  adv = rng.normal(size=n).astype(np.float32)
  log_ratio = (rng.normal(size=n) * log_scale).astype(np.float32)
  lo, hi = (0.8, 1.2) if symmetric else (0.0, 5.0)
  w = np_snis(log_ratio, g, lo, hi)
  centred = (adv.astype(np.float64).reshape(groups, g)
             - (w * adv).reshape(groups, g).sum(1, keepdims=True)).reshape(-1)
  got = np.asarray(sdrl.center_advantages(jnp.asarray(w, jnp.float32), jnp.asarray(adv), g))
  np.testing.assert_allclose(got, centred, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose((w * centred).reshape(groups, g).sum(1), 0.0, atol=1e-6)
  assert np.all(np.abs(centred) <= 2 * np.abs(adv).max() * (1 + 1e-6))

  def loss_fn(s):
    return sdrl.stabledrl_loss(s, jnp.asarray(log_ratio), jnp.asarray(adv), g, min_ratio=lo,
                               max_ratio=hi, advantage_centering="snis")[0]

  coefficients = np.asarray(jax.grad(loss_fn)(jnp.asarray(features @ np.zeros(dim, np.float32))))
  np.testing.assert_allclose(coefficients, -w * centred / groups, rtol=1e-4, atol=1e-7)
  grad = np.asarray(jax.grad(lambda theta: loss_fn(jnp.asarray(features) @ theta))(
      jnp.zeros(dim)), np.float64)
  assert np.all(np.isfinite(grad))
  bound = 2 * np.abs(adv).max() * np.linalg.norm(features, axis=1).max()
  assert np.linalg.norm(grad) <= bound * (1 + 1e-5)


def test_centring_is_off_by_default_and_needs_group_scope():
  logp, log_ratio, adv, _, g = random_batch(7)
  args = (jnp.asarray(logp), jnp.asarray(log_ratio), jnp.asarray(adv), g)
  assert objectives.get_objective("stabledrl").make_hparams({}).advantage_centering == "none"
  plain = sdrl.stabledrl_loss(*args)[0]
  np.testing.assert_allclose(plain, np_stabledrl(logp, log_ratio, adv, g), rtol=1e-5)
  assert abs(float(sdrl.stabledrl_loss(*args, advantage_centering="snis")[0]) - float(plain)) > 0
  with pytest.raises(ValueError, match="normalize_over='group'"):
    sdrl.stabledrl_loss(*args, normalize_over="batch", advantage_centering="snis")
  with pytest.raises(ValueError, match="advantage_centering"):
    objectives.get_objective("stabledrl").make_hparams({"advantage_centering": "mean"})


def test_grpo_gradient_grows_without_bound_for_negative_advantage():
  """The pathology: for A < 0 and rho > 1 + eps, GRPO's gradient is rho * |A| / N."""
  adv = jnp.array([-1.0, 1.0])
  norms = []
  for log_rho in [0.0, 5.0, 10.0, 20.0, 40.0]:
    old = jnp.array([-log_rho, 0.0])
    grad = jax.grad(lambda lp: objectives.grpo.grpo_loss(lp, old, adv)[0])(jnp.zeros(2))
    norms.append(float(jnp.linalg.norm(grad)))
    np.testing.assert_allclose(grad[0], np.exp(log_rho) / 2, rtol=1e-4)
  assert all(b > 100 * a for a, b in zip(norms[1:], norms[2:]))
  # StableDRL on the same ratios stays below max |A| * ||grad s|| = 1.
  for log_rho in [0.0, 40.0, 1e4]:
    grad = jax.grad(lambda s: sdrl.stabledrl_loss(
        s, jnp.array([log_rho, 0.0]), adv, 2)[0])(jnp.zeros(2))
    assert float(jnp.linalg.norm(grad)) <= 1.0


# ---------------------------------------------------------------------------
# GRPO / d1, ESPO.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kl", ["k1", "k2", "k3"])
def test_grpo_token_level_with_padding_and_kl_matches_numpy(kl):
  rng = np.random.default_rng(6)
  n, t = 8, 5
  logp = rng.normal(scale=0.5, size=(n, t)).astype(np.float32) - 1
  old = logp + rng.normal(scale=0.4, size=(n, t)).astype(np.float32)
  ref = logp + rng.normal(scale=0.3, size=(n, t)).astype(np.float32)
  adv = np_advantages(rng.integers(0, 2, n), 4).astype(np.float32)
  mask = rng.random((n, t)) > 0.25
  logp_padded = np.where(mask, logp, 1e4).astype(np.float32)  # padding garbage
  loss, metrics = objectives.grpo.grpo_loss(
      jnp.asarray(logp_padded), jnp.asarray(old), jnp.asarray(adv), epsilon_low=0.2,
      epsilon_high=0.28, mask=jnp.asarray(mask), ref_logp=jnp.asarray(ref), beta=0.04,
      kl_estimator=kl)
  expected = np_grpo(logp_padded, old, adv, 0.2, 0.28, mask, ref, 0.04, kl)
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  assert np.isfinite(metrics["log_ratio/max"])
  grad = jax.grad(lambda lp: objectives.grpo.grpo_loss(lp, jnp.asarray(old), jnp.asarray(adv),
                                              mask=jnp.asarray(mask))[0])(jnp.asarray(logp_padded))
  assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[~mask] == 0)


def test_grpo_sequence_level_matches_numpy():
  logp, log_ratio, adv, _, _ = random_batch(7)
  old = logp - log_ratio * 0.3
  loss, metrics = objectives.grpo.grpo_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv),
                                   epsilon_low=0.5, epsilon_high=0.5)
  np.testing.assert_allclose(loss, np_grpo(logp, old, adv, 0.5, 0.5), rtol=1e-5)
  rho = np.exp(logp.astype(np.float64) - old)
  np.testing.assert_allclose(metrics["clip/frac_active"],
                             np.mean(np.clip(rho, 0.5, 1.5) * adv < rho * adv))


def test_grpo_beta_without_reference_is_an_error():
  with pytest.raises(ValueError, match="ref_logp"):
    objectives.grpo.grpo_loss(jnp.zeros(2), jnp.zeros(2), jnp.ones(2), beta=0.1)


def test_espo_matches_numpy():
  rng = np.random.default_rng(8)
  n, length = 8, 64
  elbo = rng.normal(scale=10, size=n).astype(np.float32) - 80
  old = elbo + rng.normal(scale=8, size=n).astype(np.float32)
  ref = elbo + rng.normal(scale=5, size=n).astype(np.float32)
  adv = np_advantages(rng.integers(0, 2, n), 4).astype(np.float32)
  loss, _ = objectives.espo.espo_loss(jnp.asarray(elbo), jnp.asarray(old), jnp.asarray(adv), length,
                             epsilon=0.2, ref_elbo=jnp.asarray(ref), beta=0.01)
  e, o, r = (x.astype(np.float64) for x in (elbo, old, ref))
  expected = np_grpo(e / length, o / length, adv, 0.2, 0.2) + 0.01 * np.mean(
      (e - r)**2 / (2 * length))
  np.testing.assert_allclose(loss, expected, rtol=1e-5)


# ---------------------------------------------------------------------------
# SPG, wd1.
# ---------------------------------------------------------------------------


def test_spg_sandwich_and_loss_match_numpy():
  rng = np.random.default_rng(9)
  n = 8
  elbo = rng.normal(size=n).astype(np.float32) - 2
  eubo = elbo + np.abs(rng.normal(size=n)).astype(np.float32)
  adv = np_advantages(rng.integers(0, 3, n), 4).astype(np.float32)
  lengths = rng.integers(1, 30, n).astype(np.float32)
  valid = np.arange(n) != 3
  s = objectives.spg.spg_surrogate(jnp.asarray(elbo), jnp.asarray(eubo), jnp.asarray(adv),
                                   omega=0.5)
  expected_s = np.where(adv > 0, elbo, 0.5 * eubo + 0.5 * elbo)
  np.testing.assert_allclose(s, expected_s, rtol=1e-6)
  loss, _ = objectives.spg.spg_loss(s, jnp.asarray(adv), jnp.asarray(lengths),
                            sample_mask=jnp.asarray(valid))
  np.testing.assert_allclose(loss, np_spg(expected_s, adv, lengths, valid), rtol=1e-5)


def test_wd1_matches_numpy():
  logp, _, adv, _, g = random_batch(10)
  loss, _ = objectives.wd1.wd1_loss(jnp.asarray(logp), jnp.asarray(adv), g)
  np.testing.assert_allclose(loss, np_wd1(logp, adv, g), rtol=1e-5)


# ---------------------------------------------------------------------------
# Registry.
# ---------------------------------------------------------------------------


def test_registry_has_every_objective():
  assert set(objectives.objective_names()) >= {"grpo", "espo", "spg", "wd1", "stabledrl"}
  with pytest.raises(ValueError, match="Unknown objective"):
    objectives.get_objective("ppo")


def test_registered_objectives_agree_with_direct_calls():
  logp, log_ratio, adv, n, g = random_batch(11)
  old = logp - log_ratio
  eubo = logp + 0.5
  lengths = np.full(n, 10.0, np.float32)
  inputs = objectives.ObjectiveInputs(logp=jnp.asarray(logp), advantages=jnp.asarray(adv),
                                  old_logp=jnp.asarray(old), eubo=jnp.asarray(eubo),
                                  lengths=jnp.asarray(lengths))
  registered = lambda name, **overrides: objectives.get_objective(name)(
      inputs, objectives.get_objective(name).make_hparams(overrides), g)
  stable, _ = registered("stabledrl", surrogate="sandwich")
  s = np.where(adv > 0, logp, 0.5 * eubo + 0.5 * logp)
  np.testing.assert_allclose(stable, np_stabledrl(s, logp - old, adv, g), rtol=1e-5)
  grpo, _ = registered("grpo", epsilon_low=0.5, epsilon_high=0.5, beta=0.0)
  np.testing.assert_allclose(grpo, np_grpo(logp, old, adv, 0.5, 0.5), rtol=1e-5)
  espo, _ = objectives.get_objective("espo")(inputs.replace(gen_length=16),
                                             objectives.espo.ESPOHparams(beta=0.0), g)
  np.testing.assert_allclose(espo, np_grpo(logp / 16, old / 16, adv), rtol=1e-5)
  spg, _ = registered("spg")
  np.testing.assert_allclose(spg, np_spg(s, adv, lengths), rtol=1e-5)
  wd1, _ = registered("wd1")
  np.testing.assert_allclose(wd1, np_wd1(logp, adv, g), rtol=1e-5)


def test_objective_names_missing_inputs():
  inputs = objectives.ObjectiveInputs(logp=jnp.zeros(4), advantages=jnp.zeros(4))
  with pytest.raises(ValueError, match="old_logp"):
    objectives.get_objective("stabledrl")(inputs, sdrl.StableDRLHparams(), 2)


# ---------------------------------------------------------------------------
# jit and no-jit agree.
# ---------------------------------------------------------------------------


class JitAgreementTest(chex.TestCase, parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("grpo", "espo", "spg", "wd1", "stabledrl")
  def test_objective(self, name):
    logp, log_ratio, adv, n, g = random_batch(12)
    inputs = objectives.ObjectiveInputs(
        logp=jnp.asarray(logp), advantages=jnp.asarray(adv),
        old_logp=jnp.asarray(logp - log_ratio), eubo=jnp.asarray(logp + 1.0),
        ref_logp=jnp.asarray(logp - 0.3), lengths=jnp.full((n,), 7.0), mask=jnp.arange(n) != 2)
    inputs = inputs.replace(gen_length=32)
    objective = objectives.get_objective(name)
    hparams = objective.make_hparams()
    fn = self.variant(functools.partial(objective, hparams=hparams, group_size=g))
    loss, metrics = fn(inputs)
    ref_loss, ref_metrics = objective(inputs, hparams, g)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    chex.assert_trees_all_close(metrics, ref_metrics, rtol=1e-6)


# ---------------------------------------------------------------------------
# One file per objective, one copy of each default, state updated inside jit.
# ---------------------------------------------------------------------------


_ARRAY_FUNCTIONS = {
    "stabledrl": (sdrl.StableDRLHparams,
                  [sdrl.stabledrl_loss, sdrl.snis_weights,
                   sdrl.clip_log_ratio]),
    "grpo": (objectives.grpo.GRPOHparams, [objectives.grpo.grpo_loss]),
    "espo": (objectives.espo.ESPOHparams, [objectives.espo.espo_loss]),
    "spg": (objectives.spg.SPGHparams, [objectives.spg.spg_surrogate]),
}


@pytest.mark.parametrize("name", sorted(_ARRAY_FUNCTIONS))
def test_the_array_functions_default_to_their_objectives_hyperparameters(name):
  """A hyperparameter's default is written once, in its dataclass: every array-level function
  that takes it as a keyword defaults to that value (``beta`` aside: 0 there means no KL)."""
  import dataclasses
  import inspect
  hparams, functions = _ARRAY_FUNCTIONS[name]
  defaults = {f.name: f.default for f in dataclasses.fields(hparams)}
  checked = 0
  for fn in functions:
    for parameter in inspect.signature(fn).parameters.values():
      if parameter.name in defaults and parameter.name != "beta":
        assert parameter.default == defaults[parameter.name], (fn.__name__, parameter.name)
        checked += 1
  assert checked


@pytest.mark.parametrize("name", ["stabledrl", "grpo", "espo", "spg", "wd1"])
def test_each_objective_module_opens_with_its_equation_and_official_source(name):
  import re
  module = getattr(objectives, name)
  doc = module.__doc__
  assert "Official code" in doc and re.search(r"\[[0-9a-f]{7}\]", doc), name  # Its commit.
  assert re.search(r":\d+(-\d+)?", doc), name  # Source lines.
  assert "=" in doc.split("\n\n")[1], name  # The equation, right after the title.
  assert objectives.get_objective(name).loss.__module__ == module.__name__


def test_the_adaptive_clip_state_moves_inside_jit_as_its_controller_says():
  """``train_step.advance_objective_state`` (jitted, as the trainer runs it): the bound after a
  step is ``adapt_log_clip`` of the mean clipped fraction over the step's updates; fixed: kept."""
  from stabledrl_jax.training.step import train_step
  adaptive = sdrl.StableDRLHparams(clip_mode="adaptive", max_ratio=2.0)
  state = objectives.get_objective("stabledrl").initial_state(adaptive)
  assert float(state["log_clip_hi"]) == pytest.approx(np.log(2.0))
  inner = [{"clip/frac_upper": jnp.float32(0.25), "clip/frac_lower": jnp.float32(0.0),
            "per_sample/weight": jnp.ones(4)},
           {"clip/frac_upper": jnp.float32(0.125), "clip/frac_lower": jnp.float32(0.0625),
            "per_sample/weight": jnp.ones(4)}]
  for hparams, moved in ((adaptive, True), (sdrl.StableDRLHparams(), False)):
    advance = jax.jit(functools.partial(train_step.advance_objective_state,
                                        run=_run("stabledrl", hparams)))
    new = advance(state, inner)
    expected = sdrl.adapt_log_clip(state["log_clip_hi"], 0.1875 + 0.03125)
    assert float(new["log_clip_hi"]) == (float(expected) if moved else float(state[
        "log_clip_hi"]))
  assert float(expected) == pytest.approx(np.log(2.0) + 0.1)  # Above the band: raised.
  # A stateless objective's state stays empty.
  assert train_step.advance_objective_state(
      {}, inner, run=_run("grpo", objectives.grpo.GRPOHparams())) == {}


def _run(objective, hparams):
  from stabledrl_jax import estimators
  from stabledrl_jax.training.config import run_spec
  spec = estimators.LikelihoodSpec(method="elbo", num_samples=2, normalize="mean",
                                   token_level=False, eubo_beta=None, family="llada", mask_id=0)
  return run_spec.RunSpec(objective=objective, hparams=hparams, likelihood=spec, group_size=2,
                          gen_length=4)


def test_init_state_and_update_state_come_together():
  with pytest.raises(TypeError, match="come together"):
    objectives.register_objective("half_state", estimator={}, init_state=lambda p: {})(
        lambda inputs, hparams, group_size: (0.0, {}))
  assert "half_state" not in objectives.objective_names()
