r"""The quickstart over several seeds: greedy eval accuracy per evaluation, gain, wall-clock time.

  python experiments/quickstart_seeds.py --workdir runs/quickstart_seeds [--seeds 0,1,2] \
      [--config configs/quickstart.py] [--set FIELD=VALUE ...] [--readme README.md] \
      [--marker quickstart-seeds]

Each seed runs ``python -m stabledrl_jax.train --config CONFIG --config.seed=S`` into
``WORKDIR/seed_S`` (its own supervised start and held-out set), as a new user would. Prints a
markdown table, writes ``WORKDIR/summary.json``, and with ``--readme`` rewrites the table between
the README's ``<!-- MARKER:begin -->`` and ``<!-- MARKER:end -->`` (``--marker``; the LoRA
quickstart's table: ``--config configs/quickstart_lora.py --marker quickstart-lora-seeds``). A finished seed is not rerun
(``--summarize_only`` only reads the workdirs).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from absl import app
from absl import flags

from stabledrl_jax.training.loop import metrics_writer

_CONFIG = flags.DEFINE_string("config", "configs/quickstart.py", "Config file of every run.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Root directory: one workdir per seed.",
                               required=True)
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds to run.")
_SET = flags.DEFINE_multi_string("set", [], "A config override FIELD=VALUE for every run "
                                  "(passed as --config.FIELD=VALUE); repeatable.")
_README = flags.DEFINE_string("readme", None, "Rewrite the table between this file's markers.")
_MARKER = flags.DEFINE_string("marker", "quickstart-seeds", "The README markers' name.")
_SUMMARIZE_ONLY = flags.DEFINE_bool("summarize_only", False, "Read finished runs; run nothing.")

_TIME_FILE = "quickstart_seconds.json"


def run_seed(seed: int, workdir: str) -> None:
  """Trains one seed in a subprocess (as the README's command does) unless it finished before."""
  if os.path.exists(os.path.join(workdir, _TIME_FILE)):
    return
  start = time.perf_counter()
  subprocess.run([sys.executable, "-m", "stabledrl_jax.train", "--config", _CONFIG.value,
                  "--workdir", workdir, f"--config.seed={seed}",
                  *(f"--config.{override}" for override in _SET.value)], check=True)
  with open(os.path.join(workdir, _TIME_FILE), "w") as f:
    json.dump({"seconds": time.perf_counter() - start}, f)


def summarize(seed: int, workdir: str) -> dict:
  """Eval accuracy by step, the gain of the last evaluation over the start, and the run time."""
  records = metrics_writer.read_metrics(os.path.join(workdir, "metrics.jsonl"))
  accuracy = {r["step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r}
  if not accuracy or 0 not in accuracy:
    raise ValueError(f"{workdir} has no eval/accuracy at step 0: did the run finish?")
  last = max(accuracy)
  with open(os.path.join(workdir, _TIME_FILE)) as f:
    seconds = json.load(f)["seconds"]
  return {"seed": seed, "accuracy": accuracy, "start": accuracy[0], "final": accuracy[last],
          "gain": accuracy[last] - accuracy[0], "seconds": seconds}


def table(rows: list[dict]) -> str:
  steps = sorted({step for row in rows for step in row["accuracy"]})
  shown = [s for s in steps if s == 0 or s % 20 == 0 or s == steps[-1]]
  lines = ["| seed | " + " | ".join("0 (start)" if s == 0 else str(s) for s in shown)
           + " | gain | time |",
           "|---|" + "---|" * (len(shown) + 2)]
  for row in rows:
    cells = [f"{row['accuracy'][s]:.2f}" if s in row["accuracy"] else "" for s in shown]
    minutes, seconds = divmod(round(row["seconds"]), 60)
    lines.append(f"| {row['seed']} | " + " | ".join(cells)
                 + f" | {row['gain']:+.2f} | {minutes} min {seconds:02d} s |")
  return "\n".join(lines)


def rewrite_readme(path: str, text: str, marker: str = "quickstart-seeds") -> None:
  begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
  with open(path) as f:
    readme = f.read()
  pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), flags=re.DOTALL)
  if not pattern.search(readme):
    raise ValueError(f"{path} has no {begin} ... {end} markers")
  with open(path, "w") as f:
    f.write(pattern.sub(lambda _: f"{begin}\n{text}\n{end}", readme))


def main(argv) -> None:
  del argv
  rows = []
  for seed in (int(s) for s in _SEEDS.value):
    workdir = os.path.join(_WORKDIR.value, f"seed_{seed}")
    if not _SUMMARIZE_ONLY.value:
      run_seed(seed, workdir)
    rows.append(summarize(seed, workdir))
  text = table(rows)
  print(text)
  with open(os.path.join(_WORKDIR.value, "summary.json"), "w") as f:
    json.dump({"config": _CONFIG.value, "overrides": _SET.value, "rows": rows}, f, indent=2)
  if _README.value:
    rewrite_readme(_README.value, text, _MARKER.value)


if __name__ == "__main__":
  app.run(main)
