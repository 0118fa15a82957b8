"""The scoring CLI: d1 file layout, shard pooling, and the d1 baseline table (docs/tasks.md)."""

import json
import pathlib
import subprocess
import sys

import pytest

from stabledrl_jax import scoring, tasks

SHARED_DATA = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"
BASELINES = SHARED_DATA / "d1_baseline_generations"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

# The d1 baseline table: LLaDA-8B-Instruct scored with the d1 protocol, gen length 128 / 256 / 512.
D1_TABLE = {
    "gsm8k_instruct_128_64": 69.29, "gsm8k_instruct_256_128": 76.37,
    "gsm8k_instruct_512_256": 78.14,
    "math500_instruct_128_64": 26.00, "math500_instruct_256_128": 32.40,
    "math500_instruct_512_256": 36.20,
    "countdown_instruct_128_64": 20.70, "countdown_instruct_256_128": 19.53,
    "countdown_instruct_512_256": 16.02,
    "sudoku_instruct_128_64": 11.72, "sudoku_instruct_256_128": 6.69,
    "sudoku_instruct_512_256": 5.47,
}


@pytest.mark.skipif(not BASELINES.is_dir(), reason="needs ../shared/data (not in user clones)")
def test_reproduces_the_d1_baseline_table(tmp_path):
  output = tmp_path / "results.json"
  assert scoring.main([str(BASELINES), "--output", str(output)]) == 0
  results = json.loads(output.read_text())
  assert set(results) == set(D1_TABLE)
  for setup, published in D1_TABLE.items():
    assert results[setup]["accuracy"] == pytest.approx(published, abs=0.1), setup
  assert {results[setup]["n"] for setup in D1_TABLE if setup.startswith("math500")} == {500}
  assert {results[setup]["n"] for setup in D1_TABLE if setup.startswith("countdown")} == {256}


def _write(directory, name, items):
  """items: (example, completion) pairs."""
  examples, completions = zip(*items)
  scoring.write_generations(directory / name, examples, completions, gen_length=8)


def test_shards_of_a_setup_are_pooled(tmp_path):
  right = (tasks.Example("q", 3.0), "<answer>\\boxed{3}</answer>")
  wrong = (tasks.Example("q", 4.0), "<answer>\\boxed{3}</answer>")
  _write(tmp_path, "gsm8k_tiny_8_4_0_generations.json", [right, wrong])
  _write(tmp_path, "gsm8k_tiny_8_4_1_generations.json", [right, right])
  _write(tmp_path, "gsm8k_tiny_16_8_0_generations.json", [wrong])
  (tmp_path / "notes.json").write_text("{}")  # ignored: not a generation file
  results = scoring.score_generation_files([tmp_path])
  assert list(results) == ["gsm8k_tiny_16_8", "gsm8k_tiny_8_4"]
  assert results["gsm8k_tiny_8_4"].accuracy == pytest.approx(75.0)
  assert results["gsm8k_tiny_8_4"].n == 4
  assert results["gsm8k_tiny_16_8"].accuracy == 0.0


def test_sudoku_accuracy_pools_cells_over_puzzles(tmp_path):
  solution = "1234341221434321"
  few_blanks = tasks.sudoku.make_example("1234341221434320", solution)  # 1 blank
  many_blanks = tasks.sudoku.make_example("1000000000000000", solution)  # 15 blanks
  _write(tmp_path, "sudoku_tiny_8_4_0_generations.json", [
      (few_blanks, f"<answer>{solution}</answer>"),          # 1 of 1
      (many_blanks, "<answer>1234000000000000</answer>"),    # 3 of 15
  ])
  result = scoring.score_generation_files([tmp_path])["sudoku_tiny_8_4"]
  assert result.accuracy == pytest.approx(100 * 4 / 16)  # not the mean of 100% and 20%
  assert result.n == 2


def test_written_files_round_trip_through_every_task(tmp_path):
  for name, example, completion in [
      ("countdown", tasks.countdown.make_example([25, 4, 3], 63), "\\boxed{(25-4)*3}"),
      ("math500", tasks.Example("q", "\\frac{1}{2}"), "\\boxed{\\dfrac12}"),
      ("sudoku", tasks.sudoku.make_example("1034000000000000", "1234341221434321"),
       "<answer>\n1234341221434321\n</answer>"),
  ]:
    _write(tmp_path, f"{name}_m_8_4_0_generations.json", [(example, completion)])
  results = scoring.score_generation_files([tmp_path])
  assert {setup: result.accuracy for setup, result in results.items()} == {
      "countdown_m_8_4": 100.0, "math500_m_8_4": 100.0, "sudoku_m_8_4": 100.0}


def test_setup_and_task_from_file_names():
  assert scoring.setup_of("a/gsm8k_instruct_256_128_3_generations.json") == (
      "gsm8k_instruct_256_128")
  assert scoring.setup_of("gsm8k_instruct_256_128_generations.json") == "gsm8k_instruct_256"
  assert scoring.setup_of("results.json") is None
  assert scoring.task_of("math500_instruct_512_256").name == "math500"
  with pytest.raises(KeyError):
    scoring.task_of("chess_instruct_512_256")


def test_cli_rejects_bad_input(tmp_path, capsys):
  bad_name = tmp_path / "gsm8k.json"
  bad_name.write_text("{}")
  for argv in ([str(bad_name)], [str(tmp_path / "missing_0_generations.json")], [str(tmp_path)]):
    with pytest.raises(SystemExit) as exit_info:
      scoring.main(argv)
    assert exit_info.value.code == 2
  assert "error" in capsys.readouterr().err


def test_cli_module_prints_table_and_writes_json(tmp_path):
  example = tasks.Example("q", 2.0)
  _write(tmp_path, "gsm8k_tiny_8_4_0_generations.json", [(example, "\\boxed{2}")])
  output = tmp_path / "out.json"
  completed = subprocess.run(
      [sys.executable, "-m", "stabledrl_jax.scoring", str(tmp_path), "--output", str(output)],
      cwd=REPO_ROOT, capture_output=True, text=True, check=True)
  assert "gsm8k_tiny_8_4" in completed.stdout and "100.00" in completed.stdout
  assert json.loads(output.read_text()) == {"gsm8k_tiny_8_4": {"accuracy": 100.0, "n": 1}}


def test_a_file_named_twice_is_scored_once_and_bad_paths_raise_without_a_skip_list(tmp_path):
  example = tasks.Example("q", 2.0)
  _write(tmp_path, "gsm8k_tiny_8_4_0_generations.json", [(example, "\\boxed{2}")])
  named = tmp_path / "gsm8k_tiny_8_4_0_generations.json"
  results = scoring.score_generation_files([tmp_path, named, tmp_path / "." / named.name])
  assert results["gsm8k_tiny_8_4"].n == 1
  with pytest.raises(FileNotFoundError, match="missing_0_generations.json"):
    scoring.score_generation_files([tmp_path / "missing_0_generations.json"])
  bad = tmp_path / "gsm8k_tiny_8_4_1_generations.json"
  bad.write_text(json.dumps({"generations": [{"question": ["q"], "generations": "2"}]}))
  with pytest.raises(ValueError, match=r"generations\[0\]\.question is a list, not text"):
    scoring.score_generation_files([tmp_path])
  skipped = []
  assert scoring.score_generation_files([tmp_path], skipped)["gsm8k_tiny_8_4"].n == 1
  assert skipped == [f"{bad}: generations[0].question is a list, not text"]
