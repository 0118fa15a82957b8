r"""wd1: a ratio-free, advantage-weighted log-likelihood.

    L_wd1 = (1/P) sum_groups sum_j (softmax_G(-A)_j - softmax_G(A)_j) l_j

with l_j d1's mean-field sequence log-likelihood (token sums). Official code, xiaohangt/wd1
[0898985]: the loss ``wd1/trainers/rev_grpo_trainer.py:145-160``; the mean-field estimator with
one sample and prompt tokens masked at 0.15, sum form (``:319-346,406-410``,
``wd1/train.yaml:69``).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from stabledrl_jax.objectives import base

Array = jax.Array


def wd1_loss(logp: Array, advantages: Array, group_size: int, *,
             sample_mask: Array | None = None) -> tuple[Array, base.Metrics]:
  """wd1: ``-sum_j softmax_G(A)_j * l_j + sum_j softmax_G(-A)_j * l_j``, mean over groups.

  Args:
    logp: [N] likelihood estimates l_j (gradient).
    advantages: [N].
    group_size: G.
    sample_mask: optional [N] bool.
  """
  chex.assert_rank([logp, advantages], 1)
  chex.assert_equal_shape([logp, advantages])
  groups = base.num_groups(logp.shape[0], group_size)
  valid = base.as_valid(sample_mask, logp.shape).reshape(groups, group_size)
  adv = jax.lax.stop_gradient(advantages.astype(jnp.float32)).reshape(groups, group_size)
  w_pos = base.group_softmax(adv, valid)
  w_neg = base.group_softmax(-adv, valid)
  grouped = logp.astype(jnp.float32).reshape(groups, group_size)
  loss = jnp.sum((w_neg - w_pos) * grouped) / groups
  return loss, {"loss": loss, "wd1/weight_pos_max": jnp.max(w_pos)}


@base.register_objective("wd1", estimator=dict(method="mean_field", num_samples=1,
                                               prompt_mask_prob=0.15, coupled_ratio=False,
                                               normalize="sum"))
def loss(inputs: base.ObjectiveInputs, hparams: base.NoHyperparameters,
         group_size: int) -> tuple[Array, base.Metrics]:
  del hparams
  return wd1_loss(inputs.logp, inputs.advantages, group_size, sample_mask=inputs.mask)
