"""StableDRL on LLaDA-8B-Instruct, sudoku: the paper's setting (docs/training.md, "Configs").

  python -m stabledrl_jax.train --config llada8b_sudoku --workdir runs/llada8b_sudoku

The model and tokenizer come from the Hub by id (config_lib); pass a local directory with
--config.model.checkpoint=DIR --config.tokenizer.path=DIR to use one.
"""

from stabledrl_jax.training import config_lib


def get_config():
  c = config_lib.llada8b_config("sudoku", learning_rate=1e-6)
  # The official config trains on d1's 4x4_sudoku_unique_puzzles.csv, which d1 does not
  # publish in its repository; seeded, uniquely solvable puzzles disjoint from the test split
  # stand in (or --config.data.train=YOUR.csv).
  c.data.train = "synthetic"
  c.data.train_size = 100_000
  c.data.eval = "4x4_test_sudoku.csv"  # the d1 test set (packaged)
  return c
