"""Per-step metrics: one JSON object per line in ``<workdir>/metrics.jsonl``, mirrored to TensorBoard.

The workdir may be local or remote (``gs://``): paths go through ``etils.epath``. Locally each
record is appended and flushed; object stores cannot append, so there the file is rewritten
whole (through a temporary name) after each record. Only process 0 writes.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

import numpy as np
from etils import epath

from stabledrl_jax.training import checkpointing


def _to_python(value: Any) -> Any:
  value = np.asarray(value).item() if not isinstance(value, (int, float, str)) else value
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)  # JSON has no inf / nan; keep them visible as strings.
  return value


def read_metrics(path: epath.PathLike) -> list[dict[str, Any]]:
  """The records of a metrics.jsonl file (a torn last line from a crash is dropped)."""
  path = epath.Path(path)
  if not path.exists():
    return []
  records = []
  for line in path.read_text().splitlines():
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      break
  return records


def _write_atomically(path: epath.Path, text: str) -> None:
  staging = path.parent / (path.name + ".tmp")
  staging.write_text(text)
  staging.replace(path)


class MetricsWriter:
  """Appends ``{"step": ..., **metrics}`` lines and TensorBoard scalars.

  On resume from step ``s``, records of steps > ``s`` (written after the last
  checkpoint by the interrupted run) are dropped, so that the file equals the
  one an uninterrupted run writes.
  """

  def __init__(self, workdir: epath.PathLike, *, resume_step: int = 0, tensorboard: bool = True):
    workdir = epath.Path(workdir)
    self.path = workdir / "metrics.jsonl"
    self._local = checkpointing.is_local(workdir)
    self._lines = [json.dumps(r) + "\n" for r in read_metrics(self.path)
                   if r.get("step", 0) <= resume_step]
    # Rewritten atomically: a kill during the rewrite must not lose the history.
    _write_atomically(self.path, "".join(self._lines))
    self._file = self.path.open("a") if self._local else None
    self._tb = None
    if tensorboard:
      import tensorboardX  # Imported lazily: only the writer needs it.
      self._tb = tensorboardX.SummaryWriter(str(workdir / "tensorboard"),
                                            purge_step=resume_step + 1)

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    record = {"step": int(step), **{k: _to_python(v) for k, v in metrics.items()}}
    line = json.dumps(record) + "\n"
    if self._file is not None:
      self._file.write(line)
      self._file.flush()
    else:  # The whole file each time: object stores cannot append.
      self._lines.append(line)
      _write_atomically(self.path, "".join(self._lines))
    if self._tb is not None:
      for name, value in record.items():
        if name != "step" and isinstance(value, (int, float)):
          self._tb.add_scalar(name, value, step)

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
    if self._tb is not None:
      self._tb.close()
