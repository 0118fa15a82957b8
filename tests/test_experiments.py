"""The experiment scripts end to end at toy size, and the notebooks' hygiene.

The notebooks themselves are executed by nbmake (``pytest --nbmake notebooks``, in CI).
"""

import functools
import importlib.util
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from stabledrl_jax import models
from stabledrl_jax.models.llada import flops
from stabledrl_jax.training.loop import sweep

REPO = pathlib.Path(__file__).resolve().parents[1]

# A toy-size run of the quickstart-based configs: seconds per objective.
TOY = [f"--config.{field}={value}" for field, value in sweep.TOY_OVERRIDES.items()]


def run_script(name, *args, check=True, env=None):
  # The repository first on the path, so that the scripts import this checkout's package.
  path = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
  env = {**os.environ, "PYTHONPATH": path, **(env or {})}
  return subprocess.run([sys.executable, str(REPO / "experiments" / name), *args],
                        capture_output=True, text=True, cwd=REPO, check=check, timeout=600,
                        env=env)


@pytest.mark.slow
def test_stress_test_writes_summary_and_figure(tmp_path):
  # One objective, its official coupling only: every objective's trainer path is tested in
  # tests/test_training.py, each run's settings below.
  toy = [*TOY, "--config.train.num_steps=1", "--noother_coupling"]
  out = run_script("stress_test.py", f"--workdir={tmp_path}", "--objectives=stabledrl", *toy)
  summary = json.loads((tmp_path / "summary.json").read_text())
  conditions = ("normal", "stress")
  assert sorted(summary) == sorted(["frozen/normal"] + [f"stabledrl/{c}" for c in conditions])
  for entry in summary.values():
    assert entry["steps"] == 1
    for field in ("grad_norm_mean", "grad_norm_max", "explosion_rate", "final_reward",
                  "eval_start", "eval_final"):
      assert math.isfinite(entry[field]), (field, entry)
    assert entry["max_log10_ratio"] is not None
  # Each run as configured: official (independent) masks only; the control frozen.
  configs = {key: json.loads(json.loads((tmp_path / key / "run_result.json").read_text())["config"])
             for key in summary}
  assert configs["stabledrl/stress"]["estimator"]["coupled_ratio"] is None
  assert configs["stabledrl/stress"]["estimator"]["stress"]["fraction"] == 0.7
  assert configs["frozen/normal"]["optimizer"]["learning_rate"] == 1e-12
  # The frozen control evaluates where it started: its policy did not move.
  assert summary["frozen/normal"]["eval_final"] == summary["frozen/normal"]["eval_start"]
  for condition in conditions:  # The convex-hull bound, measured per update (0 when every
    # advantage of a toy run is 0; tests/test_training.py checks nontrivial cases).
    assert 0 <= summary[f"stabledrl/{condition}"]["bound_ratio_max"] <= 1 + 1e-5
  assert (tmp_path / "stress_test.png").stat().st_size > 0
  assert "| stabledrl/stress |" in out.stdout and "| frozen/normal |" in out.stdout
  written = {key: (tmp_path / key / "run_result.json").stat().st_mtime_ns for key in summary}
  run_script("stress_test.py", f"--workdir={tmp_path}", "--objectives=stabledrl", *toy)
  # Finished runs are read back, not trained again.
  assert {key: (tmp_path / key / "run_result.json").stat().st_mtime_ns
          for key in summary} == written
  assert json.loads((tmp_path / "summary.json").read_text()) == summary
  resummarized = run_script("stress_test.py", f"--workdir={tmp_path}",
                            "--objectives=stabledrl", "--summarize_only",
                            "--explosion_factor=1e9")
  assert "| stabledrl/stress |" in resummarized.stdout
  again = json.loads((tmp_path / "summary.json").read_text())
  assert all(entry["explosion_rate"] == 0 for entry in again.values())
  assert again["stabledrl/stress"]["grad_norm_max"] == summary["stabledrl/stress"]["grad_norm_max"]


