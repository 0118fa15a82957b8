"""The resolved specs of one RL run, derived from the config once and then passed whole:
``RunSpec``, what the update and the scoring take (``specs.resolve_run``); ``RolloutSpec``, what
the rollouts and the held-out evaluation take (``specs.resolve_rollout``); ``Resolved``, the
whole run's record (``specs.resolve``: every check, then the model config, both specs, the mesh
shape and the optimizer's schedule), which the trainer, the planner and the compiles take.

Both are frozen and hashable (no arrays), so the jitted update compiles for their values; nothing
downstream of them reads the config again. This module imports no config code: the update step
and the rollout collector depend on it alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optax

from stabledrl_jax import estimators, objectives
from stabledrl_jax.training import decoding


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


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
  """What one RL run's rollouts and held-out evaluation need, static.

  Attributes:
    num_prompts: prompts drawn per step; each gives ``group_size`` rollouts.
    group_size: G, completions per prompt.
    prompt_length: P, prompts left-padded to it (None: the longest prompt of the batch).
    with_instruction: the task's instruction goes before each question.
    prompt_style: how a prompt is written (``data.format_prompt``).
    sampling: the rollout sampler's settings (``rollout.*``, at its temperature and steps).
    evaluation: the held-out evaluation's: the rollout sampler, greedy, at ``eval.steps``, exact.
    chunk_rows: rows per sampler call of a rollout batch (``rollout.microbatch_groups`` x G; 0:
      all at once).
    stress_fraction: the stress test's share of "hard" rows (``estimator.stress.fraction``; 0:
      off).
  """

  num_prompts: int
  group_size: int
  prompt_length: int | None
  with_instruction: bool
  prompt_style: str
  sampling: decoding.Decoding
  evaluation: decoding.Decoding
  chunk_rows: int = 0
  stress_fraction: float = 0.0

  @property
  def gen_length(self) -> int:
    """G tokens of completion per rollout."""
    return self.sampling.gen_length

  @property
  def num_rows(self) -> int:
    """Rollouts per step, over every process: num_prompts x group_size."""
    return self.num_prompts * self.group_size


@dataclasses.dataclass(frozen=True)
class Resolved:
  """One run's config resolved once (``specs.resolve``), every check passed.

  Attributes:
    model: the model's config (its family's frozen dataclass; a checkpoint's once loaded).
    run: what the update and the scoring take.
    rollout: what the rollouts and the held-out evaluation take.
    mesh_shape: ((axis, size), ...) of the mesh over the devices it was resolved for, -1 axes
      filled in (``mesh.mesh_shape``); None where no device count was given.
    num_updates: optimizer updates of the run, train.num_steps x train.num_iterations, over
      which ``schedule`` runs.
    tx: the optimizer (``optimizer.make_optimizer``).
    schedule: its learning rate per update.
  """

  model: Any
  run: RunSpec
  rollout: RolloutSpec
  mesh_shape: tuple[tuple[str, int], ...] | None
  num_updates: int
  tx: optax.GradientTransformation
  schedule: optax.Schedule

  @property
  def data_ways(self) -> int | None:
    """Devices a batch's rows split over (data x fsdp); None without a mesh shape."""
    if self.mesh_shape is None:
      return None
    sizes = dict(self.mesh_shape)
    return sizes["data"] * sizes["fsdp"]
