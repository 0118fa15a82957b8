"""Equivalence of final math answers: MATH-style string normalization, then math-verify.

`normalize_math_answer` implements the normalization of the MATH benchmark (Hendrycks et al.),
which the d1 scorer uses for MATH-500: drop LaTeX spacing, \\left/\\right, degrees, dollars,
units and percent signs, canonicalize \\frac / \\sqrt arguments and "a/b", strip a short "x ="
prefix. Two answers match when their normalized forms are equal. Some strings cannot be
normalized under that convention (an unbalanced "\\sqrt" at the end, "a/b" with non-integers, two
"\\text{ " units); for those the convention compares the raw strings, and so do we, because the
published numbers depend on it.

`symbolic_equivalent` asks math-verify (sympy-based) when it is installed. sympy can spend
unbounded time on inputs such as (x+1)^{9999}, part of it in C code that no timer can interrupt
(9^{9^{9^{9}}}), so inputs are screened first (`safe_for_symbolic`) and the call gets a CPU-time
budget on any thread (`bounded_call`): a signal deadline in the main thread (`deadline`), a
helper process that is killed if it overruns elsewhere (`symbolic_worker`, whose helpers run
`symbolic_helper`).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import re

from stabledrl_jax.rewards import deadline, extraction, symbolic_worker

# ---------------------------------------------------------------------------
# MATH normalization.
# ---------------------------------------------------------------------------


def _brace_sqrt_arguments(text: str) -> str | None:
  """"\\sqrt3" -> "\\sqrt{3}"; None when a "\\sqrt" has nothing after it."""
  pieces = text.split("\\sqrt")
  out = [pieces[0]]
  for piece in pieces[1:]:
    if not piece:
      return None
    out.append("\\sqrt" + piece if piece[0] == "{" else "\\sqrt{" + piece[0] + "}" + piece[1:])
  return "".join(out)


def _brace_frac_arguments(text: str) -> str | None:
  """"\\frac12" -> "\\frac{1}{2}", "\\frac1{2}" -> "\\frac{1}{2}".

  Returns None when a "\\frac" has nothing after it, and the input unchanged when one has a
  single character after it (the convention gives up on the whole string in that case).
  """
  pieces = text.split("\\frac")
  out = [pieces[0]]
  for piece in pieces[1:]:
    if not piece:
      return None
    if piece[0] == "{":
      out.append("\\frac" + piece)
    elif len(piece) < 2:
      return text
    elif piece[1] == "{":
      out.append("\\frac{" + piece[0] + "}" + piece[1:])
    else:
      out.append("\\frac{" + piece[0] + "}{" + piece[1] + "}" + piece[2:])
  return "".join(out)


def _as_int(text: str) -> int | None:
  """int(text) with Python's rules, or None."""
  try:
    return int(text)
  except ValueError:
    return None


def _slash_fraction_as_frac(text: str) -> str | None:
  """"3/4" -> "\\frac{3}{4}". None when the one "/" separates non-integers (see module doc)."""
  pieces = text.split("/")
  if len(pieces) != 2:
    return text
  numerator, denominator = (_as_int(piece) for piece in pieces)
  if numerator is None or denominator is None:
    return None
  if text != f"{numerator}/{denominator}":
    return text
  return "\\frac{" + str(numerator) + "}{" + str(denominator) + "}"


def _drop_right_units(text: str) -> str | None:
  """"5 \\text{ cm}" -> "5 "; None when "\\text{ " occurs more than once."""
  if "\\text{ " not in text:
    return text
  pieces = text.split("\\text{ ")
  return pieces[0] if len(pieces) == 2 else None


_PLAIN_REMOVALS = ("\\left", "\\right", "^{\\circ}", "^\\circ", "\\$")


def normalize_math_answer(answer: str) -> str | None:
  """The canonical form of a final answer under the MATH convention, or None if it has none.

  Args:
    answer: the answer as written, e.g. "\\dfrac{1}{2}", "x = 5", "10\\%".

  Returns:
    The normalized string ("\\frac{1}{2}", "5", "10"), or None when the convention cannot
    normalize it; callers then compare raw strings (`math_answers_match`).
  """
  text = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
  text = text.replace("tfrac", "frac").replace("dfrac", "frac")
  for removal in _PLAIN_REMOVALS:
    text = text.replace(removal, "")
  text = _drop_right_units(text)
  if text is None:
    return None
  text = text.replace("\\%", "")
  text = text.replace(" .", " 0.").replace("{.", "{0.")
  if not text:
    return text
  if text[0] == ".":
    text = "0" + text
  # A short left-hand side is a variable name: "x = 5" and "5" are the same answer.
  sides = text.split("=")
  if len(sides) == 2 and len(sides[0]) <= 2:
    text = sides[1]
  text = _brace_sqrt_arguments(text)
  if text is None:
    return None
  text = text.replace(" ", "")
  text = _brace_frac_arguments(text)
  if text is None:
    return None
  if text == "0.5":
    text = "\\frac{1}{2}"
  return _slash_fraction_as_frac(text)


