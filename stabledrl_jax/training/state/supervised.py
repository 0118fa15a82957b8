"""Supervised diffusion fitting (LLaDA's and SDAR's SFT objectives), for warm starts.

Loss per sequence: the negative sum-form ELBO of the completion divided by its
length, one Monte Carlo sample, through ``rl_loss.estimate`` (so for either model
family):

* LLaDA: ``-(1/L) (1/t) sum_{masked} log p(y_i | z_t)``, with t ~ U(0, 1] and at
  least one masked token (``estimators`` 'elbo' masks).
* SDAR (block diffusion): in every block, m_j ~ U{1..L_j} of its completion tokens
  masked, ``-(1/L) sum_j (L_j / m_j) sum_{masked in j} log p(y_i | z_<j, z_t of block j)``:
  each block denoised given the clean blocks before it, all blocks in one staircase
  pass (``block_estimators``), as SDAR is trained.

The completion includes the EOS padding, so the model learns where answers end.
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from etils import epath
from flax import nnx

from stabledrl_jax import estimators, models, tasks, workdir_files
from stabledrl_jax.models import family as family_lib
from stabledrl_jax.training.config import specs
from stabledrl_jax.training.inputs import data
from stabledrl_jax.training.parallel import multihost
from stabledrl_jax.training.state import checkpointing
from stabledrl_jax.training.step import build, rl_loss

Array = jax.Array


def sft_loss(model: nnx.Module, tokens: Array, prompt_mask: Array, completion_mask: Array,
             key: Array, *, mask_id: int) -> Array:
  """Mean over the batch of the per-token negative ELBO. Shapes: [B, L].

  Left padding (neither prompt nor completion) is hidden from attention.
  """
  attention_mask = prompt_mask | completion_mask
  spec = estimators.LikelihoodSpec(method="elbo", num_samples=1, normalize="sum",
                                   token_level=False, eubo_beta=None, mask_id=mask_id,
                                   family=family_lib.of(model).name,
                                   block_size=family_lib.block_size(model))
  zeros = jnp.zeros(tokens.shape[:1], jnp.float32)
  batch = rl_loss.RolloutBatch(tokens=tokens, prompt_mask=prompt_mask,
                               completion_mask=completion_mask, attention_mask=attention_mask,
                               advantages=zeros, old_logp=zeros, ref_logp=zeros)
  elbo, _ = rl_loss.estimate(rl_loss.model_logits_fn(model, attention_mask), batch, key, spec)
  lengths = jnp.maximum(jnp.sum(completion_mask, axis=-1), 1)
  return -jnp.mean(elbo / lengths)


@functools.partial(nnx.jit, static_argnames=("mask_id",))
def _sft_step(model, optimizer, tokens, prompt_mask, completion_mask, key, *, mask_id):
  loss_fn = functools.partial(sft_loss, mask_id=mask_id)
  loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, prompt_mask, completion_mask, key)
  optimizer.update(model, grads)
  return loss


def make_optimizer(model: nnx.Module, *, num_steps: int, learning_rate: float) -> nnx.Optimizer:
  """``fit``'s optimizer: AdamW with a warmup and a cosine decay from ``learning_rate``."""
  schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, min(100, num_steps // 10),
                                                num_steps, learning_rate * 0.05)
  return nnx.Optimizer(model, optax.adamw(schedule, b2=0.99, weight_decay=0.01), wrt=nnx.Param)


def fit(model: nnx.Module, sample_batch: Callable[[int], tuple[np.ndarray, np.ndarray,
                                                                 np.ndarray]], *,
        num_steps: int, learning_rate: float, seed: int, mask_id: int,
        log: Callable[[int, dict[str, Any]], None] | None = None,
        log_every: int = 100,
        place: Callable[[np.ndarray], Array] = jnp.asarray,
        optimizer: nnx.Optimizer | None = None, start_step: int = 0,
        stop: Callable[[int], bool] | None = None) -> nnx.Module:
  """Fits ``model`` in place; ``sample_batch(step) -> (tokens, prompt_mask, completion_mask)``.

  AdamW with a cosine decay from ``learning_rate`` (``make_optimizer``); deterministic given
  ``seed`` and ``sample_batch``. ``place`` puts a host batch on the devices (the trainer splits
  its rows over the mesh; with several processes every process passes the same batch).

  A resumed fit passes the ``optimizer`` (``make_optimizer``'s, restored) and the ``start_step``
  it reached, and ``sample_batch`` continues where it was: the result is the uninterrupted fit's.
  ``stop(done)``, asked after each step with the number of steps done, ends the fit early when
  it returns True (a signal: the caller saves the progress).
  """
  if optimizer is None:
    optimizer = make_optimizer(model, num_steps=num_steps, learning_rate=learning_rate)
  key = jax.random.key(seed)
  start = time.perf_counter()
  for step in range(start_step, num_steps):
    tokens, prompt_mask, completion_mask = sample_batch(step)
    loss = _sft_step(model, optimizer, place(tokens), place(prompt_mask),
                     place(completion_mask), jax.random.fold_in(key, step),
                     mask_id=mask_id)
    if log is not None and (step % log_every == 0 or step == num_steps - 1):
      log(step, {"sft/loss": float(loss), "sft/elapsed_s": time.perf_counter() - start})
    if stop is not None and step + 1 < num_steps and stop(step + 1):
      break
  return model


