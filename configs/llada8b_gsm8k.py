"""StableDRL on LLaDA-8B-Instruct, gsm8k: the paper's setting (docs/training.md, "Configs").

  python -m stabledrl_jax.train --config llada8b_gsm8k --workdir runs/llada8b_gsm8k

The model and tokenizer come from the Hub by id (config_lib); pass a local directory with
--config.model.checkpoint=DIR --config.tokenizer.path=DIR to use one.
"""

from stabledrl_jax.training.config import config_lib


def get_config():
  c = config_lib.llada8b_config("gsm8k", learning_rate=2e-6)
  return c
