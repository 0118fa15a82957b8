r"""Every objective under normal conditions: reward, eval accuracy and time per step, over seeds.

  python experiments/compare_objectives.py --config configs/compare_objectives.py \
      --workdir runs/compare --seeds 0,1,2

For each seed, fits one supervised start (``<workdir>/seed<S>/sft``) and trains every objective
of ``sweep.objective_variants()`` from it with that seed. Writes ``<workdir>/comparison.json``:

  {"<objective>": {"eval_start", "eval_final", "eval_final_std", "eval_best", "reward_final",
                   "step_s", "seeds": {"<seed>": {"eval": {step: accuracy}, "reward": [...],
                                                  "step_s", "wall_s", "stopped"}}}}

``eval_*``: greedy ``eval/accuracy`` (percent) at the first / last evaluation and its best, means
over seeds (``eval_final_std``: their standard deviation); ``reward_final``: mean rollout reward of
the last 10 steps; ``step_s``: median seconds per RL step after the first (compilation). Also
draws ``<workdir>/comparison.png`` (reward and eval accuracy against step, means over seeds) and
prints the table in Markdown. Any config field can be overridden (``--config.train.num_steps=20``).
"""

from __future__ import annotations

import json
import os
import statistics
import time

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/compare_objectives.py",
                                          "Path to a get_config() file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.", required=True)
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds; each gets its own start.")
_OBJECTIVES = flags.DEFINE_list("objectives", None,
                                "Objectives to run (default: all of sweep.objective_variants()).")
_SUMMARIZE_ONLY = flags.DEFINE_bool(
    "summarize_only", False, "Train nothing: summarize the finished runs in --workdir (e.g. "
    "those of an interrupted comparison).")
_FINAL_STEPS = 10


def run_summary(result) -> dict:
  """Per-seed curves of one run."""
  from stabledrl_jax.training.sweep import REWARD_METRIC, metric  # pylint: disable=g-import-not-at-top
  evals = {h["step"]: metric(h, "eval/accuracy") for h in result.history if "eval/accuracy" in h}
  steps = [h for h in result.history if "rewards/mean" in h]
  times = [metric(h, "time/step_s") for h in steps[1:]] or [float("nan")]
  return {"eval": evals, "reward": [metric(h, REWARD_METRIC) for h in steps],
          "step_s": statistics.median(times), "wall_s": result.wall_s,
          "stopped": result.stopped}


def objective_summary(per_seed: dict) -> dict:
  """Means over seeds of one objective's runs."""
  runs = list(per_seed.values())
  finals = [r["eval"][max(r["eval"])] for r in runs if r["eval"]]
  mean = lambda xs: statistics.fmean(xs) if xs else float("nan")
  return {
      "eval_start": mean([r["eval"][min(r["eval"])] for r in runs if r["eval"]]),
      "eval_final": mean(finals),
      "eval_final_std": statistics.pstdev(finals) if finals else float("nan"),
      "eval_best": mean([max(r["eval"].values()) for r in runs if r["eval"]]),
      "reward_final": mean([mean(r["reward"][-_FINAL_STEPS:]) for r in runs]),
      "step_s": mean([r["step_s"] for r in runs]),
      "seeds": per_seed,
  }


def plot(comparison: dict, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")  # Files only: no display needed.
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, (reward_ax, eval_ax) = plt.subplots(1, 2, figsize=(11, 4))
  for name, entry in comparison.items():
    runs = list(entry["seeds"].values())
    length = min(len(r["reward"]) for r in runs)
    rewards = [statistics.fmean(r["reward"][i] for r in runs) for i in range(length)]
    reward_ax.plot(range(1, length + 1), rewards, label=name)
    steps = sorted(set.intersection(*(set(r["eval"]) for r in runs)))
    eval_ax.plot(steps, [statistics.fmean(r["eval"][s] for r in runs) for s in steps],
                 marker="o", label=name)
  reward_ax.set(xlabel="RL step", ylabel="rollout reward (mean over seeds)")
  eval_ax.set(xlabel="RL step", ylabel="greedy eval accuracy, % (mean over seeds)")
  for ax in (reward_ax, eval_ax):
    ax.grid(alpha=0.3)
  eval_ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def markdown_table(comparison: dict) -> str:
  lines = ["| objective | seeds | eval start | eval final (mean +- sd) | eval best | final reward | "
           "s / step |", "|---|---|---|---|---|---|---|"]
  for name, e in comparison.items():
    lines.append(f"| {name} | {len(e['seeds'])} | {e['eval_start']:.2f} | {e['eval_final']:.2f} "
                 f"+- {e['eval_final_std']:.2f} | {e['eval_best']:.2f} | "
                 f"{e['reward_final']:.3f} | {e['step_s']:.2f} |")
  return "\n".join(lines)


def main(argv) -> None:
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO.
  from stabledrl_jax.training import sweep  # pylint: disable=g-import-not-at-top

  base, workdir = _CONFIG.value, _WORKDIR.value
  try:
    names = sweep.select_objectives(_OBJECTIVES.value)
  except ValueError as error:
    raise app.UsageError(f"--objectives: {error}") from None
  try:
    seeds = [int(s) for s in _SEEDS.value]
  except ValueError:
    raise app.UsageError(f"--seeds must be integers, got {_SEEDS.value}") from None
  if base.eval.every_steps <= 0:
    raise app.UsageError("--config.eval.every_steps must be > 0: the comparison needs evals")
  began = time.perf_counter()
  per_objective = {name: {} for name in names}
  for seed in seeds:
    seeded = sweep.with_overrides(base, {"seed": seed})
    if not _SUMMARIZE_ONLY.value:
      start = sweep.fit_supervised_start(seeded, os.path.join(workdir, f"seed{seed}", "sft"))
    for name in names:
      run_dir = os.path.join(workdir, f"seed{seed}", name)
      if _SUMMARIZE_ONLY.value:
        try:
          result = sweep.finished_run(run_dir)
        except FileNotFoundError:
          continue
      else:
        config = sweep.with_overrides(seeded, sweep.objective_variants()[name])
        result = sweep.train_from_start(config, start, run_dir)
        print(f"seed {seed} {name}: {result.wall_s:.0f} s {result.stopped}", flush=True)
      per_objective[name][str(seed)] = run_summary(result)
  per_objective = {name: runs for name, runs in per_objective.items() if runs}
  if not per_objective:
    raise app.UsageError(f"no finished runs in {workdir}")

  comparison = {name: objective_summary(runs) for name, runs in per_objective.items()}
  with open(os.path.join(workdir, "comparison.json"), "w") as f:
    json.dump(comparison, f, indent=2)
  plot(comparison, os.path.join(workdir, "comparison.png"))
  print("\n" + markdown_table(comparison))
  print(f"\nwall time {time.perf_counter() - began:.0f} s; wrote {workdir}/comparison.json and "
        "comparison.png")


if __name__ == "__main__":
  app.run(main)
