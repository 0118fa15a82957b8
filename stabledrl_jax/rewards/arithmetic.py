"""Safe evaluation of countdown answers: + - * / and parentheses, never `eval`.

A recursive-descent parser over exact rationals (`fractions.Fraction`):

    expression := term (("+" | "-") term)*
    term       := unary (("*" | "/") unary)*
    unary      := ("+" | "-") unary | atom
    atom       := number | "(" expression ")"

Every input is bounded before any arithmetic happens: length, nesting depth and the magnitude of
every intermediate value (and of its denominator). Anything outside the grammar or the bounds is
rejected (`None`), so model output such as "9**9**9**9", "1/0" or a thousand nested parentheses
costs microseconds and can never hang, overflow or raise.

Literals follow Python's rules, so that an expression accepted here means what the d1 scorer's
`eval` would make of it: integers ("0", "42", but not "042"), and decimals ("2.5", "2.", ".5").
"""

from __future__ import annotations

import ast
import dataclasses
import fractions
import operator

from stabledrl_jax import pyast

MAX_EXPRESSION_CHARS = 512
MAX_NESTING_DEPTH = 32
MAX_MAGNITUDE = 10**15

_OPERATORS = frozenset("+-*/()")
_WHITESPACE = frozenset(" \t\n\r\f\v")
_DIGITS = frozenset("0123456789")


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """The value of an accepted expression and the numbers written in it.

  Attributes:
    value: the exact value.
    literals: the numeric literals as written, left to right (e.g. ("25", "4", "3")).
  """

  value: fractions.Fraction
  literals: tuple[str, ...]

  def integer_literals(self) -> list[int] | None:
    """The literals as integers, or None if any of them is a decimal ("2.5", "3.")."""
    if any("." in literal for literal in self.literals):
      return None
    return [int(literal) for literal in self.literals]


class _Rejected(Exception):
  """Internal: the input is outside the grammar or the bounds."""


def _tokenize(expression: str) -> list[str]:
  """Splits into numbers and single-character operators; rejects any other character."""
  tokens = []
  i, n = 0, len(expression)
  while i < n:
    char = expression[i]
    if char in _WHITESPACE:
      i += 1
    elif char in _OPERATORS:
      tokens.append(char)
      i += 1
    elif char in _DIGITS or char == ".":
      start = i
      while i < n and expression[i] in _DIGITS:
        i += 1
      if i < n and expression[i] == ".":
        i += 1
        while i < n and expression[i] in _DIGITS:
          i += 1
      tokens.append(expression[start:i])
    else:
      raise _Rejected(f"character {char!r}")
  return tokens


def _literal_value(literal: str) -> fractions.Fraction:
  """Python literal rules: no lone ".", no leading zeros on integers ("042" is a SyntaxError)."""
  if literal == ".":
    raise _Rejected("lone '.'")
  if "." not in literal and len(literal) > 1 and literal[0] == "0" and literal.strip("0"):
    raise _Rejected(f"leading zero in {literal!r}")
  return fractions.Fraction(literal)


class _Parser:
  """One pass over the token list; each method consumes one grammar rule."""

  def __init__(self, tokens: list[str], max_depth: int, max_magnitude: int):
    self._tokens = tokens
    self._position = 0
    self._max_depth = max_depth
    self._max_magnitude = max_magnitude
    self.literals: list[str] = []

  def parse(self) -> fractions.Fraction:
    value = self._expression(depth=0)
    if self._position != len(self._tokens):
      raise _Rejected(f"unexpected {self._tokens[self._position]!r}")
    return value

  def _peek(self) -> str | None:
    return self._tokens[self._position] if self._position < len(self._tokens) else None

  def _take(self) -> str:
    token = self._peek()
    if token is None:
      raise _Rejected("unexpected end")
    self._position += 1
    return token

  def _bounded(self, value: fractions.Fraction) -> fractions.Fraction:
    # Bounding the denominator too keeps chains like 1/7/7/7/... from growing huge rationals.
    if abs(value) > self._max_magnitude or value.denominator > self._max_magnitude:
      raise _Rejected("magnitude")
    return value

  def _expression(self, depth: int) -> fractions.Fraction:
    value = self._term(depth)
    while self._peek() in ("+", "-"):
      operator = self._take()
      right = self._term(depth)
      value = self._bounded(value + right if operator == "+" else value - right)
    return value

  def _term(self, depth: int) -> fractions.Fraction:
    value = self._unary(depth)
    while self._peek() in ("*", "/"):
      operator = self._take()
      right = self._unary(depth)
      if operator == "*":
        value = self._bounded(value * right)
      elif right == 0:
        raise _Rejected("division by zero")
      else:
        value = self._bounded(value / right)
    return value

  def _unary(self, depth: int) -> fractions.Fraction:
    if depth > self._max_depth:
      raise _Rejected("nesting depth")
    token = self._peek()
    if token in ("+", "-"):
      self._take()
      operand = self._unary(depth + 1)
      return operand if token == "+" else -operand
    return self._atom(depth)

  def _atom(self, depth: int) -> fractions.Fraction:
    token = self._take()
    if token == "(":
      value = self._expression(depth + 1)
      if self._take() != ")":
        raise _Rejected("unbalanced parenthesis")
      return value
    if token in _OPERATORS:
      raise _Rejected(f"unexpected {token!r}")
    self.literals.append(token)
    return self._bounded(_literal_value(token))


