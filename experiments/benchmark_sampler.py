"""Tokens/s of the jitted diffusion sampler against a naive per-step Python loop.

    python experiments/benchmark_sampler.py                    # 'small' config, CPU, ~1-2 min
    python experiments/benchmark_sampler.py --temperature 0    # greedy; checks the outputs agree

Rows of the table:
  naive loop      LLaDA's reference generate() transcribed to numpy: a Python loop over the
                  steps that calls the jitted model once per step, pulls the full logits
                  [B, L, V] to the host and does the sampling step there.
  python loop     the same loop, but each step is one jitted call doing what a step of
                  `generate` does (logits of the current block only, sampling on device):
                  one dispatch and one host round trip per step.
  generate        models/llada/sampler.generate: one jitted function, lax loops over blocks
                  and steps, last transformer block and output projection on the current block only.

All three decode the same prompts with the same schedule; at temperature 0 their outputs must
agree exactly, which the script checks. Times are the best of `--repeats` runs, the methods taking
turns so that they see the same load; the first call (compilation) is reported separately.

`--mode caches` compares instead block-wise KV caching (`generate(..., cache=...)`, Fast-dLLM):
none (exact) / prefix / dual, each with the low_confidence schedule and with threshold decoding
(`--threshold`), at the paper's decoding shape:

    python experiments/benchmark_sampler.py --mode caches --prompt_length 192 --gen_length 256 \
        --steps 128 --block_length 32

With ``--workdir`` the model is a trained one (a training workdir's latest checkpoint, e.g. the
quickstart's) and the prompts its held-out ones, at its own rollout shape unless the shape flags
say otherwise: a trained model is confident where a random one is not, which is what threshold
decoding needs.

    python experiments/benchmark_sampler.py --mode caches --workdir runs/quickstart

It prints tokens/s, the speed-up over the exact low_confidence sampler, the model calls per
sequence and the model's matmul FLOPs per generated token (`models.llada.flops`: a block's first
call is a full pass that refreshes the cache, its later calls run the block (dual) or the
sequence from the block on (prefix)).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stabledrl_jax import models, profiling
from stabledrl_jax.models.llada import flops as flops_lib
from stabledrl_jax.models.llada.sampler import CACHES, generate
from stabledrl_jax.models.sampler_lib import categorical, num_transfer_tokens


def naive_generate(forward, prompt, *, mask_id, gen_length, steps, block_length, temperature,
                   rng):
  """The reference loop: jitted model per step, sampling in numpy on the host."""
  batch, prompt_len = prompt.shape
  x = np.full((batch, prompt_len + gen_length), mask_id, np.int32)
  x[:, :prompt_len] = prompt
  num_blocks = gen_length // block_length
  steps_per_block = steps // num_blocks
  for block in range(num_blocks):
    lo, hi = prompt_len + block * block_length, prompt_len + (block + 1) * block_length
    schedule = np.asarray(num_transfer_tokens((x[:, lo:hi] == mask_id).sum(1), steps_per_block))
    for i in range(steps_per_block):
      mask_index = x == mask_id
      logits = np.array(forward(x))                        # host sync: [B, L, V]
      logits[..., mask_id] = -np.inf
      if temperature > 0:
        gumbel = -np.log(-np.log(rng.uniform(1e-20, 1.0, logits.shape)))
        x0 = np.argmax(logits + temperature * gumbel, axis=-1)
      else:
        x0 = np.argmax(logits, axis=-1)
      z = np.exp(logits - logits.max(-1, keepdims=True))
      p = np.take_along_axis(z, x0[..., None], -1)[..., 0] / z.sum(-1)
      p[:, hi:] = -np.inf
      confidence = np.where(mask_index, p, -np.inf)
      for j in range(batch):
        chosen = np.argsort(-confidence[j], kind="stable")[:schedule[j, i]]
        x[j, chosen] = x0[j, chosen]
  return x


def python_loop_generate(step_fn, prompt, *, mask_id, gen_length, steps, block_length, key):
  """A host loop over steps, each step one jitted call (model and update on device)."""
  batch, prompt_len = prompt.shape
  x = jnp.concatenate([prompt, jnp.full((batch, gen_length), mask_id, jnp.int32)], axis=1)
  num_blocks = gen_length // block_length
  steps_per_block = steps // num_blocks
  for block in range(num_blocks):
    lo = prompt_len + block * block_length
    schedule = num_transfer_tokens((x[:, lo:lo + block_length] == mask_id).sum(1),
                                   steps_per_block)
    for i in range(steps_per_block):
      x = step_fn(x, schedule[:, i], lo, jax.random.fold_in(key, block * steps_per_block + i))
  return np.asarray(x)


def make_step_fn(model, *, mask_id, block_length, temperature):
  """One sampling step as one jitted call: the same math as `generate` (block-only logits)."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def step(state, x, count, lo, key):
    model = nnx.merge(graphdef, state)
    hidden = model.encode(x, span=(lo, block_length))
    logits = model.unembed(hidden).astype(jnp.float32).at[..., mask_id].set(-jnp.inf)
    if temperature > 0:
      x0 = categorical(key, logits, temperature)
    else:
      x0 = jnp.argmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, x0[..., None], -1)[..., 0]
    p = jnp.exp(chosen - jax.nn.logsumexp(logits, axis=-1))
    block = jax.lax.dynamic_slice_in_dim(x, lo, block_length, axis=1)
    masked = block == mask_id
    confidence = jnp.where(masked, p, -jnp.inf)
    rank = jnp.argsort(jnp.argsort(-confidence, axis=-1, stable=True), axis=-1, stable=True)
    block = jnp.where(masked & (rank < count[:, None]), x0, block)
    return jax.lax.dynamic_update_slice_in_dim(x, block, lo, axis=1)

  return lambda x, count, lo, key: step(state, x, count, lo, key)


