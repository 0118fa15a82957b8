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
import math
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm
from absl import logging
from etils import epath
from flax import nnx

from stabledrl_jax import models, profiling, tasks, workdir_files
from stabledrl_jax.models import lora as lora_lib
from stabledrl_jax.training import build, checkpointing, data, decoding, lora_base
from stabledrl_jax.training import mesh as mesh_lib, metrics_writer, multihost, preemption
from stabledrl_jax.training import reward_pool, rl_step as rl_step_lib, rollout as rollout_lib
from stabledrl_jax.training import specs, spikes, supervised, train_step

class TooManySkipsError(RuntimeError):
  """Raised after ``train.max_consecutive_skips`` non-finite updates in a row."""


# Top-level fields of older checkpoints' states that now live in ``TrainState.objective_state``:
# StableDRL's clip bound was ``TrainState.log_clip_hi``.
_LEGACY_OBJECTIVE_FIELDS = ("log_clip_hi",)


def _restore_item(fields: dict[str, Any], stored: dict[str, list[tuple[int, ...]]],
                  where: str) -> dict[str, Any]:
  """What to restore of a checkpoint whose state has ``stored`` fields, as a dict of abstract
  arrays: this state's ``fields``, with an older checkpoint's layout where it has one.

  A checkpoint without ``objective_state`` (or with an empty one) restores the rest, and the
  missing subtree starts as a fresh run's (``_restored_state``), except a legacy top-level
  leaf that the objective state holds under the same name (StableDRL's ``log_clip_hi``).

  Raises:
    ValueError: the stored arrays do not have this state's shapes (another model).
  """
  objective_state = fields["objective_state"]
  item = {name: value for name, value in fields.items() if name in stored}
  for name in _LEGACY_OBJECTIVE_FIELDS:
    if name in stored and name not in fields:  # Read and dropped unless the state holds it.
      like = objective_state.get(name) if isinstance(objective_state, dict) else None
      item[name] = like if like is not None else jax.ShapeDtypeStruct(
          (), jnp.float32, sharding=fields["step"].sharding)
  want = sorted(tuple(x.shape) for x in jax.tree.leaves(item))
  have = sorted(shape for shapes in stored.values() for shape in shapes)
  required = set(fields) - {"objective_state"}
  if want != have or not required <= set(stored):
    full = sorted(tuple(x.shape) for x in jax.tree.leaves(fields))
    mismatch = next(((a, b) for a, b in zip(have, full) if a != b), (len(have), len(full)))
    raise ValueError(f"config does not match {where}: its {len(have)} arrays do not have "
                     f"the shapes of this model's state ({len(full)}; e.g. "
                     f"{mismatch[0]} stored vs {mismatch[1]}). Resume with the "
                     "checkpoint's model config, or start a new --workdir.")
  return item


