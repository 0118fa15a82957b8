"""Fixtures shared by the test files: supervised starts fitted once per run.

A supervised start takes tens of seconds to fit; the tests that train from one only copy it.
``shared_runs.shared_start`` fits it once for the whole run, whichever xdist worker asks first
(the others wait on a file lock and read it), under the run's shared temporary directory.
"""

import pytest

from shared_runs import shared_start


@pytest.fixture(scope="session")
def sft_start(tmp_path_factory, worker_id):
  """The tiny supervised start of ``test_training.tiny_config`` (copy it into a workdir with
  ``test_training.workdir_with_start``; never write into it)."""
  from test_training import tiny_config  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.state import supervised  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.loop import trainer

  def fit(workdir):
    trainer.train(tiny_config(**{"train.num_steps": 0}), str(workdir))
    return workdir / supervised.SFT_DIR

  return shared_start(tmp_path_factory, worker_id, "sft", fit)


@pytest.fixture(scope="session")
def sdar_start(tmp_path_factory, worker_id):
  """The tiny SDAR supervised start of ``test_sdar_training.sdar_config``."""
  from test_sdar_training import sdar_config  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.state import supervised  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.loop import trainer

  def fit(workdir):
    trainer.train(sdar_config(**{"train.num_steps": 0}), str(workdir))
    return workdir / supervised.SFT_DIR

  return shared_start(tmp_path_factory, worker_id, "sdar_sft", fit)
