"""The RL training loop (docs/training.md): rollouts, rewards, old-policy estimates, mu updates.

One RL step:

1. P prompts, each repeated G times; rollouts from pi_old (the current parameters).
2. Rewards on the host; group-relative advantages.
3. l_old under pi_old (independent masks, or the inner iterations' own masks when
   ``estimator.coupled_ratio``), and l_ref under a frozen reference (the start of RL) when
   the objective has a KL term, on the same masks as l_old. In a
   stress test (``estimator.stress.fraction > 0``, docs/stress_test.md) a fraction of the
   samples, chosen once per step, gets "hard" masks for l_old and "easy" masks for l_theta.
4. ``train.num_iterations`` updates with fresh masks each; a non-finite loss or
   gradient skips its update.

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
import functools
import json
import math
import os
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

from stabledrl_jax import hub, input_files, models, profiling, tasks, workdir_files
from stabledrl_jax.models import lora as lora_lib
from stabledrl_jax.training import checkpointing, data, decoding, lora_base, mesh as mesh_lib
from stabledrl_jax.training import specs
from stabledrl_jax.training import metrics_writer, multihost, preemption
from stabledrl_jax.training import optimizer as optimizer_lib
from stabledrl_jax.training import reward_pool, rl_loss, rollout as rollout_lib, run_spec, spikes
from stabledrl_jax.training import supervised, train_step

SFT_DIR = "sft_model"
# A stopped supervised start's parameters, optimizer state and step (orbax), until it finishes.
SFT_PROGRESS_DIR = "sft_progress"
# Folded into the step key for the stress selection, so that the other keys stay as they were.
_STRESS_KEY = 0x57e55


class TooManySkipsError(RuntimeError):
  """Raised after ``train.max_consecutive_skips`` non-finite updates in a row."""


def build_model(config: ml_collections.ConfigDict, tokenizer, mesh) -> models.LLaDA | models.SDAR:
  """A checkpoint (``model.checkpoint``), else a fresh model of ``model.family``/``model.name``.

  Raises ValueError if the checkpoint is not of ``model.family``, or if its block size does
  not fit the rollout layout.
  """
  if not config.model.checkpoint:
    model_config = specs.model_config(config, tokenizer)
    return models.init_model(model_config, seed=config.seed, mesh=mesh)
  with input_files.named("config.model.checkpoint"):
    path = hub.local_path(config.model.checkpoint, download=config.model.download)
    model = models.from_pretrained(path, mesh=mesh, **_dtypes(config),
                                   remat=config.model.remat, **specs.run_options(config))
  try:
    data.check_tokenizer(model.config, tokenizer)
  except ValueError as error:
    raise ValueError(f"config.tokenizer: {error} (model.checkpoint={config.model.checkpoint!r})"
                     ) from None
  if lora_lib.has_adapters(model):  # A PEFT adapter: its base with it.
    model = _continued_adapter(config, model)
  return _check_loaded(config, model, config.model.checkpoint)


def _continued_adapter(config: ml_collections.ConfigDict, model: nnx.Module) -> nnx.Module:
  """A model loaded with a PEFT adapter: with ``model.lora.rank`` 0 its merged weights (every
  parameter trains); else the adapter itself trains on, if ``model.lora`` describes it (rank,
  alpha, the modules it adapts), as the official code continues one (the reference of KL terms
  is then its base)."""
  spec = lora_lib.spec_of(config.model.lora)
  if spec is None:
    return lora_lib.merge_adapters(model)
  adapters = lora_lib.adapters_of(model)
  rank, scale = next((a.a.shape[1], a.scale) for a in adapters.values())
  chosen = set(lora_lib.targeted(model, spec))
  if (spec.rank, spec.scale) != (rank, scale) or chosen != set(adapters):
    short = sorted({name.rsplit(".", 1)[-1] for name in adapters})
    raise ValueError(
        f"config.model.lora: rank={spec.rank}, alpha={spec.alpha:g}, targets="
        f"{','.join(spec.targets)!r} do not describe the adapter model.checkpoint="
        f"{config.model.checkpoint!r} (r={rank}, lora_alpha={scale * rank:g}, {len(adapters)} "
        f"modules {','.join(short)}): set them so to train it on, or rank=0 to train its merged "
        "weights")
  return model


def _dtypes(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """``from_pretrained`` keywords: parameters stored in ``model.param_dtype`` (float32 master
  weights), computed in ``model.dtype``."""
  return dict(dtype=jnp.dtype(config.model.dtype),
              param_dtype=jnp.dtype(config.model.param_dtype))


def _check_loaded(config: ml_collections.ConfigDict, model: nnx.Module, path: str) -> nnx.Module:
  """A loaded model is of ``model.family`` and its sampler can decode the rollout layout."""
  family = models.family.of(model)
  found = family.name
  if found != config.model.family:
    raise ValueError(f"config.model.family: {config.model.family!r}, but {path} holds a "
                     f"{found} model")
  family.check_rollout(config.rollout, model.config)
  return model


class Stopped(Exception):
  """A signal stopped the supervised start; its progress is saved (``SFT_PROGRESS_DIR``)."""


def supervised_start(config: ml_collections.ConfigDict, workdir: str | epath.PathLike,
                     model: nnx.Module, tokenizer, task: tasks.Task, train_examples, mesh,
                     log, stop=None) -> nnx.Module:
  """Fits the model on the task's reference answers once; later runs load ``<workdir>/sft_model``.

  Every process fits on the same batches (each device gets its rows); process 0 writes the
  result.

  ``stop(done)`` is asked at each step boundary (``supervised.fit``); when it says so (a
  SIGTERM or SIGINT), the parameters, the optimizer state, the step and the batch generator's
  state are saved in ``<workdir>/sft_progress`` and ``Stopped`` is raised. The next run
  continues from there: its start is the uninterrupted fit's (docs/reliability.md).
  """
  path = epath.Path(workdir) / SFT_DIR
  progress_dir = epath.Path(workdir) / SFT_PROGRESS_DIR
  if (path / "config.json").exists():
    if multihost.is_primary() and progress_dir.exists():  # A stop after the fit was written.
      progress_dir.rmtree()
    return _check_loaded(config, _load_pretrained(path, mesh, config), path)
  rollout = config.rollout
  rng = np.random.default_rng(config.seed)

  def sample_batch(step):
    del step  # The generator state advances deterministically with each call.
    indices = rng.integers(len(train_examples), size=config.sft.batch_size)
    examples = [train_examples[int(i)] for i in indices]
    prompts = data.encode_examples(config, tokenizer, task, examples)
    targets = [data.answer_text(ex, data.noisy_demonstration(
        task, ex, rng, error_rate=config.sft.demo_error_rate,
        error_cells=config.sft.demo_error_cells)) for ex in examples]
    completions = data.encode_completions(tokenizer, targets, rollout.gen_length)
    tokens = np.concatenate([prompts.tokens, completions], axis=1)
    prompt_mask = np.concatenate([prompts.mask, np.zeros_like(completions, bool)], axis=1)
    completion_mask = np.concatenate([np.zeros_like(prompts.mask), np.ones_like(completions,
                                                                                 bool)], axis=1)
    return tokens, prompt_mask, completion_mask

  num_steps = config.sft.num_steps
  optimizer = supervised.make_optimizer(model, num_steps=num_steps,
                                        learning_rate=config.sft.learning_rate)
  progress = checkpointing.Checkpointer(workdir, subdir=SFT_PROGRESS_DIR, max_to_keep=1,
                                        async_save=False)
  identity = {"sft": config.sft.to_dict(), "seed": config.seed}
  done, stopped = [0], [False]
  try:
    latest = progress.latest_step()
    if latest is not None:
      where = f"{progress.directory}/{latest}"
      saved = progress.restore_meta(latest)
      checkpointing.check_resume(config, saved.get("config", {}), where)
      if saved.get("identity") != json.loads(json.dumps(identity)):
        raise ValueError(f"config does not match {where}: the supervised start's settings "
                         f"(sft.*, seed) were {saved.get('identity')}. Resume with them, or "
                         f"delete {progress.directory} to fit the start anew.")
      # Placed as the fit places them: on the mesh (the optimizer's step counter, made on one
      # device, replicated over it: a one-device array cannot join the others' computation).
      replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
      abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=x.sharding if isinstance(
              x.sharding, jax.sharding.NamedSharding) else replicated),
                              _sft_state(model, optimizer))
      state, meta = progress.restore(latest, abstract)
      nnx.update(model, state["params"])
      nnx.update(optimizer, state["optimizer"])
      rng.bit_generator.state = meta["rng"]
      done[0] = int(meta["step"])
      if multihost.is_primary():
        logging.warning("continuing the supervised start from step %d (%s)", done[0], where)

    def asked_to_stop(step):
      done[0], stopped[0] = step, stop is not None and stop(step)
      return stopped[0]

    rows = models.batch_sharding(mesh, ndim=1)
    supervised.fit(model, sample_batch, num_steps=num_steps,
                   learning_rate=config.sft.learning_rate, seed=config.seed,
                   mask_id=model.config.mask_token_id, log=log,
                   place=lambda x: jax.device_put(x, rows), optimizer=optimizer,
                   start_step=done[0], stop=asked_to_stop)
    if stopped[0]:
      progress.save(done[0], _sft_state(model, optimizer), {
          "step": done[0], "rng": rng.bit_generator.state, "identity": identity,
          "config": json.loads(config.to_json_best_effort())})
      progress.wait()
      raise Stopped(f"Stopped by a signal: saved the supervised start's step {done[0]} of "
                    f"{num_steps} in {progress.directory}; rerun the same command to continue")
  finally:
    progress.close()
  _save_pretrained(model, path, mesh)
  if multihost.is_primary() and progress_dir.exists():
    progress_dir.rmtree()
  multihost.sync("stabledrl_jax: supervised progress removed")
  return model


def _sft_state(model: nnx.Module, optimizer: nnx.Optimizer) -> dict[str, Any]:
  """What a stopped supervised start saves: the parameters and the optimizer's state (its
  step and AdamW's moments), as pytrees of arrays."""
  return {"params": nnx.state(model, nnx.Param), "optimizer": nnx.state(optimizer)}


