"""The trainer on a block diffusion model (SDAR): config checks, every objective, the stress
test, the supervised start, evaluation and resuming."""

import dataclasses
import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from stabledrl_jax import block_estimators, estimators, models
from stabledrl_jax.training.config import specs
from stabledrl_jax.training.inputs import data
from stabledrl_jax.training.loop import metrics_writer, trainer
from stabledrl_jax.training.state import supervised
from stabledrl_jax.training.step import rl_loss, train_step

from test_training import _comparable, _final_params, load_config, tiny_config
import family_helpers


def sdar_config(**updates):
  """The toy quickstart (test_training.tiny_config) on a tiny SDAR with blocks of 4."""
  return tiny_config(**{"model.family": "sdar", **updates})


# ---------------------------------------------------------------------------
# Config: the family, its names and overrides, the block layout.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,match", [
    ("model.family", "gpt", "model.family"),
    ("model.name", "llada_8b", "model.name"),  # An LLaDA config, not an SDAR one.
    ("rollout.prompt_length", 30, "rollout.prompt_length"),  # Not a multiple of 4.
    ("rollout.gen_length", 42, "rollout.gen_length"),
    ("rollout.steps", 15, "rollout.steps"),  # 10 completion blocks.
    ("rollout.remasking", "random", "rollout.remasking"),
    ("rollout.threshold", 0.0, "rollout.threshold"),
    ("model.overrides.block_size", 16, "rollout.gen_length"),  # 40 is not a multiple of 16.
])
def test_bad_sdar_config_values_name_the_field(field, value, match):
  with pytest.raises(ValueError, match=match.replace(".", r"\.")):
    specs.validate(sdar_config(**{field: value}), num_devices=1)


def test_an_estimator_name_that_means_the_block_elbo_says_so():
  """On SDAR every sampled estimator is the block ELBO: refused options and the start-up note
  say it; on LLaDA the names mean what they say (no note)."""
  config = sdar_config(**{"estimator.method": "block_random", "estimator.block_length": 8})
  with pytest.raises(ValueError, match=r"estimator\.block_length: the 'block_random' estimator "
                     r"of a sdar model \(the block ELBO: every block scored in one staircase"):
    specs.validate(config, num_devices=1)
  note = specs.estimator_note(sdar_config(**{"estimator.method": "espo_elbo"}))
  assert note.startswith("note: estimator.method='espo_elbo' on a sdar model is the block ELBO")
  assert "whole-block mean field" in specs.estimator_note(
      sdar_config(**{"estimator.method": "mean_field"}))
  assert specs.estimator_note(tiny_config(**{"estimator.method": "block_random"})) == ""


def test_bad_family_fails_before_anything_is_built(tmp_path):
  with pytest.raises(ValueError, match=r"config\.model\.family: 'gpt'"):
    trainer.train(tiny_config(**{"model.family": "gpt"}), str(tmp_path))
  assert not (tmp_path / "checkpoints").exists()


def test_llada_override_names_size_an_sdar_model_and_unknown_fields_fail():
  config = sdar_config(**{"model.overrides.n_layers": 3, "model.overrides.head_dim": 8})
  tokenizer = data.make_tokenizer(config.tokenizer)
  got = specs.model_config(config, tokenizer)
  assert isinstance(got, models.SDARConfig)
  assert (got.hidden_size, got.num_attention_heads, got.num_key_value_heads,
          got.num_hidden_layers, got.intermediate_size, got.head_dim) == (64, 4, 2, 3, 128, 8)
  assert (got.vocab_size, got.mask_token_id, got.eos_token_id) == (
      tokenizer.vocab_size, tokenizer.mask_id, tokenizer.eos_id)
  for family, field in (("sdar", "embedding_size"), ("llada", "head_dim"),
                        ("llada", "block_size")):
    config = tiny_config(**{"model.family": family, f"model.overrides.{field}": 8})
    with pytest.raises(ValueError, match=rf"config\.model\.overrides\.{field}: .*no field"):
      specs.validate(config)
  twice = sdar_config(**{"model.overrides.hidden_size": 64})  # d_model is set too.
  with pytest.raises(ValueError, match="another override"):
    specs.validate(twice)


def test_shipped_sdar_configs():
  quick = load_config("sdar_tiny_quickstart")
  assert specs.model_config(quick).block_size == 8
  paper = load_config("sdar8b_math")
  assert (paper.model.family, paper.model.name, paper.tokenizer.kind) == ("sdar", "sdar_8b",
                                                                          "sdar")
  assert specs.estimator_method(paper) == "block_random"
  stress = load_config("stress_test")
  stress.model.family = "sdar"
  stress.estimator.stress.fraction = 0.7
  specs.validate(stress)  # The quickstart's LLaDA-style overrides size the SDAR model.


