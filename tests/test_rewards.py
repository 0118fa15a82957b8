"""Rewards: the values the official reward code gives, robustness to hostile completions, and the
d1 evaluation protocol's extraction rules."""

import collections
import fractions
import functools
import math
import re
import pathlib
import signal
import sys
import threading
import time

from hypothesis import assume
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import pytest

from stabledrl_jax import rewards
from stabledrl_jax.rewards import arithmetic, d1_protocol, deadline, extraction, format_rewards
from stabledrl_jax.rewards import math_equivalence, task_rewards
from examples import examples

SUDOKU_PUZZLE = "1034000000000000"
SUDOKU_SOLUTION = "1234341221434321"
SUDOKU_QUESTION = "Sudoku puzzle: " + SUDOKU_PUZZLE

_NEAR_CAP = extraction.MAX_COMPLETION_CHARS - 1_000  # still scored, so still scanned


def _answer(text: str) -> str:
  return f"<reasoning>\nthinking\n</reasoning>\n<answer>\n{text}\n</answer>"


# ---------------------------------------------------------------------------
# Safe arithmetic.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("expression, value", [
    ("1 + 2 * 3", 7),
    ("(1 + 2) * 3", 9),
    ("2 - 3 - 4", -5),
    ("8 / 4 / 2", 1),
    ("1/3*3", 1),
    ("-(3 - 5)", 2),
    ("--4", 4),
    ("2.5 * 2", 5),
    ("(((7)))", 7),
    (" 100 / 8 ", fractions.Fraction(25, 2)),
])
def test_evaluator_computes_exact_values(expression, value):
  assert arithmetic.evaluate_arithmetic(expression).value == value


def test_evaluator_reports_literals_in_order():
  evaluation = arithmetic.evaluate_arithmetic("(25 - 4) * 3")
  assert evaluation.literals == ("25", "4", "3")
  assert evaluation.integer_literals() == [25, 4, 3]
  assert arithmetic.evaluate_arithmetic("2.5 + 1").integer_literals() is None


@pytest.mark.parametrize("expression", [
    "", "1 +", "(1 + 2", "1 + 2)", "1 2", "2(3)", "1/0", "1/(2-2)", "9**9**9**9", "2**3",
    "7//2", "2^3", "x + 1", "eval('1')", "__import__('os')", "1e3", "042", ".", "1 = 1",
    "(" * 1000 + "1" + ")" * 1000, "-" * 100 + "1", "9" * 20, "10**15 * 10", "99999999 * 99999999",
    "1" * 600, "1/7/7/7/7/7/7/7/7/7/7/7/7/7/7/7/7/7/7/7/7", "１+２", "1\u00a0+ 2",
])
def test_evaluator_rejects_everything_outside_the_grammar_or_bounds(expression):
  assert arithmetic.evaluate_arithmetic(expression) is None


def test_evaluator_nesting_bound_is_what_limits_depth():
  assert arithmetic.evaluate_arithmetic("(" * 30 + "1" + ")" * 30).value == 1
  assert arithmetic.evaluate_arithmetic("(" * 40 + "1" + ")" * 40) is None
  assert arithmetic.evaluate_arithmetic("(" * 40 + "1" + ")" * 40, max_depth=50).value == 1


_VALID_EXPRESSIONS = st.recursive(
    st.integers(0, 999).map(str),
    lambda inner: st.one_of(
        st.tuples(inner, st.sampled_from("+-*/"), inner).map(" ".join),
        inner.map(lambda expression: f"({expression})"),
        inner.map(lambda expression: f"-{expression}")),
    max_leaves=8)


def _python_value(expression: str):
  """Python's exact value of an expression (literals as Fractions), or None on division by 0.

  Tests may use eval on generated input; the library never does.
  """
  exact = re.sub(r"[0-9]+", lambda match: f'F("{match.group(0)}")', expression)
  try:
    return eval(exact, {"__builtins__": {}, "F": fractions.Fraction})  # pylint: disable=eval-used
  except ZeroDivisionError:
    return None


@settings(max_examples=examples(200), deadline=None)
@given(_VALID_EXPRESSIONS)
def test_evaluator_agrees_with_python_on_its_grammar(expression):
  expected = _python_value(expression)
  unbounded = arithmetic.evaluate_arithmetic(
      expression, max_chars=10**6, max_depth=10**4, max_magnitude=10**300)
  if expected is None:
    assert unbounded is None  # division by zero
  else:
    assert unbounded.value == expected
  # With the default bounds, an accepted expression has the same value.
  bounded = arithmetic.evaluate_arithmetic(expression)
  assert bounded is None or bounded.value == expected


@settings(max_examples=examples(200), deadline=None)
@given(st.text(alphabet="0123456789+-*/() .", max_size=60))
def test_evaluator_never_raises_on_its_alphabet(expression):
  evaluation = arithmetic.evaluate_arithmetic(expression)
  assert evaluation is None or isinstance(evaluation.value, fractions.Fraction)


