"""The trainer: config validation, every objective, skip-on-NaN, kill-and-resume, 8 devices."""

import dataclasses
import functools
import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from stabledrl_jax import estimators, models, objectives
from stabledrl_jax.models.llada import sampler as llada_sampler
from stabledrl_jax.training.config import config_lib, optimizer as optimizer_lib, run_spec, specs
from stabledrl_jax.training.inputs import data
from stabledrl_jax.training.loop import metrics_writer, sweep, trainer
from stabledrl_jax.training.parallel import multihost
from stabledrl_jax.training.state import checkpointing, supervised
from stabledrl_jax.training.step import rl_loss, rollout, train_step

REPO = pathlib.Path(__file__).resolve().parents[1]


# StableDRL scoring its plain ELBO estimate (no EUBO pass), as the toy updates below do.
_ELBO_STABLEDRL = objectives.stabledrl.StableDRLHparams(surrogate="elbo")


def _toy_run(spec, **fields):
  """The run spec of the toy updates: StableDRL on its ELBO, groups of 2, 6 generated tokens."""
  return run_spec.RunSpec(**{"objective": "stabledrl", "hparams": _ELBO_STABLEDRL,
                             "likelihood": spec, "group_size": 2, "gen_length": 6, **fields})

def load_config(name="quickstart"):
  return config_lib.from_file(REPO / "configs" / f"{name}.py")


def tiny_config(**updates):
  """The quickstart at toy size: a few SFT steps so that rewards are not all zero."""
  c = load_config()
  c.data.train_size = 64
  c.data.eval_size = 8
  c.rollout.update(num_prompts=2, group_size=4, steps=10)
  c.sft.update(num_steps=30, batch_size=16)
  c.train.update(num_steps=2, num_iterations=2)
  c.eval.update(every_steps=0)
  c.checkpoint.update(every_steps=1)
  return sweep.with_overrides(c, updates)


def workdir_with_start(path, sft_start):
  path.mkdir(parents=True, exist_ok=True)
  shutil.copytree(sft_start, path / supervised.SFT_DIR)
  return path


# ---------------------------------------------------------------------------
# Config validation: before anything is compiled, with the field named.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,match", [
    ("objective.name", "ppo", "objective.name"),
    ("rollout.gen_length", 30, "rollout.gen_length"),
    ("rollout.steps", 0, "rollout.steps"),
    ("rollout.remasking", "top_k", "rollout.remasking"),
    ("rollout.threshold", 1.5, "rollout.threshold"),
    ("rollout.block_length", 16, "rollout.gen_length"),
    ("estimator.method", "exact", "estimator.method"),
    ("objective.stabledrl.max_ratio", 0.0, "objective.stabledrl.max_ratio"),
    ("optimizer.learning_rate", -1.0, "optimizer.learning_rate"),
    ("train.microbatch_groups", 3, "train.microbatch_groups"),
    ("objective.grpo.level", "word", "objective.grpo.level"),
    ("estimator.stress.fraction", 1.5, "estimator.stress.fraction"),
    ("estimator.stress.fraction", -0.1, "estimator.stress.fraction"),
    ("estimator.stress.easy_rate", 0.0, "estimator.stress.easy_rate"),
    ("estimator.stress.hard_rate", 1.2, "estimator.stress.hard_rate"),
    ("estimator.stress.easy_rate", 0.9, "estimator.stress.easy_rate"),  # > hard_rate 0.8
    ("train.gradient_bound", True, "train.gradient_bound"),  # objective is wd1 below
])
def test_bad_config_values_name_the_field(field, value, match):
  config = tiny_config(**{field: value})
  if field.startswith("estimator.stress.") and value == 0.9:
    config.estimator.stress.hard_rate = 0.8
  if field == "objective.grpo.level":
    config.objective.name = "grpo"
  if field == "train.gradient_bound":
    config.objective.name = "wd1"
  with pytest.raises(ValueError, match=match.replace(".", r"\.")):
    specs.validate(config, num_devices=1)


@pytest.mark.parametrize("family", ["llada", "sdar", "dream"])
def test_scan_layers_reaches_the_model_config(family):
  config = tiny_config(**{"model.scan_layers": True, "model.family": family,
                          "rollout.remasking": models.family.get(family).remasking[-1]})
  specs.validate(config, num_devices=1)
  tokenizer = data.make_tokenizer(config.tokenizer)
  assert specs.model_config(config, tokenizer).scan_layers
  config.model.scan_layers = False
  assert not specs.model_config(config, tokenizer).scan_layers


def test_token_level_grpo_needs_mean_field():
  config = tiny_config(**{"objective.name": "grpo", "estimator.method": "elbo"})
  with pytest.raises(ValueError, match="mean_field"):
    specs.validate(config)


def test_a_kl_term_keeps_a_reference_model():
  config = tiny_config(**{"objective.name": "grpo", "estimator.method": ""})
  assert specs.objective_params(config).beta == 0.04 and specs.uses_reference(config)  # d1's
  assert not specs.uses_reference(tiny_config(**{"objective.name": "grpo",
                                                      "estimator.method": "",
                                                      "objective.grpo.beta": 0.0}))
  assert not specs.uses_reference(tiny_config(**{"objective.name": "stabledrl"}))


def test_mesh_must_match_the_devices():
  with pytest.raises(ValueError, match="config.mesh"):
    specs.validate(tiny_config(**{"mesh.data": 3}), num_devices=8)


@pytest.mark.parametrize("objective,level,official", [
    ("grpo", "token", dict(method="mean_field", num_samples=1, prompt_mask_prob=0.15,
                           coupled_ratio=True, normalize="sum")),
    ("grpo", "sequence", dict(method="elbo", num_samples=2, coupled_ratio=True)),
    ("espo", None, dict(method="espo_elbo", num_samples=2, coupled_ratio=True, normalize="sum")),
    ("spg", None, dict(method="block_random", num_samples=2, prompt_mask_prob=0.15,
                       block_length=32, normalize="mean")),
    ("wd1", None, dict(method="mean_field", num_samples=1, prompt_mask_prob=0.15,
                       normalize="sum")),
    ("stabledrl", None, dict(method="block_random", num_samples=2, prompt_mask_prob=0.15,
                             coupled_ratio=False, normalize="mean")),
])
def test_the_objective_name_alone_gives_its_official_estimator(objective, level, official):
  config = config_lib.base_config()
  config.objective.name = objective
  if level:
    config.objective.grpo.level = level
  settings = specs.estimator_settings(config)
  assert {k: settings[k] for k in official} == official
  # Every setting stays overridable; another method keeps its own option defaults.
  config.estimator.update(num_samples=3, coupled_ratio=not settings["coupled_ratio"])
  assert specs.estimator_settings(config)["num_samples"] == 3
  config.estimator.method = "block_random_unbiased"
  assert set(specs.estimator_settings(config)) == {
      "method", "num_samples", "normalize", "coupled_ratio", "block_length"}


