r"""The ratio-noise study over seeds, at the official group size 16 (docs/ratio_noise_study.md).

  python experiments/ratio_noise_study.py --config configs/ratio_noise_seeds.py \
      --workdir runs/ratio_noise_seeds --seeds 0,1,2 \
      --rows stabledrl_oneblock,stabledrl_centred,espo,spg_oneblock,stabledrl_fitted,stabledrl

configs/ratio_noise_study.py with groups of 16 samples, the paper setting's group size
(docs/training.md, "Configs"), and 8 prompts a step, so that a step still scores 128 samples;
100 RL steps (every collapse of the one-seed study but two came by step 100), with greedy eval
and a checkpoint every 10.
"""

import pathlib

from stabledrl_jax.training.config import config_lib


def get_config():
  c = config_lib.from_file(pathlib.Path(__file__).with_name("ratio_noise_study.py"))
  c.rollout.update(num_prompts=8, group_size=16)
  c.train.num_steps = 100
  c.eval.every_steps = 10
  c.checkpoint.every_steps = 10
  return c
