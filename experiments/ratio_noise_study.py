r"""Where do ratio-based objectives collapse under estimated likelihoods, and does StableDRL hold?

  python experiments/ratio_noise_study.py --config configs/ratio_noise_study.py \
      --workdir runs/ratio_noise_study [--mu 2,4,8] [--rows ...]

Runs, each from the same supervised start with the same seed and batches (quickstart scale,
200 RL steps by default):

- the ratio-based objectives, sequence-level GRPO, ESPO and StableDRL, each with its official
  mask coupling (``<name>``: GRPO and ESPO score l_old on each update's own masks, StableDRL on
  masks of its own) and with independent masks (``<name>_independent``: the ratio then carries
  the estimator's noise; StableDRL's official coupling already is this);
- StableDRL and SPG with ``block_random`` as its official code runs on this completion
  (``<name>_oneblock``: one block over the whole completion, 15% of the prompt masked; with the
  default 32-token blocks a 40-token completion makes the official code raise IndexError, and
  the plain rows run our 32 + 8 split, which the table's estimator column marks "ours");
- StableDRL again with ``block_random`` fitted to the toy (``stabledrl_fitted``: one block over
  the completion, no prompt masking, as in experiments/compare_objectives.py), which leaves the
  ratio the noise of independent masks without that of the masked prompt digits;
- StableDRL with its advantages centred under the SNIS weights (``stabledrl_centred``: the
  one-block estimator, ``objective.stabledrl.advantage_centering=snis``);
- SPG and wd1, which have no importance ratio, as references;
- each at mu = 2, 4 and 8 inner updates per rollout batch (``train.num_iterations``: the policy
  drifts further from pi_old with every update), and the ratio-based ones also stressed
  (``<name>_stress``: ``--stress_fraction`` of the samples scored on easy l_theta and hard
  l_old masks, docs/stress_test.md) at the smallest mu;
- a frozen-policy control (StableDRL at learning rate 1e-12): its curves move with the batches
  alone.

Each at ``--seeds`` (default: the config's own seed; another seed S runs in
``<row>/mu<mu>-seed<S>``, its batches, masks and held-out set drawn from S, its supervised start
the shared one). Per run it records the rollout reward and greedy eval curves, the pre-clip
gradient norm, the variance of log rho over the batch (``log_ratio/var``), StableDRL's
effective sample size, the KL from the start (``kl_start/mean``), the weighted advantage sum
(``weights/adv_sum_abs_mean``, docs/diagnostics.md) and skipped (non-finite) steps, and marks
collapse:

- a skipped step (a non-finite loss or gradient), or
- greedy eval below its start by more than ``--eval_margin`` points after having risen above it
  by as much, or
- the rollout reward's ``--window``-step mean below its first window's after having risen above
  it by ``--reward_margin``.

A run whose greedy eval ends more than ``--eval_margin`` points below its start without having
risen is marked ``degraded`` instead (it never learned; it did not collapse).

Finished runs with the same config are read back, and a cut run resumes from its checkpoint, so
the study can be continued in several sittings. Writes ``<workdir>/study.json``, draws
``<workdir>/study.png`` and prints the table in Markdown; with several seeds also a table per
cell (the fraction of seeds that collapse, the median final eval); and the rank correlation, over
the runs with SNIS weights, between the mean weighted advantage sum (of the uncentred
advantages, also in a centred run) and the final KL.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/ratio_noise_study.py",
                                          "Path to a get_config() file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.", required=True)
_MU = flags.DEFINE_list("mu", ["2", "4", "8"], "Inner updates per rollout batch to run.")
_ROWS = flags.DEFINE_list("rows", None, "Rows to run (default: all of rows()).")
_STRESS_FRACTION = flags.DEFINE_float("stress_fraction", 0.7, "The stressed rows' fraction.")
_EVAL_MARGIN = flags.DEFINE_float("eval_margin", 2.0, "Collapse: eval points below the start, "
                                  "after having been as far above it.")
_REWARD_MARGIN = flags.DEFINE_float("reward_margin", 0.02, "Collapse: reward below the first "
                                    "window's mean, after having been as far above it.")
_WINDOW = flags.DEFINE_integer("window", 20, "Steps of the reward's moving mean.")
_SEEDS = flags.DEFINE_list("seeds", None, "Seeds to run (default: the config's seed).")
_SUMMARIZE_ONLY = flags.DEFINE_bool("summarize_only", False,
                                    "Train nothing: summarize the finished runs in --workdir.")

RATIO_BASED = ("grpo_sequence", "espo", "stabledrl")
REFERENCES = ("spg", "wd1")
FROZEN = "frozen"
FROZEN_LEARNING_RATE = 1e-12
CURVES = {"reward": None, "grad_norm": "grad_norm",  # reward: sweep.REWARD_METRIC
          "log_ratio_var": "log_ratio/var", "ess": "snis/ess", "kl_start": "kl_start/mean",
          "adv_sum": "weights/adv_sum_abs_mean"}
ONE_BLOCK = ("stabledrl", "spg")  # block_random objectives: also as the official code runs here.


def rows(completion_length: int) -> dict[str, dict]:
  """{row: config overrides, mu aside}."""
  from stabledrl_jax.training.loop import sweep  # pylint: disable=g-import-not-at-top
  variants = sweep.objective_variants()
  out = {}
  for name in RATIO_BASED:
    out[name] = dict(variants[name])
    if name != "stabledrl":  # StableDRL's official masks are the independent ones.
      out[f"{name}_independent"] = {**variants[name], "estimator.coupled_ratio": False}
    else:  # Its estimator fitted to the toy: the ratio's noise without the prompt masking's.
      out[f"{name}_fitted"] = {**variants[name], **sweep.fitted_block_random(completion_length)}
  for name in REFERENCES:
    out[name] = dict(variants[name])
  for name in ONE_BLOCK:
    out[f"{name}_oneblock"] = {**variants[name], "estimator.block_length": completion_length}
  out["stabledrl_centred"] = {**out["stabledrl_oneblock"],
                              "objective.stabledrl.advantage_centering": "snis"}
  for name in RATIO_BASED:
    out[f"{name}_stress"] = {**variants[name], "estimator.stress.fraction": None}
  out[FROZEN] = {**variants["stabledrl"], "optimizer.learning_rate": FROZEN_LEARNING_RATE}
  return out


VARIANTS = ("independent", "fitted", "oneblock", "centred", "stress")


def split_row(row: str) -> tuple[str, str]:
  """(objective variant, study variant or ''): 'espo_stress' -> ('espo', 'stress')."""
  for variant in VARIANTS:
    if row.endswith("_" + variant):
      return row[:-len(variant) - 1], variant
  return row, ""


def run_keys(names: list[str], mus: list[int]) -> list[tuple[str, int]]:
  """(row, mu) of every run: stressed rows and the control at the smallest mu only."""
  keys = []
  for name in names:
    once = name.endswith("_stress") or name == FROZEN
    keys += [(name, mu) for mu in (mus[:1] if once else mus)]
  return keys


def collapse(history: list[dict], *, eval_margin: float, reward_margin: float,
             window: int) -> dict | None:
  """The first sign of collapse in a run's history (see the module docstring), or None: the
  trainer's collapse guard's rule (``training/loop/collapse.py``), one skipped update enough."""
  # pylint: disable-next=g-import-not-at-top
  from stabledrl_jax.training.config import run_spec
  # pylint: disable-next=g-import-not-at-top
  from stabledrl_jax.training.loop import collapse as collapse_lib
  return collapse_lib.first_collapse(history, run_spec.Rules(
      eval_margin=eval_margin, reward_margin=reward_margin, window=window, max_skipped=1))


def run_name(row: str, mu: int, seed: int, config_seed: int) -> str:
  """The run's key in study.json and its directory under the workdir."""
  return f"{row}/mu{mu}" + ("" if seed == config_seed else f"-seed{seed}")


