"""The CPU quickstart with LoRA: the same supervised start, then StableDRL trains rank-8 adapters.

  python -m stabledrl_jax.train --config configs/quickstart_lora.py --workdir runs/quickstart_lora

Every projection of the tiny LLaDA gets an adapter (its seven module names; "ff_out" also
selects the output head, as PEFT's rule does), the base is frozen in bfloat16, and only the
adapters and their optimizer moments train (docs/training.md, "LoRA"). LoRA's smaller update
takes a larger learning rate than the full-parameter quickstart's (experiments/quickstart_seeds.py
measures both). ``python -m stabledrl_jax.export`` then writes a PEFT adapter on
``<workdir>/sft_model``.
"""

import pathlib

from stabledrl_jax.training.config import config_lib


def get_config():
  c = config_lib.from_file(pathlib.Path(__file__).with_name("quickstart.py"))
  c.model.lora.update(rank=8, alpha=16.0,
                      targets="q_proj,k_proj,v_proj,attn_out,ff_proj,up_proj,ff_out")
  c.optimizer.learning_rate = 1e-3
  return c
