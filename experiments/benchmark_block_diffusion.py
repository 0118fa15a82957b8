"""Cost of block diffusion likelihoods and sampling: one staircase pass against per-block passes,
and KV-cached against uncached block decoding.

    python experiments/benchmark_block_diffusion.py --output /tmp/block_diffusion.json
    python experiments/benchmark_block_diffusion.py --output out.json --configs small --repeats 5

For each SDAR config (default: tiny and small, random weights, CPU), it times with jit-compiled
functions, best of `--repeats` runs taken in turn after one warm-up call:

  forward passes (batch B, sequence length n = --length):
    plain            model(tokens): one block-causal pass of length n, logits [B, n, V]
    staircase        model.staircase(x_t, x_0): one pass of length 2n, logits of x_t [B, n, V]
    staircase dense  the same through the dense [2n, 2n] mask (impl="dense")

  block ELBO (K = 1 sample of every block, length --elbo_length):
    one pass         block_estimators.estimate_block_elbo: masks + one staircase pass
    per-block passes the same masks scored by per_block_token_logprobs: one plain pass of length
                     n per block (n / block_size passes), the naive estimator

  sampling (greedy, low_confidence_static, --steps steps per block, batch B):
    cached           models/sdar/sampler.generate(use_cache=True): KV cache of finished blocks
    uncached         use_cache=False: the whole sequence recomputed at every step
  (the script checks that both produce the same tokens).

It writes JSON with every time and ratio, and at top level `staircase_over_plain` (staircase /
plain time, `--ratio_config`, default small; the target is <= 2.5) and `cached_speedup` (uncached /
cached sampling time, same config), and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stabledrl_jax import block_estimators as be, estimators, models, profiling
from stabledrl_jax.models.sdar.sampler import generate


def timed(fns: dict, repeats: int) -> tuple[dict, dict]:
  """Warm each function up (compiles), then time them in turn; returns (outputs, best seconds)."""
  timings = profiling.time_interleaved(fns, repeats)
  return timings.outputs, timings.best


def bench_config(name: str, args) -> dict:
  config = models.get_sdar_config(name)
  model = models.SDAR(config, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  bs, mask_id = config.block_size, config.mask_token_id
  rng = np.random.default_rng(0)
  vocab = config.vocab_size - 2

  def with_model(fn):
    jitted = jax.jit(lambda state, *xs: fn(nnx.merge(graphdef, state), *xs))
    return lambda *xs: jitted(state, *xs)

  # Forward passes.
  n = args.length
  clean = jnp.asarray(rng.integers(0, vocab, (args.batch, n)), jnp.int32)
  noisy = jnp.where(jnp.asarray(rng.random((args.batch, n)) < 0.5), mask_id, clean)
  plain = with_model(lambda m, t: m(t))
  stair = with_model(lambda m, x, c: m.staircase(x, c))
  dense = with_model(lambda m, x, c: m.staircase(x, c, impl="dense"))
  _, passes = timed({"plain": lambda: plain(clean), "staircase": lambda: stair(noisy, clean),
                     "staircase_dense": lambda: dense(noisy, clean)}, args.repeats)

  # Block ELBO: one staircase pass against one plain pass per block, on the same masks.
  n_elbo = args.elbo_length
  tokens = jnp.asarray(rng.integers(0, vocab, (args.batch, n_elbo)), jnp.int32)
  prompt_mask = jnp.zeros((args.batch, n_elbo), bool).at[:, :args.prompt_length].set(True)
  completion = ~prompt_mask
  masks = be.sample_block_masks(jax.random.key(1), completion, block_size=bs)
  one_pass = with_model(lambda m, t, key: be.estimate_block_elbo(
      lambda x, c, a: m.staircase(x, c, a), t, prompt_mask, completion, key, mask_id=mask_id,
      block_size=bs))
  per_block = with_model(lambda m, t: estimators.combine(be.per_block_token_logprobs(
      lambda x, a: m(x, a), t, masks.noisy, mask_id=mask_id, block_size=bs), masks))
  one_pass_same = with_model(lambda m, t: be.estimate_block_elbo(
      lambda x, c, a: m.staircase(x, c, a), t, prompt_mask, completion, None, mask_id=mask_id,
      block_size=bs, masks=masks))
  elbo_out, elbo = timed({"one_pass": lambda: one_pass(tokens, jax.random.key(1)),
                          "per_block_passes": lambda: per_block(tokens)},
                         max(1, args.repeats - 1))
  reference = one_pass_same(tokens)
  agree = float(jnp.max(jnp.abs(elbo_out["per_block_passes"] - reference))
                / jnp.maximum(jnp.max(jnp.abs(reference)), 1e-30))

  # Sampling.
  prompt = jnp.asarray(rng.integers(0, vocab, (args.batch, args.prompt_length)), jnp.int32)
  kw = dict(key=jax.random.key(2), gen_length=args.gen_length, steps=args.steps,
            remasking="low_confidence_static", stop_at_eos=False)
  sample_out, sampling = timed({
      "cached": lambda: generate(model, prompt, use_cache=True, **kw),
      "uncached": lambda: generate(model, prompt, use_cache=False, **kw)},
      max(1, args.repeats - 1))
  same_tokens = bool(np.array_equal(sample_out["cached"], sample_out["uncached"]))
  return dict(
      params=models.count_params(config), block_size=bs,
      forward=dict(length=n, batch=args.batch, seconds=passes,
                   staircase_over_plain=passes["staircase"] / passes["plain"],
                   dense_over_plain=passes["staircase_dense"] / passes["plain"]),
      elbo=dict(length=n_elbo, batch=args.batch, blocks=n_elbo // bs, seconds=elbo,
                per_block_over_one_pass=elbo["per_block_passes"] / elbo["one_pass"],
                max_relative_difference=agree),
      sampling=dict(prompt_length=args.prompt_length, gen_length=args.gen_length,
                    steps_per_block=args.steps, batch=args.batch, seconds=sampling,
                    tokens_per_second={k: args.batch * args.gen_length / v
                                       for k, v in sampling.items()},
                    cached_speedup=sampling["uncached"] / sampling["cached"],
                    same_tokens=same_tokens))


def print_table(results: dict) -> None:
  print(f"| {'config':<6} | {'measurement':<58} | {'time s':>8} | {'ratio':>17} |")
  print(f"|{'-' * 8}|{'-' * 60}|{'-' * 9}:|{'-' * 18}:|")
  for name, r in results.items():
    f, e, s = r["forward"], r["elbo"], r["sampling"]
    rows = [
        (f"plain pass, length n = {f['length']}", f["seconds"]["plain"], "1.00x"),
        ("staircase pass, length 2n", f["seconds"]["staircase"],
         f"{f['staircase_over_plain']:.2f}x plain"),
        ("staircase pass, dense mask", f["seconds"]["staircase_dense"],
         f"{f['dense_over_plain']:.2f}x plain"),
        (f"block ELBO, one pass (n = {e['length']})", e["seconds"]["one_pass"], "1.00x"),
        (f"block ELBO, {e['blocks']} per-block passes", e["seconds"]["per_block_passes"],
         f"{e['per_block_over_one_pass']:.1f}x one pass"),
        (f"sampling, KV cache (prompt {s['prompt_length']}, {s['gen_length']} tokens, "
         f"{s['steps_per_block']} steps/block)", s["seconds"]["cached"], "1.00x"),
        ("sampling, no cache", s["seconds"]["uncached"],
         f"{s['cached_speedup']:.2f}x cached"),
    ]
    for label, seconds, ratio in rows:
      print(f"| {name:<6} | {label:<58} | {seconds:8.4f} | {ratio:>17} |")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--output", required=True, help="JSON file to write")
  parser.add_argument("--configs", default="tiny,small")
  parser.add_argument("--ratio_config", default="small")
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--length", type=int, default=256)
  parser.add_argument("--elbo_length", type=int, default=128)
  parser.add_argument("--prompt_length", type=int, default=32)
  parser.add_argument("--gen_length", type=int, default=64)
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  if not 0 < args.prompt_length < args.elbo_length:
    parser.error("--prompt_length must be positive and shorter than --elbo_length")
  names = [c for c in args.configs.split(",") if c]
  if args.ratio_config not in names:
    parser.error(f"--ratio_config {args.ratio_config!r} must be one of --configs {names}")

  machine = dict(backend=jax.default_backend(), devices=jax.device_count(),
                 device_kind=jax.devices()[0].device_kind, cpu_count=os.cpu_count(),
                 load_average=list(os.getloadavg()), python=platform.python_version(),
                 jax=jax.__version__)
  print(f"backend={machine['backend']} devices={machine['devices']} "
        f"load={machine['load_average'][0]:.2f}")
  results = {}
  for name in names:
    print(f"benchmarking {name} ...", flush=True)
    results[name] = bench_config(name, args)
  ratio = results[args.ratio_config]
  out = dict(
      staircase_over_plain=ratio["forward"]["staircase_over_plain"],
      cached_speedup=ratio["sampling"]["cached_speedup"],
      ratio_config=args.ratio_config, target_staircase_over_plain=2.5,
      machine=machine, settings=vars(args), configs=results)
  os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
  with open(args.output, "w") as f:
    json.dump(out, f, indent=2)
  print()
  print_table(results)
  print()
  print(f"staircase_over_plain ({args.ratio_config}): {out['staircase_over_plain']:.2f} "
        f"(target <= 2.5)")
  print(f"cached_speedup ({args.ratio_config}): {out['cached_speedup']:.2f}")
  for name, r in results.items():
    print(f"{name}: cached and uncached greedy tokens identical: {r['sampling']['same_tokens']}; "
          f"one-pass vs per-block ELBO (same masks) relative difference "
          f"{r['elbo']['max_relative_difference']:.1e}")
  print(f"wrote {args.output}")


if __name__ == "__main__":
  main()
