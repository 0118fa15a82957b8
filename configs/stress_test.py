r"""Stress test (docs/stress_test.md) at quickstart scale: every objective, normal and stressed.

  python experiments/stress_test.py --config configs/stress_test.py --workdir runs/stress_test

The tiny model and synthetic 4x4 sudoku of ``configs/quickstart.py``, with smaller RL steps so
that 7 objective variants x 4 conditions fit in well under an hour on 2 CPU cores.
``experiments/stress_test.py`` sets the objective, ``estimator.stress.fraction`` and the
coupling per run.

Each objective runs with its official mask coupling (``estimator.coupled_ratio`` unset:
StableDRL and SPG score l_old on masks of their own, independent of the update's, as their
official code does; GRPO and ESPO on the update's, as theirs), which for StableDRL is the ratio
noise it is built for; the script runs the coupled variant
(``coupled_ratio=True``: l_old on the update's own masks, so that log rho measures the policy
change alone) beside it, and a frozen-policy control. Greedy eval on the 256 held-out puzzles
before the first step and after the last resolves gains that the batches' reward spread hides.
"""

import pathlib

from stabledrl_jax.training.config import config_lib


def get_config():
  c = config_lib.from_file(pathlib.Path(__file__).with_name("quickstart.py"))
  # Each objective with its official estimator (the quickstart pins StableDRL's).
  c.estimator.update(method="", num_samples=None)
  c.objective.stabledrl.surrogate = "sandwich"
  c.rollout.update(num_prompts=8, group_size=8, steps=20)
  c.train.update(num_steps=20, num_iterations=2)
  c.optimizer.update(grad_clip=1.0)
  c.eval.update(every_steps=20)  # Before the first step and after the last.
  c.checkpoint.update(every_steps=1000, max_to_keep=1)  # Only the last step.
  c.sft.update(num_steps=600)
  # t_min = 0.1 (the last 4 of 40 completion tokens), t_max = 1.0 (all of them).
  c.estimator.stress.update(fraction=0.0, easy_rate=0.1, hard_rate=1.0)
  return c
