"""The resolved spec of one RL run: what the update and the scoring take from the config,
derived once (``specs.resolve_run``) and then passed whole.

A ``RunSpec`` is frozen and hashable (no arrays), so the jitted update compiles for its values;
nothing downstream reads the config again. It imports no config code: the update step depends on
it alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from stabledrl_jax import estimators, objectives


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """What one RL run's update and scoring need, static.

  Attributes:
    objective: the registered objective's name (``objectives.get_objective``).
    hparams: its hyperparameters (its frozen dataclass, defaults and config overrides).
    likelihood: how the likelihoods are estimated (``estimators.LikelihoodSpec``).
    group_size: G, completions per prompt.
    gen_length: L, the generation length.
    num_microbatches: gradient-accumulation microbatches per update (whole groups each).
    coupled_ratio: l_old and l_ref on each update's own masks (d1, ESPO); else once per rollout
      on masks of their own (StableDRL, SPG).
    uses_reference: the objective has a KL term against the frozen start of RL.
    baseline: the advantage baseline (``objectives.ADVANTAGE_BASELINES``).
    scale_advantages_by_std: divide the advantages by the group's reward std.
    gradient_bound: log StableDRL's convex-hull bound per update (per-sample gradients).
    lora: only the LoRA adapters train (``models.lora``); the base is frozen and, with the
      adapters off, the reference policy.
    lora_dropout: LoRA dropout of the differentiated forward pass (``lora.with_dropout``).
  """

  objective: str
  hparams: Any
  likelihood: estimators.LikelihoodSpec
  group_size: int
  gen_length: int
  num_microbatches: int = 1
  coupled_ratio: bool = False
  uses_reference: bool = False
  baseline: str = "group_mean"
  scale_advantages_by_std: bool = False
  gradient_bound: bool = False
  lora: bool = False
  lora_dropout: float = 0.0

  @property
  def registered(self) -> objectives.Objective:
    """The objective's registration."""
    return objectives.get_objective(self.objective)

  @property
  def needs_old(self) -> bool:
    """Whether the objective has an importance ratio (scores l_old before the updates)."""
    return "old_logp" in self.registered.requires

  def initial_state(self) -> Any:
    """The objective's state at the start of a run ({} when it has none)."""
    return self.registered.initial_state(self.hparams)
