"""Many runs from one supervised start: the objective comparison and the stress test.

Every run of a sweep copies the same fitted supervised model into its workdir, so that objectives
differ only in what the sweep sets. Host-side glue over ``trainer.train``; nothing here is jitted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Any

import ml_collections
from etils import epath

from stabledrl_jax import objectives, workdir_files
from stabledrl_jax.training.loop import collapse, metrics_writer, trainer
from stabledrl_jax.training.state import supervised

_RESULT_FILE = "run_result.json"
_BEGUN_FILE = "run_config.json"  # Written when a run starts: a cut run of this config resumes.
# The reward the sweeps report (the collapse rule's, written once there).
REWARD_METRIC = collapse.REWARD_METRIC

# A toy-size run of the quickstart-based configs (seconds per run): the experiments' tests, and
# the notebooks where TOY_ENV is "1" (CI's notebook tests run their cells at this size).
TOY_OVERRIDES = {"sft.num_steps": 20, "sft.batch_size": 16, "data.train_size": 64,
                 "data.eval_size": 8, "eval.batch_size": 8, "train.num_steps": 2,
                 "rollout.num_prompts": 2, "rollout.group_size": 4}
TOY_ENV = "STABLEDRL_NOTEBOOK_TOY"


def notebook_size(overrides: dict[str, Any]) -> dict[str, Any]:
  """A notebook's config ``overrides``, with ``TOY_OVERRIDES`` over them where the environment
  variable STABLEDRL_NOTEBOOK_TOY is "1" (the same cells, at toy size)."""
  if os.environ.get(TOY_ENV, "") == "1":
    return {**overrides, **TOY_OVERRIDES}
  return dict(overrides)


def objective_variants() -> dict[str, dict[str, Any]]:
  """The objectives compared, as {name: config overrides as dotted paths}: every registered
  objective, or its registered variants (``grpo_token``, ``grpo_sequence``). Each runs with its
  official loss and estimator settings, except what the sweep's config sets for all of them
  (every other training setting is shared)."""
  variants = {}
  for objective in objectives.objectives():
    for variant, overrides in objective.variant_overrides().items():
      variants[variant] = {"objective.name": objective.name, **{
          f"objective.{objective.name}.{field}": value for field, value in overrides.items()}}
  return variants


def fitted_block_random(completion_length: int) -> dict[str, Any]:
  """``block_random`` fitted to a toy whose completion copies its prompt: one block over the
  whole completion, no prompt token masked (docs/stress_test.md: the published 15% prompt
  masking multiplies the estimator's noise there)."""
  return {"estimator.prompt_mask_prob": 0.0, "estimator.block_length": completion_length}


def select_objectives(names: list[str] | None) -> list[str]:
  """``names`` (None: every variant), checked against ``objective_variants()``."""
  known = objective_variants()
  if not names:
    return list(known)
  unknown = sorted(set(names) - set(known))
  if unknown:
    raise ValueError(f"unknown objectives {unknown}; known: {list(known)}")
  return list(names)


def with_overrides(config: ml_collections.ConfigDict,
                   overrides: dict[str, Any]) -> ml_collections.ConfigDict:
  """A copy of ``config`` with ``{"a.b.c": value}`` fields set.

  Each field must exist, except under ``model.overrides``, which holds any ModelConfig field.
  """
  config = config.copy_and_resolve_references()
  for field, value in overrides.items():
    *path, name = field.split(".")
    node = config
    for part in path:
      node = node[part]
    if name not in node and path != ["model", "overrides"]:
      raise KeyError(f"config has no field {field!r}")
    node[name] = value
  return config


def fit_supervised_start(config: ml_collections.ConfigDict, directory: str) -> str:
  """Fits (or finds) the config's supervised start in ``directory``; returns its model dir."""
  start = os.path.join(directory, supervised.SFT_DIR)
  if not os.path.exists(os.path.join(start, "config.json")):
    trainer.train(with_overrides(config, {"train.num_steps": 0}), directory)
  return start


@dataclasses.dataclass
class RunResult:
  """One finished (or stopped) run.

  Attributes:
    history: the per-step records of ``metrics.jsonl`` (``step`` included).
    wall_s: seconds the run took, compilation included.
    stopped: why the run ended early ('' if it did not).
    config: the run's config as JSON ('' for a run from before it was recorded).
  """

  history: list[dict[str, Any]]
  wall_s: float
  stopped: str = ""
  config: str = ""


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
  if not isinstance(tree, dict):
    return {prefix: tree}
  out = {}
  for key, value in tree.items():
    out.update(_leaves(value, f"{prefix}.{key}" if prefix else key))
  return out


def same_config(stored: str | None, identity: str) -> bool:
  """Whether a run recorded with the config ``stored`` (JSON) is the run of ``identity``: equal,
  or equal but for fields added to the base config since, at their defaults (None: unset), so
  that a newer version reads an older sweep's runs back instead of training them again."""
  if stored is None:
    return False
  if stored == identity:
    return True
  try:
    old, new = _leaves(json.loads(stored)), _leaves(json.loads(identity))
  except ValueError:
    return False
  from stabledrl_jax.training.config import config_lib  # pylint: disable=g-import-not-at-top
  defaults = _leaves(json.loads(config_lib.base_config().to_json_best_effort()))
  added = set(new) - set(old)
  return (set(old) <= set(new) and all(old[k] == new[k] for k in old)
          and all(new[k] is None or (k in defaults and new[k] == defaults[k]) for k in added))


def train_from_start(config: ml_collections.ConfigDict, start: str, workdir: str, *,
                     reuse: bool = False) -> RunResult:
  """Trains ``config`` in a fresh ``workdir`` from the supervised model at ``start``.

  A run stopped by ``train.max_consecutive_skips`` keeps the steps it logged. ``reuse``: a run
  that this function finished in ``workdir`` with the same config is read back, not trained
  again, and one it began with the same config but did not finish resumes from its latest
  checkpoint (a long sweep continues where it was cut); any other content is replaced. A
  resumed run's ``wall_s`` counts this sitting only. A run that a signal (SIGTERM, Ctrl-C)
  stops before its last step is saved but not recorded as finished, and the sweep stops
  (SystemExit naming the run): the same command resumes it.
  """
  identity = config.to_json_best_effort(sort_keys=True)
  begun = os.path.join(workdir, _BEGUN_FILE)
  resume = False
  if reuse:
    try:
      done = finished_run(workdir)
    except FileNotFoundError:
      done = None
    if done is not None and same_config(done.config, identity):
      return done
    if done is None:  # Cut short: the trainer resumes it. Never a FIFO opened.
      resume = same_config(
          workdir_files.read_text(begun, "sweep run marker", missing_ok=True), identity)
  if not resume:
    workdir_files.remove(workdir)
    os.makedirs(workdir)
    shutil.copytree(start, os.path.join(workdir, supervised.SFT_DIR))
    workdir_files.write_text(begun, identity)
  began = time.perf_counter()
  stopped = ""
  try:
    trainer.train(config, workdir)
  except trainer.TooManySkipsError as err:
    stopped = str(err)
  history = _trajectory(workdir)
  stopped = stopped or _guard_stop(workdir)
  done = max((h["step"] for h in history), default=0)
  if not stopped and done < config.train.num_steps:  # A signal: saved, to be resumed.
    raise SystemExit(f"{workdir}: stopped by a signal at step {done} of "
                     f"{config.train.num_steps} (saved); rerun the same command to resume it")
  wall_s = time.perf_counter() - began
  workdir_files.write_text(os.path.join(workdir, _RESULT_FILE),
                           json.dumps({"wall_s": wall_s, "stopped": stopped, "config": identity}))
  return RunResult(history=history, wall_s=wall_s, stopped=stopped, config=identity)


def run_or_read(config: ml_collections.ConfigDict | None, start: str | None, workdir: str, *,
                label: str, summarize_only: bool) -> RunResult | None:
  """A sweep's run: trained (or resumed, or read back) by ``train_from_start`` with reuse, its
  time printed after ``label``; with ``summarize_only`` only the finished run in ``workdir``
  read back, None where there is none."""
  if summarize_only:
    try:
      return finished_run(workdir)
    except FileNotFoundError:
      return None
  result = train_from_start(config, start, workdir, reuse=True)
  print(f"{label}: {result.wall_s:.0f} s {result.stopped}", flush=True)
  return result


def _trajectory(workdir: str) -> list[dict[str, Any]]:
  """The run's metrics; a run the collapse guard restored keeps the steps as they now stand
  (``collapse.Trajectory``: a step run again replaces its first record)."""
  history = metrics_writer.read_metrics(os.path.join(workdir, "metrics.jsonl"))
  if os.path.exists(os.path.join(workdir, collapse.EVENTS_FILE)):
    history = collapse.Trajectory(history).records()
  return history


def _guard_stop(workdir: str) -> str:
  """Why the collapse guard stopped the run in ``workdir`` ('' if it did not)."""
  path = os.path.join(workdir, collapse.EVENTS_FILE)
  if not os.path.exists(path):
    return ""
  events, _ = collapse.load_events(epath.Path(path))
  last = events[-1] if events else {}
  return (f"the collapse guard stopped it: {last['why']} at step {last['step']}"
          if last.get("action") == "stop" else "")


def finished_run(workdir: str) -> RunResult:
  """The result of a run that ``train_from_start`` finished in ``workdir``, read back."""
  path = os.path.join(workdir, _RESULT_FILE)
  text = workdir_files.read_text(path, "sweep result", missing_ok=True)  # Never a FIFO opened.
  if text is None:
    raise FileNotFoundError(f"no finished run in {workdir!r} (no {_RESULT_FILE})")
  result = json.loads(text)
  history = _trajectory(workdir)
  return RunResult(history=history, wall_s=result["wall_s"], stopped=result["stopped"],
                   config=result.get("config", ""))


def metric(record: dict[str, Any], name: str) -> float:
  """A metric as a float (``metrics.jsonl`` stores inf and nan as strings)."""
  return float(record[name])