@pytest.mark.slow
def test_compare_objectives_writes_table_and_figure(tmp_path):
  out = run_script("compare_objectives.py", f"--workdir={tmp_path}", "--seeds=0,1",
                   "--rows=stabledrl,spg_official", "--config.eval.every_steps=1", *TOY)
  comparison = json.loads((tmp_path / "comparison.json").read_text())
  assert sorted(comparison) == ["spg_official", "stabledrl"]
  for entry in comparison.values():
    assert sorted(entry["seeds"]["0"]["eval"]) == ["0", "1", "2"]  # Steps, as JSON keys.
    assert len(entry["seeds"]["0"]["reward"]) == 2
    assert 0 <= entry["eval_final"] <= 100 and entry["step_s"] > 0
  # The paired difference: per seed, the row's final eval minus the reference's.
  final = lambda row, seed: comparison[row]["seeds"][seed]["eval"]["2"]
  diffs = [final("spg_official", s) - final("stabledrl", s) for s in ("0", "1")]
  p = comparison["spg_official"]["paired"]
  assert p["reference"] == "stabledrl" and p["n"] == 2
  assert p["mean"] == pytest.approx(sum(diffs) / 2)
  half = 12.706205 * abs(diffs[0] - diffs[1]) / 2  # t(0.975, 1) x sd / sqrt(2)
  assert (p["low"], p["high"]) == pytest.approx((p["mean"] - half, p["mean"] + half))
  assert comparison["stabledrl"]["paired"]["mean"] == 0
  # The ratio diagnostics: means over each run's steps, then over seeds; SPG has no ratio.
  for seed in ("0", "1"):
    logs = [json.loads(line) for line in
            (tmp_path / f"seed{seed}" / "stabledrl" / "metrics.jsonl").read_text().splitlines()]
    shares = [float(r["ratio_noise/share"]) for r in logs if "ratio_noise/share" in r]
    assert shares  # Logged where the step can compare its updates.
    assert comparison["stabledrl"]["seeds"][seed]["ratio_noise_share"] == pytest.approx(
        np.mean(shares))
    clipped = [float(r["clip/frac_upper"]) + float(r["clip/frac_lower"]) for r in logs
               if "clip/frac_upper" in r]
    assert comparison["stabledrl"]["seeds"][seed]["clipped_fraction"] == pytest.approx(
        np.mean(clipped))
    ess = [float(r["snis/ess"]) for r in logs if "snis/ess" in r]
    assert comparison["stabledrl"]["seeds"][seed]["snis_ess"] == pytest.approx(np.mean(ess))
  d = comparison["stabledrl"]["diagnostics"]
  assert d["ratio_noise_share"] == pytest.approx(np.mean(
      [comparison["stabledrl"]["seeds"][s]["ratio_noise_share"] for s in ("0", "1")]))
  assert d["clip_bound_final"] == 5.0 and 0 <= d["clipped_fraction"] <= 1
  assert set(comparison["spg_official"]["diagnostics"].values()) == {None}
  diagnostics = out.stdout.split("| row | ratio_noise/share |")[1]
  assert "| stabledrl |" in diagnostics and "| spg_official |" not in diagnostics
  # Each row runs the estimator it names.
  configs = {row: json.loads(json.loads(
      (tmp_path / "seed0" / row / "run_result.json").read_text())["config"]) for row in comparison}
  assert configs["stabledrl"]["estimator"]["prompt_mask_prob"] == 0.0
  assert configs["stabledrl"]["estimator"]["block_length"] == 40
  assert configs["spg_official"]["estimator"]["prompt_mask_prob"] is None  # the official 0.15
  assert (tmp_path / "comparison.png").stat().st_size > 0
  # An interrupted comparison is summarized from the runs that finished.
  (tmp_path / "comparison.json").unlink()
  run_script("compare_objectives.py", f"--workdir={tmp_path}", "--seeds=0,1,2",
             "--rows=wd1,stabledrl,spg_official", "--summarize_only")
  assert json.loads((tmp_path / "comparison.json").read_text()) == comparison


def test_stress_test_runs_each_objective_with_its_official_coupling_then_the_other():
  """Each variant's conditions and their settings: official (``coupled_ratio`` unset), then the
  other coupling for an objective with a ratio; none for SPG and wd1 (no l_old)."""
  stress = _load_experiment("stress_test")
  from stabledrl_jax.training.config import config_lib, specs  # pylint: disable=g-import-not-at-top
  base = config_lib.from_file(REPO / "configs" / "stress_test.py")
  assert base.estimator.get("coupled_ratio") is None
  expected = {"stabledrl": "coupled", "stabledrl_adaptive": "coupled", "spg": None, "wd1": None,
              "grpo_token": "independent", "grpo_sequence": "independent", "espo": "independent"}
  assert set(expected) <= set(sweep.objective_variants())  # (tests may register plugins)
  for name, other in expected.items():
    official = ("normal", "stress")
    assert stress.conditions(base, name, False) == official
    assert stress.conditions(base, name, True) == official + (
        (f"normal_{other}", f"stress_{other}") if other else ())
    for condition in stress.conditions(base, name, True):
      config = sweep.with_overrides(base, stress.run_overrides(name, condition, 0.7))
      coupled = specs.estimator_settings(config)["coupled_ratio"]
      if condition in official:  # The objective's own coupling.
        assert "coupled_ratio" not in stress.run_overrides(name, condition, 0.7)
      else:
        assert coupled == (other == "coupled")
      assert config.estimator.stress.fraction == (0.7 if condition.startswith("stress") else 0.0)
      assert config.train.gradient_bound == (config.objective.name == "stabledrl")


@pytest.mark.parametrize("script,flag", [("stress_test.py", "--objectives"),
                                         ("compare_objectives.py", "--rows")])
def test_unknown_objective_is_a_usage_error(script, flag, tmp_path):
  out = run_script(script, f"--workdir={tmp_path}", f"{flag}=ppo", check=False)
  assert out.returncode != 0 and "ppo" in out.stderr
  assert not any(tmp_path.iterdir())  # Refused before anything ran.


