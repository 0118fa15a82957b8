"""Tasks, data loading, synthetic generators and the resumable iterator."""

import csv
import json
import pathlib
import sys
import types

import pytest

from stabledrl_jax import tasks
from stabledrl_jax.rewards import arithmetic
from stabledrl_jax.tasks import countdown, sudoku
from stabledrl_jax.training.config import config_lib, specs
from stabledrl_jax.training.inputs import data

SHARED_DATA = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"
needs_shared_data = pytest.mark.skipif(not SHARED_DATA.is_dir(),
                                       reason="needs ../shared/data (not in user clones)")


# Reasoning long enough that the answer is not "mostly boxed" (StableDRL's anti-short-boxed term).
_REASONING = "Work through the problem one step at a time, then check the result."


def _layout(answer: str) -> str:
  return f"<reasoning>\n{_REASONING}\n</reasoning>\n<answer>\n{answer}\n</answer>"


# ---------------------------------------------------------------------------
# Registry and task behaviour.
# ---------------------------------------------------------------------------


def test_registry_names_and_aliases():
  assert tasks.list_tasks() == ["countdown", "gsm8k", "math500", "sudoku"]
  assert tasks.get_task("math") is tasks.get_task("math500")
  assert tasks.get_task("gsm") is tasks.get_task("gsm8k")
  with pytest.raises(KeyError, match="registered"):
    tasks.get_task("chess")
  clash = tasks.Task(name="countdown", instruction="", rewards={"stabledrl": (), "d1": ()},
                     parse_answer=str, score=None, example_from_record=None)
  with pytest.raises(ValueError, match="already registered"):
    tasks.register_task(clash)


def test_prompt_is_instruction_then_question():
  example = countdown.make_example([25, 4, 3], 63)
  task = tasks.get_task("countdown")
  prompt = task.prompt(example)
  assert prompt.startswith(task.instruction) and prompt.endswith("Numbers: [25, 4, 3]\nTarget: 63")
  assert task.prompt(example, with_instruction=False) == example.question
  assert "<answer>" in task.instruction and "<reasoning>" in task.instruction


# The official StableDRL prompts, as its dataloaders build them (JianyuanZhong/StableDRL:
# dataloaders/logic_puzzles.py collate_fn_countdown and collate_fn_sudoku; dataloaders/math.py
# collate_fn_mixed, which configs/math_spg_snis.yaml and gsm8k_math_spg_snis.yaml use), written
# out by hand here.
OFFICIAL_PROMPTS = [
    (countdown.make_example([30, 100, 93], 23),
     "Given numbers [30, 100, 93], find an equation that equals 23. Please put the reasoning in "
     "<reasoning> tags and the final equation in <answer> tags, e.g. <answer> 1 + 1 </answer>."),
    (sudoku.make_example("3102200002100320", "3142243142131324"),
     "Solve this 4x4 Sudoku puzzle: 3102200002100320. Use 0 for empty cells. Please put the "
     "reasoning in <reasoning> tags and the solution string in <answer> tags."),
    (tasks.get_task("gsm8k").example_from_record({"question": "What is 2 + 3?",
                                                   "answer": "2 + 3 = 5\n#### 5"}),
     "What is 2 + 3?(Please put the final answer in \\\\boxed{} tag, i.e. "
     "$\\\\boxed{answer here}$)"),
    (tasks.get_task("math500").example_from_record({"problem": "Find $x$.", "answer": "2"}),
     "Find $x$.(Please put the final answer in \\\\boxed{} tag, i.e. $\\\\boxed{answer here}$)"),
]


@pytest.mark.parametrize("example, official", OFFICIAL_PROMPTS)
def test_the_stabledrl_prompt_style_is_the_official_template(example, official):
  name = {"Given": "countdown", "Solve": "sudoku", "What": "gsm8k", "Find": "math500"}[
      official.split()[0].rstrip("$")]
  task = tasks.get_task(name)
  assert task.prompt(example, style="stabledrl") == official
  assert task.prompt(example, style="d1") == task.prompt(example)  # d1 stays the default
  assert task.prompt(example, style="stabledrl", with_instruction=False) == example.question
  with pytest.raises(ValueError, match="prompt style"):
    task.prompt(example, style="tulu")


