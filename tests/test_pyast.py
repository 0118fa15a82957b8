"""pyast.parse: a parse beside another thread's parse (python/cpython#106905; see
docs/reliability.md)."""

import ast
import sys
import threading
import time

import pytest

from stabledrl_jax import pyast
from stabledrl_jax.rewards import arithmetic

_MISMATCH = SystemError("AST constructor recursion depth mismatch (before=162, after=66)")


def _failing_first(count, error=_MISMATCH):
  """An ast.parse whose first ``count`` calls raise ``error``; the calls are counted."""
  calls = []
  real = ast.parse

  def parse(*args, **kwargs):
    calls.append(args)
    if len(calls) <= count:
      raise error
    return real(*args, **kwargs)

  return parse, calls


def test_a_mismatch_is_parsed_again_and_the_answer_scored(monkeypatch):
  parse, calls = _failing_first(3)
  monkeypatch.setattr(pyast, "_ast_parse", parse)
  assert arithmetic.python_value("7 // 2 + 2 ** 3") == 11
  assert len(calls) == 4


def test_a_mismatch_on_every_attempt_and_other_system_errors_are_raised(monkeypatch):
  parse, calls = _failing_first(pyast.MAX_ATTEMPTS)
  monkeypatch.setattr(pyast, "_ast_parse", parse)
  with pytest.raises(SystemError, match="recursion depth mismatch"):
    pyast.parse("1 + 1", mode="eval")
  assert len(calls) == pyast.MAX_ATTEMPTS
  parse, calls = _failing_first(1, SystemError("some other interpreter fault"))
  monkeypatch.setattr(pyast, "_ast_parse", parse)
  with pytest.raises(SystemError, match="some other interpreter fault"):
    pyast.parse("1 + 1", mode="eval")
  assert len(calls) == 1


def test_syntax_errors_are_not_retried(monkeypatch):
  parse, calls = _failing_first(0)
  monkeypatch.setattr(pyast, "_ast_parse", parse)
  with pytest.raises(SyntaxError):
    pyast.parse("1 +", mode="eval")
  assert len(calls) == 1
  assert arithmetic.python_value("1 +") is None


class _Finalized:
  """A cycle with a finalizer: the collector runs Python code, a point where threads switch."""

  def __del__(self):
    sum(range(20))


def _parse_beside_a_thread(parse, *, until_errors, seconds):
  """Parses an expression while another thread parses; (parses, [SystemError messages]) after
  ``seconds`` or ``until_errors`` errors. The main thread makes garbage with finalizers, so that the
  collector runs Python code (and lets the other thread in) inside an AST construction."""
  stop = threading.Event()

  def other():
    while not stop.is_set():
      try:
        ast.parse("+".join(["(a.b(c)[d])"] * 100))
      except SystemError:
        pass

  thread = threading.Thread(target=other, daemon=True)
  interval = sys.getswitchinterval()
  sys.setswitchinterval(1e-6)
  thread.start()
  parses, errors = 0, []
  end = time.monotonic() + seconds
  try:
    while time.monotonic() < end and len(errors) < until_errors:
      for _ in range(20):
        item = _Finalized()
        item.cycle = item
      del item
      try:
        assert ast.dump(parse("+".join(["x"] * 200), mode="eval")).startswith("Expression(")
        parses += 1
      except SystemError as error:
        errors.append(str(error))
  finally:
    stop.set()
    thread.join()
    sys.setswitchinterval(interval)
  return parses, errors


def test_a_parse_beside_another_threads_parse_almost_never_fails():
  """On an interpreter with the race, bare ast.parse fails here (on a loaded machine, up to one
  parse in eight) and pyast.parse, with the same thread beside it, at least 20 times less often
  (no failure seen here; CI once saw one, its cause unknown: the messages say)."""
  parses, errors = _parse_beside_a_thread(
      lambda source, mode: ast.parse(source, mode=mode), until_errors=5, seconds=15)
  if not errors:
    pytest.skip(f"no race in {parses} parses: this interpreter keeps the AST state per thread")
  bare_rate = len(errors) / (parses + len(errors))
  parses, errors = _parse_beside_a_thread(pyast.parse, until_errors=10, seconds=5)
  assert parses > 0 and len(errors) / (parses + len(errors)) < bare_rate / 20, (
      bare_rate, parses, errors)