def _save_pretrained(model: nnx.Module, path: epath.Path, mesh) -> None:
  """Process 0 writes ``model`` to ``path`` (local or remote), through a directory staged beside
  it in the workdir and renamed at the end (``workdir_files.staged_dir``): a kill mid-save
  leaves no torn start, and a failed save (a full disk) removes what it staged and raises
  ``WorkdirError`` naming ``path``."""
  if jax.process_count() > 1:  # Every process's shards, replicated, so process 0 can read them.
    graphdef, state = nnx.split(model)
    state = jax.jit(lambda x: x, out_shardings=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()))(state)
    model = nnx.merge(graphdef, state)
  if multihost.is_primary():
    with workdir_files.staged_dir(path, overwrite=True) as staging:
      models.save_pretrained(model, os.fspath(staging))
  multihost.sync("stabledrl_jax: supervised start written")


def _load_pretrained(path: epath.Path, mesh, config: ml_collections.ConfigDict) -> nnx.Module:
  """``models.from_pretrained`` of a local or remote (copied to a local directory) checkpoint,
  with the run's dtypes and model options (remat, scan_layers, attention), as ``build_model``."""
  options = dict(_dtypes(config), remat=config.model.remat, **specs.run_options(config))
  if checkpointing.is_local(path):
    return models.from_pretrained(str(path), mesh=mesh, **options)
  with workdir_files.local_staging() as local:
    _copy_files(path, epath.Path(local))
    return models.from_pretrained(local, mesh=mesh, **options)