def test_the_run_prompt_style_reaches_the_encoded_prompts():
  example, official = OFFICIAL_PROMPTS[0]
  config = config_lib.get("quickstart")
  config.task.update(name="countdown", with_instruction=True, prompt_style="stabledrl")
  config.tokenizer.alphabet = "".join(sorted(set(official)))
  config.rollout.prompt_length = 256
  tokenizer = data.make_tokenizer(config.tokenizer)
  prompts = data.encode_examples(specs.resolve_rollout(config), tokenizer, tasks.get_task("countdown"), [example])
  assert tokenizer.decode(prompts.tokens[0][prompts.mask[0]]) == official


def test_paper_configs_prompt_in_the_official_style_and_the_quickstart_is_unchanged():
  for name in ("llada8b_gsm8k", "llada8b_math", "llada8b_countdown", "llada8b_sudoku",
               "sdar8b_math"):
    config = config_lib.get(name)
    assert config.task.prompt_style == "stabledrl" and config.task.with_instruction, name
  assert config_lib.get("quickstart").task.prompt_style == "d1"


def test_the_official_sudoku_csv_trains_with_leading_zeros_kept_or_restored(tmp_path):
  """d1's 4x4_sudoku_unique_puzzles.csv (the official training file) has a Puzzle,Solution
  header; a copy saved through pandas or `datasets` without dtype=str lost its leading zeros,
  which the loader restores as the official one does (zfill(16))."""
  path = tmp_path / "4x4_sudoku_unique_puzzles.csv"
  path.write_text("Puzzle,Solution\n0140432014020000,2143432114323214\n"
                  "140432014020000,2143432114323214\n3102200002100320,3142243142131324\n")
  examples = tasks.load_examples("sudoku", str(path), split="train")
  assert [sudoku.puzzle_of(e) for e in examples] == ["0140432014020000", "0140432014020000",
                                                     "3102200002100320"]
  assert examples[1].ground_truth == "2143432114323214"
  row = sudoku.example_from_record({"Puzzle": 140432014020000, "Solution": 2143432114323214})
  assert sudoku.puzzle_of(row) == "0140432014020000"
  config = config_lib.get("quickstart")
  config.data.update(train=str(path), train_size=0)
  assert len(data.make_examples(config, "train")) == 3
  with pytest.raises(ValueError, match="16-digit"):
    sudoku.example_from_record({"Puzzle": "01404320140200001", "Solution": "2143432114323214"})


@pytest.mark.parametrize("name, example, good, bad", [
    ("countdown", countdown.make_example([25, 4, 3], 63),
     # The official reward reads a plain string in the tags, d1's score the boxed expression.
     "\\boxed{(25 - 4) * 3} " + _layout("(25 - 4) * 3"), _layout("25 + 4 + 3")),
    ("sudoku", sudoku.make_example("1034000000000000", "1234341221434321"),
     _layout("1234341221434321"), _layout("1034000000000000")),
    ("gsm8k", tasks.Example("Janet...", 18.0), _layout("\\boxed{18}"), _layout("\\boxed{17}")),
    ("math500", tasks.Example("Compute...", "\\frac{1}{2}"), _layout("\\boxed{\\dfrac{1}{2}}"),
     _layout("\\boxed{\\frac{1}{3}}")),
])
@pytest.mark.parametrize("scheme", tasks.REWARD_SCHEMES)
def test_reward_and_score_separate_right_from_wrong(name, example, good, bad, scheme):
  task = tasks.get_task(name)
  assert task.reward(good, example, scheme) == pytest.approx(task.max_reward(scheme))
  assert task.reward(bad, example, scheme) < task.reward(good, example, scheme)
  assert task.score(good, example).correct == task.score(good, example).total > 0
  assert task.score(bad, example).correct == 0
  assert set(task.reward_components(good, example, scheme)) == {
      term.name for term in task.reward_terms(scheme)}
  assert task.parse_answer(good) is not None


@pytest.mark.parametrize("name", tasks.list_tasks())
def test_official_rewards_add_anti_short_boxed_to_every_task(name):
  task = tasks.get_task(name)
  assert task.reward_terms("stabledrl")[-1] is tasks.base.ANTI_SHORT_BOXED
  assert task.reward_terms() == task.reward_terms("stabledrl")  # the default scheme
  with pytest.raises(ValueError, match="reward scheme"):
    task.reward("x", tasks.Example("q", 1.0), "grpo")


