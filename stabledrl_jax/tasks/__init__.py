"""Tasks, datasets, synthetic generators and a resumable data iterator.

    task = get_task("countdown")
    examples = load_examples(task, "../shared/data/countdown_cd3_test.jsonl")
    prompt = task.prompt(examples[0])
    reward = task.reward(completion, examples[0])     # what RL optimizes
    score = task.score(completion, examples[0])       # the d1 evaluation metric

Offline, at any size: `CountdownGenerator(size, seed)`, `SudokuGenerator(size, seed, split)`.
Batches: `DataIterator(examples, batch_size, seed=...)`, with `state()` / `restore()`.

Host-side only: nothing here imports JAX.
"""

from __future__ import annotations

import pathlib

from stabledrl_jax.tasks import countdown
from stabledrl_jax.tasks import gsm8k
from stabledrl_jax.tasks import math500
from stabledrl_jax.tasks import sudoku
from stabledrl_jax.tasks.base import Example
from stabledrl_jax.tasks.base import get_task
from stabledrl_jax.tasks.base import HubSource
from stabledrl_jax.tasks.base import ItemScore
from stabledrl_jax.tasks.base import list_tasks
from stabledrl_jax.tasks.base import register_task
from stabledrl_jax.tasks.base import RewardTerm
from stabledrl_jax.tasks.base import Task
from stabledrl_jax.tasks.countdown import CountdownGenerator
from stabledrl_jax.tasks.countdown import solve_countdown
from stabledrl_jax.tasks.iteration import DataIterator
from stabledrl_jax.tasks.records import load_hub_records
from stabledrl_jax.tasks.records import read_records
from stabledrl_jax.tasks.sudoku import count_solutions
from stabledrl_jax.tasks.sudoku import SudokuGenerator

_LOCAL_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


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
    source: a local .jsonl / .json / .csv / .parquet file; or a Hub dataset path
      ("openai/gsm8k"); or None for the task's default Hub dataset.
    split: Hub split (default: the task's); ignored for local files.
    limit: keep only the first `limit` examples.
  """
  task = get_task(task) if isinstance(task, str) else task
  if source is not None and (pathlib.Path(source).suffix.lower() in _LOCAL_SUFFIXES
                             or pathlib.Path(source).exists()):
    records = read_records(source)
  else:
    hub = task.hub_source
    if source is not None:
      hub = HubSource(str(source), split=split or "train")
    elif hub is None:
      raise ValueError(f"Task {task.name!r} has no Hub dataset; pass a local file or use a "
                       "synthetic generator.")
    records = load_hub_records(hub.path, hub.config, split or hub.split)
  if limit is not None:
    records = records[:limit]
  return [task.example_from_record(record) for record in records]


__all__ = [
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
    "solve_countdown",
    "sudoku",
]
