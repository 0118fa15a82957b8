r"""Every objective under normal conditions, like for like: greedy eval over seeds, paired.

  python experiments/compare_objectives.py --config configs/compare_objectives.py \
      --workdir runs/compare --seeds 0,1,2,3,4

For each seed, fits one supervised start (``<workdir>/seed<S>/sft``) and trains every row of
``rows()`` from it with that seed (same start, same batches). Rows are the objectives with their
official loss and estimator, except that no row masks prompt tokens: on the toy task the
completion copies the prompt's digits, and masking 15% of them (the official ``block_random``
and d1's ``mean_field``) raises the estimator's noise about 15-fold. SPG and StableDRL appear
twice: with the official ``block_random`` exactly as published (32-token blocks, 15% of the
prompt masked: their own reference point), and adapted to the toy (one block covering the
40-token completion, no prompt masking). Every row says which estimator it runs.
``--official``: every objective variant exactly as published instead (its official estimator,
prompt masking included), one row each (runs in ``<workdir>/seed<S>/official/``; the paired
reference is then the published StableDRL).

Finished runs with the same config are read back, not trained again: a cut comparison continues
where it stopped. Writes ``<workdir>/comparison.json``:

  {"<row>": {"estimator", "eval_start", "eval_final", "eval_final_std", "eval_best",
             "reward_final", "step_s", "paired": {"reference", "n", "mean", "low", "high"},
             "diagnostics": {"ratio_noise_share", "clipped_fraction", "clip_bound_final",
                             "snis_ess"},
             "seeds": {"<seed>": {"eval": {step: accuracy}, "reward": [...], "step_s",
                                  "wall_s", "stopped", <the diagnostics>}}}}

``eval_*``: greedy ``eval/accuracy`` (percent of blanks right on 256 held-out puzzles) at the
first / last evaluation and its best, means over seeds; ``paired``: the mean over seeds of this
row's final eval minus the reference row's (``--reference``, the adapted StableDRL) from the
same seed, with a 95% Student-t interval (a paired difference removes the spread of the
starts); ``reward_final``: mean rollout reward of the last 10 steps; ``step_s``: median seconds
per RL step after the first; ``diagnostics`` (rows with a ratio): the mean over steps of
``ratio_noise/share``, of the clipped fraction (``clip/frac_upper`` + ``clip/frac_lower``) and
of StableDRL's ``snis/ess`` (of a group's weights), and the last ``clip/max_ratio``, means over
seeds (None where a row logs none). Also draws
``<workdir>/comparison.png`` and prints both tables.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/compare_objectives.py",
                                          "Path to a get_config() file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.", required=True)
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2", "3", "4"], "Seeds; each gets its own start.")
_ROWS = flags.DEFINE_list("rows", None, "Rows to run (default: all of rows()).")
_REFERENCE = flags.DEFINE_string("reference", "stabledrl",
                                 "The row every other is paired against.")
_OFFICIAL = flags.DEFINE_bool("official", False, "Every objective variant exactly as published "
                              "(official estimators, prompt masking included) instead of rows().")
_SUMMARIZE_ONLY = flags.DEFINE_bool(
    "summarize_only", False, "Train nothing: summarize the finished runs in --workdir (e.g. "
    "those of an interrupted comparison).")
_FINAL_STEPS = 10
OFFICIAL_SUFFIX = "_official"


def rows(completion_length: int) -> dict[str, tuple[dict, str]]:
  """{row name: (config overrides, the estimator it runs, in words)}.

  Every objective variant (``sweep.objective_variants()``) with no prompt masking; SPG's and
  StableDRL's with one ``block_random`` block over the whole completion, and again as published
  (``<name>_official``).
  """
  from stabledrl_jax.training.loop import sweep  # pylint: disable=g-import-not-at-top
  out = {}
  for name, overrides in sweep.objective_variants().items():
    objective = overrides["objective.name"]
    if objective in ("spg", "stabledrl"):
      out[name] = ({**overrides, **sweep.fitted_block_random(completion_length)},
                   f"block_random, one block of {completion_length}, no prompt masking")
      if name == objective:
        out[name + OFFICIAL_SUFFIX] = (overrides, "block_random as published: blocks of 32, "
                                       "15% of the prompt masked")
    elif objective == "grpo" and "token" in name or objective == "wd1":
      out[name] = ({**overrides, "estimator.prompt_mask_prob": 0.0},
                   "mean_field (one sample), no prompt masking")
    elif objective == "espo":
      out[name] = (overrides, "espo_elbo (complementary pairs), as published")
    else:
      out[name] = (overrides, "elbo, as published")
  return out


def official_rows() -> dict[str, tuple[dict, str]]:
  """Every objective variant with its official loss and estimator, as published."""
  from stabledrl_jax.training.loop import sweep  # pylint: disable=g-import-not-at-top
  return {name: (overrides, "official") for name, overrides in
          sweep.objective_variants().items()}


def paired(diffs: list[float]) -> dict:
  """Mean of paired differences with a 95% Student-t interval (n - 1 degrees of freedom)."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  n = len(diffs)
  if n == 0:
    return {"n": 0, "mean": math.nan, "low": math.nan, "high": math.nan}
  mean = statistics.fmean(diffs)
  if n == 1:
    return {"n": 1, "mean": mean, "low": math.nan, "high": math.nan}
  half = float(stats.t.ppf(0.975, n - 1)) * statistics.stdev(diffs) / math.sqrt(n)
  return {"n": n, "mean": mean, "low": mean - half, "high": mean + half}