def test_benchmark_writes_rows_and_counts_flops(tmp_path):
  out = tmp_path / "bench.json"
  run_script("benchmark.py", f"--output={out}", "--configs=tiny", "--repeats=1",
             "--group_size=2", "--num_samples=1", "--prompt_length=16", "--gen_length=32",
             "--steps=8", "--peak_sizes=128,256", "--peak_seconds=0.05", "--scaling_config=tiny",
             "--scale_group_sizes=2,4",
             "--scale_num_samples=1", "--scale_gen_lengths=32")
  bench = json.loads(out.read_text())
  assert bench["peak_flops"] > 0 and bench["dtype"] == "float32"
  assert [r["what"] for r in bench["rows"]] == ["forward", "train_core", "train_step", "sampler"]
  for row in bench["rows"] + bench["scaling"]:
    assert row["config"] == "tiny"
    for field in ("tokens_per_s", "flops_per_s", "mfu"):
      assert isinstance(row[field], float) and row[field] > 0, (field, row)
    assert isinstance(row["peak_memory_bytes"], int) and row["peak_memory_bytes"] > 0
  config = models.get_config("tiny")
  rows = {r["what"]: r for r in bench["rows"]}
  # 2 sequences x 1 sample of 16 + 32 tokens; the sampler: 8 passes, last block on 32 positions.
  assert rows["forward"]["flops"] == flops.forward_flops(config, 2, 48)
  # Training: forward + backward = 3 forwards, the last block's queries and the head on the 32
  # completion positions only.
  assert rows["train_core"]["flops"] == rows["train_step"]["flops"] == 3 * flops.forward_flops(
      config, 2, 48, span=32)
  assert rows["sampler"]["flops"] == 8 * flops.forward_flops(config, 2, 48, span=32)
  assert sorted((s["vary"], s["value"]) for s in bench["scaling"]) == [
      ("gen_length", 32), ("group_size", 2), ("group_size", 4), ("num_samples", 1)]
  assert {s["relative_cost"] for s in bench["scaling"] if s["value"] == 1} == {1.0}


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_memory_plan_shards_the_train_step_over_fake_devices(tmp_path, family):
  """The deprecated script runs the plan command's planner (stabledrl_jax.plan) on XLA:CPU."""
  out = tmp_path / "plan.json"
  # The paper's step (one group of 16 completions per microbatch) at tiny size and short
  # sequences, on one device and on 8 fake ones.
  done = run_script("memory_plan.py", f"--output={out}", "--model=tiny", f"--family={family}",
                    "--meshes=data=1;fsdp=8",
                    "--remat=false", "--microbatch_groups=1", "--set=rollout.prompt_length=32",
                    "--set=rollout.gen_length=64", "--set=rollout.steps=64",
                    "--set=train.num_steps=1",
                    env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
  assert "deprecated" in done.stderr and "stabledrl_jax.plan" in done.stderr
  rows = json.loads(out.read_text())["rows"]
  assert [r["topology"] for r in rows] == ["cpu:1", "cpu:8"]
  for row in rows:
    assert row["what"] == "train" and row["compiler"] == "cpu" and row["fits"] is True
    assert row["settings"]["train.microbatch_groups"] == 1
    assert row["settings"]["model.remat"] is False
    assert isinstance(row["per_chip_bytes"], int) and isinstance(row["chip_bytes"], int)
    assert row["per_chip_bytes"] == row["memory"]["total"] >= row["memory"]["temp"] > 0
  one, eight = rows
  # Each device holds an eighth of the state (tiny's shapes split 8 ways) and computes an eighth
  # of each microbatch's rows, although a microbatch has fewer groups (1) than devices (8).
  assert eight["parameters_bytes"] < one["parameters_bytes"] / 4
  assert eight["optimizer_bytes"] < one["optimizer_bytes"] / 4  # Adam's moments sharded too.
  assert eight["memory"]["temp"] < one["memory"]["temp"] / 4


def test_memory_plan_of_the_cached_sampler(tmp_path):
  """--sampler compiles the rollout sampler per cache setting; the KV cache is 2 x layers x rows x
  positions x kv heads x head dim per device, and the rows split over the devices."""
  out = tmp_path / "plan.json"
  run_script("memory_plan.py", f"--output={out}", "--model=tiny", "--sampler",
             "--meshes=data=1;fsdp=8", "--set=rollout.prompt_length=32",
             "--set=rollout.gen_length=64", "--set=rollout.steps=64", "--set=train.num_steps=1",
             env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
  rows = json.loads(out.read_text())["rows"]
  assert [(r["topology"], r["settings"]["rollout.cache"]) for r in rows] == [
      (mesh, cache) for mesh in ("cpu:1", "cpu:8") for cache in ("none", "prefix", "dual")]
  config = models.get_config("tiny")
  for row in rows:
    devices = 8 if row["topology"] == "cpu:8" else 1
    want = 0 if row["settings"]["rollout.cache"] == "none" else (
        2 * config.n_layers * row["rows"] // devices * row["positions"] * config.n_kv_heads
        * config.head_dim * 2)  # The paper config's bfloat16 activations.
    assert row["kv_cache_bytes"] == want and row["fits"] is True
    assert row["per_chip_bytes"] >= row["memory"]["temp"] > 0
  by = {(r["topology"], r["settings"]["rollout.cache"]): r for r in rows}
  assert by["cpu:8", "dual"]["memory"]["temp"] < by["cpu:1", "dual"]["memory"]["temp"] / 4
  failed = run_script("memory_plan.py", "--model=tiny", "--family=sdar", "--sampler",
                      "--caches=prefix", "--meshes=data=1", check=False)
  assert failed.returncode != 0 and "the sdar sampler has ('none',)" in failed.stderr


@pytest.mark.slow
def test_threshold_decoding_reports_calls_and_accuracy(tmp_path):
  from stabledrl_jax.training.config import config_lib  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.loop import trainer
  config = config_lib.from_file(REPO / "configs" / "quickstart.py")
  config.update_from_flattened_dict({
      "sft.num_steps": 20, "sft.batch_size": 16, "data.train_size": 64, "data.eval_size": 8,
      "eval.batch_size": 8, "train.num_steps": 0})
  trainer.train(config, str(tmp_path))  # The supervised start only: <workdir>/sft_model.
  out = tmp_path / "threshold.json"
  printed = run_script("threshold_decoding.py", f"--workdir={tmp_path}", "--thresholds=0.0,1.0",
                       f"--output={out}").stdout
  result = json.loads(out.read_text())
  assert result["source"] == "sft_model"
  low, zero, one = result["rows"]
  assert low["model_calls"] == result["eval_steps"] == 20  # 40 tokens, one block, gen / 2 steps.
  assert zero["model_calls"] == 1  # tau = 0: the whole block in one call.
  assert one["model_calls"] == 40  # tau = 1: one token per call.
  assert all(0 <= r["accuracy"] <= 100 for r in result["rows"])
  assert "| threshold tau = 0.0 |" in printed


def _experiment_module(name):
  """An experiments/ script imported as a module (its neighbours importable, as when run)."""
  import importlib  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, str(REPO / "experiments"))
  try:
    return importlib.import_module(name)
  finally:
    sys.path.remove(str(REPO / "experiments"))


def test_paper_shape_stand_in_fits_the_shape_and_reasons_correctly():
  """The stand-in task of experiments/paper_shape_sampler.py: prompts fit 192 tokens, worked
  solutions fit 256 with their EOS, each line's givens are the puzzle's and exclude the digit
  that line writes, and the reference scores 100 (an id past the characters scores, not
  crashes)."""
  from stabledrl_jax import tasks, tokenizers  # pylint: disable=g-import-not-at-top
  paper = _experiment_module("paper_shape_sampler")
  tokenizer = tokenizers.CharTokenizer()
  examples = [tasks.SudokuGenerator(64, seed=3, blanks_range=(4, 6))[i] for i in range(64)]
  prompts, prompt_mask, completions = paper.encode(tokenizer, examples)
  assert prompts.shape == (64, paper.PROMPT_LENGTH) and prompt_mask.any(axis=1).all()
  assert completions.shape == (64, paper.GEN_LENGTH)
  assert (completions[:, -1] == tokenizer.eos_id).all()
  for example in examples[:16]:
    puzzle, solution = tasks.sudoku.puzzle_of(example), example.reference
    lines = paper.worked_solution(puzzle, solution).split("\n")
    blanks = [i for i, d in enumerate(puzzle) if d == "0"]
    assert len(lines) == len(blanks) + 1 and lines[-1] == f"<answer>{solution}</answer>"
    for cell, line in zip(blanks, lines):
      r, c = divmod(cell, 4)
      head, rest = line.split(": ")
      assert head == f"r{r + 1}c{c + 1}"
      _, row, _, col, _, box, _, digit = rest.split(" ")
      assert digit == solution[cell]
      assert set(row) == set(puzzle[4 * r:4 * r + 4]) - {"0"}
      assert set(col) == set(puzzle[c::4]) - {"0"}
      assert digit not in row + col + box
  assert paper.cell_accuracy(tokenizer, completions, examples) == 100.0
  garbled = completions.copy()
  garbled[:, :8] = 10_000  # In the worked lines: the answer still counts.
  assert paper.cell_accuracy(tokenizer, garbled, examples) == 100.0
  assert paper.cell_accuracy(tokenizer, np.full_like(completions, 10_000), examples) == 0.0


@pytest.mark.parametrize("path", sorted((REPO / "notebooks").glob("*.ipynb")),
                         ids=lambda p: p.name)
def test_notebooks_are_committed_without_outputs(path):
  notebook = json.loads(path.read_text())
  for cell in notebook["cells"]:
    if cell["cell_type"] == "code":
      assert cell["outputs"] == [] and cell["execution_count"] is None, cell["source"][:80]
  # CI runs the cells at toy size: each config a notebook loads is sized by notebook_size.
  code = "".join("".join(cell["source"]) for cell in notebook["cells"])
  assert code.count("config_lib.get(") == code.count("sweep.notebook_size(") > 0, path.name


def test_notebook_size_is_toy_size_only_where_asked(monkeypatch):
  overrides = {"train.num_steps": 20, "eval.every_steps": 0}
  monkeypatch.delenv(sweep.TOY_ENV, raising=False)
  assert sweep.notebook_size(overrides) == overrides
  monkeypatch.setenv(sweep.TOY_ENV, "0")
  assert sweep.notebook_size(overrides) == overrides
  monkeypatch.setenv(sweep.TOY_ENV, "1")
  assert sweep.notebook_size(overrides) == {"eval.every_steps": 0, **sweep.TOY_OVERRIDES}


@pytest.mark.slow
def test_quickstart_seeds_tabulates_runs_and_rewrites_the_readme(tmp_path):
  readme = tmp_path / "README.md"
  readme.write_text("before\n<!-- quickstart-seeds:begin -->\nold\n"
                    "<!-- quickstart-seeds:end -->\nafter\n")
  overrides = [f"--set={arg[len('--config.'):]}" for arg in TOY] + ["--set=eval.every_steps=1"]
  out = run_script("quickstart_seeds.py", f"--workdir={tmp_path / 'runs'}", "--seeds=0,1",
                   f"--readme={readme}", *overrides)
  summary = json.loads((tmp_path / "runs" / "summary.json").read_text())
  assert [row["seed"] for row in summary["rows"]] == [0, 1]
  for row in summary["rows"]:
    assert row["gain"] == pytest.approx(row["final"] - row["start"])
    assert row["accuracy"]["0"] == row["start"]
  text = readme.read_text()
  assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
  assert "| 0 |" in text and "| 1 |" in text and "| 0 |" in out.stdout
  again = run_script("quickstart_seeds.py", f"--workdir={tmp_path / 'runs'}", "--seeds=0,1",
                     "--summarize_only")
  table = lambda stdout: [line for line in stdout.splitlines() if line.startswith("|")]
  assert table(again.stdout) == table(out.stdout) and len(table(out.stdout)) == 4


@pytest.mark.slow
def test_quickstart_gains_ten_points_for_seed_0(tmp_path):
  """The README's headline result, as a new user runs it: the quickstart command of the README,
  seed 0, with XLA's default optimization (the suite's -O0 flag removed)."""
  env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "").replace(
      "--xla_backend_optimization_level=0", "").strip()}
  subprocess.run([sys.executable, "-m", "stabledrl_jax.train", "--config",
                  str(REPO / "configs" / "quickstart.py"), "--workdir", str(tmp_path)],
                 check=True, cwd=REPO, env=env, capture_output=True, timeout=1800)
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  accuracy = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
  assert accuracy[-1] - accuracy[0] >= 10.0, accuracy


