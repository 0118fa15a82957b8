r"""The KV-cache table of the sampler at the paper's decoding shape, on a trained `small` model.

    python experiments/paper_shape_sampler.py --model_dir runs/paper_shape_small \
        [--fit_steps 400] [--fit_more 300] [--batch 4] [--repeats 1]

Threshold decoding gains only where the model is confident, which a random model never is
(it reveals one token per call). The CPU machine cannot train a real reasoning model of the
paper's shape, so this script fits the `small` config (23M parameters) on a stand-in with the
shape of a reasoning rollout: a 4x4 sudoku written out as a grid in a prompt of about 180
characters (left-padded to 192), answered by a worked solution, one line per blank cell
("r2c3: row 14 col 2 box 1 -> 3": the givens of its row, column and box, then the digit), the
grid in <answer> tags and EOS padding to 256 tokens. With 4 to 6 blanks the text fills 160 to 230
of the 256 positions. The lines' layout is fully predictable once learned, the givens are copied
from the prompt and the digits must be deduced: a mix of confident and uncertain tokens like a
real solution's.

The fitted model is cached in ``--model_dir`` (a Hugging Face directory; delete it to refit:
about 7 s per step of 16 sequences on 2 CPU cores; ``--fit_more N`` fits it N steps further).
Then the table of
``benchmark_sampler.py --mode caches`` on ``--batch`` held-out puzzles: 256 tokens in 128 steps,
blocks of 32, T = 0.9, each cache with the low_confidence schedule and with threshold decoding,
and the sudoku metric (blank cells filled right) per setting. docs/performance.md ("KV-cached
rollouts") has the measured tables.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import benchmark_sampler
from stabledrl_jax import models, tasks, tokenizers
from stabledrl_jax.models.llada.sampler import CACHES
from stabledrl_jax.training.state import supervised

PROMPT_LENGTH, GEN_LENGTH, STEPS, BLOCK_LENGTH = 192, 256, 128, 32
HEADER = ("Fill each 0 of this 4x4 sudoku with 1-4 so every row, column and 2x2 box holds "
          "1-4 once. Work cell by cell, then answer.\n")


def prompt_text(puzzle: str) -> str:
  """The puzzle as four rows under the instruction (about 180 characters)."""
  rows = [" ".join(puzzle[4 * r:4 * r + 4]) for r in range(4)]
  return HEADER + "".join(f"row {r + 1}: {row}\n" for r, row in enumerate(rows))


def worked_solution(puzzle: str, solution: str) -> str:
  """One line per blank (row-major): the givens of its row, column and box, then its digit;
  then the solved grid in <answer> tags."""
  lines = []
  for cell, digit in enumerate(puzzle):
    if digit != "0":
      continue
    r, c = divmod(cell, 4)
    row = [puzzle[4 * r + j] for j in range(4)]
    col = [puzzle[4 * i + c] for i in range(4)]
    box = [puzzle[4 * i + j] for i in range(r - r % 2, r - r % 2 + 2)
           for j in range(c - c % 2, c - c % 2 + 2)]
    givens = ["".join(sorted(d for d in group if d != "0")) or "-" for group in (row, col, box)]
    lines.append(f"r{r + 1}c{c + 1}: row {givens[0]} col {givens[1]} box {givens[2]} -> "
                 f"{solution[cell]}\n")
  return "".join(lines) + f"<answer>{solution}</answer>"


def encode(tokenizer, examples) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Prompt tokens [B, 192] (left-padded) with their mask, and completions [B, 256]."""
  puzzles = [tasks.sudoku.puzzle_of(example) for example in examples]
  prompts, prompt_mask = tokenizer.encode_batch([prompt_text(p) for p in puzzles],
                                                length=PROMPT_LENGTH, padding_side="left")
  completions = np.full((len(examples), GEN_LENGTH), tokenizer.eos_id, np.int32)
  for row, (puzzle, example) in enumerate(zip(puzzles, examples)):
    ids = tokenizer.encode(worked_solution(puzzle, example.reference))
    completions[row, :len(ids)] = ids
  return prompts, prompt_mask, completions


