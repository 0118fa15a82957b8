"""Scoring generation files with the d1 evaluation protocol.

Generation files follow d1: JSON {"generations": [{"question", "generations", "ground_truth"},
...], ...metadata}, named TASK_MODEL_GENLEN_STEPS_SHARD_generations.json. The shards of one setup
(the name without "_SHARD_generations.json", e.g. "gsm8k_instruct_256_128") are pooled, and each
item is scored by its task's metric (`Task.score`).

    python -m stabledrl_jax.scoring DIR_OF_D1_GENERATION_FILES --output results.json

prints a table of setup, accuracy (%) and n (items), and writes
{"<setup>": {"accuracy": <percent>, "n": <int>}}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
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


def setup_records(directory: str | pathlib.Path, task_name: str) -> list[dict[str, Any]]:
  """The records of the first setup (by name) of `task_name` in a directory, shards in order.

  The question set a published run was scored on: d1's baselines hold 1130 of GSM8K's 1319 test
  questions and 256 of the 500 sudoku puzzles, the same for every generation length.
  """
  shards: dict[str, list[tuple[int, pathlib.Path]]] = {}
  for path in generation_files([directory]):
    setup = setup_of(path)
    if setup.split("_", 1)[0] == task_name:
      shard = int(_GENERATION_FILE.fullmatch(path.name).group("shard"))
      shards.setdefault(setup, []).append((shard, path))
  if not shards:
    raise ValueError(f"{directory} has no {task_name}_..._SHARD_generations.json files")
  return [record for _, path in sorted(shards[min(shards)])
          for record in read_generation_file(path)]


def read_generation_file(path: str | pathlib.Path) -> list[dict[str, Any]]:
  """The records of one d1 generation file, its schema checked.

  Raises:
    ValueError naming the file: unreadable, not JSON, or not {"generations": [{"question",
    "generations" (text), "ground_truth"}, ...]}.
  """
  path = pathlib.Path(path)
  try:
    data = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
    raise ValueError(f"{path}: not a readable JSON file ({error})") from None
  records = data.get("generations") if isinstance(data, dict) else None
  if not isinstance(records, list):
    raise ValueError(f'{path}: expected {{"generations": [records]}}, got '
                     f"{type(data).__name__}" + (f" with generations of type "
                                                 f"{type(records).__name__}"
                                                 if isinstance(data, dict) else ""))
  for i, record in enumerate(records):
    if not isinstance(record, dict):
      raise ValueError(f"{path}: generations[{i}] is a {type(record).__name__}, not a record")
    if not isinstance(record.get("generations", ""), str):
      raise ValueError(f"{path}: generations[{i}].generations is a "
                       f"{type(record['generations']).__name__}, not the completion's text")
  return records


def score_records(task: tasks.Task, records: Iterable[Mapping[str, Any]],
                  result: SetupResult | None = None) -> SetupResult:
  """Adds each {"question", "generations", "ground_truth"} record's score to `result`."""
  result = SetupResult() if result is None else result
  for record in records:
    example = tasks.Example(question=record.get("question", ""),
                            ground_truth=record.get("ground_truth"))
    result.add(task.score(record.get("generations", ""), example))
  return result


def score_generation_files(paths: Sequence[str | pathlib.Path],
                           skipped: list[str] | None = None) -> dict[str, SetupResult]:
  """Scores files and directories of d1 generation files; one result per setup, sorted.

  A file that cannot be scored (unreadable, malformed, an unknown task prefix) is skipped and
  its reason, naming it, appended to ``skipped``; without ``skipped`` it raises ValueError.
  """
  results: dict[str, SetupResult] = {}
  for path in generation_files(paths):
    setup = setup_of(path)
    try:
      try:
        task = task_of(setup)
      except KeyError as error:  # An unknown task prefix.
        raise ValueError(f"{path}: {error.args[0]}") from None
      records = read_generation_file(path)
    except ValueError as error:
      if skipped is None:
        raise
      skipped.append(str(error))
      continue
    score_records(task, records, results.setdefault(setup, SetupResult()))
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
  path = pathlib.Path(path)
  # Written aside and renamed: a killed writer leaves no torn file that a reader would score or
  # a resumed run would take for finished. The temporary name does not match *_generations.json.
  temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  temporary.write_text(json.dumps({"generations": records, **metadata}, indent=2),
                       encoding="utf-8")
  os.replace(temporary, path)


def report(paths: Sequence[str | pathlib.Path], output: str | pathlib.Path | None = None
           ) -> dict[str, SetupResult]:
  """Scores `paths`, prints the table and, given `output`, writes {setup: {accuracy, n}} there.

  Files that cannot be scored are skipped and listed on stderr.

  Raises:
    ValueError: no generation file under `paths` could be scored.
  """
  skipped: list[str] = []
  results = score_generation_files(paths, skipped)
  for reason in skipped:
    print(f"skipped {reason}", file=sys.stderr)
  if not results:
    raise ValueError(f"no scorable *_SHARD_generations.json files in "
                     f"{', '.join(map(str, paths))}" + (f" ({len(skipped)} skipped)"
                                                        if skipped else ""))
  print(format_table(results))
  if output:
    pathlib.Path(output).write_text(json.dumps(results_as_json(results), indent=2) + "\n",
                                    encoding="utf-8")
  return results


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m stabledrl_jax.scoring",
      description="Score d1-format generation files (TASK_MODEL_GENLEN_STEPS_SHARD_"
                  "generations.json) with the d1 protocol; shards of a setup are pooled.")
  parser.add_argument("paths", nargs="+", help="generation files or directories holding them")
  parser.add_argument("--output", help="write {setup: {accuracy, n}} as JSON to this file")
  args = parser.parse_args(argv)
  try:
    report(args.paths, args.output)
  except (OSError, ValueError, KeyError) as error:
    parser.error(str(error))
  return 0


if __name__ == "__main__":
  sys.exit(main())
