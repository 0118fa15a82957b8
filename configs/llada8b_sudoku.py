"""StableDRL on LLaDA-8B-Instruct, sudoku: the paper's setting (docs/training.md, "Configs").

  python -m stabledrl_jax.train --config llada8b_sudoku --workdir runs/llada8b_sudoku

The model and tokenizer come from the Hub by id (config_lib); pass a local directory with
--config.model.checkpoint=DIR --config.tokenizer.path=DIR to use one.
"""

from stabledrl_jax.training.config import config_lib


def get_config():
  c = config_lib.llada8b_config("sudoku", learning_rate=1e-6)
  # The official config trains on d1's dataset/4x4_sudoku_unique_puzzles.csv, a large file that
  # d1's repository lists but does not serve to every clone: seeded, uniquely solvable puzzles
  # disjoint from the test split stand in; --config.data.train=PATH/4x4_sudoku_unique_puzzles.csv
  # --config.data.train_size=0 trains on it (docs/algorithms.md, "Rewards").
  c.data.train = "synthetic"
  c.data.train_size = 100_000
  c.data.eval = "4x4_test_sudoku.csv"  # the d1 test set (packaged)
  return c