@functools.cache
def _load_experiment(name):
  """An experiment script as a module, its absl flags kept out of this process's registry.

  Each script defines flags at import (--config, --workdir, ...), and other modules loaded in
  this process (the trainer, the planner, another script) may hold the same names: those are
  set aside while the script loads and put back after, and the script's own are removed (the
  functions tested here read no flags).
  """
  from absl import flags  # pylint: disable=g-import-not-at-top
  aside = {}
  while True:
    before = set(flags.FLAGS)
    spec = importlib.util.spec_from_file_location(name, REPO / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    try:
      spec.loader.exec_module(module)
    except flags.DuplicateFlagError as error:
      for added in set(flags.FLAGS) - before:
        delattr(flags.FLAGS, added)
      clash = re.search(r"flag '([^']+)'", str(error)).group(1)
      aside[clash] = flags.FLAGS[clash]
      delattr(flags.FLAGS, clash)
      continue
    break
  for added in set(flags.FLAGS) - before:
    delattr(flags.FLAGS, added)
  for clash, flag in aside.items():
    flags.FLAGS[clash] = flag
  return module


def test_ratio_noise_study_marks_collapse_by_its_three_rules():
  study = _load_experiment("ratio_noise_study")
  rules = dict(eval_margin=2.0, reward_margin=0.02, window=3)

  def history(rewards, evals=(), skipped=()):
    """Steps 1..n with these rewards; evals[0] at step 0, evals[k] at step 3k."""
    first_skip = min(skipped, default=len(rewards) + 1)
    records = [{"step": s, "rewards/correctness": r, "skipped_steps": int(s >= first_skip)}
               for s, r in enumerate(rewards, start=1)]
    for k, value in enumerate(evals[1:], start=1):
      records[3 * k - 1]["eval/accuracy"] = value
    return ([{"step": 0, "eval/accuracy": evals[0]}] if evals else []) + records

  flat = [0.5] * 9
  assert study.collapse(history(flat, (50, 51, 49, 50)), **rules) is None  # within the margins
  fell = study.collapse(history(flat, (50, 55, 47)), **rules)
  assert fell["step"] == 6 and "eval" in fell["why"]
  assert study.collapse(history(flat, (50, 47, 40)), **rules) is None  # never rose: not collapse
  fell = study.collapse(history([0.5] * 3 + [0.6] * 3 + [0.4] * 3), **rules)
  assert fell["step"] == 8 and "reward" in fell["why"]  # (0.6 + 2 x 0.4) / 3 <= 0.48
  fell = study.collapse(history(flat, skipped=(4,)), **rules)
  assert fell == {"step": 4, "why": "a non-finite update was skipped"}


def test_ratio_noise_study_runs_each_row_as_it_says():
  study = _load_experiment("ratio_noise_study")
  rows = study.rows(40)
  assert sorted(rows) == sorted([
      "grpo_sequence", "grpo_sequence_independent", "espo", "espo_independent", "stabledrl",
      "stabledrl_fitted", "spg", "wd1", "stabledrl_oneblock", "spg_oneblock",
      "stabledrl_centred", "grpo_sequence_stress", "espo_stress", "stabledrl_stress", "frozen"])
  assert rows["espo_independent"]["estimator.coupled_ratio"] is False
  assert "estimator.coupled_ratio" not in rows["stabledrl"]  # its official masks: independent
  fitted = rows["stabledrl_fitted"]
  assert (fitted["estimator.block_length"], fitted["estimator.prompt_mask_prob"]) == (40, 0.0)
  assert {k: v for k, v in fitted.items() if not k.startswith("estimator.")} == rows["stabledrl"]
  assert rows["frozen"]["optimizer.learning_rate"] == 1e-12
  for name in ("stabledrl", "spg"):  # the official rule where it runs: one block of 40
    assert rows[f"{name}_oneblock"] == {**rows[name], "estimator.block_length": 40}
  assert rows["stabledrl_centred"] == {**rows["stabledrl_oneblock"],
                                       "objective.stabledrl.advantage_centering": "snis"}
  keys = study.run_keys(["stabledrl", "stabledrl_stress", "frozen"], [2, 4, 8])
  assert keys == [("stabledrl", 2), ("stabledrl", 4), ("stabledrl", 8), ("stabledrl_stress", 2),
                  ("frozen", 2)]


def test_ratio_noise_study_names_each_estimator_for_what_it_is():
  from stabledrl_jax.training.config import config_lib  # pylint: disable=g-import-not-at-top
  study = _load_experiment("ratio_noise_study")
  base = config_lib.from_file(REPO / "configs" / "ratio_noise_seeds.py")
  assert (base.rollout.group_size, base.rollout.num_prompts) == (16, 8)
  label = lambda row: study.estimator_label(sweep.with_overrides(base, study.rows(40)[row]))
  # 40 tokens in 32-token blocks: our 32 + 8 split; the official code raises IndexError.
  assert label("stabledrl") == label("spg") == (
      "block_random 32 + 8 (ours: the official code raises IndexError here), prompt 15%")
  assert label("stabledrl_oneblock") == "block_random 1 x 40, prompt 15%"
  assert label("stabledrl_fitted") == "block_random 1 x 40"
  assert label("espo").endswith("l_old on the update's masks")


def test_ratio_noise_study_summarizes_cells_over_seeds():
  study = _load_experiment("ratio_noise_study")
  assert study.run_name("espo", 4, 0, 0) == "espo/mu4"
  assert study.run_name("espo", 4, 2, 0) == "espo/mu4-seed2"

  def run(row, seed, final, kl, adv_sum, fell=False):
    return {"row": row, "mu": 4, "seed": seed, "eval_final": final, "eval_best": final + 1,
            "kl_final": kl, "adv_sum_mean": adv_sum,
            "collapse": {"step": 9, "why": "x"} if fell else None}

  runs = [run("stabledrl", 0, 10.0, 60.0, 0.3, fell=True), run("stabledrl", 1, 80.0, 5.0, 0.1),
          run("stabledrl", 2, 70.0, 20.0, 0.2, fell=True), run("spg", 0, 85.0, 1.0, 0.0),
          run("stabledrl_centred", 0, 84.0, 10.0, 1e-8)]
  table = study.cell_table({str(i): e for i, e in enumerate(runs)})
  assert "| stabledrl | 4 | 3 | 2 of 3 | 70.0 [10.0, 80.0] | 71.0 | 20 | 0.2 |" in table
  assert "| spg | 4 | 1 | 0 of 1 | 85.0 [85.0, 85.0] |" in table
  by_key = {str(i): e for i, e in enumerate(runs)}
  # SPG's zero sum is left out; ranks (4, 2, 3, 1) against (4, 1, 3, 2): 1 - 6 x 2 / (4 x 15).
  corr = study.advantage_sum_kl_correlation(by_key)
  assert corr["runs"] == 4 and corr["spearman"] == pytest.approx(0.8)
  corr = study.advantage_sum_kl_correlation(by_key, ["stabledrl"])
  assert corr["runs"] == 3 and corr["spearman"] == pytest.approx(1.0)
  assert study.advantage_sum_kl_correlation(by_key, ["spg"]) is None


@pytest.mark.slow
def test_ratio_noise_study_writes_table_and_figure_and_resumes_a_cut_run(tmp_path):
  # A stressed row runs at the smallest mu only.
  args = [f"--workdir={tmp_path}", "--rows=stabledrl,espo_stress", "--mu=1,2", *TOY,
          "--config.eval.every_steps=1", "--config.checkpoint.every_steps=1"]
  out = run_script("ratio_noise_study.py", *args)
  study = json.loads((tmp_path / "study.json").read_text())
  assert sorted(study) == ["espo_stress/mu1", "stabledrl/mu1", "stabledrl/mu2"]
  for entry in study.values():
    assert entry["steps"] == [1, 2] and sorted(entry["eval"]) == ["0", "1", "2"]
    assert entry["curves"]["kl_start"][0] == 0.0  # before the first update
    assert all(math.isfinite(x) for x in entry["curves"]["log_ratio_var"])
  assert study["stabledrl/mu2"]["ess_min"] is not None
  assert study["espo_stress/mu1"]["ess_min"] is None
  assert (tmp_path / "study.png").stat().st_size > 0
  assert "| stabledrl | 2 |" in out.stdout
  # A run cut short resumes from its checkpoint: its logged steps are kept, not retrained.
  run = tmp_path / "stabledrl" / "mu2"
  (run / "run_result.json").unlink()
  (run / "marker").write_text("")  # A run trained anew starts from an empty directory.
  run_script("ratio_noise_study.py", *args)
  assert (run / "marker").exists() and (run / "run_result.json").exists()
  assert json.loads((tmp_path / "study.json").read_text())["stabledrl/mu2"]["steps"] == [1, 2]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="needs libtpu (pip install 'jax[tpu]'; the test extra has it)")
