"""The RL loss of one microbatch: likelihood estimates composed with a registered objective.

Pure functions of (logits function, arrays, PRNG key, static specs). The model
enters only through ``logits_fn``; the trainer supplies it from NNX parameters.

The likelihoods are estimated the way the model's family says (``estimators.LikelihoodSpec.family``
names
it; its record's ``likelihood`` is an ``estimators.Likelihood``): the Monte Carlo estimators of
``estimators.py`` for a full-attention model (LLaDA), ``logits_fn`` its logits; the block
estimators of ``block_estimators.py`` for a block diffusion model (SDAR), ``logits_fn`` its
staircase function. The estimator names keep their meaning by analogy for a block model:

* 'elbo': the block ELBO, every block scored in one staircase pass (count form).
* 'block_random': the same. SPG's block_random scores one random block, the earlier
  ones clean and a uniform count masked inside it; for a model whose blocks are
  fixed, averaging over the choice of block gives exactly the block ELBO, which
  scores all of them in the same pass.
* 'mean_field': every completion block fully masked, each token scored given the
  clean blocks before its own (one row; deterministic). These are the per-token
  log-probs of token-level GRPO (d1) for a block model, and their sum is the
  sequence-level mean-field proxy (wd1).

Prompt tokens are never masked for a block model (they condition every block
through the clean stream), and ``schedule`` / ``block_length`` /
``prompt_mask_prob`` do not apply.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp

from stabledrl_jax import estimators, objectives
from stabledrl_jax.models import family as family_lib

Array = jax.Array


@flax.struct.dataclass
class RolloutBatch:
  """Rollouts of P prompts x G completions, groups contiguous. N = P * G, L = prompt + gen length.

  Attributes:
    tokens: [N, L] int32 clean sequences z = [x; y].
    prompt_mask: [N, L] bool, prompt tokens (left padding excluded).
    completion_mask: [N, L] bool, scored completion tokens (up to and including the first EOS).
    attention_mask: [N, L] bool, positions the model may attend to (no left padding).
    advantages: [N] float32 group-relative advantages.
    old_logp: [N] (or [N, L] at token level) estimates under pi_old, no gradient.
    ref_logp: like ``old_logp`` under the frozen reference policy (zeros when unused).
    stressed: [N] bool, the samples given stress-test masks (docs/stress_test.md), or None.
  """

  tokens: Array
  prompt_mask: Array
  completion_mask: Array
  attention_mask: Array
  advantages: Array
  old_logp: Array
  ref_logp: Array
  stressed: Array | None = None


def model_logits_fn(model: Callable[..., Array],
                    attention_mask: Array) -> Callable[..., Array]:
  """The model as ``estimate`` sees it, the [B, L] attention mask bound: its family's
  ``likelihood_fn`` (LLaDA: tokens [B * R, L] -> logits; SDAR: its staircase function)."""
  return family_lib.likelihood_fn(model, attention_mask)


def _likelihood(spec: estimators.LikelihoodSpec) -> estimators.Likelihood:
  return family_lib.get(spec.family).likelihood


def _logp_and_eubo(details: Any, spec: estimators.LikelihoodSpec) -> tuple[Array, Array | None]:
  """What ``estimate`` returns, from the scored masks and their token log-probs."""
  if spec.token_level:
    scored = details.masks.scored.astype(jnp.float32)
    hits = jnp.sum(scored, axis=0)
    logp = jnp.sum(scored * details.token_logp, axis=0) / jnp.maximum(hits, 1.0)
  else:
    logp = details.value
  eubo = None
  if spec.eubo_beta is not None:
    eubo = estimators.eubo_from_samples(details.token_logp, details.masks, beta=spec.eubo_beta)
  return logp, eubo


def estimator_masks(batch: RolloutBatch, key: Array, spec: estimators.LikelihoodSpec,
                    stress_mode: str | None = None) -> Any:
  """The masks of one estimate: fresh ones from ``key``, or stress-test ones.

  Args:
    stress_mode: 'easy' (the numerator l_theta) or 'hard' (the denominator
      l_old): with ``spec.stress_rates`` set, the ``batch.stressed`` samples
      get the stress test's biased masks of that mode instead of fresh ones
      (rates ``stress_rates[0]`` and ``[1]``). None: fresh masks for every sample.

  Returns:
    [R, B, L] masks of the family's estimator.
  """
  likelihood = _likelihood(spec)
  masks = likelihood.masks(key, batch.prompt_mask, batch.completion_mask, spec)
  if stress_mode is not None and spec.stress_rates is not None:
    rate = spec.stress_rates[0] if stress_mode == "easy" else spec.stress_rates[1]
    stress = likelihood.stress_masks(batch.prompt_mask, batch.completion_mask, spec,
                                     mode=stress_mode, rate=rate, num_rows=masks.num_rows)
    masks = estimators.select_masks(batch.stressed, stress, masks)
  return masks


def estimate(logits_fn: Callable[..., Array], batch: RolloutBatch, key: Array | None,
             spec: estimators.LikelihoodSpec, stress_mode: str | None = None,
             masks: Any = None) -> tuple[Array, Array | None]:
  """Likelihood estimates of the batch's completions.

  Args:
    logits_fn: the model as ``model_logits_fn`` gives it.
    key: draws the masks (see ``estimator_masks``); unused when ``masks`` is given.
    stress_mode: see ``estimator_masks``.
    masks: score these masks instead.

  Returns:
    logp: [N] per-sequence estimates, or [N, L] per-token log-probs at token level.
    eubo: [N] EUBO_beta estimates, or None.
  """
  return _logp_and_eubo(_details(logits_fn, batch, key, spec, stress_mode, masks), spec)


def _details(logits_fn: Callable[..., Array], batch: RolloutBatch, key: Array | None,
             spec: estimators.LikelihoodSpec, stress_mode: str | None = None,
             masks: Any = None) -> Any:
  if masks is None:
    masks = estimator_masks(batch, key, spec, stress_mode)
  return _likelihood(spec).estimate(logits_fn, batch.tokens, batch.prompt_mask,
                                    batch.completion_mask, batch.attention_mask, masks, spec)


def _masked_row_mean(x: Array, mask: Array) -> Array:
  """[N, L] -> [N], the mean over each row's ``mask`` entries (0 for none)."""
  return jnp.sum(jnp.where(mask, x, 0.0), axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1)


