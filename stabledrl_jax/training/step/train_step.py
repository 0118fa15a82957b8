"""The jitted parameter update: gradient accumulation over whole groups, skip on non-finite.

``make_update_fn`` returns ``update(state, batch, key) -> (state, metrics)``, a
pure function of pytrees, jitted with the state donated and explicit output
shardings. An update whose loss, gradient, update or new parameters are not all finite leaves
parameters and optimizer state untouched and increments ``skipped_steps``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from stabledrl_jax.models import lora as lora_lib
from stabledrl_jax.training.config import run_spec
from stabledrl_jax.training.step import rl_loss

Array = jax.Array


@flax.struct.dataclass
class TrainState:
  """Everything an update changes (and a checkpoint restores).

  Attributes:
    step: RL steps completed.
    params: the model's nnx.Param state (with LoRA: the frozen base and the adapters).
    opt_state: optax state of the trained parameters (``trained``: all, or the adapters).
    key: [2] uint32 raw PRNG key data of the run (``jax.random.wrap_key_data``).
    skipped_steps: updates skipped (non-finite loss, gradient, update or parameters), in total.
    consecutive_skips: updates skipped in a row, up to the latest.
    objective_state: the objective's state (``Objective.init_state``: StableDRL's clip bound),
      {} for a stateless objective; ``advance_objective_state`` moves it once per RL step.
  """

  step: Array
  params: Any
  opt_state: Any
  key: Array
  skipped_steps: Array
  consecutive_skips: Array
  objective_state: Any


def trained(params: Any, lora: bool = False) -> Any:
  """What the optimizer updates of ``params``: all of them, or with ``lora`` the adapters."""
  return lora_lib.split(params)[0] if lora else params


def create_train_state(params: Any, tx: optax.GradientTransformation, seed: int,
                       objective_state: Any = None, lora: bool = False) -> TrainState:
  """A fresh state; ``objective_state`` the objective's initial one (None: {}, stateless);
  ``lora``: the optimizer holds the adapters only."""
  return TrainState(
      step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(trained(params, lora)),
      key=jax.random.key_data(jax.random.key(seed)), skipped_steps=jnp.zeros((), jnp.int32),
      consecutive_skips=jnp.zeros((), jnp.int32),
      objective_state={} if objective_state is None else objective_state)


def state_shardings(tx: optax.GradientTransformation, params: Any, param_shardings: Any,
                    replicated: jax.sharding.Sharding, objective_state: Any = None,
                    lora: bool = False) -> TrainState:
  """Shardings of the ``TrainState`` of ``params`` (concrete or abstract).

  Optimizer-state leaves shaped like the parameters (Adam's moments) take their parameter's
  sharding; counts, the step, the key and the counters are replicated. Jitting
  ``create_train_state`` without them leaves the moments replicated, since XLA's propagation
  does not reach ``zeros_like(params)`` (no data dependence): every device would hold all of
  them (30 GiB for LLaDA-8B in bf16) instead of its shards.
  """
  abstract = jax.eval_shape(lambda p: create_train_state(p, tx, 0, lora=lora), params)
  objective_state = jax.tree.map(lambda _: replicated, {} if objective_state is None
                                 else objective_state)
  opt_state = optax.tree_map_params(tx, lambda _, sharding: sharding, abstract.opt_state,
                                    trained(param_shardings, lora),
                                    transform_non_params=lambda _: replicated)
  return TrainState(step=replicated, params=param_shardings, opt_state=opt_state,
                    key=replicated, skipped_steps=replicated, consecutive_skips=replicated,
                    objective_state=objective_state)


def _split_microbatches(batch: rl_loss.RolloutBatch, num_microbatches: int,
                        group_size: int) -> rl_loss.RolloutBatch:
  """[N, ...] -> [M, N / M, ...], microbatch m holding groups m, m + M, m + 2M, ...

  Interleaving keeps every group whole and, with the batch sharded over
  devices by contiguous groups, leaves each device its own rows.
  """

  def split(x):
    groups = x.reshape((-1, num_microbatches, group_size) + x.shape[1:])
    return jnp.swapaxes(groups, 0, 1).reshape((num_microbatches, -1) + x.shape[1:])

  return jax.tree.map(split, batch)


def microbatch_sharding(batch_sharding: Any) -> jax.sharding.NamedSharding | None:
  """[M, N / M, ...] microbatches with each microbatch's rows split like the batch's rows.

  Without it, a microbatch with fewer groups than devices (the paper's one group per microbatch
  on 8 devices) lives on the devices that held its groups, and XLA replicates it: every device
  computes every microbatch. Given this sharding, XLA moves the (small) token arrays instead.
  None (no constraint) for anything but one `NamedSharding` of the whole batch.
  """
  if not isinstance(batch_sharding, jax.sharding.NamedSharding):
    return None
  return jax.sharding.NamedSharding(batch_sharding.mesh,
                                    jax.sharding.PartitionSpec(None, *batch_sharding.spec))


def _constrain(tree: Any, sharding: jax.sharding.NamedSharding | None) -> Any:
  if sharding is None:
    return tree
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding), tree)


def _in_loop(params: Any, loop_variant: Any) -> Any:
  """``params``, tied to a value that changes every iteration of the microbatch loop.

  The parameters are loop invariants, so XLA hoists what it computes from them alone out of the
  loop: with FSDP, the all-gathers of every layer's kernels, which then all stay live for the
  whole loop (the full unsharded model on every device, 28 GiB for LLaDA-8B as the CPU backend
  upcasts it) instead of one layer at a time. The barrier makes them depend on the iteration.
  """
  return jax.lax.optimization_barrier((params, loop_variant))[0]


def _merge_microbatches(x: Array, num_microbatches: int, group_size: int) -> Array:
  """Inverse of ``_split_microbatches``: [M, N / M, ...] -> [N, ...] in the batch's order."""
  groups = x.reshape((num_microbatches, -1, group_size) + x.shape[2:])
  return jnp.swapaxes(groups, 0, 1).reshape((-1,) + x.shape[2:])


PER_SAMPLE = "per_sample/"
# fold_in(microbatch key, _DROPOUT_STREAM): the LoRA dropout masks, apart from the estimator's;
# l_old's (model.lora.dropout_passes='every') from a stream of their own, so that a coupled ratio
# (l_old on the update's key) draws its dropout masks apart from the update's, as two passes do.
_DROPOUT_STREAM = 0x10DA
_OLD_DROPOUT_STREAM = 0x01DD


def reduce_metrics(stacked: dict[str, Array]) -> dict[str, Array]:
  """Microbatch metrics [M] -> scalars: max of '/max' metrics, min of '/min', else mean.

  ``per_sample/`` entries are not metrics and are left out (``update_step`` merges them)."""
  out = {}
  for name, value in stacked.items():
    if name.startswith(PER_SAMPLE):
      continue
    if name.endswith("max"):
      out[name] = jnp.max(value)
    elif name.endswith("min"):
      out[name] = jnp.min(value)
    else:
      out[name] = jnp.mean(value)
  return out


def update_step(state: TrainState, batch: rl_loss.RolloutBatch, key: Array, *, graphdef: Any,
                tx: optax.GradientTransformation, run: run_spec.RunSpec,
                microbatch_sharding: jax.sharding.NamedSharding | None = None
                ) -> tuple[TrainState, dict[str, Array]]:
  """One optimizer update on a rollout batch with fresh estimator masks from ``key``.

  ``run`` says everything static: the objective and its hyperparameters, the likelihood spec,
  the group size, the microbatches (the update compiles for its values). With
  ``run.gradient_bound`` (StableDRL only) it also logs ``grad_bound/max``, max_j |A_j|
  ||grad s_j||, and ``grad_norm_over_bound/max``, which the convex-hull property keeps <= 1
  (and ``per_sample/grad_norm``, ||grad s_j||). ``microbatch_sharding``: see
  ``microbatch_sharding()``.

  Returns:
    (new state, metrics): scalars, and ``per_sample/<name>`` [N] arrays in the batch's order
    (log ratios, weights: what the spike recorder keeps).
  """
  grads, metrics = _gradients(state, batch, key, graphdef=graphdef, run=run,
                              microbatch_sharding=microbatch_sharding)
  return _apply_update(state, grads, metrics, tx=tx, run=run)


def _gradients(state: TrainState, batch: rl_loss.RolloutBatch, key: Array, *, graphdef: Any,
               run: run_spec.RunSpec,
               microbatch_sharding: jax.sharding.NamedSharding | None
               ) -> tuple[Any, dict[str, Array]]:
  """The mean gradient of the objective over the batch's microbatches (of the trained
  parameters: all, or the LoRA adapters), and the update's metrics before the optimizer (with
  ``run.gradient_bound``, the convex-hull bound)."""
  spec, num_microbatches, group_size = run.likelihood, run.num_microbatches, run.group_size
  # The gradient is of the trained parameters (all, or the LoRA adapters); a frozen base is
  # closed over, never differentiated (no weight gradient is computed for it).
  split = lora_lib.split if run.lora else lambda params: (params, None)
  join = lora_lib.join if run.lora else lambda trained_params, frozen: trained_params

  def model_of(trained_params, frozen, micro_key):
    """The model the gradient is of: with a LoRA run's dropout, drawn per microbatch."""
    return lora_lib.with_dropout(nnx.merge(graphdef, join(trained_params, frozen)),
                                 jax.random.fold_in(micro_key, _DROPOUT_STREAM), run.lora_dropout)

  def loss_fn(trained_params, frozen, micro, micro_key):
    logits_fn = rl_loss.model_logits_fn(model_of(trained_params, frozen, micro_key),
                                        micro.attention_mask)
    return rl_loss.objective_loss(logits_fn, micro, micro_key,
                                  spec=spec, objective=run.objective, hparams=run.hparams,
                                  group_size=group_size, gen_length=run.gen_length,
                                  use_reference=run.uses_reference,
                                  objective_state=state.objective_state)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  micro = _constrain(_split_microbatches(batch, num_microbatches, group_size),
                     microbatch_sharding)
  keys = jax.random.split(key, num_microbatches)

  def accumulate(grads, inputs, params):
    mb, mb_key = inputs
    trained_params, frozen = split(params)
    (_, metrics), mb_grads = grad_fn(trained_params, frozen, mb, mb_key)
    if run.gradient_bound:
      logits_fn_of = lambda t, mask: rl_loss.model_logits_fn(model_of(t, frozen, mb_key), mask)
      norms = rl_loss.surrogate_gradient_norms(
          logits_fn_of, trained_params, mb, mb_key, spec=spec,
          surrogate=lambda inputs: run.registered.surrogate(inputs, run.hparams))
      metrics["grad_bound/max"] = jnp.max(jnp.abs(mb.advantages) * norms)
      metrics[PER_SAMPLE + "grad_norm"] = norms
    grads = jax.tree.map(lambda a, g: a + g / num_microbatches, grads, mb_grads)
    return grads, metrics

  zeros = jax.tree.map(jnp.zeros_like, split(state.params)[0])
  if num_microbatches == 1:
    # One microbatch (the default): no loop and no zero-initialized accumulator, whose carry XLA
    # would copy and add to, one pass over the gradients each.
    grads, metrics = accumulate(zeros, jax.tree.map(lambda x: x[0], (micro, keys)),
                                state.params)
    stacked = jax.tree.map(lambda x: x[None], metrics)
  else:
    grads, stacked = jax.lax.scan(
        lambda g, inputs: accumulate(g, inputs, _in_loop(state.params, g)), zeros,
        (micro, keys))
  metrics = reduce_metrics(stacked)
  metrics.update({name: _merge_microbatches(value, num_microbatches, group_size)
                  for name, value in stacked.items() if name.startswith(PER_SAMPLE)})
  if "log_ratio/max" in metrics:
    metrics["log10_ratio/max"] = metrics["log_ratio/max"] / math.log(10.0)
  return grads, metrics


def _apply_update(state: TrainState, grads: Any, metrics: dict[str, Array], *,
                  tx: optax.GradientTransformation, run: run_spec.RunSpec
                  ) -> tuple[TrainState, dict[str, Array]]:
  """The optimizer's update of the trained parameters by ``grads``, kept only if everything
  it produces is finite (else the state stays, and the skip is counted); ``metrics`` gain the
  gradient and update norms and whether it was skipped."""
  split = lora_lib.split if run.lora else lambda params: (params, None)
  join = lora_lib.join if run.lora else lambda trained_params, frozen: trained_params
  grad_norm = optax.tree.norm(grads)
  if run.gradient_bound:  # The mean of the microbatch gradients is bounded by their largest.
    bound = metrics["grad_bound/max"]
    # A zero bound (all advantages 0) allows only a zero gradient: 0 / 0 counts as 0, not NaN.
    metrics["grad_norm_over_bound/max"] = jnp.where(
        bound > 0, grad_norm / jnp.where(bound > 0, bound, 1.0),
        jnp.where(grad_norm > 0, jnp.inf, 0.0))
  finite_grad = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
  # Zero non-finite gradients before the optimizer so that its state stays finite
  # even in the branch that is discarded.
  safe_grads = jax.tree.map(lambda g: jnp.where(finite_grad, g, 0.0), grads)
  trained_params, frozen = split(state.params)
  updates, new_opt_state = tx.update(safe_grads, state.opt_state, trained_params)
  new_trained = optax.apply_updates(trained_params, updates)
  new_params = join(new_trained, frozen)
  update_norm = optax.tree.norm(updates)
  # An update is kept only if everything it produces is finite: the loss, the gradient, the
  # update and the new parameters (an infinite learning rate gives finite gradients and NaN
  # parameters), so that no poisoned state is ever kept or checkpointed.
  finite = finite_grad & jnp.isfinite(update_norm) & _all_finite(new_trained)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  skipped = (~finite).astype(jnp.int32)
  new_state = state.replace(
      params=keep(new_params, state.params), opt_state=keep(new_opt_state, state.opt_state),
      skipped_steps=state.skipped_steps + skipped,
      consecutive_skips=jnp.where(finite, 0, state.consecutive_skips + 1))
  metrics.update({
      "grad_norm": grad_norm,
      # The rejected update's norm too (inf or NaN), so that the log shows why it was skipped.
      "update_norm": update_norm,
      "skipped": skipped,
  })
  return new_state, metrics


def advance_objective_state(objective_state: Any, inner_metrics: list[dict[str, Array]], *,
                            run: run_spec.RunSpec) -> Any:
  """The objective's state for the next RL step (``Objective.update_state``), from the metrics
  of this step's updates (``update_step``'s, one dict per update; reduced like the step's log).
  Pure: jitted by the trainer, so the state never leaves the devices."""
  registered = run.registered
  if registered.update_state is None:
    return objective_state
  scalars = [{k: v for k, v in m.items() if not k.startswith(PER_SAMPLE)} for m in inner_metrics]
  metrics = reduce_metrics(jax.tree.map(lambda *xs: jnp.stack(xs), *scalars))
  return registered.update_state(objective_state, metrics, run.hparams)


def _all_finite(tree: Any) -> Array:
  """Whether every element of every array of ``tree`` is finite (a scalar bool)."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def traced_under(mesh: jax.sharding.Mesh, fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` traced with ``mesh`` as the abstract mesh, so that the model's activation
  constraints (``models.sharding.constrain``) apply when it is jitted."""

  @functools.wraps(fn)
  def traced(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args, **kwargs)

  return traced


def make_update_fn(graphdef: Any, tx: optax.GradientTransformation, *,
                   state_shardings: Any, batch_shardings: Any,
                   replicated: jax.sharding.NamedSharding,
                   **static) -> Callable[..., tuple[TrainState, dict[str, Array]]]:
  """jit(update_step) with the state donated and its shardings pinned, traced under their mesh."""
  fn = functools.partial(update_step, graphdef=graphdef, tx=tx,
                         microbatch_sharding=microbatch_sharding(batch_shardings), **static)
  return jax.jit(traced_under(replicated.mesh, fn), donate_argnums=(0,),
                 in_shardings=(state_shardings, batch_shardings, replicated),
                 out_shardings=(state_shardings, replicated))


def estimate_no_grad(params: Any, batch: rl_loss.RolloutBatch, key: Array, *, graphdef: Any,
                     run: run_spec.RunSpec, stress_mode: str | None = None,
                     microbatch_sharding: jax.sharding.NamedSharding | None = None) -> Array:
  """l_old (stress test: ``stress_mode='hard'``) or l_ref: estimates under fixed parameters.

  Runs over the same microbatches with the same keys as ``update_step``, so that the same
  ``key`` gives the same masks (the coupled ratio), and so that memory stays per microbatch.
  """
  spec, num_microbatches, group_size = run.likelihood, run.num_microbatches, run.group_size
  micro = _constrain(_split_microbatches(batch, num_microbatches, group_size),
                     microbatch_sharding)
  keys = jax.random.split(key, num_microbatches)

  def one(inputs):
    mb, mb_key = inputs
    model = nnx.merge(graphdef, _in_loop(params, mb_key))
    if run.lora_dropout_every_pass:  # As the official trainers score l_old: in train mode.
      model = lora_lib.with_dropout(model, jax.random.fold_in(mb_key, _OLD_DROPOUT_STREAM),
                                    run.lora_dropout)
    logp, _ = rl_loss.estimate(rl_loss.model_logits_fn(model, mb.attention_mask), mb, mb_key,
                               spec, stress_mode=stress_mode)
    return logp

  logp = jax.lax.map(one, (micro, keys))
  return jax.lax.stop_gradient(_merge_microbatches(logp, num_microbatches, group_size))
