r"""Stress test (docs/stress_test.md): does each objective survive exploding importance ratios?

  python experiments/stress_test.py --config configs/stress_test.py --workdir runs/stress_test

Fits the supervised start once (``<workdir>/sft``), then trains every objective from it with the
same seed and data, once normally and once with ``--fraction`` of the samples given "easy"
numerator and "hard" denominator masks (``estimator.stress``). Each runs with its official mask
coupling (``estimator.coupled_ratio`` unset: StableDRL scores l_old on masks of its own, GRPO
and ESPO on each update's own); with ``--other_coupling`` (default) each objective that has a
ratio runs again with the other one (StableDRL ``normal_coupled``, ``stress_coupled``: l_old on
the update's own masks, which removes the estimator's ratio noise; GRPO and ESPO
``normal_independent``, ``stress_independent``: l_old on masks of its own, which adds it). SPG
and wd1 have no ratio, so no l_old to couple. A frozen policy (``frozen/normal``: StableDRL at learning rate 1e-12)
on the same batches is the control: its reward moves with the batches alone. Any config field
can be overridden as usual (``--config.model.family=sdar``, ``--config.train.num_steps=20``).
Runs already finished in ``--workdir`` with the same config are read back, not trained again.

Writes ``<workdir>/summary.json``:

  {"<objective>/<condition>": {"grad_norm_mean", "grad_norm_max", "explosion_rate",
                               "final_reward", "reward_sd", "eval_start", "eval_final",
                               "max_log10_ratio", ...}}

with condition ``normal`` or ``stress``, each optionally ``_coupled`` or ``_independent``:

- ``grad_norm``: the pre-clip global gradient norm of each step (the mean over its inner
  iterations; a non-finite norm counts as exploded and is left out of mean and max);
- ``explosion_rate``: the fraction of steps whose norm exceeds the objective's own threshold,
  ``--explosion_factor`` x the median norm of its normal run (``explosion_threshold``);
- ``final_reward``: the mean rollout correctness reward (the task's own, without StableDRL's
  anti-short-boxed term) of the last ``--final_steps`` steps, and ``reward_sd`` the standard
  deviation of those steps' rewards (the batches' own spread: the frozen control's is what a
  policy that learns nothing shows);
- ``eval_start``, ``eval_final``: greedy ``eval/accuracy`` (percent of blanks right on the
  held-out puzzles) before the first step and after the last: no batch noise, so a gain of a few
  points is visible where the reward's spread hides it;
- ``max_log10_ratio``: the largest log10 rho the objective saw (None without a ratio; StableDRL's
  is its length-normalized ratio, as the paper defines it);
- for StableDRL, ``bound_ratio_max``: the largest ||grad|| / (max_j |A_j| ||grad s_j||) over all
  updates, which its convex-hull property keeps <= 1, and ``ess_min``, the smallest per-group
  effective sample size of its weights; ``clipped_fraction_mean`` (the share of ratios its clip
  bound touched) and the bound ``max_ratio_{first,last,min,max}`` (fixed, or the adaptive clip's:
  docs/diagnostics.md).

Also draws ``<workdir>/stress_test.png`` (gradient norm and reward against step) and prints the
table in Markdown.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/stress_test.py",
                                          "Path to a get_config() file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.", required=True)
_FRACTION = flags.DEFINE_float("fraction", 0.7, "Stressed fraction f of the samples.")
_EXPLOSION_FACTOR = flags.DEFINE_float(
    "explosion_factor", 10.0, "An objective's explosion threshold is this x the median "
    "gradient norm of its own normal run.")
_FINAL_STEPS = flags.DEFINE_integer("final_steps", 5,
                                    "final_reward averages the last this many steps.")
_OBJECTIVES = flags.DEFINE_list("objectives", None,
                                "Objectives to run (default: all of sweep.objective_variants()).")
_OTHER_COUPLING = flags.DEFINE_bool(
    "other_coupling", True, "Also run each objective that has a ratio with the other mask "
    "coupling than its official one (estimator.coupled_ratio), normally and stressed.")
_FROZEN = flags.DEFINE_bool("frozen", True, "Also run the frozen-policy control.")
_SUMMARIZE_ONLY = flags.DEFINE_bool(
    "summarize_only", False, "Train nothing: summarize the runs already in --workdir (e.g. "
    "with another --explosion_factor or --final_steps).")

OFFICIAL = ("normal", "stress")
FROZEN = "frozen/normal"
FROZEN_LEARNING_RATE = 1e-12


def other_coupling(base, name: str) -> str | None:
  """'coupled' or 'independent': the mask coupling that objective variant ``name`` does not use
  officially; None for an objective without l_old (SPG, wd1: no ratio)."""
  from stabledrl_jax import objectives  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.config import specs  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.loop import sweep
  config = sweep.with_overrides(base, sweep.objective_variants()[name])
  if "old_logp" not in objectives.get_objective(config.objective.name).requires:
    return None
  return "independent" if specs.estimator_settings(config)["coupled_ratio"] else "coupled"


def conditions(base, name: str, other: bool) -> tuple[str, ...]:
  """The conditions of one objective variant: official, then the other coupling's."""
  suffix = other_coupling(base, name) if other else None
  return OFFICIAL + ((f"normal_{suffix}", f"stress_{suffix}") if suffix else ())


