"""Per-step metrics: one JSON object per line in ``<workdir>/metrics.jsonl``, mirrored to TensorBoard
(and to W&B when ``config.logging.wandb.project`` is set); sample completions in
``<workdir>/samples.jsonl`` and as TensorBoard text.

The workdir may be local or remote (``gs://``): paths go through ``etils.epath``. Locally each
record is appended and flushed; object stores cannot append, so there the file is rewritten
whole (through a temporary name) after each record. Only process 0 writes.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import time
from typing import Any, Mapping

import numpy as np
from absl import logging
from etils import epath

from stabledrl_jax import workdir_files


def _import_tensorboardx():
  """tensorboardX, imported without torch.

  tensorboardX's package imports torch when it is installed (the ``peft`` extra installs it),
  only to accept torch tensors, which this writer never passes: 1.8 s of every run's start on
  a 2-core machine. torch is hidden while tensorboardX loads (it takes torch as optional) and
  shown again after; where torch is already loaded, nothing is hidden.
  """
  if "tensorboardX" in sys.modules or "torch" in sys.modules:
    import tensorboardX  # pylint: disable=g-import-not-at-top
    return tensorboardX
  sys.modules["torch"] = None  # An ``import torch`` now raises ImportError.
  try:
    import tensorboardX  # pylint: disable=g-import-not-at-top
  finally:
    if sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
  return tensorboardX


def _to_python(value: Any) -> Any:
  value = np.asarray(value).item() if not isinstance(value, (int, float, str)) else value
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)  # JSON has no inf / nan; keep them visible as strings.
  return value


def read_metrics(path: epath.PathLike, what: str = "metrics log") -> list[dict[str, Any]]:
  """The records of a metrics.jsonl file (``what`` it is, for an error), in file order.

  A line that does not parse as a JSON object (torn by a crash, cut by hand) is reported and
  skipped; it never hides the lines after it. No file: no records. A FIFO, a directory or a
  device in its place is a ``WorkdirError`` naming it, never opened (``workdir_files``).
  """
  path = epath.Path(path)
  text = workdir_files.read_text(path, what, missing_ok=True)
  if text is None:
    return []
  records = []
  for number, line in enumerate(text.splitlines(), start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      record = None
    if not isinstance(record, dict):
      logging.warning("%s, line %d: not a JSON record, skipped: %.80r", path, number, line)
      continue
    records.append(record)
  return records


class _JsonlLog:
  """One JSON-lines file of records with a ``step``, appended (local) or rewritten (remote).

  On resume it keeps its first ``keep`` records (the count the resumed checkpoint saved), or
  where that is not known (None: a checkpoint of an older version) those of steps <=
  ``resume_step``."""

  def __init__(self, path: epath.Path, *, local: bool, resume_step: int,
               keep: int | None = None):
    self.path = path
    records = read_metrics(path, f"{path.stem} log")
    records = (records[:keep] if keep is not None else
               [r for r in records if r.get("step", 0) <= resume_step])
    lines = [json.dumps(r) + "\n" for r in records]
    self.count = len(lines)
    # Rewritten aside and renamed over it: a kill during the rewrite must not lose the history,
    # and a link in its place is replaced, never followed (``workdir_files``).
    workdir_files.write_text(path, "".join(lines))
    self._file = workdir_files.open_append(path) if local else None
    self._lines = None if local else lines  # Kept only where each record rewrites the file.

  def append(self, record: Mapping[str, Any]) -> None:
    line = json.dumps(record) + "\n"
    self.count += 1
    if self._file is not None:
      self._file.write(line)
      self._file.flush()
    else:  # The whole file each time: object stores cannot append.
      self._lines.append(line)
      workdir_files.write_text(self.path, "".join(self._lines))

  def close(self) -> None:
    if self._file is not None:
      self._file.close()


class _Wandb:
  """Scalars mirrored to Weights & Biases (optional; ``config.logging.wandb.project``)."""

  def __init__(self, workdir: epath.Path, settings: Mapping[str, Any], config: Mapping[str, Any]):
    try:
      import wandb  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise ImportError("config.logging.wandb.project is set, but the `wandb` package is not "
                        "installed: pip install wandb (or unset the project)") from None
    # The run id lives in the workdir, so that a resumed run continues the same W&B run.
    id_file = workdir / "wandb_run_id"
    run_id = (workdir_files.read_text(id_file, "W&B run id file", missing_ok=True) or "").strip()
    run_id = run_id or wandb.util.generate_id()
    workdir_files.write_text(id_file, run_id)
    self._run = wandb.init(project=settings["project"], entity=settings.get("entity") or None,
                           name=settings.get("name") or workdir.name, id=run_id,
                           resume="allow", config=dict(config))

  def log(self, step: int, metrics: Mapping[str, Any]) -> None:
    self._run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

  def close(self) -> None:
    self._run.finish()


# How often a remote (gs://) events file is flushed: each flush uploads the whole file.
REMOTE_FLUSH_S = 60.0


class _EventFile:
  """TensorBoard's events file, written synchronously in the caller's thread.

  tensorboardX's ``SummaryWriter`` hands each event to a thread through a bounded queue; when a
  write fails (a full disk) that thread dies and the next ``put`` waits for good: the training
  loop hung. Here each record's events are written and flushed by the caller (tensorboardX's
  own ``EventsWriter``, protos and summaries), so a failed write is an ``OSError`` where it
  happens (``WorkdirError`` naming the file) and nothing can block. The events file is a new
  name in a real directory of the workdir (a random suffix: no link planted under the name it
  will take); ``purge_step`` marks where a resumed run takes over (TensorBoard drops the older
  run's events from that step on).
  """

  def __init__(self, directory: epath.Path, purge_step: int):
    tensorboardX = _import_tensorboardx()
    from tensorboardX import event_file_writer, summary  # pylint: disable=g-import-not-at-top
    from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
    self._summary, self._pb2 = summary, event_pb2
    del tensorboardX
    with workdir_files.writing(directory):
      workdir_files.make_dir(directory)
      self._writer = event_file_writer.EventsWriter(
          os.path.join(str(directory), "events"), f".{secrets.token_hex(4)}")
    self.path = self._writer._file_name  # pylint: disable=protected-access
    self._local, self._flushed = workdir_files.is_local(directory), time.monotonic()
    self._write([self._pb2.Event(step=purge_step, session_log=self._pb2.SessionLog(
        status=self._pb2.SessionLog.START))])

  def _write(self, events: list[Any]) -> None:
    """Writes ``events``; flushes them at once locally, and to a remote file (whose flush
    uploads it whole) at most every ``REMOTE_FLUSH_S`` seconds and at ``close``."""
    with workdir_files.writing(self.path):
      for event in events:
        event.wall_time = event.wall_time or time.time()
        self._writer.write_event(event)
      if self._local or time.monotonic() - self._flushed >= REMOTE_FLUSH_S:
        self._writer.flush()
        self._flushed = time.monotonic()

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    self._write([self._pb2.Event(step=step, summary=self._summary.scalar(name, value))
                 for name, value in values.items()])

  def text(self, step: int, tag: str, text: str) -> None:
    self._write([self._pb2.Event(step=step, summary=self._summary.text(tag, text))])

  def close(self) -> None:
    with workdir_files.writing(self.path):
      self._writer.close()


class MetricsWriter:
  """Appends ``{"step": ..., **metrics}`` lines and TensorBoard scalars.

  On resume the file is cut back to what it held when the resumed checkpoint was saved
  (``resume_records``, the counts that checkpoint keeps; or, for a checkpoint without them,
  every record of a step <= ``resume_step``), so that it equals the file an uninterrupted run
  writes, after a collapse guard's restore as well; a torn line is reported and skipped.
  Every write happens in the caller's thread: a failed one raises there, none can block.
  """

  def __init__(self, workdir: epath.PathLike, *, resume_step: int = 0,
               resume_records: Mapping[str, int] | None = None, tensorboard: bool = True,
               wandb: Mapping[str, Any] | None = None, config: Mapping[str, Any] | None = None):
    """Args:
      workdir: the run's directory (local or ``gs://``).
      resume_step: the step the run resumes from.
      resume_records: {"metrics": n, "samples": m}: the records to keep (None: those of steps
        <= ``resume_step``).
      tensorboard: also write TensorBoard events under ``<workdir>/tensorboard``.
      wandb: ``config.logging.wandb``; with a ``project``, scalars also go to W&B.
      config: the run's config, recorded by W&B.
    """
    workdir = epath.Path(workdir)
    self.path = workdir / "metrics.jsonl"
    local = workdir_files.is_local(workdir)
    keep = resume_records or {}
    self._metrics = _JsonlLog(self.path, local=local, resume_step=resume_step,
                              keep=keep.get("metrics"))
    self._samples = _JsonlLog(workdir / "samples.jsonl", local=local, resume_step=resume_step,
                              keep=keep.get("samples"))
    self._tb = _EventFile(workdir / "tensorboard", resume_step + 1) if tensorboard else None
    self._wandb = (_Wandb(workdir, wandb, config or {}) if wandb and wandb.get("project")
                   else None)

  def counts(self) -> dict[str, int]:
    """{"metrics": records in metrics.jsonl, "samples": in samples.jsonl}, as a checkpoint
    saves them (``resume_records``)."""
    return {"metrics": self._metrics.count, "samples": self._samples.count}

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    record = {"step": int(step), **{k: _to_python(v) for k, v in metrics.items()}}
    self._metrics.append(record)
    scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
    if self._tb is not None:
      self._tb.scalars(step, scalars)
    if self._wandb is not None:
      self._wandb.log(step, scalars)

  def write_samples(self, step: int, samples: list[Mapping[str, Any]]) -> None:
    """A few rollouts of ``step`` (prompt, completion, reward): one line each in
    ``samples.jsonl``, and one TensorBoard text entry."""
    for sample in samples:
      self._samples.append({"step": int(step), **{k: _to_python(v) for k, v in sample.items()}})
    if self._tb is not None and samples:
      text = "\n\n".join(f"**reward {float(x['reward']):.3f}**\n\n    "
                          + str(x["prompt"]).replace("\n", "\n    ") + "\n    ---\n    "
                          + str(x["completion"]).replace("\n", "\n    ") for x in samples)
      self._tb.text(step, "samples", text)

  def close(self) -> None:
    self._metrics.close()
    self._samples.close()
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      self._wandb.close()
