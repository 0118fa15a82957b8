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
from stabledrl_jax.training.config import optimizer as optimizer_lib


# The highest sampling temperature a decoding takes: far above 1 every completion is close to
# uniform noise, and a huge one overflows the logits' scale (rollout.temperature is bounded
# tighter, at 10: ``specs.FLOAT_RANGES``).
MAX_TEMPERATURE = 100.0


def set_options(section: Any) -> dict[str, Any]:
  """The family options a config section sets (``rollout.family_options``): those not None (a
  name every registered family declares is listed, unset, in ``config_lib.base_config``)."""
  return {k: v for k, v in dict(section or {}).items() if v is not None}


def default_steps(gen_length: int, block_length: int) -> int:
  """Denoising steps when none are given: gen_length / 2 (d1's protocol), at least one per
  block."""
  return max(gen_length // 2, gen_length // block_length, 1)


@dataclasses.dataclass(frozen=True)
class Decoding:
  """One decoding setup of the samplers (``models.family.generate``).

  Attributes:
    gen_length: completion tokens G.
    steps: denoising steps over the completion (0: ``default_steps``).
    block_length: LLaDA's semi-autoregressive blocks (SDAR decodes by its model's blocks).
    temperature: 0 for greedy; at most ``MAX_TEMPERATURE``.
    remasking: the family's rule (``rollout.remasking``'s values).
    threshold: tau of the threshold rules.
    cfg_scale: classifier-free guidance (LLaDA only; 0: off).
    stop_at_eos: LLaDA: stop once every row has a stop token, and fill after it with EOS (the
      text up to the first stop token is the same either way).
    cache: block-wise KV caching of LLaDA's sampler ("none": exact, "prefix", "dual";
      ``models/llada/sampler.py``); SDAR's sampler always caches its finished blocks, exactly.
    family_options: (name, value) pairs of the family's own sampler options
      (``rollout.family_options``: Dream's top_p, top_k, alg_temp, eps), sorted by name; a
      None value (unset) is dropped.
  """

  gen_length: int
  steps: int = 0
  block_length: int = 32
  temperature: float = 0.0
  remasking: str = "low_confidence"
  threshold: float = 0.9
  cfg_scale: float = 0.0
  stop_at_eos: bool = False
  cache: str = "none"
  family_options: tuple[tuple[str, Any], ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "family_options", tuple(sorted(
        (k, v) for k, v in dict(self.family_options).items() if v is not None)))
    if not self.steps:
      object.__setattr__(self, "steps", default_steps(self.gen_length, self.block_length))

  @classmethod
  def d1(cls, gen_length: int, *, steps: int = 0, **overrides) -> "Decoding":
    """d1's protocol: steps = gen_length / 2 unless `steps` is given, blocks of 32, greedy."""
    return cls(gen_length, steps, **overrides)

  @classmethod
  def of_eval(cls, config: Any, **overrides) -> "Decoding":
    """The trainer's held-out evaluation decode: ``config.rollout``'s sampler, greedy, at
    ``eval.steps``, exact (no KV cache) unless ``overrides`` say otherwise; its family options
    are the rollout's with ``eval.family_options`` over them."""
    options = {**set_options(config.rollout.get("family_options")),
               **set_options(config.eval.get("family_options"))}
    return cls.of_rollout(config.rollout, temperature=0.0, steps=config.eval.steps,
                          **{"cache": "none", "family_options": tuple(options.items()),
                             **overrides})

  @classmethod
  def of_rollout(cls, rollout: Any, *, temperature: float, steps: int = 0,
                 **overrides) -> "Decoding":
    """The rollout config's sampler settings (``config.rollout``), at ``temperature``."""
    fields = dict(gen_length=rollout.gen_length, steps=steps, block_length=rollout.block_length,
                  temperature=temperature, remasking=rollout.remasking,
                  threshold=rollout.threshold, cache=rollout.get("cache", "none"),
                  family_options=tuple(set_options(rollout.get("family_options")).items()))
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**fields)

  def with_options(self, **overrides) -> "Decoding":
    """These settings with ``overrides`` (remasking, threshold, cache, ...; None: kept)."""
    return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})

  def check(self, model_config: Any) -> None:
    """Raises ValueError (one line) unless the sampler of ``model_config``'s family accepts these
    settings (``Family.sampling``; cheap: nothing compiles, no weight is read), at a
    temperature of at most ``MAX_TEMPERATURE`` (each sampler refuses one below 0)."""
    if self.temperature > MAX_TEMPERATURE:
      raise ValueError(f"temperature: must be at most {MAX_TEMPERATURE:g} (0: greedy; far above 1 "
                       f"the completions are close to uniform noise), got {self.temperature!r}")
    family_lib.of(model_config).sampling(self, model_config)

  def describe(self) -> dict[str, Any]:
    """The settings a generation file records; tau only where the remasking rule uses it."""
    out = dataclasses.asdict(self)
    del out["stop_at_eos"]
    out["family_options"] = dict(self.family_options)
    if not out["family_options"]:  # As files written before family options existed.
      del out["family_options"]
    if "threshold" not in self.remasking and "dynamic" not in self.remasking:
      del out["threshold"]
    if self.cache == "none":  # As files written before caching existed.
      del out["cache"]
    return out