def run_overrides(name: str, condition: str, fraction: float) -> dict:
  """Config overrides of one run: the objective's, the stress fraction, the coupling."""
  from stabledrl_jax.training.loop import sweep  # pylint: disable=g-import-not-at-top
  overrides = dict(sweep.objective_variants()[name])
  overrides["estimator.stress.fraction"] = fraction if condition.startswith("stress") else 0.0
  if condition.endswith("_coupled"):
    overrides["estimator.coupled_ratio"] = True
  elif condition.endswith("_independent"):
    overrides["estimator.coupled_ratio"] = False
  if overrides["objective.name"] == "stabledrl":  # Its variants too.
    overrides["train.gradient_bound"] = True
  return overrides


def summarize(result, threshold: float, final_steps: int) -> dict:
  """The summary.json entry of one run (see the module docstring)."""
  # pylint: disable-next=g-import-not-at-top
  from stabledrl_jax.training.loop.sweep import REWARD_METRIC, metric
  steps = [h for h in result.history if "grad_norm" in h]
  norms = [metric(h, "grad_norm") for h in steps]
  finite = [n for n in norms if math.isfinite(n)]
  ratios = [metric(h, "log10_ratio/max") for h in steps if "log10_ratio/max" in h]
  rewards = [metric(h, REWARD_METRIC) for h in steps[-final_steps:]]
  evals = sorted((h["step"], metric(h, "eval/accuracy")) for h in result.history
                 if "eval/accuracy" in h)
  summary = {
      "grad_norm_mean": statistics.fmean(finite) if finite else float("nan"),
      "grad_norm_max": max(finite) if finite else float("nan"),
      "explosion_rate": sum(not math.isfinite(n) or n > threshold for n in norms) / len(norms),
      "explosion_threshold": threshold,
      "final_reward": statistics.fmean(rewards),
      "reward_sd": statistics.stdev(rewards) if len(rewards) > 1 else float("nan"),
      "eval_start": evals[0][1] if evals else float("nan"),
      "eval_final": evals[-1][1] if evals else float("nan"),
      "max_log10_ratio": max(ratios) if ratios else None,
      "nonfinite_steps": len(norms) - len(finite),
      "steps": len(steps),
      "wall_s": result.wall_s,
      "stopped": result.stopped,
  }
  if any("grad_norm_over_bound/max" in h for h in steps):
    summary["bound_ratio_max"] = max(metric(h, "grad_norm_over_bound/max") for h in steps)
  if any("snis/ess_min" in h for h in steps):
    summary["ess_min"] = min(metric(h, "snis/ess_min") for h in steps)
  if any("clip/max_ratio" in h for h in steps):  # StableDRL's bound, fixed or adaptive.
    bounds = [metric(h, "clip/max_ratio") for h in steps]
    summary["clipped_fraction_mean"] = statistics.fmean(
        metric(h, "clip/frac_upper") + metric(h, "clip/frac_lower") for h in steps)
    summary["max_ratio_first"], summary["max_ratio_last"] = bounds[0], bounds[-1]
    summary["max_ratio_min"], summary["max_ratio_max"] = min(bounds), max(bounds)
  return summary


