"""StableDRL on LLaDA-8B-Instruct, math500: the paper's setting (docs/training.md, "Configs").

  python -m stabledrl_jax.train --config configs/llada8b_math.py --workdir runs/llada8b_math \\
    --config.model.checkpoint=/path/to/LLaDA-8B-Instruct \\
    --config.tokenizer.path=/path/to/LLaDA-8B-Instruct/tokenizer.json
"""

from stabledrl_jax.training import config_lib


def get_config():
  c = config_lib.llada8b_config("math500", learning_rate=2e-6)
  return c
