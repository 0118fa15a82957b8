"""ESPO on LLaDA-8B-Instruct with its official training recipe, in a matched-budget
comparison: LoRA r 128, alpha 64, dropout 0.05 on a frozen base, its learning rate, schedule and
mu (config_lib.BASELINE_RECIPES cites the files and lines), on the paper's shared rollouts,
batch, prompts, rewards and evaluation; not its published run (docs/training.md says what that
changes).

  python -m stabledrl_jax.train --config llada8b_espo:gsm8k --workdir runs/espo_gsm8k

The task after the colon: gsm8k (the default), math500, countdown or sudoku. --config.model.lora.rank=0
trains every parameter instead; docs/training.md, "LoRA", says what runs on which hardware.
"""

from stabledrl_jax.training.config import config_lib


def get_config(task: str = "gsm8k"):
  return config_lib.baseline_llada8b_config("espo", task)