def math_answers_match(prediction: str, reference: str) -> bool:
  """True when the normalized answers are equal (raw equality if either cannot be normalized)."""
  normalized_prediction = normalize_math_answer(prediction)
  normalized_reference = normalize_math_answer(reference)
  if normalized_prediction is None or normalized_reference is None:
    return prediction == reference
  return normalized_prediction == normalized_reference


# ---------------------------------------------------------------------------
# math-verify, screened and under a CPU-time deadline.
# ---------------------------------------------------------------------------

MAX_SYMBOLIC_CHARS = 128
# Commands whose evaluation can be astronomically expensive (factorials, the gamma function,
# binomials, sums).
_EXPENSIVE = ("!", "**", "\\Gamma", "\\binom", "\\choose", "\\sum", "\\prod", "\\int", "\\lim")
_LONG_DIGIT_RUN = re.compile(r"[0-9]{13,}")
_DIGIT_RUN = re.compile(r"[0-9]+")
# Total digits over all exponents: with 12-digit bases this keeps any power below ~10^5 digits.
_MAX_EXPONENT_DIGITS = 4
# Digits of a number raised to a power (exact in C, which no deadline interrupts).
_MAX_POWER_DIGITS = 100_000
# sympy expands powers and products of anything but plain numbers: (x+1)^{9999} against 5 runs
# for minutes, (2x+1)^{999} for 11 s, (a+b+c+d+e+f)^{12} for 28 s. The degree (exponents of
# non-numeric bases plus parenthesized factors) and the terms of a full expansion in the
# answer's letters, C(degree + letters, letters), are bounded: (a+b+c)^{16} (1140 terms)
# against (a+b+c)^{15} runs past a 1 s budget.
_MAX_SYMBOLIC_DEGREE = 64
_MAX_EXPANSION_TERMS = 500
# math-verify's parser is exponential in bracket nesting: 21 nested parentheses cost 2.6 s.
MAX_SYMBOLIC_NESTING = 6
_COMMAND = re.compile(r"\\([a-zA-Z]+)")
# LaTeX commands seen in final answers. An unknown one means garbled text, on which sympy's
# parser can spend a long time for nothing; such answers get the normalized comparison only.
_KNOWN_COMMANDS = frozenset("""
    frac dfrac tfrac sqrt cdot times div pm mp le leq ge geq lt gt ne neq neg approx sim equiv
    infty pi circ degree prime left right big Big bigl bigr text textbf textrm mathrm mathbf
    mathit operatorname sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh log ln lg exp
    in notin cup cap setminus subset subseteq emptyset varnothing mid vert lvert rvert langle
    rangle lfloor rfloor lceil rceil begin end pmatrix bmatrix vmatrix matrix array cases dots
    ldots cdots quad qquad to rightarrow implies iff angle triangle parallel perp overline
    alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi
    rho sigma tau upsilon phi varphi chi psi omega Delta Theta Lambda Xi Pi Sigma Phi Psi
    Omega displaystyle boxed hat vec bar tilde
""".split())

# The CPU-time budget of one answer's symbolic check (the d1-style math reward uses 0.2 s).
DEFAULT_BUDGET_S = 1.0

_math_verify_module = None  # the module once imported and warmed up, False if not installed
_math_verify_installed = None  # whether it can be imported (checked without importing it)

# Representative comparisons run once after import, outside any deadline: sympy initializes
# lazily, and a first call costs 50-350 ms that a warm call does not.
_WARM_UP = (("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2"), ("2(x+1)", "2x+2"),
            ("(x+1)^2", "x^2+2x+1"), ("[1, 2)", "(1,2]"), ("0.5", "\\frac{1}{2}"),
            ("x=1", "1"), ("\\{1,2\\}", "1,2"), ("\\pi/3", "60^\\circ"))


def _math_verify():
  """The math_verify module, imported and warmed up on first use (~1 s once), or None."""
  global _math_verify_module
  if _math_verify_module is None:
    try:
      import math_verify  # pylint: disable=g-import-not-at-top
    except ImportError:
      _math_verify_module = False
    else:
      # We pass timeout=None and enforce our own deadline; silence the warning about it.
      for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(
            lambda record: "Timeout is disabled" not in record.getMessage())
      for prediction, reference in _WARM_UP:
        try:
          _verdict(math_verify, prediction, reference)
        except Exception:  # pylint: disable=broad-except
          pass
      _math_verify_module = math_verify
  return _math_verify_module or None