# What the collapse guard does when it acts (``train.collapse_guard.action``).
ACTIONS = ("restore", "stop")


@dataclasses.dataclass(frozen=True)
class Rules:
  """The collapse criteria (the study's defaults)."""

  eval_margin: float = 2.0
  reward_margin: float = 0.02
  window: int = 20
  max_skipped: int = 1


@dataclasses.dataclass(frozen=True)
class GuardSettings:
  """``train.collapse_guard``: off by default.

  Attributes:
    enabled: check the rules after every step.
    action: 'restore' (the best checkpoint by eval, the learning rate times ``lr_factor``, the
      run goes on from there) or 'stop' (the run ends, its last checkpoint kept).
    lr_factor: in (0, 1], what each restore multiplies the learning rate by.
    max_restores: restores allowed (since the last 'go on'); a collapse after them stops the run.
    go_on: a rerun of a run the guard stopped trains on from its last checkpoint (the rules
      then judge the run from there, and the restores are counted afresh); without it the rerun
      says that the guard stopped it and trains nothing.
    rules: the criteria.
  """

  enabled: bool = False
  action: str = "restore"
  lr_factor: float = 0.5
  max_restores: int = 2
  go_on: bool = False
  rules: Rules = Rules()

  @classmethod
  def of(cls, section: Any) -> "GuardSettings":
    """From ``config.train.collapse_guard``; ValueError naming the field for a bad value."""
    where = "config.train.collapse_guard"
    if section is None:
      return cls()
    get = lambda name, default: section.get(name, default)
    action = get("action", cls.action)
    if action not in ACTIONS:
      raise ValueError(f"{where}.action: {action!r} is not one of {ACTIONS}")
    factor = float(get("lr_factor", cls.lr_factor))
    if not 0 < factor <= 1:
      raise ValueError(f"{where}.lr_factor: needs 0 < lr_factor <= 1, got {factor}")
    restores = get("max_restores", cls.max_restores)
    if not isinstance(restores, int) or restores < 0:
      raise ValueError(f"{where}.max_restores: needs an integer >= 0, got {restores!r}")
    rules = Rules(eval_margin=float(get("eval_margin", Rules.eval_margin)),
                  reward_margin=float(get("reward_margin", Rules.reward_margin)),
                  window=get("window", Rules.window), max_skipped=get("max_skipped",
                                                                      Rules.max_skipped))
    for name in ("eval_margin", "reward_margin"):
      if not getattr(rules, name) >= 0:
        raise ValueError(f"{where}.{name}: needs >= 0, got {getattr(rules, name)}")
    for name in ("window", "max_skipped"):
      value = getattr(rules, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}.{name}: needs an integer >= 1, got {value!r}")
    return cls(enabled=bool(get("enabled", cls.enabled)), action=action, lr_factor=factor,
               max_restores=restores, go_on=bool(get("go_on", cls.go_on)), rules=rules)


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
    lora_dropout_every_pass: the same dropout in the rollouts' sampler and the l_old scoring
      (``model.lora.dropout_passes='every'``).
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
  lora_dropout_every_pass: bool = False

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
  sampling: Decoding
  evaluation: Decoding
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
    guard: the collapse guard's settings (``GuardSettings``).
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
  guard: GuardSettings
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
