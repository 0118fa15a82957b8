"""StableDRL on SDAR-8B-Chat (block diffusion), math500: the paper's setting (docs/training.md, "Configs").

  python -m stabledrl_jax.train --config configs/sdar8b_math.py --workdir runs/sdar8b_math \\
    --config.model.checkpoint=/path/to/SDAR-8B-Chat \\
    --config.tokenizer.path=/path/to/SDAR-8B-Chat/tokenizer.json

Rollouts decode 4-token blocks with a KV cache; likelihoods are block ELBOs, every block
scored in one staircase pass (docs/block_diffusion.md).
"""

from stabledrl_jax.training import config_lib


def get_config():
  c = config_lib.sdar8b_config("math500", learning_rate=2e-6)
  return c
