"""Plug-ins defined in this file alone: an estimator method, a third model family and a task.

Each is one registration; the config check, the likelihood spec, the trainer, checkpoint IO and
the evaluation path pick it up without another file knowing its name (docs/algorithms.md and
docs/models.md, "Adding ...").
"""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stabledrl_jax import estimators, evaluate, models, tasks
from stabledrl_jax.models import family as family_lib, llada
from stabledrl_jax.models.llada import checkpoint as llada_checkpoint
from stabledrl_jax.training.config import specs
from stabledrl_jax.training.loop import sweep, trainer
from stabledrl_jax.training.step import rl_loss

from test_training import tiny_config


def _quick(**updates):
  """tiny_config without the supervised start: one RL step from random weights."""
  return tiny_config(**{"sft.num_steps": 0, "train.num_steps": 1, "train.num_iterations": 1,
                        **updates})


# ---------------------------------------------------------------------------
# An estimator method.
# ---------------------------------------------------------------------------


def _every_other_masks(key, prompt_mask, completion_mask, num_samples, *, offset: int = 0):
  """Every other completion token masked (from ``offset``), weighted by 2: a deterministic toy
  Monte Carlo estimator of the sum of the completion's log-probs."""
  del key
  rank = jnp.cumsum(completion_mask, axis=-1) - 1
  scored = completion_mask & (rank % 2 == offset)
  past = estimators.past_completion(prompt_mask, completion_mask)
  noisy = jnp.broadcast_to((scored | past)[None], (num_samples,) + scored.shape)
  scored = jnp.broadcast_to(scored[None], noisy.shape)
  length = jnp.sum(completion_mask, axis=-1).astype(jnp.float32)
  ones = jnp.ones((num_samples,) + length.shape, jnp.float32)
  return estimators.MaskSample.per_row(
      noisy=noisy, scored=scored, sum_scale=2.0 * ones / num_samples,
      mean_scale=2.0 * ones / (num_samples * jnp.maximum(length, 1)), rate=0.5 * ones)


@pytest.fixture
def every_other():
  estimators.register_method("every_other", _every_other_masks)
  yield "every_other"
  estimators.unregister_method("every_other")
  assert "every_other" not in estimators.methods()


def test_an_estimator_registered_in_a_test_file_trains(tmp_path, every_other):
  config = _quick(**{"estimator.method": every_other})
  config.estimator.update(prompt_mask_prob=None, schedule="", coupled=None, block_length=None)
  assert estimators.method_options(every_other) == ("offset",)
  assert specs.estimator_settings(config)["method"] == every_other
  spec = specs.likelihood_spec(config, specs.model_config(config))
  assert spec.method == every_other and spec.options == ()
  history = trainer.train(config, str(tmp_path))
  assert len(history) == 1 and np.isfinite(history[0]["loss"])
  # Its own option is a field a config file adds; the likelihood spec passes it to the sampler.
  with_option = config.copy_and_resolve_references()
  with_option.estimator.offset = 1
  specs.validate(with_option)
  spec = specs.likelihood_spec(with_option, specs.model_config(with_option))
  assert spec.options == (("offset", 1),)
  # An option the method does not take is named, not silently ignored.
  config.estimator.schedule = "count"
  with pytest.raises(ValueError, match=r"config\.estimator\.schedule: the 'every_other'"):
    specs.validate(config)
  # The block model's likelihood does not take it: a clear error, not a wrong estimate.
  sdar = _quick(**{"model.family": "sdar", "estimator.method": every_other})
  with pytest.raises(ValueError, match=r"config\.estimator\.method: 'every_other' .*sdar"):
    specs.validate(sdar)


