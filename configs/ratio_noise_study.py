r"""The ratio-noise study (experiments/ratio_noise_study.py) at quickstart scale.

  python experiments/ratio_noise_study.py --config configs/ratio_noise_study.py \
      --workdir runs/ratio_noise_study

The quickstart's tiny model, task and supervised start, 200 RL steps per run with greedy eval
every 20, the policy's KL from the start logged at every step (``diagnostics.kl_to_start``) and a
checkpoint every 20 steps (a cut run resumes). The script sets, per run, the objective with its
official loss and estimator, the mask coupling, mu (``train.num_iterations``) and the stress.
"""

import pathlib

from stabledrl_jax.training.config import config_lib


def get_config():
  c = config_lib.from_file(pathlib.Path(__file__).with_name("quickstart.py"))
  # Each objective with its official estimator (the quickstart pins StableDRL's).
  c.estimator.update(method="", num_samples=None)
  c.objective.stabledrl.surrogate = "sandwich"
  c.train.num_steps = 200
  c.eval.every_steps = 20
  c.checkpoint.update(every_steps=20, max_to_keep=1)
  c.diagnostics.kl_to_start = True
  return c
