"""Beyond the paper: the adaptive ratio clip, ratio-noise diagnostics and the spike recorder."""

import math
import os
import shutil
import subprocess
import sys

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stabledrl_jax import estimators, objectives
from stabledrl_jax.objectives import stabledrl as sdrl
from stabledrl_jax.training.config import config_lib
from stabledrl_jax.training.loop import spikes, step_metrics, sweep, trainer
from stabledrl_jax.training.state import checkpointing

from test_training import REPO, tiny_config, workdir_with_start
from examples import examples

BAND = (0.02, 0.10)


def _tail(log_hi, sigma):
  """P(log rho > log_hi) for log rho ~ N(0, sigma^2): the clipped fraction, exactly."""
  return 0.5 * math.erfc(log_hi / (sigma * math.sqrt(2)))


# ---------------------------------------------------------------------------
# The adaptive clip's controller.
# ---------------------------------------------------------------------------


def test_the_controller_holds_the_clipped_fraction_in_its_band_on_a_stream_of_ratios():
  """Log ratios ~ N(0, sigma^2), 4096 a step, sigma changing mid-stream (a noisier estimator):
  from the paper's bound the controller reaches the band and holds it, in both regimes."""
  rng = np.random.default_rng(0)
  log_hi, held = math.log(5.0), []
  for step in range(300):
    sigma = 2.0 if step < 150 else 0.6
    log_ratio = rng.normal(0.0, sigma, 4096)
    fraction = float(np.mean(log_ratio > log_hi))
    log_hi = float(sdrl.adapt_log_clip(log_hi, fraction, band=BAND, step=0.1))
    assert math.isfinite(log_hi)
    if 100 <= step < 150 or step >= 250:  # After time to converge.
      held.append(_tail(log_hi, sigma))
  # Sampling noise can step it once past an edge; it comes back at once.
  assert min(held) > 0.015 and max(held) < 0.115, (min(held), max(held))


def test_a_fixed_stream_gives_a_fixed_bound():
  log_hi = math.log(5.0)
  for _ in range(50):
    log_hi = sdrl.adapt_log_clip(log_hi, 0.05, band=BAND)
  assert float(log_hi) == pytest.approx(math.log(5.0))
  # Always above the band: the bound rises by one step a call, to its cap, and stays finite.
  bounds = [math.log(5.0)]
  for _ in range(100):
    bounds.append(float(sdrl.adapt_log_clip(bounds[-1], 0.9, step=0.1)))
  np.testing.assert_allclose(np.diff(bounds[:40]), 0.1, atol=1e-5)
  assert bounds[-1] == pytest.approx(6.9)


@hypothesis.given(st.lists(st.one_of(st.floats(0, 1), st.just(math.nan), st.just(math.inf)),
                           min_size=1, max_size=60),
                  st.floats(0.01, 1.0))
@hypothesis.settings(deadline=None, max_examples=examples(50))
def test_the_bound_stays_finite_and_moves_by_at_most_one_step(fractions, step):
  log_hi = math.log(5.0)
  for fraction in fractions:
    new = float(sdrl.adapt_log_clip(log_hi, fraction, step=step))
    assert math.isfinite(new) and 0.05 - 1e-6 <= new <= 6.9 + 1e-6
    assert abs(new - log_hi) <= step + 1e-6
    if not math.isfinite(fraction):
      assert new == pytest.approx(log_hi)  # A skipped update keeps the bound.
    log_hi = new


def test_a_traced_bound_clips_like_the_same_fixed_bound():
  """StableDRL with the train state's bound == StableDRL with that max_ratio (float64 check)."""
  rng = np.random.default_rng(1)
  log_ratio = rng.normal(0, 3, 16).astype(np.float32)
  logp, adv = rng.normal(size=16).astype(np.float32), rng.normal(size=16).astype(np.float32)
  log_hi = 1.3
  loss, metrics = sdrl.stabledrl_loss(jnp.asarray(logp), jnp.asarray(log_ratio),
                                        jnp.asarray(adv), 4, log_max_ratio=jnp.float32(log_hi))
  clipped = np.minimum(log_ratio.astype(np.float64), log_hi).reshape(4, 4)
  weights = np.exp(clipped - clipped.max(1, keepdims=True))
  weights = (weights / weights.sum(1, keepdims=True)).reshape(-1)
  np.testing.assert_allclose(metrics["per_sample/weight"], weights, rtol=1e-5)
  assert float(loss) == pytest.approx(-np.sum(weights * adv * logp) / 4, rel=1e-5)
  assert float(metrics["clip/frac_upper"]) == np.mean(log_ratio > log_hi)
  fixed, _ = sdrl.stabledrl_loss(jnp.asarray(logp), jnp.asarray(log_ratio), jnp.asarray(adv),
                                   4, max_ratio=math.exp(log_hi))
  assert float(fixed) == pytest.approx(float(loss), rel=1e-6)


