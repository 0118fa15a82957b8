r"""Where an RL run's step time goes: ``time/step_s`` split into sampling, host scoring,
likelihood scoring and updates (the trainer logs each; docs/training.md, "Metrics"), from a
workdir's metrics.jsonl.

  python experiments/time_split.py --workdir runs/quickstart [--skip 1] \
      [--doc docs/performance.md]

Prints a Markdown table: each part's mean seconds per step and its share of the step, over the
run's RL steps after the first ``--skip`` (the first compiles), then the sampler's model calls
and tokens per call. ``--doc`` writes the table between the file's ``<!-- time-split:begin -->``
and ``<!-- time-split:end -->`` markers.
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quickstart_seeds  # pylint: disable=g-import-not-at-top,wrong-import-position  (its writer)

MARKER = "time-split"  # The doc's <!-- time-split:begin --> ... :end -->.
PARTS = (("rollout", "sampling (prompts drawn and encoded, the sampler's calls)"),
         ("reward", "host scoring (texts decoded, rewards, advantages)"),
         ("likelihood", "likelihood scoring (l_old, l_ref)"),
         ("update", "updates (mu of them)"))


def step_records(workdir: str, skip: int) -> list[dict]:
  """The RL steps' records of ``workdir``'s metrics.jsonl, the first ``skip`` dropped.

  Raises:
    ValueError: no record with the time split is left (a run of an older version, or too
      short for ``skip``).
  """
  path = os.path.join(workdir, "metrics.jsonl")
  with open(path) as f:
    records = [json.loads(line) for line in f if line.strip()]
  steps = [r for r in records if "time/update_s" in r][skip:]
  if not steps:
    raise ValueError(f"{path} has no RL step with the time split after the first {skip}")
  return steps


def table(steps: list[dict]) -> str:
  """The split as a Markdown table (means over ``steps``)."""
  step = float(np.mean([r["time/step_s"] for r in steps]))
  lines = [f"Mean over {len(steps)} RL steps: {step:.2f} s a step.", "",
           "| part | s per step | share of the step |", "|---|---:|---:|"]
  accounted = 0.0
  for name, what in PARTS:
    seconds = float(np.mean([r[f"time/{name}_s"] for r in steps]))
    accounted += seconds
    lines.append(f"| {what} | {seconds:.3f} | {100 * seconds / step:.1f}% |")
  lines.append(f"| the rest (metrics, the step's bookkeeping) | {step - accounted:.3f} | "
               f"{100 * (step - accounted) / step:.1f}% |")
  calls = float(np.mean([r["rollout/calls_per_completion"] for r in steps]))
  tokens = float(np.mean([r["rollout/tokens_per_call"] for r in steps]))
  lines += ["", f"The sampler: {calls:.1f} model calls per completion, {tokens:.2f} generated "
            "positions per call."]
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="a training workdir")
  parser.add_argument("--skip", type=int, default=1, help="first RL steps left out (compiles)")
  parser.add_argument("--doc", default=None, help="rewrite the table between this file's markers")
  args = parser.parse_args(argv)
  try:
    text = table(step_records(args.workdir, args.skip))
  except (OSError, ValueError) as error:
    parser.error(str(error))
  print(text)
  if args.doc:
    quickstart_seeds.rewrite_readme(args.doc, text, MARKER)


if __name__ == "__main__":
  main()