def test_an_option_the_method_does_not_take_is_a_config_error():
  config = tiny_config(**{"estimator.schedule": "count"})  # the quickstart's elbo: fine
  specs.validate(config)
  config = tiny_config(**{"estimator.method": "mean_field", "estimator.block_length": 8})
  with pytest.raises(ValueError, match="estimator.block_length"):
    specs.validate(config)


@pytest.mark.parametrize("name", ["llada8b_gsm8k", "llada8b_math", "llada8b_countdown",
                                  "llada8b_sudoku", "sdar8b_math"])
def test_paper_configs_run_the_official_schedule_on_float32_master_weights(name):
  config = load_config(name)
  # The official total_steps counts optimizer updates: 2000 = 1000 rollout batches x mu 2.
  assert config.train.num_steps * config.train.num_iterations == 2000
  assert (config.model.param_dtype, config.model.dtype) == ("float32", "bfloat16")
  assert config.optimizer.schedule == "linear" and config.optimizer.end_lr_factor == 0.0
  assert specs.estimator_method(config) == "block_random"
  assert config.task.reward == "stabledrl"


def test_config_files_import_neither_jax_nor_flax():
  """Loading every config (as --help, a sweep or a notebook does) stays light: the schema is
  ml_collections only; what a run derives from it lives in training/config/specs.py."""
  script = ("import sys\n"
            "from stabledrl_jax.training.config import config_lib\n"
            "for name in config_lib.config_names():\n"
            "  config_lib.get(name)\n"
            "heavy = sorted(m for m in ('jax', 'flax', 'optax', 'orbax', 'numpy') if m in sys.modules)\n"
            "print(heavy)\n")
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]", out.stdout


def test_every_shipped_config_validates():
  names = config_lib.config_names()
  assert len(names) == len(list((REPO / "configs").glob("*.py"))) - 1  # All but __init__.py.
  for name in names:
    specs.validate(config_lib.get(name))


def test_the_run_spec_is_resolved_once_and_is_a_static_value():
  """``specs.resolve_run``: the objective, its hyperparameters and the likelihood spec of the
  config, in a frozen, hashable record (jit compiles once per distinct value)."""
  config = config_lib.get("llada8b_gsm8k")
  model_config = specs.model_config(config)
  run = specs.resolve_run(config, model_config)
  assert run == specs.resolve_run(config, model_config)
  assert hash(run) == hash(specs.resolve_run(config, model_config))
  assert (run.objective, run.hparams.max_ratio, run.likelihood.method) == (
      "stabledrl", 5.0, "block_random")
  assert run.needs_old and not run.coupled_ratio and not run.uses_reference
  assert run.num_microbatches == config.rollout.num_prompts  # The paper's one group each.
  assert run.initial_state().keys() == {"log_clip_hi"}
  other = config.copy_and_resolve_references()
  other.objective.stabledrl.max_ratio = 2.0
  assert specs.resolve_run(other, model_config) != run
  grpo = sweep.with_overrides(config, {"objective.name": "grpo"})
  assert specs.resolve_run(grpo, model_config).coupled_ratio  # d1's.
  assert specs.resolve_run(grpo, model_config).uses_reference


# ---------------------------------------------------------------------------
# The update step.
# ---------------------------------------------------------------------------


def _toy_update(advantages, tx=None):
  config = models.get_config("tiny", n_layers=1, vocab_size=16, mask_token_id=15,
                             eos_token_id=14)
  model = models.LLaDA(config, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  tx = tx or optax.adamw(1e-2)
  state = train_step.create_train_state(params, tx, seed=0)
  n, length = 4, 10
  tokens = jax.random.randint(jax.random.key(1), (n, length), 0, 14)
  prompt = jnp.zeros((n, length), bool).at[:, :4].set(True)
  batch = rl_loss.RolloutBatch(
      tokens=tokens, prompt_mask=prompt, completion_mask=~prompt,
      attention_mask=jnp.ones((n, length), bool), advantages=advantages,
      old_logp=jnp.zeros(n), ref_logp=jnp.zeros(n))
  spec = estimators.LikelihoodSpec(method="elbo", num_samples=2, normalize="mean",
                                   token_level=False, eubo_beta=None, family="llada", mask_id=15)
  new_state, metrics = train_step.update_step(
      state, batch, jax.random.key(2), graphdef=graphdef, tx=tx,
      run=_toy_run(spec, num_microbatches=2))
  return state, new_state, metrics


def test_non_finite_update_is_skipped_and_counted():
  state, new_state, metrics = _toy_update(jnp.array([1.0, -1.0, jnp.nan, 0.0]))
  assert int(metrics["skipped"]) == 1 and int(new_state.skipped_steps) == 1
  assert int(new_state.consecutive_skips) == 1
  chex_equal = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), state.params,
                            new_state.params)
  assert all(jax.tree.leaves(chex_equal))
  _, good_state, good = _toy_update(jnp.array([1.0, -1.0, 0.5, -0.5]))
  assert int(good["skipped"]) == 0 and int(good_state.consecutive_skips) == 0
  assert float(good["update_norm"]) > 0


def test_coupled_ratio_is_exactly_one_before_any_update():
  """l_old from the update's own key: the same masks, so log rho = 0 at the first update."""
  config = models.get_config("tiny", n_layers=1, vocab_size=16, mask_token_id=15,
                             eos_token_id=14)
  graphdef, params = nnx.split(models.LLaDA(config, rngs=nnx.Rngs(0)), nnx.Param)
  tx = optax.adamw(1e-2)
  n, length = 8, 10
  prompt = jnp.zeros((n, length), bool).at[:, :4].set(True)
  batch = rl_loss.RolloutBatch(
      tokens=jax.random.randint(jax.random.key(1), (n, length), 0, 14), prompt_mask=prompt,
      completion_mask=~prompt, attention_mask=jnp.ones((n, length), bool),
      advantages=jnp.array([1.0, -1.0] * 4), old_logp=jnp.zeros(n), ref_logp=jnp.zeros(n))
  spec = estimators.LikelihoodSpec(method="elbo", num_samples=2, normalize="mean",
                                   token_level=False, eubo_beta=None, family="llada", mask_id=15)
  key = jax.random.key(3)
  run = _toy_run(spec, num_microbatches=2)
  old = train_step.estimate_no_grad(params, batch, key, graphdef=graphdef, run=run)
  _, metrics = train_step.update_step(
      train_step.create_train_state(params, tx, seed=0), batch.replace(old_logp=old), key,
      graphdef=graphdef, tx=tx, run=run)
  assert abs(float(metrics["log_ratio/max"])) < 1e-6
  assert abs(float(metrics["log_ratio/min"])) < 1e-6
  other = train_step.estimate_no_grad(params, batch, jax.random.key(4), graphdef=graphdef,
                                      run=run)
  assert float(jnp.max(jnp.abs(other - old))) > 1e-3  # independent masks: estimator noise


