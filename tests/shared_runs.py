"""Results computed once per test run and shared by every xdist worker (``shared_start``)."""

import pathlib
import shutil
from typing import Callable

import filelock


def shared_start(tmp_path_factory, worker_id: str, name: str,
                 fit: Callable[[pathlib.Path], pathlib.Path]) -> pathlib.Path:
  """``fit(workdir) -> start`` run once per test run (every xdist worker gets its result).

  The result is written to a scratch directory and renamed into place, so a worker never reads
  a half-written start; a failed fit leaves nothing behind and the next worker tries again.
  """
  root = tmp_path_factory.getbasetemp()
  if worker_id != "master":  # xdist: the workers' base directories share this parent.
    root = root.parent
  target = root / f"shared_{name}"
  with filelock.FileLock(str(root / f"shared_{name}.lock")):
    if not target.exists():
      scratch = root / f"shared_{name}.partial"
      shutil.rmtree(scratch, ignore_errors=True)
      start = fit(scratch)
      scratch.rename(target)
      (root / f"shared_{name}.path").write_text(str(start.relative_to(scratch)))
  return target / (root / f"shared_{name}.path").read_text()
