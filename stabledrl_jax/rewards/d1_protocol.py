"""The d1 evaluation protocol (dllm-reasoning/d1, eval/parse_and_get_acc.py), item by item.

These functions decide whether one generation is correct the way the d1 scorer does, so that
accuracies computed here are comparable with published d1 / SPG / StableDRL numbers. They are
evaluation metrics, deliberately separate from the training rewards in `task_rewards`: the
protocol has quirks (documented per function) that a reward should not copy, but a metric must.

All functions are linear in the length of the generation and never raise.
"""

from __future__ import annotations

import re
from typing import Iterator

from stabledrl_jax.rewards import arithmetic, extraction, math_equivalence

_EOT = "<|eot_id|>"
_EOS = "<|endoftext|>"
_FENCE = "```"
# Floats and integers longer than this are never answers; refusing them keeps parsing cheap.
_MAX_NUMERIC_CHARS = 1000
_MAX_DIGIT_RUN = 20


# ---------------------------------------------------------------------------
# Shared extraction rules.
# ---------------------------------------------------------------------------


def boxed_answer(text: str) -> str | None:
  """The protocol's \\boxed extraction for MATH-500 and countdown.

  Rules, in order:
  - if "\\boxed " (with a space) occurs, the text after its last occurrence up to the next "$";
  - else the last "\\boxed" (or, if none, the last "\\fbox") with balanced braces: the content
    when it reads "\\boxed{...}", else the whole command ("\\fbox{3}" stays "\\fbox{3}");
  - with neither command, the entire text (callers then search the whole generation);
  - None when the braces after the command never close.
  """
  if "\\boxed " in text:
    tail = text[text.rfind("\\boxed ") + len("\\boxed "):]
    return tail.split("$", 1)[0]
  start = text.rfind("\\boxed")
  if start < 0:
    start = text.rfind("\\fbox")
    if start < 0:
      return text
  # Braces are counted from the command itself, so the first "{" may come later ("\\boxed x{").
  end = extraction.balanced_brace_end(text, start)
  if end is None:
    return None
  command = text[start:end + 1]
  if command.startswith("\\boxed{"):
    return command[len("\\boxed{"):-1]
  return command


def _float_or_none(text: str) -> float | None:
  """Python's float(text) (it accepts "1e3", "1_000", " 7 ", "inf"), or None."""
  if len(text) > _MAX_NUMERIC_CHARS:
    return None
  try:
    return float(text)
  except ValueError:
    return None


# Unicode \d, as in the reference: float() accepts other scripts' digits too.
_LOOSE_NUMBER = re.compile(r"-?\d+\.?\d*")


def _number_in(text: str, *, last: bool) -> float | None:
  """float(text) if it parses, else the first (or last) number-looking run in it."""
  value = _float_or_none(text)
  if value is not None:
    return value
  runs = _LOOSE_NUMBER.findall(text)
  if not runs:
    return None
  return _float_or_none(runs[-1] if last else runs[0])


# ---------------------------------------------------------------------------
# GSM8K.
# ---------------------------------------------------------------------------


def _single_line_boxes(text: str) -> Iterator[str]:
  """Contents of `re.findall(r"\\boxed{(.*?)}", text)`: up to the first "}", within one line."""
  search_from = 0
  next_close = next_newline = -1
  while True:
    start = text.find("\\boxed{", search_from)
    if start < 0:
      return
    content_start = start + len("\\boxed{")
    # The first "}" / newline after a position is shared by every later start before it, so
    # each is searched for again only once passed: linear overall.
    if next_close < content_start:
      next_close = text.find("}", content_start)
      if next_close < 0:
        return
    if next_newline < content_start and next_newline != len(text):
      next_newline = text.find("\n", content_start)
      if next_newline < 0:
        next_newline = len(text)
    if next_close < next_newline:
      yield text[content_start:next_close]
      search_from = next_close + 1
    else:
      search_from = start + 1


def _is_placeholder(content: str) -> bool:
  """Empty, "..." or only dots: the model copied the template's \\boxed{...}."""
  return not content or not content.strip(".")


def gsm8k_prediction(generation: str) -> float | None:
  """The protocol's GSM8K answer.

  The first single-line \\boxed{...} (up to its first "}") that is not a placeholder and holds a
  number: float() of the content, else its first number. Failing that, the first
  <answer>...</answer>: float() of it, else its last number.
  """
  for content in _single_line_boxes(generation):
    content = content.strip()
    if _is_placeholder(content):
      continue
    value = _number_in(content, last=False)
    if value is not None:
      return value
  tag = extraction.first_answer_tag(generation)
  if tag:
    return _number_in(tag, last=True)
  return None


def gsm8k_correct(generation: str, ground_truth: float | None) -> bool:
  """Exact float equality of `gsm8k_prediction` with the ground truth (None is never right)."""
  prediction = gsm8k_prediction(generation)
  return prediction is not None and ground_truth is not None and prediction == ground_truth


