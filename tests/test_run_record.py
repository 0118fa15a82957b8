"""The run's record and its build: ``specs.resolve`` -> ``Resolved`` (loop, data, guard,
optimizer, family), ``Resolved.with_model`` / ``with_lr_scale``, the memoized step functions,
the collapse guard's decisions (``collapse.Guard``), the ahead-of-time programs of a step, and
the family registry's answers where code once named LLaDA."""

import dataclasses
import json

import jax
import pytest

from stabledrl_jax import models
from stabledrl_jax.models import family as family_lib
from stabledrl_jax.training.config import optimizer as optimizer_lib, run_spec, specs
from stabledrl_jax.training.loop import collapse, trainer
from stabledrl_jax.training.step import build, rl_step

from test_training import tiny_config, workdir_with_start


def test_resolve_reads_every_value_the_loop_uses():
  config = tiny_config(**{"train.num_steps": 7, "train.num_iterations": 3, "seed": 5,
                          "eval.every_steps": 2, "eval.batch_size": 16,
                          "checkpoint.every_steps": 3, "checkpoint.max_to_keep": 2,
                          "logging.samples_every_steps": 4, "logging.num_samples": 2,
                          "train.collapse_guard.enabled": True, "train.collapse_guard.window": 3,
                          "task.reward": "d1", "diagnostics.kl_to_start": True})
  resolved = specs.resolve(config, num_devices=1)
  loop = resolved.loop
  assert (loop.num_steps, loop.num_iterations, loop.seed) == (7, 3, 5)
  assert (loop.eval_every_steps, loop.eval_batch_size) == (2, 16)
  assert (loop.checkpoint_every_steps, loop.max_to_keep, loop.kl_to_start) == (3, 2, True)
  assert [loop.eval_due(d) for d in range(1, 8)] == [False, True, False, True, False, True, True]
  assert [loop.samples_due(s) for s in range(8)] == [0, 0, 0, 2, 0, 0, 0, 2]
  assert resolved.data == dataclasses.replace(resolved.data, task="sudoku", reward="d1")
  assert resolved.guard.enabled and resolved.guard.rules.window == 3
  assert resolved.family == "llada" and resolved.family_record is family_lib.get("llada")
  assert resolved.num_updates == 21 and resolved.optimizer.num_updates == 21
  hash(resolved.loop), hash(resolved.data), hash(resolved.optimizer)  # Static records.


def test_with_lr_scale_scales_the_schedule_and_keeps_the_optimizer_state_layout():
  resolved = specs.resolve(tiny_config(**{"optimizer.schedule": "linear",
                                          "optimizer.warmup_steps": 2}), num_devices=1)
  half = resolved.with_lr_scale(0.5)
  for update in range(resolved.num_updates):
    assert float(half.schedule(update)) == pytest.approx(0.5 * float(resolved.schedule(update)))
  params = {"w": jax.numpy.ones((3,))}
  assert (jax.tree.structure(half.tx.init(params))
          == jax.tree.structure(resolved.tx.init(params)))
  # Equal specs give the same optimizer object: what the memoized update is keyed on.
  assert resolved.with_lr_scale(0.5).tx is half.tx
  assert resolved.with_lr_scale(1.0).tx is resolved.tx
  with pytest.raises(ValueError, match=r"config\.optimizer\.schedule"):
    optimizer_lib.OptimizerSpec.of(dataclasses.replace(
        resolved.optimizer, schedule="cosine"), 10)


def test_with_model_follows_the_loaded_model_and_refuses_another_family():
  config = tiny_config()
  resolved = specs.resolve(config, num_devices=1)
  loaded = dataclasses.replace(resolved.model, mask_token_id=3)
  again = resolved.with_model(loaded)
  assert again.model is loaded and again.run.likelihood.mask_id == 3
  assert dataclasses.replace(again.run.likelihood, mask_id=resolved.run.likelihood.mask_id) == (
      resolved.run.likelihood)
  assert again.with_model(resolved.model) == resolved
  with pytest.raises(ValueError, match=r"config\.model\.family: 'llada', but the model is a "
                                       r"sdar model"):
    resolved.with_model(models.get_sdar_config("tiny"))


def test_a_second_run_of_the_same_shape_traces_nothing(tmp_path, sft_start):
  """The step functions are memoized on the run's parts: a second trainer of the same config in
  one process gets the same jitted functions, whose caches do not grow (nothing is traced or
  compiled again), and trains exactly as the first."""
  config = tiny_config(**{"train.num_steps": 1})
  first = trainer.Trainer(config, workdir_with_start(tmp_path / "a", sft_start))
  fns = first.fns
  first_history = first.run()
  jitted = {"update": fns.update, "estimate": fns.estimate,
            "advance": fns.advance_objective_state}
  cache_sizes = lambda: {name: fn._cache_size()  # pylint: disable=protected-access
                         for name, fn in jitted.items()}
  sizes = cache_sizes()
  assert all(size >= 1 for size in sizes.values()), sizes
  second = trainer.Trainer(config, workdir_with_start(tmp_path / "b", sft_start))
  assert (second.fns.update, second.fns.estimate) == (fns.update, fns.estimate)
  second_history = second.run()
  assert cache_sizes() == sizes
  strip = lambda h: [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/",
                                                                      "perf/"))} for r in h]
  assert strip(second_history) == strip(first_history)
  # Another learning rate is another update; the scoring is shared.
  scaled = second.parts.with_lr_scale(0.5)
  assert build.make_update(scaled) is not fns.update
  assert rl_step.scoring(scaled, scaled.run) is fns.estimate


