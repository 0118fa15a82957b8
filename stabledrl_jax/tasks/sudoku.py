"""4x4 sudoku: fill the blanks (0) so every row, column and 2x2 box holds 1-4 once.

Data: the d1 test set (`4x4_test_sudoku.csv`, columns Puzzle,Solution, 500 puzzles with 8 blanks)
or `SudokuGenerator`, which makes uniquely solvable puzzles offline from a seed, with train and
test splits disjoint by construction.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import zlib
from typing import Any, Mapping

import numpy as np

from stabledrl_jax.rewards import d1_protocol, task_rewards
from stabledrl_jax.tasks import base

SIZE = 4
BOX = 2
NUM_CELLS = SIZE * SIZE

INSTRUCTION = (
    "Solve this 4x4 Sudoku. The grid is a 16-digit string read row by row from the top left, "
    "with 0 marking an empty cell. Fill every empty cell with a digit from 1 to 4 so that each "
    "row, each column and each of the four 2x2 boxes contains 1, 2, 3 and 4 exactly once. "
    "Answer with the complete solved grid as 16 digits, without spaces or separators.\n"
    + base.ANSWER_FORMAT.format(answer="the 16 digits of the solved grid"))


def stabledrl_prompt(example: base.Example) -> str:
  """The official StableDRL sudoku prompt (its logic_puzzles.py ``collate_fn_sudoku``)."""
  return (f"Solve this 4x4 Sudoku puzzle: {puzzle_of(example)}. Use 0 for empty cells. Please "
          "put the reasoning in <reasoning> tags and the solution string in <answer> tags.")


def format_question(puzzle: str) -> str:
  # "Sudoku puzzle: <16 digits>" is where the d1 scorer looks for the puzzle.
  return f"Sudoku puzzle: {puzzle}"


def make_example(puzzle: str, solution: str) -> base.Example:
  """An example of ``puzzle`` (16 digits 0-4, 0 blank) and its ``solution`` (a complete valid
  grid that keeps the puzzle's givens); ValueError saying which is wrong."""
  if len(puzzle) != NUM_CELLS or len(solution) != NUM_CELLS:
    raise ValueError(f"expected two {NUM_CELLS}-digit grids, got {puzzle!r} and {solution!r}")
  if not all(cell in "01234" for cell in puzzle):
    raise ValueError(f"puzzle {puzzle!r} holds a cell that is not 0 (blank) or 1-4")
  if solution not in _solution_strings():
    raise ValueError(f"solution {solution!r} is not a complete valid 4x4 grid (1-4 once in "
                     "every row, column and box)")
  if any(given not in ("0", cell) for given, cell in zip(puzzle, solution)):
    raise ValueError(f"solution {solution!r} does not keep the givens of puzzle {puzzle!r}")
  return base.Example(question=format_question(puzzle), ground_truth=solution, reference=solution)


def puzzle_of(example: base.Example) -> str:
  """The puzzle string, read back from the question as the d1 scorer does."""
  puzzle = d1_protocol.sudoku_puzzle(example.question)
  if puzzle is None:
    raise ValueError(f"No 16-digit sudoku puzzle in question {example.question!r}.")
  return puzzle


def _grid(value: Any) -> str:
  """A grid cell string; one read as a number (a CSV loaded by `datasets` or pandas without
  dtype=str drops leading zeros: 0140... becomes 140...) gets its zeros back, as the official
  StableDRL loader does (``zfill(16)``)."""
  text = str(value).strip()
  if isinstance(value, int) or (text.isdigit() and len(text) < NUM_CELLS):
    text = text.zfill(NUM_CELLS)
  return text


def example_from_record(record: Mapping[str, Any]) -> base.Example:
  """A CSV row (Puzzle, Solution; any letter case) or a d1 generation record."""
  fields = {key.lower(): value for key, value in record.items()}
  if "puzzle" in fields and "solution" in fields:
    return make_example(_grid(fields["puzzle"]), _grid(fields["solution"]))
  if "question" in fields and "ground_truth" in fields:
    puzzle = d1_protocol.sudoku_puzzle(str(fields["question"]))
    if puzzle is None:
      raise ValueError(f"No puzzle in question {fields['question']!r}.")
    return make_example(puzzle, str(fields["ground_truth"]))
  raise ValueError(f"not a sudoku record: its columns are {sorted(record)}; expected Puzzle and "
                   "Solution, or question and ground_truth")


def _reward(completion: str, example: base.Example) -> float:
  return task_rewards.sudoku_reward(completion, puzzle_of(example), example.ground_truth)


def _score(completion: str, example: base.Example) -> base.ItemScore:
  correct, blanks = d1_protocol.sudoku_cells_correct(
      completion, example.question, example.ground_truth)
  return base.ItemScore(float(correct), float(blanks))


def _parse_answer(completion: str) -> str | None:
  return task_rewards.sudoku_answer(completion, NUM_CELLS)


def _generate(size: int, *, seed: int, split: str, **options: Any) -> SudokuGenerator:
  """``data.train='synthetic'``: ``SudokuGenerator`` (options: split, blanks_range)."""
  options.setdefault("split", split)
  options["blanks_range"] = tuple(options.get("blanks_range", (6, 10)))
  return SudokuGenerator(size, seed=seed, **options)


def _demonstrate(example: base.Example, error_cells: int) -> str:
  """The demonstrator's habitual mistake: the digit of each of the first ``error_cells`` blank
  cells replaced by the next digit (4 wraps to 1)."""
  cells = list(example.reference)
  blanks = [i for i, digit in enumerate(puzzle_of(example)) if digit == "0"][:error_cells]
  for i in blanks:
    cells[i] = str(int(cells[i]) % 4 + 1)
  return "".join(cells)


TASK = base.register_task(base.Task(
    name="sudoku",
    instruction=INSTRUCTION,
    rewards={"stabledrl": (base.RewardTerm("correctness", 1.0, _reward), base.ANTI_SHORT_BOXED),
             "d1": (base.RewardTerm("correctness", 1.0, _reward),)},
    parse_answer=_parse_answer,
    score=_score,
    example_from_record=example_from_record,
    stabledrl_prompt=stabledrl_prompt,
    generator=_generate,
    demonstrate=_demonstrate,
    suite_position=3,
    test_file="4x4_test_sudoku.csv",
))


# ---------------------------------------------------------------------------
# Solutions of 4x4 grids.
# ---------------------------------------------------------------------------


def _peers(cell: int) -> list[int]:
  """Cells that share a row, column or box with `cell` (excluding itself)."""
  row, column = divmod(cell, SIZE)
  box_row, box_column = row // BOX * BOX, column // BOX * BOX
  peers = set()
  for other in range(NUM_CELLS):
    other_row, other_column = divmod(other, SIZE)
    same_box = (other_row // BOX * BOX, other_column // BOX * BOX) == (box_row, box_column)
    if other != cell and (other_row == row or other_column == column or same_box):
      peers.add(other)
  return sorted(peers)


@functools.cache
def all_solution_grids() -> np.ndarray:
  """Every complete valid 4x4 grid (there are 288): int8 array [288, 16]."""
  peers = [_peers(cell) for cell in range(NUM_CELLS)]
  grids = []
  grid = [0] * NUM_CELLS

  def fill(cell: int) -> None:
    if cell == NUM_CELLS:
      grids.append(list(grid))
      return
    for digit in range(1, SIZE + 1):
      if all(grid[peer] != digit for peer in peers[cell]):
        grid[cell] = digit
        fill(cell + 1)
    grid[cell] = 0

  fill(0)
  return np.asarray(grids, dtype=np.int8)


@functools.cache
def _solution_strings() -> frozenset[str]:
  return frozenset("".join(map(str, grid)) for grid in all_solution_grids().tolist())


def _as_cells(puzzle: str) -> np.ndarray:
  return np.frombuffer(puzzle.encode("ascii"), dtype=np.uint8).astype(np.int8) - ord("0")


def count_solutions(puzzle: str) -> int:
  """Number of valid completions of a 4x4 puzzle (exact: matched against all 288 grids)."""
  cells = _as_cells(puzzle)
  grids = all_solution_grids()
  return int(np.all((cells == 0) | (grids == cells), axis=1).sum())


# ---------------------------------------------------------------------------
# Seeded generator with disjoint splits.
# ---------------------------------------------------------------------------


def split_of(puzzle: str, test_fraction: float = 0.1) -> str:
  """"test" or "train", a fixed function of the puzzle string (CRC32 bucket).

  Every puzzle belongs to exactly one split whatever the seed, so generated train and test
  sets can never share a puzzle.
  """
  bucket = zlib.crc32(puzzle.encode("ascii")) % 10_000
  return "test" if bucket < round(test_fraction * 10_000) else "train"


def _unique_puzzle(rng: np.random.Generator, num_blanks: int) -> tuple[str, str] | None:
  """Blanks cells of a random grid in random order while the solution stays unique."""
  grids = all_solution_grids()
  solution = grids[rng.integers(len(grids))]
  puzzle = solution.copy()
  blanked = 0
  for cell in rng.permutation(NUM_CELLS):
    puzzle[cell] = 0
    if np.all((puzzle == 0) | (grids == puzzle), axis=1).sum() == 1:
      blanked += 1
      if blanked == num_blanks:
        break
    else:
      puzzle[cell] = solution[cell]
  if blanked < num_blanks:
    return None
  to_text = lambda cells: "".join(str(int(digit)) for digit in cells)
  return to_text(puzzle), to_text(solution)


def generate_sudoku(
    rng: np.random.Generator,
    *,
    split: str = "train",
    blanks_range: tuple[int, int] = (6, 10),
    test_fraction: float = 0.1,
    exclude: frozenset[str] = frozenset(),
    max_attempts: int = 100_000,
) -> base.Example:
  """One uniquely solvable 4x4 puzzle of the given split, not in `exclude`.

  Args:
    rng: the randomness.
    split: "train" or "test" (see `split_of`).
    blanks_range: inclusive range of the number of blanks (4x4 puzzles have at most 12).
    test_fraction: share of all puzzles that belong to the test split.
    exclude: puzzles never to produce (e.g. an external test set).
    max_attempts: give up after this many rejected candidates.
  """
  if split not in ("train", "test"):
    raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
  for _ in range(max_attempts):
    num_blanks = int(rng.integers(blanks_range[0], blanks_range[1] + 1))
    candidate = _unique_puzzle(rng, num_blanks)
    if candidate is None:
      continue
    puzzle, solution = candidate
    if puzzle not in exclude and split_of(puzzle, test_fraction) == split:
      return make_example(puzzle, solution)
  raise RuntimeError(f"No {split} sudoku found in {max_attempts} attempts.")


@dataclasses.dataclass(frozen=True)
class SudokuGenerator(collections.abc.Sequence):
  """`size` seeded, uniquely solvable 4x4 puzzles of one split; item i depends only on
  (seed, split, i).

  Attributes:
    size: number of puzzles.
    seed: base seed.
    split: "train" or "test"; the two never share a puzzle, whatever the seeds.
    blanks_range: inclusive range of blanks per puzzle (the d1 test set uses 8).
    test_fraction: share of the puzzle space assigned to "test".
    exclude: puzzles to skip, e.g. those of the d1 test set when generating training data.
  """

  size: int
  seed: int = 0
  split: str = "train"
  blanks_range: tuple[int, int] = (6, 10)
  test_fraction: float = 0.1
  exclude: frozenset[str] = frozenset()

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int) -> base.Example:  # pytype: disable=signature-mismatch
    if not -self.size <= index < self.size:
      raise IndexError(index)
    index %= self.size
    split_code = 0 if self.split == "train" else 1
    rng = np.random.default_rng([self.seed, split_code, index])
    return generate_sudoku(rng, split=self.split, blanks_range=self.blanks_range,
                           test_fraction=self.test_fraction, exclude=self.exclude)
