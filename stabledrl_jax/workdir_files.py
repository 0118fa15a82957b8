"""The one way files are written into a workdir (or an export's output directory).

Every writer of the trainer, the supervised start, the metrics and TensorBoard logs, the spike
records, export and evaluation writes through these functions (docs/reliability.md):

* A file is written under a fresh name beside it (``tempfile.mkstemp``: created exclusively, so
  never through a link planted under that name) and renamed over its name: a symbolic link in
  its place is replaced, never followed, and a kill mid-write leaves the old file whole.
* A directory a writer fills (``make_dir``) must be a real directory: a symbolic link there is
  refused, one line naming it.
* A directory written whole (the supervised start, an export) is staged beside its name inside
  the same parent (``staged_dir``) and renamed into place; nothing is staged outside a local
  workdir. A remote (``gs://``) target stages locally in one place, ``local_staging``, in the
  system's temporary directory (``TMPDIR``).
* Any ``OSError`` (a full disk, no permission) is a ``WorkdirError``, one line naming the path
  and the reason (``writing``); what a failed write staged is removed.

Standard library and etils only: every layer may import it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import tempfile
from typing import Iterator

from etils import epath

# Staging names start with this prefix; a leftover one (a kill mid-write) is recognisable.
STAGING_PREFIX = ".staging-"


class WorkdirError(RuntimeError):
  """A file of the workdir cannot be written (read-only, full disk, a directory or a link in the
  way); the message, one line, names the file."""


def reason_of(error: OSError) -> str:
  """The cause of ``error`` in words (a full disk says so)."""
  if error.errno == errno.ENOSPC:
    return "no space left on the device"
  return error.strerror or str(error) or type(error).__name__


_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def os_error_of(error: BaseException | None) -> OSError | None:
  """The ``OSError`` behind ``error``: itself, one in its chain of causes, or one that
  tensorstore (orbax's storage) reports in words (``RESOURCE_EXHAUSTED: ... No space left on
  device [os_error_code='28']``, a ``ValueError``); None if it is not a file system's error."""
  for _ in range(8):
    if error is None:
      return None
    if isinstance(error, OSError):
      return error
    match = _OS_ERROR_CODE.search(str(error))
    if match:
      code = int(match.group(1))
      return OSError(code, os.strerror(code))
    error = error.__cause__ or error.__context__
  return None


@contextlib.contextmanager
def writing(path: epath.PathLike) -> Iterator[None]:
  """Turns a file system's error (``os_error_of``: a full disk, no permission) into a
  ``WorkdirError`` naming ``path``: a failed write without a file name, or deep in a library,
  still says which file it was. Other errors pass unchanged."""
  try:
    yield
  except WorkdirError:
    raise
  except Exception as error:  # pylint: disable=broad-except
    cause = os_error_of(error)
    if cause is None:
      raise
    raise WorkdirError(f"cannot write {path}: {reason_of(cause)}") from error


def is_local(path: epath.PathLike) -> bool:
  """Whether ``path`` is on this machine's file system (not ``gs://`` and the like)."""
  return "://" not in str(path)


def _refuse_link(path: str, what: str) -> None:
  if os.path.islink(path):
    raise WorkdirError(f"{path} is a symbolic link (to {os.readlink(path)}): the {what} is "
                       "written only inside the workdir, never through a link; remove the link")


def make_dir(path: epath.PathLike) -> epath.Path:
  """``path`` and its missing parents, created; a ``WorkdirError`` if it (or a parent that
  exists) is a symbolic link or a file, or cannot be created."""
  path = epath.Path(path)
  with writing(path):
    if is_local(path):
      _refuse_link(os.fspath(path), "directory")
      if os.path.exists(path) and not os.path.isdir(path):
        raise WorkdirError(f"cannot write {path}: a file is in the way of a directory")
    path.mkdir(parents=True, exist_ok=True)
  return path


@contextlib.contextmanager
def replacing(path: epath.PathLike) -> Iterator[str]:
  """Yields a new local file's name to write (by any library) that then replaces ``path``.

  Locally the file is created beside ``path`` (exclusively: never a planted link) and renamed
  over it, so a link at ``path`` is replaced, not followed; a remote ``path`` gets a local
  staging file copied up. On any error the staging file is removed, and an ``OSError`` is a
  ``WorkdirError`` naming ``path``.
  """
  path = epath.Path(path)
  with writing(path):
    if not is_local(path):
      with local_staging() as local:
        staging = os.path.join(local, path.name)
        yield staging
        path.write_bytes(epath.Path(staging).read_bytes())
      return
    target = os.fspath(path)
    if os.path.isdir(target) and not os.path.islink(target):
      raise WorkdirError(f"cannot write {target}: a directory is in the way of a file")
    fd, staging = tempfile.mkstemp(dir=os.path.dirname(target) or ".",
                                   prefix=f"{STAGING_PREFIX}{os.path.basename(target)}.")
    os.close(fd)
    try:
      yield staging
      os.chmod(staging, 0o666 & ~_umask())  # mkstemp makes 0600; a new file's usual mode.
      os.replace(staging, target)
    except BaseException:
      with contextlib.suppress(OSError):
        os.unlink(staging)
      raise


