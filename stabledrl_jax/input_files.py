"""Files a user names (data, checkpoints, tokenizers): what is wrong with one, in words.

Every path a run reads from its config or its flags is checked here before it is opened
(docs/reliability.md): an error says which field named it, the path, and the reason (no such
file, a directory or a FIFO where a file was expected, empty, not readable). A FIFO or a device
is never opened: reading one waits for a writer forever.

    input_files.check(path)                         # InputError "<path>: a FIFO, not a file"
    with input_files.named("config.data.train"):    # prefixes the field to what fails inside
      examples = tasks.load_examples(task, path)

Standard library only: every layer may import it.
"""

from __future__ import annotations

import contextlib
import os
import stat
from typing import Iterator

KINDS = ("file", "directory")


class InputError(ValueError):
  """A file a run was told to read is missing, of the wrong kind, empty or unreadable; the
  message, one line, names the field (where one named it), the path and the reason."""


def kind_of(mode: int) -> str:
  """What ``os.stat``'s ``st_mode`` is, in words ("a directory", "a FIFO", ...)."""
  for test, kind in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                     (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                     (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
    if test(mode):
      return kind
  return "not a regular file"


def problem(path: str | os.PathLike[str], kind: str = "file", *,
            allow_empty: bool = False) -> str | None:
  """Why ``path`` cannot be read as a ``kind`` ('file' or 'directory'), or None if it can.

  The reasons: "no such file or directory", "<what it is>, not a <kind>", "empty" (a file of
  no bytes, unless ``allow_empty``), "not readable (<why>)". Nothing is opened.
  """
  if kind not in KINDS:
    raise ValueError(f"kind={kind!r} is not one of {KINDS}")
  try:
    info = os.stat(path)
  except FileNotFoundError:
    return ("a symbolic link to a missing path" if os.path.islink(path)
            else "no such file or directory")
  except OSError as error:
    return f"not readable ({error.strerror or error})"
  if kind == "file" and not stat.S_ISREG(info.st_mode):
    return f"{kind_of(info.st_mode)}, not a file"
  if kind == "directory" and not stat.S_ISDIR(info.st_mode):
    return f"{kind_of(info.st_mode)}, not a directory"
  if not os.access(path, os.R_OK | (os.X_OK if kind == "directory" else 0)):
    return "not readable (permission denied)"
  if kind == "file" and info.st_size == 0 and not allow_empty:
    return "empty"
  return None


def check(path: str | os.PathLike[str], kind: str = "file", *, allow_empty: bool = False,
          what: str = "") -> None:
  """Raises ``InputError`` "<what> <path>: <reason>" if ``path`` is not a readable ``kind``."""
  reason = problem(path, kind, allow_empty=allow_empty)
  if reason is not None:
    raise InputError(f"{what + ' ' if what else ''}{os.fspath(path)}: {reason}")


def first_line(error: BaseException) -> str:
  """An error's message in one line (its type's name when it has none)."""
  text = str(error).strip()
  return text.splitlines()[0] if text else type(error).__name__


@contextlib.contextmanager
def named(field: str) -> Iterator[None]:
  """An ``OSError`` or ``ValueError`` raised inside is re-raised as an ``InputError`` that
  starts with ``field`` (a config field or a flag): "config.data.train: /x.jsonl: empty". An
  error that already names a field or flag ("config.<field>: ...", "--flag ...") passes
  unchanged."""
  try:
    yield
  except (OSError, ValueError) as error:
    message = first_line(error)
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
      message = f"{os.fspath(error.filename)}: {error.strerror}"  # Not "[Errno 2] ...: 'x'".
    if message.startswith((field, "config.", "--")):  # Already names its field or flag.
      raise
    raise InputError(f"{field}: {message}") from error
