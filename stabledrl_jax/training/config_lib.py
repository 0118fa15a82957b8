"""Experiment configs: the full default tree, validation, and what the step needs from it.

Config files (``configs/*.py``) start from ``base_config()`` and override
fields; every field exists in every config, so ``--config.a.b=value`` works
for all of them. ``validate`` runs before anything is compiled and names the
offending field.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import pathlib
from typing import Any

import ml_collections
from ml_collections import config_dict

from stabledrl_jax import estimators, losses, tasks
from stabledrl_jax.training import model_family, rl_loss

# Estimator fields that, left unset (None or ''), take the objective's official value
# (``losses.Objective.estimator``); ``block_length`` falls back to this.
_ESTIMATOR_FIELDS = ("method", "num_samples", "normalize", "coupled_ratio", "block_length",
                     "prompt_mask_prob", "schedule", "coupled")
_DEFAULT_BLOCK_LENGTH = 32
# The estimator settings that belong to the objective whatever the method (the rest are options
# of the official method's mask sampler).
_OBJECTIVE_ESTIMATOR_FIELDS = ("num_samples", "normalize", "coupled_ratio")


def base_config() -> ml_collections.ConfigDict:
  """Every field, with the paper-scale defaults (docs/training.md, "Configs") where they apply."""
  c = ml_collections.ConfigDict()
  c.seed = 113

  c.model = ml_collections.ConfigDict(dict(
      family="llada",  # llada (full-attention masked diffusion) | sdar (block diffusion)
      # A config of the family: llada: tiny | small | llada_8b (models.get_config);
      # sdar: tiny | small | sdar_1_7b | sdar_4b | sdar_8b (models.get_sdar_config).
      name="tiny",
      checkpoint="",  # Hugging Face checkpoint directory; '' = random init (or the SFT start)
      # Fields of the family's config (ModelConfig / SDARConfig); the shapes both have may use
      # either family's name (d_model or hidden_size, ...: training/model_family.py).
      overrides=ml_collections.ConfigDict(),
      dtype="float32",  # compute dtype of activations
      param_dtype="float32",
      remat=False,
      # Run the layers as a lax.scan over their stacked parameters (models/scan.py: with FSDP,
      # one layer's kernels gathered and one layer's gradients reduced at a time).
      scan_layers=False,
  ))
  c.tokenizer = ml_collections.ConfigDict(dict(kind="char", alphabet="", path=""))
  # reward: the scheme (tasks.REWARD_SCHEMES): 'stabledrl' (the official StableDRL code's: its
  # correctness rewards plus anti_short_boxed) or 'd1' (correctness plus format terms).
  # reward_workers: processes that score rollouts in parallel (0: in this process; math-verify
  # can take 0.2 s an answer), each answer bounded by reward_timeout_s (past it: reward 0).
  c.task = ml_collections.ConfigDict(dict(name="sudoku", with_instruction=False,
                                          reward="stabledrl", reward_workers=0,
                                          reward_timeout_s=10.0))
  c.data = ml_collections.ConfigDict(dict(
      train="synthetic", eval="synthetic", train_size=20_000, eval_size=256,
      generator=ml_collections.ConfigDict()))

  # steps: denoising steps over the whole completion. block_length: LLaDA's semi-autoregressive
  # blocks; SDAR decodes by its model's block_size (prompt_length and gen_length multiples of it)
  # and ignores it. remasking: llada: low_confidence | random (`steps` on an even schedule) |
  # threshold (every position above `threshold`, at least one per call; `steps` unused);
  # sdar: low_confidence (= static) | low_confidence_static | low_confidence_dynamic (every
  # position above `threshold`, or the static count if fewer pass).
  c.rollout = ml_collections.ConfigDict(dict(
      num_prompts=32, group_size=16, prompt_length=64, gen_length=256, steps=128,
      block_length=32, temperature=0.9, remasking="low_confidence", threshold=0.9))

  # Each objective's hyperparameters default to its official code's (docs/algorithms.md lists
  # them with their sources). advantage_baseline: '' = the objective's own (group_mean, or ESPO's
  # leave_one_out). A KL term (grpo/espo beta > 0) keeps a frozen copy of the start of RL.
  c.objective = ml_collections.ConfigDict(dict(
      name="stabledrl",
      scale_advantages_by_std=False,
      advantage_baseline="",
      stabledrl=ml_collections.ConfigDict(dict(
          min_ratio=0.0, max_ratio=5.0, normalize_over="group", surrogate="sandwich",
          omega=0.5, eubo_beta=1.5)),
      grpo=ml_collections.ConfigDict(dict(
          level="token", epsilon_low=0.5, epsilon_high=0.5, beta=0.04, kl_estimator="k3")),
      espo=ml_collections.ConfigDict(dict(epsilon=0.2, beta=1e-3)),
      spg=ml_collections.ConfigDict(dict(surrogate="sandwich", omega=0.5, eubo_beta=1.5)),
      wd1=ml_collections.ConfigDict(),
  ))
  # Every field left unset (None, or '') takes the value of the objective's official code
  # (``estimator_settings``): method (a name of estimators.MASK_SAMPLERS), num_samples (K),
  # normalize ('sum' | 'mean'), coupled_ratio (l_old on each update's own masks, as d1 and ESPO;
  # else once per rollout on independent masks, as StableDRL) and the mask sampler's options.
  # For SDAR the methods are block estimators (rl_loss's docstring): elbo and block_random the
  # block ELBO, mean_field whole blocks masked; block_length, prompt_mask_prob and schedule
  # do not apply.
  c.estimator = ml_collections.ConfigDict(dict(
      method="",
      num_samples=config_dict.placeholder(int),
      normalize="",
      coupled_ratio=config_dict.placeholder(bool),
      block_length=config_dict.placeholder(int),
      prompt_mask_prob=config_dict.placeholder(float),
      schedule="",
      coupled=config_dict.placeholder(bool),
      # Stress test (docs/stress_test.md): in this fraction of the samples (0: off), l_theta uses
      # "easy" masks (the last ceil(easy_rate * L) completion tokens, t_min) and l_old "hard"
      # ones (the first ceil(hard_rate * L), t_max), so that log rho explodes.
      stress=ml_collections.ConfigDict(dict(fraction=0.0, easy_rate=0.1, hard_rate=1.0))))

  c.optimizer = ml_collections.ConfigDict(dict(
      learning_rate=1e-6, schedule="linear", warmup_steps=0, end_lr_factor=0.0,
      b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1, grad_clip=0.2))
  # num_steps counts RL steps (rollout batches); each makes num_iterations optimizer updates,
  # over which the learning-rate schedule runs (num_steps * num_iterations in all).
  c.train = ml_collections.ConfigDict(dict(
      num_steps=1000, num_iterations=2, microbatch_groups=0,  # 0: the whole batch at once
      max_consecutive_skips=10,
      # Log StableDRL's convex-hull bound max_j |A_j| ||grad s_j|| per update (per-sample
      # gradients: memory grows as batch x parameters, so for small models).
      gradient_bound=False,
      # A persistent XLA compilation cache (local or gs://; '' off): restarts skip compiling.
      compilation_cache_dir=""))
  c.eval = ml_collections.ConfigDict(dict(every_steps=100, batch_size=64, steps=0))  # 0: gen/2
  # A checkpoint every `every_steps` RL steps, and also once `every_seconds` have passed since
  # the last one (0: off); SIGTERM (preemption) saves at the next step boundary.
  c.checkpoint = ml_collections.ConfigDict(dict(every_steps=100, every_seconds=0.0,
                                                max_to_keep=3))
  # Global axis sizes (training/mesh.py); dcn_data: how many slices the data axis spans.
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, dcn_data=1))
  c.sft = ml_collections.ConfigDict(dict(
      num_steps=0, batch_size=64, learning_rate=1e-3,
      demo_error_rate=0.0, demo_error_cells=1))  # an imperfect demonstrator (data.py)
  return c


def from_file(path: str | os.PathLike[str]) -> ml_collections.ConfigDict:
  """``get_config()`` of a config file (e.g. to build one config file on another)."""
  spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
  if spec is None or not os.path.isfile(path):
    raise FileNotFoundError(f"no config file at {str(path)!r}")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _paper_setting(task: str, learning_rate: float) -> ml_collections.ConfigDict:
  """The paper's RL setting (docs/training.md, "Configs") for ``task``, before the model is chosen."""
  c = base_config()  # seed 113, StableDRL with the SPG sandwich, ratio clip 5, no KL.
  # 512 answers a step, scored by 8 worker processes per host (math-verify is slow).
  c.task.update(name=task, with_instruction=True, reward_workers=8)
  c.data.update(train="hub", eval="hub", train_size=0, eval_size=0)
  c.rollout.update(num_prompts=32, group_size=16, prompt_length=256, gen_length=256,
                   temperature=0.9)
  c.optimizer.update(learning_rate=learning_rate, schedule="linear", grad_clip=0.2,
                     weight_decay=0.1)
  # 2000 optimizer updates with linear decay over them (the official total_steps counts
  # updates): 1000 rollout batches at mu = 2.
  c.train.update(num_steps=1000, num_iterations=2, microbatch_groups=1)
  c.eval.update(every_steps=100, batch_size=64, steps=0)
  # Also every 30 minutes: a preempted VM that misses its SIGTERM loses at most that.
  c.checkpoint.update(every_steps=50, every_seconds=1800.0, max_to_keep=3)
  c.mesh.update(data=1, fsdp=-1, tensor=1)
  return c