@pytest.mark.parametrize("field,value", [("clip_mode", "pid"), ("clip_target_low", 0.2),
                                         ("clip_step", 0.0)])
def test_bad_adaptive_clip_settings_name_the_field(field, value):
  with pytest.raises(ValueError, match=field):
    objectives.get_objective("stabledrl").make_hparams({field: value})


# ---------------------------------------------------------------------------
# Ratio-noise diagnostics.
# ---------------------------------------------------------------------------


def test_the_monte_carlo_variance_matches_the_closed_form():
  """block_random over one block, K = 2, a model whose token log-probs c_i ignore the input:
  each row's estimate is the mean of c over a uniform subset of a uniform size m in 1..L, so
  Var = sigma^2 / (L - 1) * E_m[(L - m) / m] per row (sampling without replacement), / K for
  the estimate. The logged variance is unbiased for it, and the estimates' spread agrees."""
  length, vocab, batch, k = 8, 5, 4000, 2
  table = jax.random.normal(jax.random.key(0), (length, vocab))
  tokens = jnp.tile(jnp.arange(length) % (vocab - 1), (batch, 1))
  logits_fn = lambda x: jnp.broadcast_to(table, x.shape + (vocab,))
  completion = jnp.ones((batch, length), bool)
  details = estimators.estimate_logp(
      logits_fn, tokens, ~completion, completion, jax.random.key(1), method="block_random",
      mask_id=vocab - 1, num_samples=k, normalize="mean", return_details=True,
      block_length=length, prompt_mask_prob=0.0)
  table64 = np.asarray(table, np.float64)
  log_softmax = table64 - np.log(np.exp(table64).sum(-1, keepdims=True))
  c = log_softmax[np.arange(length), np.asarray(tokens[0])]
  sigma2 = np.var(c)
  m = np.arange(1, length + 1)
  closed = sigma2 / (length - 1) * np.mean((length - m) / m) / k
  logged = np.asarray(estimators.monte_carlo_variance(details.row_values))
  np.testing.assert_allclose(np.asarray(details.row_values).sum(0), details.value, rtol=1e-6)
  assert np.mean(logged) == pytest.approx(closed, rel=0.08)
  assert np.var(np.asarray(details.value)) == pytest.approx(closed, rel=0.08)
  assert np.mean(details.value) == pytest.approx(np.mean(c), abs=0.01)  # Unbiased here.


def test_one_row_has_no_variance():
  with pytest.raises(ValueError, match="at least 2 rows"):
    estimators.monte_carlo_variance(jnp.zeros((1, 3)))


def test_log_ratio_variance_ignores_padding_and_infinities():
  log_ratio = jnp.asarray([1.0, 3.0, jnp.inf, 100.0])
  valid = jnp.asarray([True, True, True, False])
  metrics = objectives.base.ratio_metrics(log_ratio, jnp.ones(4), valid, log_lo=-1.0, log_hi=1.0)
  assert float(metrics["log_ratio/var"]) == pytest.approx(1.0)


def test_noise_share_from_the_inner_updates():
  assert step_metrics.ratio_noise([0.5, 1.0]) == {"ratio_noise/var_first": 0.5,
                                              "ratio_noise/share": 0.5}
  assert step_metrics.ratio_noise([0.04])["ratio_noise/share"] == 1.0  # One update: all noise.
  assert step_metrics.ratio_noise([0.0, 0.3])["ratio_noise/share"] == 0.0  # Coupled masks.
  assert step_metrics.ratio_noise([0.0, 0.0]) == {} and step_metrics.ratio_noise([]) == {}


