"""Countdown: combine the given numbers with + - * / into an expression equal to the target.

Data: the d1 test set (`countdown_cd3_test.jsonl`, lines {"input": "30,100,93", "output": "23"}),
the Hub's Jiayi-Pan/Countdown-Tasks-3to4 ({"nums": [...], "target": n}), or
`CountdownGenerator`, which makes any number of solvable tasks offline from a seed.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import fractions
import itertools
import re
from typing import Any, Mapping, Sequence

import numpy as np

from stabledrl_jax.rewards import d1_protocol, task_rewards
from stabledrl_jax.tasks import base

INSTRUCTION = (
    "Combine the given numbers with +, -, * and / (parentheses allowed) into an expression whose "
    "value is exactly the target. Use every number exactly once. After thinking it through, "
    "write only the expression, without an equals sign or the target, as \\boxed{expression} "
    "inside the answer tags.\n" + base.ANSWER_FORMAT.format(answer="\\boxed{expression}"))

_QUESTION = re.compile(r"Numbers:\s*\[([^\]]*)\]\s*Target:\s*(-?\d+)")


def stabledrl_prompt(example: base.Example) -> str:
  """The official StableDRL countdown prompt (its logic_puzzles.py ``collate_fn_countdown``)."""
  numbers, target = _numbers_and_target(example)
  return (f"Given numbers {numbers}, find an equation that equals {target}. Please put the "
          "reasoning in <reasoning> tags and the final equation in <answer> tags, e.g. "
          "<answer> 1 + 1 </answer>.")


def format_question(numbers: Sequence[int], target: int) -> str:
  """The d1 question layout: "Numbers: [49, 55, 53]\\nTarget: 51"."""
  return f"Numbers: {[int(number) for number in numbers]}\nTarget: {int(target)}"


def make_example(numbers: Sequence[int], target: int, reference: str | None = None) -> base.Example:
  numbers = [int(number) for number in numbers]
  return base.Example(question=format_question(numbers, target),
                      ground_truth=[numbers, int(target)], reference=reference)


def _numbers_and_target(example: base.Example) -> tuple[list[int], int]:
  numbers, target = example.ground_truth
  return [int(number) for number in numbers], target


def example_from_record(record: Mapping[str, Any]) -> base.Example:
  """A d1 test line, a Hub row, a {"numbers", "target"} dict or a d1 generation record."""
  reference = record.get("reference") or record.get("solution")
  if "input" in record and "output" in record:
    numbers = [int(part) for part in str(record["input"]).split(",")]
    return make_example(numbers, int(record["output"]), reference)
  for key in ("nums", "numbers"):
    if key in record and "target" in record:
      return make_example(record[key], int(record["target"]), reference)
  if "ground_truth" in record:
    numbers, target = record["ground_truth"]
    return make_example(numbers, target, reference)
  raise ValueError(f"not a countdown record: its columns are {sorted(record)}; expected input and "
                   "output, nums (or numbers) and target, or ground_truth")


def _reward(completion: str, example: base.Example) -> float:
  numbers, target = _numbers_and_target(example)
  return task_rewards.countdown_reward(completion, numbers, target)


def _official_reward(completion: str, example: base.Example) -> float:
  numbers, target = _numbers_and_target(example)
  return task_rewards.official_countdown_reward(completion, numbers, target)


def _score(completion: str, example: base.Example) -> base.ItemScore:
  if isinstance(example.ground_truth, (list, tuple)) and len(example.ground_truth) == 2:
    numbers, target = _numbers_and_target(example)
  else:
    # d1 falls back to the question when the ground truth is not [numbers, target].
    match = _QUESTION.search(example.question)
    if match is None:
      return base.ItemScore(0.0, 1.0)
    numbers = [int(part) for part in match.group(1).split(",") if part.strip()]
    target = int(match.group(2))
  return base.ItemScore(float(d1_protocol.countdown_correct(completion, numbers, target)), 1.0)


def _generate(size: int, *, seed: int, split: str, **options: Any) -> CountdownGenerator:
  """``data.train='synthetic'``: ``CountdownGenerator`` (options: number_range, target_range;
  one distribution for both splits)."""
  del split
  for name in ("number_range", "target_range"):
    if name in options:
      options[name] = tuple(options[name])
  return CountdownGenerator(size, seed=seed, **options)


TASK = base.register_task(base.Task(
    name="countdown",
    instruction=INSTRUCTION,
    rewards={
        # StableDRL's: its own parser (<answer> tags, a plain arithmetic string, unused numbers
        # allowed); plus its anti-short-boxed term.
        "stabledrl": (base.RewardTerm("correctness", 1.0, _official_reward),
                      base.ANTI_SHORT_BOXED),
        "d1": (base.RewardTerm("correctness", 1.0, _reward),),
    },
    parse_answer=task_rewards.countdown_expression,
    score=_score,
    example_from_record=example_from_record,
    # The official StableDRL config trains on the d1 test file (packaged: "countdown_cd3_test.jsonl").
    hub_sources={"train": base.HubSource("Jiayi-Pan/Countdown-Tasks-3to4", split="train")},
    stabledrl_prompt=stabledrl_prompt,
    generator=_generate,
    suite_position=2,
    test_file="countdown_cd3_test.jsonl",
))


# ---------------------------------------------------------------------------
# Exhaustive solver.
# ---------------------------------------------------------------------------

_Term = tuple[fractions.Fraction, str]


def _combinations(left: _Term, right: _Term):
  """Every value reachable by one operation on two terms, with its expression."""
  (a, a_text), (b, b_text) = left, right
  yield a + b, f"({a_text} + {b_text})"
  yield a - b, f"({a_text} - {b_text})"
  yield b - a, f"({b_text} - {a_text})"
  yield a * b, f"({a_text} * {b_text})"
  if b != 0:
    yield a / b, f"({a_text} / {b_text})"
  if a != 0:
    yield b / a, f"({b_text} / {a_text})"


def _search(terms: list[_Term], target: fractions.Fraction) -> str | None:
  if len(terms) == 1:
    value, text = terms[0]
    return text if value == target else None
  for i, j in itertools.combinations(range(len(terms)), 2):
    rest = [term for k, term in enumerate(terms) if k not in (i, j)]
    for combined in _combinations(terms[i], terms[j]):
      found = _search(rest + [combined], target)
      if found is not None:
        return found
  return None


def solve_countdown(numbers: Sequence[int], target: int) -> str | None:
  """An expression that uses each number once and equals the target, or None if none exists.

  Exhaustive over all binary trees and operations with exact rationals (intermediate values
  may be negative or fractional); instant for 3 or 4 numbers, slow beyond 6.
  """
  terms = [(fractions.Fraction(int(number)), str(int(number))) for number in numbers]
  found = _search(terms, fractions.Fraction(target))
  if found is not None and found.startswith("(") and found.endswith(")") and len(terms) > 1:
    found = found[1:-1]
  return found


# ---------------------------------------------------------------------------
# Seeded generator.
# ---------------------------------------------------------------------------

_OPERATIONS = ("+", "-", "*", "/")


def _apply(operation: str, a: int, b: int) -> int | None:
  """a op b if it is a positive integer (keeps generated tasks natural), else None."""
  if operation == "+":
    return a + b
  if operation == "-":
    return a - b if a > b else None
  if operation == "*":
    return a * b
  return a // b if b != 0 and a % b == 0 else None


def _random_solution(rng: np.random.Generator, numbers: list[int]) -> tuple[int, str] | None:
  """Combines the numbers in random order with random operations; None on a dead end."""
  terms: list[tuple[int, str, bool]] = [(number, str(number), True) for number in numbers]
  while len(terms) > 1:
    i, j = rng.choice(len(terms), size=2, replace=False)
    (a, a_text, a_atom), (b, b_text, b_atom) = terms[i], terms[j]
    for operation in rng.permutation(_OPERATIONS):
      value = _apply(str(operation), a, b)
      if value is not None:
        break
    else:
      return None
    left = a_text if a_atom else f"({a_text})"
    right = b_text if b_atom else f"({b_text})"
    terms = [term for k, term in enumerate(terms) if k not in (i, j)]
    terms.append((value, f"{left} {operation} {right}", False))
  return terms[0][0], terms[0][1]


def generate_countdown(
    rng: np.random.Generator,
    *,
    num_numbers: int = 3,
    number_range: tuple[int, int] = (1, 100),
    target_range: tuple[int, int] = (1, 100),
    max_attempts: int = 10_000,
) -> base.Example:
  """One solvable countdown task; the example's `reference` is a solution expression.

  Numbers are drawn uniformly from `number_range`; the target is the value of a random
  expression over them (positive integer intermediate results), kept if it lies in
  `target_range`. Solvable by construction.
  """
  low, high = number_range
  for _ in range(max_attempts):
    numbers = [int(number) for number in rng.integers(low, high + 1, size=num_numbers)]
    solution = _random_solution(rng, numbers)
    if solution is not None and target_range[0] <= solution[0] <= target_range[1]:
      target, expression = solution
      return make_example(numbers, target, reference=expression)
  raise RuntimeError(f"No countdown task found in {max_attempts} attempts; widen the ranges.")


@dataclasses.dataclass(frozen=True)
class CountdownGenerator(collections.abc.Sequence):
  """`size` seeded countdown tasks, generated on access: item i depends only on (seed, i).

  Attributes:
    size: number of tasks.
    seed: base seed.
    num_numbers: numbers per task (3 as in d1's CD3, or 4).
    number_range, target_range: inclusive ranges, as in the d1 test set (1..100).
  """

  size: int
  seed: int = 0
  num_numbers: int = 3
  number_range: tuple[int, int] = (1, 100)
  target_range: tuple[int, int] = (1, 100)

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int) -> base.Example:  # pytype: disable=signature-mismatch
    if not -self.size <= index < self.size:
      raise IndexError(index)
    index %= self.size
    rng = np.random.default_rng([self.seed, index])
    return generate_countdown(rng, num_numbers=self.num_numbers,
                              number_range=self.number_range, target_range=self.target_range)