def plot(results: dict, names: list[str], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")  # Files only: no display needed.
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  # pylint: disable-next=g-import-not-at-top
  from stabledrl_jax.training.loop.sweep import REWARD_METRIC, metric

  fig, axes = plt.subplots(2, len(names), figsize=(3.0 * len(names), 5.4), sharex=True,
                           squeeze=False)
  for col, name in enumerate(names):
    for condition in OFFICIAL + tuple(f"{c}_{s}" for s in ("coupled", "independent")
                                      for c in OFFICIAL):
      style = {"normal": "-", "stress": "--"}[condition.split("_")[0]]
      style = style if "_" not in condition else {"-": ":", "--": "-."}[style]
      result = results.get(f"{name}/{condition}")
      if result is None:
        continue
      steps = [h for h in result.history if "grad_norm" in h]
      x = [h["step"] for h in steps]
      axes[0, col].plot(x, [metric(h, "grad_norm") for h in steps], style, label=condition)
      axes[1, col].plot(x, [metric(h, REWARD_METRIC) for h in steps], style,
                        label=condition)
    frozen = results.get(FROZEN)
    if frozen is not None:  # The control: the batches' own ups and downs.
      steps = [h for h in frozen.history if "grad_norm" in h]
      axes[1, col].plot([h["step"] for h in steps], [metric(h, REWARD_METRIC) for h in steps],
                        color="0.6", lw=1, label="frozen")
    axes[0, col].set_title(name, fontsize=10)
    axes[0, col].set_yscale("log")
    axes[1, col].set_xlabel("RL step")
    for row in range(2):
      axes[row, col].grid(alpha=0.3)
  axes[0, 0].set_ylabel("grad norm (pre-clip)")
  axes[1, 0].set_ylabel("correctness reward (mean)")
  axes[0, 0].legend(fontsize=8)
  axes[1, 0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def markdown_table(summary: dict) -> str:
  lines = ["| run | grad norm mean | grad norm max | explosion rate | final reward (sd) | "
           "eval start -> final | max log10 rho | bound ratio max |",
           "|---|---|---|---|---|---|---|---|"]
  for key, s in summary.items():
    ratio = "-" if s["max_log10_ratio"] is None else f"{s['max_log10_ratio']:.2f}"
    bound = f"{s['bound_ratio_max']:.3f}" if "bound_ratio_max" in s else "-"
    lines.append(f"| {key} | {s['grad_norm_mean']:.4g} | {s['grad_norm_max']:.4g} | "
                 f"{s['explosion_rate']:.2f} | {s['final_reward']:.3f} ({s['reward_sd']:.3f}) | "
                 f"{s['eval_start']:.2f} -> {s['eval_final']:.2f} | {ratio} | {bound} |")
  return "\n".join(lines)


def run_all(base, workdir: str, names: list[str], keys: list[str]) -> dict:
  """Every run of ``keys`` ("name/condition") from one supervised start: {key: result}."""
  from stabledrl_jax.training.loop import sweep  # pylint: disable=g-import-not-at-top
  began = time.perf_counter()
  start = sweep.fit_supervised_start(base, os.path.join(workdir, "sft"))
  print(f"supervised start: {time.perf_counter() - began:.0f} s", flush=True)
  del names
  results = {}
  for key in keys:
    if key == FROZEN:
      overrides = dict(run_overrides("stabledrl", "normal", 0.0))
      overrides["optimizer.learning_rate"] = FROZEN_LEARNING_RATE
    else:
      overrides = run_overrides(*key.split("/"), _FRACTION.value)
    config = sweep.with_overrides(base, overrides)
    result = sweep.train_from_start(config, start, os.path.join(workdir, key), reuse=True)
    results[key] = result
    print(f"{key}: {result.wall_s:.0f} s {result.stopped}", flush=True)
  return results


def main(argv) -> None:
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO.
  from stabledrl_jax.training.loop import sweep  # pylint: disable=g-import-not-at-top

  base, workdir = _CONFIG.value, _WORKDIR.value
  try:
    names = sweep.select_objectives(_OBJECTIVES.value)
  except ValueError as error:
    raise app.UsageError(f"--objectives: {error}") from None
  if not 0 < _FRACTION.value <= 1:
    raise app.UsageError(f"--fraction must lie in (0, 1], got {_FRACTION.value}")
  began = time.perf_counter()
  keys = ([FROZEN] if _FROZEN.value else []) + [
      f"{name}/{condition}" for name in names
      for condition in conditions(base, name, _OTHER_COUPLING.value)]
  if _SUMMARIZE_ONLY.value:
    results = {}
    for key in keys:
      try:
        results[key] = sweep.finished_run(os.path.join(workdir, key))
      except FileNotFoundError:
        pass
  else:
    results = run_all(base, workdir, names, keys)

  summary = {}
  for key in keys:
    if key not in results:
      continue
    name, condition = key.split("/")
    # The threshold of a run: its objective's normal run under the same coupling.
    suffix = condition.partition("_")[2]
    reference = results.get(f"{name}/normal" + (f"_{suffix}" if suffix else ""), results[key])
    normal = [sweep.metric(h, "grad_norm") for h in reference.history if "grad_norm" in h]
    finite = [n for n in normal if math.isfinite(n)]
    threshold = _EXPLOSION_FACTOR.value * (statistics.median(finite) if finite else 0.0)
    summary[key] = summarize(results[key], threshold, _FINAL_STEPS.value)
  if not summary:
    raise app.UsageError(f"no finished runs in {workdir}")
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  plot(results, names, os.path.join(workdir, "stress_test.png"))
  print("\n" + markdown_table(summary))
  clip_rows = [(key, s) for key, s in summary.items() if "max_ratio_last" in s]
  if clip_rows:
    print("\n| run | clipped fraction (mean) | bound first | bound last | bound min | bound max |\n"
          "|---|---|---|---|---|---|")
    for key, s in clip_rows:
      print(f"| {key} | {s['clipped_fraction_mean']:.3f} | {s['max_ratio_first']:.3g} | "
            f"{s['max_ratio_last']:.3g} | {s['max_ratio_min']:.3g} | {s['max_ratio_max']:.3g} |")
  print(f"\nexplosion threshold: {_EXPLOSION_FACTOR.value} x the median grad norm of the "
        f"objective's normal run; wall time {time.perf_counter() - began:.0f} s; wrote "
        f"{workdir}/summary.json and stress_test.png")


if __name__ == "__main__":
  app.run(main)