def objective_loss(logits_fn: Callable[[Array], Array], batch: RolloutBatch, key: Array, *,
                   spec: estimators.LikelihoodSpec, objective: str, hparams: Any, group_size: int,
                   gen_length: int, use_reference: bool,
                   objective_state: Any = None) -> tuple[Array, dict[str, Array]]:
  """The objective's (loss, metrics) on fresh estimates under the current parameters.

  In a stress test the numerator l_theta of the stressed samples uses "easy" masks. Besides the
  objective's own metrics: ``estimator/logp_std_{mean,max}``, the standard deviation of the
  sequence estimates from their own K samples (``estimators.monte_carlo_variance``; sequence
  level with K >= 2 only), and for ratio objectives ``per_sample/log_ratio`` [N]
  (l_theta - l_old; at token level the mean over the completion's tokens).

  Args:
    objective: the registered objective's name; ``hparams`` its hyperparameters.
    gen_length: the generation length of the rollouts.
    objective_state: the objective's state (``TrainState.objective_state``).
  """
  details = _details(logits_fn, batch, key, spec, stress_mode="easy")
  logp, eubo = _logp_and_eubo(details, spec)
  inputs = objective_inputs(batch, logp, eubo, spec, use_reference, objective_state, gen_length)
  registered = objectives.get_objective(objective)
  loss, metrics = registered(inputs, hparams, group_size)
  metrics = {**metrics, "loss": loss}  # Every objective's loss is logged as `loss`.
  scored = jnp.any(batch.completion_mask, axis=-1)
  if not spec.token_level and details.row_values is not None and details.masks.num_rows >= 2:
    std = jax.lax.stop_gradient(jnp.sqrt(estimators.monte_carlo_variance(details.row_values)))
    metrics["estimator/logp_std_mean"] = jnp.sum(jnp.where(scored, std, 0.0)) / jnp.maximum(
        jnp.sum(scored), 1)
    metrics["estimator/logp_std_max"] = jnp.max(jnp.where(scored, std, 0.0))
  if "old_logp" in registered.requires:  # A ratio objective.
    log_ratio = jax.lax.stop_gradient(inputs.logp - inputs.old_logp)
    if spec.token_level:
      log_ratio = _masked_row_mean(log_ratio, batch.completion_mask)
    metrics["per_sample/log_ratio"] = log_ratio
  return loss, metrics


