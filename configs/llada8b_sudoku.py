"""StableDRL on LLaDA-8B-Instruct, sudoku: the paper's setting (SPEC section 8).

  python -m stabledrl_jax.train --config configs/llada8b_sudoku.py --workdir runs/llada8b_sudoku \\
    --config.model.checkpoint=/path/to/LLaDA-8B-Instruct \\
    --config.tokenizer.path=/path/to/LLaDA-8B-Instruct/tokenizer.json
"""

from stabledrl_jax.training import config_lib


def get_config():
  c = config_lib.llada8b_config("sudoku", learning_rate=1e-6)
  c.data.train = "synthetic"  # seeded, uniquely solvable puzzles disjoint from the test split
  c.data.train_size = 100_000
  c.data.eval = "../shared/data/4x4_test_sudoku.csv"  # the d1 test set
  return c