def test_official_math_rewards_are_plus_or_minus_one_on_the_whole_text():
  gsm8k, math = tasks.get_task("gsm8k"), tasks.get_task("math500")
  example = tasks.Example("q", 18.0)
  # No box or tag needed: math-verify reads the answer from the text.
  assert gsm8k.reward_components("So she earns 18 dollars a day.", example, "stabledrl") == {
      "correctness": 1.0, "anti_short_boxed": 1.0}
  assert gsm8k.reward("\\boxed{17}", example, "stabledrl") == -1.0  # wrong and bare boxed
  solution = tasks.Example("q", "\\frac{1}{2}", reference="Half: $\\boxed{\\frac12}$.")
  assert math.reward_components("so $x = 0.5$, i.e. \\boxed{0.5}", solution, "stabledrl")[
      "correctness"] == 1.0


def test_gsm8k_reward_mixture_follows_d1_weights():
  task = tasks.get_task("gsm8k")
  example = tasks.Example("q", 18.0)
  assert task.max_reward("d1") == 3.5  # correctness 2.0 + three layout terms of 0.5
  assert task.reward("18", example, "d1") == 2.0  # right number, no layout
  assert task.reward_components(_layout("\\boxed{18}"), example, "d1") == {
      "correctness": 1.0, "tag_count": 1.0, "soft_format": 1.0, "strict_format": 1.0}


# ---------------------------------------------------------------------------
# Loading.
# ---------------------------------------------------------------------------


def test_loads_the_d1_countdown_test_set():
  examples = tasks.load_examples("countdown", "countdown_cd3_test.jsonl")  # packaged
  assert len(examples) == 256
  assert examples[0].question == "Numbers: [30, 100, 93]\nTarget: 23"
  assert examples[0].ground_truth == [[30, 100, 93], 23]


def test_loads_the_d1_sudoku_test_set():
  examples = tasks.load_examples("sudoku", "4x4_test_sudoku.csv")  # packaged
  assert len(examples) == 500
  first = examples[0]
  assert sudoku.puzzle_of(first) == "3102200002100320"  # leading digits kept as text
  assert first.ground_truth == "3142243142131324"
  task = tasks.get_task("sudoku")
  assert task.reward(_layout(first.ground_truth), first, "d1") == 1.0
  # Unlike our generator's puzzles, 124 of the 500 d1 test puzzles have 2 to 4 solutions (two
  # independent counters agree); the listed solution is always one of them.
  counts = [sudoku.count_solutions(sudoku.puzzle_of(example)) for example in examples]
  assert counts == [_count_by_backtracking(sudoku.puzzle_of(example), limit=10)
                    for example in examples]
  assert sum(count == 1 for count in counts) == 376
  for example in examples:
    puzzle = sudoku.puzzle_of(example)
    assert _valid_grid(example.ground_truth) and puzzle.count("0") == 8
    assert all(p in ("0", s) for p, s in zip(puzzle, example.ground_truth))


def test_loads_gsm8k_jsonl_with_hash_answers(tmp_path):
  path = tmp_path / "gsm8k.jsonl"
  rows = [{"question": "How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
          {"question": "How much?", "answer": "Total\n#### 1,250"}]
  path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")
  examples = tasks.load_examples("gsm8k", path)
  assert [example.ground_truth for example in examples] == [7.0, 1250.0]
  assert examples[0].reference.endswith("#### 7")
  assert tasks.load_examples("gsm8k", path, limit=1) == examples[:1]


def test_loads_csv_and_rejects_unknown_formats(tmp_path):
  path = tmp_path / "puzzles.csv"
  with path.open("w", newline="") as file:
    writer = csv.writer(file)
    writer.writerow(["Puzzle", "Solution"])
    writer.writerow(["0034000000000000", "1234341221434321"])
  (example,) = tasks.load_examples("sudoku", path)
  assert sudoku.puzzle_of(example) == "0034000000000000"
  with pytest.raises(ValueError, match="unsupported"):
    tasks.read_records(tmp_path / "data.txt")
  with pytest.raises(ValueError, match="absent.jsonl: no such file or directory"):
    tasks.read_records(tmp_path / "absent.jsonl")
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"a": 1}\nnot json\n')
  with pytest.raises(ValueError, match="bad.jsonl:2"):
    tasks.read_records(bad)


def test_loads_parquet(tmp_path):
  pyarrow = pytest.importorskip("pyarrow")
  import pyarrow.parquet  # pylint: disable=g-import-not-at-top
  path = tmp_path / "math.parquet"
  table = pyarrow.table({"problem": ["What is 1/2 + 0?"],
                         "solution": ["It is $\\boxed{\\frac12}$."]})
  pyarrow.parquet.write_table(table, path)
  (example,) = tasks.load_examples("math500", path)
  assert example.ground_truth == "\\frac12"


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "pyarrow", None)
  monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
  path = tmp_path / "x.parquet"
  path.write_bytes(b"PAR1")
  with pytest.raises(ImportError, match="pip install pyarrow"):
    tasks.read_records(path)


