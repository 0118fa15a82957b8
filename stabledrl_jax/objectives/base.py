"""What every objective shares: its inputs, its registration, the registry and array helpers.

An objective is one :class:`Objective` record, registered by name; the trainer, the config check,
the likelihood spec and the comparisons consult the registry and nothing else. Its loss is a
pure function ``loss(inputs, hparams, group_size) -> (loss, metrics)`` of arrays: ``inputs`` an
:class:`ObjectiveInputs`, ``hparams`` its frozen hyperparameter dataclass (static: the update
compiles for its values), ``group_size`` G. ``loss`` is the scalar to *minimize*; ``metrics`` a
flat dict of scalars with stable names (``log_ratio/max``, ``snis/ess``), plus optional
``per_sample/<name>`` [N] arrays (the weight each sample's gradient gets), which the trainer keeps
for the spike recorder instead of averaging.

Notation (docs/algorithms.md): a batch holds P prompts x G completions, N = P * G, each group
contiguous. ``A`` are advantages, ``l`` likelihood estimates, ``log_ratio = l_theta - l_old``
(log rho) and ``s`` a surrogate log-likelihood that carries the gradient.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import chex
import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array
Metrics = dict[str, Array]


@flax.struct.dataclass
class ObjectiveInputs:
  """What the trainer hands an objective. Shapes: N = P * G completions.

  Attributes:
    logp: [N] likelihood estimate under pi_theta (carries the gradient), or [N, T] per-token
      log-probs for token-level GRPO.
    advantages: [N] A.
    old_logp: like ``logp``, under pi_old (rollout time), no gradient.
    mask: [N] (or [N, T] at token level) bool, entries that count.
    ref_logp: like ``logp``, under the frozen reference policy (KL terms).
    eubo: [N] EUBO estimate under pi_theta (SPG sandwich), gradient.
    lengths: [N] scored completion tokens per sample.
    state: the objective's state (``Objective.init_state``; ``TrainState.objective_state``),
      None for an objective without one.
    gen_length: the generation length L of the rollouts (static).
  """

  logp: Array
  advantages: Array
  old_logp: Array | None = None
  mask: Array | None = None
  ref_logp: Array | None = None
  eubo: Array | None = None
  lengths: Array | None = None
  state: Any = None
  gen_length: int | None = flax.struct.field(pytree_node=False, default=None)


@dataclasses.dataclass(frozen=True)
class NoHyperparameters:
  """The hyperparameters of an objective that has none."""


@dataclasses.dataclass(frozen=True)
class Objective:
  """A registered objective: everything the trainer needs to know about it, in one place.

  Attributes:
    name: config name (``--config.objective.name``).
    loss: ``loss(inputs, hparams, group_size) -> (loss, metrics)``.
    hparams: a frozen dataclass of its hyperparameters, defaulting to its official code's
      (docs/algorithms.md); the only place its defaults are written.
      ``config.objective.<name>.<field>`` overrides a field; a ``check()`` method, if any, raises
      ValueError("<field>: <why>") for a bad value.
    requires: names of ``ObjectiveInputs`` fields that must be set.
    estimator: ``estimator(hparams) -> dict``, the official likelihood settings: ``method`` (an
      estimator method, ``estimators.methods()``), ``num_samples``, ``normalize`` ('sum' or
      'mean'), ``coupled_ratio`` (l_old on each inner iteration's own masks) and mask-sampler
      options. A config field left unset takes these.
    baseline: the advantage baseline of its official code (``advantages.ADVANTAGE_BASELINES``).
    uses_reference: ``uses_reference(hparams) -> bool``: needs a frozen reference (a KL term).
    token_level: ``token_level(hparams) -> bool``: per-token log-probs [N, T] instead of [N].
    eubo_beta: ``eubo_beta(hparams) -> float | None``: SPG's EUBO_beta from the same pass.
    surrogate: ``surrogate(inputs, hparams) -> [N]``, the log-likelihood whose per-sample
      gradients bound the update (StableDRL's convex hull, ``train.gradient_bound``); None when
      the objective has no such bound.
    init_state: ``init_state(hparams) -> pytree`` of arrays, the objective's state (optax's
      shape); None: stateless. It lives in ``TrainState.objective_state`` and is checkpointed.
    update_state: ``update_state(state, metrics, hparams) -> state``, jitted once per RL step
      with the step's metrics (averaged over its updates).
    variants: named hyperparameter overrides that comparisons run as separate objectives
      (``{"grpo_token": {"level": "token"}, ...}``); by default the objective itself.
    metrics: the metric names ``loss`` always reports.
  """

  name: str
  loss: Callable[[ObjectiveInputs, Any, int], tuple[Array, Metrics]]
  hparams: type
  requires: tuple[str, ...]
  estimator: Callable[[Any], dict[str, Any]]
  baseline: str = "group_mean"
  uses_reference: Callable[[Any], bool] = lambda hparams: False
  token_level: Callable[[Any], bool] = lambda hparams: False
  eubo_beta: Callable[[Any], float | None] = lambda hparams: None
  surrogate: Callable[[ObjectiveInputs, Any], Array] | None = None
  init_state: Callable[[Any], Any] | None = None
  update_state: Callable[[Any, Metrics, Any], Any] | None = None
  variants: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
  metrics: tuple[str, ...] = ()

  def make_hparams(self, overrides: dict[str, Any] | None = None) -> Any:
    """The hyperparameters: the official defaults with ``overrides`` (None values skipped).

    Raises:
      ValueError: "<field>: <why>" for an unknown field or a value ``check()`` refuses.
    """
    fields = {f.name for f in dataclasses.fields(self.hparams)}
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = sorted(set(given) - fields)
    if unknown:
      raise ValueError(f"{unknown[0]}: {self.name!r} has no hyperparameter {unknown[0]!r}; its "
                       f"hyperparameters are {sorted(fields)}")
    params = self.hparams(**given)
    check_finite(params)
    if hasattr(params, "check"):
      params.check()
    return params

  def initial_state(self, hparams: Any) -> Any:
    """The state a run starts with: ``init_state(hparams)``, or {} for a stateless objective."""
    return {} if self.init_state is None else self.init_state(hparams)

  def variant_overrides(self) -> dict[str, dict[str, Any]]:
    """{variant name: hyperparameter overrides}; the objective alone without variants."""
    return {name: dict(overrides) for name, overrides in self.variants} or {self.name: {}}

  def __call__(self, inputs: ObjectiveInputs, hparams: Any,
               group_size: int) -> tuple[Array, Metrics]:
    missing = [f for f in self.requires if getattr(inputs, f) is None]
    if missing:
      raise ValueError(f"Objective {self.name!r} needs inputs {missing}.")
    return self.loss(inputs, hparams, group_size)


_OBJECTIVES: dict[str, Objective] = {}
ADVANTAGE_BASELINES = ("group_mean", "leave_one_out")


def register_objective(name: str, *, hparams: type = NoHyperparameters,
                       requires: tuple[str, ...] = (),
                       estimator: dict[str, Any] | Callable[[Any], dict[str, Any]],
                       baseline: str = "group_mean",
                       uses_reference: Callable[[Any], bool] | None = None,
                       token_level: Callable[[Any], bool] | None = None,
                       eubo_beta: Callable[[Any], float | None] | None = None,
                       surrogate: Callable[[ObjectiveInputs, Any], Array] | None = None,
                       init_state: Callable[[Any], Any] | None = None,
                       update_state: Callable[[Any, Metrics, Any], Any] | None = None,
                       variants: dict[str, dict[str, Any]] | None = None,
                       metrics: tuple[str, ...] = ()):
  """Decorator adding ``loss(inputs, hparams, group_size)`` to the registry; every keyword is an
  attribute of :class:`Objective`. Registering is all it takes: the config check, the likelihood
  spec, the update step and the comparisons consult the registry."""
  if baseline not in ADVANTAGE_BASELINES:
    raise ValueError(f"baseline must be one of {ADVANTAGE_BASELINES}, got {baseline!r}.")
  if not (dataclasses.is_dataclass(hparams) and hparams.__dataclass_params__.frozen):
    raise TypeError(f"hparams of {name!r} must be a frozen dataclass (hashable: the update step "
                    "is compiled for its values)")
  if (init_state is None) != (update_state is None):
    raise TypeError(f"{name!r}: init_state and update_state come together")
  estimator_of = estimator if callable(estimator) else lambda params: dict(estimator)
  frozen_variants = tuple((k, tuple(sorted(v.items()))) for k, v in (variants or {}).items())
  given = dict(uses_reference=uses_reference, token_level=token_level, eubo_beta=eubo_beta)

  def decorator(loss):
    if name in _OBJECTIVES:
      raise ValueError(f"Objective {name!r} is already registered.")
    _OBJECTIVES[name] = Objective(
        name, loss, hparams, ("logp", "advantages") + requires, estimator_of, baseline,
        surrogate=surrogate, init_state=init_state, update_state=update_state,
        variants=frozen_variants, metrics=metrics,
        **{k: v for k, v in given.items() if v is not None})
    return loss

  return decorator


def unregister_objective(name: str) -> None:
  """Removes a registration (tests that register their own objective clean up with it)."""
  _OBJECTIVES.pop(name, None)


def get_objective(name: str) -> Objective:
  if name not in _OBJECTIVES:
    raise ValueError(f"Unknown objective {name!r}; registered: {sorted(_OBJECTIVES)}.")
  return _OBJECTIVES[name]


def objective_names() -> list[str]:
  return sorted(_OBJECTIVES)


def objectives() -> list[Objective]:
  """Every registered objective, in registration order."""
  return list(_OBJECTIVES.values())


# ---------------------------------------------------------------------------
# Hyperparameter checks: "<field>: <why>" (the config check prefixes config.objective.<name>.).
# ---------------------------------------------------------------------------


def check_choice(field: str, value: Any, allowed: tuple[Any, ...]) -> None:
  if value not in allowed:
    raise ValueError(f"{field}: {value!r} is not one of {allowed}")


def check_finite(params: Any) -> None:
  """Every number field of a hyperparameter dataclass is finite (a NaN or infinite clip bound,
  coefficient or weight poisons every update; ``make_hparams`` checks this before ``check()``).

  Raises:
    ValueError: "<field>: must be a finite number, got nan".
  """
  for field in dataclasses.fields(params):
    value = getattr(params, field.name)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isfinite(
        value):
      raise ValueError(f"{field.name}: must be a finite number, got {value!r}")


def check_range(field: str, value: float, low: float, high: float = math.inf, *,
                low_open: bool = False, high_open: bool = False) -> None:
  """Raises ValueError "<field>: must lie in [low, high], got v" (open ends as asked)."""
  above = value > low if low_open else value >= low
  below = value < high if high_open else value <= high
  if not (isinstance(value, (int, float)) and not isinstance(value, bool) and above and below):
    interval = (("(" if low_open else "[") + f"{low}, {high}"
                + (")" if high_open or high == math.inf else "]"))
    raise ValueError(f"{field}: must lie in {interval}, got {value!r}")


# ---------------------------------------------------------------------------
# Array helpers.
# ---------------------------------------------------------------------------


def num_groups(n: int, group_size: int) -> int:
  """P = N / G, checking that the batch holds whole groups."""
  if group_size < 1:
    raise ValueError(f"group_size must be >= 1, got {group_size}.")
  if n % group_size:
    raise ValueError(
        f"The batch size {n} is not a multiple of group_size {group_size}: "
        "every group of completions must be complete and contiguous.")
  return n // group_size


def as_valid(mask: Array | None, shape: tuple[int, ...]) -> Array:
  """``mask`` as bool of ``shape`` (None: everything valid)."""
  if mask is None:
    return jnp.ones(shape, dtype=bool)
  chex.assert_shape(mask, shape)
  return mask.astype(bool)


def masked_mean(x: Array, valid: Array) -> Array:
  """Mean of ``x`` over ``valid`` entries; 0 when nothing is valid."""
  total = jnp.sum(jnp.where(valid, x, 0.0))
  return total / jnp.maximum(jnp.sum(valid), 1)


def masked_max(x: Array, valid: Array) -> Array:
  return jnp.max(jnp.where(valid, x, -jnp.inf), initial=-jnp.inf)


def masked_min(x: Array, valid: Array) -> Array:
  return jnp.min(jnp.where(valid, x, jnp.inf), initial=jnp.inf)


def group_softmax(logits: Array, valid: Array) -> Array:
  """Softmax over the last axis restricted to ``valid`` entries.

  Finite for any finite or -inf input. A group whose valid entries are all -inf (every ratio
  exactly 0) carries no preference and gets uniform weights; a group with no valid entry gets
  all-zero weights.
  """
  logits = jnp.where(valid, logits, -jnp.inf)
  top = jnp.max(logits, axis=-1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  unnorm = jnp.where(valid, jnp.exp(logits - top), 0.0)
  total = jnp.sum(unnorm, axis=-1, keepdims=True)
  unnorm = jnp.where(total > 0, unnorm, valid.astype(unnorm.dtype))
  # The largest valid entry contributes exp(0) = 1 (or the uniform fallback contributes its
  # count), so total is 0 only for a group with nothing valid.
  total = jnp.sum(unnorm, axis=-1, keepdims=True)
  return unnorm / jnp.where(total > 0, total, 1.0)


RATIO_METRICS = ("log_ratio/mean", "log_ratio/max", "log_ratio/min", "log_ratio/var",
                 "clip/frac_upper", "clip/frac_lower")
# The per-group weighted advantage sum (``weighted_advantage_sums``; docs/diagnostics.md).
ADVANTAGE_SUM_METRICS = ("weights/adv_sum_abs_mean", "weights/adv_sum_abs_max")


def weighted_advantage_sums(weights: Array | None, advantages: Array, group_size: int,
                            valid: Array) -> Metrics:
  """The diagnostic of ratio-weighted updates: per group g, S_g = sum_{j in g} w_j A_j.

  With uniform weights (on-policy, or no importance weights at all) S_g is the group's mean
  advantage, 0 under a group-mean baseline: the update moves the group's samples against each
  other. Noisy weights make S_g != 0, so each update also pushes the likelihood of the whole
  group up or down by S_g, at random (docs/diagnostics.md, "Weighted advantage sum").

  Args:
    weights: [N] each sample's weight, normalized so that uniform weights are 1 / G per sample
      (SNIS weights as they are; a PPO coefficient rho_j divided by G); None: no weights (0).
    advantages: [N] A_j.
    group_size: G.
    valid: [N] bool.

  Returns:
    ``weights/adv_sum_abs_mean`` (mean |S_g| over groups with a valid sample) and
    ``weights/adv_sum_abs_max`` (the largest |S_g|).
  """
  if weights is None:
    zero = jnp.zeros((), jnp.float32)
    return {ADVANTAGE_SUM_METRICS[0]: zero, ADVANTAGE_SUM_METRICS[1]: zero}
  groups = num_groups(advantages.shape[0], group_size)
  terms = jnp.where(valid, jax.lax.stop_gradient(weights * advantages), 0.0)
  sums = jnp.abs(jnp.sum(terms.astype(jnp.float32).reshape(groups, group_size), axis=1))
  has_valid = jnp.any(valid.reshape(groups, group_size), axis=1)
  return {ADVANTAGE_SUM_METRICS[0]: masked_mean(sums, has_valid),
          ADVANTAGE_SUM_METRICS[1]: jnp.max(jnp.where(has_valid, sums, 0.0))}


def ratio_metrics(log_ratio: Array, advantages: Array, valid: Array, *,
                  log_lo: float, log_hi: float | Array) -> Metrics:
  """Diagnostics of the importance ratios against clipping bounds.

  Args:
    log_ratio: [...] log rho_hat (per sequence or per token).
    advantages: [...] A, broadcast to ``log_ratio``'s shape.
    valid: [...] bool, entries that count.
    log_lo, log_hi: clipping bounds in log space.

  Returns:
    ``log_ratio/{mean,max,min,var}`` and the fraction of valid entries above
    (``clip/frac_upper``) and below (``clip/frac_lower``) the bounds, also split by the sign of
    the advantage (``clip/frac_upper_neg_adv``, ...). Ratios above the bound with A < 0 are the
    ones GRPO's conditional clip lets through.
  """
  log_ratio = jax.lax.stop_gradient(log_ratio)
  above = valid & (log_ratio > log_hi)
  below = valid & (log_ratio < log_lo)
  pos = advantages > 0
  neg = advantages < 0
  frac = lambda m: masked_mean(m.astype(jnp.float32), valid)
  finite = valid & jnp.isfinite(log_ratio)
  return {
      "log_ratio/mean": masked_mean(log_ratio, valid),
      # Over finite entries: one infinite ratio would make it NaN and say nothing.
      "log_ratio/var": masked_mean(
          jnp.square(log_ratio - masked_mean(log_ratio, finite)), finite),
      "log_ratio/max": masked_max(log_ratio, valid),
      "log_ratio/min": masked_min(log_ratio, valid),
      "clip/frac_upper": frac(above),
      "clip/frac_lower": frac(below),
      "clip/frac_upper_pos_adv": frac(above & pos),
      "clip/frac_upper_neg_adv": frac(above & neg),
      "clip/frac_lower_pos_adv": frac(below & pos),
      "clip/frac_lower_neg_adv": frac(below & neg),
  }