def _restored_state(fresh: train_step.TrainState, restored: dict[str, Any]
                    ) -> train_step.TrainState:
  """The state of a restored ``_restore_item``: missing objective state from ``fresh``."""
  objective_state = restored.pop("objective_state", None)
  if objective_state is None or not jax.tree.leaves(objective_state):
    objective_state = fresh.objective_state
    if isinstance(objective_state, dict):
      objective_state = {**objective_state, **{
          name: restored[name] for name in _LEGACY_OBJECTIVE_FIELDS
          if name in restored and name in objective_state}}
  for name in _LEGACY_OBJECTIVE_FIELDS:
    restored.pop(name, None)
  return fresh.replace(**restored, objective_state=objective_state)


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
    decoding.check_chunks(r, mesh_lib.data_parallel_size(self.mesh))  # microbatch_groups
    self.tokenizer = data.make_tokenizer(config.tokenizer)
    self.task = tasks.get_task(config.task.name)
    self.scorer = reward_pool.RewardScorer(self.task, config.task.reward,
                                           workers=config.task.reward_workers,
                                           timeout_s=config.task.reward_timeout_s)
    self.train_examples = data.make_examples(config, "train")
    self.eval_prompts = data.encode_examples(config, self.tokenizer, self.task,
                                             data.make_examples(config, "eval"))
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
    self.parts = parts = build.parts(config, self.mesh, graphdef, params, model_config)
    note = specs.estimator_note(config)
    if note and self.primary:
      print(note, file=sys.stderr, flush=True)
    # The reference for KL terms is the start of RL, frozen: with LoRA the base itself (the
    # adapters off), without a copy.
    kl_to_start = bool(config.diagnostics.get("kl_to_start", False))
    keep_start = not parts.run.lora and (parts.run.uses_reference or kl_to_start)
    self.rollouts = rollout_lib.RolloutCollector(
        config, parts.run, tokenizer=self.tokenizer, task=self.task, scorer=self.scorer,
        graphdef=graphdef, model_config=model_config, mesh=self.mesh)
    self.fns = rl_step_lib.step_functions(
        parts, self.rollouts, num_iterations=config.train.num_iterations,
        kl_to_start=kl_to_start, start_params=params if keep_start else None)
    state = build.initial_state(parts, params, config.seed)
    self.start_step = 0
    self.base_identity = (lora_base.identity(config, self.workdir) if parts.run.lora else None)
    if latest is not None:
      state, meta = self._restore(state)
      self.data_iter.restore(meta["data"])
      self.start_step = int(state.step)
    self.state = state
    if self.primary:  # Only now: a failed resume leaves the workdir as it was.
      workdir_files.write_text(self.workdir / "config.json",
                               config.to_json_best_effort(indent=2))
    self.writer = (metrics_writer.MetricsWriter(
        self.workdir, resume_step=self.start_step, wandb=config.logging.wandb.to_dict(),
        config=json.loads(config.to_json_best_effort())) if self.primary else None)
    self.num_params = models.count_params(model_config)
    peak = (config.logging.peak_tflops_per_device * 1e12
            or profiling.peak_flops_per_device(self.mesh.devices.flat[0]))
    self.peak_flops = peak * self.mesh.devices.size if peak else None
    self.samples = []  # This step's sample rollouts, for the writer.
    dg = config.diagnostics
    self.spikes = spikes.SpikeDetector(dg.spike_factor, dg.spike_window, dg.spike_min_history)

  def _restore(self, state: train_step.TrainState) -> tuple[train_step.TrainState, dict]:
    """The newest checkpoint that restores whole and finite, after checking that it is this
    run's (``checkpointing.check_resume``, before anything is written).

    Checkpoints newer than it that cannot be read, or whose parameters are not all finite, are
    moved to ``<workdir>/checkpoints_damaged/`` with a warning naming why. If none restores,
    nothing is moved (a fault that hits every step is not damage) and the error says why the
    latest failed. A checkpoint of another run (other model, objective, tokenizer) is an error,
    never damage.
    """
    abstract = checkpointing.abstract_like(state)
    fields = {f.name: getattr(abstract, f.name) for f in dataclasses.fields(abstract)}
    damaged = []
    for step in reversed(self.checkpointer.all_steps()):
      where = f"{self.checkpointer.directory}/{step}"
      try:
        meta = self.checkpointer.restore_meta(step)
        stored = self.checkpointer.stored_fields(step)
      except Exception as error:  # pylint: disable=broad-except
        damaged.append((step, f"its metadata cannot be read ({_one_line(error)})"))
        continue
      if "config" in meta:
        checkpointing.check_resume(self.config, meta["config"], where)
      adapters_only = self.parts.run.lora and lora_base.holds_adapters_only(
          stored.get("params", []), state.params)
      if adapters_only:  # This version's LoRA checkpoint: the base is this run's own.
        lora_base.check(meta.get(lora_base.META_KEY), self.base_identity, where)
        fields["params"] = lora_base.saved_params(abstract.params)
      else:
        fields["params"] = abstract.params
      item = _restore_item(fields, stored, where)
      try:
        restored, meta = self.checkpointer.restore(step, item)
      except Exception as error:  # pylint: disable=broad-except
        damaged.append((step, f"it cannot be restored ({_one_line(error)})"))
        continue
      if adapters_only:
        restored["params"] = lora_lib.join(restored["params"], lora_lib.split(state.params)[1])
      restored = _restored_state(state, restored)
      bad = checkpointing.nonfinite_leaves(restored.params)
      if bad:
        damaged.append((step, f"{len(bad)} parameters are not finite ({', '.join(bad[:3])}"
                              + (", ..." if len(bad) > 3 else "") + ")"))
        continue
      for bad_step, why in damaged:
        self._set_aside(bad_step, why, step)
      return restored, meta
    latest, why = damaged[0]
    raise ValueError(f"no checkpoint in {self.checkpointer.directory} can be restored; the latest "
                     f"(step {latest}): {why[:300]}. Nothing was moved; fix the cause, or start "
                     "a new --workdir")

  def _set_aside(self, step: int, why: str, fallback: int) -> None:
    target = self.checkpointer.set_aside(step)
    message = (f"checkpoint step {step} is damaged: {why[:300]}; moved to {target}; resuming "
               f"from step {fallback}")
    if self.primary:
      logging.warning(message)
      print(f"warning: {message}", file=sys.stderr, flush=True)

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
    settings = decoding.Decoding.of_eval(self.config, **options)
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
    rollouts = out.rollouts
    self.samples = rollouts.samples
    # On the host: the metrics are replicated, and host code launches no computation on global
    # arrays that another process might order differently.
    inner = jax.device_get(out.inner)
    per_sample = {name: np.stack([m.pop(name) for m in inner]) for name in list(inner[0])
                  if name.startswith(train_step.PER_SAMPLE)}  # [I, N] each.
    metrics = train_step.reduce_metrics(jax.tree.map(lambda *xs: np.stack(xs), *inner))
    metrics = {k: float(v) for k, v in metrics.items()}
    metrics.update(_ratio_noise([float(m["log_ratio/var"]) for m in inner
                                 if "log_ratio/var" in m]))
    if out.kl_start is not None:
      metrics["kl_start/mean"] = float(out.kl_start)
    metrics.update(self._spike_metrics(step + 1, inner, per_sample, rollouts))
    metrics.update(self._step_metrics(step, rollouts, out.num_scorings,
                                      elapsed=time.perf_counter() - start))
    return metrics

  def _samples_due(self, step: int) -> int:
    """How many rollouts step ``step`` logs: ``logging.num_samples`` on process 0 every
    ``logging.samples_every_steps`` steps, else none."""
    every, num = self.config.logging.samples_every_steps, self.config.logging.num_samples
    return num if self.primary and every and (step + 1) % every == 0 else 0

  def _spike_metrics(self, step: int, inner: list[dict[str, Any]],
                     per_sample: dict[str, np.ndarray], rollouts: rollout_lib.Rollouts
                     ) -> dict[str, float]:
    """Checks step ``step``'s gradient norms for a spike; records it (``_record_spike``)."""
    reason, norm, median = self.spikes.check(
        np.asarray([m["grad_norm"] for m in inner]),
        skipped=any(int(m["skipped"]) for m in inner))
    if reason is None:
      return {}
    # Replicated metrics: every process takes this branch (it gathers rows).
    self._record_spike(step, reason, inner, per_sample, rollouts, median)
    out = {"spike/step": step}
    if median > 0 and math.isfinite(norm):  # Not for a non-finite step, nor before history.
      out["spike/grad_norm_over_median"] = norm / median
    return out

  def _step_metrics(self, step: int, rollouts: rollout_lib.Rollouts, num_scorings: int, *,
                    elapsed: float) -> dict[str, float]:
    """The rollouts' statistics, the schedule, skips, time and throughput of step ``step``."""
    r, train = self.config.rollout, self.config.train
    num_rows = self.rollouts.split.num_rows
    length = r.prompt_length + r.gen_length
    flops = profiling.rl_step_flops(
        self.num_params, rollout_positions=float(rollouts.stats.model_calls.sum()) * length,
        scored_positions=num_rows * self.parts.run.likelihood.num_samples * length,
        num_updates=train.num_iterations,
        num_scorings=num_scorings)  # passes run, not reused
    updates_done = (step + 1) * train.num_iterations
    return {
        **rollouts.stats.metrics([term.name for term in self.scorer.terms], r.group_size),
        "learning_rate": float(self.parts.schedule(updates_done - 1)),
        "skipped_steps": int(self.state.skipped_steps),
        "time/step_s": elapsed, "time/rollout_s": rollouts.seconds,
        "throughput/tokens_per_s": num_rows * r.gen_length / elapsed,
        "perf/tflops_per_s": flops / elapsed / 1e12,
        **({"perf/mfu": flops / elapsed / self.peak_flops} if self.peak_flops else {}),
    }

  def _record_spike(self, step: int, reason: str, inner: list[dict[str, Any]],
                    per_sample: dict[str, np.ndarray], rollouts: rollout_lib.Rollouts,
                    median: float) -> None:
    """Writes ``<workdir>/spikes/step_<step>.npz`` (``spikes.SPIKE_FIELDS``) on process 0, with
    every process's rows (gathered: a collective every process enters)."""
    prompt_length = self.config.rollout.prompt_length
    tokens, stressed = rollouts.tokens, rollouts.stressed
    gathered = multihost.gather_rows(np.column_stack(
        [tokens, rollouts.advantages[:, None], np.zeros((len(tokens), 1)) if stressed is None
         else stressed[:, None]]).astype(np.float64), self.rollouts.split)
    if not self.primary:
      return
    all_tokens = gathered[:, :tokens.shape[1]].astype(np.int64)
    path = spikes.write_spike(self.workdir, step, {
        "step": step, "reason": reason, "median": median,
        "factor": self.config.diagnostics.spike_factor,
        "grad_norm": np.asarray([float(m["grad_norm"]) for m in inner]),
        "prompts": np.asarray(data.decode_completions(self.tokenizer,
                                                      all_tokens[:, :prompt_length])),
        "completions": np.asarray(data.decode_completions(self.tokenizer,
                                                          all_tokens[:, prompt_length:])),
        "rewards": rollouts.stats.rewards, "advantages": gathered[:, -2],
        "stressed": gathered[:, -1] > 0,
        **per_sample})
    logging.warning("Step %d: %s spike (gradient norms %s, median %.4g); its rollouts are in %s",
                    step, reason, [f"{float(m['grad_norm']):.4g}" for m in inner], median, path)

  # -------------------------------------------------------------------------
  # The loop.
  # -------------------------------------------------------------------------

  def _save(self, step: int) -> None:
    meta = {"data": self.data_iter.state(), "processes": jax.process_count(),
            "config": json.loads(self.config.to_json_best_effort())}
    state = self.state
    if self.parts.run.lora:  # The adapters and their moments; the base is rebuilt (lora_base).
      state = state.replace(params=lora_base.saved_params(state.params))
      meta[lora_base.META_KEY] = self.base_identity
    self.checkpointer.save(step, state, meta)

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
      self._write(0, self.evaluate(self.state.params, eval_key))
    progress = tqdm.tqdm(range(self.start_step, config.train.num_steps),
                         initial=self.start_step, total=config.train.num_steps,
                         desc="RL", dynamic_ncols=True, disable=not self.primary)
    last_save = time.monotonic()
    skipped_steps = 0  # Steps of this invocation that skipped every update.
    preempted = False
    try:
      for step in progress:
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
        progress.set_postfix(reward=f"{metrics['rewards/mean']:.3f}",
                             step_s=f"{metrics['time/step_s']:.2f}")
        if self.lock is not None:
          self.lock.touch()
        if int(self.state.consecutive_skips) >= config.train.max_consecutive_skips:
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
             (self.scorer, None), (self.writer, self.workdir)]
    for part, where in parts:
      if part is None:
        continue
      try:
        with checkpointing.writing(where) if where is not None else contextlib.nullcontext():
          part.close()
      except BaseException as error:  # pylint: disable=broad-except
        errors.append(error)
    self.checkpointer = self.scorer = self.writer = None
    self._release_lock()  # Last: the saves above have finished (or failed).
    if raising and errors:
      raise errors[0]

  def _write(self, step: int, metrics: dict[str, Any]) -> None:
    if self.writer is not None:
      with checkpointing.writing(self.workdir / "metrics.jsonl"):
        self.writer.write(step, metrics)


def _one_line(error: BaseException) -> str:
  """``error``'s type and message on one line (tensorstore's span many), at most 300 chars."""
  return " ".join(f"{type(error).__name__}: {error}".split())[:300]


def _ratio_noise(variances: list[float]) -> dict[str, float]:
  """How much of log rho's spread is estimator noise, from its variance over the batch on each
  inner update (``log_ratio/var``).

  On the first update the policy is pi_old: log rho is pure estimator noise (exactly 0 for
  coupled masks), so ``ratio_noise/share`` = var(first) / var(last), capped at 1, is the share
  of the last update's variance that noise explains (1 with one update per step).
  """
  if not variances or not variances[-1] > 0:
    return {}
  return {"ratio_noise/var_first": variances[0],
          "ratio_noise/share": min(1.0, variances[0] / variances[-1])}


def train(config: ml_collections.ConfigDict, workdir: str | epath.PathLike, *,
          hard_stop: bool = False) -> list[dict[str, Any]]:
  """Builds a Trainer and runs it; returns the per-step metrics of this invocation."""
  return Trainer(config, workdir, hard_stop=hard_stop).run()
