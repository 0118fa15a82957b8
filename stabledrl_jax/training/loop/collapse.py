"""Collapse: the ratio-noise study's rule (docs/ratio_noise_study.md), and the trainer's guard
(``train.collapse_guard``; docs/reliability.md, "Collapse guard").

A run's trajectory (one metrics record per step, ``metrics.jsonl``'s) has collapsed at the first
of:

- a step after which ``max_skipped`` updates have been skipped in all (a non-finite loss,
  gradient, update or parameters; the records' cumulative ``skipped_steps``);
- greedy eval (``eval/accuracy``) below its first value by more than ``eval_margin`` points after
  having risen above it by as much;
- the rollout reward's (``rewards/correctness``) ``window``-step mean below its first window's
  after having risen above it by ``reward_margin``.

``first_collapse`` is a pure function of the records; the study marks its runs with it and the
guard checks it after every step.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from typing import Any, Mapping, Sequence

from stabledrl_jax import workdir_files
from stabledrl_jax.training.config import run_spec as run_spec_lib

# The reward the rules (and the sweeps) watch: the task's correctness term (every task has one),
# without the terms every completion gets (StableDRL's anti-short-boxed reward).
REWARD_METRIC = "rewards/correctness"
EVAL_METRIC = "eval/accuracy"
EVENTS_FILE = "collapse_guard.json"  # <workdir>/: every collapse the guard acted on
BEST_DIR = "best_eval_checkpoint"  # <workdir>/: the state of the best eval so far
GUARD_PREFIX = "collapse_guard/"  # the metrics records the guard writes when it acts


def first_collapse(records: Sequence[Mapping[str, Any]],
                   rules: run_spec_lib.Rules) -> dict[str, Any] | None:
  """The first sign of collapse in a trajectory, ``{"step", "why"}``, or None: the earliest step
  at which any rule fires (on a tie: skipped updates, then the eval, then the reward).

  Args:
    records: the trajectory's metrics records in step order, each with ``step`` and any of
      ``skipped_steps``, ``eval/accuracy`` and ``rewards/correctness`` (values may be strings
      for inf and nan, as ``metrics.jsonl`` stores them).
    rules: the criteria.
  """
  steps = [r for r in records if REWARD_METRIC in r]
  signs = [sign for sign in (_skipped_sign(steps, rules), _eval_sign(records, rules),
                             _reward_sign(steps, rules)) if sign is not None]
  return min(signs, key=lambda sign: sign["step"]) if signs else None


def _skipped_sign(steps: list[Mapping[str, Any]],
                  rules: run_spec_lib.Rules) -> dict[str, Any] | None:
  for r in steps:
    skipped = int(float(r.get("skipped_steps", 0)))
    if skipped >= rules.max_skipped:
      return {"step": int(r["step"]), "why": ("a non-finite update was skipped" if skipped == 1
                                              else f"{skipped} non-finite updates were skipped")}
  return None


def _eval_sign(records: Sequence[Mapping[str, Any]],
               rules: run_spec_lib.Rules) -> dict[str, Any] | None:
  evals = sorted((int(r["step"]), float(r[EVAL_METRIC])) for r in records if EVAL_METRIC in r)
  if evals:
    start, rose = evals[0][1], False
    for step, value in evals[1:]:
      rose = rose or value >= start + rules.eval_margin
      if rose and value <= start - rules.eval_margin:
        return {"step": step, "why": f"eval {value:.1f} < start {start:.1f} after rising"}
  return None


def _reward_sign(steps: list[Mapping[str, Any]],
                 rules: run_spec_lib.Rules) -> dict[str, Any] | None:
  rewards = [float(r[REWARD_METRIC]) for r in steps]
  window = rules.window
  if len(rewards) >= 2 * window:
    first, rose = statistics.fmean(rewards[:window]), False
    for end in range(window, len(rewards) + 1):
      mean = statistics.fmean(rewards[end - window:end])
      rose = rose or mean >= first + rules.reward_margin
      if rose and mean <= first - rules.reward_margin:
        return {"step": int(steps[end - 1]["step"]),
                "why": f"reward {mean:.3f} < first {first:.3f} after rising"}
  return None


def events_on_resume(saved: Sequence[Mapping[str, Any]] | None,
                     written: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """The guard's events of a run resumed from a checkpoint whose meta holds ``saved`` (None: a
  checkpoint of a version that kept them in ``EVENTS_FILE`` alone), given the events
  ``written`` in that file.

  A restore saves its restored step with the event in its meta before the file is written, so
  the checkpoint is the record: the file adds only what no checkpoint carries, a stop after an
  unsaved (skipped) step, when it is the file's last event and continues the checkpoint's
  events (``saved`` is [] for a run with no checkpoint yet).
  """
  if saved is None:
    return [dict(e) for e in written]
  saved, written = [dict(e) for e in saved], [dict(e) for e in written]
  if (len(written) > len(saved) and written[:len(saved)] == saved
      and written[-1].get("action") == "stop"):
    return saved + [written[-1]]
  return saved


def lr_scale_of(events: Sequence[Mapping[str, Any]]) -> float:
  """The learning-rate scale the events leave: the last restore's (1 before any)."""
  restores = [e for e in events if e.get("action") == "restore"]
  return float(restores[-1]["lr_scale"]) if restores else 1.0


