"""The RL training loop (docs/training.md): the run built (``run_build``), then each RL step
(``rl_step.rl_step``: rollouts, l_old / l_ref, the updates, the objective state) followed by
what the loop owns: evaluation, metrics, checkpoints, the collapse guard's decisions and
signals. It reads the resolved record (``Resolved``) alone.

The step's PRNG key is ``fold_in(run_key, step)``; with the data-iterator state in the
checkpoint, a resumed run repeats the uninterrupted one exactly. The loop is the same for every
model family and for one process or a pod (docs/pods.md): process 0 writes the config, metrics,
TensorBoard events and the supervised start; all processes save the orbax checkpoints together.
SIGTERM (a preempted VM or job) saves a checkpoint at the next step boundary, agreed by all
processes, and ends the run normally; rerunning the command continues exactly.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import jax
import ml_collections
import tqdm
from absl import logging
from etils import epath
from flax import nnx

from stabledrl_jax import path_args
from stabledrl_jax.training.loop import collapse, preemption, run_build, step_metrics
from stabledrl_jax.training.parallel import multihost
from stabledrl_jax.training.state import checkpointing, lora_base, supervised
from stabledrl_jax.training.step import build, decoding, rl_step as rl_step_lib


class TooManySkipsError(RuntimeError):
  """Raised after ``train.max_consecutive_skips`` non-finite updates in a row."""


class Trainer:
  """The loop over a built run (``run_build.Run``, whose fields it holds); ``run()`` trains to
  ``train.num_steps``."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str | epath.PathLike, *,
               hard_stop: bool = False):
    """``hard_stop`` (the command line): a second Ctrl-C, or a SIGTERM not answered within
    ``train.stop_grace_s``, ends the process at once even inside a long jitted call
    (``preemption.PreemptionWatcher``); a notebook keeps its kernel (KeyboardInterrupt).

    Everything that can be checked without the workdir is checked before anything is created
    in it (docs/reliability.md): the workdir's name, then the config and the inputs
    (``run_build.read_inputs``: the fields, the tokenizer, a checkpoint's config files). A start
    that fails later leaves nothing of its own (``run_build.claimed``)."""
    path_args.check(workdir, "workdir")
    self.inputs = inputs = run_build.read_inputs(config)
    self.config, self.mesh, self.loop = config, inputs.mesh, inputs.resolved.loop
    self.workdir = checkpointing.resolve_workdir(workdir)
    self.primary = multihost.is_primary()
    self.lock, self.stopped, self.closing = None, "", run_build.Closing()
    # From here SIGTERM and SIGINT stop at the next step boundary (the supervised start's too);
    # the handlers are restored after the build and installed again by ``run``.
    self.watcher = preemption.PreemptionWatcher(
        on_abort=self._release_lock, grace_s=self.loop.stop_grace_s, hard_stop=hard_stop,
        kept=lambda: run_build.kept(self.workdir))
    try:
      with run_build.claimed(self.workdir, self.closing) as self.lock:
        built = run_build.build_run(config, inputs, self.workdir, stop=self.watcher.reached,
                                    on_part=self.closing.add)
      for field in dataclasses.fields(built):
        setattr(self, field.name, getattr(built, field.name))
      self.samples = []  # This step's sample rollouts, for the writer.
    except supervised.Stopped as stop:
      self.stopped = str(stop)
    except BaseException:
      self.lock = None  # Released by ``claimed``, with what the start made.
      self.watcher.close()  # Its watchdog ends with the failed start.
      raise
    finally:
      self.watcher.uninstall()

  def _release_lock(self) -> None:
    if self.lock is not None:
      self.lock.release()
      self.lock = None

  def evaluate(self, params, key, **options) -> dict[str, float]:
    """Greedy decoding of the held-out prompts (``decoding.score_batches``, the path every
    evaluation shares): the task's metric in percent, the mean reward and the mean model calls
    per sequence. ``options`` override the rollout's remasking / threshold / cache; the decoding
    is exact (no KV cache) unless they say otherwise. Each process decodes and scores its rows
    of every batch; the totals are summed over the processes."""
    return decoding.evaluate(
        nnx.merge(self.parts.graphdef, params), self.inputs.tokenizer, self.inputs.task,
        self.inputs.eval_prompts, key, self.parts.rollout.evaluation.with_options(**options),
        mesh=self.mesh, batch_size=self.loop.eval_batch_size,
        reward_scheme=self.resolved.data.reward, split=self.rollouts.split)

  def rl_step(self, step: int) -> dict[str, Any]:
    """RL step ``step`` (``rl_step.rl_step``) on the next batch; its metrics, on the host."""
    start = time.perf_counter()
    key = jax.random.fold_in(jax.random.wrap_key_data(self.state.key), step)
    samples = self.loop.samples_due(step) if self.primary else 0
    self.state, out = rl_step_lib.rl_step(self.parts, self.fns, self.state, next(self.data_iter),
                                          key, num_samples=samples)
    self.samples = out.rollouts.samples
    return self.step_log.metrics(step, out, self.state, start=start)

  def _save(self, step: int, *, checkpointer: Any = None,
            extra: dict[str, Any] | None = None) -> None:
    """Saves the state as step ``step``, with what a resume needs besides it: the data
    position, the config, the records logged so far and the guard's events."""
    meta = {"data": self.data_iter.state(), "processes": jax.process_count(),
            "config": json.loads(self.config.to_json_best_effort()),
            run_build.LOGGED_KEY: dict(self.logged), **(extra or {})}
    if self.guard is not None:
      meta[run_build.GUARD_KEY] = {"events": self.guard.events, "lr_scale": self.guard.lr_scale}
    state = self.state
    if self.parts.run.lora:  # The adapters and their moments; the base is rebuilt (lora_base).
      state = state.replace(params=lora_base.saved_params(state.params))
      meta[lora_base.META_KEY] = self.base_identity
    (checkpointer or self.checkpointer).save(step, state, meta)

  def _act_on(self, done: int, decision: collapse.Decision) -> None:
    """The guard's restore or stop after step ``done``. A restore loads the best eval's state,
    rebuilds the update at the guard's learning-rate scale (``Parts.with_lr_scale``) and makes
    the restored step the latest checkpoint (``run_build.keep_restore``)."""
    event = decision.event
    if self.primary:
      logging.warning("collapse guard: %s at step %d (detected after step %d); %s",
                      event["why"], event["step"], done,
                      f"restored step {decision.restore_to} (eval {event['restored_eval']}), "
                      f"learning rate x {self.guard.lr_scale:g}" if decision.action == "restore"
                      else "stopping the run")
    if decision.action == "restore":
      self.checkpointer.wait()
      self.best_checkpointer.wait()
      self.state, meta = checkpointing.restore_run(self.best_checkpointer, self.state,
                                                   self.config, base_identity=self.base_identity)
      self.data_iter.restore(meta["data"])
      self.parts = self.parts.with_lr_scale(self.guard.lr_scale)
      self.fns = dataclasses.replace(self.fns, update=build.make_update(self.parts))
      self.step_log.parts = self.parts
    self._write(done, decision.record())
    if decision.action == "restore":  # The restored step becomes the latest checkpoint.
      run_build.keep_restore(self.workdir, self.checkpointer,
                             lambda staging: self._save(decision.restore_to, checkpointer=staging))
    if self.primary:
      run_build.write_events(self.workdir, self.guard)

  def run(self) -> list[dict[str, Any]]:
    """Trains from the latest checkpoint (or the start) to ``train.num_steps``, or until a
    SIGTERM or SIGINT, which saves at the next step boundary.

    Raises:
      TooManySkipsError: ``train.max_consecutive_skips`` skipped updates in a row; or a run
        that ended (not stopped by a signal) with every one of its steps skipping an update, or
        with no checkpoint at all: its result is not a trained model.
    """
    if self.stopped:  # A signal stopped the supervised start, or the guard stopped the run.
      if self.primary:
        logging.warning(self.stopped)
      self.close()
      return []
    history = []
    self.watcher.install()
    try:
      # A signal during the build (after the supervised start): stop before the first step.
      if self.start_step < self.loop.num_steps and self.watcher.reached(self.start_step):
        if self.primary:
          logging.warning("Stopped by a signal before the first step; rerun the same command "
                          "to continue")
        return history
      history = self._loop()
    except BaseException:
      self._close(raising=False)  # The error that stopped the loop is the one to report.
      raise
    self.close()
    return history

  def _loop(self) -> list[dict[str, Any]]:
    loop, guard = self.loop, self.guard
    history, skipped_steps, preempted = [], 0, False  # skipped: steps that skipped every update
    eval_key = jax.random.key(loop.seed + 1)
    if not self.resumed and loop.eval_every_steps:
      start = self.evaluate(self.state.params, eval_key)
      self._write(0, start)
      if guard is not None and guard.start(start):
        self._save(0, checkpointer=self.best_checkpointer,
                   extra={"eval": float(start[collapse.EVAL_METRIC])})
    progress = tqdm.tqdm(total=loop.num_steps, initial=self.start_step, desc="RL",
                         dynamic_ncols=True, disable=not self.primary)
    last_save, step = time.monotonic(), self.start_step
    try:
      while step < loop.num_steps:
        skipped_before = int(self.state.skipped_steps)
        metrics = self.rl_step(step)
        skipped_steps += (int(self.state.skipped_steps) - skipped_before == loop.num_iterations)
        done = step + 1
        if loop.eval_due(done):
          metrics.update(self.evaluate(self.state.params, eval_key))
        self._write(done, metrics)
        if self.writer is not None and self.samples:
          self.logged["samples"] += len(self.samples)
          with checkpointing.writing(self.workdir / "samples.jsonl"):
            self.writer.write_samples(done, self.samples)
        history.append({"step": done, **metrics})
        progress.update(1)
        progress.set_postfix(step_metrics.progress_fields(metrics))
        if self.lock is not None:
          self.lock.touch()
        skips = int(self.state.consecutive_skips)
        if skips >= loop.max_consecutive_skips and guard is None:
          self.checkpointer.wait()
          raise TooManySkipsError(
              f"{skips} consecutive updates were skipped (a non-finite loss, gradient, update "
              f"or parameters; step {done}); stopping. "
              + self._last_checkpoint(self.checkpointer.latest_step()))
        # A step that skipped an update is not checkpointed: the last checkpoint stays the last
        # step whose every update was finite. The guard judges the step before its checkpoint:
        # a restore saves the restored step, a collapsed one is saved only when it stops there.
        healthy = skips == 0
        decision = (guard.after_step(done, metrics, healthy) if guard is not None
                    else collapse.Decision())
        if decision.save_best:
          self._save(done, checkpointer=self.best_checkpointer,
                     extra={"eval": float(metrics[collapse.EVAL_METRIC])})
        if decision.event is not None:
          self._act_on(done, decision)
        preempted = self.watcher.reached(done)
        if decision.action == "restore":  # Restored (and saved): run it again.
          if preempted:
            self._stopped_by_signal(decision.restore_to)
            break
          step = progress.n = decision.restore_to
          progress.refresh()
          continue
        due = done % loop.checkpoint_every_steps == 0 or done == loop.num_steps
        if loop.checkpoint_every_seconds:  # Clocks differ: process 0 decides for all.
          due |= multihost.agree(time.monotonic() - last_save >= loop.checkpoint_every_seconds)
        guard_stop = decision.action == "stop"
        if healthy and (due or preempted or guard_stop):
          self._save(done)
          last_save = time.monotonic()
        if guard_stop:  # Stopped (as a signal stops it): its result is its checkpoints.
          preempted = True
          break
        if preempted:
          self._stopped_by_signal(done if healthy else self.checkpointer.latest_step())
          break
        step = done
    finally:
      progress.close()
    if history and not preempted:
      self._check_trained(history, skipped_steps)
    return history

  def _check_trained(self, history: list[dict[str, Any]], skipped_steps: int) -> None:
    """Raises TooManySkipsError if every step of this invocation skipped every update, or if
    none was saved."""
    ran = len(history)
    self.checkpointer.wait()
    last = self.checkpointer.latest_step()
    if skipped_steps == ran or last is None:
      what = (f"all {ran} steps of this run skipped every update" if skipped_steps == ran else
              f"no step of its {ran} was saved (a step that skips an update is not)")
      raise TooManySkipsError(
          f"the run ended at step {history[-1]['step']}, but {what} (a non-finite loss, "
          "gradient, update or parameters; fewer in a row than train.max_consecutive_skips="
          f"{self.loop.max_consecutive_skips}): nothing was trained. "
          + self._last_checkpoint(last))

  def _stopped_by_signal(self, saved: int | None) -> None:
    if self.primary:
      logging.warning("Stopped by a signal: saved step %s in %s; rerun the same command to "
                      "continue", saved, self.checkpointer.directory)

  def _last_checkpoint(self, last: int | None) -> str:
    return (f"The last good checkpoint is step {last} in {self.checkpointer.directory}."
            if last is not None else "No checkpoint was written: every saved state must pass "
            "that check, and none did.")

  def close(self) -> None:
    """Finishes the saves in flight, closes the writers, the checkpointers and the reward pool,
    and releases the workdir (``run`` does this when it ends). Each is closed even if one
    before it fails; the first failure is raised after LOCK is released."""
    self._close(raising=True)

  def _close(self, *, raising: bool) -> None:
    self.watcher.close()
    errors = self.closing.close()
    self._release_lock()  # Last: the saves above have finished (or failed).
    if raising and errors:
      raise errors[0]

  def _write(self, step: int, metrics: dict[str, Any]) -> None:
    """One metrics record (process 0 writes it; every process counts it)."""
    self.logged["metrics"] += 1
    if self.writer is not None:
      with checkpointing.writing(self.workdir / "metrics.jsonl"):
        self.writer.write(step, metrics)


def train(config: ml_collections.ConfigDict, workdir: str | epath.PathLike, *,
          hard_stop: bool = False) -> list[dict[str, Any]]:
  """Builds a Trainer and runs it; returns the per-step metrics of this invocation."""
  return Trainer(config, workdir, hard_stop=hard_stop).run()
