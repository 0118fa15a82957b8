"""The optimizer: clip_by_global_norm -> AdamW with a learning-rate schedule (docs/training.md,
"Configs"), made in one place: ``OptimizerSpec``, the ``optimizer`` section resolved.

Equal specs give the same ``tx`` object (``OptimizerSpec.tx`` is cached), so the jitted update of
a run (``build.make_update``) is memoized on the spec: a second run of the same shape in one
process traces nothing again.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import optax

SCHEDULES = ("linear", "constant")


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  """The ``optimizer`` section over a run's ``num_updates`` (train.num_steps x
  train.num_iterations), its learning rate times ``lr_scale`` (the collapse guard's restores).

  Linear warmup to the learning rate over ``warmup_steps`` updates, then 'linear' decay to
  ``end_lr_factor`` x lr or 'constant'; gradients clipped to global norm ``grad_clip`` (0: not).
  """

  learning_rate: float
  schedule: str
  warmup_steps: int
  end_lr_factor: float
  grad_clip: float
  b1: float
  b2: float
  eps: float
  weight_decay: float
  num_updates: int
  lr_scale: float = 1.0

  @classmethod
  def of(cls, section: Any, num_updates: int, *, lr_scale: float = 1.0) -> OptimizerSpec:
    """From the config's ``optimizer`` section (ValueError naming a bad schedule)."""
    if section.schedule not in SCHEDULES:
      raise ValueError(f"config.optimizer.schedule must be one of {SCHEDULES}, got "
                       f"{section.schedule!r}.")
    return cls(learning_rate=float(section.learning_rate), schedule=section.schedule,
               warmup_steps=int(section.warmup_steps),
               end_lr_factor=float(section.end_lr_factor), grad_clip=float(section.grad_clip),
               b1=float(section.b1), b2=float(section.b2), eps=float(section.eps),
               weight_decay=float(section.weight_decay), num_updates=int(num_updates),
               lr_scale=float(lr_scale))

  def scaled(self, lr_scale: float) -> OptimizerSpec:
    """The same optimizer at ``lr_scale`` x ``learning_rate`` (the same state layout: AdamW's
    moments carry over)."""
    return dataclasses.replace(self, lr_scale=float(lr_scale))

  @property
  def lr_schedule(self) -> optax.Schedule:
    """The learning rate per update."""
    return _schedule(self)

  @property
  def tx(self) -> optax.GradientTransformation:
    """``clip_by_global_norm(grad_clip) -> adamw(b1, b2, eps, weight_decay)`` on the schedule."""
    return _tx(self)


@functools.lru_cache(maxsize=64)
def _schedule(spec: OptimizerSpec) -> optax.Schedule:
  lr = spec.learning_rate * spec.lr_scale
  warmup = spec.warmup_steps
  if spec.schedule == "constant":
    decay = optax.constant_schedule(lr)
  else:
    decay = optax.linear_schedule(lr, lr * spec.end_lr_factor, max(spec.num_updates - warmup, 1))
  if not warmup:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), decay], [warmup])


@functools.lru_cache(maxsize=64)
def _tx(spec: OptimizerSpec) -> optax.GradientTransformation:
  parts = []
  if spec.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(spec.grad_clip))
  parts.append(optax.adamw(spec.lr_schedule, b1=spec.b1, b2=spec.b2, eps=spec.eps,
                           weight_decay=spec.weight_decay))
  return optax.chain(*parts)


def learning_rate_schedule(section: Any, num_updates: int) -> optax.Schedule:
  """The schedule of the ``optimizer`` section over ``num_updates`` (``OptimizerSpec``)."""
  return OptimizerSpec.of(section, num_updates).lr_schedule


def make_optimizer(section: Any, num_updates: int) -> optax.GradientTransformation:
  """The optimizer of the ``optimizer`` section over ``num_updates`` (``OptimizerSpec``)."""
  return OptimizerSpec.of(section, num_updates).tx