# ---------------------------------------------------------------------------
# Every objective updates an SDAR model (one jitted update, no rollouts).
# ---------------------------------------------------------------------------

OBJECTIVES = [
    ("stabledrl", {}),  # The quickstart's: block ELBO, ELBO surrogate.
    ("stabledrl", {"objective.stabledrl.surrogate": "sandwich",  # The paper's.
                   "estimator.method": "block_random"}),
    ("grpo", {"objective.grpo.level": "token", "estimator.method": ""}),  # Block mean field.
    ("grpo", {"objective.grpo.level": "sequence"}),
    ("espo", {"estimator.coupled": True}),
    ("spg", {}),  # The sandwich: EUBO from the block masks.
    ("wd1", {"estimator.method": ""}),  # Mean field, sum form.
]


def _sdar_batch(model_config, n=8, prompt=8, gen=12, seed=0, num_tokens=24):
  """Left-padded prompts (2 blocks of 4), completions of 3 blocks ending in EOS padding; tokens
  drawn from ids 4 .. 4 + num_tokens - 1 (no special ids)."""
  return family_helpers.random_batch(model_config.eos_token_id, n=n, prompt=prompt, gen=gen,
                                     seed=seed, num_tokens=num_tokens, min_prompt=3,
                                     min_completion=4, pad_prompt=False, stressed=True)


@pytest.mark.parametrize("objective,extra", OBJECTIVES)
def test_every_objective_updates_an_sdar_model(objective, extra):
  config = sdar_config(**{"objective.name": objective, "estimator.stress.fraction": 0.5,
                          **extra})
  specs.validate(config)
  model_config = specs.model_config(config, data.make_tokenizer(config.tokenizer))
  model = models.init_model(model_config.replace(num_hidden_layers=1), seed=0)
  graphdef, params = nnx.split(model, nnx.Param)
  spec = specs.likelihood_spec(config, model_config)
  assert spec.block_size == 4
  batch = _sdar_batch(model_config)
  run = dataclasses.replace(specs.resolve_run(config, model_config), group_size=4,
                            num_microbatches=2)
  old = jax.jit(functools.partial(
      train_step.estimate_no_grad, graphdef=graphdef, run=run, stress_mode="hard"))(
          params, batch, jax.random.key(1))
  assert old.shape == (batch.tokens.shape if spec.token_level else batch.tokens.shape[:1])
  assert np.all(np.isfinite(old))
  tx = optax.adam(1e-3)  # No weight decay: only a gradient moves a parameter.
  state = train_step.create_train_state(params, tx, seed=0)
  update = jax.jit(functools.partial(train_step.update_step, graphdef=graphdef, tx=tx, run=run))
  new_state, metrics = update(state, batch.replace(old_logp=old, ref_logp=old - 0.1),
                              jax.random.key(2))
  assert np.isfinite(float(metrics["loss"])) and int(metrics["skipped"]) == 0
  assert float(metrics["grad_norm"]) > 0
  changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), params, new_state.params)
  assert all(jax.tree.leaves(changed))


def test_sdar_stress_masks_differ_only_on_the_stressed_samples():
  """l_theta (easy: the tail of each block) vs l_old (hard: whole blocks), one selection."""
  model_config = models.get_sdar_config("tiny", num_hidden_layers=1)
  model = models.SDAR(model_config, rngs=nnx.Rngs(0))
  batch = _sdar_batch(model_config, seed=1)
  stressed = np.asarray(batch.stressed)
  spec = estimators.LikelihoodSpec(method="elbo", num_samples=2, normalize="sum", token_level=False,
                                   eubo_beta=1.5, mask_id=model_config.mask_token_id,
                                   stress_rates=(0.1, 1.0), family="sdar", block_size=4)
  @nnx.jit
  def estimates(model):  # One compilation for the three.
    logits_fn = rl_loss.model_logits_fn(model, batch.attention_mask)
    return [rl_loss.estimate(logits_fn, batch, jax.random.key(3), spec, stress_mode=mode)
            for mode in (None, "easy", "hard")]

  (plain, _), (easy, eubo), (hard, _) = estimates(model)
  np.testing.assert_array_equal(easy[~stressed], plain[~stressed])
  np.testing.assert_array_equal(hard[~stressed], plain[~stressed])
  assert np.all(np.abs(easy[stressed] - hard[stressed]) > 1e-3)
  assert eubo.shape == plain.shape and np.all(np.isfinite(eubo))


