"""Config validation (docs/reliability.md): every value that would poison a run, and every field
or file name that does not exist, is a one-line error naming it before anything is written."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import ml_collections
import pytest

from stabledrl_jax import cli_flags, objectives, tasks, tokenizers
from stabledrl_jax.training.config import config_lib, specs
from stabledrl_jax.training.inputs import data

REPO = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "configs" / "quickstart.py")
NON_FINITE = (float("nan"), float("inf"), float("-inf"))


def quickstart(**updates) -> ml_collections.ConfigDict:
  config = config_lib.from_file(QUICKSTART)
  for field, value in updates.items():
    *sections, name = field.split(".")
    holder = config
    for section in sections:
      holder = holder[section]
    holder[name] = value
  return config


def typed_fields(config: ml_collections.ConfigDict, kind: type, prefix: str = "") -> list[str]:
  """Every field of ``config`` whose declared type is ``kind`` (unset placeholders included;
  a bool field is no int field)."""
  fields = []
  for key in config.keys():
    value = config[key]
    if isinstance(value, ml_collections.ConfigDict):
      fields.extend(typed_fields(value, kind, f"{prefix}{key}."))
    elif config.get_type(key) is kind:
      fields.append(f"{prefix}{key}")
  return fields


def float_fields(config: ml_collections.ConfigDict) -> list[str]:
  return typed_fields(config, float)


def int_fields(config: ml_collections.ConfigDict) -> list[str]:
  return typed_fields(config, int)


def objective_float_hparams() -> list[tuple[str, str]]:
  """(objective, field) for every float hyperparameter of every registered objective."""
  return [(objective.name, field.name) for objective in objectives.objectives()
          for field in dataclasses.fields(objective.hparams)
          if isinstance(field.default, float)]


def objective_int_hparams() -> list[tuple[str, str]]:
  """(objective, field) for every integer hyperparameter of every registered objective (their
  ranges are the objective's own check, ``Objective.make_hparams``)."""
  return [(objective.name, field.name) for objective in objectives.objectives()
          for field in dataclasses.fields(objective.hparams)
          if isinstance(field.default, int) and not isinstance(field.default, bool)]


def assert_names(error: BaseException, field: str) -> None:
  message = str(error)
  assert message.startswith(f"config.{field}: "), message
  assert "\n" not in message, message


# ---------------------------------------------------------------------------
# Numbers: finite, in range; the seed.
# ---------------------------------------------------------------------------


def test_every_float_field_refuses_nan_and_infinity_naming_it():
  fields = float_fields(config_lib.base_config())
  assert {"optimizer.b1", "optimizer.eps", "rollout.temperature", "sft.demo_error_rate",
          "objective.grpo.beta", "objective.spg.omega"} <= set(fields)  # The walk sees them.
  specs.validate(quickstart())
  for field in fields:
    for value in NON_FINITE:
      updates = {field: value}
      if field.startswith("objective."):  # The objective of the section too: its own check.
        updates["objective.name"] = field.split(".")[1]
      with pytest.raises(ValueError) as error:
        specs.validate(quickstart(**updates))
      assert_names(error.value, field)


def test_the_objective_sections_are_the_registered_hyperparameters():
  """config.objective.<name> is generated from the objective module's source: exactly its
  hyperparameter dataclass's fields, each unset, typed like the field."""
  sections = config_lib.base_config().objective
  shipped = [objective for objective in objectives.objectives()  # Not other tests' plugins.
             if objective.loss.__module__.startswith("stabledrl_jax.objectives.")]
  assert {objective.name for objective in shipped} == {"stabledrl", "grpo", "espo", "spg", "wd1"}
  for objective in shipped:
    fields = dataclasses.fields(objective.hparams)
    section = sections[objective.name]
    assert sorted(section) == sorted(f.name for f in fields), objective.name
    for field in fields:
      assert section[field.name] is None
      assert section.get_type(field.name) is type(field.default), (objective.name, field.name)


def test_the_estimator_options_are_the_registered_samplers_keyword_arguments():
  """config.estimator's sampler options are generated from estimators.py's source: exactly the
  keyword-only arguments of its registered methods (imported here, read there with ast), each
  unset and typed like the argument's default."""
  import inspect  # pylint: disable=g-import-not-at-top
  from stabledrl_jax import estimators  # pylint: disable=g-import-not-at-top
  registry = estimators._METHODS  # pylint: disable=protected-access
  shipped = [m for m in estimators.methods()
             if registry[m].__module__ == "stabledrl_jax.estimators"]
  assert set(shipped) == {"mean_field", "elbo", "block_random", "block_random_unbiased",
                          "espo_elbo"}
  defaults = {}
  for method in shipped:
    for name, param in inspect.signature(registry[method]).parameters.items():
      if param.kind is inspect.Parameter.KEYWORD_ONLY:
        defaults.setdefault(name, param.default)
  fields = config_lib.estimator_option_fields()
  assert set(fields) == set(defaults) == {"block_length", "prompt_mask_prob", "schedule",
                                          "coupled"}
  section = config_lib.base_config().estimator
  for name, default in defaults.items():
    if isinstance(default, str):
      assert section[name] == ""
    else:
      assert section[name] is None and section.get_type(name) is type(default), name


def test_every_float_hyperparameter_of_every_objective_refuses_nan_and_infinity():
  params = objective_float_hparams()
  assert ("grpo", "epsilon_low") in params and ("espo", "beta") in params
  for name, field in params:
    objective = objectives.get_objective(name)
    objective.make_hparams({})  # The defaults pass.
    for value in NON_FINITE:
      with pytest.raises(ValueError, match=rf"^{field}: must be a finite number"):
        objective.make_hparams({field: value})


def family_option_fields() -> dict[str, type]:
  """{rollout.family_options.<name> and eval.'s: kind} of every option a registered model family
  declares (``Family.options``: its range is the family's ``Option``)."""
  from stabledrl_jax.models import family  # pylint: disable=g-import-not-at-top
  return {f"{section}.family_options.{name}": option.kind for section in ("rollout", "eval")
          for record in map(family.get, family.names()) for name, option in record.options.items()}


def test_every_float_field_of_base_config_has_a_range():
  """A new float field needs a range in specs.FLOAT_RANGES (or its objective's check, or its
  model family's ``Option``)."""
  hparams = {f"objective.{name}.{field}" for name, field in objective_float_hparams()}
  options = family_option_fields()
  unranged = [field for field in float_fields(config_lib.base_config())
              if field not in specs.FLOAT_RANGES and field not in hparams
              and options.get(field) is not float]
  assert not unranged
  assert not set(specs.FLOAT_RANGES) - set(float_fields(config_lib.base_config()))


def test_every_float_range_is_bounded_above():
  """A float with no finite upper bound takes 1e300 (optimizer.eps=1e300 trained with updates
  of about 0, and only an overflow warning)."""
  assert [field for field, bounds in specs.FLOAT_RANGES.items() if bounds.high == float("inf")
          ] == []


@pytest.mark.parametrize("field,value", [
    ("optimizer.eps", 1e300), ("optimizer.eps", 1.5), ("optimizer.weight_decay", 2.0),
    ("optimizer.weight_decay", 1e300), ("optimizer.grad_clip", 1e300),
    ("rollout.temperature", 1e300), ("checkpoint.every_seconds", 1e300),
    ("task.reward_timeout_s", 1e300), ("logging.peak_tflops_per_device", 1e300),
    ("diagnostics.spike_factor", 1e300), ("train.stop_grace_s", 1e300),
    ("train.stop_grace_s", -1.0),
    ("optimizer.b1", 1.0), ("optimizer.b1", -0.1), ("optimizer.b2", 1.5), ("optimizer.eps", 0.0),
    ("optimizer.end_lr_factor", 1.5), ("rollout.temperature", -0.5), ("rollout.threshold", 0.0),
    ("sft.demo_error_rate", 2.0), ("sft.demo_error_rate", -0.1),
    ("estimator.prompt_mask_prob", 1.5), ("checkpoint.every_seconds", -1.0),
    ("task.reward_timeout_s", 0.0), ("diagnostics.spike_factor", -1.0),
    ("logging.peak_tflops_per_device", -1.0), ("optimizer.grad_clip", -1.0),
])
def test_a_float_out_of_its_range_names_the_field(field, value):
  with pytest.raises(ValueError, match="must be a finite number in") as error:
    specs.validate(quickstart(**{field: value}))
  assert_names(error.value, field)


@pytest.mark.parametrize("field,value", [
    ("optimizer.b1", 0.0), ("optimizer.b2", 0.999), ("rollout.temperature", 0.0),
    ("rollout.threshold", 1.0), ("sft.demo_error_rate", 1.0), ("optimizer.end_lr_factor", 1.0),
    ("estimator.prompt_mask_prob", 0.0), ("optimizer.eps", 1.0), ("optimizer.weight_decay", 1.0),
    ("task.reward_timeout_s", 86400.0), ("rollout.temperature", 10.0),
])
def test_the_ends_of_a_range_pass(field, value):
  specs.validate(quickstart(**{field: value}))


@pytest.mark.parametrize("name,field,value", [
    ("grpo", "epsilon_low", 1.5), ("grpo", "epsilon_low", -0.1), ("grpo", "epsilon_high", -0.1),
    ("grpo", "beta", -0.04), ("espo", "epsilon", 1.2), ("espo", "beta", -1e-3),
    ("spg", "omega", 1.5), ("spg", "eubo_beta", 0.0), ("stabledrl", "omega", -0.5),
    ("stabledrl", "eubo_beta", -1.0),
])
def test_an_objective_hyperparameter_out_of_range_names_the_field(name, field, value):
  with pytest.raises(ValueError, match=rf"^{field}: must lie in"):
    objectives.get_objective(name).make_hparams({field: value})
  with pytest.raises(ValueError) as error:
    specs.validate(quickstart(**{"objective.name": name, f"objective.{name}.{field}": value}))
  assert_names(error.value, f"objective.{name}.{field}")


@pytest.mark.parametrize("seed", [-1, 2**32, 2**40])
def test_a_seed_outside_32_bits_names_the_field(seed):
  with pytest.raises(ValueError, match="must be an integer in") as error:
    specs.validate(quickstart(seed=seed))
  assert_names(error.value, "seed")


def test_the_seeds_at_the_ends_pass():
  for seed in (0, 2**32 - 2):
    specs.validate(quickstart(seed=seed))


# Integer fields where -1 means something: (field, why). Every other integer field refuses -1.
MINUS_ONE_MEANS_SOMETHING = {
    "mesh.data": "-1: the devices the other mesh axes leave (training/parallel/mesh.py)",
    "mesh.fsdp": "-1: the devices the other mesh axes leave (the paper configs' FSDP axis)",
    "mesh.tensor": "-1: the devices the other mesh axes leave",
}
HUGE = 10**12


def test_every_integer_field_refuses_minus_one_and_a_huge_value_naming_it():
  """rollout.steps=10**6 once ran 10**6 model calls a step, eval.steps=-1 failed at the first
  evaluation: every integer field has a range, and 10**12 lies outside each (no field takes a
  value that large legitimately)."""
  fields = int_fields(config_lib.base_config())
  assert {"seed", "rollout.steps", "eval.steps", "sft.demo_error_cells", "estimator.num_samples",
          "mesh.data", "train.num_steps"} <= set(fields)  # The walk sees them.
  assert set(MINUS_ONE_MEANS_SOMETHING) <= set(fields)
  specs.validate(quickstart())
  options = family_option_fields()
  for field in fields:
    updates = {}
    if field.startswith("objective."):  # The objective of the section too: its own check.
      updates["objective.name"] = field.split(".")[1]
    if field in options:  # A family that takes it (Dream): its own range.
      updates.update({"model.family": "dream", "rollout.remasking": "entropy"})
    for value in (-1, HUGE):
      if value == -1 and field in MINUS_ONE_MEANS_SOMETHING:
        continue
      with pytest.raises(ValueError) as error:
        specs.validate(quickstart(**updates, **{field: value}))
      assert_names(error.value, field)
      assert str(value) in str(error.value), error.value
  # Where -1 means something, it passes (one mesh axis at a time).
  for field in MINUS_ONE_MEANS_SOMETHING:
    config = quickstart(**{"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1, field: -1})
    specs.validate(config, num_devices=1)


def test_the_sampler_chunks_are_checked_with_the_mesh():
  """rollout.microbatch_groups is checked where the mesh is (specs.validate with a device count,
  as the trainer and the planner call it): 1 group x 8 rows does not split over 16 devices."""
  config = quickstart(**{"rollout.microbatch_groups": 1})
  specs.validate(config, num_devices=8)
  with pytest.raises(ValueError, match=r"^rollout.microbatch_groups=1 gives 8 rows per sampler "
                                       r"call, not a multiple of the 16 data x fsdp devices"):
    specs.validate(config, num_devices=16)


def test_the_rollouts_are_resolved_once_into_a_frozen_spec():
  """specs.resolve_rollout: what the rollout collector, the prompts and the held-out evaluation
  take from the config (the collector reads no config): the rollout sampler at its temperature
  and cache, the evaluation greedy and exact at eval.steps, the sampler's chunks in rows."""
  config = quickstart(**{"rollout.microbatch_groups": 2, "rollout.temperature": 0.7,
                         "rollout.cache": "prefix", "rollout.remasking": "low_confidence",
                         "eval.steps": 8, "estimator.stress.fraction": 0.25,
                         "task.with_instruction": True})
  r = config.rollout
  spec = specs.resolve_rollout(config)
  hash(spec)  # Static: a jit argument and a dict key.
  assert (spec.num_prompts, spec.group_size, spec.num_rows, spec.prompt_length,
          spec.gen_length) == (r.num_prompts, r.group_size, r.num_prompts * r.group_size,
                               r.prompt_length, r.gen_length)
  assert spec.chunk_rows == 2 * r.group_size and spec.stress_fraction == 0.25
  assert (spec.with_instruction, spec.prompt_style) == (True, config.task.prompt_style)
  sampling, evaluation = spec.sampling, spec.evaluation
  assert (sampling.temperature, sampling.cache, sampling.steps) == (0.7, "prefix", r.steps)
  assert (evaluation.temperature, evaluation.cache, evaluation.steps) == (0.0, "none", 8)
  assert evaluation.block_length == sampling.block_length == r.block_length
  # Options override; None keeps the setting.
  assert sampling.with_options(cache=None, threshold=0.5) == dataclasses.replace(sampling,
                                                                                 threshold=0.5)
  assert evaluation.with_options(cache="dual").cache == "dual"


def test_the_run_is_resolved_once_into_one_record():
  """specs.resolve: every check (the mesh's included), then one typed record the trainer, the
  planner and the compiles build from: the model config, both specs, the mesh shape with its
  -1 axis filled in and the optimizer's schedule over train.num_steps x train.num_iterations."""
  config = quickstart(**{"rollout.microbatch_groups": 1, "mesh.data": -1, "mesh.fsdp": 2,
                         "train.num_iterations": 3, "optimizer.schedule": "linear",
                         "optimizer.warmup_steps": 0, "optimizer.end_lr_factor": 0.0})
  resolved = specs.resolve(config, num_devices=8)
  assert resolved.model == specs.model_config(config)
  assert resolved.run == specs.resolve_run(config, resolved.model)
  assert resolved.rollout == specs.resolve_rollout(config)
  assert resolved.mesh_shape == (("data", 4), ("fsdp", 2), ("tensor", 1))
  assert resolved.data_ways == 8
  assert resolved.num_updates == config.train.num_steps * 3
  lr = config.optimizer.learning_rate
  assert float(resolved.schedule(0)) == pytest.approx(lr)
  assert float(resolved.schedule(resolved.num_updates)) == pytest.approx(0.0, abs=1e-12)
  assert specs.resolve(config).mesh_shape is None and specs.resolve(config).data_ways is None
  # The checks are validate's, the chunks over the mesh among them (one line naming the field).
  with pytest.raises(ValueError, match=r"^rollout.microbatch_groups=1 gives 8 rows per sampler "
                                       r"call, not a multiple of the 16 data x fsdp devices"):
    specs.resolve(config, num_devices=16)
  config.optimizer.schedule = "cosine"
  with pytest.raises(ValueError, match=r"optimizer\.schedule"):
    specs.resolve(config, num_devices=8)


def test_every_integer_field_of_base_config_has_a_range():
  """A new integer field needs a range in specs.INT_RANGES (or its objective's check, or its
  model family's ``Option``)."""
  hparams = {f"objective.{name}.{field}" for name, field in objective_int_hparams()}
  options = family_option_fields()
  unranged = [field for field in int_fields(config_lib.base_config())
              if field not in specs.INT_RANGES and field not in hparams
              and options.get(field) is not int]
  assert not unranged
  assert not set(specs.INT_RANGES) - set(int_fields(config_lib.base_config()))
  for field, bounds in specs.INT_RANGES.items():  # Bounded well below the walk's huge value.
    assert bounds.high < HUGE and bounds.low <= bounds.high, field


@pytest.mark.parametrize("field,value", [
    ("rollout.steps", None), ("seed", True), ("eval.batch_size", False), ("sft.batch_size", 0),
    ("mesh.fsdp", 0), ("mesh.tensor", -2), ("train.num_iterations", 0),
    ("checkpoint.every_steps", 0), ("task.reward_workers", 10**5),
])
def test_an_integer_out_of_its_range_names_the_field(field, value):
  with pytest.raises(ValueError, match="must be an integer in") as error:
    specs.validate(quickstart(**{field: value}))
  assert_names(error.value, field)


@pytest.mark.parametrize("field,value", [
    ("train.num_steps", 0), ("eval.every_steps", 0), ("eval.steps", 0), ("sft.num_steps", 0),
    ("logging.samples_every_steps", 0), ("logging.num_samples", 0), ("task.reward_workers", 0),
    ("rollout.microbatch_groups", 0), ("train.microbatch_groups", 0), ("mesh.dcn_data", 0),
    ("sft.demo_error_cells", 0), ("optimizer.warmup_steps", 0), ("estimator.num_samples", None),
])
def test_zero_keeps_its_meaning(field, value):
  """0 means off, never, every, all at once or the default where the code gives it that
  meaning; an unset placeholder stays unset."""
  specs.validate(quickstart(**{field: value}))


@pytest.mark.parametrize("config_name,block", [("quickstart", 40), ("sdar_tiny_quickstart", 8)])
def test_rollout_steps_beyond_the_completion_are_refused(config_name, block):
  """One step per completion token at most: LLaDA's schedule runs every step (those beyond
  reveal nothing); SDAR's steps split over its blocks, at most block_size each."""
  config = config_lib.get(config_name)
  assert config.rollout.gen_length == 40
  config.rollout.steps = 40
  specs.validate(config)  # One per token: the bound itself passes.
  for steps in (80, 1_000_000):
    config.rollout.steps = steps
    with pytest.raises(ValueError, match=rf"{steps} exceeds rollout.gen_length=40") as error:
      specs.validate(config)
    assert_names(error.value, "rollout.steps")
    assert f"={block} a block" in str(error.value), error.value
  # A checkpoint's model config (its block size) is known once it is loaded; the bound over
  # the completion is checked before.
  config.model.checkpoint = "some/checkpoint"
  with pytest.raises(ValueError, match="1000000 exceeds rollout.gen_length=40") as error:
    specs.validate(config)
  assert_names(error.value, "rollout.steps")


def test_the_llada_sampler_refuses_steps_beyond_the_completion():
  """The sampler's own check (``evaluate --steps``, any direct caller): not 10**6 model calls."""
  from stabledrl_jax.models.llada import sampler  # pylint: disable=g-import-not-at-top
  sampler.check_settings(gen_length=8, steps=8, block_length=4)
  with pytest.raises(ValueError, match=r"steps \(16\) must be at most gen_length \(8\)"):
    sampler.check_settings(gen_length=8, steps=16, block_length=4)
  sampler.check_settings(gen_length=8, steps=16, block_length=4, remasking="threshold")  # Unused.


def test_eval_steps_are_bounded_and_fit_the_family_sampler():
  with pytest.raises(ValueError, match=r"must be an integer in \[0, ") as error:
    specs.validate(quickstart(**{"eval.steps": -1}))
  assert_names(error.value, "eval.steps")
  with pytest.raises(ValueError, match="41 exceeds rollout.gen_length=40") as error:
    specs.validate(quickstart(**{"eval.steps": 41}))
  assert_names(error.value, "eval.steps")
  # LLaDA splits the steps evenly over its blocks (5 of 8 here): 7 would fail at the first
  # evaluation, after eval.every_steps RL steps.
  blocks = {"rollout.block_length": 8}
  specs.validate(quickstart(**blocks, **{"eval.steps": 10}))
  with pytest.raises(ValueError, match=r"multiple of the number of blocks \(5\)") as error:
    specs.validate(quickstart(**blocks, **{"eval.steps": 7}))
  assert_names(error.value, "eval.steps")
  specs.validate(quickstart(**blocks, **{"eval.steps": 7, "eval.every_steps": 0}))  # No eval.
  sdar = config_lib.get("sdar_tiny_quickstart")  # SDAR's blocks take ceil(steps / blocks).
  sdar.eval.steps = 7
  specs.validate(sdar)
  sdar.eval.steps = 41
  with pytest.raises(ValueError, match="41 exceeds rollout.gen_length=40") as error:
    specs.validate(sdar)
  assert_names(error.value, "eval.steps")


def test_demo_error_cells_beyond_a_sudoku_grid_are_refused():
  """The imperfect demonstrator rewrites the first demo_error_cells blanks of a sudoku, which
  has at most its grid's cells blank."""
  cells = tasks.sudoku.NUM_CELLS
  assert cells == 16
  specs.validate(quickstart(**{"sft.demo_error_cells": cells}))
  with pytest.raises(ValueError, match=rf"\[0, {cells}\] \(.*a 4x4 sudoku has {cells}\)"
                     ) as error:
    specs.validate(quickstart(**{"sft.demo_error_cells": cells + 1}))
  assert_names(error.value, "sft.demo_error_cells")


def test_counts_whose_product_or_relation_cannot_work_are_refused():
  with pytest.raises(ValueError, match="more than optax counts") as error:
    specs.validate(quickstart(**{"train.num_steps": 10**9, "train.num_iterations": 3}))
  assert_names(error.value, "train.num_steps")
  with pytest.raises(ValueError, match="no spike would ever be recorded") as error:
    specs.validate(quickstart(**{"diagnostics.spike_min_history": 21}))
  assert_names(error.value, "diagnostics.spike_min_history")
  specs.validate(quickstart(**{"diagnostics.spike_min_history": 20}))


def test_a_non_finite_number_anywhere_in_the_config_names_it():
  """Fields no range covers (a model override, a generator option) are still finite."""
  config = quickstart()
  config.model.overrides.rope_theta = float("nan")
  with pytest.raises(ValueError) as error:
    specs.validate(config)
  assert_names(error.value, "model.overrides.rope_theta")
  config = quickstart()
  config.data.generator.blanks_range = (3.0, float("inf"))
  with pytest.raises(ValueError) as error:
    specs.validate(config)
  assert_names(error.value, "data.generator.blanks_range[1]")


# ---------------------------------------------------------------------------
# The character tokenizer's alphabet and the task.
# ---------------------------------------------------------------------------


def test_an_alphabet_that_cannot_spell_the_answers_is_refused():
  with pytest.raises(ValueError) as error:
    specs.validate(quickstart(**{"tokenizer.alphabet": "0123<>/answer"}))
  assert_names(error.value, "tokenizer.alphabet")
  assert "'4'" in str(error.value)  # Sudoku solutions use the digits 1-4; '4' is missing.
  # Countdown's answers are arithmetic: the quickstart's sudoku alphabet has no operators.
  countdown = {"task.name": "countdown", "data.generator": ml_collections.ConfigDict()}
  with pytest.raises(ValueError, match=r"cannot encode '\(\)\*\+-'") as error:
    specs.validate(quickstart(**countdown))
  assert_names(error.value, "tokenizer.alphabet")
  # The default passes (without the quickstart's imperfect demonstrator, which is sudoku's).
  specs.validate(quickstart(**countdown, **{"tokenizer.alphabet": "", "sft.demo_error_rate": 0.0}))
  # The sudoku generator's option, left on a countdown run: named before any data is made.
  with pytest.raises(ValueError, match="blanks_range") as error:
    specs.validate(quickstart(**{"task.name": "countdown"}))
  assert_names(error.value, "data.generator")


def test_check_alphabet_on_hand_made_examples():
  task = tasks.get_task("sudoku")
  tokenizer = tokenizers.CharTokenizer("<>/answer12")
  data.check_alphabet(tokenizer, task, [tasks.Example("q", "12", reference="12"),
                                        tasks.Example("q", None)])  # No reference: skipped.
  with pytest.raises(ValueError, match=r"cannot encode '3'.*'<answer>13</answer>'"):
    data.check_alphabet(tokenizer, task, [tasks.Example("q", "12", reference="12"),
                                          tasks.Example("q", "13", reference="13")])


def test_a_dataset_is_checked_once_when_it_is_loaded(tmp_path):
  """A file's examples (not made in validate) are checked by make_examples, not per batch."""
  records = tmp_path / "gsm8k.jsonl"
  records.write_text(json.dumps({"question": "1 + 1?", "answer": "1 + 1 = 2\n#### 2"}) + "\n")
  config = quickstart(**{"task.name": "gsm8k", "data.eval": str(records), "data.eval_size": 0,
                         "data.train": str(records), "data.train_size": 0,
                         "sft.demo_error_rate": 0.0})  # The quickstart's demonstrator: sudoku's.
  specs.validate(config)  # The file is not read here.
  with pytest.raises(ValueError, match=r"cannot encode '\\n#\+='") as error:
    data.make_examples(config, "eval")
  assert_names(error.value, "tokenizer.alphabet")
  config.tokenizer.alphabet = ""
  assert [ex.reference for ex in data.make_examples(config, "eval")] == ["1 + 1 = 2\n#### 2"]


def test_a_repeated_alphabet_and_an_unknown_task_name_their_field():
  with pytest.raises(ValueError, match="repeats '0'") as error:
    specs.validate(quickstart(**{"tokenizer.alphabet": "0012"}))
  assert_names(error.value, "tokenizer.alphabet")
  with pytest.raises(ValueError, match="'chess' is not a registered task") as error:
    specs.validate(quickstart(**{"task.name": "chess"}))
  assert_names(error.value, "task.name")


# ---------------------------------------------------------------------------
# Field and file names on the command line.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("flag,field,guess", [
    ("--config.rollout.temprature=0.5", "rollout.temprature", "rollout.temperature"),
    ("--config.temperature=0.5", "temperature", "rollout.temperature"),
    ("--noconfig.model.remt", "model.remt", "model.remat"),
    ("--config.model.overrides.d_modle=32", "model.overrides.d_modle", "model.overrides.d_model"),
    ("--config.optimizer.learning_rte=1e-4", "optimizer.learning_rte", "optimizer.learning_rate"),
])
def test_an_unknown_field_is_named_with_the_closest_one(flag, field, guess):
  with pytest.raises(ValueError) as error:
    cli_flags.check_config_flags(["--config", QUICKSTART, flag])
  assert_names(error.value, field)
  assert str(error.value).endswith(f"did you mean config.{guess}?")


def test_known_fields_and_other_flags_pass():
  cli_flags.check_config_flags(
      ["--config=" + QUICKSTART, "--config.rollout.temperature=0.5", "--noconfig.model.remat",
       "--config.model.overrides.d_model", "32", "--workdir", "/tmp/x", "--verbose"])
  cli_flags.check_config_flags(["--workdir", "/tmp/x"])  # absl reports the missing --config.
  with pytest.raises(ValueError, match=r"^config\.seed\.x: config\.seed is a value \(int\)"):
    cli_flags.check_config_flags(["--config", QUICKSTART, "--config.seed.x=1"])


def test_a_missing_or_broken_config_file_is_named(tmp_path):
  missing = str(REPO / "configs" / "quickstrat.py")
  with pytest.raises(FileNotFoundError) as error:
    cli_flags.check_config_flags(["--config", missing])
  assert str(error.value) == (f"--config {missing!r}: no such file; did you mean "
                              f"{REPO / 'configs' / 'quickstart.py'}?")
  broken = tmp_path / "broken.py"
  broken.write_text("def get_config():\n  return undefined_name\n")
  with pytest.raises(ValueError, match=rf"^--config {broken}: get_config\(\) raised NameError"):
    cli_flags.check_config_flags(["--config", str(broken)])
  with_arg = tmp_path / "with_arg.py"
  with_arg.write_text("from stabledrl_jax.training.config import config_lib\n"
                      "def get_config(arg):\n  c = config_lib.base_config()\n"
                      "  c.task.name = arg\n  return c\n")
  cli_flags.check_config_flags([f"--config={with_arg}:countdown", "--config.task.name=x"])


def _train(*args, workdir):
  return subprocess.run(
      [sys.executable, "-m", "stabledrl_jax.train", *args, "--workdir", str(workdir)],
      capture_output=True, text=True, timeout=300, cwd=REPO,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_the_cli_gives_one_line_and_writes_nothing(tmp_path):
  workdir = tmp_path / "run"
  cases = [
      (["--config", "quickstart", "--config.rollout.temprature=0.5"],
       "error: config.rollout.temprature: no such field (config.rollout has no 'temprature'); "
       "did you mean config.rollout.temperature?"),
      (["--config", str(tmp_path / "nowhere.py")], f"error: --config '{tmp_path}/nowhere.py': "),
      (["--config", "quickstart", "--config.seed=-1"], "error: config.seed: must be an integer"),
      (["--config", "quickstart", "--config.optimizer.b1=nan"],
       "error: config.optimizer.b1: must be a finite number, got nan"),
  ]
  for args, start in cases:
    out = _train(*args, workdir=workdir)
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(start), out.stderr
    assert not workdir.exists()  # Validation runs before anything is written.
  verbose = _train("--config", "quickstart", "--config.rollout.temprature=0.5", "--verbose",
                   workdir=workdir)
  assert verbose.returncode == 1 and "Traceback" in verbose.stderr


def test_an_unknown_prompt_style_names_the_field_and_the_styles():
  with pytest.raises(ValueError, match="'d1', 'stabledrl'") as error:
    specs.validate(quickstart(**{"task.prompt_style": "tulu"}))
  assert_names(error.value, "task.prompt_style")
  specs.validate(quickstart(**{"task.prompt_style": "stabledrl", "task.with_instruction": True}))
