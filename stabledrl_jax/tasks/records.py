"""Reading raw dataset records from local files or the Hugging Face Hub.

A record is a flat dict, one per problem: a JSONL line, a CSV row (all values are strings), a
Parquet row or a Hub dataset row. Tasks turn records into `Example`s.

Parquet needs `pyarrow` and the Hub needs `datasets`; both are optional and imported only when
used, with an error that says what to install.
"""

from __future__ import annotations

import csv
import json
import os
import pathlib
from typing import Any

from stabledrl_jax import input_files, workdir_files


def _open(path: pathlib.Path, mode: str = "r", **options):
  """``path`` opened only as the regular file ``input_files.check`` found (a FIFO put there
  since is refused, never opened: ``workdir_files.open_regular``)."""
  return workdir_files.open_regular(path, mode, error=input_files.InputError, **options)


def _read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
  records = []
  with _open(path) as file:
    for line_number, line in enumerate(file, start=1):
      if not line.strip():
        continue
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{line_number}: not JSON: {error}") from None
  return records


def _read_json(path: pathlib.Path) -> list[dict[str, Any]]:
  """A JSON list of records, or a d1 generation file ({"generations": [...]})."""
  with _open(path) as file:
    data = json.loads(file.read())
  if isinstance(data, dict) and isinstance(data.get("generations"), list):
    return data["generations"]
  if isinstance(data, list):
    return data
  raise ValueError(f"{path}: expected a list of records or a d1 generations file.")


def _read_csv(path: pathlib.Path) -> list[dict[str, Any]]:
  # Values stay strings: sudoku grids such as "0140..." must keep their leading zeros.
  with _open(path, newline="") as file:
    return list(csv.DictReader(file))


def _read_parquet(path: pathlib.Path) -> list[dict[str, Any]]:
  try:
    import pyarrow.parquet  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError(
        f"Reading {path} needs pyarrow, which is not installed: pip install pyarrow") from None
  with _open(path, "rb") as file:
    return pyarrow.parquet.read_table(file).to_pylist()


_READERS = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".csv": _read_csv,
    ".parquet": _read_parquet,
}


def read_records(path: str | pathlib.Path) -> list[dict[str, Any]]:
  """All records of a local .jsonl, .json, .csv or .parquet file, in file order.

  Raises:
    input_files.InputError (a ValueError) naming the file and the reason: an unsupported
    extension, no such file, not a regular file (a FIFO or a device is never opened), empty,
    not readable, not UTF-8 text, malformed, or no records in it.
  """
  path = pathlib.Path(path)
  reader = _READERS.get(path.suffix.lower())
  if reader is None:
    raise input_files.InputError(
        f"{path}: unsupported extension; expected one of {sorted(_READERS)}")
  input_files.check(path)
  try:
    records = reader(path)
  except UnicodeDecodeError as error:
    raise input_files.InputError(f"{path}: not UTF-8 text ({error.reason} at byte "
                                 f"{error.start})") from None
  except OSError as error:
    raise input_files.InputError(f"{path}: not readable ({error.strerror or error})") from None
  except ImportError:
    raise
  except Exception as error:  # pylint: disable=broad-except  (csv.Error, JSON, pyarrow's own)
    message = input_files.first_line(error)
    raise input_files.InputError(
        message if message.startswith(str(path)) else f"{path}: {message}") from None
  if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
    bad = next((r for r in records if not isinstance(r, dict)), records)
    raise input_files.InputError(f"{path}: a record is a {type(bad).__name__}, not an object "
                                 "of named fields")
  if not records:
    raise input_files.InputError(f"{path}: no records")
  return records


def load_hub_records(path: str, config: str | None = None,
                     split: str = "train") -> list[dict[str, Any]]:
  """All rows of a Hugging Face Hub dataset split (needs `datasets` and network access)."""
  try:
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError(
        f"Loading {path!r} from the Hugging Face Hub needs the `datasets` extra: pip install "
        "'stabledrl_jax[datasets]' (and network access, or the dataset in the Hub cache with "
        "HF_HUB_OFFLINE=1). Otherwise pass a local .jsonl/.csv/.parquet file, or use the "
        "synthetic generators.") from None
  try:
    dataset = datasets.load_dataset(path, config, split=split)
  except Exception as error:  # pylint: disable=broad-except  (datasets raises many kinds)
    where = ("a local directory, read as a Hugging Face dataset repository"
             if os.path.isdir(path) else "not a local file, and as a Hugging Face dataset")
    raise input_files.InputError(
        f"{path!r}: {where}, could not be loaded ({type(error).__name__}: "
        f"{input_files.first_line(error)}). Pass a local .jsonl/.json/.csv/.parquet file"
        ) from None
  records = [dict(row) for row in dataset]
  if not records:
    raise input_files.InputError(f"{path!r}: split {split!r} has no records")
  return records