def run_summary(result) -> dict:
  """Per-seed curves of one run."""
  # pylint: disable-next=g-import-not-at-top
  from stabledrl_jax.training.loop.sweep import REWARD_METRIC, metric
  evals = {h["step"]: metric(h, "eval/accuracy") for h in result.history if "eval/accuracy" in h}
  steps = [h for h in result.history if "rewards/mean" in h]
  times = [metric(h, "time/step_s") for h in steps[1:]] or [float("nan")]
  # The ratio diagnostics of the objectives that have a ratio (docs/diagnostics.md).
  logged = lambda name: [metric(h, name) for h in steps if name in h]
  mean = lambda xs: statistics.fmean(xs) if xs else None
  clipped = [a + b for a, b in zip(logged("clip/frac_upper"), logged("clip/frac_lower"))]
  return {"eval": evals, "reward": [metric(h, REWARD_METRIC) for h in steps],
          "step_s": statistics.median(times), "wall_s": result.wall_s,
          "stopped": result.stopped, "ratio_noise_share": mean(logged("ratio_noise/share")),
          "clipped_fraction": mean(clipped),
          "clip_bound_final": (logged("clip/max_ratio") or [None])[-1],
          "snis_ess": mean(logged("snis/ess"))}


def _final(run: dict) -> float:
  return run["eval"][max(run["eval"])]


_DIAGNOSTICS = ("ratio_noise_share", "clipped_fraction", "clip_bound_final", "snis_ess")


def _mean_of(runs: list[dict], field: str) -> float | None:
  """The mean over seeds of a per-run diagnostic (None where a run has none: no ratio)."""
  values = [r[field] for r in runs if r.get(field) is not None]
  return statistics.fmean(values) if values else None


def row_summary(per_seed: dict, estimator: str, reference: dict | None,
                reference_name: str) -> dict:
  """Means over seeds of one row's runs, and its paired difference from the reference's."""
  runs = list(per_seed.values())
  finals = [_final(r) for r in runs if r["eval"]]
  mean = lambda xs: statistics.fmean(xs) if xs else float("nan")
  # Paired at the reference's last evaluated step: a run stopped early (too many skipped
  # steps) has no eval there and is left out of the pairs, not compared at an earlier step.
  common = sorted(s for s in per_seed if reference and s in reference and reference[s]["eval"]
                  and max(reference[s]["eval"]) in per_seed[s]["eval"])
  return {
      "estimator": estimator,
      "eval_start": mean([r["eval"][min(r["eval"])] for r in runs if r["eval"]]),
      "eval_final": mean(finals),
      "eval_final_std": statistics.pstdev(finals) if finals else float("nan"),
      "eval_best": mean([max(r["eval"].values()) for r in runs if r["eval"]]),
      "reward_final": mean([mean(r["reward"][-_FINAL_STEPS:]) for r in runs]),
      "step_s": mean([r["step_s"] for r in runs]),
      "diagnostics": {field: _mean_of(runs, field) for field in _DIAGNOSTICS},
      "paired": {"reference": reference_name, **paired(
          [per_seed[s]["eval"][max(reference[s]["eval"])] - _final(reference[s])
           for s in common])},
      "seeds": per_seed,
  }