# ---------------------------------------------------------------------------
# Countdown reward.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("completion, expected", [
    (_answer("(25 - 4) * 3"), 1.0),
    (_answer("3 * (25 - 4)"), 1.0),
    (_answer("\\boxed{(25 - 4) \\times 3}"), 1.0),
    ("The answer is \\boxed{(25-4)*3}", 1.0),
    (_answer("25 - 4 * 3"), 0.1),            # valid, wrong value
    (_answer("(25 - 4) * 3 * 1"), 0.1),      # a number not given
    (_answer("(25 - 4) * 3 = 63"), 0.1),     # not an expression
    (_answer("25 + 4 + 3 + 31"), 0.1),
    (_answer("21 * 3"), 0.1),                # numbers not all used
    (_answer("9**9**9**9"), 0.1),
    (_answer("1/0"), 0.1),
    (_answer(""), 0.1),
    ("(25 - 4) * 3", 0.0),                   # no answer tag, no box
    ("", 0.0),
])
def test_countdown_reward_levels(completion, expected):
  assert rewards.countdown_reward(completion, [25, 4, 3], 63) == expected


def test_countdown_reward_uses_last_answer_and_exact_arithmetic():
  draft_then_final = _answer("25 + 4 + 3") + "\nwait\n" + _answer("(25 - 4) * 3")
  assert rewards.countdown_reward(draft_then_final, [25, 4, 3], 63) == 1.0
  assert rewards.countdown_reward(_answer("1 / 3 * 3 * 5"), [1, 3, 3, 5], 5) == 1.0
  assert rewards.countdown_reward(_answer("(7 + 7) / 7"), [7, 7, 7], 2) == 1.0
  assert rewards.countdown_reward(_answer("7 + 7 / 7"), [7, 7], 2) == 0.1


# ---------------------------------------------------------------------------
# Sudoku reward.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("answer, expected", [
    (SUDOKU_SOLUTION, 1.0),
    ("1234 3412 2143 4321", 1.0),
    ("1234\n3412\n2143\n4321", 1.0),
    (SUDOKU_PUZZLE, 0.0),
    ("1234341221434320", 12 / 13),
    ("12", 1 / 13),                           # padded with zeros
    (SUDOKU_SOLUTION + "999", 1.0),           # cut to 16 cells
    ("no digits", 0.0),
])
def test_sudoku_reward_is_fraction_of_blanks_filled_right(answer, expected):
  reward = rewards.sudoku_reward(_answer(answer), SUDOKU_PUZZLE, SUDOKU_SOLUTION)
  assert reward == pytest.approx(expected)


def test_sudoku_reward_zero_without_answer_or_blank():
  assert rewards.sudoku_reward(SUDOKU_SOLUTION, SUDOKU_PUZZLE, SUDOKU_SOLUTION) == 0.0
  assert rewards.sudoku_reward(_answer(SUDOKU_SOLUTION), SUDOKU_SOLUTION, SUDOKU_SOLUTION) == 0.0
  with pytest.raises(ValueError):
    rewards.sudoku_reward("", SUDOKU_PUZZLE, SUDOKU_SOLUTION[:-1])


# ---------------------------------------------------------------------------
# GSM8K reward.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("completion, expected", [
    (_answer("\\boxed{18}"), 1.0),
    (_answer("18"), 1.0),
    (_answer("$18.00"), 1.0),
    ("so she makes 9 * 2 = 18 dollars", 1.0),          # last number
    ("\\boxed{18} but the tag says <answer>17</answer>", 1.0),  # the box wins
    (_answer("\\boxed{17}"), 0.0),
    (_answer("\\boxed{\\text{eighteen}}") + " 18", 1.0),  # empty box falls through
    ("no number at all", 0.0),
    ("", 0.0),
])
def test_gsm8k_reward(completion, expected):
  assert rewards.gsm8k_reward(completion, "Janet sells 9 eggs at $2.\n#### 18") == expected


def test_gsm8k_reward_thousands_and_reference_forms():
  assert rewards.gsm8k_reward(_answer("\\boxed{1,080}"), "#### 1,080") == 1.0
  assert rewards.gsm8k_reward(_answer("\\boxed{1080}"), 1080.0) == 1.0
  assert rewards.gsm8k_reward(_answer("-3.5"), "-3.5") == 1.0
  with pytest.raises(ValueError):
    rewards.gsm8k_reward("1", "#### no number")


# ---------------------------------------------------------------------------
# MATH reward and normalization.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("prediction, reference", [
    ("\\dfrac{1}{2}", "\\frac12"),
    ("0.5", "\\frac{1}{2}"),
    ("1/2", "\\frac{1}{2}"),
    ("x = 5", "5"),
    ("10\\%", "10"),
    ("90^\\circ", "90"),
    ("\\left( 1, 2 \\right)", "(1,2)"),
    ("16\\sqrt3", "16 \\sqrt{3}"),
    ("5 \\text{ cm}", "5"),
    (".5", "0.5"),
])
def test_math_normalization_matches_equivalent_forms(prediction, reference):
  assert math_equivalence.math_answers_match(prediction, reference)


@pytest.mark.parametrize("prediction, reference", [
    ("\\frac{1}{3}", "\\frac{1}{2}"), ("52_8", "42"), ("x+1", "x-1"), ("", "1"),
])
def test_math_normalization_keeps_different_answers_apart(prediction, reference):
  assert not math_equivalence.math_answers_match(prediction, reference)


def test_math_normalization_falls_back_to_raw_equality_where_the_convention_gives_up():
  # "a/b" with non-integers, and a dangling \sqrt, cannot be normalized.
  assert math_equivalence.normalize_math_answer("x/y") is None
  assert math_equivalence.normalize_math_answer("2\\sqrt") is None
  assert math_equivalence.math_answers_match("x/y", "x/y")
  assert not math_equivalence.math_answers_match("x/y", "\\frac{x}{y}")


