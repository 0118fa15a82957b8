"""CPU quickstart with block diffusion: a tiny SDAR model learns 4x4 sudoku, then StableDRL.

  python -m stabledrl_jax.train --config configs/sdar_tiny_quickstart.py --workdir runs/sdar_qs

The task, data, imperfect demonstrator, RL and evaluation settings of ``configs/quickstart.py``;
the model is a tiny SDAR (Qwen3 architecture, block diffusion) of the same width and depth, with
blocks of 8 positions: the left-padded 32-token prompt fills 4 blocks and the 40-token
completion 5, each decoded in 4 steps (20 in all, as the quickstart) with a KV cache of the
finished blocks. The supervised start is SDAR's block-diffusion loss (random positions masked in
every block, each block conditioned on the clean ones before it); the RL likelihoods are block
ELBOs, every block scored in one staircase pass.
"""

import pathlib

import ml_collections

from stabledrl_jax.training.config import config_lib


def get_config():
  c = config_lib.from_file(pathlib.Path(__file__).with_name("quickstart.py"))
  c.model.family = "sdar"
  c.model.name = "tiny"
  # SDARConfig names; listed so that --config.model.overrides.<field>=... can change them.
  c.model.overrides = ml_collections.ConfigDict(dict(
      hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
      num_hidden_layers=2, intermediate_size=128, block_size=8))
  # prompt_length and gen_length are multiples of the block size (blocks are fixed by absolute
  # position); rollout.block_length is LLaDA's and only recorded here.
  c.rollout.update(prompt_length=32, gen_length=40, steps=20, block_length=8,
                   remasking="low_confidence")
  c.sft.num_steps = 400  # The setting of its measured run (docs/block_diffusion.md).
  c.eval.every_steps = 10
  return c
