"""StableDRL on SDAR-8B-Chat (block diffusion), math500: the paper's setting (docs/training.md, "Configs").

  python -m stabledrl_jax.train --config sdar8b_math --workdir runs/sdar8b_math

The model and tokenizer come from the Hub by id (config_lib); pass a local directory with
--config.model.checkpoint=DIR --config.tokenizer.path=DIR to use one.

Rollouts decode 4-token blocks with a KV cache; likelihoods are block ELBOs, every block
scored in one staircase pass (docs/block_diffusion.md).
"""

from stabledrl_jax.training.config import config_lib


def get_config():
  c = config_lib.sdar8b_config("math500", learning_rate=2e-6)
  return c
