r"""StableDRL (arXiv 2603.06743): unconditional clipping, then self-normalized weights (SNIS).

    log c_j = clip(log rho_j, log lo, log hi)          # whatever the sign of A_j
    w_j     = sg(softmax_{k in group}(log c_k)_j)      # a convex combination per group
    L       = -(1/P) sum_groups sum_j w_j A_j s_j

The weights sum to 1 in each group, so the gradient is bounded by max_j |A_j| ||grad s_j||
however wrong the ratio estimates are (docs/algorithms.md). s_j is SPG's sandwich (``spg.py``).

Official code, JianyuanZhong/StableDRL [26ad014]: the clip at log 5 without a lower bound and the
group softmax, detached, ``networks/llada_svpo.py:1013-1025`` and ``configs/*_spg_snis.yaml``; the
loss with SPG's sandwich (omega 0.5, beta 1.5) ``:1034-1037``; SPG's ``block_random`` masks with
two samples, l_old once per rollout on masks of its own (``:457-519,848-869``).

The adaptive clip (``clip_mode='adaptive'``) is ours, not the paper's: the objective's state
holds log hi, and ``update_state`` moves it between RL steps to keep the clipped fraction of the
ratios in a band.
"""

from __future__ import annotations

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp

from stabledrl_jax.objectives import base, spg

Array = jax.Array
CLIP_MODES = ("fixed", "adaptive")
NORMALIZE_OVER = ("group", "batch")
# advantage_centering: none (the paper's loss) | snis (A_j - sum_k w_k A_k within each group).
CENTERINGS = ("none", "snis")


@dataclasses.dataclass(frozen=True)
class StableDRLHparams:
  """StableDRL: log c(rho) = clip(log rho, log min_ratio, log max_ratio), unconditionally, then
  self-normalized over each group (or the batch); SPG's sandwich surrogate.

  ``clip_mode='adaptive'``: ``max_ratio`` is only the starting bound; between RL steps
  ``adapt_log_clip`` moves log hi by ``clip_step`` to keep the clipped fraction of the ratios in
  [clip_target_low, clip_target_high]. The bound lives in the objective's state
  (``TrainState.objective_state``), so it is checkpointed.

  ``advantage_centering='snis'`` (ours, off by default): each A_j becomes A_j - sum_k w_k A_k
  within its group (``center_advantages``), so that the weighted advantages of every group sum
  to 0 as uniform weights' do (docs/algorithms.md, "Centred advantages").
  """

  min_ratio: float = 0.0
  max_ratio: float = 5.0
  normalize_over: str = "group"
  surrogate: str = "sandwich"
  omega: float = 0.5
  eubo_beta: float = 1.5
  clip_mode: str = "fixed"
  clip_target_low: float = 0.02
  clip_target_high: float = 0.10
  clip_step: float = 0.1
  advantage_centering: str = "none"

  def check(self) -> None:
    if not 0 <= self.min_ratio < self.max_ratio:
      raise ValueError(f"max_ratio: needs 0 <= min_ratio < max_ratio, got {self.min_ratio}, "
                       f"{self.max_ratio}")
    base.check_choice("normalize_over", self.normalize_over, NORMALIZE_OVER)
    base.check_choice("surrogate", self.surrogate, spg.SURROGATES)
    base.check_choice("clip_mode", self.clip_mode, CLIP_MODES)
    base.check_choice("advantage_centering", self.advantage_centering, CENTERINGS)
    spg.check_sandwich(self)
    if not 0 <= self.clip_target_low < self.clip_target_high <= 1:
      raise ValueError(f"clip_target_high: needs 0 <= clip_target_low < clip_target_high <= 1, "
                       f"got {self.clip_target_low}, {self.clip_target_high}")
    if not 0 < self.clip_step <= 1:
      raise ValueError(f"clip_step: needs 0 < clip_step <= 1 (a change of log hi), got "
                       f"{self.clip_step}")


_DEFAULTS = StableDRLHparams()