def _toy_model_and_batch(n=8, length=10, seed=1):
  config = models.get_config("tiny", n_layers=1, vocab_size=16, mask_token_id=15,
                             eos_token_id=14)
  graphdef, params = nnx.split(models.LLaDA(config, rngs=nnx.Rngs(0)), nnx.Param)
  keys = jax.random.split(jax.random.key(seed), 3)
  prompt = jnp.zeros((n, length), bool).at[:, :4].set(True)
  batch = rl_loss.RolloutBatch(
      tokens=jax.random.randint(keys[0], (n, length), 0, 14), prompt_mask=prompt,
      completion_mask=~prompt, attention_mask=jnp.ones((n, length), bool),
      advantages=jax.random.normal(keys[1], (n,)),
      old_logp=1e4 * jax.random.normal(keys[2], (n,)),  # Wildly wrong ratios.
      ref_logp=jnp.zeros(n), stressed=jnp.arange(n) % 2 == 0)
  return graphdef, params, batch


@pytest.mark.parametrize("surrogate", ["elbo", "sandwich"])
def test_gradient_bound_matches_per_sample_gradients(surrogate):
  """||grad s_j|| from the vmapped rows == a loop over full-batch gradients."""
  graphdef, params, batch = _toy_model_and_batch()
  spec = estimators.LikelihoodSpec(method="elbo", num_samples=2, normalize="mean",
                                   token_level=False, family="llada", mask_id=15,
                                   stress_rates=(0.2, 1.0),
                                   eubo_beta=1.5 if surrogate == "sandwich" else None)
  logits_fn_of = lambda p, m: rl_loss.model_logits_fn(nnx.merge(graphdef, p), m)
  key = jax.random.key(5)
  vmapped = rl_loss.surrogate_gradient_norms(
      logits_fn_of, params, batch, key, spec=spec,
      surrogate=lambda inputs: objectives.spg.surrogate_logp(inputs, surrogate, 0.5))
  masks = rl_loss.estimator_masks(batch, key, spec, stress_mode="easy")

  def s(p, j):  # The whole batch scored at once; row j's surrogate.
    logp, eubo = rl_loss.estimate(logits_fn_of(p, batch.attention_mask), batch, None, spec,
                                  masks=masks)
    inputs = rl_loss.objective_inputs(batch, logp, eubo, spec, use_reference=False)
    return objectives.spg.surrogate_logp(inputs, surrogate, 0.5)[j]

  grad_s = jax.jit(jax.grad(s))  # j traced: one compilation for every row.
  norms = [float(optax.tree.norm(grad_s(params, jnp.int32(j)))) for j in range(len(batch.tokens))]
  np.testing.assert_allclose(vmapped, norms, rtol=1e-5)


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_stabledrl_gradient_stays_inside_its_convex_hull_bound(num_microbatches):
  """docs/stress_test.md: ||grad|| <= max_j |A_j| ||grad s_j||, even with log rho of +-1e4."""
  graphdef, params, batch = _toy_model_and_batch()
  spec = estimators.LikelihoodSpec(method="elbo", num_samples=2, normalize="mean",
                                   token_level=False, eubo_beta=None, family="llada", mask_id=15,
                                   stress_rates=(0.2, 1.0))
  tx = optax.sgd(1e-3)
  _, metrics = train_step.update_step(
      train_step.create_train_state(params, tx, seed=0), batch, jax.random.key(2),
      graphdef=graphdef, tx=tx,
      run=_toy_run(spec, num_microbatches=num_microbatches, gradient_bound=True))
  assert float(metrics["grad_norm"]) > 0
  assert float(metrics["grad_norm"]) <= float(metrics["grad_bound/max"]) * (1 + 1e-5)
  np.testing.assert_allclose(metrics["grad_norm_over_bound/max"],
                             metrics["grad_norm"] / metrics["grad_bound/max"], rtol=1e-6)


def test_zero_advantages_give_a_zero_bound_ratio_not_nan():
  graphdef, params, batch = _toy_model_and_batch()
  batch = batch.replace(advantages=jnp.zeros_like(batch.advantages))
  spec = estimators.LikelihoodSpec(method="elbo", num_samples=1, normalize="mean",
                                   token_level=False, eubo_beta=None, family="llada", mask_id=15)
  tx = optax.sgd(1e-3)
  _, metrics = train_step.update_step(
      train_step.create_train_state(params, tx, seed=0), batch, jax.random.key(2),
      graphdef=graphdef, tx=tx, run=_toy_run(spec, gradient_bound=True))
  assert float(metrics["grad_bound/max"]) == 0 and float(metrics["grad_norm"]) == 0
  assert float(metrics["grad_norm_over_bound/max"]) == 0


def test_estimates_of_left_padded_rows_match_one_sequence_at_a_time():
  # The estimator's B x K rows and the attention mask that model_logits_fn repeats for them must
  # be in the same (sequence-major) order: a left-padded row scored with another row's mask would
  # differ.
  config = models.get_config("tiny")
  model = models.LLaDA(config, rngs=nnx.Rngs(0))
  n, length, k = 3, 12, 3
  tokens = jax.random.randint(jax.random.key(1), (n, length), 0, 100)
  attention = jnp.arange(length)[None] >= jnp.array([[0], [3], [5]])  # Left padding 0, 3, 5.
  prompt = attention & (jnp.arange(length)[None] < 7)
  completion = jnp.broadcast_to(jnp.arange(length) >= 7, (n, length))
  batch = rl_loss.RolloutBatch(
      tokens=tokens, prompt_mask=prompt, completion_mask=completion, attention_mask=attention,
      advantages=jnp.zeros(n), old_logp=jnp.zeros(n), ref_logp=jnp.zeros(n))
  spec = estimators.LikelihoodSpec(method="elbo", num_samples=k, normalize="sum", token_level=False,
                                   eubo_beta=None, family="llada", mask_id=config.mask_token_id)
  masks = rl_loss.estimator_masks(batch, jax.random.key(2), spec)
  together, _ = rl_loss.estimate(rl_loss.model_logits_fn(model, attention), batch, None, spec,
                                 masks=masks)
  for i in range(n):
    row = jax.tree.map(lambda x: x[i:i + 1], batch)
    row_masks = jax.tree.map(lambda x: x[:, i:i + 1], masks)
    alone, _ = rl_loss.estimate(rl_loss.model_logits_fn(model, row.attention_mask), row, None,
                                spec, masks=row_masks)
    np.testing.assert_allclose(together[i], alone[0], rtol=1e-5)


