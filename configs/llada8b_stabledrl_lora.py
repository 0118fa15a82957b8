"""StableDRL on LLaDA-8B-Instruct with LoRA, for small hardware: NOT the paper's setting.

  python -m stabledrl_jax.train --config llada8b_stabledrl_lora:gsm8k --workdir runs/lora_gsm8k

StableDRL's official code trains every parameter (llada8b_<task>.py); this is its paper setting
with the baselines' adapters instead (rank 128, alpha 64, dropout 0.05 on q, k, v and up_proj,
the base frozen in bfloat16) and their LoRA learning rate, 3e-6 (config_lib.BASELINE_RECIPES),
so that LLaDA-8B trains where full-parameter training does not fit (docs/training.md, "LoRA").
The task after the colon: gsm8k (the default), math500, countdown or sudoku.
"""

from stabledrl_jax.training.config import config_lib


def get_config(task: str = "gsm8k"):
  recipe = config_lib.BASELINE_RECIPES["grpo"]
  c = config_lib.llada8b_config(task, learning_rate=recipe["learning_rate"])
  c.model.lora.update(recipe["lora"], base_dtype="bfloat16")
  return c
