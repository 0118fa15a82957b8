r"""GRPO as d1 runs it: PPO's conditional clip on importance ratios, a KL term.

    L = -mean_entries min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + beta KL(pi || pi_ref)

with rho = exp(l_theta - l_old), per token (d1) or per sequence, and the k3 KL estimator. For
A < 0 and rho > 1 + eps_high the unclipped branch wins, so the gradient grows with rho without
bound: the failure StableDRL fixes (docs/algorithms.md).

Official code, dllm-reasoning/d1 [837888f]: the clip ``diffu-grpo/diffu_grpo_trainer.py:114-118``
with eps = 0.5 (``diffu-grpo/slurm_scripts/train.yaml:69``); the KL ``:101-105,474``, beta 0.04
(``train.yaml:68``); the loss sums over tokens and divides by the batch's completion tokens
(``:121``); the mean-field estimator with one sample, prompt tokens masked at 0.15, old and
reference log-probs on each inner iteration's own masks (``:241-267,449-478``, ``train.yaml:67``);
advantages r - group mean, no std (``:533-539``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import chex
import jax
import jax.numpy as jnp

from stabledrl_jax.objectives import base

Array = jax.Array

# Clamp for exp() in the k3 KL estimator: exp(20) ~ 5e8 is already far outside any useful KL
# value, and clamping *before* exp keeps the value and its gradient finite.
_MAX_KL_LOG_DIFF = 20.0
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclasses.dataclass(frozen=True)
class GRPOHparams:
  """d1's GRPO: token level (per-token ratios) or sequence level, PPO clip, k3 KL at 0.04."""

  level: str = "token"
  epsilon_low: float = 0.5
  epsilon_high: float = 0.5
  beta: float = 0.04
  kl_estimator: str = "k3"

  def check(self) -> None:
    base.check_choice("level", self.level, ("token", "sequence"))
    base.check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
    # rho is clipped to [1 - epsilon_low, 1 + epsilon_high]: a lower bound below 0 means nothing.
    base.check_range("epsilon_low", self.epsilon_low, 0.0, 1.0)
    base.check_range("epsilon_high", self.epsilon_high, 0.0)
    base.check_range("beta", self.beta, 0.0)


def kl_penalty(logp: Array, ref_logp: Array, estimator: str = GRPOHparams.kl_estimator) -> Array:
  """Per-entry estimate of KL(pi_theta || pi_ref) from samples of pi_theta.

  With ``d = ref_logp - logp``: k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1 (Schulman's
  estimators). ``d`` is clamped before ``exp``.
  """
  diff = ref_logp - logp
  if estimator == "k1":
    return -diff
  if estimator == "k2":
    return 0.5 * jnp.square(diff)
  if estimator == "k3":
    diff = jnp.clip(diff, -_MAX_KL_LOG_DIFF, _MAX_KL_LOG_DIFF)
    return jnp.exp(diff) - diff - 1.0
  raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}.")


