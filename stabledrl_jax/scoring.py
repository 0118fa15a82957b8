"""Scoring generation files with the d1 evaluation protocol.

Generation files follow d1: JSON {"generations": [{"question", "generations", "ground_truth"},
...], ...metadata}, named TASK_MODEL_GENLEN_STEPS_SHARD_generations.json. The shards of one setup
(the name without "_SHARD_generations.json", e.g. "gsm8k_instruct_256_128") are pooled, and each
item is scored by its task's metric (`Task.score`).

    python -m stabledrl_jax.scoring DIR_OF_D1_GENERATION_FILES --output results.json

prints a table of setup, accuracy (%) and n (items), and writes
{"<setup>": {"accuracy": <percent>, "n": <int>}}. A path it cannot score (a FIFO or device named
like a generation file, which is never opened; unreadable, malformed or too deeply nested JSON;
a record of the wrong types) is skipped, named and counted on stderr; the rest are scored.
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

from stabledrl_jax import tasks, workdir_files

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


def _problem(skipped: list[str] | None, error: Exception) -> None:
  """Appends the reason to ``skipped``, or raises it when there is no list to append to."""
  if skipped is None:
    raise error
  skipped.append(str(error))


def generation_files(paths: Iterable[str | pathlib.Path],
                     skipped: list[str] | None = None) -> list[pathlib.Path]:
  """The generation files named directly, plus those directly inside named directories.

  Candidates are chosen by name only (nothing is opened here: a FIFO named like a generation
  file is only ever looked at with os.stat, by `read_generation_file`); each file once. A path
  that does not exist, a directory that cannot be listed and a named file that is not called
  TASK_..._SHARD_generations.json raise ValueError / FileNotFoundError, or are appended to
  ``skipped`` (naming them) when it is given.
  """
  files, seen = [], set()

  def add(path: pathlib.Path) -> None:
    key = os.path.realpath(path)
    if key not in seen:
      seen.add(key)
      files.append(path)

  for path in map(pathlib.Path, paths):
    if path.is_dir():
      try:
        with os.scandir(path) as entries:
          names = sorted(entry.name for entry in entries)
      except OSError as error:
        _problem(skipped, ValueError(f"{path}: cannot list the directory "
                                     f"({error.strerror or error})"))
        continue
      for name in names:
        if not name.startswith(".") and setup_of(name) is not None:  # as glob("*_...")
          add(path / name)
    elif os.path.lexists(path):
      if setup_of(path) is None:
        _problem(skipped, ValueError(f"{path}: not named TASK_..._SHARD_generations.json"))
        continue
      add(path)
    else:
      _problem(skipped, FileNotFoundError(f"{path}: no such file or directory"))
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


# d1's generation files are a few MB; a larger file is not one of them.
MAX_GENERATION_FILE_BYTES = 1 << 30


def _read_regular_file(path: pathlib.Path) -> str:
  """The UTF-8 text of a regular file; ValueError naming it for anything else.

  ``workdir_files.open_regular``: the file's type is checked with os.stat before it is opened,
  so a FIFO or a device named like a generation file is never opened (reading a FIFO would
  wait for a writer forever). Should the path be replaced by one after the check, the
  non-blocking open and the fstat refuse it.
  """
  with workdir_files.open_regular(path, "rb", error=ValueError) as file:
    size = os.fstat(file.fileno()).st_size
    if size > MAX_GENERATION_FILE_BYTES:
      raise ValueError(f"{path}: {size} bytes, over the {MAX_GENERATION_FILE_BYTES} of a "
                       "generation file")
    try:
      data = file.read(MAX_GENERATION_FILE_BYTES + 1)
    except OSError as error:
      raise ValueError(f"{path}: cannot be read ({error.strerror or error})") from None
  if len(data) > MAX_GENERATION_FILE_BYTES:
    raise ValueError(f"{path}: over the {MAX_GENERATION_FILE_BYTES} bytes of a generation file")
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as error:
    raise ValueError(f"{path}: not UTF-8 text ({error})") from None


# The fields of a record, and the JSON types each may have (the ground truth's type is the
# task's business: a number for GSM8K, a string for MATH and sudoku, [numbers, target] for
# countdown; its scorer rejects the wrong one, see `score_generation_files`).
_RECORD_FIELDS = {"question": (str,), "generations": (str,),
                  "ground_truth": (str, int, float, list, type(None))}


def read_generation_file(path: str | pathlib.Path) -> list[dict[str, Any]]:
  """The records of one d1 generation file, its schema checked.

  Raises:
    ValueError naming the file: not a regular file (a FIFO, a device, a directory; never
    opened), unreadable, not UTF-8 JSON, nested too deeply to parse, or not {"generations":
    [{"question" (text), "generations" (text), "ground_truth"}, ...]}.
  """
  path = pathlib.Path(path)
  text = _read_regular_file(path)
  try:
    data = json.loads(text)
  except json.JSONDecodeError as error:
    raise ValueError(f"{path}: not a readable JSON file ({error})") from None
  except RecursionError:
    raise ValueError(f"{path}: JSON nested too deeply to parse") from None
  except ValueError as error:  # A number past Python's digit limit for int().
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
    for field, types in _RECORD_FIELDS.items():
      if field in record and not isinstance(record[field], types):
        what = "the completion's text" if field == "generations" else (
            "text" if types == (str,) else "a string, number, list or null")
        kind = type(record[field]).__name__
        raise ValueError(f"{path}: generations[{i}].{field} is "
                         f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}, not {what}")
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

  A file that cannot be scored (not a regular file, unreadable, malformed, an unknown task
  prefix, a record its task cannot score) is skipped whole and its reason, naming it, appended
  to ``skipped``; the other files are scored. Without ``skipped`` it raises ValueError.
  """
  results: dict[str, SetupResult] = {}
  for path in generation_files(paths, skipped):
    setup = setup_of(path)
    try:
      try:
        task = task_of(setup)
      except KeyError as error:  # An unknown task prefix.
        raise ValueError(f"{path}: {error.args[0]}") from None
      records = read_generation_file(path)
      file_result = SetupResult()
      for i, record in enumerate(records):
        try:
          score_records(task, [record], file_result)
        except Exception as error:  # pylint: disable=broad-except
          # A task's scorer on a value of the wrong kind (a countdown ground truth of strings,
          # a sudoku one of a number): the file is named, never the end of the run.
          raise ValueError(f"{path}: generations[{i}] cannot be scored as {task.name} "
                           f"({type(error).__name__}: {error})") from None
    except ValueError as error:
      message = str(error)  # Every skip names its file.
      _problem(skipped, error if message.startswith(str(path))
               else ValueError(f"{path}: {message}"))
      continue
    total = results.setdefault(setup, SetupResult())
    total.correct += file_result.correct
    total.total += file_result.total
    total.n += file_result.n
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
  # Written aside and renamed (workdir_files): a killed writer leaves no torn file that a reader
  # would score or a resumed run would take for finished, and a link at `path` is replaced, not
  # followed. The staging name does not match *_generations.json.
  workdir_files.write_text(path, json.dumps({"generations": records, **metadata}, indent=2))


