"""What the host logs of an RL step (docs/diagnostics.md): the inner updates' metrics reduced,
the ratio noise, gradient spikes (recorded with their rollouts), the rollouts' statistics, the
schedule, time and throughput.

``StepLog.metrics`` reads the step's outputs (``rl_step.StepOutputs``) once they are on the host;
it launches no computation on global arrays except the gather of a spike's rows, which every
process enters (the metrics are replicated, so every process takes that branch).
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

import jax
import numpy as np
from absl import logging
from etils import epath

from stabledrl_jax import models, profiling
from stabledrl_jax.training.config import run_spec
from stabledrl_jax.training.inputs import data
from stabledrl_jax.training.loop import spikes
from stabledrl_jax.training.parallel import multihost
from stabledrl_jax.training.step import build, rl_step as rl_step_lib, rollout as rollout_lib
from stabledrl_jax.training.step import train_step


class StepLog:
  """The per-run constants of a step's metrics and the spike detector's history."""

  def __init__(self, loop: run_spec.LoopSpec, parts: build.Parts,
               split: multihost.RowSplit, tokenizer: Any, workdir: epath.Path,
               term_names: Sequence[str]):
    self.loop, self.parts, self.split = loop, parts, split
    self.tokenizer, self.workdir, self.term_names = tokenizer, workdir, list(term_names)
    self.primary = multihost.is_primary()
    self.num_params = models.count_params(parts.model_config)
    mesh = parts.mesh
    peak = (loop.peak_tflops_per_device * 1e12
            or profiling.peak_flops_per_device(mesh.devices.flat[0]))
    self.peak_flops = peak * mesh.devices.size if peak else None
    self.spikes = spikes.SpikeDetector(loop.spike_factor, loop.spike_window,
                                       loop.spike_min_history)

  def metrics(self, step: int, out: rl_step_lib.StepOutputs, state: train_step.TrainState, *,
              start: float) -> dict[str, Any]:
    """RL step ``step``'s metrics (0-based; ``state`` after it), timed from ``start``
    (``time.perf_counter``)."""
    rollouts = out.rollouts
    inner = jax.device_get(out.inner)
    per_sample = {name: np.stack([m.pop(name) for m in inner]) for name in list(inner[0])
                  if name.startswith(train_step.PER_SAMPLE)}  # [I, N] each.
    metrics = train_step.reduce_metrics(jax.tree.map(lambda *xs: np.stack(xs), *inner))
    metrics = {k: float(v) for k, v in metrics.items()}
    metrics.update(ratio_noise([float(m["log_ratio/var"]) for m in inner
                                if "log_ratio/var" in m]))
    if out.kl_start is not None:
      metrics["kl_start/mean"] = float(out.kl_start)
    metrics.update(self._spike_metrics(step + 1, inner, per_sample, rollouts))
    metrics.update(self._step_metrics(step, out, state, elapsed=time.perf_counter() - start))
    return metrics

  def _spike_metrics(self, step: int, inner: list[dict[str, Any]],
                     per_sample: dict[str, np.ndarray], rollouts: rollout_lib.Rollouts
                     ) -> dict[str, float]:
    """Checks step ``step``'s gradient norms for a spike; records it (``_record_spike``)."""
    reason, norm, median = self.spikes.check(
        np.asarray([m["grad_norm"] for m in inner]),
        skipped=any(int(m["skipped"]) for m in inner))
    if reason is None:
      return {}
    self._record_spike(step, reason, inner, per_sample, rollouts, median)
    out = {"spike/step": step}
    if median > 0 and math.isfinite(norm):  # Not for a non-finite step, nor before history.
      out["spike/grad_norm_over_median"] = norm / median
    return out

  def _step_metrics(self, step: int, out: rl_step_lib.StepOutputs, state: train_step.TrainState,
                    *, elapsed: float) -> dict[str, float]:
    """The rollouts' statistics, the schedule, skips, time (and its split: sampling, host
    scoring, likelihood scoring, updates) and throughput of step ``step``."""
    rollouts, num_scorings = out.rollouts, out.num_scorings
    r, num_iterations = self.parts.rollout, self.loop.num_iterations
    num_rows = self.split.num_rows
    length = r.prompt_length + r.gen_length
    flops = profiling.rl_step_flops(
        self.num_params, rollout_positions=float(rollouts.stats.model_calls.sum()) * length,
        scored_positions=num_rows * self.parts.run.likelihood.num_samples * length,
        num_updates=num_iterations,
        num_scorings=num_scorings)  # passes run, not reused
    updates_done = (step + 1) * num_iterations
    return {
        **rollouts.stats.metrics(self.term_names, r.group_size),
        "learning_rate": float(self.parts.optimizer.lr_schedule(updates_done - 1)),
        "skipped_steps": int(state.skipped_steps),
        "time/step_s": elapsed, "time/rollout_s": rollouts.seconds,
        "time/reward_s": rollouts.reward_seconds, "time/likelihood_s": out.likelihood_seconds,
        "time/update_s": out.update_seconds,
        # Generated positions per model call of the sampler (1 / step for exact decoding).
        "rollout/tokens_per_call": r.gen_length / max(float(rollouts.stats.model_calls.mean()),
                                                      1.0),
        "throughput/tokens_per_s": num_rows * r.gen_length / elapsed,
        "perf/tflops_per_s": flops / elapsed / 1e12,
        **({"perf/mfu": flops / elapsed / self.peak_flops} if self.peak_flops else {}),
    }

  def _record_spike(self, step: int, reason: str, inner: list[dict[str, Any]],
                    per_sample: dict[str, np.ndarray], rollouts: rollout_lib.Rollouts,
                    median: float) -> None:
    """Writes ``<workdir>/spikes/step_<step>.npz`` (``spikes.SPIKE_FIELDS``) on process 0, with
    every process's rows (gathered: a collective every process enters)."""
    prompt_length = self.parts.rollout.prompt_length
    tokens, stressed = rollouts.tokens, rollouts.stressed
    gathered = multihost.gather_rows(np.column_stack(
        [tokens, rollouts.advantages[:, None], np.zeros((len(tokens), 1)) if stressed is None
         else stressed[:, None]]).astype(np.float64), self.split)
    if not self.primary:
      return
    all_tokens = gathered[:, :tokens.shape[1]].astype(np.int64)
    path = spikes.write_spike(self.workdir, step, {
        "step": step, "reason": reason, "median": median,
        "factor": self.loop.spike_factor,
        "grad_norm": np.asarray([float(m["grad_norm"]) for m in inner]),
        "prompts": np.asarray(data.decode_completions(self.tokenizer,
                                                      all_tokens[:, :prompt_length])),
        "completions": np.asarray(data.decode_completions(self.tokenizer,
                                                          all_tokens[:, prompt_length:])),
        "rewards": rollouts.stats.rewards, "advantages": gathered[:, -2],
        "stressed": gathered[:, -1] > 0,
        **per_sample})
    logging.warning("Step %d: %s spike (gradient norms %s, median %.4g); its rollouts are in %s",
                    step, reason, [f"{float(m['grad_norm']):.4g}" for m in inner], median, path)


def ratio_noise(variances: list[float]) -> dict[str, float]:
  """How much of log rho's spread is estimator noise, from its variance over the batch on each
  inner update (``log_ratio/var``).

  On the first update the policy is pi_old: log rho is pure estimator noise (exactly 0 for
  coupled masks), so ``ratio_noise/share`` = var(first) / var(last), capped at 1, is the share
  of the last update's variance that noise explains (1 with one update per step).
  """
  if not variances or not variances[-1] > 0:
    return {}
  return {"ratio_noise/var_first": variances[0],
          "ratio_noise/share": min(1.0, variances[0] / variances[-1])}


def progress_fields(metrics: dict[str, Any]) -> dict[str, str]:
  """What the progress bar shows of a step: its mean reward, time, and the time's split
  (rollout / reward / likelihood / update seconds)."""
  parts = ("rollout", "reward", "likelihood", "update")
  return {"reward": f"{metrics['rewards/mean']:.3f}", "step_s": f"{metrics['time/step_s']:.2f}",
          "split_s": "/".join(f"{metrics[f'time/{part}_s']:.2f}" for part in parts)}
