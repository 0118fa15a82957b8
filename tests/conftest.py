"""Fixtures shared by the test files: supervised starts fitted once per run.

A supervised start takes tens of seconds to fit; the tests that train from one only copy it.
``shared_start`` fits it once for the whole run, whichever xdist worker asks first (the others
wait on a file lock and read it), under the run's shared temporary directory.
"""

import pathlib
import shutil
from typing import Callable

import filelock
import pytest


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


@pytest.fixture(scope="session")
def sft_start(tmp_path_factory, worker_id):
  """The tiny supervised start of ``test_training.tiny_config`` (copy it into a workdir with
  ``test_training.workdir_with_start``; never write into it)."""
  from test_training import tiny_config  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training import trainer  # pylint: disable=g-import-not-at-top

  def fit(workdir):
    trainer.train(tiny_config(**{"train.num_steps": 0}), str(workdir))
    return workdir / trainer.SFT_DIR

  return shared_start(tmp_path_factory, worker_id, "sft", fit)


@pytest.fixture(scope="session")
def sdar_start(tmp_path_factory, worker_id):
  """The tiny SDAR supervised start of ``test_sdar_training.sdar_config``."""
  from test_sdar_training import sdar_config  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training import trainer  # pylint: disable=g-import-not-at-top

  def fit(workdir):
    trainer.train(sdar_config(**{"train.num_steps": 0}), str(workdir))
    return workdir / trainer.SFT_DIR

  return shared_start(tmp_path_factory, worker_id, "sdar_sft", fit)