def llada8b_config(task: str, learning_rate: float) -> ml_collections.ConfigDict:
  """The paper's LLaDA-8B-Instruct setting (docs/training.md, "Configs") for ``task``.

  Point ``model.checkpoint`` and ``tokenizer.path`` at the released files.
  """
  c = _paper_setting(task, learning_rate)
  # bfloat16 compute on float32 master weights (and AdamW moments): in bfloat16 an update of
  # lr 2e-6 on a weight of size 0.02 rounds away.
  c.model.update(name="llada_8b", checkpoint="/path/to/LLaDA-8B-Instruct", dtype="bfloat16",
                 param_dtype="float32", remat=True, scan_layers=True)
  c.tokenizer.update(kind="llada", path="/path/to/LLaDA-8B-Instruct/tokenizer.json")
  c.rollout.update(steps=128, block_length=32)
  return c


def sdar8b_config(task: str, learning_rate: float) -> ml_collections.ConfigDict:
  """The paper's RL setting on SDAR-8B-Chat (block diffusion, block size 4) for ``task``.

  The same RL hyperparameters as ``llada8b_config``; rollouts decode SDAR's way (its
  ``generate.py`` defaults): blocks of the model's size, at most one step per token (256 over
  the 256-token completion, 4 per block), revealing every position whose confidence passes
  0.9 (``low_confidence_dynamic``). ``block_random`` becomes the block ELBO (``rl_loss``).
  Point ``model.checkpoint`` and ``tokenizer.path`` at the released files.
  """
  c = _paper_setting(task, learning_rate)
  c.model.update(family="sdar", name="sdar_8b", checkpoint="/path/to/SDAR-8B-Chat",
                 dtype="bfloat16", param_dtype="float32", remat=True, scan_layers=True)
  c.tokenizer.update(kind="sdar", path="/path/to/SDAR-8B-Chat/tokenizer.json")
  c.rollout.update(steps=256, block_length=4, remasking="low_confidence_dynamic",
                   threshold=0.9)
  return c