def _copy_files(source: epath.Path, target: epath.Path) -> None:
  """The files of directory ``source`` into ``target`` (created), local or remote either way."""
  target.mkdir(parents=True, exist_ok=True)
  for file in source.iterdir():
    (target / file.name).write_bytes(file.read_bytes())


def with_lora(config: ml_collections.ConfigDict, model: nnx.Module, mesh=None) -> nnx.Module:
  """``model`` with ``config.model.lora``'s adapters (rank 0: as it is), created over ``mesh``,
  and its frozen base stored as ``model.lora.base_dtype`` (``lora.store_base``)."""
  section = config.model.get("lora")  # A workdir of an older version has none.
  spec = None if section is None else lora_lib.spec_of(section)
  if spec is None:
    return model
  if not lora_lib.has_adapters(model):  # A PEFT adapter's are kept (build_model).
    lora_lib.add_adapters(model, spec, seed=config.seed, mesh=mesh)
  return lora_lib.store_base(model, section.get("base_dtype", "bfloat16"))


def make_update(run: run_spec.RunSpec, graphdef: Any, tx, state_shardings: Any, mesh):
  """The jitted update of ``run`` (``train_step.make_update_fn``), state donated and pinned."""
  return train_step.make_update_fn(
      graphdef, tx, state_shardings=state_shardings,
      batch_shardings=models.batch_sharding(mesh, ndim=1),
      replicated=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), run=run)