def is_warm() -> bool:
  """Whether math-verify is imported and warmed up in this process already."""
  return bool(_math_verify_module)


def warm_up() -> bool:
  """Imports and warms up math-verify in this process now; whether it is installed."""
  return _math_verify() is not None


def _installed() -> bool:
  """Whether math-verify is importable, without importing it (a helper process may use it)."""
  global _math_verify_installed
  if _math_verify_installed is None:
    _math_verify_installed = (_math_verify_module or
                              importlib.util.find_spec("math_verify") is not None)
  return bool(_math_verify_installed)


def _verdict(module, prediction: str, reference: str) -> bool:
  gold = module.parse(f"${reference}$", parsing_timeout=None)
  guess = module.parse(f"${prediction}$", parsing_timeout=None)
  if not gold or not guess:
    return False
  return bool(module.verify(gold, guess, timeout_seconds=None))


def _verify_text(module, completion: str, gold: str) -> bool:
  """math-verify's parse of both texts, the screen on the extracted answers, then verify."""
  gold_parsed = module.parse(gold, parsing_timeout=None)
  guess = module.parse(completion, parsing_timeout=None)
  if not gold_parsed or not guess:
    return False
  if not (safe_for_symbolic(str(guess[-1])) and safe_for_symbolic(str(gold_parsed[-1]))):
    return math_answers_match(str(guess[-1]), str(gold_parsed[-1]))
  return bool(module.verify(gold_parsed, guess, timeout_seconds=None))


# The symbolic work a bounded call may run, by name (names cross to the helper processes).
_WORK = {"verdict": _verdict, "verify": _verify_text}


def _exponents(answer: str) -> list[tuple[int, str]] | None:
  """(position of "^", exponent) for each "^": the exponent a balanced {...} group or one
  character; None if unbalanced."""
  exponents = []
  caret = answer.find("^")
  while caret >= 0:
    if answer[caret + 1:caret + 2] == "{":
      end = extraction.balanced_brace_end(answer, caret + 1)
      if end is None:
        return None
      exponents.append((caret, answer[caret + 2:end]))
    else:
      end = caret + 1
      exponents.append((caret, answer[caret + 1:caret + 2]))
    caret = answer.find("^", end)
  return exponents


def _braces_balanced(answer: str) -> bool:
  depth = 0
  for char in answer.replace("\\{", "").replace("\\}", ""):
    if char == "{":
      depth += 1
    elif char == "}":
      depth -= 1
      if depth < 0:
        return False
  return depth == 0


def _exponent_value(exponent: str) -> int:
  """An upper bound on an exponent's integer size: the product of its digit runs (>= 1)."""
  value = 1
  for run in _DIGIT_RUN.findall(exponent):
    value *= max(1, int(run))
  return value


def _numeric_base_digits(answer: str, caret: int) -> int | None:
  """The digits of the plain number right before answer[caret] ("12^3" -> 2), else None."""
  start = caret
  while start > 0 and answer[start - 1].isdigit():
    start -= 1
  if start == caret or (start > 0 and (answer[start - 1].isalpha() or answer[start - 1] in ".")):
    return None
  return caret - start


def _powers_are_small(answer: str, exponents: list[tuple[int, str]]) -> bool:
  """The power and expansion bounds of `safe_for_symbolic` (exponent-free answers pass)."""
  degree = answer.count("(")
  for caret, exponent in exponents:
    value = _exponent_value(exponent)
    base_digits = _numeric_base_digits(answer, caret)
    if base_digits is not None:
      if base_digits * value > _MAX_POWER_DIGITS:
        return False
    else:
      degree += value
      if degree > _MAX_SYMBOLIC_DEGREE:
        return False
  letters = len(set(char for char in _COMMAND.sub(" ", answer) if char.isalpha()))
  return degree <= _MAX_SYMBOLIC_DEGREE and math.comb(degree + letters, letters) <= (
      _MAX_EXPANSION_TERMS)


