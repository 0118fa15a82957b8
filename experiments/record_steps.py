r"""Records a few RL steps of every objective variant, to show a refactor changes no number.

  python experiments/record_steps.py --workdir runs/record --output runs/record/after.json \
      [--compare runs/record/before.json]

At toy size (the quickstart's model and task, a 300-step supervised start fitted in
``--workdir``, 3 RL steps with greedy eval after the last), each row of the objective
comparison (``compare_objectives.rows``: every objective variant with its estimator) plus the
settings that take other code paths (the adaptive clip, kl_to_start, LoRA, the stress test,
chunked rollouts) trains from that start. Every
logged metric but wall times and throughput goes to ``--output`` as JSON. ``--compare`` prints,
per variant, how many of its numbers differ from a recording of another tree (run the same
command with ``PYTHONPATH=<that checkout>``) and by how much at most; exit status 1 if any
does. Compilation options are the same for both recordings (this process's XLA_FLAGS).
"""

from __future__ import annotations

import json
import math
import os
import sys

from absl import app, flags

import compare_objectives  # pylint: disable=g-bad-import-order
import stabledrl_jax
from stabledrl_jax.training.config import config_lib
from stabledrl_jax.training.loop import sweep

_WORKDIR = compare_objectives._WORKDIR  # pylint: disable=protected-access  # --workdir, its flag.
_OUTPUT = flags.DEFINE_string("output", None, "The recording (JSON).", required=True)
_COMPARE = flags.DEFINE_string("compare", None, "A recording to compare with.")
_STEPS = flags.DEFINE_integer("steps", 3, "RL steps per variant.")
_ONLY = flags.DEFINE_list("variants", None, "Variants to run (default: all).")

# Not a function of the computation: wall times and what is derived from them.
_TIMED = ("time/", "throughput/", "perf/")


def base_config(steps: int):
  c = config_lib.get("quickstart")
  # Each objective with its official estimator (as the comparison: configs/compare_objectives.py).
  c.estimator.update(method="", num_samples=None)
  c.objective.stabledrl.surrogate = "sandwich"
  return sweep.with_overrides(c, {
      "data.train_size": 2048, "data.eval_size": 32, "sft.num_steps": 300,
      "rollout.num_prompts": 4, "rollout.group_size": 8,
      "eval.every_steps": steps, "eval.batch_size": 32,
      "train.num_steps": steps, "checkpoint.every_steps": steps})


_LORA = {"model.lora.rank": 4, "model.lora.alpha": 8.0, "model.lora.dropout": 0.05}


def variants(completion_length: int) -> dict[str, dict]:
  """The comparison's rows (each objective variant; StableDRL and SPG also as published), and
  StableDRL and GRPO on the other code paths."""
  out = {name: overrides for name, (overrides, _) in
         compare_objectives.rows(completion_length).items()}
  stabledrl = out["stabledrl"]
  out.update({
      "stabledrl_adaptive": {**stabledrl, "objective.stabledrl.clip_mode": "adaptive"},
      "stabledrl_kl_to_start": {**stabledrl, "diagnostics.kl_to_start": True},
      "stabledrl_lora": {**stabledrl, **_LORA},
      "grpo_lora": {**out["grpo_sequence"], **_LORA},  # Its KL reference: the adapters off.
      "stabledrl_stress": {**stabledrl, "estimator.stress.fraction": 0.5},
      "stabledrl_chunked": {**stabledrl, "rollout.microbatch_groups": 2},
  })
  return out


def record(workdir: str, steps: int, names: list[str] | None) -> dict[str, list[dict]]:
  base = base_config(steps)
  start = sweep.fit_supervised_start(base, os.path.join(workdir, "start"))
  out = {}
  for name, overrides in variants(base.rollout.gen_length).items():
    if names and name not in names:
      continue
    run_dir = os.path.join(workdir, name)
    result = sweep.train_from_start(sweep.with_overrides(base, overrides), start, run_dir)
    out[name] = [{k: v for k, v in r.items() if not k.startswith(_TIMED)}
                 for r in result.history]
    if not any(r.get("advantage/abs_mean", 0.0) > 0 for r in out[name]):
      # Equal rewards in every group: no update moves the parameters, so a recording would
      # match any tree.
      sys.exit(f"{name}: every advantage is 0 in {run_dir} (equal rewards in every group); "
               "a recording of it would show nothing")
  return out


def _same(a, b) -> bool:
  if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
    return True
  return a == b


def compare(now: dict, before: dict) -> tuple[list[str], bool]:
  lines = ["| variant | records | numbers | differ | largest difference |",
           "|---|---:|---:|---:|---:|"]
  differs = False
  for name in sorted(set(now) | set(before)):
    a, b = now.get(name), before.get(name)
    if a is None or b is None:
      lines.append(f"| {name} | only in {'before' if a is None else 'now'} | - | - | - |")
      differs = True
      continue
    pairs = [(x.get(k), y.get(k)) for x, y in zip(a, b) for k in set(x) | set(y)]
    bad = [(x, y) for x, y in pairs if not _same(x, y)]
    largest = max((abs(x - y) for x, y in bad if isinstance(x, (int, float))
                   and isinstance(y, (int, float))), default=0.0)
    differs |= bool(bad) or len(a) != len(b)
    lines.append(f"| {name} | {len(a)} | {len(pairs)} | {len(bad)} | {largest:.3g} |")
  return lines, differs


def main(argv):
  del argv
  print(f"stabledrl_jax from {os.path.dirname(stabledrl_jax.__file__)}", file=sys.stderr)
  now = record(_WORKDIR.value, _STEPS.value, _ONLY.value)
  os.makedirs(os.path.dirname(os.path.abspath(_OUTPUT.value)), exist_ok=True)
  with open(_OUTPUT.value, "w") as f:
    json.dump(now, f, indent=1, sort_keys=True)
  if _COMPARE.value:
    with open(_COMPARE.value) as f:
      lines, differs = compare(now, json.load(f))
    print("\n".join(lines))
    if differs:
      sys.exit(1)


if __name__ == "__main__":
  app.run(main)