@pytest.mark.parametrize("method,token_level,eubo", [
    ("block_random", False, 1.5), ("mean_field", True, None)])
def test_completion_only_logits_give_the_same_estimates(method, token_level, eubo):
  # scored_suffix: the model computes logits for the last G positions alone (the last block's
  # queries and the head skip the prompt). Estimates, EUBOs, token log-probs and gradients must
  # equal those of full logits, left-padded prompts included.
  config = models.get_config("tiny")
  graphdef, params = nnx.split(models.LLaDA(config, rngs=nnx.Rngs(0)), nnx.Param)
  n, prompt_length, gen = 4, 7, 8
  length = prompt_length + gen
  tokens = jax.random.randint(jax.random.key(1), (n, length), 0, 100)
  attention = jnp.arange(length)[None] >= jnp.array([[0], [3], [5], [1]])
  prompt = attention & (jnp.arange(length)[None] < prompt_length)
  completion = jnp.broadcast_to(jnp.arange(length) >= prompt_length, (n, length))
  batch = rl_loss.RolloutBatch(
      tokens=tokens, prompt_mask=prompt, completion_mask=completion, attention_mask=attention,
      advantages=jnp.zeros(n), old_logp=jnp.zeros(n), ref_logp=jnp.zeros(n))
  options = (("block_length", 4),) if method == "block_random" else ()
  full = estimators.LikelihoodSpec(method=method, num_samples=2, normalize="sum",
                                   token_level=token_level, eubo_beta=eubo,
                                   family="llada", mask_id=config.mask_token_id, options=options)
  suffix = dataclasses.replace(full, scored_suffix=gen)

  def run(spec):
    def total(p):
      logits_fn = rl_loss.model_logits_fn(nnx.merge(graphdef, p), attention)
      logp, eubo_value = rl_loss.estimate(logits_fn, batch, jax.random.key(2), spec)
      return jnp.sum(logp) + (0.0 if eubo_value is None else jnp.sum(eubo_value)), (
          logp, eubo_value)
    return jax.grad(total, has_aux=True)(params)

  (grads_full, (logp_full, eubo_full)), (grads_suffix, (logp_suffix, eubo_suffix)) = (
      run(full), run(suffix))
  np.testing.assert_allclose(logp_suffix, logp_full, rtol=2e-5, atol=2e-5)
  if eubo is not None:
    np.testing.assert_allclose(eubo_suffix, eubo_full, rtol=2e-5, atol=2e-5)
  # Two programs, two summation orders: each leaf agrees to float32 rounding of its own scale
  # (measured: at most 1.3e-6 of the leaf's largest entry; a wrong gradient is off by O(1)).
  for got, want in zip(jax.tree.leaves(grads_suffix), jax.tree.leaves(grads_full)):
    want = np.asarray(want)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-5 * np.abs(want).max())


def test_a_bad_scored_suffix_is_an_error():
  logits_fn = lambda tokens, suffix=None: jnp.zeros(tokens.shape + (5,))
  noisy = jnp.zeros((1, 2, 6), bool)
  with pytest.raises(ValueError, match=r"suffix must lie in \[1, 6\]"):
    estimators.token_logprobs(logits_fn, jnp.zeros((2, 6), jnp.int32), noisy, 4, suffix=7)


def test_adam_moments_are_sharded_like_their_parameters():
  mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  model = nnx.eval_shape(lambda: models.LLaDA(models.get_config("tiny"), rngs=nnx.Rngs(0)))
  _, params = nnx.split(model, nnx.Param)
  param_shardings = models.param_shardings(params, mesh)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  shardings = train_step.state_shardings(tx, params, param_shardings, replicated)
  specs = lambda tree: [s.spec for s in jax.tree.leaves(tree)]
  adam = shardings.opt_state[1][0]
  assert specs(adam.mu) == specs(adam.nu) == specs(param_shardings)
  assert any(spec != jax.sharding.PartitionSpec() for spec in specs(adam.mu))  # Not all replicated.
  assert adam.count == shardings.step == shardings.key == replicated


def test_microbatches_keep_groups_whole():
  batch = jnp.arange(12)  # 6 groups of 2, microbatch m gets groups m, m + 3.
  split = train_step._split_microbatches(batch, 3, 2)
  np.testing.assert_array_equal(split, [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]])
  np.testing.assert_array_equal(train_step._merge_microbatches(split, 3, 2), batch)


# ---------------------------------------------------------------------------
# End to end.
# ---------------------------------------------------------------------------


def _final_params(workdir):
  ckpt = checkpointing.Checkpointer(workdir)
  step = ckpt.latest_step()
  path = os.path.join(ckpt.directory, str(step), "state")
  ckpt.close()
  import orbax.checkpoint as ocp
  restored = ocp.StandardCheckpointer().restore(path)
  return step, restored["params"]


def _comparable(records):
  return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "perf/"))}
          for r in records]


@pytest.mark.slow
@pytest.mark.parametrize("objective,extra", [
    ("stabledrl", {}),
    ("grpo", {"objective.grpo.level": "token", "estimator.method": ""}),  # d1: mean_field
    ("grpo", {"objective.grpo.level": "sequence"}),
    ("espo", {"estimator.schedule": "count", "estimator.coupled": True}),
    ("espo", {"estimator.method": "", "estimator.num_samples": None}),  # its official ELBO, KL
    ("stabledrl", {"estimator.method": "", "estimator.num_samples": None,  # the paper's
                   "objective.stabledrl.surrogate": "sandwich"}),
    ("spg", {}),
    ("wd1", {}),
])
def test_every_objective_runs_a_step(objective, extra, tmp_path, sft_start):
  config = tiny_config(**{"objective.name": objective, "train.num_steps": 1,
                          "train.num_iterations": 1, **extra})
  history = trainer.train(config, str(workdir_with_start(tmp_path, sft_start)))
  assert len(history) == 1
  record = history[0]
  for name in ("loss", "grad_norm", "rewards/mean", "skipped_steps", "update_norm"):
    assert np.isfinite(record[name]), (name, record)
  # The reward's terms (sudoku: correctness plus StableDRL's anti-short-boxed term) add up.
  assert record["rewards/mean"] == pytest.approx(
      record["rewards/correctness"] + record["rewards/anti_short_boxed"], abs=1e-6)
  lines = metrics_writer.read_metrics(str(tmp_path / "metrics.jsonl"))
  assert [r["step"] for r in lines] == [1]


@dataclasses.dataclass(frozen=True)
class _SignHparams:
  """A toy objective's hyperparameters, with its own check."""

  scale: float = 1.0

  def check(self):
    if self.scale <= 0:
      raise ValueError(f"scale: must be > 0, got {self.scale}")