def test_math_reward_boxed_then_answer_tag():
  assert rewards.math_reward("so \\boxed{\\dfrac{3}{8}}", "\\frac{3}{8}") == 1.0
  assert rewards.math_reward(_answer("\\frac{3}{8}"), "\\frac{3}{8}") == 1.0
  assert rewards.math_reward(_answer("\\boxed{\\frac{3}{7}}"), "\\frac{3}{8}") == 0.0
  assert rewards.math_reward("3/8 without any marker", "\\frac{3}{8}") == 0.0
  # A full MATH solution as the reference: its last box is the answer.
  assert rewards.math_reward("\\boxed{4}", "Thus $x = \\boxed{4}$.") == 1.0


def test_math_reward_symbolic_check_adds_matches_when_math_verify_is_installed():
  pytest.importorskip("math_verify")
  completion = _answer("\\boxed{2x+2}")
  assert rewards.math_reward(completion, "2(x+1)", use_math_verify=False) == 0.0
  assert rewards.math_reward(completion, "2(x+1)", symbolic_deadline_s=5.0) == 1.0
  assert rewards.math_reward(_answer("\\boxed{2x+3}"), "2(x+1)", symbolic_deadline_s=5.0) == 0.0


@pytest.mark.parametrize("answer, safe", [
    ("2x+2", True), ("x^2 + y^2", True), ("2^{10}", True), ("\\frac{\\sqrt{3}}{2}", True),
    ("9^{9^{9^{9}}}", False), ("10^{10^{10}}", False), ("(99^{99})^{999}", False),
    ("1000000!", False), ("9**9", False), ("\\binom{100}{50}", False), ("1" * 13, False),
    ("x" * 200, False), ("\\frace{={", False), ("{{1}", False), ("日本", False), ("", False),
    # Powers and products that sympy expands (seconds to minutes), and deep nesting.
    ("(x+1)^{10}", True), ("(x+1)(x+2)(x+3)", True), ("2^{9999}", True), ("e^{i\\pi}", True),
    ("(x+1)^{9999}", False), ("(2x+1)^{999}", False), ("(a+b+c+d+e+f)^{12}", False),
    ("(a+b+c)^{16}", False), ("(x^{999}-1)/(x-1)", False), ("\\sqrt{2}^{9999}", False),
    ("(a+b)(c+d)(e+f)(g+h)(i+j)(k+l)", False), ("999999999999^{9999}", False),
    ("\\Gamma(999999)", False), ("(" * 7 + "x" + ")" * 7, False), ("((((((x))))))", True),
])
def test_symbolic_screen(answer, safe):
  assert math_equivalence.safe_for_symbolic(answer) is safe


def test_the_deadline_is_not_raised_inside_a_finalizer():
  """A deadline that expires while the collector runs a __del__ waits for the work itself: an
  exception there would be dropped as unraisable (and fail a pytest run)."""
  seen = []

  class Finalized:
    def __del__(self):
      seen.append(deadline._in_finalizer(sys._getframe()))  # pylint: disable=protected-access

  Finalized()
  assert seen == [True]
  assert not deadline._in_finalizer(sys._getframe())  # pylint: disable=protected-access


def test_symbolic_deadline_interrupts_python_level_work():
  def spin():
    while True:
      pass

  # An endless loop returns only if the deadline interrupts it; in this thread's CPU time (not
  # wall time: the machine may be loaded) it ran about the 0.05 s deadline.
  start = time.thread_time()
  with pytest.raises(deadline.DeadlineExceeded):
    deadline.call_with_deadline(spin, 0.05)
  assert time.thread_time() - start < 1.0