def _guard(**rules):
  return collapse.Guard(run_spec.GuardSettings(
      enabled=True, action="restore", lr_factor=0.5, max_restores=1,
      rules=run_spec.Rules(eval_margin=2.0, reward_margin=0.02, window=100, **rules)))


def test_the_guard_decides_and_reads_no_file():
  """``Guard.after_step``: a new best eval is to be saved; a collapse after a best eval before it
  is a restore to it at half the learning rate (the trajectory cut there); past max_restores, a
  stop."""
  guard = _guard()
  assert guard.start({collapse.EVAL_METRIC: 50.0})  # The start is the first best.
  step = lambda done, value, healthy=True: guard.after_step(
      done, {collapse.REWARD_METRIC: 0.5, collapse.EVAL_METRIC: value}, healthy)
  assert step(1, 55.0) == collapse.Decision(save_best=True)
  assert step(2, 54.0) == collapse.Decision()
  assert step(3, 60.0, healthy=False) == collapse.Decision()  # Not saved: a skipped update.
  fell = step(4, 47.0)
  assert (fell.action, fell.restore_to, fell.save_best) == ("restore", 1, False)
  assert fell.event["restored_eval"] == 55.0 and fell.event["lr_scale"] == 0.5
  assert fell.record() == {"collapse_guard/restored_to": 1, "collapse_guard/lr_scale": 0.5}
  assert guard.lr_scale == 0.5 and [r["step"] for r in guard.trajectory.records()] == [0, 1]
  step(2, 56.0)
  again = step(3, 40.0)  # The restore's count is spent: stop.
  assert again.action == "stop" and again.restore_to is None
  assert again.record() == {"collapse_guard/restored_to": -1, "collapse_guard/lr_scale": 0.5}
  assert guard.stopped is again.event or guard.stopped == again.event
  assert json.loads(guard.dump()) == {"events": guard.events, "lr_scale": 0.5}


def test_a_resumed_guard_counts_its_events_and_goes_on_only_when_told():
  stop = {"action": "stop", "step": 3, "why": "x", "detected_at": 3}
  restore = {"action": "restore", "step": 2, "lr_scale": 0.5, "restored_step": 1}
  settings = run_spec.GuardSettings(enabled=True)
  kept = collapse.Guard.resume(settings, saved=[restore, stop], written=[], start_step=3)
  assert kept.stopped == stop and kept.lr_scale == 0.5 and kept.went_on_at is None
  on = collapse.Guard.resume(dataclasses.replace(settings, go_on=True), saved=[restore, stop],
                             written=[], start_step=3)
  assert on.stopped is None and on.went_on_at == 3
  on.read_trajectory([{"step": s, collapse.REWARD_METRIC: 0.1} for s in range(1, 6)], 4)
  assert [r["step"] for r in on.trajectory.records()] == [4]  # After the go-on, up to step 4.


def test_the_ahead_of_time_programs_cover_the_scoring_passes():
  """``rl_step.abstract_programs``: the update and every scoring pass the step runs before it
  (l_old for a ratio, l_ref for a KL term, the sequence scoring of kl_to_start), so that the
  planner's and the TPU compile's memory is the largest program's."""
  stabledrl = rl_step.abstract_programs(tiny_config())
  assert sorted(stabledrl) == ["score_old", "update"]
  assert stabledrl["score_old"][2] == {"stress_mode": "hard"}
  grpo = rl_step.abstract_programs(tiny_config(**{
      "objective.name": "grpo", "estimator.method": "mean_field",
      "diagnostics.kl_to_start": True}))
  assert sorted(grpo) == ["score_old", "score_ref", "score_sequence", "update"]
  assert sorted(rl_step.abstract_programs(tiny_config(**{"objective.name": "wd1"}))) == [
      "update"]  # No ratio, no KL term.
  fn, args, keywords = stabledrl["score_old"]
  logp = jax.eval_shape(lambda *a: fn(*a, **keywords), *args)
  assert logp.shape == (args[1].tokens.shape[0],)


def test_the_family_registry_answers_what_code_once_named_llada():
  assert family_lib.untyped().name == "llada"  # A config.json without model_type.
  assert family_lib.by_model_type(None) is family_lib.untyped()
  assert set(family_lib.caches()) == {c for f in family_lib.names()
                                      for c in family_lib.get(f).caches}
  assert family_lib.caches()[0] == "none"


def test_dream_and_sdar_share_the_qwen_base():
  from stabledrl_jax.models import qwen  # pylint: disable=g-import-not-at-top
  for family in ("dream", "sdar"):
    cls = family_lib.get(family).model_cls
    assert issubclass(cls, qwen.QwenModel) and issubclass(cls.layer_cls, qwen.QwenLayer)


def test_a_failed_build_leaves_no_workdir_lock_nor_watchdog(tmp_path, monkeypatch):
  """A build that fails after the workdir was claimed (``run_build.claimed``): the error comes
  through, the directories it created are gone, no lock is left, the signal handlers are the
  caller's again and the command line's watchdog thread (``hard_stop``) has ended."""
  import signal  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.loop import run_build  # pylint: disable=g-import-not-at-top

  def fail(*args, **kwargs):
    raise RuntimeError("the build failed")

  monkeypatch.setattr(run_build, "build_run", fail)
  handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
  workdir = tmp_path / "new" / "run"
  with pytest.raises(RuntimeError, match="^the build failed$"):
    trainer.Trainer(tiny_config(), str(workdir), hard_stop=True)
  assert not (tmp_path / "new").exists()
  assert {s: signal.getsignal(s) for s in handlers} == handlers
  for thread in threading.enumerate():
    if thread.name == "stabledrl-interrupt-watchdog":
      thread.join(timeout=10)
      assert not thread.is_alive()