def test_a_run_logs_the_diagnostics_and_an_adaptive_bound_that_follows_its_controller(
    tmp_path, sft_start):
  """Every step logs estimator/logp_std and the noise share; the adaptive bound of each step is
  the controller's output from the previous step's logged clipped fraction."""
  config = tiny_config(**{"train.num_steps": 4, "objective.stabledrl.clip_mode": "adaptive",
                          "objective.stabledrl.clip_target_low": 0.3,
                          "objective.stabledrl.clip_target_high": 0.6,
                          "objective.stabledrl.max_ratio": 1.02})
  history = trainer.train(config, str(workdir_with_start(tmp_path / "run", sft_start)))
  for record in history:
    assert record["estimator/logp_std_mean"] > 0
    assert record["estimator/logp_std_max"] >= record["estimator/logp_std_mean"]
    assert 0 <= record["ratio_noise/share"] <= 1
  bound = math.log(1.02)
  for record in history:
    assert record["clip/max_ratio"] == pytest.approx(math.exp(bound), rel=1e-5)
    fraction = record["clip/frac_upper"] + record["clip/frac_lower"]
    bound = float(sdrl.adapt_log_clip(bound, fraction, band=(0.3, 0.6)))
  assert len({round(r["clip/max_ratio"], 6) for r in history}) > 1  # It moved.


def test_the_adaptive_bound_is_checkpointed_and_resumes_exactly(tmp_path, sft_start):
  overrides = {"train.num_steps": 4, "objective.stabledrl.clip_mode": "adaptive",
               "objective.stabledrl.clip_target_low": 0.3,
               "objective.stabledrl.clip_target_high": 0.6,
               "objective.stabledrl.max_ratio": 1.02, "checkpoint.max_to_keep": 5}
  workdir = workdir_with_start(tmp_path / "run", sft_start)
  straight = trainer.train(tiny_config(**overrides), str(workdir))
  ckpt = checkpointing.Checkpointer(workdir)
  for step in (3, 4):  # Back to step 2, as if killed there.
    shutil.rmtree(os.path.join(ckpt.directory, str(step)))
  ckpt.close()
  resumed = trainer.train(tiny_config(**overrides), str(workdir))
  assert [r["step"] for r in resumed] == [3, 4]
  for a, b in zip(straight[2:], resumed):
    for name in ("clip/max_ratio", "loss", "grad_norm", "clip/frac_upper"):
      assert a[name] == b[name], name


# ---------------------------------------------------------------------------
# The spike recorder.
# ---------------------------------------------------------------------------


def test_the_detector_flags_jumps_and_non_finite_steps():
  detector = spikes.SpikeDetector(factor=10.0, window=4, min_history=3)
  assert detector.check(np.asarray([1.0]), False)[0] is None  # No history yet.
  assert detector.check(np.asarray([100.0]), False)[0] is None
  assert detector.check(np.asarray([1.0, 1.2]), False)[0] is None
  reason, norm, median = detector.check(np.asarray([0.5, 50.0]), False)  # Median 1.2.
  assert (reason, norm, median) == ("grad_norm", 50.0, 1.2)
  assert detector.check(np.asarray([1.0]), True)[0] == "non_finite"
  assert detector.check(np.asarray([math.inf]), False)[0] == "non_finite"
  assert list(detector.history) == [100.0, 1.2, 50.0, 1.0]  # Finite norms of the last 4 steps.
  assert spikes.SpikeDetector(0.0).check(np.asarray([1e9]), False)[0] is None


def test_steps_without_gradient_stay_out_of_the_window():
  """A zero norm (every advantage 0) says nothing of the scale: after a run of them the next
  nonzero step is no spike, and the median is never 0 (the trainer divides by it)."""
  detector = spikes.SpikeDetector(factor=10.0, window=4, min_history=2)
  for _ in range(6):
    reason, norm, median = detector.check(np.asarray([0.0, 0.0]), False)
    assert (reason, norm) == (None, 0.0) and math.isnan(median)
  reason, norm, median = detector.check(np.asarray([3.0]), False)
  assert (reason, norm) == (None, 3.0) and math.isnan(median)
  detector.check(np.asarray([0.0]), False)
  assert detector.check(np.asarray([2.0]), False)[0] is None
  assert detector.median() == 2.5
  assert detector.check(np.asarray([26.0]), False)[:2] == ("grad_norm", 26.0)


