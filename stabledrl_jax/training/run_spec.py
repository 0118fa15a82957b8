"""The resolved specs of one RL run, derived from the config once and then passed whole:
``RunSpec``, what the update and the scoring take (``specs.resolve_run``); ``RolloutSpec``, what
the rollouts and the held-out evaluation take (``specs.resolve_rollout``); ``LoopSpec``, the
loop's counts and cadences; ``DataSpec``, the task and its reward; ``Resolved``, the whole run's
record (``specs.resolve``: every check, then the model config, these specs, the collapse guard's
settings, the optimizer and the mesh shape), which the trainer, the planner and the compiles
take.

All are frozen and hashable (no arrays), so the jitted update compiles for their values and is
memoized on them; nothing downstream of them reads the config again. This module imports no
config code: the update step and the rollout collector depend on it alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optax

from stabledrl_jax import estimators, objectives
from stabledrl_jax.models import family as family_lib
from stabledrl_jax.training import collapse, decoding, optimizer as optimizer_lib


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
class LoopSpec:
  """The training loop's counts and cadences (``train``, ``eval``, ``checkpoint``,
  ``logging``, ``diagnostics`` and ``seed`` of the config).

  Attributes:
    num_steps: RL steps of the run.
    num_iterations: optimizer updates per RL step (mu).
    seed: the run's seed (the PRNG key, the data order, a fresh model's parameters).
    eval_every_steps: held-out evaluation every N RL steps and at the end (0: never).
    eval_batch_size: prompts per evaluation batch.
    checkpoint_every_steps: a checkpoint every N RL steps and at the end.
    checkpoint_every_seconds: also once this long has passed since the last one (0: off).
    max_to_keep: checkpoints kept.
    samples_every_steps: ``num_samples`` rollouts logged every N RL steps (0: never).
    num_samples: rollouts logged each time.
    max_consecutive_skips: non-finite updates in a row that stop the run.
    kl_to_start: log kl_start/mean (two more scoring passes a step).
    stop_grace_s: how long a SIGTERM waits for the step boundary (0: however long).
    spike_factor, spike_window, spike_min_history: the spike recorder's rule.
    peak_tflops_per_device: for perf/mfu (0: known device kinds).
  """

  num_steps: int
  num_iterations: int
  seed: int
  eval_every_steps: int = 0
  eval_batch_size: int = 64
  checkpoint_every_steps: int = 100
  checkpoint_every_seconds: float = 0.0
  max_to_keep: int = 3
  samples_every_steps: int = 0
  num_samples: int = 0
  max_consecutive_skips: int = 10
  kl_to_start: bool = False
  stop_grace_s: float = 60.0
  spike_factor: float = 10.0
  spike_window: int = 20
  spike_min_history: int = 5
  peak_tflops_per_device: float = 0.0

  def eval_due(self, done: int) -> bool:
    """Whether the loop evaluates after ``done`` RL steps."""
    every = self.eval_every_steps
    return bool(every) and (done % every == 0 or done == self.num_steps)

  def samples_due(self, step: int) -> int:
    """How many rollouts RL step ``step`` (0-based) logs on process 0."""
    every = self.samples_every_steps
    return self.num_samples if every and (step + 1) % every == 0 else 0


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """The task and its reward (``task`` of the config).

  Attributes:
    task: the registered task's name (``tasks.get_task``).
    reward: the reward scheme (``tasks.REWARD_SCHEMES``).
    reward_workers: processes scoring completions (0: in this process).
    reward_timeout_s: seconds one completion's scoring may take (then reward 0).
  """

  task: str
  reward: str
  reward_workers: int = 0
  reward_timeout_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Resolved:
  """One run's config resolved once (``specs.resolve``), every check passed.

  Attributes:
    model: the model's config (its family's frozen dataclass; a checkpoint's once loaded:
      ``with_model``).
    run: what the update and the scoring take.
    rollout: what the rollouts and the held-out evaluation take.
    loop: the loop's counts and cadences.
    data: the task and its reward.
    guard: the collapse guard's settings (``collapse.GuardSettings``).
    family: the model family's name (``family_record``: its registration).
    optimizer: the optimizer (``tx``) and its schedule, at the guard's learning-rate scale
      (``with_lr_scale``).
    mesh_shape: ((axis, size), ...) of the mesh over the devices it was resolved for, -1 axes
      filled in (``mesh.mesh_shape``); None where no device count was given.
  """

  model: Any
  run: RunSpec
  rollout: RolloutSpec
  loop: LoopSpec
  data: DataSpec
  guard: collapse.GuardSettings
  family: str
  optimizer: optimizer_lib.OptimizerSpec
  mesh_shape: tuple[tuple[str, int], ...] | None

  @property
  def family_record(self) -> family_lib.Family:
    """The model family's registration (``models.family``)."""
    return family_lib.get(self.family)

  @property
  def num_updates(self) -> int:
    """Optimizer updates of the run, loop.num_steps x loop.num_iterations."""
    return self.optimizer.num_updates

  @property
  def tx(self) -> optax.GradientTransformation:
    """The optimizer (``optimizer.OptimizerSpec.tx``)."""
    return self.optimizer.tx

  @property
  def schedule(self) -> optax.Schedule:
    """Its learning rate per update."""
    return self.optimizer.lr_schedule

  @property
  def data_ways(self) -> int | None:
    """Devices a batch's rows split over (data x fsdp); None without a mesh shape."""
    if self.mesh_shape is None:
      return None
    sizes = dict(self.mesh_shape)
    return sizes["data"] * sizes["fsdp"]

  def with_model(self, model: Any) -> Resolved:
    """This run for the model config ``model`` (a loaded checkpoint's, or the fresh model's
    with the tokenizer's vocabulary): the likelihood's mask id and block layout follow it.
    ValueError if ``model`` is not of this run's family."""
    family = family_lib.of(model)
    if family.name != self.family:
      raise ValueError(f"config.model.family: {self.family!r}, but the model is a "
                       f"{family.name} model")
    block_size = family.block_size(model)
    likelihood = dataclasses.replace(
        self.run.likelihood, mask_id=model.mask_token_id, block_size=block_size,
        scored_suffix=self.run.gen_length if block_size is None else None)
    return dataclasses.replace(self, model=model,
                               run=dataclasses.replace(self.run, likelihood=likelihood))

  def with_lr_scale(self, scale: float) -> Resolved:
    """This run with the learning rate at ``scale`` x the configured one (the collapse guard's
    restores): the same optimizer state layout."""
    return dataclasses.replace(self, optimizer=self.optimizer.scaled(scale))
