r"""The KV-cached samplers' bytes per chip against the exact sampler's, by libtpu's compiler.

  python experiments/sampler_memory.py --topology v5e:2x2 --model small \
      --override d_model=768 [--rows 512] [--caches none,prefix,dual] [--attention ""]

Compiles LLaDA's rollout sampler of the paper config (``llada8b_gsm8k``: 256 prompt + 256
generated positions, 128 steps in blocks of 32) for the model ``--model`` with shape overrides
(``--override field=value``, repeatable; ``d_model=768`` gives the 6-head ``small`` model the
paper model's head dimension, 128, whose KV cache has no tile padding on TPU), ``--rows``
sequences split over the slice's chips (mesh data=1, fsdp=chips), for each cache, on a CPU host
with the TPU compiler (``stabledrl_jax/tpu_compile.py``; needs libtpu). Prints a table: bytes
per chip, the KV cache's (every layer's keys and values of every position, per chip), and the
extra bytes of each cached sampler over the exact one in units of its cache. The target the
cached samplers are held to is at most the exact sampler's bytes plus about twice the cache.
"""

from __future__ import annotations

import argparse
import json
import time

from stabledrl_jax import tpu_compile
from stabledrl_jax.training.config import config_lib, specs


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--topology", default="v5e:2x2")
  parser.add_argument("--model", default="small")
  parser.add_argument("--override", action="append", default=[], metavar="FIELD=VALUE")
  parser.add_argument("--rows", type=int, default=512)
  parser.add_argument("--caches", default="none,prefix,dual")
  parser.add_argument("--attention", default="", help="model.attention ('': auto)")
  parser.add_argument("--output", default="", help="Also write the rows as JSON here.")
  args = parser.parse_args()

  config = config_lib.get("llada8b_gsm8k")
  overrides = {}
  for item in args.override:
    field, sep, value = item.partition("=")
    if not sep:
      parser.error(f"--override {item!r}: expected FIELD=VALUE")
    try:
      overrides[field] = int(value)
    except ValueError:
      try:
        overrides[field] = float(value)
      except ValueError:
        overrides[field] = value
  devices = tpu_compile.topology_devices(args.topology)
  chips = len(devices)
  config.model.update(name=args.model, remat=False, checkpoint="", attention=args.attention)
  config.model.overrides.update(overrides)
  config.mesh.update(data=1, fsdp=chips, tensor=1)
  model_config = specs.model_config(config)
  length = config.rollout.prompt_length + config.rollout.gen_length
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  per_row = (2 * model_config.n_layers * length * model_config.n_kv_heads
             * model_config.head_dim * jnp.dtype(model_config.dtype).itemsize)
  cache = per_row * args.rows // chips
  # The KV cache: every layer's keys and values of every position, rows split over the chips.
  rows, exact = [], None
  for name in args.caches.split(","):
    began = time.perf_counter()
    result = tpu_compile.compile_decode(config, devices,
                                        tpu_compile.rollout_decoding(config, cache=name),
                                        rows=args.rows, what=name)
    total = result.memory["total"]
    exact = total if name == "none" else exact
    rows.append(dict(cache=name, bytes_per_chip=total, kv_cache_bytes=cache if name != "none"
                     else 0, compile_s=round(time.perf_counter() - began, 1)))
  for r in rows:  # Against the exact sampler's, wherever it came in --caches.
    r["extra_in_caches"] = (None if exact is None or r["cache"] == "none"
                            else round((r["bytes_per_chip"] - exact) / cache, 2))
  gib = lambda n: f"{n / 2**30:.2f}"
  print(f"{args.model} {overrides} on {args.topology} ({chips} chips, fsdp {chips}), "
        f"{args.rows} rows x {length} positions, attention {args.attention or 'auto'}\n")
  print("| cache | GiB per chip | KV cache GiB per chip | (cached - exact) / cache | compile s |")
  print("|---|---:|---:|---:|---:|")
  for r in rows:
    extra = "-" if r["extra_in_caches"] is None else f"{r['extra_in_caches']:.2f}"
    kv = gib(r["kv_cache_bytes"]) if r["kv_cache_bytes"] else "-"
    print(f"| {r['cache']} | {gib(r['bytes_per_chip'])} | {kv} | {extra} | {r['compile_s']} |")
  if args.output:
    with open(args.output, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
