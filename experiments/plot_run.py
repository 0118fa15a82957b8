r"""Plots a training run's metrics.jsonl: reward, greedy eval accuracy and gradient norm per step.

  python experiments/plot_run.py runs/quickstart [--output runs/quickstart/run.png]

Also prints the eval accuracy at the first and last evaluation.
"""

from __future__ import annotations

import argparse
import os

import matplotlib

matplotlib.use("Agg")  # Files only: no display needed.
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

from stabledrl_jax.training.loop import metrics_writer


def series(records, name):
  points = [(r["step"], r[name]) for r in records if isinstance(r.get(name), (int, float))]
  return [p[0] for p in points], [p[1] for p in points]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("workdir")
  parser.add_argument("--output", default=None, help="PNG path (default: WORKDIR/run.png)")
  args = parser.parse_args()
  records = metrics_writer.read_metrics(os.path.join(args.workdir, "metrics.jsonl"))
  if not records:
    raise SystemExit(f"No metrics in {args.workdir}/metrics.jsonl.")
  panels = [("rewards/mean", "reward (mean over rollouts)"),
            ("eval/accuracy", "greedy eval accuracy (%)"),
            ("grad_norm", "gradient norm (before clipping)")]
  fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2))
  for ax, (name, title) in zip(axes, panels):
    steps, values = series(records, name)
    ax.plot(steps, values, marker="o" if name.startswith("eval") else None, markersize=3)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
  fig.tight_layout()
  output = args.output or os.path.join(args.workdir, "run.png")
  fig.savefig(output, dpi=120)
  steps, accuracy = series(records, "eval/accuracy")
  if accuracy:
    print(f"eval/accuracy: {accuracy[0]:.2f} at step {steps[0]} -> {accuracy[-1]:.2f} at step "
          f"{steps[-1]} ({accuracy[-1] - accuracy[0]:+.2f} points)")
  print(f"wrote {output}")


if __name__ == "__main__":
  main()