def fit_model(args, tokenizer) -> nnx.Module:
  """`small` fitted on the worked solutions (supervised masked diffusion), cached on disk."""
  steps, seed = args.fit_steps, args.seed
  if os.path.exists(os.path.join(args.model_dir, "config.json")):
    print(f"loading the fitted model from {args.model_dir}")
    model = models.from_pretrained(args.model_dir)
    if not args.fit_more:
      return model
    steps, seed = args.fit_more, args.seed + 1  # New batches, not the first fit's again.
  else:
    model = models.LLaDA(models.get_config("small"), rngs=nnx.Rngs(args.seed))
  config = model.config
  train = tasks.SudokuGenerator(args.fit_steps * args.fit_batch, seed=args.seed,
                                blanks_range=(4, 6))
  rng = np.random.default_rng(seed)

  def sample_batch(step):
    del step
    examples = [train[int(i)] for i in rng.integers(len(train), size=args.fit_batch)]
    prompts, prompt_mask, completions = encode(tokenizer, examples)
    answered = np.ones_like(completions, bool)
    return (np.concatenate([prompts, completions], axis=1),
            np.concatenate([prompt_mask, ~answered], axis=1),  # prompt mask [B, 448]
            np.concatenate([np.zeros_like(prompt_mask), answered], axis=1))  # completion mask

  start = time.perf_counter()
  supervised.fit(model, sample_batch, num_steps=steps, learning_rate=args.learning_rate,
                 seed=seed, mask_id=config.mask_token_id, log_every=20,
                 log=lambda step, m: print(f"step {step}: loss {m['sft/loss']:.4f} "
                                           f"({m['sft/elapsed_s']:.0f} s)", flush=True))
  print(f"fitted in {time.perf_counter() - start:.0f} s; writing {args.model_dir}")
  models.save_pretrained(model, args.model_dir)
  return model


def cell_accuracy(tokenizer, tokens: np.ndarray, examples) -> float:
  """The sudoku metric in percent (blank cells filled right, pooled) of completions [B, 256]."""
  task = tasks.get_task("sudoku")
  # The model's vocabulary is larger than the characters': an id past them reads as unknown.
  tokens = np.where(np.asarray(tokens) >= tokenizer.vocab_size, tokenizer.unk_id, tokens)
  scores = [task.score(text, ex) for text, ex in zip(tokenizer.decode_batch(tokens), examples)]
  return 100.0 * sum(s.correct for s in scores) / sum(s.total for s in scores)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model_dir", default="runs/paper_shape_small")
  parser.add_argument("--fit_steps", type=int, default=400)
  parser.add_argument("--fit_batch", type=int, default=16)
  parser.add_argument("--fit_more", type=int, default=0,
                      help="fit the model in --model_dir for this many more steps (a new "
                           "warm-up and cosine decay) and overwrite it")
  parser.add_argument("--learning_rate", type=float, default=1e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=1)
  parser.add_argument("--temperature", type=float, default=0.9)
  parser.add_argument("--threshold", type=float, default=0.9)
  args = parser.parse_args()

  tokenizer = tokenizers.CharTokenizer()
  model = fit_model(args, tokenizer)
  examples = [tasks.SudokuGenerator(args.batch, seed=args.seed, split="test",
                                    blanks_range=(4, 6))[i] for i in range(args.batch)]
  prompts, prompt_mask, _ = encode(tokenizer, examples)
  print(f"small ({models.count_params(model.config) / 1e6:.1f}M params), batch {args.batch}, "
        f"prompt {PROMPT_LENGTH}, {GEN_LENGTH} tokens in {STEPS} steps, blocks of "
        f"{BLOCK_LENGTH}, T = {args.temperature}, tau = {args.threshold}, "
        f"backend={jax.default_backend()}")
  shape = argparse.Namespace(gen_length=GEN_LENGTH, steps=STEPS, block_length=BLOCK_LENGTH,
                             temperature=args.temperature, threshold=args.threshold,
                             batch=args.batch, prompt_length=PROMPT_LENGTH, repeats=args.repeats)
  outputs = benchmark_sampler.cache_table(model, jnp.asarray(prompts), jax.random.key(2), shape,
                                          jnp.asarray(prompt_mask))
  print()
  print("| cache | remasking | blanks right % |")
  print("|---|---|---:|")
  settings = [(c, r) for r in ("low_confidence", "threshold") for c in CACHES]
  for (cache, remasking), output in zip(settings, outputs):
    completion = np.asarray(output[0])[:, PROMPT_LENGTH:]
    print(f"| {cache} | {remasking} | {cell_accuracy(tokenizer, completion, examples):.1f} |")


if __name__ == "__main__":
  main()