def log_bounds(min_ratio: float, max_ratio: float) -> tuple[float, float]:
  """Log-space clipping bounds; ``min_ratio == 0`` means no lower bound."""
  if not 0.0 <= min_ratio < max_ratio:
    raise ValueError(
        f"Ratio bounds must satisfy 0 <= min_ratio < max_ratio, got "
        f"min_ratio={min_ratio}, max_ratio={max_ratio}.")
  log_lo = -math.inf if min_ratio == 0.0 else math.log(min_ratio)
  return log_lo, math.log(max_ratio)


def clip_log_ratio(log_ratio: Array, *, min_ratio: float = _DEFAULTS.min_ratio,
                   max_ratio: float = _DEFAULTS.max_ratio,
                   log_max_ratio: Array | None = None) -> Array:
  """Unconditional clipping in log space: ``log c(rho) = clip(log rho, log lo, log hi)``.

  ``min_ratio = 0`` leaves the lower side unbounded (never ``log(0)``). ``log_max_ratio``: a
  traced log hi (the adaptive clip's, ``adapt_log_clip``) in place of ``log(max_ratio)``.
  """
  log_lo, log_hi = log_bounds(min_ratio, max_ratio)
  return jnp.clip(log_ratio, log_lo, log_hi if log_max_ratio is None else log_max_ratio)


def adapt_log_clip(log_hi: Array, clipped_fraction: Array, *,
                   band: tuple[float, float] = (_DEFAULTS.clip_target_low,
                                                _DEFAULTS.clip_target_high),
                   step: float = _DEFAULTS.clip_step,
                   log_range: tuple[float, float] = (0.05, 6.9)) -> Array:
  """The adaptive clip's controller: the next log hi from this step's clipped fraction.

  Above the band the bound is raised by ``step`` (in log space), below it lowered by ``step``,
  inside it kept; the result stays in ``log_range`` (default: rho bounds 1.05 to ~1000). A
  non-finite fraction (a skipped update) keeps the bound. Pure and elementwise: ``log_hi`` and
  ``clipped_fraction`` are scalars or arrays of one shape.

  Args:
    log_hi: [] current log of the upper ratio bound.
    clipped_fraction: [] fraction of the step's ratios the bound clipped (``clip/frac_upper``
      plus ``clip/frac_lower``).
    band: (low, high) target range of the clipped fraction.
    step: the largest change of log hi per call.
    log_range: (min, max) of log hi.

  Returns:
    [] float32 next log hi.
  """
  log_hi = jnp.asarray(log_hi, jnp.float32)
  fraction = jnp.asarray(clipped_fraction, jnp.float32)
  delta = jnp.where(fraction > band[1], step, jnp.where(fraction < band[0], -step, 0.0))
  delta = jnp.where(jnp.isfinite(fraction), delta, 0.0)
  return jnp.clip(log_hi + delta, log_range[0], log_range[1])


def snis_weights(log_ratio: Array, group_size: int, *, min_ratio: float = _DEFAULTS.min_ratio,
                 max_ratio: float = _DEFAULTS.max_ratio, sample_mask: Array | None = None,
                 log_max_ratio: Array | None = None) -> Array:
  """Self-normalized importance weights of clipped ratios, per group.

  ``w_j = c(rho_j) / sum_{k in group} c(rho_k)``, computed as a softmax of the clipped log
  ratios (log-sum-exp), so ``rho = 1e300`` or ``1e-300`` stays finite. Use ``group_size = N``
  for batch-level normalization.

  Args:
    log_ratio: [N] log rho_hat, one per completion.
    group_size: G, the size of a normalization group.
    min_ratio, max_ratio: clipping bounds on rho (``min_ratio = 0``: no lower bound).
    sample_mask: optional [N] bool; masked samples get weight 0.
    log_max_ratio: optional [] traced log hi (the adaptive clip), in place of max_ratio's.

  Returns:
    [N] weights, >= 0, summing to 1 within each group (with at least one valid sample), with
    stop-gradient.
  """
  chex.assert_rank(log_ratio, 1)
  groups = base.num_groups(log_ratio.shape[0], group_size)
  valid = base.as_valid(sample_mask, log_ratio.shape)
  clipped = clip_log_ratio(log_ratio.astype(jnp.float32), min_ratio=min_ratio,
                           max_ratio=max_ratio, log_max_ratio=log_max_ratio)
  weights = base.group_softmax(clipped.reshape(groups, group_size),
                               valid.reshape(groups, group_size))
  return jax.lax.stop_gradient(weights.reshape(-1))