def objective_inputs(batch: RolloutBatch, logp: Array, eubo: Array | None,
                     spec: estimators.LikelihoodSpec, use_reference: bool, state: Any = None,
                     gen_length: int | None = None) -> objectives.ObjectiveInputs:
  """What an objective sees of a batch, given its fresh estimates under pi_theta."""
  return objectives.ObjectiveInputs(
      state=state, gen_length=gen_length,
      logp=logp, advantages=batch.advantages, old_logp=batch.old_logp,
      mask=batch.completion_mask if spec.token_level else None,
      ref_logp=batch.ref_logp if use_reference else None, eubo=eubo,
      lengths=jnp.sum(batch.completion_mask, axis=-1).astype(jnp.float32))


def surrogate_gradient_norms(logits_fn_of: Callable[[Any, Array], Callable[[Array], Array]],
                             params: Any, batch: RolloutBatch, key: Array, *,
                             spec: estimators.LikelihoodSpec,
                             surrogate: Callable[[objectives.ObjectiveInputs], Array]) -> Array:
  """[N] ||grad_theta s_j||, per sample: max_j |A_j| times these bounds StableDRL's gradient
  norm (docs/algorithms.md).

  StableDRL's gradient is a convex combination (per group) of A_j grad s_j, so its norm never
  exceeds max_j |A_j| ||grad s_j||. s_j is scored on the masks that ``objective_loss`` draws
  from the same ``key`` (stress masks included), one per-sample gradient each (vmapped over the
  N rows), so memory grows as N x parameters: a diagnostic for small models.

  Args:
    logits_fn_of: (params, attention_mask [B, L]) -> logits_fn, as ``model_logits_fn``.
    params: the parameters the gradients are taken with respect to.
    batch: N rollouts; ``key`` and ``spec`` as in ``objective_loss``.
    surrogate: inputs -> [N] s, the objective's registered surrogate with its hyperparameters
      bound (``objectives.Objective.surrogate``).

  Returns:
    [N] float32.
  """
  masks = estimator_masks(batch, key, spec, stress_mode="easy")

  def sample_surrogate(p, row, row_masks):
    row = jax.tree.map(lambda x: x[None], row)  # A batch of one sequence.
    row_masks = jax.tree.map(lambda x: x[:, None], row_masks)
    logp, eubo = estimate(logits_fn_of(p, row.attention_mask), row, None, spec,
                          masks=row_masks)
    inputs = objective_inputs(row, logp, eubo, spec, use_reference=False)
    return surrogate(inputs)[0]

  grads = jax.vmap(jax.grad(sample_surrogate), in_axes=(None, 0, 1))(params, batch, masks)
  squares = [jnp.sum(jnp.square(g.astype(jnp.float32)), axis=tuple(range(1, g.ndim)))
             for g in jax.tree.leaves(grads)]
  return jnp.sqrt(sum(squares))
