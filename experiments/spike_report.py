r"""Reads a run's spike files (the trainer's spike recorder) into a short report.

  python experiments/spike_report.py runs/stress_test/grpo_sequence/stress [--top 5] [--plot]

For each ``spikes/step_<n>.npz`` (docs/diagnostics.md): why it was recorded, the gradient norms of
its inner updates against the running median, and, for the inner update with the largest norm,
the samples that dominated it: ranked by |A_j| x |weight_j| (the factor each sample's gradient
gets: the SNIS weight for StableDRL, the ratio where GRPO's clip lets it through, 0 where it
clips), with their log ratio, reward, whether the stress test stressed them, and their text.
``--plot`` also draws ``step_<n>.png`` beside each file: log rho against advantage, the
dominating samples marked (needs matplotlib: the [plot] extra).
"""

from __future__ import annotations

import math
import sys

import numpy as np
from absl import app, flags

from stabledrl_jax.training.loop import spikes

_TOP = flags.DEFINE_integer("top", 5, "Samples listed per spike.")
_PLOT = flags.DEFINE_bool("plot", False, "Draw log rho against advantage per spike.")
_WIDTH = flags.DEFINE_integer("width", 60, "Characters of each completion shown.")


def dominance(record: dict[str, np.ndarray]) -> tuple[int, np.ndarray]:
  """(the inner update with the largest gradient norm, [N] |A_j| |weight_j| in it)."""
  norms = np.where(np.isfinite(record["grad_norm"]), record["grad_norm"], np.inf)
  update = int(np.argmax(norms))
  advantages = np.abs(record["advantages"])
  if "per_sample/weight" in record:
    # A weight may be inf (GRPO's unclipped ratio): a sample with A = 0 still contributes 0.
    weight = np.abs(record["per_sample/weight"][update])
    return update, np.where(advantages == 0, 0.0, advantages * weight)
  return update, advantages  # An objective without weights (SPG, wd1): |A| alone.


def _number(x: float) -> str:
  return f"{x:.4g}" if math.isfinite(x) else str(x)


def report(record: dict[str, np.ndarray], top: int, width: int) -> str:
  step, reason = int(record["step"]), str(record["reason"])
  median, norms = float(record["median"]), record["grad_norm"]
  update, mass = dominance(record)
  order = np.argsort(-mass, kind="stable")[:top]
  total = float(mass.sum())
  if not total > 0:  # Nothing from the advantages: rank by the size of the ratio instead.
    log_ratio_size = np.abs(record.get("per_sample/log_ratio", np.zeros((update + 1, len(mass))))
                            [update])
    order = np.argsort(-log_ratio_size, kind="stable")[:top]
  share = float(mass[order].sum()) / total if total > 0 else math.nan
  log_ratio = record.get("per_sample/log_ratio")
  weight = record.get("per_sample/weight")
  stressed = record["stressed"]
  lines = [f"## step {step}: {reason}",
           "",
           f"Gradient norms of the inner updates: {', '.join(_number(float(n)) for n in norms)} "
           f"(median of the previous steps {_number(median)}; "
           f"{_number(float(np.max(norms)) / median)}x)." if math.isfinite(median) else
           f"Gradient norms of the inner updates: {', '.join(_number(float(n)) for n in norms)}.",
           f"Rollouts: {len(mass)}, reward mean {np.mean(record['rewards']):.3f}, "
           f"stressed {int(stressed.sum())}. " + (
               f"In update {update + 1} the top {len(order)} samples carry {share:.0%} of sum "
               "|A_j| |weight_j|." if total > 0 else "Every advantage is 0: the gradient comes "
               "from other terms (a KL penalty); samples ranked by |log rho|."),
           "",
           "| sample | stressed | reward | advantage | log rho | weight | share | completion |",
           "|---|---|---|---|---|---|---|---|"]
  for j in order:
    text = str(record["completions"][j]).replace("|", "\\|")
    text = text if len(text) <= width else text[:width - 3] + "..."
    lines.append(
        f"| {j} | {'yes' if stressed[j] else 'no'} | {record['rewards'][j]:.3f} | "
        f"{record['advantages'][j]:+.3f} | "
        f"{_number(float(log_ratio[update, j])) if log_ratio is not None else '-'} | "
        f"{_number(float(weight[update, j])) if weight is not None else '-'} | "
        f"{mass[j] / total if total > 0 else math.nan:.0%} | `{text}` |")
  return "\n".join(lines)


def plot(record: dict[str, np.ndarray], path: str, top: int) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  update, mass = dominance(record)
  log_ratio = record["per_sample/log_ratio"][update]
  order = np.argsort(-mass, kind="stable")[:top]
  stressed = record["stressed"]
  fig, ax = plt.subplots(figsize=(5, 3.6))
  for chosen, label, marker in ((~stressed, "not stressed", "o"), (stressed, "stressed", "^")):
    ax.scatter(record["advantages"][chosen], log_ratio[chosen], s=14, alpha=0.6, label=label,
               marker=marker)
  ax.scatter(record["advantages"][order], log_ratio[order], s=90, facecolors="none",
             edgecolors="red", linewidths=1.5, label=f"top {len(order)} by |A| |w|")
  ax.set_xlabel("advantage A_j")
  ax.set_ylabel("log rho_j")
  ax.set_title(f"step {int(record['step'])}, update {update + 1}: {record['reason']}")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  if len(argv) != 2:
    raise app.UsageError("usage: spike_report.py WORKDIR_OR_SPIKES_DIR [--top N] [--plot]")
  files = spikes.spike_files(argv[1])
  print(f"# Spikes in {argv[1]}: {len(files)}\n")
  for path in files:
    try:
      record = spikes.read_spike(path)
    except ValueError as error:
      print(f"skipped: {error}\n", file=sys.stderr)
      continue
    print(report(record, _TOP.value, _WIDTH.value) + "\n")
    if _PLOT.value and "per_sample/log_ratio" in record:
      image = str(path)[:-len(".npz")] + ".png"
      plot(record, image, _TOP.value)
      print(f"![step {int(record['step'])}]({image})\n")


if __name__ == "__main__":
  app.run(main)
