"""Group-relative advantages, the one step every objective shares before its loss."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from stabledrl_jax.objectives.base import ADVANTAGE_BASELINES, num_groups

Array = jax.Array


def group_advantages(rewards: Array, group_size: int, *,
                     scale_by_std: bool = False, eps: float = 1e-6,
                     ddof: int = 0, baseline: str = "group_mean") -> Array:
  """Group-relative advantages ``A_j = r_j - b_j``.

  Args:
    rewards: [N] rewards, N = P * G, each group of G contiguous.
    group_size: G.
    scale_by_std: divide by ``(std_group(r) + eps)`` (GRPO's normalization).
    eps: added to the std so that a group of equal rewards gives A = 0.
    ddof: degrees of freedom of the std (0: population std, 1: unbiased).
    baseline: 'group_mean' (b_j = mean_group(r)) or 'leave_one_out' (ESPO: b_j the mean of the
      group's other G - 1 rewards, i.e. ``G / (G - 1) * (r_j - mean_group(r))``; needs G >= 2).

  Returns:
    [N] advantages, float32.
  """
  chex.assert_rank(rewards, 1)
  if baseline not in ADVANTAGE_BASELINES:
    raise ValueError(f"baseline must be one of {ADVANTAGE_BASELINES}, got {baseline!r}.")
  groups = num_groups(rewards.shape[0], group_size)
  grouped = rewards.astype(jnp.float32).reshape(groups, group_size)
  centred = grouped - jnp.mean(grouped, axis=1, keepdims=True)
  if baseline == "leave_one_out":
    if group_size < 2:
      raise ValueError("a leave-one-out baseline needs group_size >= 2.")
    centred = centred * (group_size / (group_size - 1))
  if scale_by_std:
    if group_size - ddof < 1:
      raise ValueError(f"ddof={ddof} needs group_size > {ddof}.")
    centred = centred / (jnp.std(grouped, axis=1, ddof=ddof, keepdims=True) + eps)
  return centred.reshape(-1)