# ---------------------------------------------------------------------------
# The supervised start: SDAR's block-diffusion loss.
# ---------------------------------------------------------------------------


def test_sdar_sft_loss_is_the_block_elbo_and_decreases():
  model_config = models.get_sdar_config("tiny", num_hidden_layers=1)
  model = models.SDAR(model_config, rngs=nnx.Rngs(0))
  batch = _sdar_batch(model_config, n=16, seed=2, num_tokens=6)
  arrays = (batch.tokens, batch.prompt_mask, batch.completion_mask)
  key = jax.random.key(4)
  loss_of = nnx.jit(lambda m, k: supervised.sft_loss(m, *arrays, k,
                                                     mask_id=model_config.mask_token_id))
  elbo = nnx.jit(lambda m, k: block_estimators.estimate_block_elbo(
      m.staircase, *arrays, k, mask_id=model_config.mask_token_id, block_size=4,
      attention_mask=batch.prompt_mask | batch.completion_mask))(model, key)
  want = -np.mean(elbo / np.sum(batch.completion_mask, axis=-1))
  before = float(loss_of(model, key))
  np.testing.assert_allclose(before, want, rtol=1e-5)
  supervised.fit(model, lambda step: tuple(map(np.asarray, arrays)), num_steps=20,
                 learning_rate=1e-2, seed=0, mask_id=model_config.mask_token_id)
  after = float(loss_of(model, key))
  assert after < 0.7 * before, (before, after)


# ---------------------------------------------------------------------------
# End to end through trainer.train.
# ---------------------------------------------------------------------------


def _with_start(path, start):
  path.mkdir(parents=True, exist_ok=True)
  shutil.copytree(start, path / supervised.SFT_DIR)
  return path


@pytest.mark.slow
def test_sdar_stress_test_makes_the_log_ratio_explode(tmp_path, sdar_start):
  """The stress config on SDAR, sequence-level GRPO (sum-form block ELBO), one update, coupled
  ratio: log rho = 0 without stress; with 70% of the samples stressed it is their easy-minus-hard
  gap (the easy masks see the rest of each block, the hard ones nothing of it)."""
  def log_ratios(name, fraction):
    config = load_config("stress_test")
    config.model.family = "sdar"
    config.data.update(train_size=64, eval_size=8)
    config.rollout.update(num_prompts=2, group_size=5)
    config.train.update(num_steps=1, num_iterations=1)
    config.eval.every_steps = 0
    config.objective.name = "grpo"
    config.objective.grpo.level = "sequence"
    config.estimator.update(coupled_ratio=True)
    config.estimator.stress.fraction = fraction
    record = trainer.train(config, str(_with_start(tmp_path / name, sdar_start)))[0]
    return record["log_ratio/min"], record["log_ratio/mean"], record["log_ratio/max"]

  # Without stress, numerator and denominator score the same masks: equal up to the rounding
  # of two separately compiled float32 sums of a few hundred nats (an ulp is ~3e-5 at 256).
  np.testing.assert_allclose(log_ratios("normal", 0.0), 0.0, atol=1e-4)
  _, mean, high = log_ratios("stress", 0.7)
  assert mean > 1.0 and high > 5.0, (mean, high)  # Measured: 3.5 and 16.2 (rho ~ 1e7).


@pytest.mark.slow
def test_sdar_run_evaluates_checkpoints_and_resumes_exactly(tmp_path, sdar_start):
  """Two steps with greedy evaluation; resuming from step 1 reproduces step 2."""
  config = sdar_config(**{"eval.every_steps": 2, "train.num_iterations": 1})
  reference = _with_start(tmp_path / "reference", sdar_start)
  history = trainer.train(config, str(reference))
  assert [h["step"] for h in history] == [1, 2]
  records = metrics_writer.read_metrics(str(reference / "metrics.jsonl"))
  evals = [r for r in records if "eval/accuracy" in r]
  assert [r["step"] for r in evals] == [0, 2]
  assert all(0.0 <= r["eval/accuracy"] <= 100.0 for r in evals)
  for name in ("loss", "grad_norm", "rewards/mean", "completions/mean_length"):
    assert all(np.isfinite(h[name]) for h in history), name

  resumed = tmp_path / "resumed"
  shutil.copytree(reference, resumed)
  shutil.rmtree(resumed / "checkpoints" / "2")  # As if killed after step 1's checkpoint.
  trainer.train(config, str(resumed))
  (step_a, params_a), (step_b, params_b) = _final_params(reference), _final_params(resumed)
  assert step_a == step_b == 2
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=0), params_a,
               params_b)
  assert _comparable(metrics_writer.read_metrics(str(resumed / "metrics.jsonl"))) == (
      _comparable(records))
