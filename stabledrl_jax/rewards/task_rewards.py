"""Correctness rewards for countdown, sudoku, GSM8K and MATH (docs/tasks.md, d1 conventions).

Each reward is a pure function of one completion and its ground truth and returns a float in
[0, 1]. A completion is untrusted text: any string (empty, garbled, a megabyte, "9**9**9**9",
"1/0", a thousand nested parentheses) gets a finite reward quickly and never an exception.
Completions longer than `extraction.MAX_COMPLETION_CHARS` (100k) score 0. Malformed *ground
truth* is a caller bug and does raise.

These are what RL optimizes. The accuracies that papers report use the d1 protocol in
`d1_protocol`, whose extraction rules differ in places (documented there).
"""

from __future__ import annotations

import collections
import fractions
import re
from typing import Sequence

from stabledrl_jax.rewards import arithmetic, extraction, math_equivalence

COUNTDOWN_FORMAT_SCORE = 0.1
_DIGIT = re.compile(r"\d")
_LATEX_OPERATORS = (("\\div", "/"), ("\\times", "*"), ("\\cdot", "*"))


# ---------------------------------------------------------------------------
# Countdown.
# ---------------------------------------------------------------------------


def countdown_expression(completion: str) -> str | None:
  """The proposed expression: the last <answer> tag (its \\boxed{} content if it has one), else
  the last \\boxed{}; LaTeX \\times, \\cdot and \\div read as * * /. None if neither exists."""
  tag = extraction.last_answer_tag(completion)
  if tag is not None:
    boxed = extraction.last_boxed(tag)
    expression = boxed if boxed is not None else tag
  else:
    expression = extraction.last_boxed(completion)
    if expression is None:
      return None
  for latex, operator in _LATEX_OPERATORS:
    expression = expression.replace(latex, operator)
  return expression.strip()


def countdown_reward(completion: str, numbers: Sequence[int], target: float) -> float:
  """1.0 if the answer uses each number exactly once and equals the target; 0.1 if an answer
  expression is present but wrong or invalid; 0.0 if there is none.

  Args:
    completion: the generated text (answer inside <answer>...</answer> or \\boxed{}).
    numbers: the available numbers, e.g. [25, 4, 3].
    target: the value to reach, e.g. 63.
  """
  numbers = sorted(int(number) for number in numbers)
  target = fractions.Fraction(target)
  if extraction.oversized(completion):
    return 0.0
  expression = countdown_expression(completion)
  if expression is None:
    return 0.0
  evaluation = arithmetic.evaluate_arithmetic(expression)
  if evaluation is None:
    return COUNTDOWN_FORMAT_SCORE
  used = evaluation.integer_literals()
  if used is None or sorted(used) != numbers:
    return COUNTDOWN_FORMAT_SCORE
  return 1.0 if abs(evaluation.value - target) < 1e-5 else COUNTDOWN_FORMAT_SCORE


_OFFICIAL_CHARACTERS = re.compile(r"^[\d+\-*/().\s]+$")
_OFFICIAL_NUMBER = re.compile(r"\d+")


def _official_last_answer(text: str) -> str | None:
  """The last match of ``re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)`` (matches taken
  left to right, each from the first "<answer>" to the next "</answer>"), in linear time: the
  regex is quadratic on a completion of unclosed "<answer>" tags."""
  found, position = None, 0
  while True:
    start = text.find(extraction.ANSWER_OPEN, position)
    if start < 0:
      return found
    end = text.find(extraction.ANSWER_CLOSE, start + len(extraction.ANSWER_OPEN))
    if end < 0:
      return found
    found, position = text[start + len(extraction.ANSWER_OPEN):end], end + len(
        extraction.ANSWER_CLOSE)


def official_countdown_reward(completion: str, numbers: Sequence[int], target: float) -> float:
  """The official StableDRL countdown reward (its ``compute_score_countdown``), rule by rule.

  - The equation is the last ``<answer>(.*?)</answer>`` match (non-greedy, left to right),
    stripped; none: 0.0. No ``\\boxed{}``, no LaTeX operators.
  - Every run of digits in it (``\\d+``: "2.5" is 2 and 5) must come from the numbers, each
    at most as often as given (unused numbers allowed); else 0.1.
  - It must consist of digits, ``+ - * / ( ) .`` and whitespace, and Python must evaluate it
    (``arithmetic.python_value``: ``**`` and ``//`` included, floats); else 0.1.
  - 1.0 if the value is within 1e-5 of the target, else 0.1.

  Bounded where the official ``eval`` is not (a huge power scores 0.1), and completions over
  ``extraction.MAX_COMPLETION_CHARS`` score 0.
  """
  if extraction.oversized(completion):
    return 0.0
  equation = _official_last_answer(completion)
  if equation is None:
    return 0.0
  equation = equation.strip()
  available = collections.Counter(int(number) for number in numbers)
  try:
    available.subtract(int(run) for run in _OFFICIAL_NUMBER.findall(equation))
  except ValueError:  # Over Python's 4300-digit int limit: the official check fails too.
    return COUNTDOWN_FORMAT_SCORE
  if any(count < 0 for count in available.values()):
    return COUNTDOWN_FORMAT_SCORE
  if not _OFFICIAL_CHARACTERS.match(equation):
    return COUNTDOWN_FORMAT_SCORE
  value = arithmetic.python_value(equation)
  try:
    return 1.0 if value is not None and abs(value - target) < 1e-5 else COUNTDOWN_FORMAT_SCORE
  except (TypeError, OverflowError):
    return COUNTDOWN_FORMAT_SCORE