# The shape flags: the paper's rollout setting (block 32, two tokens per step, temperature 0.9) at
# half its generation length, so that the three methods together run in about a minute on 2 CPU
# cores.
SHAPE_DEFAULTS = dict(prompt_length=32, gen_length=128, steps=64, block_length=32,
                      temperature=0.9)


def run_interleaved(fns, repeats):
  """Warm each function up (compiles), then time them in turn `repeats` times, so that all see
  the same machine load; returns their outputs, first-call overheads and best times."""
  timings = profiling.time_interleaved(dict(enumerate(fns)), repeats)
  best = [timings.best[i] for i in range(len(fns))]
  outputs = [np.asarray(timings.outputs[i]) for i in range(len(fns))]
  return outputs, [timings.first_call[i] - b for i, b in enumerate(best)], best


def call_flops(config, *, batch: int, prompt_length: int, gen_length: int, block_length: int,
               cache: str, block_calls: list[int]) -> int:
  """Matmul FLOPs of a decode whose block b took ``block_calls[b]`` batched calls: each block's
  first call a full pass (the last layer's queries and the head on the block), its later ones of
  the ``cache`` kind (dual: the block's positions; prefix: the positions from the block on)."""
  length = prompt_length + gen_length
  full = flops_lib.forward_flops(config, batch, length, span=block_length)
  total = 0
  for b, calls in enumerate(block_calls):
    if cache == "none":
      total += calls * full
      continue
    queries = block_length if cache == "dual" else length - (prompt_length + b * block_length)
    cached = flops_lib.cached_forward_flops(config, batch, length, queries=queries,
                                            logit_positions=block_length)
    total += full + (calls - 1) * cached
  return total


def block_calls(reveal_step: np.ndarray, *, block_length: int, steps_per_block: int) -> list[int]:
  """The batched calls each block took: its last reveal step (over the batch) + 1; global steps
  are block * steps_per_block + step."""
  blocks = reveal_step.shape[1] // block_length
  return [int(reveal_step[:, b * block_length:(b + 1) * block_length].max())
          - b * steps_per_block + 1 for b in range(blocks)]


