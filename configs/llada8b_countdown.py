"""StableDRL on LLaDA-8B-Instruct, countdown: the paper's setting (SPEC section 8).

  python -m stabledrl_jax.train --config configs/llada8b_countdown.py --workdir runs/llada8b_countdown \\
    --config.model.checkpoint=/path/to/LLaDA-8B-Instruct \\
    --config.tokenizer.path=/path/to/LLaDA-8B-Instruct/tokenizer.json
"""

from stabledrl_jax.training import config_lib


def get_config():
  c = config_lib.llada8b_config("countdown", learning_rate=1e-6)
  c.data.train = "synthetic"  # seeded, solvable CD3 tasks; or a local JSONL of your own
  c.data.train_size = 100_000
  c.data.eval = "../shared/data/countdown_cd3_test.jsonl"  # the d1 test set
  return c