@hypothesis.given(st.lists(st.lists(st.one_of(st.just(0.0), st.floats(0, 1e6), st.just(math.inf)),
                                    min_size=1, max_size=3), max_size=30),
                  st.floats(0, 100), st.integers(1, 6), st.integers(1, 6))
@hypothesis.settings(deadline=None, max_examples=examples(100))
def test_the_detector_median_is_positive_or_unknown(steps, factor, window, min_history):
  detector = spikes.SpikeDetector(factor, window, min_history)
  for norms in steps:
    reason, norm, median = detector.check(np.asarray(norms), False)
    assert math.isnan(median) or median > 0
    assert (reason == "non_finite") == (not math.isfinite(norm))
    assert reason != "grad_norm" or norm > factor * median
    assert all(x > 0 and math.isfinite(x) for x in detector.history)


def test_a_nonzero_step_after_steps_without_gradient_is_logged(tmp_path, monkeypatch, sft_start):
  """The trainer's path of the case above: zero advantages at step 0, ones at step 1, a window
  of one step. The run finishes, and no spike is logged."""
  workdir_with_start(tmp_path, sft_start)
  config = tiny_config(**{"diagnostics.spike_min_history": 1})
  calls = []

  def first_zero(rewards, group_size, **kw):
    del group_size, kw
    calls.append(None)
    return jnp.full(rewards.shape, 0.0 if len(calls) == 1 else 1.0)

  monkeypatch.setattr(objectives, "group_advantages", first_zero)  # As the rollouts see it.
  history = trainer.train(config, str(tmp_path))
  norms = [r["grad_norm"] for r in history if "grad_norm" in r]
  assert len(norms) == 2 and norms[0] == 0.0 and norms[1] > 0
  assert not any("spike/step" in r for r in history)


def test_spike_files_are_read_back_and_bad_ones_named(tmp_path):
  spikes.write_spike(tmp_path, 12, {"step": 12, "completions": np.asarray(["a", "b"])})
  spikes.write_spike(tmp_path, 3, {"step": 3})
  (tmp_path / "spikes" / "step_x.npz").write_text("junk")
  files = spikes.spike_files(tmp_path)
  assert [f.name for f in files] == ["step_3.npz", "step_12.npz"]
  assert list(spikes.read_spike(files[1])["completions"]) == ["a", "b"]
  with pytest.raises(ValueError, match="step_x.npz"):
    spikes.read_spike(tmp_path / "spikes" / "step_x.npz")


@pytest.mark.slow
def test_the_recorder_keeps_the_stress_tests_grpo_spikes(tmp_path):
  """Sequence-level GRPO under the stress test: its spikes are recorded with their rollouts, and
  the report finds stressed samples with exploded ratios and negative advantages behind them
  (the conditional clip lets A < 0, rho >> 1 through)."""
  config = config_lib.from_file(REPO / "configs" / "stress_test.py")
  config = sweep.with_overrides(config, {
      "objective.name": "grpo", "objective.grpo.level": "sequence",
      "estimator.stress.fraction": 0.7, "train.num_steps": 12, "data.train_size": 256,
      "sft.num_steps": 100, "eval.every_steps": 0})  # Enough for rewards that differ.
  workdir = tmp_path / "grpo"
  history = trainer.train(config, str(workdir))
  flagged = [r["step"] for r in history if "spike/step" in r]
  files = spikes.spike_files(workdir)
  assert flagged and [int(f.stem.split("_")[1]) for f in files] == flagged
  n = config.rollout.num_prompts * config.rollout.group_size
  for path in files:
    record = spikes.read_spike(path)
    step = int(record["step"])
    logged = next(r for r in history if r["step"] == step)
    assert record["reason"] == "grad_norm"
    assert np.max(record["grad_norm"]) > 10 * record["median"]
    assert logged["spike/grad_norm_over_median"] == pytest.approx(
        np.max(record["grad_norm"]) / record["median"])
    assert record["completions"].shape == record["prompts"].shape == (n,)
    assert all(text.startswith("Sudoku") for text in record["prompts"])
    assert record["per_sample/log_ratio"].shape == record["per_sample/weight"].shape == (2, n)
    update = int(np.argmax(record["grad_norm"]))
    mass = np.abs(record["advantages"] * record["per_sample/weight"][update])
    top = int(np.argmax(np.where(record["advantages"] == 0, 0.0, mass)))
    assert record["stressed"][top] and record["advantages"][top] < 0
    assert record["per_sample/log_ratio"][update, top] > math.log(1.5)  # Past the clip.
  out = subprocess.run([sys.executable, str(REPO / "experiments" / "spike_report.py"),
                        str(workdir), "--plot", "--top", "3"], check=True, capture_output=True,
                       text=True).stdout
  assert f"Spikes in {workdir}: {len(files)}" in out
  assert all(f"## step {step}: grad_norm" in out for step in flagged)
  assert all(path.with_suffix(".png").exists() for path in files)