def abstract_update(config: ml_collections.ConfigDict, devices=None):
  """The update of ``config`` and abstract inputs for it: nothing is allocated.

  For ahead-of-time compilation (memory plans): ``update.lower(state, batch, key).compile()``.
  The model is ``model.name`` fresh (not ``model.checkpoint``), placed on the config's mesh
  over ``devices`` (default: all) by the same rules as in training.

  Returns:
    (update, state, batch, key): the jitted update and ``jax.ShapeDtypeStruct`` pytrees of a
    ``TrainState``, a ``RolloutBatch`` of P x G rollouts and a PRNG key, with their shardings.
  """
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  model_cfg = specs.model_config(config)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: with_lora(
      config, models.init_model(model_cfg, seed=config.seed))), nnx.Param)
  run = specs.resolve_run(config, model_cfg)
  params = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s),
                        params, models.param_shardings(params, mesh))
  tx = optimizer_lib.make_optimizer(config.optimizer,
                                    config.train.num_steps * config.train.num_iterations)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  objective_state = run.initial_state()
  shardings = train_step.state_shardings(tx, params, jax.tree.map(lambda p: p.sharding, params),
                                         replicated, objective_state, lora=run.lora)
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       jax.eval_shape(lambda p: train_step.create_train_state(
                           p, tx, config.seed, objective_state, lora=run.lora), params),
                       shardings)
  spec = run.likelihood
  r = config.rollout
  n, length = r.num_prompts * r.group_size, r.prompt_length + r.gen_length
  rows = models.batch_sharding(mesh, ndim=1)
  array = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rows)
  logp = (n, length) if spec.token_level else (n,)
  batch = rl_loss.RolloutBatch(
      tokens=array((n, length), jnp.int32), prompt_mask=array((n, length), bool),
      completion_mask=array((n, length), bool), attention_mask=array((n, length), bool),
      advantages=array((n,), jnp.float32), old_logp=array(logp, jnp.float32),
      ref_logp=array(logp, jnp.float32),
      stressed=array((n,), bool) if config.estimator.stress.fraction > 0 else None)
  key = jax.eval_shape(lambda: jax.random.key(0))
  key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated)
  update = make_update(run, graphdef, tx, shardings, mesh)
  return update, state, batch, key


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
    except Stopped as stop:
      self.stopped = str(stop)
    except BaseException:
      self._close(raising=False)  # orbax's and the reward pool's threads end before the error.
      raise
    finally:
      self.watcher.uninstall()

  def _kept(self) -> str:
    """What an immediate stop keeps: the newest complete checkpoint (or supervised progress)."""
    for subdir, what in ((checkpointing.CHECKPOINT_DIR, "checkpoint"),
                         (SFT_PROGRESS_DIR, "saved supervised step")):
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
    # Rank-1 spec: the leading (batch) axis split, valid for arrays of any rank.
    self.batch_sharding = models.batch_sharding(self.mesh, ndim=1)
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
    model = build_model(config, self.tokenizer, self.mesh)
    if config.sft.num_steps and not config.model.checkpoint:
      if latest is None:
        model = supervised_start(config, self.workdir, model, self.tokenizer, self.task,
                                 self.train_examples, self.mesh, self._log_sft,
                                 stop=self.watcher.reached)
      # On resume the checkpoint holds the parameters; the SFT start is needed only as the
      # start of RL that KL terms and kl_to_start measure against.
      elif needs_start(config):
        model = resumed_start(config, self.workdir, self.mesh)
    self.model_config = model.config
    model = with_lora(config, model, self.mesh)
    self.graphdef, params = nnx.split(model, nnx.Param)
    # The reference for KL terms is the start of RL, frozen: with LoRA the base itself (the
    # adapters off), without a copy.
    self.run_spec = specs.resolve_run(config, self.model_config)
    note = specs.estimator_note(config)
    if note and self.primary:
      print(note, file=sys.stderr, flush=True)
    self.kl_to_start = bool(config.diagnostics.get("kl_to_start", False))
    keep_start = not self.run_spec.lora and (self.run_spec.uses_reference or self.kl_to_start)
    self.start_params = params if keep_start else None
    self.rollouts = rollout_lib.RolloutCollector(
        config, self.run_spec, tokenizer=self.tokenizer, task=self.task, scorer=self.scorer,
        graphdef=self.graphdef, model_config=self.model_config, mesh=self.mesh)

    num_updates = config.train.num_steps * config.train.num_iterations
    self.tx = optimizer_lib.make_optimizer(config.optimizer, num_updates)
    self.state_shardings = train_step.state_shardings(
        self.tx, params, jax.tree.map(lambda p: p.sharding, params),
        jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()),
        objective_state=self.run_spec.initial_state(), lora=self.run_spec.lora)
    state = jax.jit(lambda p: train_step.create_train_state(
        p, self.tx, config.seed, self.run_spec.initial_state(), lora=self.run_spec.lora),
                    out_shardings=self.state_shardings)(params)
    self.start_step = 0
    self.base_identity = (lora_base.identity(config, self.workdir) if self.run_spec.lora
                          else None)
    if latest is not None:
      state, meta = self._restore(state)
      self.data_iter.restore(meta["data"])
      self.start_step = int(state.step)
    self.state = state
    if self.primary:  # Only now: a failed resume leaves the workdir as it was.
      workdir_files.write_text(self.workdir / "config.json",
                               config.to_json_best_effort(indent=2))

    self.spec = self.run_spec.likelihood
    self.advance_objective_state = jax.jit(
        functools.partial(train_step.advance_objective_state, run=self.run_spec),
        out_shardings=self.state_shardings.objective_state)
    self.update = make_update(self.run_spec, self.graphdef, self.tx, self.state_shardings,
                              self.mesh)
    self.estimate_no_grad = self._scoring(self.run_spec)
    self._adapters_off = jax.jit(lora_lib.adapters_off)
    # kl_start/mean is a sequence log-likelihood gap whatever the objective's normalization.
    sequence = dataclasses.replace(self.spec, normalize="sum")
    self.estimate_sequence = None if not self.kl_to_start else self._scoring(
        dataclasses.replace(self.run_spec, likelihood=sequence))
    self.writer = (metrics_writer.MetricsWriter(
        self.workdir, resume_step=self.start_step, wandb=config.logging.wandb.to_dict(),
        config=json.loads(config.to_json_best_effort())) if self.primary else None)
    self.schedule = optimizer_lib.learning_rate_schedule(config.optimizer, num_updates)
    self.num_params = models.count_params(self.model_config)
    peak = (config.logging.peak_tflops_per_device * 1e12
            or profiling.peak_flops_per_device(self.mesh.devices.flat[0]))
    self.peak_flops = peak * self.mesh.devices.size if peak else None
    self.samples = []  # This step's sample rollouts, for the writer.
    dg = config.diagnostics
    self.spikes = spikes.SpikeDetector(dg.spike_factor, dg.spike_window, dg.spike_min_history)

  def _scoring(self, run: run_spec.RunSpec):
    """jit(``train_step.estimate_no_grad``) of ``run``: (params, batch, key, stress_mode=None)."""
    return jax.jit(train_step.traced_under(
        self.mesh, lambda params, batch, key, stress_mode=None: train_step.estimate_no_grad(
            params, batch, key, graphdef=self.graphdef, run=run, stress_mode=stress_mode,
            microbatch_sharding=train_step.microbatch_sharding(self.batch_sharding))),
        static_argnames="stress_mode")

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
      adapters_only = self.run_spec.lora and lora_base.holds_adapters_only(
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
    return nnx.merge(self.graphdef, params)

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
    """One RL step (the module's docstring): rollouts, l_old / l_ref, the updates, metrics."""
    start = time.perf_counter()
    key = jax.random.fold_in(jax.random.wrap_key_data(self.state.key), step)
    key_rollout, key_old, key_inner = jax.random.split(key, 3)
    inner_keys = list(jax.random.split(key_inner, self.config.train.num_iterations))
    rollouts = self.rollouts(self.state.params, next(self.data_iter), key_rollout,
                             jax.random.fold_in(key, _STRESS_KEY),
                             num_samples=self._samples_due(step))
    self.samples = rollouts.samples
    old, ref, num_scorings = self._old_and_ref(rollouts.batch, key_old, inner_keys)
    kl_start = None
    if self.kl_to_start:  # KL(pi_old || pi_start), on pi_old's own rollouts.
      kl_start = self._kl_to_start(rollouts.batch, key_old, None if old is None else old[0])
    inner_device = self._updates(rollouts.batch, old, ref, inner_keys)
    # On the host: the metrics are replicated, and host code launches no computation on global
    # arrays that another process might order differently.
    inner = jax.device_get(inner_device)
    per_sample = {name: np.stack([m.pop(name) for m in inner]) for name in list(inner[0])
                  if name.startswith(train_step.PER_SAMPLE)}  # [I, N] each.
    metrics = train_step.reduce_metrics(jax.tree.map(lambda *xs: np.stack(xs), *inner))
    metrics = {k: float(v) for k, v in metrics.items()}
    metrics.update(_ratio_noise([float(m["log_ratio/var"]) for m in inner
                                 if "log_ratio/var" in m]))
    if kl_start is not None:
      metrics["kl_start/mean"] = float(kl_start)
    self.state = self.state.replace(
        step=jax.device_put(np.int32(step + 1), self.state_shardings.step),  # Global everywhere.
        objective_state=self.advance_objective_state(self.state.objective_state, inner_device))
    metrics.update(self._spike_metrics(step + 1, inner, per_sample, rollouts))
    metrics.update(self._step_metrics(step, rollouts, num_scorings,
                                      elapsed=time.perf_counter() - start))
    return metrics

  def _samples_due(self, step: int) -> int:
    """How many rollouts step ``step`` logs: ``logging.num_samples`` on process 0 every
    ``logging.samples_every_steps`` steps, else none."""
    every, num = self.config.logging.samples_every_steps, self.config.logging.num_samples
    return num if self.primary and every and (step + 1) % every == 0 else 0

  def _old_and_ref(self, batch: rl_loss.RolloutBatch, key_old: jax.Array,
                   inner_keys: list[jax.Array]) -> tuple[list | None, list | None, int]:
    """l_old and l_ref for each inner update (None where the run has none), and how many
    scoring passes ran per model.

    Coupled (d1, ESPO): on each inner iteration's own masks, before any update. Independent
    (StableDRL): once, on masks of their own, so that at the first iteration the ratio is pure
    estimator noise.
    """
    keys, repeat = (inner_keys, 1) if self.run_spec.coupled_ratio else ([key_old],
                                                                        len(inner_keys))
    old = ref = None
    if self.run_spec.needs_old:
      old = [self.estimate_no_grad(self.state.params, batch, k, "hard") for k in keys] * repeat
    if self.run_spec.uses_reference:
      reference = self._start()
      ref = [self.estimate_no_grad(reference, batch, k) for k in keys] * repeat
    return old, ref, len(keys) * ((old is not None) + (ref is not None))

  def _updates(self, batch: rl_loss.RolloutBatch, old: list | None, ref: list | None,
               inner_keys: list[jax.Array]) -> list[dict[str, jax.Array]]:
    """The ``train.num_iterations`` updates of one step, fresh masks each; their metrics."""
    inner = []
    for i, inner_key in enumerate(inner_keys):
      if old is not None:
        batch = batch.replace(old_logp=old[i])
      if ref is not None:
        batch = batch.replace(ref_logp=ref[i])
      self.state, metrics = self.update(self.state, batch, inner_key)
      inner.append(metrics)
    return inner

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
        scored_positions=num_rows * self.spec.num_samples * length,
        num_updates=train.num_iterations,
        num_scorings=num_scorings)  # passes run, not reused
    updates_done = (step + 1) * train.num_iterations
    return {
        **rollouts.stats.metrics([term.name for term in self.scorer.terms], r.group_size),
        "learning_rate": float(self.schedule(updates_done - 1)),
        "skipped_steps": int(self.state.skipped_steps),
        "time/step_s": elapsed, "time/rollout_s": rollouts.seconds,
        "throughput/tokens_per_s": num_rows * r.gen_length / elapsed,
        "perf/tflops_per_s": flops / elapsed / 1e12,
        **({"perf/mfu": flops / elapsed / self.peak_flops} if self.peak_flops else {}),
    }

  def _start(self) -> Any:
    """The parameters of the start of RL: the kept copy, or with LoRA the base (adapters off)."""
    if self.run_spec.lora:
      return self._adapters_off(self.state.params)
    return self.start_params

  def _kl_to_start(self, batch: rl_loss.RolloutBatch, key: jax.Array, old) -> jax.Array:
    """mean(l_old - l_start) over the batch's rollouts, both scored on the same masks (their
    noise largely cancels) as sequence log-likelihoods (``normalize='sum'``, whatever the
    objective's): an estimate of KL(pi_old || pi_start) in nats per sequence, since the rollouts
    are pi_old's own samples. Token-level estimates are summed over each completion."""
    del old  # Scored with the objective's normalization (and the stress test's masks).
    now = self.estimate_sequence(self.state.params, batch, key)
    start = self.estimate_sequence(self._start(), batch, key)
    return _mean_sequence_gap(now, start, batch.completion_mask)

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
    if self.run_spec.lora:  # The adapters and their moments; the base is rebuilt (lora_base).
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