def estimator_label(config) -> str:
  """What the run's likelihood estimator is, e.g. 'block_random 1 x 40, prompt 15%'; a block
  split the official code cannot run is marked ours."""
  from stabledrl_jax.training.config import specs  # pylint: disable=g-import-not-at-top
  settings = specs.estimator_settings(config)
  label = settings["method"]
  if label.startswith("block_random"):
    length, block = config.rollout.gen_length, settings["block_length"]
    label += (f" {length // block} x {block}" if length % block == 0 else
              f" {block} + {length % block} (ours: the official code raises IndexError here)")
  if settings.get("prompt_mask_prob"):
    label += f", prompt {settings['prompt_mask_prob']:.0%}"
  if settings.get("coupled_ratio"):
    label += ", l_old on the update's masks"
  return label


def run_summary(result, **criteria) -> dict:
  """Curves and the summary statistics of one run."""
  # pylint: disable-next=g-import-not-at-top
  from stabledrl_jax.training.loop.sweep import REWARD_METRIC, metric
  steps = [h for h in result.history if "grad_norm" in h]
  curves = {name: [metric(h, key or REWARD_METRIC) if (key or REWARD_METRIC) in h else None
                   for h in steps] for name, key in CURVES.items()}
  evals = {h["step"]: metric(h, "eval/accuracy") for h in result.history
           if "eval/accuracy" in h}
  finite = lambda xs: [x for x in xs if x is not None and math.isfinite(x)]
  norms, ratio_var = finite(curves["grad_norm"]), finite(curves["log_ratio_var"])
  ess, kl, adv_sum = finite(curves["ess"]), finite(curves["kl_start"]), finite(curves["adv_sum"])
  return {
      "steps": [h["step"] for h in steps], "curves": curves, "eval": evals,
      "eval_start": evals[min(evals)] if evals else math.nan,
      "eval_best": max(evals.values()) if evals else math.nan,
      "eval_final": evals[max(evals)] if evals else math.nan,
      "grad_norm_max": max(norms) if norms else math.nan,
      "log_ratio_var_mean": statistics.fmean(ratio_var) if ratio_var else None,
      "ess_min": min(ess) if ess else None,
      "kl_final": kl[-1] if kl else None,
      "adv_sum_mean": statistics.fmean(adv_sum) if adv_sum else None,
      "skipped_steps": int(result.history[-1].get("skipped_steps", 0)) if result.history else 0,
      "collapse": collapse(result.history, **criteria),
      "degraded": bool(evals) and evals[max(evals)] <= evals[min(evals)] - criteria["eval_margin"],
      "wall_s": result.wall_s, "stopped": result.stopped,
  }


