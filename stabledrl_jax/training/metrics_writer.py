"""Per-step metrics: one JSON object per line in ``<workdir>/metrics.jsonl``, mirrored to TensorBoard."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import numpy as np


def _to_python(value: Any) -> Any:
  value = np.asarray(value).item() if not isinstance(value, (int, float, str)) else value
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)  # JSON has no inf / nan; keep them visible as strings.
  return value


def read_metrics(path: str) -> list[dict[str, Any]]:
  """The records of a metrics.jsonl file (a torn last line from a crash is dropped)."""
  if not os.path.exists(path):
    return []
  records = []
  with open(path) as f:
    for line in f:
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        break
  return records


class MetricsWriter:
  """Appends ``{"step": ..., **metrics}`` lines and TensorBoard scalars.

  On resume from step ``s``, records of steps > ``s`` (written after the last
  checkpoint by the interrupted run) are dropped, so that the file equals the
  one an uninterrupted run writes.
  """

  def __init__(self, workdir: str, *, resume_step: int = 0, tensorboard: bool = True):
    self.path = os.path.join(workdir, "metrics.jsonl")
    kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
    # Rewrite atomically: a kill during the rewrite must not lose the history.
    with open(self.path + ".tmp", "w") as f:
      for record in kept:
        f.write(json.dumps(record) + "\n")
    os.replace(self.path + ".tmp", self.path)
    self._file = open(self.path, "a")
    self._tb = None
    if tensorboard:
      import tensorboardX  # Imported lazily: only the writer needs it.
      self._tb = tensorboardX.SummaryWriter(os.path.join(workdir, "tensorboard"),
                                            purge_step=resume_step + 1)

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    record = {"step": int(step), **{k: _to_python(v) for k, v in metrics.items()}}
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._tb is not None:
      for name, value in record.items():
        if name != "step" and isinstance(value, (int, float)):
          self._tb.add_scalar(name, value, step)

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()