def write_bytes(path: epath.PathLike, data: bytes) -> None:
  """``path`` holds ``data`` (``replacing``: written aside, renamed over it)."""
  with replacing(path) as staging:
    with open(staging, "wb") as file:
      file.write(data)


def write_text(path: epath.PathLike, text: str) -> None:
  """``path`` holds ``text`` in UTF-8 (``replacing``)."""
  write_bytes(path, text.encode("utf-8"))


def open_append(path: epath.PathLike):
  """A text file open for appending to ``path``, which must be a regular file (it is opened
  with ``O_NOFOLLOW``: a link planted since is refused, not followed)."""
  path = os.fspath(path)
  with writing(path):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0),
                 0o666)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
      os.close(fd)
      raise WorkdirError(f"cannot write {path}: not a regular file")
  return os.fdopen(fd, "a", encoding="utf-8")


def _remove(path: str) -> None:
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path, ignore_errors=True)
  else:
    with contextlib.suppress(OSError):
      os.unlink(path)


@contextlib.contextmanager
def staged_dir(path: epath.PathLike, *, overwrite: bool = False) -> Iterator[epath.Path]:
  """Yields a new directory beside ``path`` to fill; it then becomes ``path``.

  ``path`` must not exist, or be an empty directory, unless ``overwrite``: then the old one is
  renamed aside, the new one renamed in, and the old one removed (a link at ``path`` is
  replaced, never followed). On any error the staged directory is removed and ``path`` is as it
  was; an ``OSError`` is a ``WorkdirError`` naming ``path``. A remote ``path`` is filled in a
  local staging directory (``local_staging``) and copied up, file by file.
  """
  path = epath.Path(path)
  with writing(path):
    if not is_local(path):
      with local_staging() as local:
        yield epath.Path(local)
        path.mkdir(parents=True, exist_ok=True)
        for file in epath.Path(local).iterdir():
          (path / file.name).write_bytes(file.read_bytes())
      return
    target = os.fspath(path)
    parent = os.path.dirname(target) or "."
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(dir=parent, prefix=f"{STAGING_PREFIX}{os.path.basename(target)}.")
    try:
      yield epath.Path(staging)
      os.chmod(staging, 0o777 & ~_umask())
      if os.path.islink(target) or (os.path.lexists(target) and not os.path.isdir(target)):
        if not overwrite:
          raise WorkdirError(f"cannot write {target}: something that is not a directory is in "
                             "its place")
        os.unlink(target)
      if os.path.isdir(target) and os.listdir(target):
        if not overwrite:
          raise WorkdirError(f"cannot write {target}: it is a directory that is not empty")
        old = tempfile.mkdtemp(dir=parent, prefix=f"{STAGING_PREFIX}old.")
        os.rename(target, os.path.join(old, "old"))
        os.rename(staging, target)
        shutil.rmtree(old, ignore_errors=True)
      else:
        os.replace(staging, target)  # Onto nothing, or an empty directory.
    except WorkdirError as error:  # A file inside: named where it was going, not the staging.
      _remove(staging)
      raise WorkdirError(str(error).replace(staging, target)) from error.__cause__
    except BaseException:
      _remove(staging)
      raise


def remove_staging(directory: epath.PathLike) -> None:
  """Removes what an interrupted write staged in ``directory`` (``STAGING_PREFIX`` names)."""
  directory = os.fspath(directory)
  if not is_local(directory) or not os.path.isdir(directory):
    return
  for name in os.listdir(directory):
    if name.startswith(STAGING_PREFIX):
      _remove(os.path.join(directory, name))


def check_writable(directory: str, flag: str) -> None:
  """``ValueError`` naming ``flag`` unless files can be written in ``directory``: it, or its
  nearest existing ancestor (nothing is created but a probe file, removed at once), must be a
  directory that takes a new file. Run before long work, so that it cannot end unable to write.
  A remote directory is not probed."""
  if not is_local(directory):
    return
  path = os.path.abspath(directory or ".")
  ancestor = path
  while not os.path.exists(ancestor) and os.path.dirname(ancestor) != ancestor:
    ancestor = os.path.dirname(ancestor)
  if not os.path.isdir(ancestor):
    raise ValueError(f"{flag} {directory!r} is not writable: {ancestor} is not a directory")
  try:
    fd, probe = tempfile.mkstemp(dir=ancestor, prefix=f"{STAGING_PREFIX}probe.")
  except OSError as error:
    raise ValueError(f"{flag} {directory!r} is not writable: {ancestor}: "
                     f"{reason_of(error)}") from None
  os.close(fd)
  os.unlink(probe)


def local_staging() -> tempfile.TemporaryDirectory:
  """The one place a remote (``gs://``) workdir's files are staged on this machine: a
  temporary directory in the system's (``TMPDIR``), removed when done."""
  return tempfile.TemporaryDirectory(prefix="stabledrl-staging-")


def _umask() -> int:
  mask = os.umask(0o022)
  os.umask(mask)
  return mask