def stopped_by(events: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
  """The guard's stop that ended the run (the last event, if it is one), else None."""
  return events[-1] if events and events[-1].get("action") == "stop" else None


def restores_since_go_on(events: Sequence[Mapping[str, Any]]) -> int:
  """The restores counted against ``max_restores``: those after the last 'go on'."""
  count = 0
  for event in events:
    count = 0 if event.get("action") == "go_on" else count + (event.get("action") == "restore")
  return count


def load_events(path: Any) -> tuple[list[dict[str, Any]], float]:
  """The events and learning-rate scale a guard wrote to ``path`` (``EVENTS_FILE``); a file that
  is not one is a one-line ValueError naming it."""
  text = workdir_files.read_bytes(path, "collapse guard's events file", error=ValueError)
  try:
    saved = json.loads(text)
    events, scale = list(saved["events"]), float(saved["lr_scale"])
    if not (0 < scale <= 1 and all(isinstance(e, dict) and "action" in e for e in events)):
      raise ValueError("its values are out of range")
  except (ValueError, KeyError, TypeError) as error:
    raise ValueError(f"{path} is not the collapse guard's events file ({str(error)[:80]}); move "
                     "it aside to restart the guard's count") from None
  return events, scale


class Trajectory:
  """The records of the run as it now stands: one per step (a restore drops those after the
  restored step, and the steps run again replace them), read back from ``metrics.jsonl`` on a
  resume."""

  def __init__(self, records: Sequence[Mapping[str, Any]] = (), *, upto: int | None = None,
               after: int | None = None):
    """``upto``: the step the run resumes from (later records are dropped); ``after``: the step
    a 'go on' continued from (the rules judge only the steps after it)."""
    self._by_step: dict[int, dict[str, Any]] = {}
    for record in records:  # File order: a step run again after a restore replaces its first.
      if "step" in record and not any(k.startswith(GUARD_PREFIX) for k in record):
        self._by_step[int(record["step"])] = dict(record)
    if upto is not None:
      self.truncate(upto)
    if after is not None:
      self._by_step = {s: r for s, r in self._by_step.items() if s > after}

  def add(self, record: Mapping[str, Any]) -> None:
    self._by_step[int(record["step"])] = dict(record)

  def truncate(self, step: int) -> None:
    self._by_step = {s: r for s, r in self._by_step.items() if s <= step}

  def records(self) -> list[dict[str, Any]]:
    return [self._by_step[s] for s in sorted(self._by_step)]

  def best_eval(self) -> float | None:
    values = [float(r[EVAL_METRIC]) for r in self._by_step.values() if EVAL_METRIC in r]
    return max(values) if values else None


@dataclasses.dataclass(frozen=True)
class Decision:
  """What the guard decided after a step (``Guard.after_step``); the loop acts on it.

  Attributes:
    save_best: the step's state is the best eval so far: save it as the best checkpoint.
    event: the collapse acted on ({"step", "why", "detected_at", "action"}; a restore's also
      "restored_step", "restored_eval" and "lr_scale"), else None: train on.
    lr_scale: the learning-rate scale after the decision.
  """

  save_best: bool = False
  event: Mapping[str, Any] | None = None
  lr_scale: float = 1.0

  @property
  def action(self) -> str:
    """'continue', 'restore' or 'stop'."""
    return "continue" if self.event is None else self.event["action"]

  @property
  def restore_to(self) -> int | None:
    """The step a restore goes back to."""
    return None if self.event is None else self.event.get("restored_step")

  def record(self) -> dict[str, float]:
    """The metrics record of the decision (``GUARD_PREFIX``): the step restored to (-1: a stop)
    and the learning-rate scale; {} when it is to train on."""
    if self.event is None:
      return {}
    restored = self.event.get("restored_step")
    return {GUARD_PREFIX + "restored_to": -1 if restored is None else restored,
            GUARD_PREFIX + "lr_scale": self.lr_scale}


class Guard:
  """The collapse guard of one run (``train.collapse_guard``): it keeps the run's trajectory,
  its events and the best eval so far, and after every step decides (``after_step``) what the
  loop does: train on, restore the best eval's state with the learning rate scaled, or stop. It
  reads and writes no file: the loop saves and restores the checkpoints it names.

  Attributes:
    settings: the guard's settings.
    events: every collapse acted on, and each 'go on' (``EVENTS_FILE``).
    lr_scale: the learning-rate scale the restores left (1 before any).
    best: (step, eval) of the best eval's checkpoint, or None.
    trajectory: the run's records as it now stands.
  """

  def __init__(self, settings: run_spec_lib.GuardSettings,
               events: Sequence[Mapping[str, Any]] = (), *,
               best: tuple[int, float | None] | None = None,
               trajectory: Trajectory | None = None):
    self.settings = settings
    self.events = [dict(e) for e in events]
    self.lr_scale = lr_scale_of(self.events)
    self.best = best
    self.trajectory = Trajectory() if trajectory is None else trajectory

  @property
  def stopped(self) -> Mapping[str, Any] | None:
    """The stop that ended the run (``stopped_by``), else None."""
    return stopped_by(self.events)

  @classmethod
  def resume(cls, settings: run_spec_lib.GuardSettings, *,
             saved: Sequence[Mapping[str, Any]] | None, written: Sequence[Mapping[str, Any]],
             start_step: int) -> Guard:
    """The guard of a run started (``saved`` = []) or resumed at ``start_step`` from a
    checkpoint whose meta holds the events ``saved`` (``events_on_resume``; ``written``: the
    events file's). A run the guard stopped stays stopped (``stopped``) unless
    ``settings.go_on``: then a 'go on' event is added, from which the rules judge the run
    (``read_trajectory``) and the restores are counted afresh."""
    guard = cls(settings, events_on_resume(saved, written))
    if guard.stopped is not None and settings.go_on:
      guard.events.append({"action": "go_on", "step": start_step})
    return guard

  def read_trajectory(self, records: Sequence[Mapping[str, Any]], start_step: int) -> None:
    """The trajectory of a run resumed at ``start_step`` from its metrics ``records``: those up
    to it, after the last 'go on'."""
    go_on = [e["step"] for e in self.events if e.get("action") == "go_on"]
    self.trajectory = Trajectory(records, upto=start_step, after=go_on[-1] if go_on else None)

  @property
  def went_on_at(self) -> int | None:
    """The step of the last event if it is a 'go on', else None."""
    last = self.events[-1] if self.events else {}
    return last.get("step") if last.get("action") == "go_on" else None

  def start(self, record: Mapping[str, Any]) -> bool:
    """The start's evaluation (step 0); whether to save it as the best checkpoint."""
    return self._track(0, record, healthy=True)

  def _track(self, done: int, record: Mapping[str, Any], healthy: bool) -> bool:
    before = self.trajectory.best_eval()
    self.trajectory.add({"step": done, **record})
    value = record.get(EVAL_METRIC)
    if healthy and value is not None and (before is None or float(value) > before):
      self.best = (done, float(value))
      return True
    return False

  def after_step(self, done: int, record: Mapping[str, Any], healthy: bool) -> Decision:
    """The decision after step ``done`` (its metrics ``record``; ``healthy``: no update of it
    was skipped), before its checkpoint. A restore needs a best eval before the collapse (an
    eval rule's always is) and fewer than ``max_restores`` restores since the last 'go on'."""
    save_best = self._track(done, record, healthy)
    event = first_collapse(self.trajectory.records(), self.settings.rules)
    if event is None:
      return Decision(save_best=save_best, lr_scale=self.lr_scale)
    best_step = None if self.best is None else self.best[0]
    restore = (self.settings.action == "restore"
               and restores_since_go_on(self.events) < self.settings.max_restores
               and best_step is not None and best_step < event["step"])
    event = {**event, "detected_at": done, "action": "restore" if restore else "stop"}
    if restore:
      self.lr_scale *= self.settings.lr_factor
      self.trajectory.truncate(best_step)
      event.update(restored_step=best_step, restored_eval=self.best[1], lr_scale=self.lr_scale)
    self.events.append(event)
    return Decision(save_best=save_best, event=event, lr_scale=self.lr_scale)

  def dump(self) -> str:
    """The ``EVENTS_FILE`` text."""
    return json.dumps({"events": self.events, "lr_scale": self.lr_scale}, indent=2)