def center_advantages(weights: Array, advantages: Array, group_size: int) -> Array:
  """SNIS-centred advantages: A'_j = A_j - sum_{k in group} w_k A_k, weights detached.

  With weights summing to 1 in the group, sum_j w_j A'_j = 0, and |A'_j| <= 2 max_k |A_k| (the
  subtracted term is a convex combination of the A_k). Weights [N] of group-scope SNIS,
  advantages [N] -> [N]; a group without weight mass (no valid sample) is left as it was.
  """
  chex.assert_equal_shape([weights, advantages])
  groups = base.num_groups(advantages.shape[0], group_size)
  w = jax.lax.stop_gradient(weights).reshape(groups, group_size)
  a = jax.lax.stop_gradient(advantages.astype(jnp.float32)).reshape(groups, group_size)
  shift = jnp.sum(w * a, axis=1, keepdims=True)
  return (a - shift).reshape(-1)


def _snis_metrics(weights: Array, group_size: int, valid: Array) -> base.Metrics:
  grouped = weights.reshape(-1, group_size)
  has_valid = jnp.any(valid.reshape(-1, group_size), axis=1)
  ess = 1.0 / jnp.maximum(jnp.sum(grouped**2, axis=1), jnp.finfo(jnp.float32).tiny)
  entropy = -jnp.sum(jnp.where(grouped > 0, grouped * jnp.log(
      jnp.where(grouped > 0, grouped, 1.0)), 0.0), axis=1)
  return {
      "snis/ess": base.masked_mean(ess, has_valid),
      "snis/ess_min": base.masked_min(ess, has_valid),
      "snis/weight_entropy": base.masked_mean(entropy, has_valid),
      "snis/weight_max": jnp.max(weights),
  }


def stabledrl_loss(logp: Array, log_ratio: Array, advantages: Array,
                   group_size: int, *, min_ratio: float = _DEFAULTS.min_ratio,
                   max_ratio: float = _DEFAULTS.max_ratio,
                   normalize_over: str = _DEFAULTS.normalize_over,
                   sample_mask: Array | None = None,
                   log_max_ratio: Array | None = None,
                   advantage_centering: str = _DEFAULTS.advantage_centering
                   ) -> tuple[Array, base.Metrics]:
  """StableDRL: ``-(1/P) * sum_groups sum_j sg(w_j) * A_j * s_j``.

  Args:
    logp: [N] surrogate s_j (an ELBO or the SPG sandwich); carries the gradient.
    log_ratio: [N] log rho_hat_j = l_theta - l_old (length-normalized ELBOs); only its value is
      used.
    advantages: [N] A_j.
    group_size: G.
    min_ratio, max_ratio: unconditional clip of rho (paper: 0 and 5; the symmetric variant is
      ``1 - eps, 1 + eps``).
    normalize_over: ``"group"`` (weights sum to 1 per group) or ``"batch"`` (over the batch).
    sample_mask: optional [N] bool, samples that count.
    log_max_ratio: optional [] traced log hi (the adaptive clip) in place of ``log(max_ratio)``.
    advantage_centering: ``"none"`` (the paper's loss) or ``"snis"``: A_j - sum_k w_k A_k per
      group (``center_advantages``; group scope only).

  Returns:
    (loss, metrics) with ESS, log-ratio, clip-fraction and weight-entropy diagnostics, the
    weighted advantage sums of the uncentred advantages (``base.weighted_advantage_sums``), and
    ``per_sample/weight`` [N], the SNIS weights.
  """
  chex.assert_rank([logp, log_ratio, advantages], 1)
  chex.assert_equal_shape([logp, log_ratio, advantages])
  n = logp.shape[0]
  groups = base.num_groups(n, group_size)
  base.check_choice("normalize_over", normalize_over, NORMALIZE_OVER)
  base.check_choice("advantage_centering", advantage_centering, CENTERINGS)
  if advantage_centering == "snis" and normalize_over != "group":
    raise ValueError("advantage_centering='snis' centres within each group: it needs "
                     "normalize_over='group'")
  scope = group_size if normalize_over == "group" else n
  valid = base.as_valid(sample_mask, (n,))
  weights = snis_weights(log_ratio, scope, min_ratio=min_ratio, max_ratio=max_ratio,
                         sample_mask=valid, log_max_ratio=log_max_ratio)
  advantages = jax.lax.stop_gradient(advantages.astype(jnp.float32))
  # Group-scope weights sum to 1 per group (total mass P), batch scope to 1.
  total_mass = groups if scope == group_size else 1
  # The sums S_g = sum_j w_j A_j, with weights on the group scale (uniform: 1 / G).
  sums = base.weighted_advantage_sums(weights * (groups / total_mass), advantages, group_size,
                                      valid)
  applied = (center_advantages(weights, advantages, group_size)
             if advantage_centering == "snis" else advantages)
  loss = -jnp.sum(weights * applied * logp.astype(jnp.float32)) / total_mass
  log_lo, log_hi = log_bounds(min_ratio, max_ratio)
  if log_max_ratio is not None:
    log_hi = log_max_ratio
  metrics = {
      "loss": loss,
      **base.ratio_metrics(log_ratio, advantages, valid, log_lo=log_lo, log_hi=log_hi),
      **_snis_metrics(weights, scope, valid),
      **sums,
      "per_sample/weight": weights,
  }
  return loss, metrics