def cache_table(model, prompt, key, args, prompt_mask=None) -> list:
  """Tokens/s and FLOPs per token of none / prefix / dual, with and without threshold decoding.

  Prints the table; returns each setting's ``generate`` outputs (tokens, reveal step, stats), in
  the table's order."""
  config = model.config
  shape = dict(gen_length=args.gen_length, steps=args.steps, block_length=args.block_length,
               temperature=args.temperature)
  settings = [(cache, remasking) for remasking in ("low_confidence", "threshold")
              for cache in CACHES]
  fns = [lambda c=c, r=r: generate(model, prompt, key=key, remasking=r, prompt_mask=prompt_mask,
                                   threshold=args.threshold, cache=c, return_reveal_step=True,
                                   return_stats=True, **shape)
         for c, r in settings]
  timings = profiling.time_interleaved(dict(enumerate(fns)), args.repeats)
  tokens = args.batch * args.gen_length
  blocks = args.gen_length // args.block_length
  base = timings.best[0]
  print()
  print(f"| {'cache':<6} | {'remasking':<14} | {'time s':>7} | {'tokens/s':>9} | {'speed-up':>8} "
        f"| {'calls/seq':>9} | {'GFLOP/token':>11} |")
  print(f"|{'-' * 8}|{'-' * 16}|{'-' * 8}:|{'-' * 10}:|{'-' * 9}:|{'-' * 10}:|{'-' * 12}:|")
  for i, (cache, remasking) in enumerate(settings):
    _, reveal_step, stats = timings.outputs[i]
    per_block = block_calls(np.asarray(reveal_step), block_length=args.block_length,
                            steps_per_block=(args.block_length if remasking == "threshold"
                                             else args.steps // blocks))
    assert sum(per_block) == int(stats["forward_passes"]), (per_block, stats)
    flops = call_flops(config, batch=args.batch, prompt_length=args.prompt_length,
                       gen_length=args.gen_length, block_length=args.block_length, cache=cache,
                       block_calls=per_block)
    best = timings.best[i]
    print(f"| {cache:<6} | {remasking:<14} | {best:7.2f} | {tokens / best:9.1f} | "
          f"{base / best:7.2f}x | {float(np.mean(stats['model_calls'])):9.1f} | "
          f"{flops / tokens / 1e9:11.3f} |")
  return [timings.outputs[i] for i in range(len(settings))]


def workdir_model_and_prompts(source, args, parser):
  """The model of ``source`` (a resolved workdir checkpoint) and its first ``--batch`` held-out
  prompts."""
  from stabledrl_jax import tasks  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.config import specs  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.inputs import data
  from stabledrl_jax.training.parallel import mesh as mesh_lib
  from stabledrl_jax.training.state import checkpoint_source

  config = source.config
  model = checkpoint_source.load_model(source, mesh=mesh_lib.make_mesh(config.mesh),
                                       dtype=jnp.float32)
  tokenizer = data.make_tokenizer(config.tokenizer)
  examples = data.make_examples(config, "eval")
  prompts = data.encode_examples(specs.resolve_rollout(config), tokenizer, tasks.get_task(config.task.name),
                                 [examples[i] for i in range(args.batch)])
  if prompts.tokens.shape[1] != args.prompt_length:
    parser.error(f"the workdir's prompts are {prompts.tokens.shape[1]} tokens long, not "
                 f"{args.prompt_length}")
  return model, jnp.asarray(prompts.tokens), jnp.asarray(prompts.mask)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="small")
  parser.add_argument("--batch", type=int, default=2)
  for name, default in SHAPE_DEFAULTS.items():  # None: the workdir's value, else the default.
    parser.add_argument(f"--{name}", type=type(default), default=None,
                        help=f"default {default} (with --workdir: its rollout's)")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--mode", default="methods", choices=("methods", "caches"),
                      help="methods: generate against the loops; caches: KV-cache settings")
  parser.add_argument("--threshold", type=float, default=0.9,
                      help="tau of the threshold rows of --mode caches")
  parser.add_argument("--workdir", default="",
                      help="--mode caches: a training workdir's model and held-out prompts, at "
                           "its rollout shape (the shape flags given explicitly still apply)")
  args = parser.parse_args()
  if args.workdir and args.mode != "caches":
    parser.error("--workdir goes with --mode caches")
  source = None
  if args.workdir:
    from stabledrl_jax.training.state import (  # pylint: disable=g-import-not-at-top
        checkpoint_source)
    source = checkpoint_source.resolve(args.workdir)
  for name, default in SHAPE_DEFAULTS.items():
    if getattr(args, name) is None:
      setattr(args, name, source.config.rollout[name] if source else default)

  if source:
    model, prompt, prompt_mask = workdir_model_and_prompts(source, args, parser)
    config = model.config
  else:
    config = models.get_config(args.config)
    model = models.LLaDA(config, rngs=nnx.Rngs(0))
    prompt = jax.random.randint(jax.random.key(1), (args.batch, args.prompt_length), 0,
                                config.vocab_size - 2, jnp.int32)
    prompt_mask = None
  mask_id = config.mask_token_id
  key = jax.random.key(2)
  shape = dict(gen_length=args.gen_length, steps=args.steps, block_length=args.block_length)
  print(f"config={args.workdir or args.config} ({models.count_params(config) / 1e6:.2f}M params), "
        f"batch={args.batch}, prompt={args.prompt_length}, {shape}, "
        f"temperature={args.temperature}, backend={jax.default_backend()}, "
        f"devices={jax.device_count()}")

  if args.mode == "caches":
    cache_table(model, prompt, key, args, prompt_mask)
    return
  graphdef, state = nnx.split(model)
  forward_jit = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
  forward = lambda x: forward_jit(state, x)
  step_fn = make_step_fn(model, mask_id=mask_id, block_length=args.block_length,
                         temperature=args.temperature)
  prompt_np = np.asarray(prompt)
  rows = [
      ("naive loop (jit model/step, numpy)", lambda: naive_generate(
          forward, prompt_np, mask_id=mask_id, temperature=args.temperature,
          rng=np.random.default_rng(0), **shape)),
      ("python loop (jit step/step)", lambda: python_loop_generate(
          step_fn, prompt, mask_id=mask_id, key=key, **shape)),
      ("generate (one jit, lax loops)", lambda: generate(
          model, prompt, key=key, temperature=args.temperature, **shape)),
  ]
  outputs, overheads, best = run_interleaved([fn for _, fn in rows], args.repeats)
  results = [(name, overhead, t) for (name, _), overhead, t in zip(rows, overheads, best)]

  tokens = args.batch * args.gen_length
  naive_time = results[0][2]
  print()
  print(f"| {'method':<36} | {'1st call +s':>11} | {'time s':>7} | {'tokens/s':>9} | "
        f"{'vs naive':>8} |")
  print(f"|{'-' * 38}|{'-' * 12}:|{'-' * 8}:|{'-' * 10}:|{'-' * 9}:|")
  for name, compile_s, best in results:
    print(f"| {name:<36} | {max(compile_s, 0.0):11.1f} | {best:7.2f} | {tokens / best:9.1f} | "
          f"{naive_time / best:7.2f}x |")
  if args.temperature == 0:
    agree = all(np.array_equal(outputs[0], o) for o in outputs[1:])
    print(f"\ngreedy outputs identical across the three methods: {agree}")


if __name__ == "__main__":
  main()
