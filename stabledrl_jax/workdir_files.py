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

And the one way a file of the workdir or of an input (a checkpoint, an adapter, a tokenizer, a
data file) is read: only once it is known to be a regular file (``open_regular``,
``read_text``, ``read_bytes``; ``regular_file`` where a library opens it by name; ``check_tree``
for a directory a library reads whole, an orbax step). A FIFO, a device, a socket or a
directory, or a link to one, is one line in the caller's error type, "<what> <path>: a FIFO,
not a regular file", and is never opened: opening a FIFO waits for a writer for good.

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

from stabledrl_jax import input_files  # Standard library only.

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
      if os.path.exists(path) and not os.path.isdir(path):  # Its kind named: "a FIFO is ...".
        kind = input_files.kind_of(os.stat(path).st_mode).replace("a regular file", "a file")
        raise WorkdirError(f"cannot write {path}: {kind} is in the way of a directory")
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
  """A text file open for appending to ``path``, which must be a regular file or absent (it is
  opened with ``O_NOFOLLOW`` and ``O_NONBLOCK``: a link planted since is refused, not followed,
  and a FIFO planted since never blocks the open; ``open_regular``)."""
  path = os.fspath(path)
  with writing(path):
    return open_regular(path, "a", what="cannot write", follow_links=False)


def _remove(path: str) -> None:
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path, ignore_errors=True)
  else:
    with contextlib.suppress(OSError):
      os.unlink(path)


def remove(path: epath.PathLike) -> None:
  """Removes ``path``, whatever it is: a directory with its contents, else the entry itself (a
  file, a link, a FIFO; never what a link points to). ``shutil.rmtree`` (and ``epath``'s
  ``rmtree``) opens its argument first, and opening a FIFO waits for a writer for good."""
  if is_local(path):
    _remove(os.fspath(path))
    return
  remote = epath.Path(path)
  if remote.is_dir():
    remote.rmtree()
  elif remote.exists():
    remote.unlink()


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


# ---------------------------------------------------------------------------
# Reading: a file of the workdir or of an input is opened only once it is known to be a regular
# file. Opening a FIFO waits for a writer forever (a hang that only SIGKILL ends), a device
# reads without end (/dev/zero) and a directory fails deep in a library with a traceback.
# ---------------------------------------------------------------------------


def _link_note(path: str) -> str:
  """' (a symbolic link to TARGET)' when ``path`` is a link, else ''."""
  try:
    return f" (a symbolic link to {os.readlink(path)})" if os.path.islink(path) else ""
  except OSError:
    return ""


def problem(path: epath.PathLike, *, follow_links: bool = True,
            missing_ok: bool = False) -> str | None:
  """Why ``path`` cannot be opened as a regular file, in words, or None if it can (``os.stat``
  alone: nothing is opened).

  The reasons: "does not exist" (a dangling link: "does not exist (a symbolic link to T)"),
  "<what it is>, not a regular file" ("a FIFO", "a directory", "a character device", "a block
  device", "a socket"; through a link: "a FIFO, not a regular file (a symbolic link to T)"),
  "a symbolic link (to T), which is not followed" (``follow_links=False``), "cannot be read
  (<why>)". ``missing_ok``: a path that does not exist (a dangling link, when links are
  followed) is fine: there is nothing to read.
  """
  path = os.fspath(path)
  try:
    info = os.stat(path) if follow_links else os.lstat(path)
  except FileNotFoundError:
    if missing_ok:
      return None
    return "does not exist" + _link_note(path)
  except OSError as error:
    return f"cannot be read ({reason_of(error)})"
  if stat.S_ISLNK(info.st_mode):
    return f"a symbolic link (to {os.readlink(path)}), which is not followed"
  if not stat.S_ISREG(info.st_mode):
    return f"{input_files.kind_of(info.st_mode)}, not a regular file" + _link_note(path)
  return None


def _refuse(path: str, what: str, reason: str, error: type[Exception]) -> Exception:
  return error(f"{what} {path}: {reason}" if what else f"{path}: {reason}")


def regular_file(path: epath.PathLike, what: str = "", *,
                 error: type[Exception] = WorkdirError, follow_links: bool = True) -> str:
  """``path``, if it is a regular file (links followed, unless ``follow_links=False``); else
  ``error`` (one line): "<what> <path>: <problem>", e.g. "adapter weights
  /ck/adapter_model.safetensors: a FIFO, not a regular file".

  For a library that opens the file by name (safetensors, orbax): nothing is opened here. Where
  the bytes are read here, ``open_regular`` also closes the window between the check and the
  open. A remote path (``gs://``) holds no FIFO or device: it is not checked.

  ``error``: the caller's error type, which its command line already reports in one line
  (``WorkdirError`` for the workdir's own files; ``input_files.InputError``,
  ``hf_io.CheckpointError``, ``tokenizers.TokenizerError`` or ``ValueError`` for what a run
  reads).
  """
  if is_local(path):
    reason = problem(path, follow_links=follow_links)
    if reason is not None:
      raise _refuse(os.fspath(path), what, reason, error)
  return os.fspath(path)


