"""Tasks, datasets, synthetic generators and a resumable data iterator.

    task = get_task("countdown")
    examples = load_examples(task, "countdown_cd3_test.jsonl")  # packaged d1 test set
    prompt = task.prompt(examples[0])
    reward = task.reward(completion, examples[0])     # what RL optimizes
    score = task.score(completion, examples[0])       # the d1 evaluation metric

Offline, at any size: `CountdownGenerator(size, seed)`, `SudokuGenerator(size, seed, split)`.
Batches: `DataIterator(examples, batch_size, seed=...)`, with `state()` / `restore()`.

Host-side only: nothing here imports JAX.

Modules: ``base`` (``Example``, ``Task``, the registry and prompt styles), one module per task
(``countdown``, ``sudoku``, ``gsm8k``, ``math500``: prompt, reward terms, d1 score, dataset
records, generator), ``records`` (dataset files and the Hub), ``iteration`` (``DataIterator``).
To add a task: a module that builds a ``Task`` and calls ``register_task``, imported below
(docs/tasks.md).
"""

from __future__ import annotations

import dataclasses
import pathlib

from stabledrl_jax.input_files import InputError
from stabledrl_jax.tasks import countdown, gsm8k, math500, sudoku
from stabledrl_jax.tasks.base import DEFAULT_PROMPT_STYLE, DEFAULT_REWARD_SCHEME, Example, HubSource
from stabledrl_jax.tasks.base import ItemScore, PROMPT_STYLES, REWARD_SCHEMES, RewardTerm, Task
from stabledrl_jax.tasks.base import get_task, list_tasks, register_task, suite, unregister_task
from stabledrl_jax.tasks.countdown import CountdownGenerator, solve_countdown
from stabledrl_jax.tasks.iteration import DataIterator
from stabledrl_jax.tasks.records import load_hub_records, read_records
from stabledrl_jax.tasks.sudoku import SudokuGenerator, count_solutions

_LOCAL_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
# Small test sets that ship with the package (the d1 releases): pass their file name as a source.
PACKAGED_DATA = pathlib.Path(__file__).resolve().parent / "data"


def packaged_files() -> list[str]:
  """Names of the data files that ship with the package (usable as a `source`)."""
  return sorted(path.name for path in PACKAGED_DATA.iterdir() if path.is_file())


def _local_path(source: str | pathlib.Path) -> pathlib.Path | None:
  """A local file: an existing path, a path with a data suffix, or a packaged file's name."""
  path = pathlib.Path(source)
  if path.exists():
    return path
  if path.name == str(source) and (PACKAGED_DATA / path.name).is_file():
    return PACKAGED_DATA / path.name
  return path if path.suffix.lower() in _LOCAL_SUFFIXES else None


def load_examples(
    task: str | Task,
    source: str | pathlib.Path | None = None,
    *,
    split: str | None = None,
    limit: int | None = None,
) -> list[Example]:
  """Examples of a task from a local file or the Hugging Face Hub.

  Args:
    task: a `Task` or its registered name.
    source: a local .jsonl / .json / .csv / .parquet file, or the name of a packaged one
      (`packaged_files()`); a Hub dataset path ("openai/gsm8k"); a local directory laid out as
      a Hub dataset repository (read like the task's default dataset of `split`: its
      configuration, split and record filter); or None for the task's default Hub dataset of
      `split`.
    split: 'train' or 'test' for the task's default dataset (its own split name and record
      filter apply); the split of a Hub `source`; ignored for local files.
    limit: keep only the first `limit` examples.
  """
  task = get_task(task) if isinstance(task, str) else task
  local = None if source is None else _local_path(source)
  if local is not None and not local.is_dir():
    records = read_records(local)
  else:
    if local is not None:  # A local copy of a Hub dataset repository (offline, no download).
      default = task.hub_sources.get(split or "test") or HubSource(str(local))
      hub = dataclasses.replace(default, path=str(local))
    elif source is not None:
      hub = HubSource(str(source), split=split or "train")
    else:
      hub = task.hub_sources.get(split or "test")
      if hub is None:
        raise ValueError(f"Task {task.name!r} has no default Hub dataset for split "
                         f"{split or 'test'!r}; pass a local file (packaged: {packaged_files()}) "
                         "or use a synthetic generator.")
    records = load_hub_records(hub.path, hub.config, hub.split)
    if hub.keep is not None:
      records = [record for record in records if hub.keep(record)]
  if limit is not None:
    records = records[:limit]
  examples = []
  for number, record in enumerate(records, start=1):
    try:
      examples.append(task.example_from_record(record))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
      # A record of other columns or a value of the wrong kind: the file and the record named.
      where = local if local is not None and not local.is_dir() else hub.path
      kind = "" if isinstance(error, ValueError) else f"{type(error).__name__}: "
      raise InputError(f"{where}: record {number}: {kind}{error}") from None
  return examples


__all__ = [
    "DEFAULT_PROMPT_STYLE",
    "DEFAULT_REWARD_SCHEME",
    "PROMPT_STYLES",
    "REWARD_SCHEMES",
    "packaged_files",
    "PACKAGED_DATA",
    "CountdownGenerator",
    "DataIterator",
    "Example",
    "HubSource",
    "ItemScore",
    "RewardTerm",
    "SudokuGenerator",
    "Task",
    "count_solutions",
    "countdown",
    "get_task",
    "gsm8k",
    "list_tasks",
    "load_examples",
    "load_hub_records",
    "math500",
    "read_records",
    "register_task",
    "suite",
    "unregister_task",
    "solve_countdown",
    "sudoku",
]
