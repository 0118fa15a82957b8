r"""ESPO: sequence-level PPO on length-normalized ELBO ratios.

    rho = exp((ELBO_theta - ELBO_old) / L)
    L_ESPO = -mean_j min(rho_j A_j, clip(rho_j, 1 - eps, 1 + eps) A_j)
             + beta mean_j (ELBO_theta - ELBO_ref)^2 / (2 L)

with L the generation length and a k2 KL per token. Official code, ML-GSAI/ESPO [b5f2dac]: the
ratio and clip ``espo/espo_trainer.py:191-192`` with eps = 0.2 (``recipes/train.yaml:18``); the
KL ``:199-201``, beta 1e-3 in its GSM8K and MATH scripts (``recipes/run_*_llada.sh:28``); its
ELBO (a count schedule stratified over the batch, the complementary pass, the whole generation
scored) with two samples and masks shared with pi_old and the reference (``:55-75,421-446,
611-640``); leave-one-out advantages (``:694-710``).
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp

from stabledrl_jax.objectives import base, grpo

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class ESPOHparams:
  """ESPO: PPO clip on length-normalized ELBO ratios, a k2 KL (beta 1e-3: its GSM8K and MATH
  scripts)."""

  epsilon: float = 0.2
  beta: float = 1e-3

  def check(self) -> None:
    base.check_range("epsilon", self.epsilon, 0.0, 1.0)  # rho clipped to [1 - eps, 1 + eps].
    base.check_range("beta", self.beta, 0.0)


def espo_loss(elbo: Array, old_elbo: Array, advantages: Array,
              gen_length: int | Array, *, epsilon: float = ESPOHparams.epsilon,
              sample_mask: Array | None = None, ref_elbo: Array | None = None,
              beta: float = 0.0) -> tuple[Array, base.Metrics]:
  """ESPO's loss on sum-form ELBOs.

  Args:
    elbo: [N] sum-form ELBO estimates under pi_theta (gradient).
    old_elbo: [N] under pi_old.
    advantages: [N].
    gen_length: L, the generation length (scalar or [N]).
    epsilon: symmetric clip range.
    sample_mask: optional [N] bool.
    ref_elbo: optional [N] under a reference policy, for the KL penalty.
    beta: KL coefficient (0 here; ESPO's 1e-3 in ``ESPOHparams``).
  """
  chex.assert_rank([elbo, old_elbo, advantages], 1)
  if beta and ref_elbo is None:
    raise ValueError("beta > 0 needs ref_elbo for the KL penalty.")
  inv_length = 1.0 / jnp.asarray(gen_length, jnp.float32)
  loss, metrics = grpo.grpo_loss(elbo * inv_length, old_elbo * inv_length, advantages,
                                 epsilon_low=epsilon, epsilon_high=epsilon, mask=sample_mask)
  if beta:
    valid = base.as_valid(sample_mask, elbo.shape)
    diff = elbo.astype(jnp.float32) - jax.lax.stop_gradient(ref_elbo.astype(jnp.float32))
    kl = base.masked_mean(0.5 * jnp.square(diff) * inv_length, valid)
    loss = loss + beta * kl
    metrics = {**metrics, "loss": loss, "kl/mean": kl}
  return loss, metrics


@base.register_objective(
    "espo", hparams=ESPOHparams, requires=("old_logp",),
    estimator=dict(method="espo_elbo", num_samples=2, coupled_ratio=True, normalize="sum"),
    baseline="leave_one_out", uses_reference=lambda p: p.beta > 0,
    metrics=base.RATIO_METRICS + base.ADVANTAGE_SUM_METRICS)
def loss(inputs: base.ObjectiveInputs, hparams: ESPOHparams,
         group_size: int) -> tuple[Array, base.Metrics]:
  if inputs.gen_length is None:
    raise ValueError("ESPO needs inputs.gen_length (the generation length L)")
  loss_value, metrics = espo_loss(inputs.logp, inputs.old_logp, inputs.advantages,
                                  inputs.gen_length, epsilon=hparams.epsilon,
                                  sample_mask=inputs.mask, ref_elbo=inputs.ref_logp,
                                  beta=hparams.beta)
  return loss_value, {**metrics, **grpo.coefficient_sums(metrics, inputs, group_size)}
