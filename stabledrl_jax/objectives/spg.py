r"""SPG, the sandwiched policy gradient: no importance ratio, a bound on each side.

    s_j = ELBO_j                                        if A_j > 0
          omega EUBO_beta,j + (1 - omega) ELBO_j        otherwise
    L_SPG = -sum_j A_j s_j len_j / sum_k len_k

Raising a lower bound raises the likelihood; pushing a likelihood down pushes an upper bound
down too. Official code, facebookresearch/SPG [a1c7120]: the loss ``spg/spg_trainer.py:116-124``;
the sandwich with omega 0.5 and EUBO beta 1.5 (sudoku 1.0) ``:533-556``,
``spg/slurm_scripts/spg_mix/*.sbatch:49-51``; ``block_random`` masks, two samples, 32-token blocks,
the prompt and earlier blocks masked at 0.15, fresh masks per update ``:334-378``,
``spg_mix/*.sbatch:40-43``. StableDRL reuses the sandwich and the masks (``stabledrl.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import chex
import jax
import jax.numpy as jnp

from stabledrl_jax.objectives import base

Array = jax.Array
SURROGATES = ("elbo", "sandwich")
# SPG's and StableDRL's likelihoods: block_random masks, two samples, the prompt and earlier
# blocks masked at 0.15, per-token means.
BLOCK_RANDOM = dict(method="block_random", num_samples=2, prompt_mask_prob=0.15,
                    coupled_ratio=False, normalize="mean")


@dataclasses.dataclass(frozen=True)
class SPGHparams:
  """SPG: the ELBO for positive advantages, omega EUBO_beta + (1 - omega) ELBO otherwise."""

  surrogate: str = "sandwich"
  omega: float = 0.5
  eubo_beta: float = 1.5

  def check(self) -> None:
    base.check_choice("surrogate", self.surrogate, SURROGATES)
    check_sandwich(self)


def check_sandwich(params: Any) -> None:
  """The sandwich's fields: omega mixes EUBO and ELBO; eubo_beta is the Renyi order
  (``estimators.eubo_from_samples``)."""
  base.check_range("omega", params.omega, 0.0, 1.0)
  base.check_range("eubo_beta", params.eubo_beta, 0.0, low_open=True)


def sandwich_eubo(params: Any) -> float | None:
  """The EUBO_beta the likelihood pass computes for ``params.surrogate`` (None: no EUBO)."""
  return float(params.eubo_beta) if params.surrogate == "sandwich" else None


def spg_surrogate(elbo: Array, eubo: Array, advantages: Array, *,
                  omega: float = SPGHparams.omega) -> Array:
  """SPG's sandwiched surrogate s_j: the ELBO for A_j > 0, else ``omega EUBO + (1 - omega) ELBO``.

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


def surrogate_logp(inputs: base.ObjectiveInputs, surrogate: str,
                   omega: float = SPGHparams.omega) -> Array:
  """[N] s_j, the surrogate log-likelihood that carries StableDRL's and SPG's gradient.

  ``'elbo'``: the estimate itself; ``'sandwich'``: SPG's ELBO / EUBO_beta mix.
  """
  if surrogate == "elbo":
    return inputs.logp
  if surrogate == "sandwich":
    if inputs.eubo is None:
      raise ValueError("surrogate='sandwich' needs inputs.eubo.")
    return spg_surrogate(inputs.logp, inputs.eubo, inputs.advantages, omega=omega)
  raise ValueError(f"surrogate must be one of {SURROGATES}, got {surrogate!r}.")


def spg_loss(logp: Array, advantages: Array, lengths: Array, *,
             sample_mask: Array | None = None) -> tuple[Array, base.Metrics]:
  """SPG: ``-sum_j A_j * s_j * len_j / sum_k len_k`` (no importance ratio).

  Args:
    logp: [N] per-token-mean surrogate s_j (gradient).
    advantages: [N].
    lengths: [N] number of scored completion tokens of each sample.
    sample_mask: optional [N] bool.
  """
  chex.assert_rank([logp, advantages, lengths], 1)
  chex.assert_equal_shape([logp, advantages, lengths])
  valid = base.as_valid(sample_mask, logp.shape)
  lengths = jnp.where(valid, lengths.astype(jnp.float32), 0.0)
  adv = jax.lax.stop_gradient(advantages.astype(jnp.float32))
  loss = -jnp.sum(adv * logp.astype(jnp.float32) * lengths) / jnp.maximum(
      jnp.sum(lengths), 1.0)
  return loss, {"loss": loss, "surrogate/mean": base.masked_mean(logp, valid)}


@base.register_objective("spg", hparams=SPGHparams, requires=("lengths",),
                         estimator=BLOCK_RANDOM, eubo_beta=sandwich_eubo,
                         metrics=base.ADVANTAGE_SUM_METRICS)
def loss(inputs: base.ObjectiveInputs, hparams: SPGHparams,
         group_size: int) -> tuple[Array, base.Metrics]:
  loss_value, metrics = spg_loss(surrogate_logp(inputs, hparams.surrogate, hparams.omega),
                                 inputs.advantages, inputs.lengths, sample_mask=inputs.mask)
  # No importance weights: the weighted advantage sums are 0 by construction.
  return loss_value, {**metrics, **base.weighted_advantage_sums(
      None, inputs.advantages, group_size, base.as_valid(inputs.mask, inputs.advantages.shape))}
