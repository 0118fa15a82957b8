"""``ast.parse`` that survives another thread parsing at the same time.

CPython 3.11 keeps the AST constructor's recursion counter in state shared by every thread
(python/cpython#106905). When two threads build trees at once (the trainer scoring a countdown
answer while one of orbax's save threads formats a traceback, whose caret markers ``ast.parse``
the source line), a thread switch inside the construction leaves the counter off, and a parse
that built its tree correctly raises ``SystemError: AST constructor recursion depth mismatch``.
Parsing is pure, so ``parse`` builds the tree again. docs/reliability.md lists the fault.
"""

from __future__ import annotations

import ast

# Builds before the mismatch is raised. Each failed one needs another thread to have switched in
# during the construction (on a loaded machine, with a thread that parses all the time, one build
# in eight); a build after a mismatch costs what the parse costs.
MAX_ATTEMPTS = 100

_MISMATCH = "AST constructor recursion depth mismatch"
_ast_parse = ast.parse  # The parse that is retried (tests replace it here, not in ast).


def parse(source: str, filename: str = "<unknown>", mode: str = "exec") -> ast.AST:
  """``ast.parse(source, filename, mode)``, rebuilt on the shared counter's mismatch.

  Raises what ``ast.parse`` raises (``SyntaxError``, ``RecursionError``, ...), and the
  ``SystemError`` itself if MAX_ATTEMPTS builds in a row all hit it.
  """
  for attempt in range(MAX_ATTEMPTS):
    try:
      return _ast_parse(source, filename, mode)
    except SystemError as error:
      if _MISMATCH not in str(error):
        raise
      if attempt == MAX_ATTEMPTS - 1:
        raise SystemError(f"{error}, {MAX_ATTEMPTS} parses in a row") from error
  raise AssertionError("unreachable")