def test_hub_without_datasets_says_what_to_do(monkeypatch):
  monkeypatch.setitem(sys.modules, "datasets", None)
  with pytest.raises(ImportError, match=r"pip install .stabledrl_jax\[datasets\]."):
    tasks.load_examples("gsm8k")


def test_hub_loading_uses_the_task_default_source(monkeypatch):
  calls = []

  def load_dataset(path, config, split):
    calls.append((path, config, split))
    return [{"question": "q", "answer": "#### 5"}]

  monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
  (example,) = tasks.load_examples("gsm8k")
  assert example.ground_truth == 5.0
  tasks.load_examples("gsm8k", "someone/gsm8k-copy", split="train")
  assert calls == [("openai/gsm8k", "main", "test"), ("someone/gsm8k-copy", None, "train")]
  with pytest.raises(ValueError, match="no default Hub dataset"):
    tasks.load_examples("sudoku")


def test_math_trains_on_the_official_set_and_tests_on_math500(monkeypatch):
  calls = []
  rows = [{"problem": "1+1?", "level": "Level 2", "solution": "It is \\boxed{2}."},
          {"problem": "hard", "level": "Level 5", "solution": "\\boxed{3}"},
          {"problem": "x " * 301, "level": "Level 1", "solution": "\\boxed{4}"},
          {"problem": "odd", "level": "Level ?", "solution": "\\boxed{5}"}]

  def load_dataset(path, config, split):
    calls.append((path, config, split))
    return rows

  monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
  (example,) = tasks.load_examples("math500", split="train")
  assert example.ground_truth == "2" and example.reference == "It is \\boxed{2}."
  assert len(tasks.load_examples("math500", split="test")) == 4  # MATH-500: no filter
  assert calls == [("qwedsacf/competition_math", None, "train"),
                   ("HuggingFaceH4/MATH-500", None, "test")]


def test_packaged_d1_test_sets_load_by_name():
  assert {"countdown_cd3_test.jsonl", "4x4_test_sudoku.csv"} <= set(tasks.packaged_files())
  assert len(tasks.load_examples("countdown", "countdown_cd3_test.jsonl")) == 256
  assert len(tasks.load_examples("sudoku", "4x4_test_sudoku.csv")) == 500


@pytest.mark.parametrize("name, record, question, ground_truth", [
    ("countdown", {"nums": [1, 2, 3], "target": 6}, "Numbers: [1, 2, 3]\nTarget: 6",
     [[1, 2, 3], 6]),
    ("countdown", {"question": "Numbers: [1, 2]\nTarget: 3", "ground_truth": [[1, 2], 3]},
     "Numbers: [1, 2]\nTarget: 3", [[1, 2], 3]),
    ("math500", {"problem": "p", "answer": "7", "solution": "s"}, "p", "7"),
    ("gsm8k", {"question": "q", "ground_truth": 4.0}, "q", 4.0),
])
def test_records_of_every_known_layout(name, record, question, ground_truth):
  example = tasks.get_task(name).example_from_record(record)
  assert (example.question, example.ground_truth) == (question, ground_truth)


# ---------------------------------------------------------------------------
# Countdown generator.
# ---------------------------------------------------------------------------


def test_every_generated_countdown_task_is_solvable():
  generator = tasks.CountdownGenerator(300, seed=7)
  for example in generator:
    numbers, target = example.ground_truth
    assert len(numbers) == 3 and all(1 <= number <= 100 for number in numbers)
    assert 1 <= target <= 100
    # The shipped reference is a solution ...
    evaluation = arithmetic.evaluate_arithmetic(example.reference)
    assert evaluation.value == target and sorted(evaluation.integer_literals()) == sorted(numbers)
    # ... and an independent exhaustive search confirms one exists.
    found = tasks.solve_countdown(numbers, target)
    assert found is not None and arithmetic.evaluate_arithmetic(found).value == target


def test_countdown_generator_is_deterministic_per_index():
  a = tasks.CountdownGenerator(50, seed=1)
  assert list(a) == list(tasks.CountdownGenerator(50, seed=1))
  assert a[10] == tasks.CountdownGenerator(1000, seed=1)[10]  # size does not change items
  assert list(a) != list(tasks.CountdownGenerator(50, seed=2))
  assert a[-1] == a[49]
  with pytest.raises(IndexError):
    a[50]  # pylint: disable=pointless-statement
  four = tasks.CountdownGenerator(20, seed=0, num_numbers=4)
  assert all(len(example.ground_truth[0]) == 4 for example in four)


