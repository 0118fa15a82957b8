r"""The baselines as published against the matched-budget configs: what each official run uses
(``training/config/published.py``, cited) and what ``llada8b_{d1,spg,wd1,espo}`` run instead.

  python experiments/baseline_table.py [--task gsm8k] [--readme README.md] \
      [--doc docs/training.md]

Prints, for ``--task``, one Markdown table: a row per setting, the matched configs' value (the
same for all four where it is, else each one's), and each baseline's published value. The
matched values are read from the configs (``config_lib.get``), the published ones from the
record. ``--readme`` writes it between the file's ``<!-- baselines:begin -->`` and ``:end -->``
markers; ``--doc`` writes the cited tables of every task between ``<!-- baselines-cited:begin
-->`` and ``:end -->``.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quickstart_seeds  # pylint: disable=g-import-not-at-top,wrong-import-position  (its writer)

# pylint: disable-next=g-import-not-at-top,wrong-import-position
from stabledrl_jax.training.config import config_lib, published, specs

CONFIGS = {"d1": "llada8b_d1", "spg": "llada8b_spg", "wd1": "llada8b_wd1",
           "espo": "llada8b_espo"}
NAMES = {"d1": "d1", "spg": "SPG", "wd1": "wd1", "espo": "ESPO"}
LABELS = {"batch": "prompts x completions a step", "mu": "updates per batch (mu)",
          "length": "training length", "prompt_cap": "long prompts",
          "steps": "denoising steps", "temperature": "sampling temperature",
          "warmup": "learning-rate warmup", "beta": "KL beta", "epsilon": "clip epsilon",
          "rewards": "rewards", "data": "training data"}


def matched(baseline: str, task: str) -> dict[str, str]:
  """{field: value} of the matched-budget config of ``baseline`` on ``task``."""
  config = config_lib.get(f"{CONFIGS[baseline]}:{task}")
  r, hparams = config.rollout, specs.objective_params(config)
  def hyper(*names):
    values = sorted({f"{getattr(hparams, n):g}" for n in names if hasattr(hparams, n)})
    return "/".join(values) or "none"

  size = config.data.train_size
  return {
      "batch": f"{r.num_prompts} x {r.group_size}",
      "mu": str(config.train.num_iterations),
      "length": f"{config.train.num_steps} RL steps",
      "prompt_cap": f"over {r.prompt_length} tokens: skipped",
      "steps": f"{r.steps} over {r.gen_length} tokens, blocks of {r.block_length}",
      "temperature": f"{r.temperature:g}",
      "warmup": f"{config.optimizer.warmup_steps} updates",
      "beta": hyper("beta"), "epsilon": hyper("epsilon", "epsilon_low", "epsilon_high"),
      "rewards": f"the '{config.task.reward}' scheme (tasks/)",
      "data": f"{config.data.train} train set, " + (f"{size} examples" if size else "whole"),
  }


def table(task: str) -> str:
  """The values table of ``task``."""
  ours = {b: matched(b, task) for b in published.BASELINES}
  theirs = {b: published.of(b, task) for b in published.BASELINES}
  head = "| setting | matched configs | " + " | ".join(
      f"{NAMES[b]} published" for b in published.BASELINES) + " |"
  lines = [head, "|---|" + "---|" * (1 + len(published.BASELINES))]
  for field in published.FIELDS:
    values = {b: ours[b][field] for b in published.BASELINES}
    if len(set(values.values())) == 1:
      mine = next(iter(values.values()))
    elif all(values[b] == theirs[b][field][0] for b in published.BASELINES):
      mine = "each one's published"
    else:
      mine = ", ".join(f"{NAMES[b]} {v}" for b, v in values.items())
    lines.append(f"| {LABELS[field]} | {mine} | " + " | ".join(
        theirs[b][field][0] for b in published.BASELINES) + " |")
  return "\n".join(lines)


def cited(task: str) -> str:
  """``task``'s published values with their citations, one row per baseline and setting."""
  lines = [f"{task}:", "", "| baseline | setting | published | where |", "|---|---|---|---|"]
  for baseline in published.BASELINES:
    for field, (value, where) in published.of(baseline, task).items():
      lines.append(f"| {NAMES[baseline]} | {LABELS[field]} | {value} | `{where}` |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--task", default="gsm8k", choices=published.TASKS)
  parser.add_argument("--readme", default=None, help="rewrite its <!-- baselines --> table")
  parser.add_argument("--doc", default=None, help="rewrite its <!-- baselines-cited --> tables")
  args = parser.parse_args(argv)
  text = table(args.task)
  print(text)
  if args.readme:
    quickstart_seeds.rewrite_readme(args.readme, text, "baselines")
  if args.doc:
    quickstart_seeds.rewrite_readme(args.doc, "\n\n".join(cited(t) for t in published.TASKS),
                                    "baselines-cited")


if __name__ == "__main__":
  main()