def init_state(hparams: StableDRLHparams) -> dict[str, Array]:
  """The clip bound a run starts with: ``{"log_clip_hi": [] float32 log max_ratio}``."""
  return {"log_clip_hi": jnp.asarray(math.log(hparams.max_ratio), jnp.float32)}


def update_state(state: dict[str, Array], metrics: base.Metrics,
                 hparams: StableDRLHparams) -> dict[str, Array]:
  """The next RL step's bound, from this step's clipped fraction (fixed: unchanged)."""
  if hparams.clip_mode == "fixed":
    return state
  fraction = metrics["clip/frac_upper"] + metrics["clip/frac_lower"]
  return {"log_clip_hi": adapt_log_clip(
      state["log_clip_hi"], fraction, step=hparams.clip_step,
      band=(hparams.clip_target_low, hparams.clip_target_high))}


def surrogate(inputs: base.ObjectiveInputs, hparams: StableDRLHparams) -> Array:
  """[N] s_j, whose per-sample gradients bound the update (``train.gradient_bound``)."""
  return spg.surrogate_logp(inputs, hparams.surrogate, hparams.omega)


@base.register_objective(
    "stabledrl", hparams=StableDRLHparams, requires=("old_logp",), estimator=spg.BLOCK_RANDOM,
    eubo_beta=spg.sandwich_eubo, surrogate=surrogate, init_state=init_state,
    update_state=update_state,
    variants={"stabledrl": {}, "stabledrl_adaptive": {"clip_mode": "adaptive"}},
    metrics=base.RATIO_METRICS + base.ADVANTAGE_SUM_METRICS + (
        "snis/ess", "snis/ess_min", "snis/weight_entropy", "snis/weight_max"))
def loss(inputs: base.ObjectiveInputs, hparams: StableDRLHparams,
         group_size: int) -> tuple[Array, base.Metrics]:
  log_ratio = inputs.logp - inputs.old_logp
  log_clip_hi = (inputs.state or {}).get("log_clip_hi")
  log_max_ratio = None
  if hparams.clip_mode == "adaptive":
    if log_clip_hi is None:
      raise ValueError("clip_mode='adaptive' needs inputs.state['log_clip_hi'] (the objective's "
                       "state: Objective.initial_state)")
    log_max_ratio = log_clip_hi
  loss_value, metrics = stabledrl_loss(
      surrogate(inputs, hparams), log_ratio, inputs.advantages, group_size,
      min_ratio=hparams.min_ratio, max_ratio=hparams.max_ratio,
      normalize_over=hparams.normalize_over, sample_mask=inputs.mask,
      log_max_ratio=log_max_ratio, advantage_centering=hparams.advantage_centering)
  if log_clip_hi is not None:  # The bound this step clips at (fixed or adaptive).
    metrics["clip/max_ratio"] = jnp.exp(log_clip_hi)
  if hparams.clip_mode == "adaptive":
    metrics["clip/log_hi"] = log_max_ratio
  return loss_value, metrics