def test_solver_finds_solutions_and_reports_impossible_tasks():
  assert arithmetic.evaluate_arithmetic(tasks.solve_countdown([25, 4, 3], 63)).value == 63
  assert arithmetic.evaluate_arithmetic(tasks.solve_countdown([3, 3, 8, 8], 24)).value == 24
  assert tasks.solve_countdown([1, 1, 1], 100) is None


# ---------------------------------------------------------------------------
# Sudoku generator.
# ---------------------------------------------------------------------------


def _valid_grid(cells: str) -> bool:
  rows = [cells[4 * r:4 * r + 4] for r in range(4)]
  columns = ["".join(row[c] for row in rows) for c in range(4)]
  boxes = ["".join(rows[r + i][c + j] for i in (0, 1) for j in (0, 1))
           for r in (0, 2) for c in (0, 2)]
  return all(sorted(group) == list("1234") for group in rows + columns + boxes)


def _count_by_backtracking(puzzle: str, limit: int = 2) -> int:
  """Independent solution counter: plain backtracking, no precomputed grids."""
  cells = list(puzzle)
  try:
    blank = cells.index("0")
  except ValueError:
    return int(_valid_grid(puzzle))
  row, column = divmod(blank, 4)
  count = 0
  for digit in "1234":
    peers = {cells[4 * row + c] for c in range(4)} | {cells[4 * r + column] for r in range(4)}
    box_row, box_column = row // 2 * 2, column // 2 * 2
    peers |= {cells[4 * (box_row + i) + box_column + j] for i in (0, 1) for j in (0, 1)}
    if digit not in peers:
      cells[blank] = digit
      count += _count_by_backtracking("".join(cells), limit - count)
      cells[blank] = "0"
      if count >= limit:
        break
  return count


def test_all_288_solution_grids_are_valid_and_distinct():
  grids = sudoku.all_solution_grids()
  as_text = {"".join(map(str, grid)) for grid in grids}
  assert len(grids) == len(as_text) == 288
  assert all(_valid_grid(grid) for grid in as_text)


def test_every_generated_sudoku_has_exactly_one_solution():
  for split, size in (("train", 120), ("test", 40)):
    for example in tasks.SudokuGenerator(size, seed=3, split=split):
      puzzle, solution = sudoku.puzzle_of(example), example.ground_truth
      assert _count_by_backtracking(puzzle) == 1
      assert sudoku.count_solutions(puzzle) == 1
      assert _valid_grid(solution)
      assert all(p in ("0", s) for p, s in zip(puzzle, solution))
      assert 6 <= puzzle.count("0") <= 10


def test_train_and_test_puzzles_are_disjoint():
  train = {example.question for example in tasks.SudokuGenerator(400, seed=0, split="train")}
  test = {example.question for example in tasks.SudokuGenerator(200, seed=0, split="test")}
  other_seed_test = {ex.question for ex in tasks.SudokuGenerator(200, seed=9, split="test")}
  assert not train & test and not train & other_seed_test
  assert all(sudoku.split_of(question[-16:]) == "train" for question in train)
  assert all(sudoku.split_of(question[-16:]) == "test" for question in test)


def test_sudoku_generator_is_deterministic_and_honours_exclusions():
  generator = tasks.SudokuGenerator(30, seed=5, blanks_range=(8, 8))
  assert list(generator) == list(tasks.SudokuGenerator(30, seed=5, blanks_range=(8, 8)))
  assert all(sudoku.puzzle_of(example).count("0") == 8 for example in generator)
  excluded = frozenset(sudoku.puzzle_of(example) for example in generator)
  fresh = tasks.SudokuGenerator(30, seed=5, blanks_range=(8, 8), exclude=excluded)
  assert not excluded & {sudoku.puzzle_of(example) for example in fresh}
  with pytest.raises(ValueError):
    sudoku.generate_sudoku(None, split="validation")


# ---------------------------------------------------------------------------
# Iterator.
# ---------------------------------------------------------------------------


def test_iterator_visits_every_example_once_per_epoch():
  data = list(range(10))
  iterator = tasks.DataIterator(data, batch_size=5, seed=0)
  epoch = next(iterator) + next(iterator)
  assert sorted(epoch) == data and epoch != data
  assert iterator.epoch == 1
  assert tasks.DataIterator(data, batch_size=4, shuffle=False).__next__() == [0, 1, 2, 3]