def plot(study: dict, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")  # Files only: no display needed.
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  mus = sorted({entry["mu"] for entry in study.values()})
  panels = [("reward", "rollout reward"), ("eval", "greedy eval, %"),
            ("grad_norm", "grad norm (pre-clip)"), ("log_ratio_var", "var log rho"),
            ("ess", "SNIS ESS (StableDRL)"), ("kl_start", "KL from the start"),
            ("adv_sum", "|sum_j w_j A_j|, group mean")]
  fig, axes = plt.subplots(len(panels), len(mus), figsize=(4.2 * len(mus), 2.3 * len(panels)),
                           sharex=True, squeeze=False)
  # One colour per objective, one line style per variant (official, independent, fitted, stress).
  colors = {name: f"C{i}" for i, name in enumerate(RATIO_BASED + REFERENCES)}
  styles = {"independent": "--", "fitted": "-.", "stress": ":", "oneblock": (0, (5, 1, 1, 1)),
            "centred": (0, (1, 1))}
  first_seed = next(iter(study.values())).get("seed")
  for key, entry in study.items():
    col = mus.index(entry["mu"])
    objective, variant = split_row(entry["row"])
    style = styles.get(variant, "-")
    label = entry["row"] if entry.get("seed") in (None, first_seed) else None  # once per row
    color = "0.6" if entry["row"] == FROZEN else colors.get(objective)
    for row, (name, label) in enumerate(panels):
      ax = axes[row, col]
      if name == "eval":
        points = sorted((int(s), v) for s, v in entry["eval"].items())
        line, = ax.plot([s for s, _ in points], [v for _, v in points], linestyle=style,
                        marker=".", color=color, label=label)
      else:
        points = [(s, v) for s, v in zip(entry["steps"], entry["curves"][name]) if v is not None]
        if not points:
          continue
        line, = ax.plot([s for s, _ in points], [v for _, v in points], linestyle=style,
                        color=color, lw=1, label=label)
      if entry["collapse"] is not None and name in ("reward", "eval"):
        ax.axvline(entry["collapse"]["step"], color=line.get_color(), alpha=0.4, lw=0.8)
      if name in ("grad_norm", "log_ratio_var"):
        ax.set_yscale("log")
      ax.set_ylabel(label, fontsize=8)
      ax.grid(alpha=0.3)
    axes[0, col].set_title(f"mu = {entry['mu']}", fontsize=10)
  for ax in axes[-1]:
    ax.set_xlabel("RL step")
  axes[0, 0].legend(fontsize=6, ncol=2)  # mu = 2 holds every row (stressed, frozen).
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def markdown_table(study: dict) -> str:
  lines = ["| run | mu | eval start -> best -> final | collapse | grad norm max | "
           "var log rho (mean, the objective's own units) | ESS min | KL from start, nats per "
           "sequence (final) | skipped |", "|---|---|---|---|---|---|---|---|---|"]
  text = lambda x, f="{:.3g}": "-" if x is None or (isinstance(x, float) and math.isnan(x)) \
      else f.format(x)
  for key, e in study.items():
    fell = ("degraded" if e["degraded"] else "no") if e["collapse"] is None else (
        f"step {e['collapse']['step']}: {e['collapse']['why']}")
    run = e["row"] + (f" (seed {e['seed']})" if e.get("seed") not in (None, e.get("config_seed"))
                      else "")
    lines.append(f"| {run} | {e['mu']} | {e['eval_start']:.1f} -> {e['eval_best']:.1f} -> "
                 f"{e['eval_final']:.1f} | {fell} | {text(e['grad_norm_max'])} | "
                 f"{text(e['log_ratio_var_mean'])} | {text(e['ess_min'])} | "
                 f"{text(e['kl_final'])} | {e['skipped_steps']} |")
  return "\n".join(lines)


def estimator_table(study: dict) -> str:
  """Each row's likelihood estimator, named for what it is (``estimator_label``)."""
  labels = {e["row"]: e["estimator"] for e in study.values() if e.get("estimator")}
  return "\n".join(["| row | estimator |", "|---|---|"]
                   + [f"| {row} | {label} |" for row, label in labels.items()])


def cells(study: dict) -> dict[tuple[str, int], list[dict]]:
  """The runs of each (row, mu), over seeds, in the study's order."""
  out = {}
  for e in study.values():
    out.setdefault((e["row"], e["mu"]), []).append(e)
  return out


def cell_table(study: dict) -> str:
  """Per (row, mu): how many of its seeds collapse, and the medians over them."""
  lines = ["| run | mu | seeds | collapsed | eval final, median [min, max] | eval best, median | "
           "KL from start (final), median | mean abs weighted advantage sum, median |",
           "|---|---|---|---|---|---|---|---|"]
  median = lambda xs: statistics.median(xs) if xs else None
  text = lambda x: "-" if x is None else f"{x:.3g}"
  for (row, mu), runs in cells(study).items():
    finals = [e["eval_final"] for e in runs]
    fell = sum(e["collapse"] is not None for e in runs)
    lines.append(
        f"| {row} | {mu} | {len(runs)} | {fell} of {len(runs)} | {median(finals):.1f} "
        f"[{min(finals):.1f}, {max(finals):.1f}] | {median([e['eval_best'] for e in runs]):.1f} | "
        f"{text(median([e['kl_final'] for e in runs if e['kl_final'] is not None]))} | "
        f"{text(median([e['adv_sum_mean'] for e in runs if e.get('adv_sum_mean') is not None]))} |")
  return "\n".join(lines)


def advantage_sum_kl_correlation(study: dict, rows_: list[str] | None = None) -> dict | None:
  """Spearman's rank correlation, over the runs (of ``rows_``, default all) whose weighted
  advantage sum is not 0 by construction (SPG's, wd1's), between its mean over the run and the
  final KL from the start; None with fewer than 3 such runs."""
  import scipy.stats  # pylint: disable=g-import-not-at-top
  pairs = [(e["adv_sum_mean"], e["kl_final"]) for e in study.values()
           if (rows_ is None or e["row"] in rows_) and e.get("adv_sum_mean")
           and e["kl_final"] is not None]
  if len(pairs) < 3:
    return None
  rho, p = scipy.stats.spearmanr(*zip(*pairs))
  return {"spearman": float(rho), "p": float(p), "runs": len(pairs)}


def main(argv) -> None:
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO.
  from stabledrl_jax.training.loop import sweep  # pylint: disable=g-import-not-at-top

  base, workdir = _CONFIG.value, _WORKDIR.value
  known = rows(base.rollout.gen_length)
  names = list(_ROWS.value or known)
  unknown = sorted(set(names) - set(known))
  if unknown:
    raise app.UsageError(f"--rows: unknown {unknown}; known: {list(known)}")
  try:
    mus = sorted(int(m) for m in _MU.value)
  except ValueError:
    raise app.UsageError(f"--mu takes integers, got {_MU.value}") from None
  if not mus or mus[0] < 1:
    raise app.UsageError(f"--mu must be >= 1, got {_MU.value}")
  if not 0 < _STRESS_FRACTION.value <= 1:
    raise app.UsageError(f"--stress_fraction must lie in (0, 1], got {_STRESS_FRACTION.value}")
  if base.eval.every_steps <= 0:
    raise app.UsageError("--config.eval.every_steps must be > 0: the study needs evals")
  criteria = dict(eval_margin=_EVAL_MARGIN.value, reward_margin=_REWARD_MARGIN.value,
                  window=_WINDOW.value)
  try:
    seeds = [int(s) for s in _SEEDS.value or [base.seed]]
  except ValueError:
    raise app.UsageError(f"--seeds takes integers, got {_SEEDS.value}") from None
  if len(set(seeds)) != len(seeds):
    raise app.UsageError(f"--seeds repeats a seed: {_SEEDS.value}")
  began = time.perf_counter()
  start = None if _SUMMARIZE_ONLY.value else sweep.fit_supervised_start(
      base, os.path.join(workdir, "sft"))
  study = {}
  for seed in seeds:  # Seed by seed: a study cut short holds whole seeds.
    for name, mu in run_keys(names, mus):
      key = run_name(name, mu, seed, base.seed)
      run_dir = os.path.join(workdir, *key.split("/"))
      overrides = {**known[name], "train.num_iterations": mu, "seed": seed}
      if "estimator.stress.fraction" in overrides:
        overrides["estimator.stress.fraction"] = _STRESS_FRACTION.value
      config = sweep.with_overrides(base, overrides)
      result = sweep.run_or_read(config, start, run_dir, label=key,
                                 summarize_only=_SUMMARIZE_ONLY.value)
      if result is None:
        continue
      study[key] = {"row": name, "mu": mu, "seed": seed, "config_seed": base.seed,
                    "estimator": estimator_label(config), **run_summary(result, **criteria)}
  if not study:
    raise app.UsageError(f"no finished runs in {workdir}")
  with open(os.path.join(workdir, "study.json"), "w") as f:
    json.dump(study, f, indent=1)
  plot(study, os.path.join(workdir, "study.png"))
  print("\n" + markdown_table(study))
  print("\n" + estimator_table(study))
  if len(seeds) > 1:
    print("\n" + cell_table(study))
  # The logged sum is the uncentred advantages': in a centred run, what the centring removes.
  # ESPO's is of its clipped PPO coefficients (docs/diagnostics.md): each objective apart.
  of = lambda objective: [r for r in names if split_row(r)[0] == objective]
  for label, subset in (
      ("StableDRL, uncentred", [r for r in of("stabledrl") if r != "stabledrl_centred"]),
      ("StableDRL, centred runs too", of("stabledrl")), ("ESPO", of("espo")),
      ("sequence-level GRPO", of("grpo_sequence"))):
    corr = advantage_sum_kl_correlation(study, subset)
    if corr is not None:
      print(f"\nmean weighted advantage sum vs final KL, {label}: Spearman {corr['spearman']:+.2f} "
            f"(p {corr['p']:.2g}, {corr['runs']} runs)")
  print(f"\nwall time {time.perf_counter() - began:.0f} s; wrote {workdir}/study.json and "
        "study.png")


if __name__ == "__main__":
  app.run(main)