def grpo_loss(logp: Array, old_logp: Array, advantages: Array, *,
              epsilon_low: float = GRPOHparams.epsilon_low,
              epsilon_high: float = GRPOHparams.epsilon_high,
              mask: Array | None = None, ref_logp: Array | None = None, beta: float = 0.0,
              kl_estimator: str = GRPOHparams.kl_estimator) -> tuple[Array, base.Metrics]:
  """GRPO's conditionally clipped surrogate, token or sequence level.

  ``loss = -mean(min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)) + beta * mean(KL)``,
  with ``rho = exp(logp - old_logp)``; the mean runs over the batch's valid entries (tokens at
  token level).

  Args:
    logp: [N] (sequence level) or [N, T] (token level) log-likelihoods under pi_theta; carries
      the gradient.
    old_logp: same shape, under pi_old (no gradient).
    advantages: [N] A, broadcast over tokens.
    epsilon_low, epsilon_high: clip range of rho.
    mask: optional bool of ``logp``'s shape, entries that count (padding off).
    ref_logp: optional, same shape, under a frozen reference policy.
    beta: KL coefficient (needs ``ref_logp`` when > 0; 0 here, d1's 0.04 in ``GRPOHparams``).
    kl_estimator: 'k1', 'k2' or 'k3'.

  Returns:
    (loss, metrics), with ``per_sample/weight`` [N]: the coefficient of A_j grad logp_j.
  """
  chex.assert_equal_shape([logp, old_logp])
  chex.assert_rank(advantages, 1)
  if logp.ndim not in (1, 2) or logp.shape[0] != advantages.shape[0]:
    raise ValueError(
        f"logp must be [N] or [N, T] with N = len(advantages) = "
        f"{advantages.shape[0]}, got shape {logp.shape}.")
  if epsilon_low < 0 or epsilon_high < 0:
    raise ValueError(f"Clip epsilons must be >= 0, got {epsilon_low}, {epsilon_high}.")
  if beta and ref_logp is None:
    raise ValueError("beta > 0 needs ref_logp for the KL penalty.")
  valid = base.as_valid(mask, logp.shape)
  logp = logp.astype(jnp.float32)
  adv = jax.lax.stop_gradient(advantages.astype(jnp.float32))
  adv = adv[:, None] if logp.ndim == 2 else adv
  adv = jnp.broadcast_to(adv, logp.shape)
  log_ratio = logp - jax.lax.stop_gradient(old_logp.astype(jnp.float32))
  # Padding entries may hold anything (even inf); zero them before exp so that they cannot
  # poison the gradient through 0 * inf.
  log_ratio = jnp.where(valid, log_ratio, 0.0)
  ratio = jnp.exp(log_ratio)
  unclipped = ratio * adv
  clipped = jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * adv
  per_entry = -jnp.minimum(unclipped, clipped)
  metrics = {}
  if beta:
    kl = kl_penalty(logp, jax.lax.stop_gradient(ref_logp.astype(jnp.float32)), kl_estimator)
    kl = jnp.where(valid, kl, 0.0)
    per_entry = per_entry + beta * kl
    metrics["kl/mean"] = base.masked_mean(kl, valid)
  loss = base.masked_mean(per_entry, valid)
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
      "clip/frac_active": base.masked_mean((clipped < unclipped).astype(jnp.float32), valid),
      **base.ratio_metrics(log_ratio, adv, valid, log_lo=log_lo,
                           log_hi=math.log1p(epsilon_high)),
  })
  return loss, metrics


def estimator_defaults(params: GRPOHparams) -> dict[str, Any]:
  """d1 (token level): one mean-field sample, prompt tokens masked at 0.15, old and reference
  log-probs on each iteration's own masks, token sums. The sequence level scores an ELBO."""
  if params.level == "token":
    return dict(method="mean_field", num_samples=1, prompt_mask_prob=0.15, coupled_ratio=True,
                normalize="sum")
  return dict(method="elbo", num_samples=2, coupled_ratio=True, normalize="sum")


@base.register_objective("grpo", hparams=GRPOHparams, requires=("old_logp",),
                         estimator=estimator_defaults, uses_reference=lambda p: p.beta > 0,
                         token_level=lambda p: p.level == "token",
                         variants={"grpo_token": {"level": "token"},
                                   "grpo_sequence": {"level": "sequence"}},
                         metrics=base.RATIO_METRICS + base.ADVANTAGE_SUM_METRICS)
def loss(inputs: base.ObjectiveInputs, hparams: GRPOHparams,
         group_size: int) -> tuple[Array, base.Metrics]:
  loss_value, metrics = grpo_loss(inputs.logp, inputs.old_logp, inputs.advantages,
                                  epsilon_low=hparams.epsilon_low,
                                  epsilon_high=hparams.epsilon_high, mask=inputs.mask,
                                  ref_logp=inputs.ref_logp, beta=hparams.beta,
                                  kl_estimator=hparams.kl_estimator)
  return loss_value, {**metrics, **coefficient_sums(metrics, inputs, group_size)}


def coefficient_sums(metrics: base.Metrics, inputs: base.ObjectiveInputs,
                     group_size: int) -> base.Metrics:
  """``base.weighted_advantage_sums`` of a PPO-clipped update: each sample's coefficient of
  A_j grad logp_j (rho_j where unclipped, 0 where clipped; ``per_sample/weight``) over G."""
  mask = inputs.mask
  if mask is not None and mask.ndim == 2:  # Token level: a sample counts if a token does.
    mask = jnp.any(mask, axis=-1)
  valid = base.as_valid(mask, inputs.advantages.shape)
  return base.weighted_advantage_sums(metrics["per_sample/weight"] / group_size,
                                      inputs.advantages.astype(jnp.float32), group_size, valid)