def _sign_objective(inputs, hparams, group_size):
  """REINFORCE on the sign of the advantage: a toy that no other file knows about. Its state is
  an average of the positive-sign fraction over RL steps, which it reports."""
  del group_size
  sign = jnp.sign(inputs.advantages)
  return -hparams.scale * jnp.mean(sign * inputs.logp), {
      "sign/positive": jnp.mean(sign > 0), "sign/average": inputs.state["average"]}


def _sign_update(state, metrics, hparams):
  del hparams
  return {"average": 0.5 * state["average"] + 0.5 * metrics["sign/positive"]}


def test_an_objective_registered_in_a_test_file_trains(tmp_path, sft_start):
  """Adding an objective, with state, is one registration: the config check, the likelihood
  spec, the update step, the state's update and checkpoint, the metrics and the sweeps pick it
  up; its hyperparameters come from its own section."""
  objectives.register_objective(
      "sign_test", hparams=_SignHparams, estimator=dict(method="elbo", num_samples=1),
      init_state=lambda hparams: {"average": jnp.zeros((), jnp.float32)},
      update_state=_sign_update, metrics=("sign/positive", "sign/average"))(_sign_objective)
  try:
    config = sweep.with_overrides(tiny_config(**{"train.num_steps": 3}),
                                  {"objective.name": "sign_test"})
    config.objective.sign_test = ml_collections.ConfigDict({"scale": 2.0})
    assert specs.objective_params(config) == _SignHparams(scale=2.0)
    assert specs.estimator_settings(config)["method"] == "elbo"
    workdir = workdir_with_start(tmp_path, sft_start)
    history = trainer.train(config, str(workdir))
    assert len(history) == 3 and all(0.0 <= h["sign/positive"] <= 1.0 for h in history)
    assert np.isfinite(history[0]["loss"]) and history[0]["sign/average"] == 0.0
    average = 0.0
    for record in history:  # Each step sees the state the previous steps left.
      assert record["sign/average"] == pytest.approx(average, abs=1e-6)
      average = 0.5 * average + 0.5 * record["sign/positive"]
    resumed = trainer.Trainer(config, str(workdir))  # The state is checkpointed.
    try:
      assert float(resumed.state.objective_state["average"]) == pytest.approx(average, abs=1e-6)
    finally:
      resumed.close()
    config.objective.sign_test.scale = -1.0
    with pytest.raises(ValueError, match="config.objective.sign_test.scale: must be > 0"):
      specs.validate(config)
    config.objective.sign_test = ml_collections.ConfigDict({"scael": 2.0})
    with pytest.raises(ValueError, match="config.objective.sign_test.scael"):
      specs.validate(config)
    assert "sign_test" in sweep.objective_variants()
  finally:
    objectives.unregister_objective("sign_test")
  assert "sign_test" not in objectives.objective_names()


def test_every_objective_reports_its_declared_metrics():
  """The metrics a registration declares are among those its loss returns."""
  g, n = 4, 8
  rng = np.random.default_rng(0)
  inputs = objectives.ObjectiveInputs(
      logp=jnp.asarray(rng.normal(size=n), jnp.float32),
      advantages=jnp.asarray(rng.normal(size=n), jnp.float32),
      old_logp=jnp.asarray(rng.normal(size=n), jnp.float32),
      ref_logp=jnp.asarray(rng.normal(size=n), jnp.float32),
      eubo=jnp.asarray(rng.normal(size=n), jnp.float32),
      lengths=jnp.full((n,), 5.0))
  for objective in objectives.objectives():
    hparams = objective.make_hparams()
    _, metrics = objective(inputs.replace(state=objective.initial_state(hparams), gen_length=16),
                           hparams, g)
    assert set(objective.metrics) <= set(metrics), objective.name


@pytest.mark.slow
def test_stress_masks_make_the_log_ratio_explode(tmp_path, sft_start):
  """docs/stress_test.md: easy numerator / hard denominator masks blow up log rho.

  Sequence-level GRPO (sum-form ELBO), one update, with the coupled ratio so that
  estimator noise is out of the picture: without stress log rho is exactly 0 before
  the update, with every sample stressed it is the easy-minus-hard gap.
  """
  def log_ratios(name, fraction):
    config = tiny_config(**{"objective.name": "grpo", "objective.grpo.level": "sequence",
                            "train.num_steps": 1, "train.num_iterations": 1,
                            "estimator.coupled_ratio": True,
                            "estimator.stress.fraction": fraction})
    record = trainer.train(config, str(workdir_with_start(tmp_path / name, sft_start)))[0]
    np.testing.assert_allclose(record["log10_ratio/max"], record["log_ratio/max"] / np.log(10),
                               rtol=1e-6)
    return record["log_ratio/min"], record["log_ratio/mean"], record["log_ratio/max"]

  normal = log_ratios("normal", 0.0)
  np.testing.assert_allclose(normal, 0.0, atol=1e-5)
  _, stress_mean, stress_max = log_ratios("stress", 1.0)
  assert stress_mean > 5.0 and stress_max > 10.0, (stress_mean, stress_max)


def test_stress_selection_is_shared_by_numerator_and_denominator():
  """l_theta (easy) and l_old (hard) differ only on the selected samples."""
  config = models.get_config("tiny", n_layers=1, vocab_size=16, mask_token_id=15,
                             eos_token_id=14)
  model = models.LLaDA(config, rngs=nnx.Rngs(0))
  n, length = 6, 12
  prompt = jnp.zeros((n, length), bool).at[:, :4].set(True)
  stressed = jnp.array([True, False, True, False, False, True])
  batch = rl_loss.RolloutBatch(
      tokens=jax.random.randint(jax.random.key(1), (n, length), 0, 14), prompt_mask=prompt,
      completion_mask=~prompt, attention_mask=jnp.ones((n, length), bool),
      advantages=jnp.zeros(n), old_logp=jnp.zeros(n), ref_logp=jnp.zeros(n), stressed=stressed)
  spec = estimators.LikelihoodSpec(method="elbo", num_samples=2, normalize="sum",
                                   token_level=False, eubo_beta=None, family="llada", mask_id=15,
                                   stress_rates=(0.125, 1.0))
  logits_fn = rl_loss.model_logits_fn(model, batch.attention_mask)
  key = jax.random.key(3)
  plain, _ = rl_loss.estimate(logits_fn, batch, key, spec)
  easy, _ = rl_loss.estimate(logits_fn, batch, key, spec, stress_mode="easy")
  hard, _ = rl_loss.estimate(logits_fn, batch, key, spec, stress_mode="hard")
  np.testing.assert_array_equal(easy[~stressed], plain[~stressed])
  np.testing.assert_array_equal(hard[~stressed], plain[~stressed])
  assert np.all(np.abs(easy[stressed] - hard[stressed]) > 1e-3)
  # Without stress rates in the spec, the mode changes nothing.
  off = dataclasses.replace(spec, stress_rates=None)
  np.testing.assert_array_equal(rl_loss.estimate(logits_fn, batch, key, off, "easy")[0], plain)