def test_sampler_memory_compares_each_cache_with_the_exact_sampler(tmp_path):
  out = tmp_path / "rows.json"
  done = run_script("sampler_memory.py", "--model=tiny", "--rows=32", "--caches=none,dual",
                    f"--output={out}")
  rows = json.loads(out.read_text())
  assert [r["cache"] for r in rows] == ["none", "dual"]
  # tiny: 2 layers, 2 kv heads of 16 dimensions; the paper config computes in bf16 (2 bytes).
  cache = 2 * 2 * 512 * 2 * 16 * 2 * 32 // 4
  assert rows[1]["kv_cache_bytes"] == cache and rows[0]["kv_cache_bytes"] == 0
  extra = (rows[1]["bytes_per_chip"] - rows[0]["bytes_per_chip"]) / cache
  assert rows[1]["extra_in_caches"] == pytest.approx(extra, abs=0.01)
  assert "| dual |" in done.stdout


def test_compare_objectives_rows_are_like_for_like_or_all_official():
  compare = _load_experiment("compare_objectives")
  official = compare.official_rows()
  assert {name: overrides for name, (overrides, _) in official.items()} == \
      sweep.objective_variants()
  rows = compare.rows(40)
  assert set(rows) == set(official) | {"spg_official", "stabledrl_official"}
  for name, (overrides, estimator) in rows.items():
    if name.endswith("_official"):
      assert overrides == official[name[:-len("_official")]][0] and "as published" in estimator
    else:  # No row masks prompt tokens.
      assert overrides.get("estimator.prompt_mask_prob", 0.0) == 0.0, name


