"""CPU quickstart: a tiny LLaDA-architecture model on synthetic 4x4 sudoku.

Supervised masked-diffusion fitting first (cached in <workdir>/sft_model), then StableDRL.

  python -m stabledrl_jax.train --config configs/quickstart.py --workdir runs/quickstart
"""

from stabledrl_jax.training import config_lib


def get_config():
  c = config_lib.base_config()
  c.seed = 0
  c.model.name = "tiny"
  # The tiny shapes, listed so that --config.model.overrides.<field>=... can change them.
  c.model.overrides.update(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=128)
  c.tokenizer.kind = "char"
  c.tokenizer.alphabet = " /0123456789:<>Sadeklnoprsuwz"
  c.task.name = "sudoku"
  c.data.train_size = 20_000
  c.data.eval_size = 256
  c.data.generator.blanks_range = (6, 10)
  c.rollout.update(num_prompts=16, group_size=8, prompt_length=32, gen_length=40, steps=20,
                   block_length=40, temperature=1.0)
  c.estimator.update(block_length=8, num_samples=2)
  c.optimizer.update(learning_rate=5e-5, grad_clip=1.0, weight_decay=0.0)
  c.train.update(num_steps=40, num_iterations=2)
  c.eval.update(every_steps=10, batch_size=128, steps=20)
  c.checkpoint.update(every_steps=10, max_to_keep=2)
  c.sft.update(num_steps=1500, batch_size=64, learning_rate=2e-3)
  return c
