r"""Objective comparison (experiments/compare_objectives.py) at quickstart scale.

  python experiments/compare_objectives.py --config configs/compare_objectives.py \
      --workdir runs/compare --seeds 0,1,2,3,4

The quickstart's tiny model, task and supervised start, with 60 RL steps per objective (greedy
eval every 20). ``experiments/compare_objectives.py`` sets the objective and its estimator (its
``rows()``: no prompt masking, SPG and StableDRL also as published) and the seed.
"""

import pathlib

from stabledrl_jax.training.config import config_lib


def get_config():
  c = config_lib.from_file(pathlib.Path(__file__).with_name("quickstart.py"))
  # Each objective with its official estimator (the quickstart pins StableDRL's).
  c.estimator.update(method="", num_samples=None)
  c.objective.stabledrl.surrogate = "sandwich"
  c.train.num_steps = 60
  c.eval.every_steps = 20
  c.checkpoint.update(every_steps=1000, max_to_keep=1)  # Only the last step.
  return c