def test_the_step_recorder_compares_every_number_and_covers_every_row(monkeypatch):
  monkeypatch.syspath_prepend(str(REPO / "experiments"))  # It imports compare_objectives.
  record = _load_experiment("record_steps")
  before = {"x": [{"step": 1, "loss": 0.5, "kl": float("nan")}]}
  lines, differs = record.compare(json.loads(json.dumps(before)), before)
  assert not differs and "| x | 1 | 3 | 0 | 0 |" in lines
  now = {"x": [{"step": 1, "loss": 0.5 + 1e-9, "kl": float("nan")}], "y": []}
  lines, differs = record.compare(now, before)
  assert differs and "| x | 1 | 3 | 1 | 1e-09 |" in lines
  assert "| y | only in now | - | - | - |" in lines
  shorter = {"x": []}
  assert record.compare(shorter, before)[1]  # A run that logged fewer steps differs too.
  assert set(record.variants(40)) > set(_load_experiment("compare_objectives").rows(40))


def test_a_sweep_run_cut_by_a_signal_is_not_recorded_as_finished(tmp_path, monkeypatch):
  """The trainer returns normally after a signal saves the run; the sweep must not take the
  cut run for a finished one: no run_result.json, a one-line exit naming the run, and the same
  call later resumes it."""
  from stabledrl_jax.training.config import config_lib  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.loop import trainer
  config = config_lib.get("quickstart")
  config.train.num_steps = 2
  start = tmp_path / "start"
  start.mkdir()
  runs = []

  def fake_train(config, workdir):  # Step 1 of 2 logged, then "a signal".
    runs.append(workdir)
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
      f.write(json.dumps({"step": len(runs)}) + "\n")

  monkeypatch.setattr(trainer, "train", fake_train)
  with pytest.raises(SystemExit, match="step 1 of 2"):
    sweep.train_from_start(config, str(start), str(tmp_path / "run"), reuse=True)
  assert not (tmp_path / "run" / "run_result.json").exists()
  done = sweep.train_from_start(config, str(start), str(tmp_path / "run"), reuse=True)
  assert [h["step"] for h in done.history] == [1, 2]  # resumed in place, not started anew
  assert sweep.train_from_start(config, str(start), str(tmp_path / "run"), reuse=True).history \
      == done.history and len(runs) == 2  # finished: read back


