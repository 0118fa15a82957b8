"""The spike recorder: the evidence of a gradient spike, kept for a post-mortem (docs/diagnostics.md).

A step is a spike when its largest pre-clip gradient norm (over its inner updates) exceeds
``diagnostics.spike_factor`` times the median of the previous ``diagnostics.spike_window`` steps'
(once ``spike_min_history`` of them are known; steps with a zero norm do not count), or when an
update was skipped as non-finite. The trainer then writes ``<workdir>/spikes/step_<n>.npz``
(``SPIKE_FIELDS``) and a ``spike/step`` line in metrics.jsonl; ``experiments/spike_report.py``
reads the folder.
"""

from __future__ import annotations

import collections
import io
import math
import re
from typing import Any

import numpy as np
from etils import epath

from stabledrl_jax import workdir_files

SPIKES_DIR = "spikes"

# What a spike file holds. N rollouts of the step, I inner updates.
SPIKE_FIELDS = {
    "step": "[] the RL step (as in metrics.jsonl)",
    "reason": "[] 'grad_norm' (above factor x median) or 'non_finite' (an update was skipped)",
    "grad_norm": "[I] pre-clip gradient norm of each inner update",
    "median": "[] median gradient norm of the previous steps (NaN before enough history)",
    "factor": "[] the spike factor",
    "prompts": "[N] prompt text",
    "completions": "[N] completion text",
    "rewards": "[N] rewards",
    "advantages": "[N] advantages",
    "stressed": "[N] bool, stress-test samples (all False outside the stress test)",
    "per_sample/<name>": "[I, N] per inner update: log_ratio (l_theta - l_old), weight (the "
                         "coefficient of the sample's gradient: SNIS weight, GRPO's ratio or 0 "
                         "where clipped), grad_norm (||grad s_j||, with train.gradient_bound)",
}


class SpikeDetector:
  """Running median of a step statistic; ``check(norms, skipped)`` says whether a step spiked.

  Host-side state only (the window restarts on resume). ``factor = 0`` turns spikes off but
  still reports non-finite steps.
  """

  def __init__(self, factor: float, window: int = 20, min_history: int = 5):
    if factor < 0 or window < 1 or min_history < 1:
      raise ValueError(f"spike detector: needs factor >= 0, window >= 1, min_history >= 1; got "
                       f"{factor}, {window}, {min_history}")
    self.factor, self.min_history = factor, min_history
    self.history: collections.deque[float] = collections.deque(maxlen=window)

  def median(self) -> float:
    return float(np.median(self.history)) if len(self.history) >= self.min_history else math.nan

  def check(self, grad_norms: np.ndarray, skipped: bool) -> tuple[str | None, float, float]:
    """(reason or None, this step's norm, the median before it).

    The norm joins the history if finite and positive: a zero norm (every group's rewards
    equal, so every advantage 0) says nothing of the gradient's scale, and a window of them
    would make the next nonzero step an infinite spike.
    """
    norm = float(np.max(grad_norms))
    median = self.median()
    reason = None
    if skipped or not math.isfinite(norm):
      reason = "non_finite"
    elif self.factor and math.isfinite(median) and norm > self.factor * median:
      reason = "grad_norm"
    if math.isfinite(norm) and norm > 0:
      self.history.append(norm)
    return reason, norm, median


def spike_path(workdir: epath.PathLike, step: int) -> epath.Path:
  return epath.Path(workdir) / SPIKES_DIR / f"step_{step}.npz"


def write_spike(workdir: epath.PathLike, step: int, arrays: dict[str, Any]) -> epath.Path:
  """Writes ``arrays`` (``SPIKE_FIELDS``) as one compressed npz (local or gs://)."""
  path = spike_path(workdir, step)
  workdir_files.make_dir(path.parent)
  buffer = io.BytesIO()
  np.savez_compressed(buffer, **{k: np.asarray(v) for k, v in arrays.items()})
  workdir_files.write_bytes(path, buffer.getvalue())
  return path


def read_spike(path: epath.PathLike) -> dict[str, np.ndarray]:
  """A spike file's arrays by name (strings as numpy unicode arrays, no pickles)."""
  path = epath.Path(path)
  content = workdir_files.read_bytes(path, "spike file", error=ValueError)  # Never a FIFO.
  try:
    with np.load(io.BytesIO(content), allow_pickle=False) as data:
      return {name: data[name] for name in data.files}
  except (OSError, ValueError) as error:
    raise ValueError(f"{path}: not a readable spike file ({error})") from None


def spike_files(workdir_or_dir: epath.PathLike) -> list[epath.Path]:
  """The spike files of a workdir (or of its spikes/ folder), by step."""
  root = epath.Path(workdir_or_dir)
  if (root / SPIKES_DIR).is_dir():
    root = root / SPIKES_DIR
  steps = {p: re.fullmatch(r"step_(\d+)\.npz", p.name) for p in root.glob("step_*.npz")}
  return sorted((p for p, m in steps.items() if m), key=lambda p: int(steps[p].group(1)))