def safe_for_symbolic(answer: str) -> bool:
  """Whether an answer is well-formed and small enough to hand to sympy.

  Accepts short printable-ASCII LaTeX with balanced braces, known commands and brackets nested
  at most MAX_SYMBOLIC_NESTING deep. Refuses factorials, \\Gamma, binomials, sums, products,
  integrals, limits, "**", digit runs of 13 or more, exponents that contain another exponent,
  more than 4 exponent digits in total, a number to a power of over 10^5 digits, and powers and
  products whose expansion is large (a degree over 64, or over 500 terms in the answer's
  letters). So 2^{10}, x^2 + y^2 and (x+1)^{10} pass; 10^{10^{10}}, (99^{99})^{999},
  (x+1)^{9999} and (a+b+c+d+e+f)^{12} do not: sympy would spend seconds to minutes on them, part
  of it in C code that no timer can interrupt.
  """
  if not answer or len(answer) > MAX_SYMBOLIC_CHARS:
    return False
  if not (answer.isascii() and answer.isprintable()):
    return False
  if any(token in answer for token in _EXPENSIVE) or _LONG_DIGIT_RUN.search(answer):
    return False
  if not _braces_balanced(answer) or _nesting_depth(answer) > MAX_SYMBOLIC_NESTING:
    return False
  if any(command not in _KNOWN_COMMANDS for command in _COMMAND.findall(answer)):
    return False
  exponents = _exponents(answer)
  if exponents is None or any("^" in exponent for _, exponent in exponents):
    return False
  exponent_digits = sum(char.isdigit() for _, exponent in exponents for char in exponent)
  return exponent_digits <= _MAX_EXPONENT_DIGITS and _powers_are_small(answer, exponents)


def run_bounded_here(kind: str, args, budget_s: float):
  """`_WORK[kind](module, *args)` in this (main) thread under the CPU deadline; None when
  math-verify is missing, the work fails, or it runs past ``budget_s`` CPU seconds."""
  module = _math_verify()
  work = _WORK.get(kind)
  if module is None or work is None:
    return None
  try:
    return deadline.call_with_deadline(lambda: work(module, *args), budget_s)
  except deadline.DeadlineExceeded:
    return None
  except deadline.NoSignals:
    raise
  except Exception:  # pylint: disable=broad-except
    # math-verify / sympy raise a wide variety of errors on odd input; a reward must not.
    return None


def bounded_call(kind: str, args, budget_s: float):
  """`run_bounded_here` on the main thread; elsewhere the same in a helper process.

  Either way the work gets at most about ``budget_s`` seconds of CPU time, and the calling
  thread spends no more: off the main thread it only waits for the helper
  (`symbolic_worker.POOL`), which is killed if it does not answer in time.
  """
  if deadline.signals_usable():
    try:
      return run_bounded_here(kind, args, budget_s)
    except deadline.NoSignals:
      pass
  return symbolic_worker.POOL.call(kind, list(args), budget_s)


def symbolic_equivalent(prediction: str, reference: str, *,
                        deadline_s: float = DEFAULT_BUDGET_S) -> bool | None:
  """math-verify's verdict on whether two answers are mathematically equal.

  Args:
    prediction: the model's final answer (LaTeX or plain), without \\boxed{}.
    reference: the ground-truth answer.
    deadline_s: the CPU-time budget of the check, on any thread (`bounded_call`).

  Returns:
    True or False, or None when math-verify is not installed, an input fails
    `safe_for_symbolic`, or the call fails or runs out of time.
  """
  if not _installed() or not (safe_for_symbolic(prediction) and safe_for_symbolic(reference)):
    return None
  return bounded_call("verdict", (prediction, reference), deadline_s)


MAX_PARSE_NESTING = 12


def _nesting_depth(text: str) -> int:
  """The deepest nesting of (), [] and {} in ``text`` (unbalanced closers are ignored)."""
  depth = deepest = 0
  for char in text:
    if char in "([{":
      depth += 1
      deepest = max(deepest, depth)
    elif char in ")]}" and depth:
      depth -= 1
  return deepest


def verify_completion(completion: str, gold: str, *, deadline_s: float = DEFAULT_BUDGET_S
                      ) -> bool:
  """The official StableDRL check: math-verify's ``parse`` of the gold answer (a number, or a
  full MATH solution) and of the whole completion, then ``verify``.

  Parsing finds the answer wherever math-verify looks for one (\\boxed{} first, then LaTeX and
  plain expressions). An extracted answer that fails `safe_for_symbolic` is compared as
  normalized text (`math_answers_match`), never handed to sympy. Parsing and comparison
  together get ``deadline_s`` of CPU time on any thread (`bounded_call`; the official code
  allows 5 s of wall time for each); past it, or on an error, the final answers (last \\boxed{}
  or <answer>) are compared as normalized text.
  """
  if not _installed() or extraction.oversized(completion):
    return False
  if _nesting_depth(completion) <= MAX_PARSE_NESTING:
    verdict = bounded_call("verify", (completion, gold), deadline_s)
    if verdict is not None:
      return verdict
  # math-verify's parser is exponential in bracket nesting (minutes at depth 300), and some
  # answers cost more than the budget to parse ((\Gamma(10^{12}))!): such text gets the
  # normalized comparison of its final answer only.
  prediction = extraction.last_boxed(completion) or extraction.last_answer_tag(completion)
  reference = extraction.last_boxed(gold) or gold
  return bool(prediction) and math_answers_match(prediction.strip(), reference.strip())