def evaluate_arithmetic(
    expression: str,
    *,
    max_chars: int = MAX_EXPRESSION_CHARS,
    max_depth: int = MAX_NESTING_DEPTH,
    max_magnitude: int = MAX_MAGNITUDE,
) -> Evaluation | None:
  """Evaluates an arithmetic expression exactly, or returns None if it is not one.

  Args:
    expression: text such as "(25 - 4) * 3"; surrounding whitespace is ignored.
    max_chars: longer inputs are rejected before tokenizing.
    max_depth: bound on nested parentheses plus chained unary signs.
    max_magnitude: bound on |value| and on the denominator of every intermediate result.

  Returns:
    An `Evaluation`, or None for anything outside the grammar or the bounds (syntax errors,
    other characters such as "**" or "x", division by zero, too long, too deep, too large).
    Never raises.
  """
  if not isinstance(expression, str) or len(expression) > max_chars:
    return None
  try:
    tokens = _tokenize(expression)
    parser = _Parser(tokens, max_depth=max_depth, max_magnitude=max_magnitude)
    value = parser.parse()
  except (_Rejected, ValueError, ZeroDivisionError, RecursionError):
    return None
  return Evaluation(value=value, literals=tuple(parser.literals))


# ---------------------------------------------------------------------------
# Python's own arithmetic, bounded: the official StableDRL countdown scorer's semantics.
# ---------------------------------------------------------------------------

# Powers whose result would pass this many bits are refused ("9**9**9" never runs).
MAX_POWER_BITS = 4096

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def _power(base, exponent):
  """``base ** exponent``; an integer power of over MAX_POWER_BITS bits is refused (float powers
  are fast, and Python raises OverflowError past the float range itself)."""
  if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
    if exponent * (abs(base).bit_length() - 1) > MAX_POWER_BITS:
      raise OverflowError("power too large")
  return base ** exponent


def _python_value(node: ast.AST):
  if isinstance(node, ast.Expression):
    return _python_value(node.body)
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    return node.value
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
    signs = []  # A chain of signs, folded in a loop: as deep as Python's parser allows.
    while isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
      signs.append(node.op)
      node = node.operand
    value = _python_value(node)
    for op in reversed(signs):
      value = +value if isinstance(op, ast.UAdd) else -value
    return value
  if isinstance(node, ast.BinOp):
    left, right = _python_value(node.left), _python_value(node.right)
    if isinstance(node.op, ast.Pow):
      return _power(left, right)
    if type(node.op) in _BINARY:
      return _BINARY[type(node.op)](left, right)
  raise _Rejected(f"not arithmetic: {type(node).__name__}")


def python_value(expression: str) -> int | float | complex | None:
  """What Python's ``eval`` makes of an arithmetic expression (ints, floats, + - * / // % **,
  unary signs, parentheses), or None where it would raise or is not arithmetic.

  This is the official StableDRL countdown scorer's evaluation (its ``eval`` after a character
  check), run on Python's own parser and operators without ``eval``, so the values are
  Python's (floats, ``7 // 2 == 3``, ``2 ** 3 == 8``, ``(-1) ** 0.5`` complex). Bounded where
  ``eval`` is not: a power whose result would exceed MAX_POWER_BITS bits is None (``eval``
  would compute it, or hang on "9**9**9**9"), as is anything Python's parser refuses (over 200
  nested parentheses, a very deep chain of signs). Never raises.
  """
  if not isinstance(expression, str):
    return None
  try:
    tree = pyast.parse(expression.lstrip(" \t"), mode="eval")  # eval strips these too.
    return _python_value(tree)
  except (_Rejected, SyntaxError, ValueError, TypeError, ZeroDivisionError, OverflowError,
          RecursionError, MemoryError):
    return None
