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
import secrets
import sys
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


def read_metrics(path: epath.PathLike) -> list[dict[str, Any]]:
  """The records of a metrics.jsonl file, in file order.

  A line that does not parse as a JSON object (torn by a crash, cut by hand) is reported and
  skipped; it never hides the lines after it.
  """
  path = epath.Path(path)
  if not path.exists():
    return []
  records = []
  for number, line in enumerate(path.read_text().splitlines(), start=1):
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
  """One JSON-lines file of records with a ``step``, appended (local) or rewritten (remote)."""

  def __init__(self, path: epath.Path, *, local: bool, resume_step: int):
    self.path = path
    lines = [json.dumps(r) + "\n" for r in read_metrics(path) if r.get("step", 0) <= resume_step]
    # Rewritten aside and renamed over it: a kill during the rewrite must not lose the history,
    # and a link in its place is replaced, never followed (``workdir_files``).
    workdir_files.write_text(path, "".join(lines))
    self._file = workdir_files.open_append(path) if local else None
    self._lines = None if local else lines  # Kept only where each record rewrites the file.

  def append(self, record: Mapping[str, Any]) -> None:
    line = json.dumps(record) + "\n"
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
    run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
    workdir_files.write_text(id_file, run_id)
    self._run = wandb.init(project=settings["project"], entity=settings.get("entity") or None,
                           name=settings.get("name") or workdir.name, id=run_id,
                           resume="allow", config=dict(config))

  def log(self, step: int, metrics: Mapping[str, Any]) -> None:
    self._run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

  def close(self) -> None:
    self._run.finish()


class MetricsWriter:
  """Appends ``{"step": ..., **metrics}`` lines and TensorBoard scalars.

  On resume from step ``s``, every record of a step <= ``s`` is kept and the records of steps
  > ``s`` (written after the last checkpoint by the interrupted run) are dropped, so that the
  file equals the one an uninterrupted run writes; a torn line is reported and skipped.
  """

  def __init__(self, workdir: epath.PathLike, *, resume_step: int = 0, tensorboard: bool = True,
               wandb: Mapping[str, Any] | None = None, config: Mapping[str, Any] | None = None):
    """Args:
      workdir: the run's directory (local or ``gs://``).
      resume_step: the step the run resumes from; later records are dropped.
      tensorboard: also write TensorBoard events under ``<workdir>/tensorboard``.
      wandb: ``config.logging.wandb``; with a ``project``, scalars also go to W&B.
      config: the run's config, recorded by W&B.
    """
    workdir = epath.Path(workdir)
    self.path = workdir / "metrics.jsonl"
    local = workdir_files.is_local(workdir)
    self._metrics = _JsonlLog(self.path, local=local, resume_step=resume_step)
    self._samples = _JsonlLog(workdir / "samples.jsonl", local=local, resume_step=resume_step)
    self._tb = None
    if tensorboard:
      tensorboardX = _import_tensorboardx()
      # Its events file is a new name in a real directory of the workdir (a random suffix: no
      # link planted under the name it will take).
      self._tb = tensorboardX.SummaryWriter(
          str(workdir_files.make_dir(workdir / "tensorboard")), purge_step=resume_step + 1,
          filename_suffix=f".{secrets.token_hex(4)}")
    self._wandb = (_Wandb(workdir, wandb, config or {}) if wandb and wandb.get("project")
                   else None)

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    record = {"step": int(step), **{k: _to_python(v) for k, v in metrics.items()}}
    self._metrics.append(record)
    scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
    if self._tb is not None:
      for name, value in scalars.items():
        self._tb.add_scalar(name, value, step)
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
      self._tb.add_text("samples", text, step)

  def close(self) -> None:
    self._metrics.close()
    self._samples.close()
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      self._wandb.close()