def test_the_lora_hardware_table_says_which_rows_run(tmp_path):
  """experiments/lora_hardware.py renders the planner's rows: a config runs on a slice when its
  train step and its sampler fit (as given, or with the planner's recommended settings)."""
  module = _load_experiment("lora_hardware")
  gib = 2**30

  def row(config, topology, what, total, fits, recommended=None):
    return {"config": config, "topology": topology, "what": what, "fits": fits,
            "settings": {"rollout.cache": "dual", "rollout.microbatch_groups": 32},
            "memory": {"total": total * gib} if fits or total else None,
            "per_chip_bytes": total * gib, "recommended": recommended, "chip_bytes": 16 * gib}

  lora_config, full_config = module.RUNS[0][0], module.RUNS[-1][0]
  rows = [row(lora_config, "v5litepod-8", "train", 9.5, True),
          row(lora_config, "v5litepod-8", "sampler", 20, False,
              {"rollout.cache": "dual", "rollout.microbatch_groups": 8}),
          row(full_config, "v5litepod-8", "train", 40, False),
          row(full_config, "v5litepod-8", "sampler", 6, True)]
  path = tmp_path / "plan.json"
  path.write_text(json.dumps({"rows": rows}))
  lines = module.table(str(path)).splitlines()
  assert len(lines) == 4  # Header, rule, the two slices compiled.
  assert lines[2].startswith(f"| `{lora_config}` (") and lines[2].endswith(
      "| v5litepod-8 | 9.5 | 20.0 (fits with rollout.microbatch_groups=8) | 16.0 | yes |")
  assert lines[3].endswith("| v5litepod-8 | 40.0 | 6.0 | 16.0 | **no** |")


def test_cache_accuracy_evaluates_a_workdir_as_the_trainer_did(tmp_path, sft_start):
  """experiments/cache_accuracy.py evaluates the workdir's latest checkpoint by the trainer's
  own evaluation (``decoding.evaluate``) without a trainer: its exact row is the trainer's
  eval at that step, and its cached rows are the family's caches."""
  from stabledrl_jax.training.loop import trainer  # pylint: disable=g-import-not-at-top
  from test_training import tiny_config, workdir_with_start  # pylint: disable=g-import-not-at-top
  config = tiny_config(**{"train.num_steps": 1, "eval.every_steps": 1})
  workdir = workdir_with_start(tmp_path / "run", sft_start)
  last = trainer.train(config, str(workdir))[-1]
  study = _load_experiment("cache_accuracy")
  block = config.rollout.block_length
  source, num_prompts, rows = study.accuracy_rows(str(workdir), [block], 0.9)
  assert source.step == 1 and num_prompts == config.data.eval_size
  exact = rows[0]
  assert (exact["cache"], exact["remasking"], exact["block_length"]) == (
      "none", "low_confidence", block)
  assert exact["accuracy"] == pytest.approx(last["eval/accuracy"])
  assert exact["reward_mean"] == pytest.approx(last["eval/reward_mean"])
  assert exact["model_calls"] == pytest.approx(last["eval/model_calls"])
  assert [r["cache"] for r in rows[:3]] == ["none", "prefix", "dual"]