# ---------------------------------------------------------------------------
# The supervised start of an RL run, in its workdir: fitted once, resumable.
# ---------------------------------------------------------------------------

SFT_DIR = "sft_model"
# A stopped supervised start's parameters, optimizer state and step (orbax), until it finishes.
SFT_PROGRESS_DIR = "sft_progress"


class Stopped(Exception):
  """A signal stopped the supervised start; its progress is saved (``SFT_PROGRESS_DIR``)."""


def supervised_start(config: ml_collections.ConfigDict, workdir: str | epath.PathLike,
                     model: nnx.Module, tokenizer, task: tasks.Task, train_examples, mesh,
                     log, stop=None, rollout: Any = None) -> nnx.Module:
  """Fits the model on the task's reference answers once; later runs load ``<workdir>/sft_model``.

  Every process fits on the same batches (each device gets its rows); process 0 writes the
  result.

  ``stop(done)`` is asked at each step boundary (``supervised.fit``); when it says so (a
  SIGTERM or SIGINT), the parameters, the optimizer state, the step and the batch generator's
  state are saved in ``<workdir>/sft_progress`` and ``Stopped`` is raised. The next run
  continues from there: its start is the uninterrupted fit's (docs/reliability.md).
  ``rollout``: the run's resolved rollout spec (``specs.resolve_rollout``'s, made if None), whose
  prompt layout and generation length the fit's rows take.
  """
  path = epath.Path(workdir) / SFT_DIR
  progress_dir = epath.Path(workdir) / SFT_PROGRESS_DIR
  if (path / "config.json").exists():
    if multihost.is_primary() and progress_dir.exists():  # A stop after the fit was written.
      workdir_files.remove(progress_dir)  # Never opened: a FIFO would block.
    return build.load_pretrained(path, mesh, config)
  rollout = specs.resolve_rollout(config) if rollout is None else rollout
  rng = np.random.default_rng(config.seed)
  batch_size, error_rate = config.sft.batch_size, config.sft.demo_error_rate
  error_cells = config.sft.demo_error_cells

  def sample_batch(step):
    del step  # The generator state advances deterministically with each call.
    indices = rng.integers(len(train_examples), size=batch_size)
    examples = [train_examples[int(i)] for i in indices]
    prompts = data.encode_examples(rollout, tokenizer, task, examples)
    targets = [data.answer_text(ex, data.noisy_demonstration(
        task, ex, rng, error_rate=error_rate, error_cells=error_cells)) for ex in examples]
    completions = data.encode_completions(tokenizer, targets, rollout.gen_length)
    tokens = np.concatenate([prompts.tokens, completions], axis=1)
    prompt_mask = np.concatenate([prompts.mask, np.zeros_like(completions, bool)], axis=1)
    completion_mask = np.concatenate([np.zeros_like(prompts.mask), np.ones_like(completions,
                                                                                 bool)], axis=1)
    return tokens, prompt_mask, completion_mask

  num_steps = config.sft.num_steps
  optimizer = make_optimizer(model, num_steps=num_steps, learning_rate=config.sft.learning_rate)
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
    fit(model, sample_batch, num_steps=num_steps, learning_rate=config.sft.learning_rate,
        seed=config.seed, mask_id=model.config.mask_token_id, log=log,
        place=lambda x: jax.device_put(x, rows), optimizer=optimizer, start_step=done[0],
        stop=asked_to_stop)
    if stopped[0] and done[0] != progress.latest_step():  # Else that step is saved already.
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
    workdir_files.remove(progress_dir)
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
  return build.load_pretrained(path, mesh, config)
