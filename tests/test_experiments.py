"""The experiment scripts end to end at toy size, and the notebooks' hygiene.

The notebooks themselves are executed by nbmake (``pytest --nbmake notebooks``, in CI).
"""

import json
import math
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

# A toy-size run of the quickstart-based configs: seconds per objective.
TOY = ["--config.sft.num_steps=20", "--config.sft.batch_size=16", "--config.data.train_size=64",
       "--config.data.eval_size=8", "--config.eval.batch_size=8", "--config.train.num_steps=2",
       "--config.rollout.num_prompts=2", "--config.rollout.group_size=4"]


def run_script(name, *args, check=True):
  return subprocess.run([sys.executable, str(REPO / "experiments" / name), *args],
                        capture_output=True, text=True, cwd=REPO, check=check, timeout=600)


@pytest.mark.slow
def test_stress_test_writes_summary_and_figure(tmp_path):
  # One objective: every objective's trainer path is tested in tests/test_training.py.
  out = run_script("stress_test.py", f"--workdir={tmp_path}", "--objectives=stabledrl", *TOY)
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert sorted(summary) == ["stabledrl/normal", "stabledrl/stress"]
  for entry in summary.values():
    assert entry["steps"] == 2
    for field in ("grad_norm_mean", "grad_norm_max", "explosion_rate", "final_reward"):
      assert math.isfinite(entry[field]), (field, entry)
    assert entry["max_log10_ratio"] is not None
  for condition in ("normal", "stress"):  # The convex-hull bound, measured per update (0 when
    # every advantage of a toy run is 0; tests/test_training.py checks nontrivial cases).
    assert 0 <= summary[f"stabledrl/{condition}"]["bound_ratio_max"] <= 1 + 1e-5
  assert (tmp_path / "stress_test.png").stat().st_size > 0
  assert "| stabledrl/stress |" in out.stdout
  resummarized = run_script("stress_test.py", f"--workdir={tmp_path}",
                            "--objectives=stabledrl", "--summarize_only",
                            "--explosion_factor=1e9")
  assert "| stabledrl/stress |" in resummarized.stdout
  again = json.loads((tmp_path / "summary.json").read_text())
  assert all(entry["explosion_rate"] == 0 for entry in again.values())
  assert again["stabledrl/stress"]["grad_norm_max"] == summary["stabledrl/stress"]["grad_norm_max"]


@pytest.mark.slow
def test_compare_objectives_writes_table_and_figure(tmp_path):
  run_script("compare_objectives.py", f"--workdir={tmp_path}", "--seeds=0",
             "--objectives=stabledrl", "--config.eval.every_steps=1", *TOY)
  comparison = json.loads((tmp_path / "comparison.json").read_text())
  assert sorted(comparison) == ["stabledrl"]
  for entry in comparison.values():
    assert sorted(entry["seeds"]["0"]["eval"]) == ["0", "1", "2"]  # Steps, as JSON keys.
    assert len(entry["seeds"]["0"]["reward"]) == 2
    assert 0 <= entry["eval_final"] <= 100 and entry["step_s"] > 0
  assert (tmp_path / "comparison.png").stat().st_size > 0
  # An interrupted comparison is summarized from the runs that finished.
  (tmp_path / "comparison.json").unlink()
  run_script("compare_objectives.py", f"--workdir={tmp_path}", "--seeds=0,1",
             "--objectives=wd1,stabledrl", "--summarize_only")  # Only seed 0 / stabledrl ran.
  assert json.loads((tmp_path / "comparison.json").read_text()) == comparison


@pytest.mark.parametrize("script", ["stress_test.py", "compare_objectives.py"])
def test_unknown_objective_is_a_usage_error(script, tmp_path):
  out = run_script(script, f"--workdir={tmp_path}", "--objectives=ppo", check=False)
  assert out.returncode != 0 and "ppo" in out.stderr
  assert not any(tmp_path.iterdir())  # Refused before anything ran.


@pytest.mark.parametrize("path", sorted((REPO / "notebooks").glob("*.ipynb")),
                         ids=lambda p: p.name)
def test_notebooks_are_committed_without_outputs(path):
  notebook = json.loads(path.read_text())
  for cell in notebook["cells"]:
    if cell["cell_type"] == "code":
      assert cell["outputs"] == [] and cell["execution_count"] is None, cell["source"][:80]