def test_iterator_is_deterministic_and_batches_span_epochs():
  data = list(range(7))

  def first_batches(seed):
    iterator = tasks.DataIterator(data, 3, seed=seed)
    return [next(iterator) for _ in range(5)]

  batches = first_batches(4)
  assert batches == first_batches(4) and batches != first_batches(5)
  assert all(len(batch) == 3 for batch in batches)  # 15 items: two epochs and a bit
  assert sorted(sum(batches, [])[:7]) == data and sorted(sum(batches, [])[7:14]) == data


def test_iterator_state_restores_exactly_through_json():
  data = tasks.CountdownGenerator(11, seed=0)
  original = tasks.DataIterator(data, batch_size=4, seed=2)
  for _ in range(5):
    next(original)
  saved = json.loads(json.dumps(original.state()))
  assert all(isinstance(value, int) for value in saved.values())
  expected = [next(original) for _ in range(6)]
  resumed = tasks.DataIterator(data, batch_size=4, seed=2)
  resumed.restore(saved)
  assert [next(resumed) for _ in range(6)] == expected
  alias = tasks.DataIterator(data, batch_size=4, seed=2)
  alias.set_state(alias.get_state())


def test_iterator_refuses_a_state_from_another_setup():
  state = tasks.DataIterator(list(range(10)), batch_size=2, seed=0).state()
  with pytest.raises(ValueError, match="does not match"):
    tasks.DataIterator(list(range(10)), batch_size=2, seed=1).restore(state)
  with pytest.raises(ValueError, match="does not match"):
    tasks.DataIterator(list(range(12)), batch_size=2, seed=0).restore(state)
  with pytest.raises(ValueError):
    tasks.DataIterator([], batch_size=2)


def _hub_dataset_repo(root, config, files):
  """A local directory laid out as a Hub dataset repository: README.md declaring the
  configuration's splits (as openai/gsm8k's does) and one parquet shard per split."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  (root / config).mkdir(parents=True)
  lines = ["---", "configs:", f"- config_name: {config}", "  data_files:"]
  for split, rows in files.items():
    pq.write_table(pa.Table.from_pylist(rows), root / config / f"{split}-00000-of-00001.parquet")
    lines += [f"  - split: {split}", f"    path: {config}/{split}-*"]
  (root / "README.md").write_text("\n".join(lines + ["---", ""]))
  return root


def test_a_local_copy_of_a_hub_dataset_loads_with_the_official_split_and_config(tmp_path):
  """GSM8K as the official configs name it (openai/gsm8k, config main, train / test), from a
  directory in the Hub layout: offline, through `datasets`, as the trainer reads it."""
  rows = lambda split, n: [{"question": f"{split} question {i}?",
                            "answer": f"Some steps.\n#### {1000 + i}"} for i in range(n)]
  repo = _hub_dataset_repo(tmp_path / "gsm8k", "main", {"train": rows("train", 5),
                                                         "test": rows("test", 3)})
  test = tasks.load_examples("gsm8k", repo, split="test")
  assert [e.question for e in test] == [f"test question {i}?" for i in range(3)]
  assert [float(e.ground_truth) for e in test] == [1000, 1001, 1002]  # After "####".
  assert len(tasks.load_examples("gsm8k", repo, split="train", limit=4)) == 4
  config = config_lib.llada8b_config("gsm8k", learning_rate=1e-6)
  config.data.update(train=str(repo), eval=str(repo), train_size=0, eval_size=2)
  assert [e.question for e in data.make_examples(config, "eval")] == [
      "test question 0?", "test question 1?"]
  assert len(data.make_examples(config, "train")) == 5


def test_the_official_gsm8k_gold_is_the_text_after_the_hashes_never_an_exponent():
  from stabledrl_jax.tasks import gsm8k  # pylint: disable=g-import-not-at-top
  task = tasks.get_task("gsm8k")
  example = task.example_from_record({"question": "q", "answer": "so 1234567\n#### 1234567"})
  assert gsm8k.official_gold(example) == "1234567"
  assert gsm8k.official_gold(tasks.Example("q", 1234567.0)) == "1234567"
  assert gsm8k.official_gold(tasks.Example("q", 2.5)) == "2.5"
  right = "<answer>\\boxed{1234567}</answer>"
  assert task.reward_components(right, tasks.Example("q", 1234567.0))["correctness"] == 1.0