def test_the_loop_reads_the_record_not_the_config(tmp_path):
  """experiments/config_reads.py: after ``specs.resolve`` the config is read only where the run
  is built from its sources (the model, the supervised start, the tokenizer, the data, the
  checkpoints' meta); the loop, the step, the rollouts and the guard read the record alone."""
  study = _load_experiment("config_reads")
  config = study._tiny_config()  # pylint: disable=protected-access
  config.train.collapse_guard.update(enabled=True, action="stop")
  counts = study.count_reads(config, str(tmp_path / "run"))
  after = {module for phase, module in counts if phase == "after"}
  assert after, counts  # The build's sources are read (the model, the data).
  loop = {f"stabledrl_jax.training.{m}" for m in (
      "loop.trainer", "step.rl_step", "step.rollout", "loop.step_metrics", "step.train_step",
      "step.rl_loss", "loop.collapse", "step.decoding", "loop.metrics_writer", "loop.spikes",
      "loop.preemption")}
  assert not after & loop, sorted(after & loop)


def test_time_split_tabulates_a_run_s_split_and_rewrites_the_doc(tmp_path):
  """experiments/time_split.py: each part's mean over the RL steps after the first, its share
  of the step, re-derived here; the doc's table replaced between its markers."""
  records = [{"step": 0, "eval/accuracy": 50.0}]
  for step in range(1, 4):
    records.append({"step": step, "time/step_s": 2.0 * step, "time/rollout_s": 1.0 * step,
                    "time/reward_s": 0.1, "time/likelihood_s": 0.2, "time/update_s": 0.5,
                    "rollout/calls_per_completion": 20.0, "rollout/tokens_per_call": 2.0})
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  doc = tmp_path / "performance.md"
  doc.write_text("before\n<!-- time-split:begin -->\nstale\n<!-- time-split:end -->\nafter\n")
  out = run_script("time_split.py", f"--workdir={tmp_path}", "--skip=1", f"--doc={doc}")
  # Steps 2 and 3: step 5.0 s, rollout 2.5 s (50.0%), update 0.5 s (10.0%), the rest 1.7 s.
  assert "Mean over 2 RL steps: 5.00 s a step." in out.stdout
  assert "| 2.500 | 50.0% |" in out.stdout and "| 0.500 | 10.0% |" in out.stdout
  assert "| the rest (metrics, the step's bookkeeping) | 1.700 | 34.0% |" in out.stdout
  assert "20.0 model calls per completion, 2.00 generated positions per call" in out.stdout
  text = doc.read_text()
  assert text.startswith("before\n<!-- time-split:begin -->\nMean over 2") and "stale" not in text
  bad = run_script("time_split.py", f"--workdir={tmp_path}", "--skip=3", check=False)
  assert bad.returncode == 2 and "has no RL step with the time split after the first 3" in (
      bad.stderr)


def test_every_published_record_is_whole_and_cited():
  """Each baseline's published record has every setting for every task, each with a citation
  naming a file of its repository (a path with a line or a file name)."""
  from stabledrl_jax.training.config import published  # pylint: disable=g-import-not-at-top
  for baseline in published.BASELINES:
    for task in published.TASKS:
      record = published.of(baseline, task)
      assert published.fields(record) == list(published.FIELDS), (baseline, task)
      for field, (value, where) in record.items():
        assert value and re.search(r"[\w/.-]+\.(py|yaml|sh|sbatch)", where), (baseline, field)
  with pytest.raises(ValueError, match=r"^espo's published runs have no 'code' task"):
    published.of("espo", "code")


def test_baseline_table_sets_the_matched_configs_beside_the_published_runs(tmp_path):
  """experiments/baseline_table.py: the matched configs' values read from the configs (the
  paper's batch for all four, each baseline's own mu), the published ones from the record; the
  README's table and the doc's cited tables rewritten between their markers."""
  from stabledrl_jax.training.config import config_lib, published  # pylint: disable=g-import-not-at-top
  readme, doc = tmp_path / "README.md", tmp_path / "training.md"
  readme.write_text("a\n<!-- baselines:begin -->\nstale\n<!-- baselines:end -->\nb\n")
  doc.write_text("<!-- baselines-cited:begin -->\n<!-- baselines-cited:end -->\n")
  out = run_script("baseline_table.py", "--task=countdown", f"--readme={readme}", f"--doc={doc}")
  rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:]
          for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line}
  config = config_lib.get("llada8b_d1:countdown")
  assert rows["prompts x completions a step"][0] == (
      f"{config.rollout.num_prompts} x {config.rollout.group_size}")
  assert rows["updates per batch (mu)"][0] == "each one's published"
  assert [v.strip(" |") for v in rows["clip epsilon"][1:]] == [
      published.of(b, "countdown")["epsilon"][0] for b in published.BASELINES]
  assert "stale" not in readme.read_text() and "| wd1 published |" in readme.read_text()
  cited = doc.read_text()
  assert all(f"{task}:" in cited for task in published.TASKS)
  assert "`recipes/run_countdown_llada.sh:29` |" in cited  # ESPO's countdown epsilon 0.
