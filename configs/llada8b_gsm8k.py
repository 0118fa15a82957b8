"""StableDRL on LLaDA-8B-Instruct, gsm8k: the paper's setting (docs/training.md, "Configs").

  python -m stabledrl_jax.train --config configs/llada8b_gsm8k.py --workdir runs/llada8b_gsm8k \\
    --config.model.checkpoint=/path/to/LLaDA-8B-Instruct \\
    --config.tokenizer.path=/path/to/LLaDA-8B-Instruct/tokenizer.json
"""

from stabledrl_jax.training import config_lib


def get_config():
  c = config_lib.llada8b_config("gsm8k", learning_rate=2e-6)
  return c
