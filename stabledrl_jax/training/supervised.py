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
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from stabledrl_jax import estimators
from stabledrl_jax.models import family as family_lib
from stabledrl_jax.training import rl_loss

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
