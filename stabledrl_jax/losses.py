"""Policy-gradient objectives for masked diffusion LMs: pure functions of arrays.

Every objective takes arrays (no model, no PRNG, no Python branching on values),
is jit-able, handles padding through masks, and returns ``(loss, metrics)``
where ``loss`` is the scalar to *minimize* and ``metrics`` a flat dict of
scalars with stable names (``log_ratio/max``, ``snis/ess``, ``clip/frac_upper``),
plus optional ``per_sample/<name>`` [N] arrays (the weight each sample's gradient
gets), which the trainer keeps for the spike recorder instead of averaging.

Notation (docs/algorithms.md): a batch holds P prompts x G completions, N = P * G,
each group contiguous. ``A`` are advantages, ``l`` likelihood estimates,
``log_ratio = l_theta - l_old`` (log rho) and ``s`` a surrogate log-likelihood
that carries the gradient.

StableDRL (the paper's objective) in three lines::

    log_c = clip(log_ratio, log lo, log hi)           # unconditional clipping
    w     = sg(softmax_group(log_c))                  # self-normalization (SNIS)
    loss  = -(1/P) * sum_groups sum_j w_j * A_j * s_j

The weights are a convex combination within each group, so the gradient is
bounded by ``max_j |A_j| * ||grad s_j||`` whatever the ratio estimates are.

Objectives are registered by name (``get_objective("stabledrl")``) with a
uniform calling convention on :class:`ObjectiveInputs`; one ``register_objective`` carries
everything the trainer needs (docs/algorithms.md, "Adding an objective").
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Callable

import chex
import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array
Metrics = dict[str, Array]

# Clamp for exp() in the k3 KL estimator: exp(20) ~ 5e8 is already far outside
# any useful KL value, and clamping *before* exp keeps the value and its
# gradient finite.
_MAX_KL_LOG_DIFF = 20.0


# ---------------------------------------------------------------------------
# Shared helpers.
# ---------------------------------------------------------------------------


def _num_groups(n: int, group_size: int) -> int:
  if group_size < 1:
    raise ValueError(f"group_size must be >= 1, got {group_size}.")
  if n % group_size:
    raise ValueError(
        f"The batch size {n} is not a multiple of group_size {group_size}: "
        "every group of completions must be complete and contiguous.")
  return n // group_size


def _as_valid(mask: Array | None, shape: tuple[int, ...]) -> Array:
  if mask is None:
    return jnp.ones(shape, dtype=bool)
  chex.assert_shape(mask, shape)
  return mask.astype(bool)


def _masked_mean(x: Array, valid: Array) -> Array:
  """Mean of ``x`` over ``valid`` entries; 0 when nothing is valid."""
  total = jnp.sum(jnp.where(valid, x, 0.0))
  return total / jnp.maximum(jnp.sum(valid), 1)


def _masked_max(x: Array, valid: Array) -> Array:
  return jnp.max(jnp.where(valid, x, -jnp.inf), initial=-jnp.inf)


def _masked_min(x: Array, valid: Array) -> Array:
  return jnp.min(jnp.where(valid, x, jnp.inf), initial=jnp.inf)


def _log_bounds(min_ratio: float, max_ratio: float) -> tuple[float, float]:
  """Log-space clipping bounds; ``min_ratio == 0`` means no lower bound."""
  if not 0.0 <= min_ratio < max_ratio:
    raise ValueError(
        f"Ratio bounds must satisfy 0 <= min_ratio < max_ratio, got "
        f"min_ratio={min_ratio}, max_ratio={max_ratio}.")
  log_lo = -math.inf if min_ratio == 0.0 else math.log(min_ratio)
  return log_lo, math.log(max_ratio)


def ratio_metrics(log_ratio: Array, advantages: Array, valid: Array, *,
                  log_lo: float, log_hi: float) -> Metrics:
  """Diagnostics of the importance ratios against clipping bounds.

  Args:
    log_ratio: [...] log rho_hat (per sequence or per token).
    advantages: [...] A, broadcast to ``log_ratio``'s shape.
    valid: [...] bool, entries that count.
    log_lo, log_hi: clipping bounds in log space.

  Returns:
    ``log_ratio/{mean,max,min,var}`` and the fraction of valid entries above
    (``clip/frac_upper``) and below (``clip/frac_lower``) the bounds, also split
    by the sign of the advantage (``clip/frac_upper_neg_adv``, ...). Ratios
    above the bound with A < 0 are the ones GRPO's conditional clip lets
    through.
  """
  log_ratio = jax.lax.stop_gradient(log_ratio)
  above = valid & (log_ratio > log_hi)
  below = valid & (log_ratio < log_lo)
  pos = advantages > 0
  neg = advantages < 0
  frac = lambda m: _masked_mean(m.astype(jnp.float32), valid)
  finite = valid & jnp.isfinite(log_ratio)
  return {
      "log_ratio/mean": _masked_mean(log_ratio, valid),
      # Over finite entries: one infinite ratio would make it NaN and say nothing.
      "log_ratio/var": _masked_mean(
          jnp.square(log_ratio - _masked_mean(log_ratio, finite)), finite),
      "log_ratio/max": _masked_max(log_ratio, valid),
      "log_ratio/min": _masked_min(log_ratio, valid),
      "clip/frac_upper": frac(above),
      "clip/frac_lower": frac(below),
      "clip/frac_upper_pos_adv": frac(above & pos),
      "clip/frac_upper_neg_adv": frac(above & neg),
      "clip/frac_lower_pos_adv": frac(below & pos),
      "clip/frac_lower_neg_adv": frac(below & neg),
  }


# ---------------------------------------------------------------------------
# Advantages.
# ---------------------------------------------------------------------------


ADVANTAGE_BASELINES = ("group_mean", "leave_one_out")


def group_advantages(rewards: Array, group_size: int, *,
                     scale_by_std: bool = False, eps: float = 1e-6,
                     ddof: int = 0, baseline: str = "group_mean") -> Array:
  """Group-relative advantages ``A_j = r_j - b_j``.

  Args:
    rewards: [N] rewards, N = P * G, each group of G contiguous.
    group_size: G.
    scale_by_std: divide by ``(std_group(r) + eps)`` (GRPO's normalization).
    eps: added to the std so that a group of equal rewards gives A = 0.
    ddof: degrees of freedom of the std (0: population std, 1: unbiased).
    baseline: 'group_mean' (b_j = mean_group(r)) or 'leave_one_out' (ESPO: b_j the mean of the
      group's other G - 1 rewards, i.e. ``G / (G - 1) * (r_j - mean_group(r))``; needs G >= 2).

  Returns:
    [N] advantages, float32.
  """
  chex.assert_rank(rewards, 1)
  if baseline not in ADVANTAGE_BASELINES:
    raise ValueError(f"baseline must be one of {ADVANTAGE_BASELINES}, got {baseline!r}.")
  num_groups = _num_groups(rewards.shape[0], group_size)
  grouped = rewards.astype(jnp.float32).reshape(num_groups, group_size)
  centred = grouped - jnp.mean(grouped, axis=1, keepdims=True)
  if baseline == "leave_one_out":
    if group_size < 2:
      raise ValueError("a leave-one-out baseline needs group_size >= 2.")
    centred = centred * (group_size / (group_size - 1))
  if scale_by_std:
    if group_size - ddof < 1:
      raise ValueError(f"ddof={ddof} needs group_size > {ddof}.")
    centred = centred / (jnp.std(grouped, axis=1, ddof=ddof, keepdims=True) + eps)
  return centred.reshape(-1)


# ---------------------------------------------------------------------------
# StableDRL.
# ---------------------------------------------------------------------------


def clip_log_ratio(log_ratio: Array, *, min_ratio: float = 0.0,
                   max_ratio: float = 5.0, log_max_ratio: Array | None = None) -> Array:
  """Unconditional clipping in log space: ``log c(rho) = clip(log rho, log lo, log hi)``.

  ``min_ratio = 0`` leaves the lower side unbounded (never ``log(0)``). ``log_max_ratio``: a
  traced log hi (the adaptive clip's, ``adapt_log_clip``) in place of ``log(max_ratio)``.
  """
  log_lo, log_hi = _log_bounds(min_ratio, max_ratio)
  return jnp.clip(log_ratio, log_lo, log_hi if log_max_ratio is None else log_max_ratio)


CLIP_MODES = ("fixed", "adaptive")


def adapt_log_clip(log_hi: Array, clipped_fraction: Array, *,
                   band: tuple[float, float] = (0.02, 0.10), step: float = 0.1,
                   log_range: tuple[float, float] = (0.05, 6.9)) -> Array:
  """The adaptive clip's controller: the next log hi from this step's clipped fraction.

  Above the band the bound is raised by ``step`` (in log space), below it lowered by ``step``,
  inside it kept; the result stays in ``log_range`` (default: rho bounds 1.05 to ~1000). A
  non-finite fraction (a skipped update) keeps the bound. Pure and elementwise: ``log_hi`` and
  ``clipped_fraction`` are scalars or arrays of one shape.

  Args:
    log_hi: [] current log of the upper ratio bound.
    clipped_fraction: [] fraction of the step's ratios the bound clipped (``clip/frac_upper``
      plus ``clip/frac_lower``).
    band: (low, high) target range of the clipped fraction.
    step: the largest change of log hi per call.
    log_range: (min, max) of log hi.

  Returns:
    [] float32 next log hi.
  """
  log_hi = jnp.asarray(log_hi, jnp.float32)
  fraction = jnp.asarray(clipped_fraction, jnp.float32)
  delta = jnp.where(fraction > band[1], step, jnp.where(fraction < band[0], -step, 0.0))
  delta = jnp.where(jnp.isfinite(fraction), delta, 0.0)
  return jnp.clip(log_hi + delta, log_range[0], log_range[1])


def _group_softmax(logits: Array, valid: Array) -> Array:
  """Softmax over the last axis restricted to ``valid`` entries.

  Finite for any finite or -inf input. A group whose valid entries are all
  -inf (every ratio exactly 0) carries no preference and gets uniform weights;
  a group with no valid entry gets all-zero weights.
  """
  logits = jnp.where(valid, logits, -jnp.inf)
  top = jnp.max(logits, axis=-1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  unnorm = jnp.where(valid, jnp.exp(logits - top), 0.0)
  total = jnp.sum(unnorm, axis=-1, keepdims=True)
  unnorm = jnp.where(total > 0, unnorm, valid.astype(unnorm.dtype))
  # The largest valid entry contributes exp(0) = 1 (or the uniform fallback
  # contributes its count), so total is 0 only for a group with nothing valid.
  total = jnp.sum(unnorm, axis=-1, keepdims=True)
  return unnorm / jnp.where(total > 0, total, 1.0)


def snis_weights(log_ratio: Array, group_size: int, *, min_ratio: float = 0.0,
                 max_ratio: float = 5.0, sample_mask: Array | None = None,
                 log_max_ratio: Array | None = None) -> Array:
  """Self-normalized importance weights of clipped ratios, per group.

  ``w_j = c(rho_j) / sum_{k in group} c(rho_k)``, computed as a softmax of the
  clipped log ratios (log-sum-exp), so ``rho = 1e300`` or ``1e-300`` stays
  finite. Use ``group_size = N`` for batch-level normalization.

  Args:
    log_ratio: [N] log rho_hat, one per completion.
    group_size: G, the size of a normalization group.
    min_ratio, max_ratio: clipping bounds on rho (``min_ratio = 0``: no lower
      bound).
    sample_mask: optional [N] bool; masked samples get weight 0.
    log_max_ratio: optional [] traced log hi (the adaptive clip), in place of max_ratio's.

  Returns:
    [N] weights, >= 0, summing to 1 within each group (with at least one valid
    sample), with stop-gradient.
  """
  chex.assert_rank(log_ratio, 1)
  num_groups = _num_groups(log_ratio.shape[0], group_size)
  valid = _as_valid(sample_mask, log_ratio.shape)
  clipped = clip_log_ratio(log_ratio.astype(jnp.float32), min_ratio=min_ratio,
                           max_ratio=max_ratio, log_max_ratio=log_max_ratio)
  weights = _group_softmax(clipped.reshape(num_groups, group_size),
                           valid.reshape(num_groups, group_size))
  return jax.lax.stop_gradient(weights.reshape(-1))


def _snis_metrics(weights: Array, group_size: int, valid: Array) -> Metrics:
  grouped = weights.reshape(-1, group_size)
  has_valid = jnp.any(valid.reshape(-1, group_size), axis=1)
  ess = 1.0 / jnp.maximum(jnp.sum(grouped**2, axis=1), jnp.finfo(jnp.float32).tiny)
  entropy = -jnp.sum(jnp.where(grouped > 0, grouped * jnp.log(
      jnp.where(grouped > 0, grouped, 1.0)), 0.0), axis=1)
  return {
      "snis/ess": _masked_mean(ess, has_valid),
      "snis/ess_min": _masked_min(ess, has_valid),
      "snis/weight_entropy": _masked_mean(entropy, has_valid),
      "snis/weight_max": jnp.max(weights),
  }


def stabledrl_loss(logp: Array, log_ratio: Array, advantages: Array,
                   group_size: int, *, min_ratio: float = 0.0,
                   max_ratio: float = 5.0, normalize_over: str = "group",
                   sample_mask: Array | None = None,
                   log_max_ratio: Array | None = None) -> tuple[Array, Metrics]:
  """StableDRL: ``-(1/P) * sum_groups sum_j sg(w_j) * A_j * s_j``.

  Args:
    logp: [N] surrogate s_j (an ELBO or the SPG sandwich); carries the gradient.
    log_ratio: [N] log rho_hat_j = l_theta - l_old (length-normalized ELBOs);
      only its value is used.
    advantages: [N] A_j.
    group_size: G.
    min_ratio, max_ratio: unconditional clip of rho (paper: 0 and 5; the
      symmetric variant is ``1 - eps, 1 + eps``).
    normalize_over: ``"group"`` (default, weights sum to 1 per group) or
      ``"batch"`` (weights sum to 1 over the whole batch).
    sample_mask: optional [N] bool, samples that count.
    log_max_ratio: optional [] traced log hi (the adaptive clip) in place of
      ``log(max_ratio)``.

  Returns:
    (loss, metrics) with ESS, log-ratio, clip-fraction and weight-entropy
    diagnostics, and ``per_sample/weight`` [N], the SNIS weights.
  """
  chex.assert_rank([logp, log_ratio, advantages], 1)
  chex.assert_equal_shape([logp, log_ratio, advantages])
  n = logp.shape[0]
  num_groups = _num_groups(n, group_size)
  if normalize_over == "group":
    scope = group_size
  elif normalize_over == "batch":
    scope = n
  else:
    raise ValueError(
        f"normalize_over must be 'group' or 'batch', got {normalize_over!r}.")
  valid = _as_valid(sample_mask, (n,))
  weights = snis_weights(log_ratio, scope, min_ratio=min_ratio,
                         max_ratio=max_ratio, sample_mask=valid, log_max_ratio=log_max_ratio)
  advantages = jax.lax.stop_gradient(advantages.astype(jnp.float32))
  # Group-scope weights sum to 1 per group (total mass P), batch scope to 1.
  total_mass = num_groups if scope == group_size else 1
  loss = -jnp.sum(weights * advantages * logp.astype(jnp.float32)) / total_mass
  log_lo, log_hi = _log_bounds(min_ratio, max_ratio)
  if log_max_ratio is not None:
    log_hi = log_max_ratio
  metrics = {
      "loss": loss,
      **ratio_metrics(log_ratio, advantages, valid, log_lo=log_lo, log_hi=log_hi),
      **_snis_metrics(weights, scope, valid),
      "per_sample/weight": weights,
  }
  return loss, metrics


# ---------------------------------------------------------------------------
# GRPO / d1 and ESPO.
# ---------------------------------------------------------------------------


def kl_penalty(logp: Array, ref_logp: Array, estimator: str = "k3") -> Array:
  """Per-entry estimate of KL(pi_theta || pi_ref) from samples of pi_theta.

  With ``d = ref_logp - logp``: k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1
  (Schulman's estimators). ``d`` is clamped before ``exp``.
  """
  diff = ref_logp - logp
  if estimator == "k1":
    return -diff
  if estimator == "k2":
    return 0.5 * jnp.square(diff)
  if estimator == "k3":
    diff = jnp.clip(diff, -_MAX_KL_LOG_DIFF, _MAX_KL_LOG_DIFF)
    return jnp.exp(diff) - diff - 1.0
  raise ValueError(f"kl estimator must be 'k1', 'k2' or 'k3', got {estimator!r}.")


def grpo_loss(logp: Array, old_logp: Array, advantages: Array, *,
              epsilon_low: float = 0.2, epsilon_high: float = 0.2,
              mask: Array | None = None, ref_logp: Array | None = None,
              beta: float = 0.0, kl_estimator: str = "k3") -> tuple[Array, Metrics]:
  """GRPO's conditionally clipped surrogate, token or sequence level.

  ``loss = -mean(min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A))
  + beta * mean(KL)``, with ``rho = exp(logp - old_logp)``; the mean runs over
  the batch's valid entries (tokens at token level). For A < 0 and
  rho > 1 + eps_high the unclipped branch wins, so the gradient grows with rho
  without bound: the failure StableDRL fixes.

  Args:
    logp: [N] (sequence level) or [N, T] (token level) log-likelihoods under
      pi_theta; carries the gradient.
    old_logp: same shape, under pi_old (no gradient).
    advantages: [N] A, broadcast over tokens.
    epsilon_low, epsilon_high: clip range of rho.
    mask: optional bool of ``logp``'s shape, entries that count (padding off).
    ref_logp: optional, same shape, under a frozen reference policy.
    beta: KL coefficient (needs ``ref_logp`` when > 0).
    kl_estimator: 'k1', 'k2' or 'k3'.

  Returns:
    (loss, metrics).
  """
  chex.assert_equal_shape([logp, old_logp])
  chex.assert_rank(advantages, 1)
  if logp.ndim not in (1, 2) or logp.shape[0] != advantages.shape[0]:
    raise ValueError(
        f"logp must be [N] or [N, T] with N = len(advantages) = "
        f"{advantages.shape[0]}, got shape {logp.shape}.")
  if epsilon_low < 0 or epsilon_high < 0:
    raise ValueError(
        f"Clip epsilons must be >= 0, got {epsilon_low}, {epsilon_high}.")
  if beta and ref_logp is None:
    raise ValueError("beta > 0 needs ref_logp for the KL penalty.")
  valid = _as_valid(mask, logp.shape)
  logp = logp.astype(jnp.float32)
  adv = jax.lax.stop_gradient(advantages.astype(jnp.float32))
  adv = adv[:, None] if logp.ndim == 2 else adv
  adv = jnp.broadcast_to(adv, logp.shape)
  log_ratio = logp - jax.lax.stop_gradient(old_logp.astype(jnp.float32))
  # Padding entries may hold anything (even inf); zero them before exp so that
  # they cannot poison the gradient through 0 * inf.
  log_ratio = jnp.where(valid, log_ratio, 0.0)
  ratio = jnp.exp(log_ratio)
  unclipped = ratio * adv
  clipped = jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * adv
  objective = jnp.minimum(unclipped, clipped)
  per_entry = -objective
  metrics = {}
  if beta:
    kl = kl_penalty(logp, jax.lax.stop_gradient(ref_logp.astype(jnp.float32)),
                    kl_estimator)
    kl = jnp.where(valid, kl, 0.0)
    per_entry = per_entry + beta * kl
    metrics["kl/mean"] = _masked_mean(kl, valid)
  loss = _masked_mean(per_entry, valid)
  log_lo = math.log(1.0 - epsilon_low) if epsilon_low < 1 else -math.inf
  # Each entry's gradient is coefficient * A * grad logp: rho where the unclipped branch is
  # taken, 0 where the clip is; per sample, the mean over its valid entries.
  coefficient = jax.lax.stop_gradient(jnp.where(clipped < unclipped, 0.0, ratio))
  if logp.ndim == 2:
    coefficient = jnp.sum(jnp.where(valid, coefficient, 0.0), axis=1) / jnp.maximum(
        jnp.sum(valid, axis=1), 1)
  metrics.update({
      "loss": loss,
      "per_sample/weight": coefficient,
      # Entries where the clipped branch is taken: their gradient is zero.
      "clip/frac_active": _masked_mean((clipped < unclipped).astype(jnp.float32), valid),
      **ratio_metrics(log_ratio, adv, valid, log_lo=log_lo,
                      log_hi=math.log1p(epsilon_high)),
  })
  return loss, metrics


def espo_loss(elbo: Array, old_elbo: Array, advantages: Array,
              gen_length: int | Array, *, epsilon: float = 0.2,
              sample_mask: Array | None = None, ref_elbo: Array | None = None,
              beta: float = 0.0) -> tuple[Array, Metrics]:
  """ESPO: sequence-level PPO on ``rho = exp((ELBO_theta - ELBO_old) / L)``.

  ``loss = -mean(min(rho A, clip(rho, 1 - eps, 1 + eps) A))
  + beta * mean((ELBO_theta - ELBO_ref)^2 / (2 L))`` (k2 KL per token).

  Args:
    elbo: [N] sum-form ELBO estimates under pi_theta (gradient).
    old_elbo: [N] under pi_old.
    advantages: [N].
    gen_length: L, the generation length (scalar or [N]).
    epsilon: symmetric clip range.
    sample_mask: optional [N] bool.
    ref_elbo: optional [N] under a reference policy, for the KL penalty.
    beta: KL coefficient.
  """
  chex.assert_rank([elbo, old_elbo, advantages], 1)
  if beta and ref_elbo is None:
    raise ValueError("beta > 0 needs ref_elbo for the KL penalty.")
  inv_length = 1.0 / jnp.asarray(gen_length, jnp.float32)
  loss, metrics = grpo_loss(elbo * inv_length, old_elbo * inv_length, advantages,
                            epsilon_low=epsilon, epsilon_high=epsilon,
                            mask=sample_mask)
  if beta:
    valid = _as_valid(sample_mask, elbo.shape)
    diff = elbo.astype(jnp.float32) - jax.lax.stop_gradient(ref_elbo.astype(jnp.float32))
    kl = _masked_mean(0.5 * jnp.square(diff) * inv_length, valid)
    loss = loss + beta * kl
    metrics = {**metrics, "loss": loss, "kl/mean": kl}
  return loss, metrics


# ---------------------------------------------------------------------------
# Ratio-free objectives: SPG and wd1.
# ---------------------------------------------------------------------------


def spg_surrogate(elbo: Array, eubo: Array, advantages: Array, *,
                  omega: float = 0.5) -> Array:
  """SPG's sandwiched surrogate s_j.

  The ELBO (a lower bound) for A_j > 0, where raising it raises the
  likelihood; for A_j <= 0 the mix ``omega * EUBO + (1 - omega) * ELBO`` so
  that pushing the likelihood down also pushes an upper bound down.

  Args:
    elbo, eubo: [N] lower and upper bound estimates (gradient flows through).
    advantages: [N] A.
    omega: mixing weight in [0, 1].
  """
  chex.assert_equal_shape([elbo, eubo, advantages])
  if not 0.0 <= omega <= 1.0:
    raise ValueError(f"omega must lie in [0, 1], got {omega}.")
  mixed = omega * eubo + (1.0 - omega) * elbo
  return jnp.where(advantages > 0, elbo, mixed)


def spg_loss(logp: Array, advantages: Array, lengths: Array, *,
             sample_mask: Array | None = None) -> tuple[Array, Metrics]:
  """SPG: ``-sum_j A_j * s_j * len_j / sum_k len_k`` (no importance ratio).

  Args:
    logp: [N] per-token-mean surrogate s_j (gradient).
    advantages: [N].
    lengths: [N] number of scored completion tokens of each sample.
    sample_mask: optional [N] bool.
  """
  chex.assert_rank([logp, advantages, lengths], 1)
  chex.assert_equal_shape([logp, advantages, lengths])
  valid = _as_valid(sample_mask, logp.shape)
  lengths = jnp.where(valid, lengths.astype(jnp.float32), 0.0)
  adv = jax.lax.stop_gradient(advantages.astype(jnp.float32))
  loss = -jnp.sum(adv * logp.astype(jnp.float32) * lengths) / jnp.maximum(
      jnp.sum(lengths), 1.0)
  return loss, {"loss": loss, "surrogate/mean": _masked_mean(logp, valid)}


def wd1_loss(logp: Array, advantages: Array, group_size: int, *,
             sample_mask: Array | None = None) -> tuple[Array, Metrics]:
  """wd1: ``-sum_j softmax_G(A)_j * l_j + sum_j softmax_G(-A)_j * l_j``, mean over groups.

  Args:
    logp: [N] likelihood estimates l_j (gradient).
    advantages: [N].
    group_size: G.
    sample_mask: optional [N] bool.
  """
  chex.assert_rank([logp, advantages], 1)
  chex.assert_equal_shape([logp, advantages])
  num_groups = _num_groups(logp.shape[0], group_size)
  valid = _as_valid(sample_mask, logp.shape).reshape(num_groups, group_size)
  adv = jax.lax.stop_gradient(advantages.astype(jnp.float32)).reshape(
      num_groups, group_size)
  w_pos = _group_softmax(adv, valid)
  w_neg = _group_softmax(-adv, valid)
  grouped = logp.astype(jnp.float32).reshape(num_groups, group_size)
  loss = jnp.sum((w_neg - w_pos) * grouped) / num_groups
  return loss, {"loss": loss, "wd1/weight_pos_max": jnp.max(w_pos)}


# ---------------------------------------------------------------------------
# Registry: objectives selected by config name.
# ---------------------------------------------------------------------------


@flax.struct.dataclass
class ObjectiveInputs:
  """What the trainer hands an objective. Shapes: N = P * G completions.

  Attributes:
    logp: [N] likelihood estimate under pi_theta (carries the gradient), or
      [N, T] per-token log-probs for token-level GRPO.
    advantages: [N] A.
    old_logp: like ``logp``, under pi_old (rollout time), no gradient.
    mask: [N] (or [N, T] at token level) bool, entries that count.
    ref_logp: like ``logp``, under the frozen reference policy (KL terms).
    eubo: [N] EUBO estimate under pi_theta (SPG sandwich), gradient.
    lengths: [N] scored completion tokens per sample.
    log_clip_hi: [] the adaptive clip's current log hi (``TrainState.log_clip_hi``).
  """

  logp: Array
  advantages: Array
  old_logp: Array | None = None
  mask: Array | None = None
  ref_logp: Array | None = None
  eubo: Array | None = None
  lengths: Array | None = None
  log_clip_hi: Array | None = None


@dataclasses.dataclass(frozen=True)
class Objective:
  """A registered objective: everything the trainer needs to know about it, in one place.

  Attributes:
    name: config name (``--config.objective.name``).
    fn: ``fn(inputs, *, group_size, **kwargs) -> (loss, metrics)``; ``kwargs`` are the fields
      of ``hparams`` that ``fn`` takes, plus the run settings named in ``context``.
    hparams: a frozen dataclass of its hyperparameters, defaulting to its official code's
      (docs/algorithms.md). ``config.objective.<name>.<field>`` overrides a field; a
      ``check()`` method, if any, raises ValueError("<field>: <why>") for a bad value.
    requires: names of ``ObjectiveInputs`` fields that must be set.
    normalize: the likelihood normalization it expects, 'sum' or 'mean'.
    estimator: ``estimator(hparams) -> dict``, the official likelihood settings: ``method`` (an
      estimator method, ``estimators.methods()``), ``num_samples``, ``coupled_ratio`` (l_old on each
      inner iteration's own masks) and mask-sampler options. A config field left unset takes
      these.
    baseline: the advantage baseline of its official code (``ADVANTAGE_BASELINES``).
    uses_reference: ``uses_reference(hparams) -> bool``: needs a frozen reference (a KL term).
    token_level: ``token_level(hparams) -> bool``: per-token log-probs [N, T] instead of [N].
    eubo_beta: ``eubo_beta(hparams) -> float | None``: SPG's EUBO_beta from the same pass.
    surrogate: ``surrogate(inputs, hparams) -> [N]``, the log-likelihood whose per-sample
      gradients bound the update (StableDRL's convex hull, ``train.gradient_bound``); None when
      the objective has no such bound.
    context: run settings ``fn`` takes (``"gen_length"``: the completion length).
    variants: named hyperparameter overrides that comparisons run as separate objectives
      (``{"grpo_token": {"level": "token"}, ...}``); by default the objective itself.
    metrics: the metric names ``fn`` always reports.
  """

  name: str
  fn: Callable[..., tuple[Array, Metrics]]
  hparams: type
  requires: tuple[str, ...]
  normalize: str
  estimator: Callable[[Any], dict[str, Any]]
  baseline: str = "group_mean"
  uses_reference: Callable[[Any], bool] = lambda hparams: False
  token_level: Callable[[Any], bool] = lambda hparams: False
  eubo_beta: Callable[[Any], float | None] = lambda hparams: None
  surrogate: Callable[[ObjectiveInputs, Any], Array] | None = None
  context: tuple[str, ...] = ()
  variants: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
  metrics: tuple[str, ...] = ()

  def make_hparams(self, overrides: dict[str, Any] | None = None) -> Any:
    """The hyperparameters: the official defaults with ``overrides`` (None values skipped).

    Raises:
      ValueError: "<field>: <why>" for an unknown field or a value ``check()`` refuses.
    """
    fields = {f.name for f in dataclasses.fields(self.hparams)}
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = sorted(set(given) - fields)
    if unknown:
      raise ValueError(f"{unknown[0]}: {self.name!r} has no hyperparameter {unknown[0]!r}; its "
                       f"hyperparameters are {sorted(fields)}")
    params = self.hparams(**given)
    _check_finite(params)
    if hasattr(params, "check"):
      params.check()
    return params

  def loss_kwargs(self, hparams: Any, context: dict[str, Any] | None = None
                  ) -> tuple[tuple[str, Any], ...]:
    """What ``fn`` takes, as a static (hashable) tuple: its hyperparameter fields and context."""
    taken = inspect.signature(self.fn).parameters
    kwargs = {k: v for k, v in dataclasses.asdict(hparams).items() if k in taken}
    kwargs.update({k: v for k, v in (context or {}).items() if k in self.context})
    return tuple(sorted(kwargs.items()))

  def variant_overrides(self) -> dict[str, dict[str, Any]]:
    """{variant name: hyperparameter overrides}; the objective alone without variants."""
    return {name: dict(overrides) for name, overrides in self.variants} or {self.name: {}}

  def __call__(self, inputs: ObjectiveInputs, *, group_size: int,
               **hparams: Any) -> tuple[Array, Metrics]:
    missing = [f for f in self.requires if getattr(inputs, f) is None]
    if missing:
      raise ValueError(f"Objective {self.name!r} needs inputs {missing}.")
    return self.fn(inputs, group_size=group_size, **hparams)


_OBJECTIVES: dict[str, Objective] = {}


@dataclasses.dataclass(frozen=True)
class NoHyperparameters:
  """The hyperparameters of an objective that has none."""


def register_objective(name: str, *, hparams: type = NoHyperparameters,
                       requires: tuple[str, ...] = (), normalize: str = "mean",
                       estimator: dict[str, Any] | Callable[[Any], dict[str, Any]],
                       baseline: str = "group_mean",
                       uses_reference: Callable[[Any], bool] | None = None,
                       token_level: Callable[[Any], bool] | None = None,
                       eubo_beta: Callable[[Any], float | None] | None = None,
                       surrogate: Callable[[ObjectiveInputs, Any], Array] | None = None,
                       context: tuple[str, ...] = (),
                       variants: dict[str, dict[str, Any]] | None = None,
                       metrics: tuple[str, ...] = ()):
  """Decorator adding ``fn(inputs, *, group_size, **kwargs)`` to the registry; every keyword is
  an attribute of :class:`Objective`. Registering is all it takes: the config check, the
  likelihood spec, the update step and the comparisons consult the registry."""
  if baseline not in ADVANTAGE_BASELINES:
    raise ValueError(f"baseline must be one of {ADVANTAGE_BASELINES}, got {baseline!r}.")
  if not (dataclasses.is_dataclass(hparams) and hparams.__dataclass_params__.frozen):
    raise TypeError(f"hparams of {name!r} must be a frozen dataclass (hashable: the update step "
                    "is compiled for its values)")
  estimator_of = estimator if callable(estimator) else lambda params: dict(estimator)
  frozen_variants = tuple((k, tuple(sorted(v.items()))) for k, v in (variants or {}).items())

  def decorator(fn):
    if name in _OBJECTIVES:
      raise ValueError(f"Objective {name!r} is already registered.")
    defaults = dict(uses_reference=uses_reference, token_level=token_level, eubo_beta=eubo_beta)
    _OBJECTIVES[name] = Objective(
        name, fn, hparams, ("logp", "advantages") + requires, normalize, estimator_of, baseline,
        surrogate=surrogate, context=context, variants=frozen_variants, metrics=metrics,
        **{k: v for k, v in defaults.items() if v is not None})
    return fn

  return decorator


def unregister_objective(name: str) -> None:
  """Removes a registration (tests that register their own objective clean up with it)."""
  _OBJECTIVES.pop(name, None)


def get_objective(name: str) -> Objective:
  if name not in _OBJECTIVES:
    raise ValueError(
        f"Unknown objective {name!r}; registered: {sorted(_OBJECTIVES)}.")
  return _OBJECTIVES[name]


def objective_names() -> list[str]:
  return sorted(_OBJECTIVES)


def objectives() -> list[Objective]:
  """Every registered objective, in registration order."""
  return list(_OBJECTIVES.values())


def surrogate_logp(inputs: ObjectiveInputs, surrogate: str, omega: float = 0.5) -> Array:
  """[N] s_j, the surrogate log-likelihood that carries StableDRL's and SPG's gradient.

  ``'elbo'``: the estimate itself; ``'sandwich'``: SPG's ELBO / EUBO_beta mix.
  """
  if surrogate == "elbo":
    return inputs.logp
  if surrogate == "sandwich":
    if inputs.eubo is None:
      raise ValueError("surrogate='sandwich' needs inputs.eubo.")
    return spg_surrogate(inputs.logp, inputs.eubo, inputs.advantages, omega=omega)
  raise ValueError(f"surrogate must be 'elbo' or 'sandwich', got {surrogate!r}.")


_RATIO_METRICS = ("log_ratio/mean", "log_ratio/max", "log_ratio/min", "log_ratio/var",
                  "clip/frac_upper", "clip/frac_lower")


def _choice(field: str, value: Any, allowed: tuple[Any, ...]) -> None:
  if value not in allowed:
    raise ValueError(f"{field}: {value!r} is not one of {allowed}")


def _check_finite(params: Any) -> None:
  """Every number field of a hyperparameter dataclass is finite (a NaN or infinite clip bound,
  coefficient or weight poisons every update; ``make_hparams`` checks this before ``check()``).

  Raises:
    ValueError: "<field>: must be a finite number, got nan".
  """
  for field in dataclasses.fields(params):
    value = getattr(params, field.name)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isfinite(
        value):
      raise ValueError(f"{field.name}: must be a finite number, got {value!r}")


def _in_range(field: str, value: float, low: float, high: float = math.inf, *,
              low_open: bool = False, high_open: bool = False) -> None:
  """Raises ValueError "<field>: must lie in [low, high], got v" (open ends as asked)."""
  above = value > low if low_open else value >= low
  below = value < high if high_open else value <= high
  if not (isinstance(value, (int, float)) and not isinstance(value, bool) and above and below):
    interval = (("(" if low_open else "[") + f"{low}, {high}"
                + (")" if high_open or high == math.inf else "]"))
    raise ValueError(f"{field}: must lie in {interval}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class GRPOHparams:
  """d1's GRPO: token level (per-token ratios) or sequence level, PPO clip, k3 KL at 0.04."""

  level: str = "token"
  epsilon_low: float = 0.5
  epsilon_high: float = 0.5
  beta: float = 0.04
  kl_estimator: str = "k3"

  def check(self) -> None:
    _choice("level", self.level, ("token", "sequence"))
    _choice("kl_estimator", self.kl_estimator, ("k1", "k2", "k3"))
    # rho is clipped to [1 - epsilon_low, 1 + epsilon_high]: a lower bound below 0 means nothing.
    _in_range("epsilon_low", self.epsilon_low, 0.0, 1.0)
    _in_range("epsilon_high", self.epsilon_high, 0.0)
    _in_range("beta", self.beta, 0.0)


def _grpo_estimator(params: GRPOHparams) -> dict[str, Any]:
  """d1 (token level): one mean-field sample, prompt tokens masked at 0.15, old and reference
  log-probs on each iteration's own masks. The sequence level scores an ELBO instead."""
  if params.level == "token":
    return dict(method="mean_field", num_samples=1, prompt_mask_prob=0.15, coupled_ratio=True)
  return dict(method="elbo", num_samples=2, coupled_ratio=True)


@register_objective("grpo", hparams=GRPOHparams, requires=("old_logp",), normalize="sum",
                    estimator=_grpo_estimator, uses_reference=lambda p: p.beta > 0,
                    token_level=lambda p: p.level == "token",
                    variants={"grpo_token": {"level": "token"},
                              "grpo_sequence": {"level": "sequence"}},
                    metrics=_RATIO_METRICS)
def _grpo(inputs: ObjectiveInputs, *, group_size: int, epsilon_low: float = 0.5,
          epsilon_high: float = 0.5, beta: float = 0.04,
          kl_estimator: str = "k3") -> tuple[Array, Metrics]:
  del group_size  # Advantages already carry the group structure.
  return grpo_loss(inputs.logp, inputs.old_logp, inputs.advantages,
                   epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                   mask=inputs.mask, ref_logp=inputs.ref_logp, beta=beta,
                   kl_estimator=kl_estimator)


@dataclasses.dataclass(frozen=True)
class ESPOHparams:
  """ESPO: PPO clip on length-normalized ELBO ratios, a k2 KL (beta 1e-3: its GSM8K and MATH
  scripts)."""

  epsilon: float = 0.2
  beta: float = 1e-3

  def check(self) -> None:
    _in_range("epsilon", self.epsilon, 0.0, 1.0)  # rho clipped to [1 - epsilon, 1 + epsilon].
    _in_range("beta", self.beta, 0.0)


# ESPO: its own ELBO (count schedule stratified over the batch, complementary pass, the whole
# generation scored), two samples, masks shared with pi_old and the reference, leave-one-out
# advantages.
@register_objective("espo", hparams=ESPOHparams, requires=("old_logp",), normalize="sum",
                    estimator=dict(method="espo_elbo", num_samples=2, coupled_ratio=True),
                    baseline="leave_one_out", uses_reference=lambda p: p.beta > 0,
                    context=("gen_length",), metrics=_RATIO_METRICS)
def _espo(inputs: ObjectiveInputs, *, group_size: int, gen_length: int,
          epsilon: float = 0.2, beta: float = 1e-3) -> tuple[Array, Metrics]:
  del group_size
  return espo_loss(inputs.logp, inputs.old_logp, inputs.advantages, gen_length,
                   epsilon=epsilon, sample_mask=inputs.mask,
                   ref_elbo=inputs.ref_logp, beta=beta)


# SPG and StableDRL: block_random masks, two samples, prompt and earlier blocks masked at 0.15.
_BLOCK_RANDOM = dict(method="block_random", num_samples=2, prompt_mask_prob=0.15,
                     coupled_ratio=False)


@dataclasses.dataclass(frozen=True)
class SPGHparams:
  """SPG: the ELBO for positive advantages, omega EUBO_beta + (1 - omega) ELBO otherwise."""

  surrogate: str = "sandwich"
  omega: float = 0.5
  eubo_beta: float = 1.5

  def check(self) -> None:
    _choice("surrogate", self.surrogate, ("elbo", "sandwich"))
    _check_sandwich(self)


def _check_sandwich(params: Any) -> None:
  """SPG's sandwich: omega mixes EUBO and ELBO; eubo_beta is the Renyi order (estimators.py)."""
  _in_range("omega", params.omega, 0.0, 1.0)
  _in_range("eubo_beta", params.eubo_beta, 0.0, low_open=True)


def _sandwich_eubo(params: Any) -> float | None:
  return float(params.eubo_beta) if params.surrogate == "sandwich" else None


@register_objective("spg", hparams=SPGHparams, requires=("lengths",), normalize="mean",
                    estimator=_BLOCK_RANDOM, eubo_beta=_sandwich_eubo)
def _spg(inputs: ObjectiveInputs, *, group_size: int, surrogate: str = "sandwich",
         omega: float = 0.5) -> tuple[Array, Metrics]:
  del group_size
  return spg_loss(surrogate_logp(inputs, surrogate, omega), inputs.advantages,
                  inputs.lengths, sample_mask=inputs.mask)


@register_objective("wd1", normalize="sum",  # d1's mean field, one sample.
                    estimator=dict(method="mean_field", num_samples=1, prompt_mask_prob=0.15,
                                   coupled_ratio=False))
def _wd1(inputs: ObjectiveInputs, *, group_size: int) -> tuple[Array, Metrics]:
  return wd1_loss(inputs.logp, inputs.advantages, group_size,
                  sample_mask=inputs.mask)


@dataclasses.dataclass(frozen=True)
class StableDRLHparams:
  """StableDRL: log c(rho) = clip(log rho, log min_ratio, log max_ratio), unconditionally, then
  self-normalized over each group (or the batch); SPG's sandwich surrogate.

  ``clip_mode='adaptive'`` (ours, not the paper's): ``max_ratio`` is only the starting bound;
  between RL steps ``adapt_log_clip`` moves log hi by ``clip_step`` to keep the clipped fraction
  of the ratios in [clip_target_low, clip_target_high]. The bound lives in the train state
  (``TrainState.log_clip_hi``), so it is checkpointed.
  """

  min_ratio: float = 0.0
  max_ratio: float = 5.0
  normalize_over: str = "group"
  surrogate: str = "sandwich"
  omega: float = 0.5
  eubo_beta: float = 1.5
  clip_mode: str = "fixed"
  clip_target_low: float = 0.02
  clip_target_high: float = 0.10
  clip_step: float = 0.1

  def check(self) -> None:
    if not 0 <= self.min_ratio < self.max_ratio:
      raise ValueError(f"max_ratio: needs 0 <= min_ratio < max_ratio, got {self.min_ratio}, "
                       f"{self.max_ratio}")
    _choice("normalize_over", self.normalize_over, ("group", "batch"))
    _choice("surrogate", self.surrogate, ("elbo", "sandwich"))
    _choice("clip_mode", self.clip_mode, CLIP_MODES)
    _check_sandwich(self)
    if not 0 <= self.clip_target_low < self.clip_target_high <= 1:
      raise ValueError(f"clip_target_high: needs 0 <= clip_target_low < clip_target_high <= 1, "
                       f"got {self.clip_target_low}, {self.clip_target_high}")
    if not 0 < self.clip_step <= 1:
      raise ValueError(f"clip_step: needs 0 < clip_step <= 1 (a change of log hi), got "
                       f"{self.clip_step}")

  def next_log_clip(self, log_hi: Array, clipped_fraction: Array) -> Array:
    """The bound of the next step (``adapt_log_clip`` with these settings; fixed: unchanged)."""
    if self.clip_mode == "fixed":
      return jnp.asarray(log_hi, jnp.float32)
    return adapt_log_clip(log_hi, clipped_fraction, step=self.clip_step,
                          band=(self.clip_target_low, self.clip_target_high))


# StableDRL: SPG's masks and sandwich; l_old once per rollout on independent masks.
@register_objective("stabledrl", hparams=StableDRLHparams, requires=("old_logp",),
                    normalize="mean", estimator=_BLOCK_RANDOM, eubo_beta=_sandwich_eubo,
                    surrogate=lambda inputs, p: surrogate_logp(inputs, p.surrogate, p.omega),
                    variants={"stabledrl": {},
                              "stabledrl_adaptive": {"clip_mode": "adaptive"}},
                    metrics=_RATIO_METRICS + ("snis/ess", "snis/ess_min",
                                              "snis/weight_entropy", "snis/weight_max"))
def _stabledrl(inputs: ObjectiveInputs, *, group_size: int,
               min_ratio: float = 0.0, max_ratio: float = 5.0,
               normalize_over: str = "group", surrogate: str = "sandwich",
               omega: float = 0.5, clip_mode: str = "fixed") -> tuple[Array, Metrics]:
  log_ratio = inputs.logp - inputs.old_logp
  log_max_ratio = None
  if clip_mode == "adaptive":
    if inputs.log_clip_hi is None:
      raise ValueError("clip_mode='adaptive' needs inputs.log_clip_hi (the train state's bound)")
    log_max_ratio = inputs.log_clip_hi
  loss, metrics = stabledrl_loss(surrogate_logp(inputs, surrogate, omega), log_ratio,
                                 inputs.advantages, group_size, min_ratio=min_ratio,
                                 max_ratio=max_ratio, normalize_over=normalize_over,
                                 sample_mask=inputs.mask, log_max_ratio=log_max_ratio)
  if clip_mode == "adaptive":
    metrics["clip/log_hi"] = log_max_ratio
  return loss, metrics
