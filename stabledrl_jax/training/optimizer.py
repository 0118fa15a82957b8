"""The optimizer: clip_by_global_norm -> AdamW with a learning-rate schedule (docs/training.md, "Configs")."""

from __future__ import annotations

import ml_collections
import optax


def learning_rate_schedule(config: ml_collections.ConfigDict, num_steps: int) -> optax.Schedule:
  """Linear warmup to ``learning_rate``, then 'linear' decay to ``end_lr_factor * lr`` or 'constant'.

  Counts optimizer updates: ``num_steps`` RL steps x ``num_iterations`` inner updates.
  """
  lr = config.learning_rate
  warmup = config.warmup_steps
  if config.schedule == "constant":
    decay = optax.constant_schedule(lr)
  elif config.schedule == "linear":
    decay = optax.linear_schedule(lr, lr * config.end_lr_factor, max(num_steps - warmup, 1))
  else:
    raise ValueError(
        f"config.optimizer.schedule must be 'linear' or 'constant', got {config.schedule!r}.")
  if not warmup:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), decay], [warmup])


def make_optimizer(config: ml_collections.ConfigDict,
                   num_updates: int) -> optax.GradientTransformation:
  """``clip_by_global_norm(grad_clip) -> adamw(b1, b2, eps, weight_decay)`` with the schedule.

  Args:
    config: the ``optimizer`` section of the experiment config.
    num_updates: total optimizer updates, the length of the decay.
  """
  parts = []
  if config.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(config.grad_clip))
  parts.append(optax.adamw(learning_rate_schedule(config, num_updates), b1=config.b1,
                           b2=config.b2, eps=config.eps, weight_decay=config.weight_decay))
  return optax.chain(*parts)
