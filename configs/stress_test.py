r"""Stress test (docs/stress_test.md) at quickstart scale: every objective, normal and stressed.

  python experiments/stress_test.py --config configs/stress_test.py --workdir runs/stress_test

The tiny model and synthetic 4x4 sudoku of ``configs/quickstart.py``, with smaller RL steps so
that 6 objectives x 2 conditions fit in minutes on 2 CPU cores. ``experiments/stress_test.py``
sets the objective and ``estimator.stress.fraction`` per run.

The ratio is coupled (l_old scored on the update's own masks), so that in the normal condition
log rho measures the policy change alone and every explosion under stress comes from the stress
masks. With independent masks (``--config.estimator.coupled_ratio=False``, the official code's
choice) the sum-form ELBO's noise alone already drives sequence-level GRPO's ratio to 10^21.
"""

import pathlib

from stabledrl_jax.training import config_lib


def get_config():
  c = config_lib.from_file(pathlib.Path(__file__).with_name("quickstart.py"))
  # Each objective with its official estimator (the quickstart pins StableDRL's).
  c.estimator.update(method="", num_samples=None)
  c.objective.stabledrl.surrogate = "sandwich"
  c.rollout.update(num_prompts=8, group_size=8, steps=20)
  c.train.update(num_steps=20, num_iterations=2)
  c.optimizer.update(grad_clip=1.0)
  c.eval.update(every_steps=0)
  c.checkpoint.update(every_steps=1000, max_to_keep=1)  # Only the last step.
  c.sft.update(num_steps=600)
  c.estimator.coupled_ratio = True
  # t_min = 0.1 (the last 4 of 40 completion tokens), t_max = 1.0 (all of them).
  c.estimator.stress.update(fraction=0.0, easy_rate=0.1, hard_rate=1.0)
  return c
