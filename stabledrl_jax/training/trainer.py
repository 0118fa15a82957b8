"""The RL training loop (docs/training.md): the run built (``build``), then each RL step
(``rl_step.rl_step``: rollouts, l_old / l_ref, the updates, the objective state) followed by
what the loop owns: evaluation, metrics, checkpoints and signals.

The step's PRNG key is ``fold_in(run_key, step)``; with the data-iterator
state in the checkpoint, a resumed run repeats the uninterrupted one exactly.

The loop is the same for every model family (``config.model.family``): the
sampler, the likelihood function and estimators, and the stop tokens come from the family's
record (``models.family``), the model config from ``specs.model_config``.

Several processes (a TPU pod, GPU nodes; docs/pods.md) run the same loop on global arrays.
Every process draws the same global batch of prompts and keeps the groups whose rows live on
its devices (``multihost.RowSplit``): it encodes, samples, decodes and scores those alone, and
whole-batch metrics are reduced across processes. Process 0 writes the config, metrics,
TensorBoard events and the supervised start; all processes save the orbax checkpoints together.
SIGTERM (a preempted VM or job) saves a checkpoint at the next step boundary, agreed by all
processes, and ends the run normally; rerunning the command continues exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from typing import Any

import jax
import ml_collections
import tqdm
from absl import logging
from etils import epath
from flax import nnx

from stabledrl_jax import tasks, workdir_files
from stabledrl_jax.training import build, checkpointing, collapse, data, decoding, lora_base
from stabledrl_jax.training import mesh as mesh_lib, metrics_writer, multihost, preemption
from stabledrl_jax.training import reward_pool, rl_step as rl_step_lib, rollout as rollout_lib
from stabledrl_jax.training import optimizer as optimizer_lib, specs, step_metrics, supervised


class TooManySkipsError(RuntimeError):
  """Raised after ``train.max_consecutive_skips`` non-finite updates in a row."""


class Trainer:
  """Holds what the loop needs across steps; ``run()`` trains to ``train.num_steps``."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str | epath.PathLike, *,
               hard_stop: bool = False):
    """``hard_stop`` (the command line): a second Ctrl-C, or a SIGTERM not answered within
    ``train.stop_grace_s``, ends the process at once even inside a long jitted call
    (``preemption.PreemptionWatcher``); a notebook keeps its kernel (KeyboardInterrupt)."""
    specs.validate(config, num_devices=jax.device_count())
    if config.train.compilation_cache_dir:  # Before anything compiles.
      jax.config.update("jax_compilation_cache_dir", str(config.train.compilation_cache_dir))
    self.config = config
    self.workdir = checkpointing.resolve_workdir(workdir)
    self.primary = multihost.is_primary()
    self.lock = None
    # Why a signal stopped the build (the supervised start saved its progress), else ''.
    self.stopped = ""
    self.writer = self.checkpointer = self.scorer = None  # Closed by ``close``, whatever exists.
    if self.primary:
      with checkpointing.writing(self.workdir):
        self.workdir.mkdir(parents=True, exist_ok=True)
      self.lock = checkpointing.WorkdirLock(self.workdir)  # Refuses a second trainer.
    # From here SIGTERM and SIGINT stop at the next step boundary, the supervised start's ones
    # included; the handlers are restored after the build and installed again by ``run``.
    self.watcher = preemption.PreemptionWatcher(
        on_abort=self._release_lock, grace_s=config.train.stop_grace_s, hard_stop=hard_stop,
        kept=self._kept)
    try:
      self._build(config)
    except supervised.Stopped as stop:
      self.stopped = str(stop)
    except BaseException:
      self._close(raising=False)  # orbax's and the reward pool's threads end before the error.
      raise
    finally:
      self.watcher.uninstall()

  def _kept(self) -> str:
    """What an immediate stop keeps: the newest complete checkpoint (or supervised progress)."""
    for subdir, what in ((checkpointing.CHECKPOINT_DIR, "checkpoint"),
                         (supervised.SFT_PROGRESS_DIR, "saved supervised step")):
      directory = self.workdir / subdir
      steps = ([int(p.name) for p in directory.iterdir() if p.name.isdigit()]
               if directory.is_dir() else [])
      if steps:
        return f"the last {what} is step {max(steps)} in {directory}; rerun to continue from it"
    return f"no checkpoint was written in {self.workdir}; a rerun starts again"

  def _release_lock(self) -> None:
    if self.lock is not None:
      self.lock.release()
      self.lock = None

  def _build(self, config: ml_collections.ConfigDict) -> None:
    self.mesh = mesh_lib.make_mesh(config.mesh)
    r = config.rollout
    self.tokenizer = data.make_tokenizer(config.tokenizer)
    self.task = tasks.get_task(config.task.name)
    self.scorer = reward_pool.RewardScorer(self.task, config.task.reward,
                                           workers=config.task.reward_workers,
                                           timeout_s=config.task.reward_timeout_s)
    # Before the model and the supervised start: prompts longer than rollout.prompt_length are
    # skipped and counted (none fitting fails at once).
    prompt_spec = specs.resolve_rollout(config)
    self.train_examples = data.fitting_examples(prompt_spec, self.tokenizer, self.task,
                                                data.make_examples(config, "train"),
                                                split="train")
    self.eval_prompts = data.encode_examples(
        prompt_spec, self.tokenizer, self.task,
        data.fitting_examples(prompt_spec, self.tokenizer, self.task,
                              data.make_examples(config, "eval"), split="eval"))
    # Every process draws the same global batches and keeps its own groups: the position is the
    # same everywhere, and a resumed run (on any number of processes) draws what an
    # uninterrupted one would.
    self.data_iter = tasks.DataIterator(self.train_examples, r.num_prompts, seed=config.seed)

    self.checkpointer = checkpointing.Checkpointer(self.workdir,
                                                   max_to_keep=config.checkpoint.max_to_keep)
    latest = self.checkpointer.latest_step()
    model = build.build_model(config, self.tokenizer, self.mesh)
    if config.sft.num_steps and not config.model.checkpoint:
      if latest is None:
        model = supervised.supervised_start(config, self.workdir, model, self.tokenizer,
                                            self.task, self.train_examples, self.mesh,
                                            self._log_sft, stop=self.watcher.reached)
      # On resume the checkpoint holds the parameters; the SFT start is needed only as the
      # start of RL that KL terms and kl_to_start measure against.
      elif supervised.needs_start(config):
        model = supervised.resumed_start(config, self.workdir, self.mesh)
    model_config = model.config
    graphdef, params = nnx.split(build.with_lora(config, model, self.mesh), nnx.Param)
    # The config resolved once (validated in __init__), for the model as loaded.
    resolved = specs.resolve(config, self.mesh.devices.size, model=model_config, check=False)
    self.parts = parts = build.parts(resolved, self.mesh, graphdef, params)
    note = specs.estimator_note(config)
    if note and self.primary:
      print(note, file=sys.stderr, flush=True)
    # The reference for KL terms is the start of RL, frozen: with LoRA the base itself (the
    # adapters off), without a copy.
    kl_to_start = bool(config.diagnostics.get("kl_to_start", False))
    keep_start = not parts.run.lora and (parts.run.uses_reference or kl_to_start)
    self.rollouts = rollout_lib.RolloutCollector(
        parts.run, parts.rollout, tokenizer=self.tokenizer, task=self.task, scorer=self.scorer,
        graphdef=graphdef, model_config=model_config, mesh=self.mesh)
    self.fns = rl_step_lib.step_functions(
        parts, self.rollouts, num_iterations=config.train.num_iterations,
        kl_to_start=kl_to_start, start_params=params if keep_start else None)
    self.guard = collapse.GuardSettings.of(config.train.get("collapse_guard"))
    state = build.initial_state(parts, params, config.seed)
    self.start_step = 0
    self.base_identity = (lora_base.identity(config, self.workdir) if parts.run.lora else None)
    if latest is not None:
      state, meta = checkpointing.restore_run(self.checkpointer, state, config,
                                              base_identity=self.base_identity)
      self.data_iter.restore(meta["data"])
      self.start_step = int(state.step)
    self.state = state
    if self.primary:  # Only now: a failed resume leaves the workdir as it was.
      workdir_files.write_text(self.workdir / "config.json",
                               config.to_json_best_effort(indent=2))
    self.writer = (metrics_writer.MetricsWriter(
        self.workdir, resume_step=self.start_step, wandb=config.logging.wandb.to_dict(),
        config=json.loads(config.to_json_best_effort())) if self.primary else None)
    self.step_log = step_metrics.StepLog(config, parts, self.rollouts.split, self.tokenizer,
                                         self.workdir, [term.name for term in self.scorer.terms])
    self.samples = []  # This step's sample rollouts, for the writer.
    self._build_guard()

  # -------------------------------------------------------------------------
  # Pieces of a step.
  # -------------------------------------------------------------------------

  def _log_sft(self, step: int, metrics: dict[str, Any]) -> None:
    if self.primary:
      print(f"sft step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))

  def _model(self, params) -> nnx.Module:
    return nnx.merge(self.parts.graphdef, params)

  def evaluate(self, params, key, **options) -> dict[str, float]:
    """Greedy decoding of the held-out prompts (``decoding.generate_batches``, the path every
    evaluation shares): the task's metric, in percent, the mean reward and the mean model calls
    per sequence. ``options`` override the rollout's remasking / threshold / cache; the decoding
    is exact (no KV cache) unless they say otherwise.

    Each process decodes and scores its rows of every batch; the totals are summed over the
    processes."""
    prompts = self.eval_prompts
    settings = self.parts.rollout.evaluation.with_options(**options)
    totals = decoding.score_batches(
        self._model(params), self.tokenizer, self.task, prompts.examples, prompts.tokens,
        prompts.mask, key, settings, mesh=self.mesh, batch_size=self.config.eval.batch_size,
        reward_scheme=self.config.task.reward)
    # Whether this process's rows count is a property of the mesh: the rollout split's.
    return decoding.metrics_of(multihost.sum_over_rows(totals, self.rollouts.split),
                               len(prompts.examples))

  def rl_step(self, step: int) -> dict[str, Any]:
    """RL step ``step`` (``rl_step.rl_step``) on the next batch; its metrics, on the host."""
    start = time.perf_counter()
    key = jax.random.fold_in(jax.random.wrap_key_data(self.state.key), step)
    self.state, out = rl_step_lib.rl_step(self.parts, self.fns, self.state, next(self.data_iter),
                                          key, num_samples=self._samples_due(step))
    self.samples = out.rollouts.samples
    return self.step_log.metrics(step, out, self.state, start=start)

  def _samples_due(self, step: int) -> int:
    """How many rollouts step ``step`` logs: ``logging.num_samples`` on process 0 every
    ``logging.samples_every_steps`` steps, else none."""
    every, num = self.config.logging.samples_every_steps, self.config.logging.num_samples
    return num if self.primary and every and (step + 1) % every == 0 else 0

  # -------------------------------------------------------------------------
  # The collapse guard (training/collapse.py).
  # -------------------------------------------------------------------------

  def _build_guard(self) -> None:
    """The guard's trajectory (``metrics.jsonl`` up to the resumed step), its events and the
    learning-rate scale earlier restores left (``collapse.EVENTS_FILE``), and the checkpoint of
    the best eval."""
    self.guard_events = []
    self.lr_scale = 1.0
    self.best_checkpointer = None
    self.trajectory = collapse.Trajectory()
    if not self.guard.enabled:
      return
    events = self.workdir / collapse.EVENTS_FILE
    if events.exists():
      self.guard_events, self.lr_scale = collapse.load_events(events)
    metrics = self.workdir / "metrics.jsonl"
    if metrics.exists() and self.start_step:
      self.trajectory = collapse.Trajectory(metrics_writer.read_metrics(metrics),
                                            upto=self.start_step)
    self.best_checkpointer = checkpointing.Checkpointer(self.workdir, max_to_keep=1,
                                                        subdir=collapse.BEST_DIR)
    if self.lr_scale != 1.0:
      self._scale_learning_rate(self.lr_scale)

  def _scale_learning_rate(self, scale: float) -> None:
    """The update step with the optimizer at ``scale`` x ``optimizer.learning_rate`` (the same
    state layout: AdamW's moments carry over)."""
    optimizer = ml_collections.ConfigDict(self.config.optimizer.to_dict())
    optimizer.learning_rate = float(optimizer.learning_rate) * scale
    self.parts = dataclasses.replace(
        self.parts, tx=optimizer_lib.make_optimizer(optimizer, self.parts.num_updates),
        schedule=optimizer_lib.learning_rate_schedule(optimizer, self.parts.num_updates))
    self.fns = dataclasses.replace(self.fns, update=build.make_update(self.parts))
    self.step_log.parts = self.parts

  def _track(self, done: int, record: dict[str, Any], healthy: bool) -> None:
    """The guard's record of step ``done`` (0: the start's evaluation); a new best eval's state
    (above every earlier one) is saved as the best checkpoint."""
    best = self.trajectory.best_eval()
    self.trajectory.add({"step": done, **record})
    value = record.get(collapse.EVAL_METRIC)
    if healthy and value is not None and (best is None or float(value) > best):
      self._save(done, checkpointer=self.best_checkpointer, extra={"eval": float(value)})

  def _guard(self, done: int, record: dict[str, Any], healthy: bool) -> int | None:
    """After step ``done``: ``_track``, then the rules. Returns the step the run goes on from
    after a restore, -1 to stop, None to go on."""
    self._track(done, record, healthy)
    event = collapse.first_collapse(self.trajectory.records(), self.guard.rules)
    if event is None:
      return None
    restores = sum(e["action"] == "restore" for e in self.guard_events)
    self.checkpointer.wait()
    self.best_checkpointer.wait()
    best_step = self.best_checkpointer.latest_step()
    # The best eval before the collapse (an eval rule's always is): a later one would hold it.
    action = "restore" if (self.guard.action == "restore" and restores < self.guard.max_restores
                           and best_step is not None and best_step < event["step"]) else "stop"
    event = {**event, "detected_at": done, "action": action}
    if action == "restore":
      state, meta = checkpointing.restore_run(self.best_checkpointer, self.state, self.config,
                                              base_identity=self.base_identity)
      self.state = state
      self.data_iter.restore(meta["data"])
      self.lr_scale *= self.guard.lr_factor
      self._scale_learning_rate(self.lr_scale)
      self.trajectory.truncate(best_step)
      event.update(restored_step=best_step, restored_eval=meta.get("eval"),
                   lr_scale=self.lr_scale)
    self.guard_events.append(event)
    if self.primary:
      workdir_files.write_text(self.workdir / collapse.EVENTS_FILE, json.dumps(
          {"events": self.guard_events, "lr_scale": self.lr_scale}, indent=2))
      logging.warning("collapse guard: %s at step %d (detected after step %d); %s",
                      event["why"], event["step"], done,
                      f"restored step {best_step} (eval {meta.get('eval')}), learning rate x "
                      f"{self.lr_scale:g}" if action == "restore" else "stopping the run")
    self._write(done, {"collapse_guard/restored_to": best_step if action == "restore" else -1,
                       "collapse_guard/lr_scale": self.lr_scale})
    return best_step if action == "restore" else -1

  # -------------------------------------------------------------------------
  # The loop.
  # -------------------------------------------------------------------------

  def _save(self, step: int, *, checkpointer: Any = None,
            extra: dict[str, Any] | None = None) -> None:
    meta = {"data": self.data_iter.state(), "processes": jax.process_count(),
            "config": json.loads(self.config.to_json_best_effort()), **(extra or {})}
    state = self.state
    if self.parts.run.lora:  # The adapters and their moments; the base is rebuilt (lora_base).
      state = state.replace(params=lora_base.saved_params(state.params))
      meta[lora_base.META_KEY] = self.base_identity
    (checkpointer or self.checkpointer).save(step, state, meta)

  def run(self) -> list[dict[str, Any]]:
    """Trains from the latest checkpoint (or the start) to ``train.num_steps``, or until a
    SIGTERM or SIGINT, which saves at the next step boundary.

    Raises:
      TooManySkipsError: ``train.max_consecutive_skips`` skipped updates in a row; or a run
        that ended (not stopped by a signal) with every one of its steps skipping an update, or
        with no checkpoint at all: its result is not a trained model.
    """
    config = self.config
    if self.stopped:  # The supervised start was stopped by a signal and saved.
      if self.primary:
        logging.warning(self.stopped)
      self.close()
      return []
    history = []
    watcher = self.watcher
    watcher.install()
    try:
      # A signal during the build (after the supervised start): stop before the first step.
      if self.start_step < config.train.num_steps and watcher.reached(self.start_step):
        if self.primary:
          logging.warning("Stopped by a signal before the first step; rerun the same command "
                          "to continue")
        return history
      history = self._loop(watcher)
    except BaseException:
      self._close(raising=False)  # The error that stopped the loop is the one to report.
      raise
    self.close()
    return history

  def _loop(self, watcher: preemption.PreemptionWatcher) -> list[dict[str, Any]]:
    config = self.config
    history = []
    eval_key = jax.random.key(config.seed + 1)
    every = config.eval.every_steps
    if self.start_step == 0 and every:
      start = self.evaluate(self.state.params, eval_key)
      self._write(0, start)
      if self.guard.enabled:
        self._track(0, start, healthy=True)
    progress = tqdm.tqdm(total=config.train.num_steps, initial=self.start_step,
                         desc="RL", dynamic_ncols=True, disable=not self.primary)
    last_save = time.monotonic()
    skipped_steps = 0  # Steps of this invocation that skipped every update.
    preempted = False
    step = self.start_step
    try:
      while step < config.train.num_steps:
        skipped_before = int(self.state.skipped_steps)
        metrics = self.rl_step(step)
        skipped_steps += (int(self.state.skipped_steps) - skipped_before
                          == config.train.num_iterations)
        done = step + 1
        if every and (done % every == 0 or done == config.train.num_steps):
          metrics.update(self.evaluate(self.state.params, eval_key))
        self._write(done, metrics)
        if self.writer is not None and self.samples:
          with checkpointing.writing(self.workdir / "samples"):
            self.writer.write_samples(done, self.samples)
        history.append({"step": done, **metrics})
        progress.update(1)
        progress.set_postfix(reward=f"{metrics['rewards/mean']:.3f}",
                             step_s=f"{metrics['time/step_s']:.2f}")
        if self.lock is not None:
          self.lock.touch()
        guarded = self.guard.enabled
        if (int(self.state.consecutive_skips) >= config.train.max_consecutive_skips
            and not guarded):
          self.checkpointer.wait()
          last = self.checkpointer.latest_step()
          raise TooManySkipsError(
              f"{int(self.state.consecutive_skips)} consecutive updates were skipped (a "
              f"non-finite loss, gradient, update or parameters; step {done}); stopping. "
              + self._last_checkpoint(last))
        preempted = watcher.reached(done)
        due = done % config.checkpoint.every_steps == 0 or done == config.train.num_steps
        if config.checkpoint.every_seconds:  # Clocks differ: process 0 decides for all.
          due |= multihost.agree(
              time.monotonic() - last_save >= config.checkpoint.every_seconds)
        # A step that skipped an update is not checkpointed: the last checkpoint stays the
        # last step whose every update was finite.
        healthy = int(self.state.consecutive_skips) == 0
        if healthy and (due or preempted):
          self._save(done)
          last_save = time.monotonic()
        if preempted:
          if self.primary:
            logging.warning("Stopped by a signal: saved step %d in %s; rerun the same command to "
                            "continue",
                            done if healthy else self.checkpointer.latest_step(),
                            self.checkpointer.directory)
          break
        step = done
        if guarded:
          resume = self._guard(done, metrics, healthy)
          if resume == -1:  # Stopped (as a signal stops it): its result is its checkpoints.
            preempted = True
            break
          if resume is not None:  # Restored: the steps after it run again.
            step = resume
            progress.n = step
            progress.refresh()
    finally:
      progress.close()
    ran = len(history)
    if ran and not preempted:
      self.checkpointer.wait()
      last = self.checkpointer.latest_step()
      if skipped_steps == ran or last is None:
        what = (f"all {ran} steps of this run skipped every update" if skipped_steps == ran else
                f"no step of its {ran} was saved (a step that skips an update is not)")
        raise TooManySkipsError(
            f"the run ended at step {history[-1]['step']}, but {what} (a non-finite loss, "
            "gradient, update or parameters; fewer in a row than train.max_consecutive_skips="
            f"{config.train.max_consecutive_skips}): nothing was trained. "
            + self._last_checkpoint(last))
    return history

  def _last_checkpoint(self, last: int | None) -> str:
    return (f"The last good checkpoint is step {last} in {self.checkpointer.directory}."
            if last is not None else "No checkpoint was written: every saved state must pass "
            "that check, and none did.")

  def close(self) -> None:
    """Finishes the saves in flight, closes the writers and the reward pool, and releases the
    workdir (``run`` does this when it ends). Each is closed even if one before it fails; the
    first failure is raised after LOCK is released."""
    self._close(raising=True)

  def _close(self, *, raising: bool) -> None:
    self.watcher.close()
    errors = []
    parts = [(self.checkpointer, self.workdir / checkpointing.CHECKPOINT_DIR),
             (getattr(self, "best_checkpointer", None), self.workdir / collapse.BEST_DIR),
             (self.scorer, None), (self.writer, self.workdir)]
    for part, where in parts:
      if part is None:
        continue
      try:
        with checkpointing.writing(where) if where is not None else contextlib.nullcontext():
          part.close()
      except BaseException as error:  # pylint: disable=broad-except
        errors.append(error)
    self.checkpointer = self.scorer = self.writer = self.best_checkpointer = None
    self._release_lock()  # Last: the saves above have finished (or failed).
    if raising and errors:
      raise errors[0]

  def _write(self, step: int, metrics: dict[str, Any]) -> None:
    if self.writer is not None:
      with checkpointing.writing(self.workdir / "metrics.jsonl"):
        self.writer.write(step, metrics)


def train(config: ml_collections.ConfigDict, workdir: str | epath.PathLike, *,
          hard_stop: bool = False) -> list[dict[str, Any]]:
  """Builds a Trainer and runs it; returns the per-step metrics of this invocation."""
  return Trainer(config, workdir, hard_stop=hard_stop).run()
