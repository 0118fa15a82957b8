"""The absl flags the command-line tools share (``train``, ``plan``), defined once.

absl keeps one registry of flags per process, so two modules that each defined ``--config``
could not be imported together (a notebook, a test that imports every module). Each tool imports
these and adds its own.
"""

import sys

from absl import flags
from ml_collections import config_flags

from stabledrl_jax.training import config_lib

CONFIG = config_flags.DEFINE_config_file(
    "config", None, "A shipped config's name (quickstart, llada8b_gsm8k, ...) or the path of a "
    "get_config() file.", lock_config=True)
VERBOSE = flags.DEFINE_bool("verbose", False, "Show the traceback of an error (a bad config "
                            "value, a busy or mismatched workdir) instead of one line.")


def resolve_argv(argv: list[str]) -> list[str]:
  """``argv`` with ``--config NAME`` resolved to the shipped file and every ``--config.a.b``
  checked (``config_lib``), before absl parses it: absl's config_flags fail on a missing file or
  an unknown field with a traceback. A bad one exits with one line (``--verbose`` re-raises)."""
  try:
    resolved = config_lib.resolve_config_flag(argv)
    config_lib.check_config_flags(resolved[1:])
  except (FileNotFoundError, ValueError) as error:
    if any(arg in ("--verbose", "--verbose=true", "--verbose=True") for arg in argv):
      raise
    hint = " (--verbose shows the traceback)" if error.__cause__ is not None else ""
    sys.exit(f"error: {error}{hint}")
  return resolved