@jax.jit
def _mean_sequence_gap(now: jax.Array, start: jax.Array, completion_mask: jax.Array) -> jax.Array:
  """mean over rows of now - start: [N] sequence estimates, or [N, L] token ones (summed over
  the completion)."""
  gap = now - start
  if gap.ndim == 2:
    gap = jnp.sum(jnp.where(completion_mask, gap, 0.0), axis=-1)
  return jnp.mean(gap)


def needs_start(config: ml_collections.ConfigDict) -> bool:
  """Whether a resumed run needs its start of RL: a KL reference, the kl_to_start diagnostic,
  or a LoRA run's frozen base (its checkpoints hold the adapters only: ``lora_base``)."""
  return (specs.uses_reference(config) or bool(config.diagnostics.get("kl_to_start", False))
          or bool(config.model.lora.rank))


def resumed_start(config: ml_collections.ConfigDict, workdir, mesh) -> nnx.Module:
  """The supervised start of a resumed run, read back from ``<workdir>/sft_model``."""
  path = epath.Path(workdir) / SFT_DIR
  if not (path / "config.json").exists():
    raise ValueError(f"{path}: the supervised start is gone, and the run's KL reference "
                     "(or diagnostics.kl_to_start, or a LoRA run's frozen base) is it; restore "
                     "it, or start the run in a new workdir")
  return _check_loaded(config, _load_pretrained(path, mesh, config), path)


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