def test_the_registered_estimator_is_what_the_trainer_scores(every_other):
  """Through rl_loss, the method's masks are used: the estimate equals twice the log-probs of
  every other completion token, each scored with the others clean (a float64 re-derivation)."""
  config = _quick(**{"estimator.method": every_other, "estimator.normalize": "sum"})
  model_config = specs.model_config(config).replace(n_layers=1)
  model = models.init_model(model_config, seed=0)
  b, p, g = 2, 4, 6
  spec = dataclasses.replace(specs.likelihood_spec(config, model_config), scored_suffix=g)
  rng = np.random.default_rng(0)
  tokens = rng.integers(4, model_config.vocab_size, (b, p + g))  # No special token.
  prompt_mask = np.zeros((b, p + g), bool)
  prompt_mask[:, :p] = True
  completion = ~prompt_mask
  batch = rl_loss.RolloutBatch(
      tokens=jnp.asarray(tokens), prompt_mask=jnp.asarray(prompt_mask),
      completion_mask=jnp.asarray(completion), attention_mask=jnp.ones((b, p + g), bool),
      advantages=jnp.zeros(b), old_logp=jnp.zeros(b), ref_logp=jnp.zeros(b))
  logp, _ = rl_loss.estimate(rl_loss.model_logits_fn(model, batch.attention_mask), batch,
                             jax.random.key(0), spec)
  noisy = np.where(np.arange(p + g) >= p, np.where((np.arange(p + g) - p) % 2 == 0,
                                                   model_config.mask_token_id, tokens), tokens)
  logits = np.asarray(model(jnp.asarray(noisy)), np.float64)
  logits = logits - logits.max(-1, keepdims=True)
  logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  picked = np.take_along_axis(logprobs, tokens[..., None], -1)[..., 0]
  scored = (np.arange(p + g) >= p) & ((np.arange(p + g) - p) % 2 == 0)
  want = 2.0 * (picked * scored).sum(-1)
  np.testing.assert_allclose(np.asarray(logp), want, rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------------------
# A third model family.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToyConfig(llada.ModelConfig):
  """The toy family's config: LLaDA's shapes under another class (so ``family.of`` tells)."""


class Toy(llada.LLaDA):
  """The toy family's module: LLaDA's architecture."""


def _toy_config(name, **overrides):
  return ToyConfig(**dataclasses.asdict(llada.get_config(name, **overrides)))


def _toy_param_names(config, hf):
  del hf
  return [(name.replace("model.transformer.", "toy."), path, transpose)
          for name, path, transpose in llada_checkpoint.param_names(config)]


def _toy_config_to_hf(config):
  return {**llada_checkpoint.config_to_hf(config), "model_type": "toy",
          "architectures": ["Toy"]}


def _toy_config_from_hf(hf, **overrides):
  return ToyConfig(**dataclasses.asdict(llada_checkpoint.config_from_hf(hf, **overrides)))


@pytest.fixture
def toy_family():
  base = llada.FAMILY
  family = family_lib.register(dataclasses.replace(
      base, name="toy", config_cls=ToyConfig, model_cls=Toy, get_config=_toy_config,
      checkpoint=family_lib.Checkpoint(model_type="toy", config_from_hf=_toy_config_from_hf,
                                       config_to_hf=_toy_config_to_hf,
                                       param_names=_toy_param_names)))
  yield family
  family_lib.unregister("toy")
  assert "toy" not in family_lib.names()


def test_a_model_family_registered_in_a_test_file_trains_evaluates_saves_and_plans(
    tmp_path, toy_family):
  config = _quick(**{"model.family": "toy", "eval.every_steps": 1})
  specs.validate(config, num_devices=1)
  model_config = specs.model_config(config)
  assert type(model_config) is ToyConfig and models.count_params(model_config) > 0
  history = trainer.train(config, str(tmp_path / "run"))
  assert len(history) == 1 and np.isfinite(history[0]["loss"])
  assert 0.0 <= history[0]["eval/accuracy"] <= 100.0
  # Its checkpoint layout: written and read back in its own names, bit for bit.
  model = models.init_model(model_config.replace(n_layers=1), seed=3)
  models.save_pretrained(model, str(tmp_path / "hf"))
  hf = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert hf["model_type"] == "toy"
  loaded = models.from_pretrained(str(tmp_path / "hf"))
  assert type(loaded) is Toy
  for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                  jax.tree.leaves(nnx.state(loaded, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The planner counts it from its record (shapes, step FLOPs, KV cache): LLaDA's shapes under
  # another family give LLaDA's FLOPs, and its state's bytes abstractly, nothing compiled.
  from stabledrl_jax import plan  # pylint: disable=g-import-not-at-top
  as_llada = sweep.with_overrides(config, {"model.family": "llada"})
  assert plan.rl_step_flops(config) == plan.rl_step_flops(as_llada)
  assert plan.rl_step_flops(config)["total"] > 0
  sampler = plan.state_bytes("sampler", config, jax.devices()[:1])
  assert sampler["parameters_bytes"] == 4 * models.count_params(model_config)
  assert sampler["kv_cache_bytes"] == 0  # rollout.cache none: the exact sampler.
  assert plan.state_bytes("train", config, jax.devices()[:1])["optimizer_bytes"] > 0
  # The sweeps and config checks list it with the others.
  assert "toy" in family_lib.names()
  bad = sweep.with_overrides(config, {"model.overrides.block_size": 4})
  with pytest.raises(ValueError, match=r"config\.model\.overrides\.block_size: the toy config"):
    specs.validate(bad)


def test_family_registry_errors_name_the_culprit():
  with pytest.raises(ValueError, match="already registered"):
    family_lib.register(llada.FAMILY)
  with pytest.raises(ValueError, match=r"model_type 'llada' is already 'llada'"):
    family_lib.register(dataclasses.replace(llada.FAMILY, name="llada2"))
  with pytest.raises(NotImplementedError, match="model_type='gpt2'"):
    family_lib.by_model_type("gpt2")
  with pytest.raises(TypeError, match="dict is not the config of a registered model family"):
    family_lib.of({})


def test_a_method_with_misshapen_masks_is_named():
  """A plugin method that returns rates per row instead of per token (or anything else but a
  MaskSample) is refused when its masks are drawn, naming the method and the field."""
  def per_row_rates(key, prompt_mask, completion_mask, num_samples):
    good = _every_other_masks(key, prompt_mask, completion_mask, num_samples)
    return good.replace(rate=good.rate[..., 0])  # [R, B]: broadcast wrongly against [R, B, L]

  prompt = jnp.zeros((2, 6), bool).at[:, :2].set(True)
  estimators.register_method("per_row_rates", per_row_rates)
  estimators.register_method("not_masks", lambda key, p, c, k: (p, c))
  try:
    with pytest.raises(ValueError, match=r"'per_row_rates'.*MaskSample.rate.*\(1, 2, 6\)"):
      estimators.sample_masks(jax.random.key(0), prompt, ~prompt, method="per_row_rates")
    with pytest.raises(ValueError, match="'not_masks': returned tuple"):
      estimators.sample_masks(jax.random.key(0), prompt, ~prompt, method="not_masks")
  finally:
    estimators.unregister_method("per_row_rates")
    estimators.unregister_method("not_masks")


# ---------------------------------------------------------------------------
# A task: sort four digits.
# ---------------------------------------------------------------------------


def _sort_example(digits: str) -> tasks.Example:
  answer = "".join(sorted(digits))
  return tasks.Example(question=f"sort {digits}", ground_truth=answer, reference=answer)


def _sorted_right(completion: str, example: tasks.Example) -> float:
  """The share of the four answer digits in place (0 without an answer)."""
  found = re.search(r"<answer>(\d{4})</answer>", completion)
  if found is None:
    return 0.0
  return sum(a == b for a, b in zip(found.group(1), example.ground_truth)) / 4


def _sort_generator(size, *, seed, split, **options):
  del options
  rng = np.random.default_rng([seed, split == "test"])
  return [_sort_example("".join(map(str, rng.integers(1, 5, size=4)))) for _ in range(size)]


def _sort_demonstrator(example, error_cells):
  """Its habitual mistake: the first ``error_cells`` digits one too high (4 wraps to 1)."""
  digits = list(example.reference)
  for i in range(min(error_cells, len(digits))):
    digits[i] = str(int(digits[i]) % 4 + 1)
  return "".join(digits)


@pytest.fixture
def sort_task():
  term = tasks.RewardTerm("correctness", 1.0, _sorted_right)
  task = tasks.register_task(tasks.Task(
      name="sort4", instruction="Sort the digits.", rewards={"stabledrl": (term,), "d1": (term,)},
      parse_answer=lambda completion: completion,
      score=lambda completion, example: tasks.ItemScore(4 * _sorted_right(completion, example),
                                                        4.0),
      example_from_record=lambda record: _sort_example(str(record["digits"])),
      generator=_sort_generator, demonstrate=_sort_demonstrator, suite_position=9))
  yield task
  tasks.unregister_task("sort4")
  assert "sort4" not in tasks.list_tasks() and "sort4" not in tasks.suite()


def test_a_task_registered_in_a_test_file_trains_and_evaluates(tmp_path, sort_task):
  """Its generator makes the data, its demonstrator the supervised start's answers, its reward
  the RL signal; ``evaluate --task all`` includes it (its suite position), after d1's four."""
  assert tasks.suite()[-1] == "sort4" and tasks.suite()[:4] == ["gsm8k", "math500", "countdown",
                                                                 "sudoku"]
  config = tiny_config(**{"task.name": "sort4", "task.with_instruction": False,
                          "tokenizer.alphabet": " /0123456789:<>Sadeklnoprstuwz",
                          "train.num_steps": 1, "eval.every_steps": 1, "sft.demo_error_cells": 1})
  history = trainer.train(config, str(tmp_path / "run"))
  assert len(history) == 1 and np.isfinite(history[0]["loss"])
  assert 0.0 <= history[0]["eval/accuracy"] <= 100.0
  assert evaluate.task_names(["all"])[-1] == "sort4"
  results = evaluate.run(evaluate.Options(
      checkpoint=str(tmp_path / "run"), task=["sort4"], output_dir=str(tmp_path / "eval"),
      gen_lengths=[16], limit=4, batch_size=2, shard_size=2, data=["sort4=synthetic"],
      block_length=16, steps=8))
  (setup, result), = results.items()
  assert setup.startswith("sort4") and result.n == 4 and 0.0 <= result.accuracy <= 100.0