def _rewrite_checkpoint(workdir, step, edit):
  """Checkpoint ``step`` of ``workdir`` saved again with its state dict changed by ``edit``
  (an older version's layout)."""
  import orbax.checkpoint as ocp
  ckpt = checkpointing.Checkpointer(workdir)
  path = os.path.join(ckpt.directory, str(step))
  state = ocp.StandardCheckpointer().restore(os.path.join(path, "state"))
  meta = ckpt.restore_meta(step)
  edit(state)
  shutil.rmtree(path)
  ckpt.close()
  ckpt = checkpointing.Checkpointer(workdir)
  ckpt.save(step, state, meta)
  ckpt.close()


@pytest.mark.parametrize("layout", ["no_bound", "top_level_bound"])
def test_a_checkpoint_from_before_the_objective_state_resumes(tmp_path, sft_start, layout):
  """States saved by earlier versions restore: without any bound (before the adaptive clip) the
  objective state starts where a fresh run's does; with the bound as a top-level
  ``log_clip_hi`` (before ``TrainState.objective_state``) it carries over. Training continues."""
  workdir = workdir_with_start(tmp_path / "run", sft_start)
  trainer.train(tiny_config(**{"train.num_steps": 2}), str(workdir))

  def old_layout(state):
    assert float(state["objective_state"]["log_clip_hi"]) == pytest.approx(math.log(5.0))
    del state["objective_state"]
    if layout == "top_level_bound":
      state["log_clip_hi"] = np.float32(math.log(3.0))

  _rewrite_checkpoint(workdir, 2, old_layout)
  history = trainer.train(tiny_config(**{"train.num_steps": 3}), str(workdir))
  assert [r["step"] for r in history] == [3]
  expected = math.log(3.0) if layout == "top_level_bound" else math.log(5.0)
  assert history[0]["clip/max_ratio"] == pytest.approx(math.exp(expected), rel=1e-5)
  resumed = trainer.Trainer(tiny_config(**{"train.num_steps": 3}), str(workdir))
  try:
    assert set(resumed.state.objective_state) == {"log_clip_hi"}
    assert float(resumed.state.objective_state["log_clip_hi"]) == pytest.approx(expected)
  finally:
    resumed.close()


def test_a_stateless_objective_resumes_a_checkpoint_with_the_old_top_level_bound(tmp_path,
                                                                                 sft_start):
  """Before ``TrainState.objective_state`` every run stored StableDRL's bound; a GRPO run's is
  read and dropped, and its objective state stays empty."""
  overrides = {"train.num_steps": 2, "objective.name": "wd1"}
  workdir = workdir_with_start(tmp_path / "run", sft_start)
  trainer.train(tiny_config(**overrides), str(workdir))

  def old_layout(state):
    assert not state.pop("objective_state", None)
    state["log_clip_hi"] = np.float32(math.log(5.0))

  _rewrite_checkpoint(workdir, 2, old_layout)
  overrides["train.num_steps"] = 3
  assert [r["step"] for r in trainer.train(tiny_config(**overrides), str(workdir))] == [3]
  resumed = trainer.Trainer(tiny_config(**overrides), str(workdir))
  try:
    assert resumed.state.objective_state == {}
  finally:
    resumed.close()