def test_answer_parsers_behind_the_rewards():
  assert task_rewards.countdown_expression(_answer("\\boxed{3 \\times 4}")) == "3 * 4"
  assert task_rewards.countdown_expression("no answer") is None
  assert task_rewards.sudoku_answer(_answer("12 | 34"), 16) == "1234000000000000"
  assert task_rewards.gsm8k_prediction("\\boxed{} and then 7 apples") == 7.0
  assert task_rewards.math_reference("So $x = \\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"
  assert task_rewards.math_prediction("<answer> 3 </answer>") == "3"


# ---------------------------------------------------------------------------
# Format rewards.
# ---------------------------------------------------------------------------


def test_format_rewards_on_the_canonical_layout():
  canonical = "<reasoning>\nstep 1\nstep 2\n</reasoning>\n<answer>\n42\n</answer>\n"
  assert format_rewards.strict_format_reward(canonical) == 1.0
  assert format_rewards.soft_format_reward(canonical) == 1.0
  assert format_rewards.tag_count_reward(canonical) == 1.0
  prefilled = canonical[len("<reasoning>"):]
  assert format_rewards.strict_format_reward(prefilled) == 0.0
  assert format_rewards.strict_format_reward(prefilled, reasoning_prefilled=True) == 1.0


@pytest.mark.parametrize("completion, strict, soft", [
    ("<reasoning>x</reasoning><answer>42</answer>", 0.0, 1.0),
    ("<reasoning>\nx\n</reasoning>\n<answer>\n42\n</answer> trailing", 0.0, 1.0),
    ("<answer>\n42\n</answer>", 0.0, 0.0),
    ("<reasoning>\nx\n</reasoning>\ntext\n<answer>\n42\n</answer>", 0.0, 0.0),
    ("<reasoning>\n<reasoning>\n</reasoning>\n<answer>\n1\n</answer>", 0.0, 1.0),
    ("", 0.0, 0.0),
])
def test_strict_and_soft_format(completion, strict, soft):
  assert format_rewards.strict_format_reward(completion) == strict
  assert format_rewards.soft_format_reward(completion) == soft


def test_tag_count_reward_partial_credit_and_trailing_penalty():
  assert format_rewards.tag_count_reward("<reasoning>\nx") == 0.25
  tidy = "<reasoning>x</reasoning><answer>1</answer>"
  assert format_rewards.tag_count_reward(tidy) == 1.0
  assert format_rewards.tag_count_reward(tidy + "0123456789") == pytest.approx(0.99)
  assert format_rewards.tag_count_reward(tidy + "x" * 5000) == 0.0


def test_boxed_answer_format_reward():
  assert format_rewards.boxed_answer_format_reward(_answer("\\boxed{3}")) == 1.0
  assert format_rewards.boxed_answer_format_reward(_answer("3")) == 0.5
  assert format_rewards.boxed_answer_format_reward("\\boxed{3}") == 0.0


# ---------------------------------------------------------------------------
# Hostile completions: finite, never raising, fast.
# ---------------------------------------------------------------------------

_HOSTILE_CORE = [
    "", "garbled \x00\x07\ufffd\ud7ff \x1b[31m", "9**9**9**9", "1/0", "(" * 1000 + "1" + ")" * 1000,
    "１２３ 日本語 🙂 \u202e\u200b 𝟙𝟚", "\\boxed{" * 1000, "<answer>" * 1000,
    "}" * 1000,
    "\\frac" * 1000, "\\sqrt" * 1000, "9^{9^{9^{9}}}", "10^{10^{10}}", "1000000!", "nan", "inf",
    "-" * 1000 + "1", "1e308 * 1e308", "1" * 5000,
]
_HOSTILE_LONG = [
    "x" * 1_000_000, "1" * 1_000_000, "(" * 1_000_000, "<answer>" * 125_000,
    "1+" * (_NEAR_CAP // 2), "(" * _NEAR_CAP, "{" * _NEAR_CAP, "<answer>" * (_NEAR_CAP // 8),
    "\\boxed{" * (_NEAR_CAP // 7), "1,1" * (_NEAR_CAP // 3), "=1 " * (_NEAR_CAP // 3),
    "\n</reasoning>\n<answer>\n" * (_NEAR_CAP // 22), "```" * (_NEAR_CAP // 3),
]


def _wrapped(core: str) -> list[str]:
  return [core, _answer(core), f"\\boxed{{{core}}}", _answer(f"\\boxed{{{core}}}")]


HOSTILE = [variant for core in _HOSTILE_CORE for variant in _wrapped(core)] + _HOSTILE_LONG

REWARDS = {
    "countdown": lambda completion: rewards.countdown_reward(completion, [25, 4, 3], 63),
    "sudoku": lambda completion: rewards.sudoku_reward(completion, SUDOKU_PUZZLE, SUDOKU_SOLUTION),
    "gsm8k": lambda completion: rewards.gsm8k_reward(completion, "#### 18"),
    "math": lambda completion: rewards.math_reward(completion, "\\frac{1}{2}"),
    "strict_format": format_rewards.strict_format_reward,
    "soft_format": format_rewards.soft_format_reward,
    "tag_count": format_rewards.tag_count_reward,
    "boxed_format": format_rewards.boxed_answer_format_reward,
    # The official StableDRL rewards (math-verify's +-1 mapped onto [0, 1]).
    "countdown_official": lambda completion: rewards.official_countdown_reward(
        completion, [25, 4, 3], 63),
    "anti_short_boxed": format_rewards.anti_short_boxed_reward,
}
# math-verify on the whole completion (the official GSM8K / MATH reward), +-1 mapped onto [0, 1]:
# milliseconds on ordinary text, not the bound of the screened rewards on hostile text.
FULL_TEXT_REWARDS = {
    "math_verify": lambda completion: (task_rewards.math_verify_reward(completion, "18") + 1) / 2,
}


@pytest.fixture(scope="module", autouse=True)
def _warm_math_verify():
  # The first math_reward imports and warms up math-verify (~1 s, once); time only warm calls.
  rewards.math_reward("\\boxed{0.5}", "1/3")


# The screened rewards take well under 50 ms of CPU each on hostile text (a few ms typically);
# the bound is checked in the calling thread's CPU time with a 3x margin, which a loaded machine
# does not inflate. (Never the process's CPU time: other threads of a pytest worker, an orbax
# save or a compile left by an earlier test, add to it; CI once saw 2.55 s that way.)
CPU_BOUND_S = 0.15


@pytest.mark.parametrize("name", sorted(REWARDS))
def test_rewards_are_finite_and_fast_on_hostile_completions(name):
  reward = REWARDS[name]
  slowest = (0.0, "")
  for completion in HOSTILE:
    seconds = math.inf
    for _ in range(2):  # best of two
      start = time.thread_time()
      value = reward(completion)
      seconds = min(seconds, time.thread_time() - start)
    assert isinstance(value, float) and math.isfinite(value) and 0.0 <= value <= 1.0
    slowest = max(slowest, (seconds, completion[:40]))
  assert slowest[0] < CPU_BOUND_S, (
      f"{name} took {slowest[0] * 1e3:.1f} ms of CPU on {slowest[1]!r}")


def test_full_text_math_verify_is_bounded_on_hostile_completions():
  """Each hostile completion well inside the official 5 s timeout, in this thread's CPU time,
  which the 1 s deadline bounds (the machine may be loaded): bracket nesting that math-verify's
  parser cannot handle is screened out."""
  reward = FULL_TEXT_REWARDS["math_verify"]
  for completion in HOSTILE:
    start = time.thread_time()
    value = reward(completion)
    assert value in (0.0, 1.0)
    assert time.thread_time() - start < 2.5, completion[:60]


@pytest.mark.parametrize("name", sorted(REWARDS) + sorted(FULL_TEXT_REWARDS))
@settings(max_examples=examples(60), deadline=None)
@given(core=st.text(max_size=300), wrapper=st.sampled_from(["{}", "<answer>{}</answer>",
                                                             "\\boxed{{{}}}", "{}</answer>"]))
def test_rewards_never_raise_on_fuzzed_text(name, core, wrapper):
  value = {**REWARDS, **FULL_TEXT_REWARDS}[name](wrapper.format(core))
  assert isinstance(value, float) and math.isfinite(value) and 0.0 <= value <= 1.0


_TOKENS = st.sampled_from([
    "<answer>", "</answer>", "<reasoning>", "</reasoning>", "\\boxed{", "{", "}", "(", ")",
    "25", "4", "3", "63", "18", "1234", SUDOKU_SOLUTION, "+", "-", "*", "/", "=", " ", "\n",
    "\\frac", "\\sqrt", "^", "x", ".", ",", "$", "<|eot_id|>", "```",
])


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(_TOKENS, max_size=30).map("".join))
def test_rewards_and_protocol_never_raise_on_structured_noise(completion):
  for reward in REWARDS.values():
    value = reward(completion)
    assert math.isfinite(value) and 0.0 <= value <= 1.0
  d1_protocol.gsm8k_correct(completion, 18.0)
  d1_protocol.math_correct(completion, "\\frac{1}{2}")
  d1_protocol.countdown_correct(completion, [25, 4, 3], 63)
  correct, blanks = d1_protocol.sudoku_cells_correct(completion, SUDOKU_QUESTION, SUDOKU_SOLUTION)
  assert 0 <= correct <= blanks == 13


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.integers(1, 100), min_size=3, max_size=3), st.integers(1, 100))
def test_countdown_reward_only_pays_for_true_solutions(numbers, target):
  a, b, c = numbers
  completion = _answer(f"{a} + {b} - {c}")
  expected = 1.0 if a + b - c == target else 0.1
  assert rewards.countdown_reward(completion, numbers, target) == expected


# ---------------------------------------------------------------------------
# d1 protocol rules (the table reproduction is in test_evaluation.py).
# ---------------------------------------------------------------------------


def test_d1_gsm8k_takes_first_numeric_box_then_first_answer_tag():
  assert d1_protocol.gsm8k_prediction("\\boxed{...} then \\boxed{12} then \\boxed{13}") == 12.0
  assert d1_protocol.gsm8k_prediction("\\boxed{x = 7 or 8}") == 7.0
  assert d1_protocol.gsm8k_prediction("<answer>the total is 5 or 6</answer>") == 6.0
  assert d1_protocol.gsm8k_prediction("\\boxed{1,000}") == 1.0  # the protocol's comma quirk
  assert d1_protocol.gsm8k_prediction("\\boxed{12\n}") is None  # boxes do not span lines
  assert d1_protocol.gsm8k_prediction("the answer is 12") is None  # no last-number fallback
  assert not d1_protocol.gsm8k_correct("\\boxed{12}", None)


def test_d1_math_whole_generation_without_box():
  assert d1_protocol.math_prediction("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
  assert d1_protocol.math_prediction("no box <answer> 3 </answer>") == "no box <answer> 3 </answer>"
  assert d1_protocol.math_prediction("\\boxed{3 <answer> 4 </answer>") == "4"  # unclosed box
  assert d1_protocol.math_prediction("\\fbox{5}") == "\\fbox{5}"


def test_d1_countdown_extraction():
  assert d1_protocol.countdown_equation("\\boxed{(25 - 4) \\times 3}") == "(25 - 4) * 3"
  assert d1_protocol.countdown_equation("\\boxed{25 + 4 + 3 = 32}") == "25 + 4 + 3"
  assert d1_protocol.countdown_correct("\\boxed{(25 - 4) * 3}", [25, 4, 3], 63)
  assert d1_protocol.countdown_correct("first 25-4 = 21 then", [25, 4], 21)
  assert not d1_protocol.countdown_correct("\\boxed{25 - 4\n* 3}", [25, 4, 3], 63)  # as eval()
  assert d1_protocol.countdown_correct("\\boxed{(25 - 4\n) * 3}", [25, 4, 3], 63)


def test_d1_sudoku_pattern_order_and_padding():
  fenced = "<answer>\n```\n1234 3412\n```\n</answer>"
  assert d1_protocol.sudoku_solution(fenced) == "1234341200000000"
  assert d1_protocol.sudoku_solution("<answer>\n1234341221434321<|eot_id|>") == SUDOKU_SOLUTION
  assert d1_protocol.sudoku_solution(f"grid {SUDOKU_SOLUTION} done") == SUDOKU_SOLUTION
  assert d1_protocol.sudoku_solution("no grid here") == ""
  assert d1_protocol.sudoku_cells_correct(_answer(SUDOKU_SOLUTION), SUDOKU_QUESTION,
                                          SUDOKU_SOLUTION) == (13, 13)
  assert d1_protocol.sudoku_puzzle(SUDOKU_PUZZLE + " rest") == SUDOKU_PUZZLE


def _anti_short_boxed_by_the_rules(text: str) -> float:
  """StableDRL's rule, re-derived: short (< 200 non-space characters) and either a bare boxed
  answer or under 85% of the characters outside boxes -> 0."""
  stripped = text.strip()
  total = len("".join(stripped.split()))
  if total >= 200:
    return 1.0
  bare = re.fullmatch(r"[\s$]*\\boxed\{[^}]*\}[\s$]*[.?!'\"“”’]*\s*", stripped) is not None
  outside = len("".join(re.sub(r"\\boxed\{.*?\}", "", stripped, flags=re.DOTALL).split()))
  return 0.0 if bare or outside / (total + 1e-6) < 0.85 else 1.0


@pytest.mark.parametrize("text, expected", [
    ("", 0.0), ("  \n ", 0.0),  # empty
    ("\\boxed{18}", 0.0), ("$\\boxed{18}$.", 0.0),  # bare boxed answers
    ("The answer is \\boxed{18}", 0.0),  # 11 of 21 characters outside the box
    ("We add 7 and 11, which gives eighteen: \\boxed{18}", 0.0),  # 32 of 42 outside: 0.76
    ("We add seven and eleven, which gives eighteen in total, as the question asks: \\boxed{18}",
     1.0),  # 64 of 74 outside: 0.86
    ("no box at all", 1.0),
    ("x" * 100 + "\\boxed{" + "9" * 60 + "}", 0.0),  # short enough, too much inside
    ("x" * 200 + "\\boxed{" + "9" * 60 + "}", 1.0),  # 200 characters: never penalized
])
def test_anti_short_boxed_reward_follows_the_official_rule(text, expected):
  assert format_rewards.anti_short_boxed_reward(text) == expected
  assert _anti_short_boxed_by_the_rules(text) == expected


@settings(max_examples=examples(200), deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab 1$.{}\\boxed\n")), max_size=240))
def test_anti_short_boxed_reward_matches_the_rule_on_any_text(text):
  assert format_rewards.anti_short_boxed_reward(text) == _anti_short_boxed_by_the_rules(text)


def _official_countdown_by_its_source(completion, numbers, target):
  """The official StableDRL countdown scorer re-derived from its source (logic_puzzles.py:
  extract, validate, evaluate, compute_score), with its own eval; for inputs without "**"."""
  matches = re.findall(r"<answer>(.*?)</answer>", completion, re.DOTALL)
  if not matches:
    return 0.0
  equation = matches[-1].strip()
  counts = collections.Counter(numbers)
  for n in [int(n) for n in re.findall(r"\d+", equation)]:
    if counts[n] <= 0:
      return 0.1
    counts[n] -= 1
  try:
    if not re.match(r"^[\d+\-*/().\s]+$", equation):
      raise ValueError
    result = eval(equation, {"__builtins__": None}, {})  # pylint: disable=eval-used
  except Exception:  # pylint: disable=broad-except
    return 0.1
  try:
    return 1.0 if abs(result - target) < 1e-5 else 0.1
  except Exception:  # pylint: disable=broad-except
    return 0.1


def test_official_countdown_reward_follows_the_official_rules():
  reward = lambda text, numbers=(25, 4, 3), target=63: rewards.official_countdown_reward(
      text, list(numbers), target)
  assert reward("<answer>(25 - 4) * 3</answer>") == 1.0
  assert reward("<answer>(25 - 4) * 3</answer>", (25, 4, 3, 9)) == 1.0  # 9 unused: allowed
  assert reward("<answer>25 + 4 * 3 - 25 + 25</answer>", target=37) == 0.1  # 25 three times
  assert reward("<answer>\\boxed{(25 - 4) * 3}</answer>") == 0.1  # no boxed, no LaTeX
  assert reward("\\boxed{(25 - 4) * 3}") == 0.0  # no answer tag: no answer
  assert reward("<answer>(25-4)\\times 3</answer>") == 0.1
  assert reward("<answer>(25 - 4) * 3 = 63</answer>") == 0.1
  assert reward("<answer>x</answer><answer>(25 - 4) * 3</answer>") == 1.0  # the last match
  assert reward("<answer>4 ** 3 - 1 + 0 * 25</answer>", (4, 3, 1, 0, 25)) == 1.0  # Python's **
  assert reward("<answer>25 // 4 * 3 + 45</answer>", (25, 4, 3, 45)) == 1.0  # and //
  assert reward("<answer>25 ** 4 ** 3 ** 25</answer>", (25, 4, 3, 25)) == 0.1  # bounded
  assert reward("<answer>" + "9" * 5000 + "</answer>") == 0.1  # past Python's int() limit
  assert reward("<answer>" + "-" * 1200 + "(25 - 4) * 3</answer>") == 1.0  # as deep as eval


@settings(max_examples=examples(400), deadline=None)
@given(inner=st.text(alphabet=st.sampled_from(list("0123456789 +-*/().\n<>answer")),
                     max_size=40),
       prefix=st.sampled_from(["", "<answer>", "x<answer>1</answer>"]),
       suffix=st.sampled_from(["</answer>", "", "</answer>y"]))
def test_official_countdown_reward_matches_its_source_on_any_text(inner, prefix, suffix):
  completion = prefix + inner + suffix
  assume("**" not in completion)  # eval would compute any power; ours is bounded
  numbers, target = [25, 4, 3, 1], 63
  assert (rewards.official_countdown_reward(completion, numbers, target) ==
          _official_countdown_by_its_source(completion, numbers, target))


def test_math_verify_reward_reads_the_whole_completion():
  assert task_rewards.math_verify_reward("so she pays 72 dollars", "72") == 1.0
  assert task_rewards.math_verify_reward("\\boxed{0.5}", "Thus \\boxed{\\frac{1}{2}}.") == 1.0
  assert task_rewards.math_verify_reward("\\boxed{71}", "72") == -1.0
  # Unsafe expressions are compared as text, never evaluated.
  assert task_rewards.math_verify_reward("\\boxed{9^{9^{9^{9}}}}", "18") == -1.0


# ---------------------------------------------------------------------------
# Bounded symbolic work on any thread (docs/reliability.md).
# ---------------------------------------------------------------------------

# A budget of 1 s of CPU per answer (`math_equivalence.DEFAULT_BUDGET_S`) and the d1 reward's
# 0.2 s, with a generous margin for the screening and the interpreter: the calling thread's CPU
# time, which a loaded machine and the process's other threads do not inflate.
_ANSWER_CPU_BOUND_S = 2.5


def _on_a_thread(function):
  """function()'s value and the CPU time it took, run on a fresh non-main thread."""
  out = {}

  def target():
    start = time.thread_time()
    try:
      out["value"] = function()
    except BaseException as error:  # pylint: disable=broad-except
      out["error"] = error
    out["cpu_s"] = time.thread_time() - start

  thread = threading.Thread(target=target)
  thread.start()
  thread.join(timeout=120)
  assert not thread.is_alive(), "the call never returned"
  if "error" in out:
    raise out["error"]
  return out["value"], out["cpu_s"]


_NUMBERS = ["2", "7", "64", "99", "999", "9999", "999999999999"]
_ATOMS = _NUMBERS + ["x", "y", "a+b", "a+b+c", "\\pi", "e", "\\sqrt{2}", "\\frac{1}{2}"]


@st.composite
def _hostile_latex(draw, depth=0):
  """LaTeX built from huge exponents, towers, factorials, long products and nesting."""
  if depth >= 4 or draw(st.integers(0, 3)) == 0:
    return draw(st.sampled_from(_ATOMS))
  inner = lambda: draw(_hostile_latex(depth + 1))  # pylint: disable=unnecessary-lambda-assignment
  shape = draw(st.sampled_from(["power", "tower", "factorial", "gamma", "product", "nest",
                                "frac", "sqrt", "difference"]))
  if shape == "power":
    return f"({inner()})^{{{draw(st.sampled_from(_NUMBERS))}}}"
  if shape == "tower":
    return f"{{{inner()}}}^{{{inner()}}}"
  if shape == "factorial":
    return f"({inner()})!"
  if shape == "gamma":
    return f"\\Gamma({inner()})"
  if shape == "product":
    return "".join(f"({inner()})" for _ in range(draw(st.integers(2, 10))))
  if shape == "nest":
    return "(" * draw(st.integers(1, 8)) + inner() + ")" * draw(st.integers(1, 8))
  if shape == "frac":
    return f"\\frac{{{inner()}}}{{{inner()}+1}}"
  if shape == "sqrt":
    return f"\\sqrt{{{inner()}}}"
  return f"{inner()}-{inner()}"


_HOSTILE_LATEX = _hostile_latex()
_REFERENCES = st.sampled_from(["5", "x", "(x+1)^{2}", "2^{10}", "\\frac{1}{2}", "x^2+2x+1"])


@pytest.fixture(scope="module")
def _math_verify_helper():
  """math-verify installed, and a warm helper process for the off-main-thread calls."""
  pytest.importorskip("math_verify")
  from stabledrl_jax.rewards import symbolic_worker  # pylint: disable=g-import-not-at-top
  _on_a_thread(lambda: math_equivalence.symbolic_equivalent("2x+2", "2(x+1)"))
  return symbolic_worker


@settings(max_examples=examples(15), deadline=None)
@given(prediction=_HOSTILE_LATEX, reference=_REFERENCES, same=st.booleans())
def test_hostile_latex_is_bounded_in_cpu_time_off_the_main_thread(
    _math_verify_helper, prediction, reference, same):
  reference = prediction if same else reference
  completion = f"so \\boxed{{{prediction}}}"
  solution = f"Thus \\boxed{{{reference}}}."  # the official reward reads a whole solution
  pool = _math_verify_helper.POOL
  pool.stats["max_cpu_s"] = 0.0
  for call, valid in [
      (lambda: rewards.math_reward(completion, reference), (0.0, 1.0)),
      (lambda: task_rewards.math_verify_reward(completion, solution), (-1.0, 1.0))]:
    value, cpu_s = _on_a_thread(call)
    assert value in valid, (prediction, reference, value)
    if same or math_equivalence.math_answers_match(prediction, reference):
      assert value == 1.0  # still right when the symbolic check is refused
    # The calling thread only screens and waits; the helper stays within its budget.
    assert cpu_s < _ANSWER_CPU_BOUND_S, (prediction, cpu_s)
  assert pool.stats["max_cpu_s"] < _ANSWER_CPU_BOUND_S, (prediction, pool.stats)


@settings(max_examples=examples(15), deadline=None)
@given(prediction=_HOSTILE_LATEX, reference=_REFERENCES)
def test_hostile_latex_is_bounded_in_cpu_time_on_the_main_thread(prediction, reference):
  pytest.importorskip("math_verify")
  completion = f"so \\boxed{{{prediction}}}"
  for call, valid in [(lambda: rewards.math_reward(completion, reference), (0.0, 1.0)),
                      (lambda: task_rewards.math_verify_reward(completion, reference),
                       (-1.0, 1.0))]:
    start = time.thread_time()
    value = call()
    assert value in valid
    assert time.thread_time() - start < _ANSWER_CPU_BOUND_S, prediction


def test_correct_answers_stay_correct_off_the_main_thread(_math_verify_helper):
  pairs = [("2x+2", "2(x+1)", True), ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2", True),
           ("(x+1)^2", "x^2+2x+1", True), ("2x+3", "2(x+1)", False)]
  for prediction, reference, equal in pairs:
    on_main = math_equivalence.symbolic_equivalent(prediction, reference)
    off_main, _ = _on_a_thread(functools.partial(math_equivalence.symbolic_equivalent,
                                                 prediction, reference))
    assert on_main is off_main is equal, (prediction, reference)
  value, _ = _on_a_thread(lambda: task_rewards.math_verify_reward("\\boxed{0.5}",
                                                                  "Thus \\boxed{\\frac{1}{2}}."))
  assert value == 1.0


def test_a_helper_that_does_not_answer_in_time_is_killed_and_replaced(_math_verify_helper,
                                                                      monkeypatch):
  worker_module = _math_verify_helper
  pool = worker_module.POOL
  kills = pool.stats["kills"]
  started = []
  real_worker = worker_module._Worker  # pylint: disable=protected-access

  def recording_worker():
    worker = real_worker()
    started.append(worker)
    return worker

  pool.close()  # Every helper from here on is one this test starts and sees.
  monkeypatch.setattr(worker_module, "_Worker", recording_worker)
  with monkeypatch.context() as patch:
    patch.setattr(worker_module, "wait_s", lambda budget_s: 0.0)  # no time to answer
    value, cpu_s = _on_a_thread(lambda: math_equivalence.symbolic_equivalent("2x+2", "2(x+1)"))
  assert value is None and cpu_s < _ANSWER_CPU_BOUND_S
  assert pool.stats["kills"] == kills + 1
  assert len(started) == 1 and started[0].process.poll() is not None  # killed and reaped
  value, _ = _on_a_thread(lambda: math_equivalence.symbolic_equivalent("2x+2", "2(x+1)"))
  assert value is True and len(started) == 2 and started[1].alive()


def test_the_cpu_deadline_waits_out_a_loaded_machine_and_restores_the_callers_timer():
  # Sleeping uses no CPU: a 0.05 s CPU budget lets it finish (a loaded machine's case) ...
  assert deadline.call_with_deadline(
      lambda: time.sleep(0.1) or "done", 0.05, wall_factor=100) == "done"
  # ... up to the wall-clock cap.
  with pytest.raises(deadline.DeadlineExceeded):
    deadline.call_with_deadline(lambda: time.sleep(60), 0.05, wall_factor=4)
  fired = []
  previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
  try:
    signal.setitimer(signal.ITIMER_REAL, 100.0)
    deadline.call_with_deadline(lambda: None, 0.05)
    remaining, _ = signal.setitimer(signal.ITIMER_REAL, 0)
    assert 0 < remaining <= 100.0 and not fired
    assert signal.getsignal(signal.SIGALRM) is not previous
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("scheme", ["stabledrl", "d1"])
def test_the_training_scorer_is_bounded_on_huge_powers(scheme):
  """The probe of issue #27: four (x+1)^{9999} answers took 20 s through the scorer."""
  pytest.importorskip("math_verify")
  from stabledrl_jax import tasks  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.inputs import reward_pool  # pylint: disable=g-import-not-at-top
  task = tasks.get_task("math500")
  scorer = reward_pool.RewardScorer(task, scheme, workers=0)
  texts = ["\\boxed{(x+1)^{9999}}", "\\boxed{(2x+1)^{999}}", "\\boxed{(a+b+c+d+e+f)^{12}}",
           "\\boxed{\\Gamma(999999)}"]
  examples = [tasks.Example(question="q", ground_truth="5")] * 4
  scorer(texts[:1], examples[:1])  # warm up (imports math-verify once)
  start = time.thread_time()
  components = scorer(texts, examples)
  assert time.thread_time() - start < 4 * _ANSWER_CPU_BOUND_S
  correctness = [term.name for term in scorer.terms].index("correctness")
  assert components.shape == (4, len(scorer.terms))
  assert set(components[:, correctness].tolist()) == {-1.0 if scheme == "stabledrl" else 0.0}
  right = scorer(["\\boxed{5}"], examples[:1])  # and a right answer is still right
  assert right[0, correctness] == 1.0


def test_the_helper_pool_imports_nothing_of_the_work_it_runs():
  """No import cycle: symbolic_worker (imported by math_equivalence) starts the helpers'
  program by name and imports neither math_equivalence nor symbolic_helper."""
  import ast  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.rewards import symbolic_worker  # pylint: disable=g-import-not-at-top
  tree = ast.parse(pathlib.Path(symbolic_worker.__file__).read_text())
  imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
              for alias in node.names} | {alias.name for node in ast.walk(tree)
                                           if isinstance(node, ast.Import) for alias in node.names}
  assert not imported & {"math_equivalence", "symbolic_helper"}, imported
  assert symbolic_worker.HELPER_MODULE == "stabledrl_jax.rewards.symbolic_helper"