# ---------------------------------------------------------------------------
# MATH-500.
# ---------------------------------------------------------------------------


def math_prediction(generation: str) -> str | None:
  """The protocol's MATH answer: `boxed_answer`, or the first <answer> tag when that is empty.

  Note the protocol's quirk: a generation without any \\boxed is compared as a whole.
  """
  prediction = boxed_answer(generation)
  if not prediction:
    tag = extraction.first_answer_tag(generation)
    if tag is not None:
      prediction = tag
  return prediction


def math_correct(generation: str, ground_truth: str) -> bool:
  """MATH-normalized string equality (`math_answers_match`), no symbolic check."""
  prediction = math_prediction(generation)
  if prediction is None or not isinstance(ground_truth, str):
    return False
  return math_equivalence.math_answers_match(prediction, ground_truth)


# ---------------------------------------------------------------------------
# Countdown.
# ---------------------------------------------------------------------------

_LATEX_OPERATORS = (("\\div", "/"), ("\\times", "*"), ("\\cdot", "*"))
_EQUATION_CHARS = frozenset("0123456789+-*/() ")
_RESULT_CHARS = frozenset("0123456789. ")


def _left_of_first_equation(text: str) -> str | None:
  """The protocol's `re.search(r"([0-9+\\-*/() ]+)=[0-9. ]+", text)`, group 1 stripped.

  The match is the first "=" that has an arithmetic character right before it and a result
  character right after; the group is the maximal arithmetic run ending at that "=".
  """
  position = text.find("=")
  while position >= 0:
    before_ok = position > 0 and text[position - 1] in _EQUATION_CHARS
    after_ok = position + 1 < len(text) and text[position + 1] in _RESULT_CHARS
    if before_ok and after_ok:
      start = position
      while start > 0 and text[start - 1] in _EQUATION_CHARS:
        start -= 1
      return text[start:position].strip()
    position = text.find("=", position + 1)
  return None


def countdown_equation(generation: str) -> str:
  """The protocol's countdown expression.

  `boxed_answer` (which is the entire generation when there is no \\boxed); if its braces never
  close, the first <answer> tag, else the entire generation. LaTeX \\div, \\times and \\cdot
  become / * *, and if the text contains "expression = number" only the expression is kept.
  """
  equation = boxed_answer(generation)
  if equation is None:
    tag = extraction.first_answer_tag(generation)
    equation = tag if tag is not None else generation
  for latex, operator in _LATEX_OPERATORS:
    equation = equation.replace(latex, operator)
  left_side = _left_of_first_equation(equation)
  return left_side if left_side is not None else equation


_DIGIT_RUN = re.compile(r"\d+")
_EVALUABLE = re.compile(r"[\d+\-*/().\s]+")


def _uses_exactly(equation: str, numbers: list[int]) -> bool:
  """The multiset of digit runs in the text equals the given numbers (the protocol's check)."""
  runs = _DIGIT_RUN.findall(equation)
  if len(runs) != len(numbers) or any(len(run) > _MAX_DIGIT_RUN for run in runs):
    return False
  return sorted(int(run) for run in runs) == sorted(numbers)


def _python_whitespace_ok(expression: str) -> bool:
  """Whitespace Python's `eval` accepts: no vertical tab, line breaks only inside parentheses.

  The reference evaluates with `eval`, so "(12\n+3)" counts and "12\n+3" does not.
  """
  if "\v" in expression:
    return False
  depth = 0
  for char in expression:
    if char == "(":
      depth += 1
    elif char == ")":
      depth -= 1
    elif char in "\r\n" and depth <= 0:
      return False
  return True


def countdown_correct(generation: str, numbers: list[int], target: float) -> bool:
  """Numbers used exactly once and value within 1e-5 of the target.

  The expression is evaluated by `arithmetic.evaluate_arithmetic` (+ - * / and parentheses).
  The reference's `eval` would also accept Python's "**" and "//"; none of the published d1
  baseline generations relies on that, and we do not reproduce it.
  """
  equation = countdown_equation(generation)
  if not _uses_exactly(equation, list(numbers)) or not _EVALUABLE.fullmatch(equation):
    return False
  equation = equation.strip()
  if not _python_whitespace_ok(equation):
    return False
  evaluation = arithmetic.evaluate_arithmetic(equation)
  return evaluation is not None and abs(float(evaluation.value) - target) < 1e-5


# ---------------------------------------------------------------------------
# Sudoku.
# ---------------------------------------------------------------------------

_PUZZLE_IN_QUESTION = re.compile(r"Sudoku puzzle: ([0-9]{16})")
_BOUNDED_16_DIGITS = re.compile(r"\b(\d{16})\b")
_DIGITS_OR_SPACE = re.compile(r"[\d\s]*")


def sudoku_puzzle(question: str) -> str | None:
  """The 16-digit puzzle: the question itself if it starts with 16 digits, else after
  "Sudoku puzzle: "."""
  if len(question) >= 16 and question[:16].isdigit():
    return question[:16]
  match = _PUZZLE_IN_QUESTION.search(question)
  return match.group(1) if match else None