_MODES = {"r": os.O_RDONLY, "rb": os.O_RDONLY,
          "a": os.O_WRONLY | os.O_APPEND | os.O_CREAT, "ab": os.O_WRONLY | os.O_APPEND | os.O_CREAT}


def open_regular(path: epath.PathLike, mode: str = "r", *, what: str = "",
                 error: type[Exception] = WorkdirError, follow_links: bool = True,
                 missing_ok: bool = False, encoding: str = "utf-8", **options):
  """``path`` opened (``mode``: "r", "rb", "a" or "ab"), if it is a regular file; else
  ``error`` naming it (``regular_file``). None if ``missing_ok`` and there is nothing at
  ``path`` (nor at the end of a link); "a" creates a missing file.

  Checked with ``os.stat`` first, then opened with ``O_NONBLOCK`` (a FIFO put in its place
  since does not block the open) and ``O_NOFOLLOW`` unless ``follow_links``, and the open
  descriptor's ``fstat`` checked again before ``O_NONBLOCK`` is cleared: the file read is the
  regular file that was checked. ``options`` go to ``open`` (``newline``). A remote path is
  opened with ``etils.epath``.
  """
  if mode not in _MODES:
    raise ValueError(f"mode={mode!r} is not one of {sorted(_MODES)}")
  text = "b" not in mode
  if not is_local(path):
    remote = epath.Path(path)
    if missing_ok and not remote.exists():
      return None
    return remote.open(mode, **({"encoding": encoding} if text else {}), **options)
  path = os.fspath(path)
  writes = mode.startswith("a")
  reason = problem(path, follow_links=follow_links, missing_ok=missing_ok or writes)
  if reason is not None:
    raise _refuse(path, what, reason, error)
  flags = _MODES[mode] | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
  if not follow_links:
    flags |= getattr(os, "O_NOFOLLOW", 0)
  try:
    fd = os.open(path, flags, 0o666)
  except FileNotFoundError:
    if missing_ok:
      return None
    raise _refuse(path, what, "does not exist" + _link_note(path), error) from None
  except OSError as failure:
    if failure.errno == errno.ELOOP and not follow_links:
      raise _refuse(path, what, f"a symbolic link (to {os.readlink(path)}), which is not "
                    "followed", error) from None
    if writes:  # ``writing`` names the file and the cause (a full disk).
      raise
    raise _refuse(path, what, f"cannot be read ({failure.strerror or failure})", error) from None
  try:
    kind = os.fstat(fd).st_mode
    if not stat.S_ISREG(kind):
      raise _refuse(path, what, f"{input_files.kind_of(kind)}, not a regular file", error)
    os.set_blocking(fd, True)
    return os.fdopen(fd, mode, **({"encoding": encoding} if text else {}), **options)
  except BaseException:
    os.close(fd)
    raise


def read_text(path: epath.PathLike, what: str = "", *, error: type[Exception] = WorkdirError,
              follow_links: bool = True, missing_ok: bool = False) -> str | None:
  """The UTF-8 text of the regular file ``path`` (``open_regular``; None if ``missing_ok`` and
  it does not exist)."""
  file = open_regular(path, "r", what=what, error=error, follow_links=follow_links,
                      missing_ok=missing_ok)
  if file is None:
    return None
  with file:
    return file.read()


def read_bytes(path: epath.PathLike, what: str = "", *, error: type[Exception] = WorkdirError,
               follow_links: bool = True, missing_ok: bool = False) -> bytes | None:
  """The bytes of the regular file ``path`` (``open_regular``; None if ``missing_ok`` and it
  does not exist)."""
  file = open_regular(path, "rb", what=what, error=error, follow_links=follow_links,
                      missing_ok=missing_ok)
  if file is None:
    return None
  with file:
    return file.read()


def check_tree(directory: epath.PathLike, what: str = "", *,
               error: type[Exception] = WorkdirError) -> None:
  """``error`` naming the first entry under ``directory`` (all depths; ``os.scandir``, kinds
  only, nothing opened) that is neither a directory nor a regular file, links followed: a FIFO
  or a device, which a library that reads the whole tree (orbax, tensorstore) would open and
  wait on for good. A link to a directory is not descended into; a directory that does not
  exist holds nothing to open. A remote directory is not checked."""
  if not is_local(directory):
    return
  pending = [os.fspath(directory)]
  while pending:
    current = pending.pop()
    try:
      with os.scandir(current) as listing:
        entries = sorted(listing, key=lambda entry: entry.name)
    except FileNotFoundError:
      continue  # Gone: nothing there to open.
    except OSError as failure:
      raise _refuse(current, what, f"cannot be listed ({reason_of(failure)})", error) from None
    for entry in entries:
      if entry.is_dir(follow_symlinks=False):
        pending.append(entry.path)
        continue
      try:
        kind = entry.stat().st_mode  # Through a link: what a reader would open.
      except OSError:
        continue  # A dangling link fails where it is read, in words; it blocks nothing.
      if not (stat.S_ISREG(kind) or stat.S_ISDIR(kind)):
        raise _refuse(entry.path, what, f"{input_files.kind_of(kind)}, not a regular file"
                      + _link_note(entry.path), error)