def test_rollout_statistics_are_the_rows_columns_and_their_metrics():
  """One process: ``RolloutStats.gather`` keeps every row; its metrics, re-derived in numpy."""
  rng = np.random.default_rng(0)
  rewards = np.array([1.0, 1.0, 0.0, 2.0, 0.5, 0.5])  # Groups of 2: the first and last constant.
  components = rng.uniform(size=(6, 2))
  calls, lengths = np.array([4, 4, 5, 6, 7, 8]), np.array([3, 9, 2, 5, 5, 1])
  truncated = np.array([False, True, False, False, True, True])
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",))
  split = multihost.row_split(models.batch_sharding(mesh, ndim=1), 6)
  stats = rollout.RolloutStats.gather(split, rewards=rewards, abs_advantages=np.abs(rewards - 1),
                                      lengths=lengths, model_calls=calls, truncated=truncated,
                                      components=components)
  np.testing.assert_array_equal(stats.components, components.astype(np.float32))
  got = stats.metrics(["a", "b"], group_size=2)
  want = {"rewards/mean": rewards.mean(), "rewards/std": rewards.std(),
          "rewards/a": components[:, 0].mean(), "rewards/b": components[:, 1].mean(),
          "frac_reward_zero_std": 2 / 3, "advantage/abs_mean": np.abs(rewards - 1).mean(),
          "completions/mean_length": lengths.mean(), "completions/min_length": 1,
          "completions/max_length": 9, "completions/clipped_ratio": 0.5,
          "rollout/calls_per_completion": calls.mean()}
  assert set(got) == set(want)
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-6, err_msg=name)


@pytest.mark.slow
def test_too_many_skips_stop_the_run_and_keep_the_checkpoint(tmp_path, monkeypatch, sft_start):
  workdir_with_start(tmp_path, sft_start)
  # Two updates per step: the second NaN step reaches 4 consecutive skips >= 3.
  config = tiny_config(**{"train.num_steps": 1, "train.max_consecutive_skips": 3})
  trainer.train(config, str(tmp_path))
  step, before = _final_params(str(tmp_path))
  assert step == 1
  config.train.num_steps = 4
  nan_advantages = lambda rewards, group_size, **kw: jnp.full(rewards.shape, jnp.nan)
  monkeypatch.setattr(objectives, "group_advantages", nan_advantages)  # As the rollouts see it.
  with pytest.raises(trainer.TooManySkipsError, match="consecutive"):
    trainer.train(config, str(tmp_path))
  step, after = _final_params(str(tmp_path))
  assert step == 1
  jax.tree.map(np.testing.assert_array_equal, before, after)
  records = metrics_writer.read_metrics(str(tmp_path / "metrics.jsonl"))
  assert [r["skipped_steps"] for r in records] == [0, 2, 4]
  # The recorder flags the skipped steps; with no finite norm (and no history after the resume)
  # there is no ratio to the median to log.
  assert [r.get("spike/step") for r in records] == [None, 2, 3]
  assert not any("spike/grad_norm_over_median" in r for r in records)


def _cli(workdir, *overrides):
  return [sys.executable, "-m", "stabledrl_jax.train", f"--config={REPO / 'configs/quickstart.py'}",
          f"--workdir={workdir}", *overrides]


TINY_FLAGS = ("--config.data.train_size=64", "--config.data.eval_size=8",
              "--config.rollout.num_prompts=2", "--config.rollout.group_size=4",
              "--config.rollout.steps=10", "--config.sft.num_steps=30",
              "--config.sft.batch_size=16", "--config.eval.every_steps=0",
              "--config.checkpoint.every_steps=1", "--config.train.num_steps=5")


def test_a_time_interval_saves_between_the_step_interval(tmp_path, sft_start):
  """checkpoint.every_seconds saves once that much time has passed, whatever every_steps says."""
  for name, seconds, want in (("by_steps", 0.0, [2]), ("by_time", 1e-6, [1, 2])):
    config = tiny_config(**{"checkpoint.every_steps": 1000, "checkpoint.every_seconds": seconds})
    workdir = workdir_with_start(tmp_path / name, sft_start)
    trainer.train(config, str(workdir))
    assert checkpointing.Checkpointer(workdir, read_only=True).all_steps() == want, name


@pytest.mark.slow
def test_kill_and_resume_matches_an_uninterrupted_run(tmp_path, sft_start):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  reference = workdir_with_start(tmp_path / "reference", sft_start)
  subprocess.run(_cli(reference, *TINY_FLAGS), check=True, env=env, capture_output=True)
  killed = workdir_with_start(tmp_path / "killed", sft_start)
  process = subprocess.Popen(_cli(killed, *TINY_FLAGS), env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  while time.time() < deadline and process.poll() is None:
    steps = [r["step"] for r in metrics_writer.read_metrics(str(killed / "metrics.jsonl"))]
    if steps and max(steps) >= 3:
      break
    time.sleep(0.05)
  assert process.poll() is None, "the run finished before it could be killed"
  process.send_signal(signal.SIGKILL)
  process.wait()
  subprocess.run(_cli(killed, *TINY_FLAGS), check=True, env=env, capture_output=True)

  step_a, params_a = _final_params(str(reference))
  step_b, params_b = _final_params(str(killed))
  assert step_a == step_b == 5
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=0), params_a,
               params_b)
  metrics_a = _comparable(metrics_writer.read_metrics(str(reference / "metrics.jsonl")))
  metrics_b = _comparable(metrics_writer.read_metrics(str(killed / "metrics.jsonl")))
  assert [r["step"] for r in metrics_b] == [1, 2, 3, 4, 5]
  assert metrics_a == metrics_b


_LOSSES_SCRIPT = """
import json, sys
import jax
from stabledrl_jax.training.loop import trainer
sys.path.insert(0, {tests!r})
from test_training import tiny_config
config = tiny_config(**{{"mesh.data": {data}, "mesh.fsdp": {fsdp}, "mesh.tensor": {tensor}}})
history = trainer.train(config, {workdir!r})
print(json.dumps({{"devices": jax.device_count(), "loss": [h["loss"] for h in history],
                  "reward": [h["rewards/mean"] for h in history]}}))
"""


