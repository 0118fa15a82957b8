r"""Entry point: ``python -m stabledrl_jax.train --config quickstart --workdir runs/qs``.

``--config`` takes a shipped config's name (``quickstart``, ``llada8b_gsm8k``, ...:
``config_lib.config_names()``) or a path to a ``get_config()`` file (``configs/quickstart.py``).
Installed, ``stabledrl-train`` is the same command.

Override any field with ``--config.a.b=value`` (e.g. ``--config.objective.name=grpo``).
Rerunning with the same ``--workdir`` (a local directory or ``gs://...``) resumes from its
latest checkpoint.

Several processes (docs/pods.md): on a TPU pod slice, under Slurm or Open MPI, run the same
command on every host and the processes find each other. Elsewhere add ``--coordinator_address
HOST:PORT --num_processes N --process_id I``. SIGTERM saves a checkpoint at the next step
boundary and exits 0 (within ``train.stop_grace_s``, else it exits 143 at once, keeping the last
checkpoint); Ctrl-C does the same, and a second Ctrl-C exits 130 at once (also once the run
has stopped, while it finishes its saves and exits). An empty or non-UTF-8 ``--workdir`` is
refused before anything is written.
"""

import logging as std_logging
import os
import signal
import sys

from absl import app, flags, logging

from stabledrl_jax import cli_flags, libtpu_env, path_args
from stabledrl_jax.training.parallel import multihost

_CONFIG = cli_flags.CONFIG
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics "
                               "(local or gs://), shared by all processes.")
multihost.define_flags()
flags.mark_flags_as_required(["config", "workdir"])


_VERBOSE = cli_flags.VERBOSE


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO.
  try:  # Before anything is written (an empty --workdir would be the current directory).
    path_args.check(_WORKDIR.value, "--workdir")
  except ValueError as error:
    if _VERBOSE.value:
      raise
    sys.exit(f"error: {error}")
  libtpu_env.log_into(_WORKDIR.value)  # Before any backend starts.
  try:
    multihost.initialize_from_flags()
    from stabledrl_jax.training.loop import trainer  # pylint: disable=g-import-not-at-top
    trainer.train(_CONFIG.value, _WORKDIR.value, hard_stop=True)
  except KeyboardInterrupt:
    # A second Ctrl-C (the trainer has released the workdir): exit now, skipping the
    # interpreter's teardown, which would free XLA's client under a compilation still running on
    # XLA's threads (a segmentation fault; docs/reliability.md).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signal.SIGINT)
  except (ValueError, FileNotFoundError, NotImplementedError, ImportError, RuntimeError) as error:
    if _VERBOSE.value:
      raise
    quiet_after_error()
    sys.exit(f"error: {error} (--verbose shows the traceback)")


def quiet_after_error() -> None:
  """Once the error is said in one line, asyncio says nothing more. A save in flight when the
  run failed (the disk full under metrics.jsonl) fails too, inside orbax's event loop; asyncio
  logs that future's exception (``Future exception was never retrieved``, the same failure in 20
  lines) when it is collected, at exit. ``--verbose`` keeps it."""
  std_logging.getLogger("asyncio").disabled = True


def run() -> None:
  """The console script: ``--config NAME`` resolved to the shipped file, then absl.

  Outside the trainer's own handling of signals (validation, the gaps of the build, the
  teardown after a stop), a Ctrl-C ends the process at once with status 130
  (``preemption.CommandLineInterrupts``): never a KeyboardInterrupt traceback from an atexit
  callback, nor exit status 0."""
  from stabledrl_jax.training.loop import preemption  # pylint: disable=g-import-not-at-top
  preemption.CommandLineInterrupts()
  app.run(main, argv=cli_flags.resolve_argv(sys.argv))


if __name__ == "__main__":
  run()
