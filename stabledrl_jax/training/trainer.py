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

from stabledrl_jax import path_args, tasks, workdir_files
from stabledrl_jax.training import build, checkpointing, collapse, data, decoding, lora_base
from stabledrl_jax.training import mesh as mesh_lib, metrics_writer, multihost, preemption
from stabledrl_jax.training import reward_pool, rl_step as rl_step_lib, rollout as rollout_lib
from stabledrl_jax.training import optimizer as optimizer_lib, specs, step_metrics, supervised


# Keys of a checkpoint's meta: the records metrics.jsonl and samples.jsonl held when it was
# saved (a resume keeps exactly those), and the collapse guard's events and learning-rate scale.
LOGGED_KEY = "logged"
GUARD_KEY = "collapse_guard"


class TooManySkipsError(RuntimeError):
  """Raised after ``train.max_consecutive_skips`` non-finite updates in a row."""


class Trainer:
  """Holds what the loop needs across steps; ``run()`` trains to ``train.num_steps``."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str | epath.PathLike, *,
               hard_stop: bool = False):
    """``hard_stop`` (the command line): a second Ctrl-C, or a SIGTERM not answered within
    ``train.stop_grace_s``, ends the process at once even inside a long jitted call
    (``preemption.PreemptionWatcher``); a notebook keeps its kernel (KeyboardInterrupt).

    Everything that can be checked without the workdir is checked before anything is created
    in it (docs/reliability.md): the workdir's name (``path_args.check``), the config, the
    tokenizer, the task's data, and a checkpoint's config files (fetched from the Hub where
    ``model.checkpoint`` is an id: offline and not cached fails here), a PEFT adapter's rank,
    alpha and targets included (``build.check_checkpoint``). A start that fails later (a
    model's weights that cannot be read) removes the directories it created while they are
    empty (``path_args.remove_debris``): never anything that existed before it."""
    path_args.check(workdir, "workdir")
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
    self.mesh = mesh_lib.make_mesh(config.mesh)
    self.tokenizer = data.make_tokenizer(config.tokenizer)
    self.task = tasks.get_task(config.task.name)
    # Prompts longer than rollout.prompt_length are skipped and counted (none fitting fails at
    # once).
    prompt_spec = specs.resolve_rollout(config)
    self.train_examples = data.fitting_examples(prompt_spec, self.tokenizer, self.task,
                                                data.make_examples(config, "train"),
                                                split="train")
    self.eval_prompts = data.encode_examples(
        prompt_spec, self.tokenizer, self.task,
        data.fitting_examples(prompt_spec, self.tokenizer, self.task,
                              data.make_examples(config, "eval"), split="eval"))
    build.check_checkpoint(config, self.tokenizer)
    # What this invocation creates: the workdir (and its missing parents), or new entries in it.
    created = path_args.missing_dirs(self.workdir) if self.primary else []
    before = path_args.entries(self.workdir) if self.primary else set()
    # From here SIGTERM and SIGINT stop at the next step boundary, the supervised start's ones
    # included; the handlers are restored after the build and installed again by ``run``.
    self.watcher = preemption.PreemptionWatcher(
        on_abort=self._release_lock, grace_s=config.train.stop_grace_s, hard_stop=hard_stop,
        kept=self._kept)
    try:
      if self.primary:
        with checkpointing.writing(self.workdir):
          self.workdir.mkdir(parents=True, exist_ok=True)
        self.lock = checkpointing.WorkdirLock(self.workdir)  # Refuses a second trainer.
      self._build(config)
    except supervised.Stopped as stop:
      self.stopped = str(stop)
    except BaseException:
      lock, self.lock = self.lock, None  # Held while the debris goes: no other trainer's.
      self._close(raising=False)  # orbax's and the reward pool's threads end before the error.
      if lock is not None:
        path_args.remove_debris(self.workdir, before | {checkpointing.WorkdirLock.NAME})
        lock.release()
      path_args.remove_created(created)
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
    """The run's parts, in the workdir (the mesh, the tokenizer and the data are ``__init__``'s,
    built before it touches the workdir)."""
    r = config.rollout
    self.scorer = reward_pool.RewardScorer(self.task, config.task.reward,
                                           workers=config.task.reward_workers,
                                           timeout_s=config.task.reward_timeout_s)
    # Every process draws the same global batches and keeps its own groups: the position is the
    # same everywhere, and a resumed run (on any number of processes) draws what an
    # uninterrupted one would.
    self.data_iter = tasks.DataIterator(self.train_examples, r.num_prompts, seed=config.seed)

    self.checkpointer = checkpointing.Checkpointer(self.workdir,
                                                   max_to_keep=config.checkpoint.max_to_keep)
    self._promote_restore()  # A guard's restore that a kill interrupted.
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
    meta = None
    if latest is not None:
      state, meta = checkpointing.restore_run(self.checkpointer, state, config,
                                              base_identity=self.base_identity)
      self.data_iter.restore(meta["data"])
      self.start_step = int(state.step)
    self.state = state
    self.resumed = meta is not None  # (A restored step 0 is resumed, not started.)
    # The records logged up to the resumed checkpoint: none for a fresh start; None for a
    # checkpoint older than this count (the writer then keeps the records up to its step).
    self.logged = {"metrics": 0, "samples": 0} if meta is None else meta.get(LOGGED_KEY)
    self.step_log = step_metrics.StepLog(config, parts, self.rollouts.split, self.tokenizer,
                                         self.workdir, [term.name for term in self.scorer.terms])
    self.samples = []  # This step's sample rollouts, for the writer.
    self._build_guard(meta)
    if self.stopped:  # The guard stopped this run: nothing is written, nothing trained.
      return
    if self.primary:  # Only now: a failed resume leaves the workdir as it was.
      workdir_files.write_text(self.workdir / "config.json",
                               config.to_json_best_effort(indent=2))
    self.writer = (metrics_writer.MetricsWriter(
        self.workdir, resume_step=self.start_step, resume_records=self.logged,
        wandb=config.logging.wandb.to_dict(),
        config=json.loads(config.to_json_best_effort())) if self.primary else None)
    # From here every record is counted (``_write``); an older checkpoint's, as the writer kept.
    self.logged = (self.writer.counts() if self.writer is not None
                   else dict(self.logged or {"metrics": 0, "samples": 0}))
    if self.guard.enabled:
      self._resume_guard()

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

  def _build_guard(self, meta: dict[str, Any] | None) -> None:
    """The guard's events and the learning-rate scale earlier restores left: the resumed
    checkpoint's (``collapse.events_on_resume``), and the checkpoint of the best eval. A run
    the guard stopped is not trained again (``self.stopped`` says why) unless
    ``train.collapse_guard.go_on``."""
    self.guard_events = []
    self.lr_scale = 1.0
    self.best_checkpointer = None
    self.trajectory = collapse.Trajectory()
    if not self.guard.enabled:
      return
    events = self.workdir / collapse.EVENTS_FILE
    written = collapse.load_events(events)[0] if events.exists() else []
    # A fresh start has no saved events, but a stop the guard made before the first
    # checkpoint (on a skipped step, never saved) still counts.
    saved = (meta or {}).get(GUARD_KEY, {"events": []} if meta is None else None)
    self.guard_events = collapse.events_on_resume(
        saved["events"] if saved is not None else None, written)
    self.lr_scale = collapse.lr_scale_of(self.guard_events)
    stop = collapse.stopped_by(self.guard_events)
    if stop is not None:
      if not self.guard.go_on:
        self.stopped = (
            f"the collapse guard stopped this run after step {stop.get('detected_at')} "
            f"({stop.get('why')}); its best eval's state is in {self.workdir / collapse.BEST_DIR}"
            ". Nothing was trained; to train on from step "
            f"{self.start_step}, rerun with --config.train.collapse_guard.go_on=True")
        return
      self.guard_events.append({"action": "go_on", "step": self.start_step})
    self.best_checkpointer = checkpointing.Checkpointer(self.workdir, max_to_keep=1,
                                                        subdir=collapse.BEST_DIR)
    # A best eval after the resumed step belongs to the steps about to run again: they save it
    # again (orbax saves only steps above its latest).
    for step in self.best_checkpointer.all_steps():
      if step > self.start_step:
        self.best_checkpointer.delete(step)
    if self.lr_scale != 1.0:
      self._scale_learning_rate(self.lr_scale)

  def _resume_guard(self) -> None:
    """The guard's trajectory: ``metrics.jsonl`` as the writer left it (the records up to the
    resumed step), after the last 'go on' (the rules judge the run from there)."""
    go_on = [e["step"] for e in self.guard_events if e.get("action") == "go_on"]
    metrics = self.workdir / "metrics.jsonl"
    if metrics.exists() and self.resumed:
      self.trajectory = collapse.Trajectory(metrics_writer.read_metrics(metrics),
                                            upto=self.start_step,
                                            after=go_on[-1] if go_on else None)
    if go_on and go_on[-1] == self.start_step and self.primary:
      self._write_events()

  def _write_events(self) -> None:
    workdir_files.write_text(self.workdir / collapse.EVENTS_FILE, json.dumps(
        {"events": self.guard_events, "lr_scale": self.lr_scale}, indent=2))

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
    """After step ``done`` (before its checkpoint): ``_track``, then the rules. Returns the
    step the run goes on from after a restore (saved as the latest checkpoint), -1 to stop,
    None to go on."""
    self._track(done, record, healthy)
    event = collapse.first_collapse(self.trajectory.records(), self.guard.rules)
    if event is None:
      return None
    restores = collapse.restores_since_go_on(self.guard_events)
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
      logging.warning("collapse guard: %s at step %d (detected after step %d); %s",
                      event["why"], event["step"], done,
                      f"restored step {best_step} (eval {meta.get('eval')}), learning rate x "
                      f"{self.lr_scale:g}" if action == "restore" else "stopping the run")
    self._write(done, {"collapse_guard/restored_to": best_step if action == "restore" else -1,
                       "collapse_guard/lr_scale": self.lr_scale})
    if action == "stop":
      if self.primary:
        self._write_events()
      return -1
    self._keep_restore(best_step)
    return best_step

  def _keep_restore(self, step: int) -> None:
    """Makes the restored ``step`` the run's latest checkpoint, so that a kill from here resumes
    it: the restored state is saved with the event in its meta into
    ``<workdir>/checkpoints_restore/`` (complete, synchronously), then ``_promote_restore``
    moves the checkpoints after it (the collapsed trajectory) to
    ``<workdir>/checkpoints_collapsed/`` and moves it into ``checkpoints/``. The events file
    follows the checkpoint. A kill before the staged save completes resumes the latest
    checkpoint as it was, whose rerun repeats the collapse and the restore exactly; a kill after
    it is finished by the next start's ``_promote_restore``."""
    staging = checkpointing.Checkpointer(self.workdir, max_to_keep=1, async_save=False,
                                         subdir=checkpointing.RESTORE_DIR)
    try:
      self._save(step, checkpointer=staging)
      staging.wait()
    finally:
      staging.close()
    self._promote_restore()
    if self.primary:
      self._write_events()

  def _promote_restore(self) -> None:
    """A restored state staged in ``checkpoints_restore/`` becomes the latest checkpoint: the
    checkpoints from its step on are moved to ``checkpoints_collapsed/`` (its own step's
    earlier save, the same state, is removed) and it is moved into ``checkpoints/``. Nothing
    to do without one (a save that did not complete there is not a step)."""
    staged = self.workdir / checkpointing.RESTORE_DIR
    if not staged.is_dir():
      return
    steps = [int(p.name) for p in staged.iterdir() if p.name.isdigit()]
    if steps:
      step = max(steps)
      for later in self.checkpointer.all_steps():
        if later > step:
          moved = self.checkpointer.set_aside(later, to=checkpointing.COLLAPSED_DIR)
          if self.primary:
            logging.warning("collapse guard: checkpoint step %d moved to %s", later, moved)
      if step in self.checkpointer.all_steps():
        self.checkpointer.delete(step)
      self.checkpointer.adopt(step, staged / str(step))
    if self.primary:
      workdir_files.remove(staged)
    multihost.sync("stabledrl_jax: restored checkpoint promoted")

  # -------------------------------------------------------------------------
  # The loop.
  # -------------------------------------------------------------------------

  def _save(self, step: int, *, checkpointer: Any = None,
            extra: dict[str, Any] | None = None) -> None:
    """Saves the state as step ``step``, with what a resume needs besides it: the data
    position, the config, the records logged so far (``LOGGED_KEY``) and the guard's events."""
    meta = {"data": self.data_iter.state(), "processes": jax.process_count(),
            "config": json.loads(self.config.to_json_best_effort()),
            LOGGED_KEY: dict(self.logged), **(extra or {})}
    if self.guard.enabled:
      meta[GUARD_KEY] = {"events": self.guard_events, "lr_scale": self.lr_scale}
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
    if not self.resumed and every:
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
          self.logged["samples"] += len(self.samples)
          with checkpointing.writing(self.workdir / "samples.jsonl"):
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
        # A step that skipped an update is not checkpointed: the last checkpoint stays the
        # last step whose every update was finite.
        healthy = int(self.state.consecutive_skips) == 0
        # The guard judges the step before its checkpoint: a restore saves the restored step,
        # and a collapsed step is saved only when the guard stops the run there.
        decision = self._guard(done, metrics, healthy) if guarded else None
        guard_stop = decision == -1
        preempted = watcher.reached(done)
        if decision is not None and decision >= 0:  # Restored (and saved): run it again.
          if preempted:
            self._stopped_by_signal(decision)
            break
          step = decision
          progress.n = step
          progress.refresh()
          continue
        due = done % config.checkpoint.every_steps == 0 or done == config.train.num_steps
        if config.checkpoint.every_seconds:  # Clocks differ: process 0 decides for all.
          due |= multihost.agree(
              time.monotonic() - last_save >= config.checkpoint.every_seconds)
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

  def _stopped_by_signal(self, saved: int | None) -> None:
    if self.primary:
      logging.warning("Stopped by a signal: saved step %s in %s; rerun the same command to "
                      "continue", saved, self.checkpointer.directory)

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
    """One metrics record (process 0 writes it; every process counts it)."""
    self.logged["metrics"] += 1
    if self.writer is not None:
      with checkpointing.writing(self.workdir / "metrics.jsonl"):
        self.writer.write(step, metrics)


def train(config: ml_collections.ConfigDict, workdir: str | epath.PathLike, *,
          hard_stop: bool = False) -> list[dict[str, Any]]:
  """Builds a Trainer and runs it; returns the per-step metrics of this invocation."""
  return Trainer(config, workdir, hard_stop=hard_stop).run()
