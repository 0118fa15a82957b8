r"""Stress test (SPEC section 5): does each objective survive exploding importance ratios?

  python experiments/stress_test.py --config configs/stress_test.py --workdir runs/stress_test

Fits the supervised start once (``<workdir>/sft``), then trains every objective
from it with the same seed and data, once normally and once with
``estimator.stress.fraction`` of the samples given "easy" numerator and "hard"
denominator masks. Writes ``<workdir>/summary.json``:

  {"<objective>/<condition>": {"grad_norm_mean", "grad_norm_max", "explosion_rate",
                               "final_reward", "max_log10_ratio"}}

condition ``normal`` or ``stress``. ``grad_norm`` is the pre-clip global norm of
each step (the mean over its inner iterations; a non-finite one counts as exploded); ``explosion_rate`` is the
fraction of steps whose norm exceeds ``--explosion_factor`` times the largest
norm of any normal run (one threshold for all, printed); ``final_reward`` is the
mean rollout reward of the last ``--final_steps`` steps; ``max_log10_ratio`` is
the largest log10 rho over the run (None for objectives without a ratio). A run
stopped by ``train.max_consecutive_skips`` keeps the steps it logged. Also
writes ``<workdir>/stress_test.png`` and prints the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import time

import matplotlib

matplotlib.use("Agg")  # Files only: no display needed.
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

from stabledrl_jax.training import metrics_writer, trainer  # pylint: disable=g-import-not-at-top

# (summary name, objective.name, config overrides as dotted paths). Every run keeps the
# config's estimator, except token-level GRPO (d1), which needs per-token mean-field scores.
OBJECTIVES = (
    ("grpo_token", "grpo", {"objective.grpo.level": "token",
                            "estimator.method": "mean_field"}),
    ("grpo_sequence", "grpo", {"objective.grpo.level": "sequence"}),
    ("espo", "espo", {}),
    ("spg", "spg", {}),
    ("wd1", "wd1", {}),
    ("stabledrl", "stabledrl", {}),
)


def load_config(path: str):
  spec = importlib.util.spec_from_file_location("stress_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def run_config(base, objective: str, overrides: dict, fraction: float):
  config = base.copy_and_resolve_references()
  config.objective.name = objective
  for field, value in overrides.items():
    *path, name = field.split(".")
    node = config
    for part in path:
      node = node[part]
    node[name] = value
  config.estimator.stress.fraction = fraction
  return config


def value(record: dict, name: str) -> float:
  """A metric as a float: metrics.jsonl stores inf / nan as strings."""
  return float(record[name])


def summarize(history, threshold: float, final_steps: int) -> dict:
  norms = [value(h, "grad_norm") for h in history]
  finite = [n for n in norms if math.isfinite(n)]
  exploded = [not math.isfinite(n) or n > threshold for n in norms]
  ratios = [value(h, "log10_ratio/max") for h in history if "log10_ratio/max" in h]
  rewards = [value(h, "reward/mean") for h in history[-final_steps:]]
  return {
      "grad_norm_mean": sum(finite) / len(finite) if finite else float("nan"),
      "grad_norm_max": max(finite) if finite else float("nan"),
      "explosion_rate": sum(exploded) / len(norms),
      "final_reward": sum(rewards) / len(rewards),
      "max_log10_ratio": max(ratios) if ratios else None,
      "nonfinite_steps": sum(not math.isfinite(n) for n in norms),
  }


def plot(histories: dict, path: str) -> None:
  fig, axes = plt.subplots(2, len(OBJECTIVES), figsize=(3.2 * len(OBJECTIVES), 5.6),
                           sharex=True)
  for col, (name, _, _) in enumerate(OBJECTIVES):
    for condition, style in (("normal", "-"), ("stress", "--")):
      history = histories.get(f"{name}/{condition}")
      if not history:
        continue
      steps = [h["step"] for h in history]
      axes[0, col].plot(steps, [value(h, "grad_norm") for h in history], style, label=condition)
      axes[1, col].plot(steps, [value(h, "reward/mean") for h in history], style,
                        label=condition)
    axes[0, col].set_title(name, fontsize=10)
    axes[0, col].set_yscale("log")
    axes[1, col].set_xlabel("RL step")
    for row in range(2):
      axes[row, col].grid(alpha=0.3)
  axes[0, 0].set_ylabel("grad norm (pre-clip)")
  axes[1, 0].set_ylabel("reward (mean)")
  axes[0, 0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="configs/stress_test.py")
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--fraction", type=float, default=0.7, help="stressed fraction f")
  parser.add_argument("--explosion_factor", type=float, default=3.0,
                      help="threshold = this x the largest grad norm of all normal runs")
  parser.add_argument("--final_steps", type=int, default=3,
                      help="final_reward averages the last this many steps")
  parser.add_argument("--objectives", default=",".join(o[0] for o in OBJECTIVES))
  args = parser.parse_args()
  base = load_config(args.config)
  wanted = args.objectives.split(",")
  start = time.perf_counter()

  sft_dir = os.path.join(args.workdir, "sft")
  if not os.path.exists(os.path.join(sft_dir, trainer.SFT_DIR, "config.json")):
    sft_config = base.copy_and_resolve_references()
    sft_config.train.num_steps = 0
    trainer.train(sft_config, sft_dir)
  print(f"supervised start: {time.perf_counter() - start:.0f} s")

  histories = {}
  for name, objective, overrides in OBJECTIVES:
    if name not in wanted:
      continue
    for condition, fraction in (("normal", 0.0), ("stress", args.fraction)):
      run_dir = os.path.join(args.workdir, name, condition)
      shutil.rmtree(run_dir, ignore_errors=True)
      os.makedirs(run_dir)
      shutil.copytree(os.path.join(sft_dir, trainer.SFT_DIR),
                      os.path.join(run_dir, trainer.SFT_DIR))
      run_start = time.perf_counter()
      try:
        trainer.train(run_config(base, objective, overrides, fraction), run_dir)
        note = ""
      except trainer.TooManySkipsError:
        note = " (stopped: too many non-finite updates in a row)"
      histories[f"{name}/{condition}"] = metrics_writer.read_metrics(
          os.path.join(run_dir, "metrics.jsonl"))
      print(f"{name}/{condition}: {time.perf_counter() - run_start:.0f} s{note}", flush=True)

  normal_max = max(value(h, "grad_norm") for key, run in histories.items()
                   if key.endswith("/normal") for h in run if math.isfinite(value(h, "grad_norm")))
  threshold = args.explosion_factor * normal_max
  summary = {key: summarize(run, threshold, args.final_steps) for key, run in histories.items()}
  with open(os.path.join(args.workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  plot(histories, os.path.join(args.workdir, "stress_test.png"))

  print(f"\nexplosion threshold: {threshold:.4g} = {args.explosion_factor} x {normal_max:.4g} "
        f"(largest normal grad norm)")
  print(f"| run | grad norm mean | grad norm max | explosion rate | final reward | "
        f"max log10 rho |\n|---|---|---|---|---|---|")
  for key, s in summary.items():
    ratio = "-" if s["max_log10_ratio"] is None else f"{s['max_log10_ratio']:.2f}"
    print(f"| {key} | {s['grad_norm_mean']:.4g} | {s['grad_norm_max']:.4g} | "
          f"{s['explosion_rate']:.2f} | {s['final_reward']:.3f} | {ratio} |")
  print(f"\nwall time: {time.perf_counter() - start:.0f} s; wrote "
        f"{args.workdir}/summary.json and stress_test.png")


if __name__ == "__main__":
  main()