def _require(condition: bool, field: str, message: str) -> None:
  if not condition:
    raise ValueError(f"config.{field}: {message}")


def objective_level(config: ml_collections.ConfigDict) -> str | None:
  return config.objective.grpo.level if config.objective.name == "grpo" else None


def _objective_section(config: ml_collections.ConfigDict) -> dict[str, Any]:
  return dict(config.objective.get(config.objective.name, {}))


def estimator_settings(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The estimator fields, each unset one (None or '') filled in from the objective's official
  settings (``losses.Objective.estimator``), then from the estimator's own defaults."""
  objective = losses.get_objective(config.objective.name)
  settings = {"normalize": objective.normalize, "block_length": _DEFAULT_BLOCK_LENGTH,
              "coupled_ratio": False, "num_samples": 1}
  official = objective.estimator(_objective_section(config))
  if config.estimator.method and config.estimator.method != official["method"]:
    # Another method than the official one: its options keep their own defaults.
    official = {k: v for k, v in official.items() if k in _OBJECTIVE_ESTIMATOR_FIELDS}
  settings.update(official)
  for field in _ESTIMATOR_FIELDS:
    value = config.estimator.get(field)
    if value is not None and value != "":
      settings[field] = value
  return settings


def estimator_method(config: ml_collections.ConfigDict) -> str:
  return estimator_settings(config)["method"]


def sampler_options(method: str) -> tuple[str, ...]:
  """The keyword options of ``method``'s mask sampler (estimators.MASK_SAMPLERS)."""
  params = inspect.signature(estimators.MASK_SAMPLERS[method]).parameters.values()
  return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def uses_reference(config: ml_collections.ConfigDict) -> bool:
  """Whether the objective, with these hyperparameters, needs a frozen reference policy."""
  return losses.get_objective(config.objective.name).uses_reference(_objective_section(config))


def advantage_baseline(config: ml_collections.ConfigDict) -> str:
  return (config.objective.advantage_baseline
          or losses.get_objective(config.objective.name).baseline)


def check_block_layout(config: ml_collections.ConfigDict, block_size: int) -> None:
  """A block diffusion model's rollouts fit its blocks, which are fixed by absolute position.

  The left-padded prompt and the completion must fill whole blocks (so that the sampler and the
  block estimators see the same blocks, and no block mixes prompt and completion), and
  ``rollout.steps`` must split evenly over the completion's blocks.
  """
  r = config.rollout
  for field in ("prompt_length", "gen_length"):
    _require(r[field] % block_size == 0, f"rollout.{field}",
             f"{r[field]} is not a multiple of the model's block_size={block_size} (SDAR blocks "
             f"are fixed by absolute position: prompt and completion must fill whole blocks)")
  num_blocks = r.gen_length // block_size
  _require(r.steps % num_blocks == 0, "rollout.steps",
           f"{r.steps} is not a multiple of the number of completion blocks ({num_blocks} of "
           f"the model's block_size={block_size})")


def _validate_model(config: ml_collections.ConfigDict) -> tuple[model_family.Family, int | None]:
  """model.family, model.name and model.overrides; returns the family and its block size.

  The block size is None for full attention, and for a checkpoint (known once it is loaded).
  """
  family = model_family.get(config.model.family)
  model_family.resolve_overrides(family, dict(config.model.overrides))
  if config.model.checkpoint:
    return family, None
  _require(config.model.name in family.config_names, "model.name",
           f"{config.model.name!r} is not a {family.name} config; choose from "
           f"{family.config_names} (or set model.family)")
  return family, model_family.named_block_size(config)


def validate(config: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
  """Raises ValueError naming the first bad field. Cheap: nothing is built or compiled."""
  name = config.objective.name
  _require(name in losses.objective_names(), "objective.name",
           f"{name!r} is not one of {losses.objective_names()}")
  family, block_size = _validate_model(config)
  r = config.rollout
  for field in ("num_prompts", "group_size", "prompt_length", "gen_length", "steps",
                "block_length"):
    _require(isinstance(r[field], int) and r[field] > 0, f"rollout.{field}",
             f"must be a positive integer, got {r[field]!r}")
  if family.name == "llada":  # Semi-autoregressive blocks of the completion.
    _require(r.gen_length % r.block_length == 0, "rollout.gen_length",
             f"{r.gen_length} is not a multiple of rollout.block_length={r.block_length}")
    num_blocks = r.gen_length // r.block_length
    _require(r.steps % num_blocks == 0, "rollout.steps",
             f"{r.steps} is not a multiple of the number of blocks ({num_blocks})")
  elif block_size is not None:  # A checkpoint's is checked when it is loaded.
    check_block_layout(config, block_size)
  _require(r.temperature >= 0, "rollout.temperature", f"must be >= 0, got {r.temperature}")
  _require(r.remasking in family.remasking, "rollout.remasking",
           f"{r.remasking!r} is not one of {family.remasking} (model.family={family.name!r})")
  _require(0 < r.threshold <= 1, "rollout.threshold", f"must lie in (0, 1], got {r.threshold}")
  if name == "grpo":
    _require(config.objective.grpo.level in ("token", "sequence"), "objective.grpo.level",
             f"{config.objective.grpo.level!r} is not 'token' or 'sequence'")
  _validate_estimator(config, block_size is not None or family.name != "llada")
  stress = config.estimator.stress
  _require(0 <= stress.fraction <= 1, "estimator.stress.fraction",
           f"must lie in [0, 1] (0: off), got {stress.fraction}")
  for field in ("easy_rate", "hard_rate"):
    _require(0 < stress[field] <= 1, f"estimator.stress.{field}",
             f"must lie in (0, 1], got {stress[field]}")
  _require(stress.easy_rate <= stress.hard_rate, "estimator.stress.easy_rate",
           f"the easy masks must not mask more than the hard ones, got easy_rate="
           f"{stress.easy_rate} > hard_rate={stress.hard_rate}")
  if name == "stabledrl":
    s = config.objective.stabledrl
    _require(0 <= s.min_ratio < s.max_ratio, "objective.stabledrl.max_ratio",
             f"needs 0 <= min_ratio < max_ratio, got {s.min_ratio}, {s.max_ratio}")
    _require(s.normalize_over in ("group", "batch"), "objective.stabledrl.normalize_over",
             f"{s.normalize_over!r} is not 'group' or 'batch'")
  if name in ("stabledrl", "spg"):
    _require(config.objective[name].surrogate in ("elbo", "sandwich"),
             f"objective.{name}.surrogate",
             f"{config.objective[name].surrogate!r} is not 'elbo' or 'sandwich'")
  _require(advantage_baseline(config) in losses.ADVANTAGE_BASELINES,
           "objective.advantage_baseline",
           f"{config.objective.advantage_baseline!r} is not '' or one of "
           f"{losses.ADVANTAGE_BASELINES}")
  _require(advantage_baseline(config) != "leave_one_out" or r.group_size >= 2,
           "rollout.group_size", "a leave-one-out advantage baseline needs at least 2")
  o = config.optimizer
  _require(o.learning_rate > 0, "optimizer.learning_rate", f"must be > 0, got {o.learning_rate}")
  _require(o.schedule in ("linear", "constant"), "optimizer.schedule",
           f"{o.schedule!r} is not 'linear' or 'constant'")
  _require(o.grad_clip >= 0, "optimizer.grad_clip", "must be >= 0 (0: no clipping)")
  t = config.train
  _require(t.num_steps >= 0, "train.num_steps", "must be >= 0")
  _require(t.num_iterations >= 1, "train.num_iterations", "must be >= 1")
  _require(t.max_consecutive_skips >= 1, "train.max_consecutive_skips", "must be >= 1")
  _require(t.microbatch_groups >= 0, "train.microbatch_groups", "must be >= 0")
  _require(not t.gradient_bound or name == "stabledrl", "train.gradient_bound",
           f"the convex-hull bound is StableDRL's; objective.name is {name!r}")
  if t.microbatch_groups:
    _require(r.num_prompts % t.microbatch_groups == 0, "train.microbatch_groups",
             f"{t.microbatch_groups} does not divide rollout.num_prompts={r.num_prompts}")
  _require(config.checkpoint.every_steps >= 1, "checkpoint.every_steps", "must be >= 1")
  _require(config.checkpoint.every_seconds >= 0, "checkpoint.every_seconds",
           "must be >= 0 (0: off)")
  _require(config.task.reward_workers >= 0, "task.reward_workers", "must be >= 0 (0: in process)")
  _require(config.task.reward_timeout_s > 0, "task.reward_timeout_s", "must be > 0")
  _require(config.checkpoint.max_to_keep >= 1, "checkpoint.max_to_keep", "must be >= 1")
  _require(config.eval.every_steps >= 0, "eval.every_steps", "must be >= 0 (0: never)")
  _require(config.task.reward in tasks.REWARD_SCHEMES, "task.reward",
           f"{config.task.reward!r} is not one of {tasks.REWARD_SCHEMES}")
  _require(config.tokenizer.kind in ("char", "llada", "sdar"), "tokenizer.kind",
           f"{config.tokenizer.kind!r} is not 'char', 'llada' or 'sdar'")
  if num_devices is not None:
    from stabledrl_jax.training import mesh as mesh_lib  # Needs no devices, only counts.
    try:
      sizes = dict(zip(mesh_lib.MESH_AXES, mesh_lib.mesh_shape(config.mesh, num_devices)))
    except ValueError as err:
      raise ValueError(str(err)) from None
    ways = sizes["data"] * sizes["fsdp"]
    _require(sizes["data"] % int(config.mesh.get("dcn_data", 1) or 1) == 0, "mesh.dcn_data",
             f"{config.mesh.dcn_data} does not divide the data axis ({sizes['data']})")
    per_microbatch = r.num_prompts // num_microbatches(config)
    if per_microbatch * r.group_size % ways:
      fits = microbatch_groups_for(config, ways)
      advice = (f"on this mesh set train.microbatch_groups to one of {fits} (e.g. "
                f"--config.train.microbatch_groups={fits[0]})" if fits else
                f"no microbatch fits: make rollout.num_prompts x rollout.group_size a multiple "
                f"of {ways}")
      _require(False, "train.microbatch_groups" if t.microbatch_groups else "rollout.num_prompts",
               f"a microbatch of {per_microbatch} prompts x {r.group_size} completions does not "
               f"split over data x fsdp = {ways} devices; {advice}")
    if config.sft.num_steps and not config.model.checkpoint:
      _require(config.sft.batch_size % ways == 0, "sft.batch_size",
               f"{config.sft.batch_size} does not split over data x fsdp = {ways} devices")


def _validate_estimator(config: ml_collections.ConfigDict, block_model: bool) -> None:
  settings = estimator_settings(config)
  method, methods = settings["method"], tuple(estimators.MASK_SAMPLERS)
  _require(method in methods, "estimator.method", f"{method!r} is not one of {methods}")
  if objective_level(config) == "token":
    _require(method == "mean_field", "estimator.method",
             "token-level GRPO scores every completion token, so it needs 'mean_field'")
  _require(settings["normalize"] in ("sum", "mean"), "estimator.normalize",
           f"{settings['normalize']!r} is not '', 'sum' or 'mean'")
  _require(isinstance(settings["num_samples"], int) and settings["num_samples"] >= 1,
           "estimator.num_samples", f"must be an integer >= 1, got {settings['num_samples']!r}")
  _require(0 <= settings.get("prompt_mask_prob", 0.0) <= 1, "estimator.prompt_mask_prob",
           "must lie in [0, 1]")
  _require(settings["block_length"] >= 1, "estimator.block_length", "must be >= 1")
  if not block_model:  # A set option that the method does not take would be silently ignored.
    taken = sampler_options(method)
    for field in ("block_length", "prompt_mask_prob", "schedule", "coupled"):
      value = config.estimator.get(field)
      _require(value is None or value == "" or field in taken, f"estimator.{field}",
               f"the {method!r} estimator takes no {field!r} (it takes {taken or 'none'}); "
               f"unset it")


def microbatch_groups_for(config: ml_collections.ConfigDict, ways: int) -> list[int]:
  """The ``train.microbatch_groups`` whose microbatches split over ``ways`` = data x fsdp
  devices (each device needs whole rows)."""
  r = config.rollout
  return [g for g in range(1, r.num_prompts + 1)
          if r.num_prompts % g == 0 and g * r.group_size % ways == 0]


def num_microbatches(config: ml_collections.ConfigDict) -> int:
  groups = config.train.microbatch_groups or config.rollout.num_prompts
  return config.rollout.num_prompts // groups


def likelihood_spec(config: ml_collections.ConfigDict, mask_id: int,
                    block_size: int | None = None) -> rl_loss.LikelihoodSpec:
  """The static estimator settings of the configured objective.

  ``block_size``: that of a block diffusion model (its estimators: see ``rl_loss``), or None.
  """
  name = config.objective.name
  settings = estimator_settings(config)
  method, e = settings["method"], config.estimator
  if block_size is not None:  # The block ELBO takes only `coupled`; its mean field nothing.
    options = {} if method == "mean_field" else {"coupled": bool(settings.get("coupled"))}
  else:
    options = {k: settings[k] for k in sampler_options(method) if k in settings}
  stress_rates = None
  if e.stress.fraction > 0:
    stress_rates = (float(e.stress.easy_rate), float(e.stress.hard_rate))
  eubo_beta = None
  if name in ("stabledrl", "spg") and config.objective[name].surrogate == "sandwich":
    eubo_beta = float(config.objective[name].eubo_beta)
  return rl_loss.LikelihoodSpec(
      method=method, num_samples=settings["num_samples"], normalize=settings["normalize"],
      token_level=objective_level(config) == "token", eubo_beta=eubo_beta, mask_id=mask_id,
      options=tuple(sorted(options.items())), stress_rates=stress_rates, block_size=block_size,
      # Completions fill the last gen_length positions of every rollout row.
      scored_suffix=config.rollout.gen_length if block_size is None else None)


def objective_hparams(config: ml_collections.ConfigDict) -> tuple[tuple[str, Any], ...]:
  """Keyword arguments of the registered objective, from ``config.objective.<name>``."""
  name = config.objective.name
  hparams = dict(config.objective[name])
  for key in ("level", "eubo_beta"):  # Estimator settings, not loss arguments.
    hparams.pop(key, None)
  if name == "espo":
    hparams["gen_length"] = config.rollout.gen_length
  return tuple(sorted(hparams.items()))


