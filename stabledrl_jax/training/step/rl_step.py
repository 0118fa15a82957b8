"""One RL step as one function (docs/training.md, "One RL step"), read top to bottom:

1. rollouts of the step's prompts from pi_old (the state's parameters), scored on the host;
2. l_old under pi_old and l_ref under the start of RL, where the run has them;
3. ``train.num_iterations`` updates, fresh masks each;
4. the objective's state (StableDRL's adaptive clip bound) moved once.

``rl_step(parts, fns, state, drawn, key) -> (state, outputs)`` returns the new state; the
trainer's loop around it evaluates, logs, checkpoints and answers signals. Its metrics are the
caller's: ``outputs`` holds the rollouts and each update's metrics on the devices.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from stabledrl_jax.models import lora as lora_lib
from stabledrl_jax.training.config import run_spec
from stabledrl_jax.training.step import build, rollout as rollout_lib, train_step

# Folded into the step key for the stress selection, so that the other keys stay as they were.
STRESS_KEY = 0x57e55


@dataclasses.dataclass(frozen=True)
class StepFunctions:
  """The jitted functions of a run's RL step, built once by ``step_functions``.

  Attributes:
    collect: the host half (``rollout.RolloutCollector``): sample, decode, score.
    update: one inner update, ``(state, batch, key) -> (state, metrics)``, state donated.
    estimate: l(params) without gradient, ``(params, batch, key, stress_mode=None)``.
    estimate_sequence: the same as sequence sums (``diagnostics.kl_to_start``), else None.
    advance_objective_state: the objective's state after a step's updates.
    start_params: the start of RL, kept where a KL term or kl_to_start needs it (without
      LoRA; with LoRA the start is the base, the adapters off), else None.
    num_iterations: inner updates per step (``train.num_iterations``).
  """

  collect: rollout_lib.RolloutCollector
  update: Callable[..., Any]
  estimate: Callable[..., Any]
  estimate_sequence: Callable[..., Any] | None
  advance_objective_state: Callable[..., Any]
  adapters_off: Callable[..., Any]
  start_params: Any
  num_iterations: int


@dataclasses.dataclass(frozen=True)
class StepOutputs:
  """What one RL step leaves for the trainer's metrics.

  Attributes:
    rollouts: the step's rollouts (``rollout.Rollouts``).
    inner: each update's metrics, on the devices (``train_step.update_step``'s).
    num_scorings: scoring passes run per model (l_old and l_ref), for the FLOP count.
    kl_start: mean(l_old - l_start) in nats per sequence (``diagnostics.kl_to_start``), else
      None.
    likelihood_seconds: wall time of the scoring passes (l_old, l_ref, kl_to_start's), until
      their results are ready.
    update_seconds: wall time of the updates, until the last one's results are ready.
  """

  rollouts: rollout_lib.Rollouts
  inner: list[dict[str, jax.Array]]
  num_scorings: int
  kl_start: jax.Array | None
  likelihood_seconds: float = 0.0
  update_seconds: float = 0.0


def scoring(parts: build.Parts, run: run_spec.RunSpec):
  """jit(``train_step.estimate_no_grad``) of ``run``: (params, batch, key, stress_mode=None);
  memoized on the parts' model signature (no optimizer changes it) and ``run``."""
  microbatches = train_step.microbatch_sharding(parts.batch_sharding)
  return build.memoized(("scoring", parts.signature[0], run), lambda: jax.jit(
      train_step.traced_under(
          parts.mesh, lambda params, batch, key, stress_mode=None: train_step.estimate_no_grad(
              params, batch, key, graphdef=parts.graphdef, run=run, stress_mode=stress_mode,
              microbatch_sharding=microbatches)), static_argnames="stress_mode"))


def step_functions(parts: build.Parts, collect: rollout_lib.RolloutCollector, *,
                   num_iterations: int, kl_to_start: bool, start_params: Any) -> StepFunctions:
  """The jitted functions of ``parts``' RL step (memoized on the parts: ``build.memoized``)."""
  run = parts.run
  # kl_start/mean is a sequence log-likelihood gap whatever the objective's normalization.
  # Without dropout: the diagnostic compares two models, not two noisy passes.
  sequence = dataclasses.replace(run, likelihood=dataclasses.replace(run.likelihood,
                                                                     normalize="sum"),
                                 lora_dropout_every_pass=False)
  advance = build.memoized(("advance", parts.signature[0]), lambda: jax.jit(
      lambda objective_state, inner: train_step.advance_objective_state(
          objective_state, inner, run=run),
      out_shardings=parts.state_shardings.objective_state))
  return StepFunctions(
      collect=collect, update=build.make_update(parts), estimate=scoring(parts, run),
      estimate_sequence=scoring(parts, sequence) if kl_to_start else None,
      advance_objective_state=advance, adapters_off=_adapters_off,
      start_params=start_params, num_iterations=num_iterations)


def abstract_programs(config: Any, devices=None) -> dict[str, tuple[Callable[..., Any],
                                                                     tuple[Any, ...],
                                                                     dict[str, Any]]]:
  """Every jitted program of ``config``'s RL step but the sampler's (``tpu_compile``
  compiles that one), as {name: (jitted function, abstract args, keywords)}: the update, and
  the scoring passes the step runs before it: l_old ('score_old', the stress test's 'hard'
  masks where it is on), l_ref ('score_ref') and kl_to_start's ('score_sequence'). Nothing is
  allocated (``build.abstract_parts``); ``fn.lower(*args, **keywords).compile()`` each."""
  parts, state, batch, key = build.abstract_parts(config, devices)
  run = parts.run
  programs = {"update": (build.make_update(parts), (state, batch, key), {})}
  estimate = scoring(parts, run)
  if run.needs_old:
    programs["score_old"] = (estimate, (state.params, batch, key), {"stress_mode": "hard"})
  if run.uses_reference:
    programs["score_ref"] = (estimate, (state.params, batch, key), {})
  if config.diagnostics.get("kl_to_start", False):
    sequence = dataclasses.replace(run, likelihood=dataclasses.replace(run.likelihood,
                                                                       normalize="sum"))
    programs["score_sequence"] = (scoring(parts, sequence), (state.params, batch, key), {})
  return programs


def rl_step(parts: build.Parts, fns: StepFunctions, state: train_step.TrainState,
            drawn: list[Any], key: jax.Array, *, num_samples: int = 0
            ) -> tuple[train_step.TrainState, StepOutputs]:
  """One RL step on the step's global batch of examples ``drawn``, with the step's ``key``
  (``fold_in(run key, step)``); ``num_samples`` rollouts decoded for the log. Returns the state
  after it (the step counted) and its outputs."""
  run = parts.run
  key_rollout, key_old, key_inner = jax.random.split(key, 3)
  inner_keys = list(jax.random.split(key_inner, fns.num_iterations))
  rollouts = fns.collect(state.params, drawn, key_rollout, jax.random.fold_in(key, STRESS_KEY),
                         num_samples=num_samples)
  batch = rollouts.batch
  start = None
  if run.uses_reference or fns.estimate_sequence is not None:
    start = fns.adapters_off(state.params) if run.lora else fns.start_params

  scoring_start = time.perf_counter()
  # l_old and l_ref. Coupled (d1, ESPO): on each update's own masks, before any update.
  # Independent (StableDRL): once, on masks of their own, so that at the first update the
  # ratio is pure estimator noise.
  keys, repeat = (inner_keys, 1) if run.coupled_ratio else ([key_old], len(inner_keys))
  old = ref = None
  if run.needs_old:
    old = [fns.estimate(state.params, batch, k, "hard") for k in keys] * repeat
  if run.uses_reference:
    ref = [fns.estimate(start, batch, k) for k in keys] * repeat
  num_scorings = len(keys) * ((old is not None) + (ref is not None))
  kl_start = None
  if fns.estimate_sequence is not None:  # KL(pi_old || pi_start), on pi_old's own rollouts.
    kl_start = _mean_sequence_gap(fns.estimate_sequence(state.params, batch, key_old),
                                  fns.estimate_sequence(start, batch, key_old),
                                  batch.completion_mask)
  # Timed to their results (the updates wait for them anyway): the step's time split.
  jax.block_until_ready((old, ref, kl_start))
  update_start = time.perf_counter()

  inner = []
  for i, inner_key in enumerate(inner_keys):
    if old is not None:
      batch = batch.replace(old_logp=old[i])
    if ref is not None:
      batch = batch.replace(ref_logp=ref[i])
    state, metrics = fns.update(state, batch, inner_key)
    inner.append(metrics)
  jax.block_until_ready((state.params, inner))
  update_end = time.perf_counter()

  state = state.replace(
      # A host value placed on the mesh: global on every process.
      step=jax.device_put(np.int32(int(state.step) + 1), parts.state_shardings.step),
      objective_state=fns.advance_objective_state(state.objective_state, inner))
  return state, StepOutputs(rollouts=rollouts, inner=inner, num_scorings=num_scorings,
                            kl_start=kl_start,
                            likelihood_seconds=update_start - scoring_start,
                            update_seconds=update_end - update_start)


_adapters_off = jax.jit(lora_lib.adapters_off)


@jax.jit
def _mean_sequence_gap(now: jax.Array, start: jax.Array, completion_mask: jax.Array) -> jax.Array:
  """mean over rows of now - start: [N] sequence estimates, or [N, L] token ones (summed over
  the completion). Both on the same masks, so their noise largely cancels: an estimate of
  KL(pi_old || pi_start) in nats per sequence, the rollouts being pi_old's own samples."""
  gap = now - start
  if gap.ndim == 2:
    gap = jnp.sum(jnp.where(completion_mask, gap, 0.0), axis=-1)
  return jnp.mean(gap)

