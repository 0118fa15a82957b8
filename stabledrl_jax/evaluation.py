"""Scoring generation files with the d1 evaluation protocol.

Generation files follow d1: JSON {"generations": [{"question", "generations", "ground_truth"},
...], ...metadata}, named TASK_MODEL_GENLEN_STEPS_SHARD_generations.json. The shards of one setup
(the name without "_SHARD_generations.json", e.g. "gsm8k_instruct_256_128") are pooled, and each
item is scored by its task's metric (`Task.score`).

    python -m stabledrl_jax.evaluation ../shared/data/d1_baseline_generations --output results.json

prints a table of setup, accuracy (%) and n (items), and writes
{"<setup>": {"accuracy": <percent>, "n": <int>}}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import sys
from typing import Any, Iterable, Mapping, Sequence

from stabledrl_jax import tasks

_GENERATION_FILE = re.compile(r"(?P<setup>.+)_(?P<shard>\d+)_generations\.json")


@dataclasses.dataclass
class SetupResult:
  """Pooled score of one setup: accuracy = correct / total; n = number of items."""

  correct: float = 0.0
  total: float = 0.0
  n: int = 0

  @property
  def accuracy(self) -> float:
    """Percent."""
    return 100.0 * self.correct / self.total if self.total else 0.0

  def add(self, score: tasks.ItemScore) -> None:
    self.correct += score.correct
    self.total += score.total
    self.n += 1


def setup_of(path: str | pathlib.Path) -> str | None:
  """"gsm8k_instruct_256_128" for ".../gsm8k_instruct_256_128_3_generations.json", else None."""
  match = _GENERATION_FILE.fullmatch(pathlib.Path(path).name)
  return match.group("setup") if match else None


def task_of(setup: str) -> tasks.Task:
  """The task named by the setup's first field ("math500_instruct_..." -> math500)."""
  return tasks.get_task(setup.split("_", 1)[0])


def generation_files(paths: Iterable[str | pathlib.Path]) -> list[pathlib.Path]:
  """The generation files named directly, plus those directly inside named directories."""
  files = []
  for path in map(pathlib.Path, paths):
    if path.is_dir():
      files.extend(sorted(child for child in path.glob("*_generations.json")
                          if setup_of(child) is not None))
    elif path.is_file():
      if setup_of(path) is None:
        raise ValueError(f"{path}: not named TASK_..._SHARD_generations.json")
      files.append(path)
    else:
      raise FileNotFoundError(path)
  return files


def score_records(task: tasks.Task, records: Iterable[Mapping[str, Any]],
                  result: SetupResult | None = None) -> SetupResult:
  """Adds each {"question", "generations", "ground_truth"} record's score to `result`."""
  result = SetupResult() if result is None else result
  for record in records:
    example = tasks.Example(question=record.get("question", ""),
                            ground_truth=record.get("ground_truth"))
    result.add(task.score(record.get("generations", ""), example))
  return result


def score_generation_files(paths: Sequence[str | pathlib.Path]) -> dict[str, SetupResult]:
  """Scores files and directories of d1 generation files; one result per setup, sorted."""
  results: dict[str, SetupResult] = {}
  for path in generation_files(paths):
    setup = setup_of(path)
    records = tasks.read_records(path)
    score_records(task_of(setup), records, results.setdefault(setup, SetupResult()))
  return dict(sorted(results.items()))


def results_as_json(results: Mapping[str, SetupResult]) -> dict[str, dict[str, Any]]:
  return {setup: {"accuracy": result.accuracy, "n": result.n}
          for setup, result in results.items()}


def format_table(results: Mapping[str, SetupResult]) -> str:
  """A plain-text table: setup, accuracy (%, two decimals), n."""
  width = max([len("setup")] + [len(setup) for setup in results])
  lines = [f"{'setup':<{width}}  {'accuracy':>8}  {'n':>6}", "-" * (width + 18)]
  for setup, result in results.items():
    lines.append(f"{setup:<{width}}  {result.accuracy:>8.2f}  {result.n:>6d}")
  return "\n".join(lines)


def write_generations(path: str | pathlib.Path, examples: Sequence[tasks.Example],
                      completions: Sequence[str], **metadata: Any) -> None:
  """Writes completions in the d1 generation-file format, scorable by this module and by d1's.

  Name the file TASK_MODEL_GENLEN_STEPS_SHARD_generations.json so that shards pool.
  """
  if len(examples) != len(completions):
    raise ValueError(f"{len(examples)} examples but {len(completions)} completions.")
  records = [{"question": example.question, "generations": completion,
              "ground_truth": example.ground_truth}
             for example, completion in zip(examples, completions)]
  pathlib.Path(path).write_text(json.dumps({"generations": records, **metadata}, indent=2),
                                encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m stabledrl_jax.evaluation",
      description="Score d1-format generation files (TASK_MODEL_GENLEN_STEPS_SHARD_"
                  "generations.json) with the d1 protocol; shards of a setup are pooled.")
  parser.add_argument("paths", nargs="+", help="generation files or directories holding them")
  parser.add_argument("--output", help="write {setup: {accuracy, n}} as JSON to this file")
  args = parser.parse_args(argv)
  try:
    results = score_generation_files(args.paths)
  except (OSError, ValueError, KeyError) as error:
    parser.error(str(error))
  if not results:
    parser.error("no *_SHARD_generations.json files found")
  print(format_table(results))
  if args.output:
    pathlib.Path(args.output).write_text(json.dumps(results_as_json(results), indent=2) + "\n",
                                         encoding="utf-8")
  return 0


if __name__ == "__main__":
  sys.exit(main())