def report(paths: Sequence[str | pathlib.Path], output: str | pathlib.Path | None = None
           ) -> dict[str, SetupResult]:
  """Scores `paths`, prints the table and, given `output`, writes {setup: {accuracy, n}} there.

  Paths that cannot be scored (see `score_generation_files`) are skipped: each is named on
  stderr with its reason, then their count; every other file is scored.

  Raises:
    ValueError: no generation file under `paths` could be scored.
  """
  skipped: list[str] = []
  results = score_generation_files(paths, skipped)
  for reason in skipped:
    print(f"skipped {reason}", file=sys.stderr)
  if skipped:
    print(f"skipped {len(skipped)} path{'s' if len(skipped) > 1 else ''}; scored "
          f"{sum(result.n for result in results.values())} items of {len(results)} "
          f"setup{'s' if len(results) != 1 else ''}", file=sys.stderr)
  if not results:
    raise ValueError(f"no scorable *_SHARD_generations.json files in "
                     f"{', '.join(map(str, paths))}" + (f" ({len(skipped)} skipped)"
                                                        if skipped else ""))
  print(format_table(results))
  if output:
    workdir_files.write_text(output, json.dumps(results_as_json(results), indent=2) + "\n")
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
  except (OSError, ValueError, KeyError, workdir_files.WorkdirError) as error:
    parser.error(str(error))
  return 0


if __name__ == "__main__":
  sys.exit(main())