def plot(comparison: dict, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")  # Files only: no display needed.
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, (reward_ax, eval_ax) = plt.subplots(1, 2, figsize=(12, 4.2))
  for name, entry in comparison.items():
    runs = list(entry["seeds"].values())
    style = "--" if name.endswith(OFFICIAL_SUFFIX) else "-"
    length = min(len(r["reward"]) for r in runs)
    rewards = [statistics.fmean(r["reward"][i] for r in runs) for i in range(length)]
    reward_ax.plot(range(1, length + 1), rewards, style, label=name)
    steps = sorted(set.intersection(*(set(r["eval"]) for r in runs)))
    eval_ax.plot(steps, [statistics.fmean(r["eval"][s] for r in runs) for s in steps],
                 style, marker="o", label=name)
  reward_ax.set(xlabel="RL step", ylabel="rollout reward (mean over seeds)")
  eval_ax.set(xlabel="RL step", ylabel="greedy eval accuracy, % (mean over seeds)")
  for ax in (reward_ax, eval_ax):
    ax.grid(alpha=0.3)
  eval_ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def markdown_table(comparison: dict) -> str:
  reference = next(iter(comparison.values()))["paired"]["reference"]
  lines = ["| row | estimator | seeds | eval start | eval final (mean +- sd) | "
           f"final minus {reference}'s, same seed (95% CI) | final reward | s / step |",
           "|---|---|---|---|---|---|---|---|"]
  for name, e in comparison.items():
    p = e["paired"]
    if name == p["reference"]:
      diff = "(reference)"
    elif p["n"] >= 2:
      diff = f"{p['mean']:+.2f} [{p['low']:+.2f}, {p['high']:+.2f}]"
    elif p["n"] == 1:
      diff = f"{p['mean']:+.2f} (one seed)"
    else:
      diff = "-"
    lines.append(f"| {name} | {e['estimator']} | {len(e['seeds'])} | {e['eval_start']:.2f} | "
                 f"{e['eval_final']:.2f} +- {e['eval_final_std']:.2f} | {diff} | "
                 f"{e['reward_final']:.3f} | {e['step_s']:.2f} |")
  return "\n".join(lines)


def diagnostics_table(comparison: dict) -> str:
  """The ratio diagnostics of the rows that have a ratio: means over steps (the clip bound: the
  last step's), then over seeds."""
  lines = ["| row | ratio_noise/share | clipped fraction | clip bound at the end | SNIS ESS |",
           "|---|---|---|---|---|"]
  for name, e in comparison.items():
    d = e.get("diagnostics", {})
    if d.get("ratio_noise_share") is None and d.get("clipped_fraction") is None:
      continue
    cell = lambda x, form: "-" if x is None else format(x, form)
    lines.append(f"| {name} | {cell(d['ratio_noise_share'], '.3f')} | "
                 f"{cell(d['clipped_fraction'], '.2%')} | {cell(d['clip_bound_final'], '.2f')} | "
                 f"{cell(d['snis_ess'], '.2f')} |")
  return "\n".join(lines)


def main(argv) -> None:
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO.
  from stabledrl_jax.training.loop import sweep  # pylint: disable=g-import-not-at-top

  base, workdir = _CONFIG.value, _WORKDIR.value
  known = official_rows() if _OFFICIAL.value else rows(base.rollout.gen_length)
  names = list(_ROWS.value or known)
  unknown = sorted(set(names) - set(known))
  if unknown:
    raise app.UsageError(f"--rows: unknown {unknown}; known: {list(known)}")
  if _REFERENCE.value not in known:
    raise app.UsageError(f"--reference {_REFERENCE.value!r}: not one of {list(known)}")
  try:
    seeds = [int(s) for s in _SEEDS.value]
  except ValueError:
    raise app.UsageError(f"--seeds must be integers, got {_SEEDS.value}") from None
  if base.eval.every_steps <= 0:
    raise app.UsageError("--config.eval.every_steps must be > 0: the comparison needs evals")
  began = time.perf_counter()
  per_row = {name: {} for name in names}
  for seed in seeds:
    seeded = sweep.with_overrides(base, {"seed": seed})
    start = None if _SUMMARIZE_ONLY.value else sweep.fit_supervised_start(
        seeded, os.path.join(workdir, f"seed{seed}", "sft"))
    for name in names:
      run_dir = os.path.join(workdir, f"seed{seed}", *["official"] * _OFFICIAL.value, name)
      result = sweep.run_or_read(sweep.with_overrides(seeded, known[name][0]), start, run_dir,
                                 label=f"seed {seed} {name}", summarize_only=_SUMMARIZE_ONLY.value)
      if result is None:
        continue
      per_row[name][str(seed)] = run_summary(result)
  per_row = {name: runs for name, runs in per_row.items() if runs}
  if not per_row:
    raise app.UsageError(f"no finished runs in {workdir}")

  reference = per_row.get(_REFERENCE.value)
  comparison = {name: row_summary(runs, known[name][1], reference, _REFERENCE.value)
                for name, runs in per_row.items()}
  with open(os.path.join(workdir, "comparison.json"), "w") as f:
    json.dump(comparison, f, indent=2)
  plot(comparison, os.path.join(workdir, "comparison.png"))
  print("\n" + markdown_table(comparison))
  print("\n" + diagnostics_table(comparison))
  print(f"\nwall time {time.perf_counter() - began:.0f} s; wrote {workdir}/comparison.json and "
        "comparison.png")


if __name__ == "__main__":
  app.run(main)