# ---------------------------------------------------------------------------
# Sudoku.
# ---------------------------------------------------------------------------


def sudoku_answer(completion: str, num_cells: int = 16) -> str | None:
  """The first `num_cells` digits of the last <answer> tag, right-padded with "0"; None if there
  is no tag or it holds no digit. Separators (spaces, newlines, "|") are ignored."""
  tag = extraction.last_answer_tag(completion)
  if tag is None:
    return None
  digits = []
  for match in _DIGIT.finditer(tag):  # the regex skips non-digits in C: fast on huge tags
    digits.append(match.group(0))
    if len(digits) == num_cells:
      break
  if not digits:
    return None
  return "".join(digits).ljust(num_cells, "0")


def sudoku_reward(completion: str, puzzle: str, solution: str) -> float:
  """Fraction of the puzzle's blank cells ("0") that the answer fills with the right digit.

  Args:
    completion: the generated text, answer grid inside <answer>...</answer>.
    puzzle: the grid as a digit string read row by row, "0" for blanks (16 digits for 4x4).
    solution: the solved grid, same layout.

  Returns:
    A value in [0, 1]; 0.0 without an answer or when the puzzle has no blank.
  """
  if len(puzzle) != len(solution):
    raise ValueError(f"puzzle and solution differ in length: {puzzle!r} vs {solution!r}")
  blanks = [index for index, cell in enumerate(puzzle) if cell == "0"]
  if not blanks or extraction.oversized(completion):
    return 0.0
  answer = sudoku_answer(completion, num_cells=len(puzzle))
  if answer is None:
    return 0.0
  return sum(answer[index] == solution[index] for index in blanks) / len(blanks)


# ---------------------------------------------------------------------------
# GSM8K.
# ---------------------------------------------------------------------------


def gsm8k_reference_value(answer: str | float) -> float:
  """The numeric ground truth from "... #### 1,234", "72" or 72."""
  if isinstance(answer, (int, float)):
    return float(answer)
  text = answer.split("####")[-1]
  value = extraction.parse_number(text)
  if value is None:
    raise ValueError(f"not a GSM8K answer: {answer!r}")
  return value


def gsm8k_prediction(completion: str) -> float | None:
  """The predicted number: the last number in the last \\boxed{}, else in the last <answer>
  tag, else the last number in the completion (the first of these that has a number)."""
  for span in (extraction.last_boxed(completion), extraction.last_answer_tag(completion),
               completion):
    if span is not None:
      value = extraction.last_number(span)
      if value is not None:
        return value
  return None


def gsm8k_reward(completion: str, answer: str | float) -> float:
  """1.0 if the predicted number equals the answer (relative tolerance 1e-6), else 0.0."""
  reference = gsm8k_reference_value(answer)
  if extraction.oversized(completion):
    return 0.0
  prediction = gsm8k_prediction(completion)
  if prediction is None:
    return 0.0
  return 1.0 if abs(prediction - reference) <= 1e-6 * max(1.0, abs(reference)) else 0.0


# ---------------------------------------------------------------------------
# MATH.
# ---------------------------------------------------------------------------


def math_reference(answer: str) -> str:
  """The final answer from a MATH answer or full solution (its last \\boxed{} if it has one)."""
  boxed = extraction.last_boxed(answer)
  return (boxed if boxed is not None else answer).strip()


def math_prediction(completion: str) -> str | None:
  """The last \\boxed{} content, else the last <answer> tag; None if neither."""
  boxed = extraction.last_boxed(completion)
  if boxed is not None:
    return boxed.strip()
  return extraction.last_answer_tag(completion)


def math_reward(completion: str, answer: str, *, use_math_verify: bool = True,
                symbolic_deadline_s: float = 0.2) -> float:
  """1.0 if the predicted answer is equivalent to the reference, else 0.0.

  Equivalence: equal after MATH normalization, or (when math-verify is installed and
  `use_math_verify`) symbolically equal within `symbolic_deadline_s` seconds of CPU time, on any
  thread; see `math_equivalence`. Only well-formed, small answers reach sympy
  (`safe_for_symbolic`), so garbled text costs nothing; the deadline is a last resort. The
  symbolic check only ever adds matches to the normalized one. The first call imports and warms
  up math-verify (about a second, once).
  """
  reference = math_reference(answer)
  if extraction.oversized(completion):
    return 0.0
  prediction = math_prediction(completion)
  if not prediction:
    return 0.0
  if math_equivalence.math_answers_match(prediction, reference):
    return 1.0
  if use_math_verify and math_equivalence.symbolic_equivalent(
      prediction, reference, deadline_s=symbolic_deadline_s):
    return 1.0
  return 0.0


# ---------------------------------------------------------------------------
# The official StableDRL correctness reward for GSM8K and MATH.
# ---------------------------------------------------------------------------


def math_verify_reward(completion: str, gold: str) -> float:
  """+1.0 if math-verify finds the gold answer in the completion, else -1.0 (the official
  StableDRL dataloaders' reward for GSM8K and MATH; `math_equivalence.verify_completion`)."""
  return 1.0 if math_equivalence.verify_completion(completion, gold) else -1.0
