"""The paths a command writes into (``--workdir``, evaluate's ``--output_dir``, export's
``--output``), checked before anything is written, and what a failed start created, removed.

``check`` refuses, in one line naming the flag, a path that is empty (``--workdir=`` would
write into the current directory) or that is not valid UTF-8: a byte such as ``\\xff`` in argv
reaches Python as a lone surrogate (``'\\udcff'``, PEP 383), which Python's own file functions
write, but the libraries a run writes through (orbax and tensorstore, TensorBoard) take UTF-8
paths only and fail at the first save, after all the work.

``missing_dirs`` and ``remove_debris`` let a start that fails after it created its workdir (a
model that could not be read, a supervised start that failed) leave the file system as it found
it: only the directories this invocation created, and only while they are empty; nothing that
existed before, nor anything with content, is ever removed.

Standard library only: every command imports it before anything heavy.
"""

from __future__ import annotations

import os
from typing import Iterable


def check(path: str | os.PathLike | None, flag: str) -> None:
  """Raises ValueError naming ``flag`` unless ``path`` names a path every writer can use: not
  empty, no NUL, valid UTF-8 (no surrogate-escaped byte from argv)."""
  if path is None:
    text = ""
  elif isinstance(path, bytes):
    text = os.fsdecode(path)
  else:
    text = path if isinstance(path, str) else str(path)  # A Path, or a remote epath.
  if not text.strip():
    raise ValueError(f"{flag} is empty ({text!r}): name a directory (an empty one would write "
                     "into the current directory)")
  if "\0" in text:
    raise ValueError(f"{flag} {text!r} holds a NUL character")
  try:
    text.encode("utf-8")
  except UnicodeEncodeError:
    try:  # The bytes argv held: b'runs/\xff' shown as 'runs/\xff'.
      shown = repr(os.fsencode(text))[1:]
    except UnicodeEncodeError:
      shown = repr(text)
    raise ValueError(f"{flag} {shown} is not valid UTF-8: the checkpoints and logs are written "
                     "through libraries that take UTF-8 paths only; name it in UTF-8") from None


def missing_dirs(path: str | os.PathLike) -> list[str]:
  """``path`` and those of its ancestors that do not exist, deepest first: what creating it
  creates (none for a remote path)."""
  text = str(path)
  if "://" in text:
    return []
  missing, current = [], os.path.abspath(text)
  while not os.path.lexists(current):
    missing.append(current)
    parent = os.path.dirname(current)
    if parent == current:
      break
    current = parent
  return missing


def entries(path: str | os.PathLike) -> set[str]:
  """The names in directory ``path`` (none if it is not one, or is remote)."""
  text = str(path)
  if "://" in text or not os.path.isdir(text):
    return set()
  return set(os.listdir(text))


def _remove_if_empty(path: str) -> bool:
  """Removes ``path`` if it is a directory (not a link) holding nothing but such directories;
  returns whether it is gone."""
  if os.path.islink(path) or not os.path.isdir(path):
    return False
  try:
    gone = all([_remove_if_empty(os.path.join(path, name)) for name in os.listdir(path)])
    if gone:
      os.rmdir(path)
    return gone
  except OSError:
    return False


def remove_debris(path: str | os.PathLike, before: Iterable[str]) -> None:
  """In directory ``path``: removes each entry not in ``before`` (what was there when this
  invocation started) that is an empty directory (or holds only empty directories). Files, and
  directories with a file in them, stay."""
  text = str(path)
  if "://" in text:
    return
  known = set(before)
  for name in sorted(entries(text) - known):
    _remove_if_empty(os.path.join(text, name))


def remove_created(created: Iterable[str]) -> None:
  """Removes the directories ``created`` (``missing_dirs``: deepest first) while each is empty;
  stops at the first that is not."""
  for directory in created:
    try:
      os.rmdir(directory)
    except OSError:
      return
