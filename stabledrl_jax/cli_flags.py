"""The absl flags the command-line tools share (``train``, ``plan``), defined once, and the
checks of ``--config`` and its ``--config.a.b=value`` overrides before absl parses them.

absl keeps one registry of flags per process, so two modules that each defined ``--config``
could not be imported together (a notebook, a test that imports every module). Each tool imports
these and adds its own.
"""

import difflib
import os
import pathlib
import sys

import ml_collections
from absl import flags
from ml_collections import config_flags

from stabledrl_jax.training.config import config_lib

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
    resolved = resolve_config_flag(argv)
    check_config_flags(resolved[1:])
  except (FileNotFoundError, ValueError) as error:
    if any(arg in ("--verbose", "--verbose=true", "--verbose=True") for arg in argv):
      raise
    hint = " (--verbose shows the traceback)" if error.__cause__ is not None else ""
    sys.exit(f"error: {error}{hint}")
  return resolved


def resolve_config_flag(argv: list[str]) -> list[str]:
  """``argv`` with a ``--config NAME`` (or ``--config=NAME``) replaced by the shipped file's path
  (``config_path``); overrides such as ``--config.a.b=v`` pass through."""
  argv = list(argv)
  for i, arg in enumerate(argv):
    if arg == "--config" and i + 1 < len(argv):
      argv[i + 1] = config_lib.config_path(argv[i + 1])
    elif arg.startswith("--config="):
      argv[i] = "--config=" + config_lib.config_path(arg[len("--config="):])
  return argv


def _close(word: str, choices: list[str]) -> str | None:
  matches = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
  return matches[0] if matches else None


def field_paths(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  """The dotted path of every field of ``config`` (sections and their fields)."""
  paths = []
  for key, value in config.items():
    path = f"{prefix}{key}"
    paths.append(path)
    if isinstance(value, ml_collections.ConfigDict):
      paths.extend(field_paths(value, path + "."))
  return paths


def check_field(config: ml_collections.ConfigDict, dotted: str) -> None:
  """Raises ValueError ``config.<dotted>: no such field; did you mean config.<closest>?`` when
  ``dotted`` (``rollout.temperature``) names no field of ``config``."""
  node, walked = config, []
  for part in dotted.split("."):
    key = part.split("[", 1)[0]  # config_flags also index sequences: a.b[0].
    if not isinstance(node, ml_collections.ConfigDict):
      raise ValueError(f"config.{dotted}: config.{'.'.join(walked)} is a value "
                       f"({type(node).__name__}), not a section")
    if key not in node:
      near = _close(key, list(node.keys()))
      guess = ".".join(walked + [near]) if near else _close(dotted, field_paths(config))
      hint = f"; did you mean config.{guess}?" if guess else ""
      where = f"config.{'.'.join(walked)}" if walked else "the config"
      raise ValueError(f"config.{dotted}: no such field ({where} has no {key!r}){hint}")
    node, walked = node[key], walked + [key]


def _config_arg(argv: list[str]) -> str | None:
  for i, arg in enumerate(argv):
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
    if arg.startswith("--config="):
      return arg[len("--config="):]
  return None


def _missing_file(path: str) -> FileNotFoundError:
  """The error of a --config path that is not a file, with the closest existing config."""
  parent = pathlib.Path(path).parent
  candidates = {str(parent / f"{name}.py"): name for name in config_lib.config_names()}
  if parent.is_dir():
    candidates.update({str(p): p.stem for p in parent.glob("*.py") if p.stem != "__init__"})
  near = _close(pathlib.Path(path).stem, sorted(set(candidates.values())))
  if near is not None:
    here = [c for c, stem in candidates.items() if stem == near and os.path.isfile(c)]
    near = here[0] if here else near
  hint = f"; did you mean {near}?" if near else f"; the shipped configs are {config_lib.config_names()}"
  return FileNotFoundError(f"--config {path!r}: no such file{hint}")


def check_config_flags(argv: list[str]) -> None:
  """Checks what absl's config_flags would fail on with a traceback: the ``--config`` file
  exists and its ``get_config()`` runs, and every ``--config.a.b=value`` override (or
  ``--[no]config.a.b``) names one of its fields.

  Raises:
    FileNotFoundError: the file does not exist (naming it and the closest config).
    ValueError: ``config.<field>: no such field; did you mean config.<closest>?``, or the config
      file's own error, on one line.
  """
  value = _config_arg(argv)
  if value is None:
    return  # absl reports the missing required flag.
  path, colon, arg = value.partition(":")
  if not os.path.isfile(path):
    if os.path.exists(path):  # A FIFO, a directory, a device: said, never opened.
      from stabledrl_jax import workdir_files  # pylint: disable=g-import-not-at-top
      workdir_files.regular_file(path, "--config", error=ValueError)
    raise _missing_file(path)
  try:
    config = config_lib.from_file(path, arg if colon else None)
  except Exception as error:  # pylint: disable=broad-except  (anything a config file raises)
    raise ValueError(f"--config {path}: get_config() raised {type(error).__name__}: "
                     f"{error}") from error
  for item in argv:
    name = item.split("=", 1)[0]
    for flag in ("--config.", "--noconfig."):
      if name.startswith(flag):
        check_field(config, name[len(flag):])
