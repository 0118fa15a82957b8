"""CPU quickstart: a tiny LLaDA-architecture model learns 4x4 sudoku, then StableDRL improves it.

  python -m stabledrl_jax.train --config configs/quickstart.py --workdir runs/quickstart

1. Supervised masked-diffusion fitting (cached in <workdir>/sft_model) on the demonstrations of
   an imperfect demonstrator: in 75% of them it writes the next digit in the first two blank
   cells (data.noisy_demonstration). The fitted model samples the right digits there often but
   decodes the wrong ones greedily: sampled answers are often right where greedy decoding is
   wrong, which is the gap RL can close.
2. StableDRL on the sudoku reward (fraction of blanks filled right); greedy eval/accuracy on 256
   held-out puzzles every 10 steps.

The completion is one short block (the 16-digit grid in <answer> tags), so the likelihoods use
random masks over the whole completion ('elbo') rather than the paper's 32-token blocks.
"""

from stabledrl_jax.training.config import config_lib


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
  c.data.generator.blanks_range = (3, 5)
  c.rollout.update(num_prompts=16, group_size=8, prompt_length=32, gen_length=40, steps=20,
                   block_length=40, temperature=1.0)
  c.objective.stabledrl.surrogate = "elbo"
  c.estimator.update(method="elbo", num_samples=2)
  c.optimizer.update(learning_rate=1e-4, grad_clip=1.0, weight_decay=0.0)
  c.train.update(num_steps=120, num_iterations=2)
  c.eval.update(every_steps=20, batch_size=128, steps=20)
  c.checkpoint.update(every_steps=10, max_to_keep=2)
  # 800 supervised steps: the cells the demonstrator gets right are fitted well, so that what RL
  # must fix is the demonstrator's error (with 400 the start varied more across seeds and RL
  # gained 5 to 18 points; experiments/quickstart_seeds.py).
  c.sft.update(num_steps=800, batch_size=64, learning_rate=2e-3, demo_error_rate=0.75,
               demo_error_cells=2)
  return c