@pytest.mark.slow
def test_eight_fake_devices_give_the_same_losses(tmp_path, sft_start):
  def run(devices, mesh, workdir):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    script = _LOSSES_SCRIPT.format(tests=str(REPO / "tests"), workdir=str(workdir),
                                   data=mesh[0], fsdp=mesh[1], tensor=mesh[2])
    out = subprocess.run([sys.executable, "-c", script], check=True, env=env,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])

  single = run(1, (1, 1, 1), workdir_with_start(tmp_path / "one", sft_start))
  sharded = run(8, (2, 2, 2), workdir_with_start(tmp_path / "eight", sft_start))
  assert single["devices"] == 1 and sharded["devices"] == 8
  np.testing.assert_allclose(sharded["reward"], single["reward"], atol=1e-6)
  np.testing.assert_allclose(sharded["loss"], single["loss"], atol=1e-5)


@pytest.mark.parametrize("param_dtype,min_changed,max_changed", [
    ("float32", 0.99, 1.0),  # Master weights: every weight moves.
    ("bfloat16", 0.0, 0.2),  # The failure it prevents: most updates round away.
])
def test_float32_master_weights_keep_paper_size_updates(param_dtype, min_changed, max_changed):
  """One AdamW update at the paper's lr 2e-6 (wd 0.1, clip 0.2) on weights of std 0.02,
  computed in bfloat16: with float32 parameters at least 99% of the weights change."""
  config = tiny_config(**{"model.dtype": "bfloat16", "model.param_dtype": param_dtype,
                          "optimizer.learning_rate": 2e-6, "optimizer.weight_decay": 0.1,
                          "optimizer.grad_clip": 0.2, "objective.name": "stabledrl"})
  model = models.init_model(specs.model_config(config), seed=0)
  graphdef, params = nnx.split(model, nnx.Param)
  params = jax.tree.map(  # Matrices of std 0.02 (norm scales stay 1), stored in param_dtype.
      lambda p, k: (0.02 * jax.random.normal(k, p.shape)).astype(p.dtype) if p.ndim > 1 else p,
      params,
      jax.tree.unflatten(jax.tree.structure(params),
                         list(jax.random.split(jax.random.key(0), len(jax.tree.leaves(params))))))
  assert all(p.dtype == jnp.dtype(param_dtype) for p in jax.tree.leaves(params))
  tx = optimizer_lib.make_optimizer(config.optimizer, 10)
  state = train_step.create_train_state(params, tx, seed=0)
  assert all(m.dtype == jnp.dtype(param_dtype) for m in jax.tree.leaves(state.opt_state)
             if hasattr(m, "dtype") and m.ndim)
  n, prompt, gen = 8, config.rollout.prompt_length, config.rollout.gen_length
  length = prompt + gen
  tokens = jax.random.randint(jax.random.key(1), (n, length), 0, model.config.vocab_size - 1)
  positions = jnp.arange(length)[None]
  batch = rl_loss.RolloutBatch(
      tokens=tokens, prompt_mask=jnp.broadcast_to(positions < prompt, (n, length)),
      completion_mask=jnp.broadcast_to(positions >= prompt, (n, length)),
      attention_mask=jnp.ones((n, length), bool),
      advantages=jnp.tile(jnp.array([1.0, -1.0]), n // 2), old_logp=jnp.zeros(n),
      ref_logp=jnp.zeros(n))
  new_state, metrics = jax.jit(functools.partial(
      train_step.update_step, graphdef=graphdef, tx=tx,
      run=dataclasses.replace(specs.resolve_run(config, model.config), num_microbatches=1,
                              uses_reference=False)))(state, batch, jax.random.key(2))
  assert int(metrics["skipped"]) == 0
  changed = sum(int(jnp.sum(a != b)) for a, b in zip(jax.tree.leaves(new_state.params),
                                                    jax.tree.leaves(params)))
  total = sum(p.size for p in jax.tree.leaves(params))
  assert min_changed <= changed / total <= max_changed, changed / total


def test_cached_rollouts_train_and_evaluation_stays_exact(tmp_path, monkeypatch):
  """rollout.cache=dual: the rollouts use the KV-cached sampler, the periodic evaluation the
  exact one; SDAR, whose sampler caches exactly already, takes only 'none'."""
  seen = []
  real = llada_sampler.sample
  monkeypatch.setattr(llada_sampler, "sample", lambda *a: seen.append(a[4].cache) or real(*a))
  config = tiny_config(**{"sft.num_steps": 0, "train.num_steps": 1, "train.num_iterations": 1,
                          "eval.every_steps": 1, "rollout.cache": "dual"})
  history = trainer.train(config, str(tmp_path))
  assert np.isfinite(history[0]["loss"]) and "eval/accuracy" in history[0]
  assert "dual" in seen and "none" in seen
  with pytest.raises(ValueError, match=r"config\.rollout\.cache: 'dual' is not one of \('none',\)"):
    specs.validate(sweep.with_overrides(config, {"model.family": "sdar"}))
  with pytest.raises(ValueError, match=r"config\.rollout\.cache: 'full'"):
    specs.validate(sweep.with_overrides(config, {"rollout.cache": "full"}))


# The command line with the supervised start's second step held 600 s inside one jitted call,
# so that signals land inside a step however fast the machine is. It prints SLOW_STEP as it
# enters that step: after step 0's stop check, so that no signal can be taken at that boundary.
SLOW_STEP = "slow sft step"
_SLOW_SFT = f"""
import sys, time
import jax, numpy as np
from stabledrl_jax.training.state import supervised
real, calls = supervised._sft_step, []

def slow(*args, **kwargs):
  calls.append(1)
  if len(calls) == 2:
    print({SLOW_STEP!r}, flush=True)
    wait = lambda x: jax.pure_callback(lambda y: (time.sleep(600), y)[1],
                                       jax.ShapeDtypeStruct((), np.float32), x)
    jax.block_until_ready(jax.jit(wait)(np.float32(0)))
  return real(*args, **kwargs)

supervised._sft_step = slow
from stabledrl_jax import train
sys.argv = ["stabledrl_jax.train", *sys.argv[1:]]
train.run()
"""


def _start_and_signal(workdir, signals, flags, env, *, slow=False):
  """Starts the CLI on ``workdir``; once it prints ``sft step 0`` (``slow``: once it enters its
  supervised step 1, which takes 600 s) sends ``signals`` (0.2 s apart). Returns (exit code,
  output)."""
  command = _cli(workdir, *flags)
  ready = "sft step 0"
  if slow:
    command = [sys.executable, "-c", _SLOW_SFT, *command[3:]]
    ready = SLOW_STEP
  process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
  lines = []
  try:
    for line in process.stdout:
      lines.append(line)
      if line.startswith(ready):
        for signum in signals:
          process.send_signal(signum)
          time.sleep(0.2)
        break
    lines.append(process.stdout.read())
    return process.wait(timeout=300), "".join(lines)
  finally:
    if process.poll() is None:
      process.kill()
      process.wait()


SFT_STOP_FLAGS = (*TINY_FLAGS[:-1], "--config.sft.num_steps=60", "--config.train.num_steps=1")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_the_supervised_start_saves_it_and_the_rerun_continues(tmp_path,
                                                                               signum):
  """SIGTERM or Ctrl-C during the supervised start: its progress is saved at the next step and
  the run exits 0, releasing the workdir; the rerun continues from that step (it does not
  start again) and fits the start an uninterrupted run fits."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  workdir = tmp_path / "stopped"
  code, out = _start_and_signal(workdir, [signum], SFT_STOP_FLAGS, env)
  assert code == 0, out
  saved = checkpointing.Checkpointer(workdir, read_only=True, subdir=supervised.SFT_PROGRESS_DIR)
  steps = saved.all_steps()
  saved.close()
  assert len(steps) == 1 and 1 <= steps[0] < 60, (steps, out)
  assert f"saved the supervised start's step {steps[0]} of 60" in out
  assert not (workdir / checkpointing.WorkdirLock.NAME).exists()
  assert not (workdir / supervised.SFT_DIR).exists()

  rerun = subprocess.run(_cli(workdir, *SFT_STOP_FLAGS), env=env, capture_output=True,
                         text=True, timeout=600)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert f"continuing the supervised start from step {steps[0]}" in rerun.stderr
  assert "sft step 0:" not in rerun.stdout  # Continued, not started again.
  assert not (workdir / supervised.SFT_PROGRESS_DIR).exists()
  assert [r["step"] for r in metrics_writer.read_metrics(str(workdir / "metrics.jsonl"))] == [1]

  # The reference: the same supervised start, never interrupted, in this process.
  reference = tmp_path / "reference"
  trainer.train(tiny_config(**{"sft.num_steps": 60, "train.num_steps": 0}), str(reference))
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  got = load_file(str(workdir / supervised.SFT_DIR / "model.safetensors"))
  want = load_file(str(reference / supervised.SFT_DIR / "model.safetensors"))
  assert got.keys() == want.keys()
  for name in want:
    np.testing.assert_allclose(got[name], want[name], atol=1e-6, rtol=0, err_msg=name)


@pytest.mark.slow
def test_a_second_ctrl_c_during_the_supervised_start_stops_at_once_and_cleanly(tmp_path):
  """Two Ctrl-Cs inside a supervised step: the run stops without saving, exit code 130 (not a
  segmentation fault from XLA's threads outliving the interpreter), the workdir released."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  workdir = tmp_path / "aborted"
  code, out = _start_and_signal(workdir, [signal.SIGINT, signal.SIGINT], SFT_STOP_FLAGS, env,
                                slow=True)
  assert code == 128 + signal.SIGINT, out
  assert "Interrupted again" in out and "Segmentation fault" not in out, out
  assert not (workdir / checkpointing.WorkdirLock.NAME).exists()
  assert not (workdir / supervised.SFT_DIR).exists()


def test_a_chunked_rollout_runs_a_step(tmp_path, sft_start):
  """rollout.microbatch_groups = 1: the 2 x 4 rollouts decoded in two sampler calls."""
  config = tiny_config(**{"rollout.microbatch_groups": 1, "train.num_steps": 1,
                          "train.num_iterations": 1})
  history = trainer.train(config, str(workdir_with_start(tmp_path, sft_start)))
  assert len(history) == 1 and np.isfinite(history[0]["loss"]), history


def test_rollout_chunks_that_do_not_divide_the_prompts_are_a_config_error(tmp_path):
  config = tiny_config(**{"rollout.microbatch_groups": 3, "train.num_steps": 1})
  with pytest.raises(ValueError, match=r"^rollout.microbatch_groups=3 does not divide"):
    trainer.train(config, str(tmp_path))


def test_kl_to_start_is_zero_at_the_start_and_measured_against_it_after_a_resume(tmp_path,
                                                                                 sft_start):
  """diagnostics.kl_to_start: l_old - l_start on one set of masks, so 0 exactly before the
  first update; a resumed run measures against the supervised start (read back from
  sft_model), as the uninterrupted one does."""
  # A constant learning rate: the cut run's schedule (over 2 steps) is then the whole one's.
  config = tiny_config(**{"diagnostics.kl_to_start": True, "train.num_steps": 3,
                          "optimizer.learning_rate": 1e-2, "optimizer.schedule": "constant"})
  whole = workdir_with_start(tmp_path / "whole", sft_start)
  history = trainer.train(config, str(whole))
  kl = [h["kl_start/mean"] for h in history]
  assert kl[0] == 0.0 and all(math.isfinite(x) for x in kl) and kl[2] != 0.0
  cut = workdir_with_start(tmp_path / "cut", sft_start)
  trainer.train(sweep.with_overrides(config, {"train.num_steps": 2}), str(cut))
  resumed = trainer.train(config, str(cut))
  assert [h["step"] for h in resumed] == [3]
  assert resumed[0]["kl_start/mean"] == pytest.approx(kl[2], rel=1e-4, abs=1e-6)
  shutil.rmtree(cut / supervised.SFT_DIR)
  with pytest.raises(ValueError, match="supervised start is gone"):
    trainer.train(sweep.with_overrides(config, {"train.num_steps": 4}), str(cut))


def test_prompts_longer_than_prompt_length_are_skipped_and_counted_not_fatal(tmp_path, caplog):
  """A data file with a few prompts over ``rollout.prompt_length`` (the official trainers have no
  cap): they are skipped, their count logged naming the setting, and the run trains; a file of
  which none fits is a one-line config error."""
  rows = [{"input": "3,5,7", "output": "15"}] * 12 + [
      {"input": ",".join(str(i) for i in range(40)), "output": "99"}] * 3
  path = tmp_path / "countdown.jsonl"
  path.write_text("\n".join(json.dumps(row) for row in rows))
  overrides = {"task.name": "countdown", "data.train": str(path), "data.eval": str(path),
               "data.train_size": 0, "data.eval_size": 0, "sft.num_steps": 0,
               "train.num_steps": 1, "train.num_iterations": 1, "eval.every_steps": 1}
  with caplog.at_level("WARNING"):
    history = trainer.train(tiny_config(**overrides), str(tmp_path / "run"))
  assert len(history) == 1 and np.isfinite(history[0]["loss"])
  said = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
  assert any("config.data.train: skipped 3 of 15 prompts longer than "
             "config.rollout.prompt_length=32" in message for message in said), said
  assert any("config.data.eval: skipped 3 of 15" in message for message in said), said
  path.write_text("\n".join(json.dumps(row) for row in rows[-3:]))
  with pytest.raises(ValueError, match=r"^config\.rollout\.prompt_length: none of the 3 train "):
    trainer.train(tiny_config(**overrides), str(tmp_path / "run2"))
