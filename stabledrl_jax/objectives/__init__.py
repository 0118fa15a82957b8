"""The policy-gradient objectives, one module each, and the registry the trainer consults.

========================  ==================================================================
module                    holds
========================  ==================================================================
``base``                  ``ObjectiveInputs``, the ``Objective`` record, the registry, checks
                          and array helpers every objective shares
``advantages``            ``group_advantages`` (group mean or ESPO's leave-one-out baseline)
``stabledrl``             StableDRL: unconditional clip, SNIS weights, the adaptive clip state
``grpo``                  GRPO as d1 runs it (token or sequence level, k3 KL)
``espo``                  ESPO: PPO clip on length-normalized ELBO ratios
``spg``                   SPG: the sandwiched surrogate (StableDRL's too), no ratio
``wd1``                   wd1: advantage-softmax weighted likelihoods, no ratio
========================  ==================================================================

Each objective module opens with its equation and its official source lines, and holds the only
copy of its defaults (its frozen hyperparameter dataclass), its loss
``loss(inputs, hparams, group_size) -> (loss, metrics)`` (a pure function of arrays), its
estimator defaults and, if it has state, ``init_state`` / ``update_state`` (optax-shaped, jitted;
the state lives in ``TrainState.objective_state``). One ``base.register_objective`` call carries
all of it.

To add an objective, write one module like these (anywhere, imported before training) with one
``register_objective`` call; no other file changes (docs/algorithms.md, "Adding an objective").
"""

from stabledrl_jax.objectives import advantages, base, espo, grpo, spg, stabledrl, wd1
from stabledrl_jax.objectives.advantages import group_advantages
from stabledrl_jax.objectives.base import (ADVANTAGE_BASELINES, NoHyperparameters, Objective,
                                           ObjectiveInputs, get_objective, objective_names,
                                           objectives, register_objective, unregister_objective)

__all__ = [
    "ADVANTAGE_BASELINES", "NoHyperparameters", "Objective", "ObjectiveInputs", "advantages",
    "base", "espo", "get_objective", "group_advantages", "grpo", "objective_names", "objectives",
    "register_objective", "spg", "stabledrl", "unregister_objective", "wd1",
]