def _fenced_digits_after_answer(text: str) -> str | None:
  """`re.search(r"<answer>.*?```\\s*([\\d\\s]+)```", text, re.DOTALL)`: the first fence after the
  first <answer> that encloses only digits and whitespace."""
  open_ = text.find(extraction.ANSWER_OPEN)
  if open_ < 0:
    return None
  fence = text.find(_FENCE, open_ + len(extraction.ANSWER_OPEN))
  while fence >= 0:
    body_start = fence + len(_FENCE)
    body_end = _DIGITS_OR_SPACE.match(text, body_start).end()
    if body_end > body_start and text.startswith(_FENCE, body_end):
      return text[body_start:body_end]
    fence = text.find(_FENCE, fence + 1)
  return None


def _first_terminator(text: str, start: int, *, end_counts: bool) -> int | None:
  """First <|eot_id|>, <|endoftext|> (or, with end_counts, `$`) at or after start."""
  candidates = [index for index in (text.find(_EOT, start), text.find(_EOS, start)) if index >= 0]
  if end_counts:
    # `$` matches at the very end and just before a final newline.
    candidates.append(len(text) - 1 if text.endswith("\n") and len(text) - 1 >= start
                      else len(text))
  return min(candidates) if candidates else None


def _answer_until_terminator(text: str) -> str | None:
  """`<answer>(.*?)(?:<|eot_id|>|<|endoftext|>|</answer>)`, DOTALL, from the first <answer>."""
  open_ = text.find(extraction.ANSWER_OPEN)
  if open_ < 0:
    return None
  start = open_ + len(extraction.ANSWER_OPEN)
  ends = [index for index in (text.find(_EOT, start), text.find(_EOS, start),
                              text.find(extraction.ANSWER_CLOSE, start)) if index >= 0]
  return text[start:min(ends)] if ends else None


def _text_after_answer_close(text: str) -> str | None:
  """`</answer>\\s*(.*?)(?:<|eot_id|>|<|endoftext|>|$)`, DOTALL, after the first </answer>."""
  close = text.find(extraction.ANSWER_CLOSE)
  if close < 0:
    return None
  start = close + len(extraction.ANSWER_CLOSE)
  while start < len(text) and text[start].isspace():
    start += 1
  return text[start:_first_terminator(text, start, end_counts=True)]


def _digits_before_answer_close(text: str) -> str | None:
  """`(\\d{16})\\s*</answer>`: 16 digits, then only whitespace, then </answer>; the first one."""
  close = text.find(extraction.ANSWER_CLOSE)
  while close >= 0:
    end = close
    while end > 0 and text[end - 1].isspace():
      end -= 1
    candidate = text[end - 16:end] if end >= 16 else ""
    # Unicode \d is exactly str.isdecimal().
    if len(candidate) == 16 and candidate.isdecimal():
      return candidate
    close = text.find(extraction.ANSWER_CLOSE, close + 1)
  return None


def _bounded_sixteen_digits(text: str) -> str | None:
  """`\\b(\\d{16})\\b`: a standalone 16-digit word."""
  match = _BOUNDED_16_DIGITS.search(text)
  return match.group(1) if match else None


_SUDOKU_PATTERNS = (
    _fenced_digits_after_answer,
    _answer_until_terminator,
    _text_after_answer_close,
    _digits_before_answer_close,
    _bounded_sixteen_digits,
)
_WHITESPACE_RUN = re.compile(r"\s")


def sudoku_solution(generation: str) -> str:
  """The protocol's 16-cell answer string ("" if none).

  The first of these that yields non-blank text: a ``` fence of digits after <answer>; the text
  from <answer> to the first end token or </answer>; the text after </answer> up to an end token;
  16 digits right before </answer>; any standalone 16-digit word. Whitespace is then removed
  and the result padded with "0" or cut to 16 characters.
  """
  for pattern in _SUDOKU_PATTERNS:
    found = pattern(generation)
    if found is not None and found.strip():
      solution = _WHITESPACE_RUN.sub("", found.strip())
      return (solution + "0" * 16)[:16]
  return ""


def sudoku_cells_correct(generation: str, question: str, solution: str) -> tuple[int, int]:
  """(blank cells filled correctly, blank cells) of one puzzle.

  The protocol pools cells over the whole set: accuracy = sum of the first / sum of the second.
  Returns (0, 0) when the question holds no recognizable puzzle.
  """
  puzzle = sudoku_puzzle(question)
  if puzzle is None or not isinstance(solution, str) or len(solution) < 16:
    return 0, 0
  blanks = [index for index, cell in enumerate(puzzle) if cell == "0"]
  answer = sudoku_solution(generation)
  if not answer:
    return 0, len(blanks)
  return sum(answer[index] == solution[index] for index in blanks), len(blanks)
