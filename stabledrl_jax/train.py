r"""Entry point: ``python -m stabledrl_jax.train --config configs/quickstart.py --workdir runs/qs``.

Override any field with ``--config.a.b=value`` (e.g. ``--config.objective.name=grpo``).
Rerunning with the same ``--workdir`` resumes from its latest checkpoint.
"""

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a get_config() file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO.
  # Imported here so that --help and flag errors do not pay for importing JAX.
  from stabledrl_jax.training import trainer
  trainer.train(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
