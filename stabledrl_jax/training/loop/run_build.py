"""One build of an RL run (docs/training.md): what the trainer's loop holds, made in two stages.

``read_inputs`` does what needs no workdir: the config's checks, the mesh, the tokenizer, a
checkpoint's config files (read once, ``build.check_checkpoint``), the resolved record, the task
and its prompts (those longer than rollout.prompt_length skipped and counted). The trainer runs
it before it creates anything in the workdir.

``build_run`` builds the rest in the workdir: the model (a checkpoint, the supervised start or a
fresh one), the run's parts on the mesh (``build.parts``) and its memoized step functions
(``rl_step.step_functions``), the reward pool, the checkpointer and a resumed state, the
collapse guard (``collapse.Guard``), the step log and the metrics writer. The loop reads only the
resolved record (``Resolved``) from then on; the raw config goes only into the checkpoints' meta.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from typing import Any, Callable, Iterator

import jax
import ml_collections
from absl import logging
from etils import epath
from flax import nnx

from stabledrl_jax import path_args, tasks, workdir_files
from stabledrl_jax.training.config import run_spec, specs
from stabledrl_jax.training.inputs import data, reward_pool
from stabledrl_jax.training.loop import collapse, metrics_writer, step_metrics
from stabledrl_jax.training.parallel import mesh as mesh_lib, multihost
from stabledrl_jax.training.state import checkpointing, lora_base, supervised
from stabledrl_jax.training.step import build, rl_step, rollout as rollout_lib

# Keys of a checkpoint's meta: the records metrics.jsonl and samples.jsonl held when it was
# saved (a resume keeps exactly those), and the collapse guard's events and learning-rate scale.
LOGGED_KEY = "logged"
GUARD_KEY = "collapse_guard"


@dataclasses.dataclass(frozen=True)
class Inputs:
  """What a run reads and resolves before its workdir: its record (for a checkpoint's model,
  from its config files), the mesh, the tokenizer, the task, the training examples that fit the
  rollout layout and the held-out prompts, encoded."""

  resolved: run_spec.Resolved
  mesh: jax.sharding.Mesh
  tokenizer: Any
  task: tasks.Task
  train_examples: list[Any]
  eval_prompts: data.PromptSet


def read_inputs(config: ml_collections.ConfigDict) -> Inputs:
  """The run's inputs, checked in the order a user fixes them: the config's fields
  (``specs.validate``), the tokenizer's files, then a model checkpoint's config files against
  the config (``build.check_checkpoint``), then the data. Sets the compilation cache
  (``train.compilation_cache_dir``) before anything compiles.

  Raises:
    ValueError / FileNotFoundError naming the field at fault.
  """
  specs.validate(config, num_devices=jax.device_count())
  if config.train.compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", str(config.train.compilation_cache_dir))
  mesh = mesh_lib.make_mesh(config.mesh)
  tokenizer = data.make_tokenizer(config.tokenizer)
  # A checkpoint's model is known from its config files until it is loaded (``with_model``).
  checkpoint = build.checkpoint_config(config)
  build.check_checkpoint(config, tokenizer, checkpoint)
  resolved = specs.resolve(config, jax.device_count(), check=False, model=checkpoint)
  task = tasks.get_task(resolved.data.task)
  spec = resolved.rollout
  train = data.fitting_examples(spec, tokenizer, task, data.make_examples(config, "train"),
                                split="train")
  held_out = data.fitting_examples(spec, tokenizer, task, data.make_examples(config, "eval"),
                                   split="eval")
  return Inputs(resolved=resolved, mesh=mesh, tokenizer=tokenizer, task=task,
                train_examples=train,
                eval_prompts=data.encode_examples(spec, tokenizer, task, held_out))


@dataclasses.dataclass
class Run:
  """A built run: the loop's parts and where it starts (the trainer holds them as its own).

  Attributes:
    resolved: the run's record, for the model as loaded.
    parts, fns: the step's parts and its jitted functions.
    rollouts: the host half of a step (``rollout.RolloutCollector``).
    state: the train state to start from; ``start_step`` its step, ``resumed`` whether it was
      restored from a checkpoint (a restored step 0 is resumed, not started).
    logged: the metrics and samples records logged up to ``state`` (``LOGGED_KEY``).
    base_identity: a LoRA run's frozen base (``lora_base.identity``), else None.
    guard: the collapse guard, or None when it is off; ``best_checkpointer`` its best eval's
      checkpoints.
    stopped: why the run trains nothing ('' when it trains): the guard stopped it.
  """

  resolved: run_spec.Resolved
  scorer: reward_pool.RewardScorer
  data_iter: tasks.DataIterator
  checkpointer: checkpointing.Checkpointer
  parts: build.Parts
  rollouts: rollout_lib.RolloutCollector
  fns: rl_step.StepFunctions
  state: Any
  start_step: int
  resumed: bool
  logged: dict[str, int] | None
  base_identity: dict[str, Any] | None
  step_log: step_metrics.StepLog
  guard: collapse.Guard | None = None
  best_checkpointer: checkpointing.Checkpointer | None = None
  writer: metrics_writer.MetricsWriter | None = None
  stopped: str = ""


class Closing:
  """The parts of a run that must be closed (the checkpointers, the reward pool, the writer),
  each with the path its close writes to, in the order they were made."""

  def __init__(self):
    self._parts = []

  def add(self, part: Any, where: epath.Path | None) -> None:
    self._parts.append((part, where))

  def close(self) -> list[BaseException]:
    """Closes each part once, even if one before it fails; returns the failures."""
    parts, self._parts, errors = self._parts, [], []
    for part, where in parts:
      try:
        with checkpointing.writing(where) if where is not None else contextlib.nullcontext():
          part.close()
      except BaseException as error:  # pylint: disable=broad-except
        errors.append(error)
    return errors


@contextlib.contextmanager
def claimed(workdir: epath.Path, closing: Closing) -> Iterator[Any]:
  """``workdir`` created and locked by process 0 (``checkpointing.WorkdirLock``, which refuses
  a second trainer) for a build; yields the lock (None on other processes).

  A build that fails (but for a signal's stop of the supervised start, which keeps what it
  made) leaves nothing of its own: its parts are closed (orbax's and the reward pool's threads
  end before the error), the empty directories it created in the workdir go while the lock is
  held (``path_args.remove_debris``), the lock is released, and so are the workdir's own
  directories if this build created them: never anything that existed before it.
  """
  primary = multihost.is_primary()
  created = path_args.missing_dirs(workdir) if primary else []
  before = path_args.entries(workdir) if primary else set()
  lock = None
  try:
    if primary:
      with checkpointing.writing(workdir):
        workdir.mkdir(parents=True, exist_ok=True)
      lock = checkpointing.WorkdirLock(workdir)
    yield lock
  except supervised.Stopped:
    raise
  except BaseException:
    closing.close()
    if lock is not None:
      path_args.remove_debris(workdir, before | {checkpointing.WorkdirLock.NAME})
      lock.release()
    path_args.remove_created(created)
    raise


def print_sft(step: int, metrics: dict[str, Any]) -> None:
  """The supervised start's progress line (process 0)."""
  if multihost.is_primary():
    print(f"sft step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))


def build_run(config: ml_collections.ConfigDict, inputs: Inputs, workdir: epath.Path, *,
              stop: Callable[[int], bool],
              on_part: Callable[[Any, epath.Path | None], None],
              log_sft: Callable[[int, dict[str, Any]], None] = print_sft) -> Run:
  """The run of ``config`` (``inputs.resolved``) in ``workdir`` on ``inputs.mesh``.

  ``stop(done)``: whether a signal asks the supervised start to stop at its step boundary
  (``supervised.Stopped`` then). ``on_part(part, where)``: each part that must be closed (the
  checkpointers, the reward pool, the writer) and the path its close writes to, as it is made,
  so that the caller closes what exists if a later part fails.
  """
  primary, resolved, mesh = multihost.is_primary(), inputs.resolved, inputs.mesh
  d, loop = resolved.data, resolved.loop
  # Every process draws the same global batches and keeps its own groups: the position is the
  # same everywhere, and a resumed run (on any number of processes) draws what an
  # uninterrupted one would.
  data_iter = tasks.DataIterator(inputs.train_examples, resolved.rollout.num_prompts,
                                 seed=loop.seed)
  checkpointer = checkpointing.Checkpointer(workdir, max_to_keep=loop.max_to_keep)
  on_part(checkpointer, checkpointer.directory)
  scorer = reward_pool.RewardScorer(inputs.task, d.reward, workers=d.reward_workers,
                                    timeout_s=d.reward_timeout_s)
  on_part(scorer, None)
  promote_restore(workdir, checkpointer)  # A guard's restore that a kill interrupted.
  latest = checkpointer.latest_step()
  model = _start_model(config, resolved, inputs, workdir, mesh, fresh=latest is None, stop=stop,
                       log_sft=log_sft)
  graphdef, params = nnx.split(build.with_lora(config, model, mesh), nnx.Param)
  resolved = resolved.with_model(model.config)
  parts = build.parts(resolved, mesh, graphdef, params)
  note = specs.estimator_note(config)
  if note and primary:
    print(note, file=sys.stderr, flush=True)
  # The reference for KL terms is the start of RL, frozen: with LoRA the base itself (the
  # adapters off), without a copy.
  keep_start = not parts.run.lora and (parts.run.uses_reference or loop.kl_to_start)
  rollouts = rollout_lib.RolloutCollector(
      parts.run, parts.rollout, tokenizer=inputs.tokenizer, task=inputs.task, scorer=scorer,
      graphdef=graphdef, model_config=model.config, mesh=mesh)
  fns = rl_step.step_functions(parts, rollouts, num_iterations=loop.num_iterations,
                               kl_to_start=loop.kl_to_start,
                               start_params=params if keep_start else None)
  state = build.initial_state(parts, params, loop.seed)
  base_identity = lora_base.identity(config, workdir) if parts.run.lora else None
  meta = None
  if latest is not None:
    state, meta = checkpointing.restore_run(checkpointer, state, config,
                                            base_identity=base_identity)
    data_iter.restore(meta["data"])
  start_step = int(state.step)
  run = Run(resolved=resolved, scorer=scorer, data_iter=data_iter, checkpointer=checkpointer,
            parts=parts, rollouts=rollouts, fns=fns, state=state, start_step=start_step,
            resumed=meta is not None,
            # None for a checkpoint older than the count (the writer keeps its step's records).
            logged={"metrics": 0, "samples": 0} if meta is None else meta.get(LOGGED_KEY),
            base_identity=base_identity,
            step_log=step_metrics.StepLog(loop, parts, rollouts.split, inputs.tokenizer,
                                          workdir, [term.name for term in scorer.terms]))
  if resolved.guard.enabled:
    _build_guard(run, workdir, meta, on_part)
  if run.stopped:  # The guard stopped this run: nothing is written, nothing trained.
    return run
  if primary:  # Only now: a failed resume leaves the workdir as it was.
    workdir_files.write_text(workdir / "config.json", config.to_json_best_effort(indent=2))
    run.writer = metrics_writer.MetricsWriter(
        workdir, resume_step=start_step, resume_records=run.logged,
        wandb=config.logging.wandb.to_dict(), config=json.loads(config.to_json_best_effort()))
    on_part(run.writer, workdir)
  # From here every record is counted; an older checkpoint's, as the writer kept.
  run.logged = (run.writer.counts() if run.writer is not None
                else dict(run.logged or {"metrics": 0, "samples": 0}))
  if run.guard is not None:  # metrics.jsonl as the writer left it: up to the resumed step.
    metrics = workdir / "metrics.jsonl"
    if metrics.exists() and run.resumed:
      run.guard.read_trajectory(metrics_writer.read_metrics(metrics), start_step)
    if run.guard.went_on_at == start_step and primary:
      write_events(workdir, run.guard)
  return run


def _start_model(config: ml_collections.ConfigDict, resolved: run_spec.Resolved, inputs: Inputs,
                 workdir: epath.Path, mesh: Any, *, fresh: bool, stop: Callable[[int], bool],
                 log_sft: Callable[[int, dict[str, Any]], None]) -> nnx.Module:
  """The model RL starts from: ``model.checkpoint``, else the supervised start (fitted on a
  fresh run; on a resumed one read back where the run needs it: the checkpoint holds the
  parameters, and the start is only what KL terms and kl_to_start measure against), else a
  fresh model."""
  model = build.build_model(config, inputs.tokenizer, mesh)
  if config.sft.num_steps and not config.model.checkpoint:
    if fresh:
      return supervised.supervised_start(config, workdir, model, inputs.tokenizer, inputs.task,
                                         inputs.train_examples, mesh, log_sft, stop=stop,
                                         rollout=resolved.rollout)
    if supervised.needs_start(config):
      return supervised.resumed_start(config, workdir, mesh)
  return model


def _build_guard(run: Run, workdir: epath.Path, meta: dict[str, Any] | None,
                 on_part: Callable[[Any, epath.Path | None], None]) -> None:
  """The collapse guard of ``run``: its events from the resumed checkpoint's meta and the
  events file (``collapse.Guard.resume``), its trajectory from ``metrics.jsonl``, and the
  checkpoint of the best eval. A run the guard stopped is not trained again (``run.stopped``
  says why) unless ``train.collapse_guard.go_on``."""
  settings = run.resolved.guard
  events = workdir / collapse.EVENTS_FILE
  written = collapse.load_events(events)[0] if events.exists() else []
  # A fresh start has no saved events, but a stop the guard made before the first checkpoint
  # (on a skipped step, never saved) still counts.
  saved = (meta or {}).get(GUARD_KEY, {"events": []} if meta is None else None)
  guard = run.guard = collapse.Guard.resume(
      settings, saved=None if saved is None else saved["events"], written=written,
      start_step=run.start_step)
  if guard.stopped is not None:
    stop = guard.stopped
    run.stopped = (
        f"the collapse guard stopped this run after step {stop.get('detected_at')} "
        f"({stop.get('why')}); its best eval's state is in {workdir / collapse.BEST_DIR}. "
        f"Nothing was trained; to train on from step {run.start_step}, rerun with "
        "--config.train.collapse_guard.go_on=True")
    return
  best = checkpointing.Checkpointer(workdir, max_to_keep=1, subdir=collapse.BEST_DIR)
  on_part(best, best.directory)
  run.best_checkpointer = best
  # A best eval after the resumed step belongs to the steps about to run again: they save it
  # again (orbax saves only steps above its latest).
  for step in best.all_steps():
    if step > run.start_step:
      best.delete(step)
  best_step = best.latest_step()
  if best_step is not None:  # Its eval is only named in the restore's event.
    try:
      value = best.restore_meta(best_step).get("eval")
    except Exception:  # pylint: disable=broad-except  (a restore reads it whole, or says why)
      value = None
    guard.best = (best_step, value)
  if guard.lr_scale != 1.0:
    run.parts = run.parts.with_lr_scale(guard.lr_scale)
    run.fns = dataclasses.replace(run.fns, update=build.make_update(run.parts))
    run.step_log.parts = run.parts


def keep_restore(workdir: epath.Path, checkpointer: checkpointing.Checkpointer,
                 save: Callable[[checkpointing.Checkpointer], None]) -> None:
  """Makes a collapse guard's restored state the latest checkpoint, so that a kill from here
  resumes it: ``save(staging)`` saves it whole, with the event in its meta, into
  ``<workdir>/checkpoints_restore/`` (synchronously), then ``promote_restore`` moves it into
  ``checkpoints/``. A kill before the staged save completes resumes the latest checkpoint as
  it was, whose rerun repeats the collapse and the restore exactly; a kill after it is finished
  by the next start's ``promote_restore``."""
  staging = checkpointing.Checkpointer(workdir, max_to_keep=1, async_save=False,
                                       subdir=checkpointing.RESTORE_DIR)
  try:
    save(staging)
    staging.wait()
  finally:
    staging.close()
  promote_restore(workdir, checkpointer)


def kept(workdir: epath.Path) -> str:
  """What an immediate stop keeps: the newest complete checkpoint (or supervised progress)."""
  for subdir, what in ((checkpointing.CHECKPOINT_DIR, "checkpoint"),
                       (supervised.SFT_PROGRESS_DIR, "saved supervised step")):
    directory = workdir / subdir
    steps = ([int(p.name) for p in directory.iterdir() if p.name.isdigit()]
             if directory.is_dir() else [])
    if steps:
      return f"the last {what} is step {max(steps)} in {directory}; rerun to continue from it"
  return f"no checkpoint was written in {workdir}; a rerun starts again"


def write_events(workdir: epath.Path, guard: collapse.Guard) -> None:
  """The guard's events file (``collapse.EVENTS_FILE``)."""
  workdir_files.write_text(workdir / collapse.EVENTS_FILE, guard.dump())


def promote_restore(workdir: epath.Path, checkpointer: checkpointing.Checkpointer) -> None:
  """A restored state staged in ``checkpoints_restore/`` (the collapse guard's) becomes the
  latest checkpoint: the checkpoints from its step on are moved to ``checkpoints_collapsed/``
  (its own step's earlier save, the same state, is removed) and it is moved into
  ``checkpoints/``. Nothing to do without one (a save that did not complete there is not a
  step)."""
  staged = workdir / checkpointing.RESTORE_DIR
  if not staged.is_dir():
    return
  primary = multihost.is_primary()
  steps = [int(p.name) for p in staged.iterdir() if p.name.isdigit()]
  if steps:
    step = max(steps)
    for later in checkpointer.all_steps():
      if later > step:
        moved = checkpointer.set_aside(later, to=checkpointing.COLLAPSED_DIR)
        if primary:
          logging.warning("collapse guard: checkpoint step %d moved to %s", later, moved)
    if step in checkpointer.all_steps():
      checkpointer.delete(step)
    checkpointer.adopt(step, staged / str(step))
  if primary:
    workdir_files.remove(staged)
  multihost.sync("stabledrl_jax: restored checkpoint promoted")
