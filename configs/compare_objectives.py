r"""Objective comparison (experiments/compare_objectives.py) at quickstart scale.

  python experiments/compare_objectives.py --config configs/compare_objectives.py \
      --workdir runs/compare

The quickstart's tiny model, task and supervised start, with 60 RL steps per objective (greedy
eval every 20) so that 6 objectives x 3 seeds fit in well under an hour on 2 CPU cores.
``experiments/compare_objectives.py`` sets the objective (``sweep.objective_variants()``) and seed.
"""

import pathlib

from stabledrl_jax.training import config_lib


def get_config():
  c = config_lib.from_file(pathlib.Path(__file__).with_name("quickstart.py"))
  # Each objective with its official estimator (the quickstart pins StableDRL's).
  c.estimator.update(method="", num_samples=None)
  c.objective.stabledrl.surrogate = "sandwich"
  c.train.num_steps = 60
  c.eval.every_steps = 20
  c.checkpoint.update(every_steps=1000, max_to_keep=1)  # Only the last step.
  return c
