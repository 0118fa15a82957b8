"""StableDRL on LLaDA-8B-Instruct, countdown: the paper's setting (docs/training.md, "Configs").

  python -m stabledrl_jax.train --config llada8b_countdown --workdir runs/llada8b_countdown

The model and tokenizer come from the Hub by id (config_lib); pass a local directory with
--config.model.checkpoint=DIR --config.tokenizer.path=DIR to use one.
"""

from stabledrl_jax.training.config import config_lib


def get_config():
  c = config_lib.llada8b_config("countdown", learning_rate=1e-6)
  # The official StableDRL config trains on d1's 256-task test set, the file it evaluates on
  # (packaged). --config.data.train=synthetic --config.data.train_size=100000 trains on seeded,
  # solvable CD3 tasks instead.
  c.data.train = "countdown_cd3_test.jsonl"
  c.data.eval = "countdown_cd3_test.jsonl"
  return c
