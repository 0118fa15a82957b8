r"""Which attention kernel needs less memory, by libtpu's compiler: the measurements behind
``model.attention='auto'`` (``models.layers.attention_impl``).

  python experiments/attention_choice.py [--topology v5e:2x2] [--dtypes float32,bfloat16] \
      [--families llada,sdar] [--programs train,none,prefix,dual,sampler] \
      [--override d_model=768] [--output attention.json]

For the `small` model of each family (LLaDA 23M, SDAR) at the quickstart's vocabulary, 512
rollouts of 256 + 256 positions (128 a chip over the v5e 2x2's 4 chips, FSDP), 64 steps in
blocks of 32, it compiles with the TPU compiler on this CPU host (``stabledrl_jax/tpu_compile.py``;
needs libtpu) the train step (one microbatch of 8 groups of 8, 64 rows) and the rollout sampler
of every cache (LLaDA: none, prefix, dual; SDAR: its KV-cached block sampler) once with
``model.attention=xla``, once with ``splash`` and once with ``auto``, in float32 and bfloat16
compute. Prints a Markdown table: GiB per chip of each, the smaller kernel, and whether ``auto``
compiled to that kernel's bytes (within 1%: the two kernels that tie are both right).
``--override field=value`` changes the model's shape (``d_model=768`` gives LLaDA `small` the
paper model's head dimension, 128, which fills the TPU's 128 lanes; `small`'s own is 64).
docs/performance.md ("Attention kernel") has the measured table; about 15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import time

from stabledrl_jax import profiling, tpu_compile
from stabledrl_jax.training.config import config_lib, specs

KERNELS = ("xla", "splash", "auto")
# Programs per family: the train step and the sampler of each cache (SDAR's always caches).
PROGRAMS = {"llada": ("train", "none", "prefix", "dual"), "sdar": ("train", "sampler")}
CONFIGS = {"llada": "quickstart", "sdar": "sdar_tiny_quickstart"}


def config_for(family: str, dtype: str, attention: str, chips: int, overrides=None):
  """The quickstart config of ``family`` at the `small` model and the paper's decoding shape."""
  config = config_lib.get(CONFIGS[family])
  config.model.update(name="small", attention=attention, dtype=dtype, param_dtype=dtype,
                      remat=False)
  config.model.overrides = dict(overrides or {})
  config.rollout.update(num_prompts=64, group_size=8, prompt_length=256, gen_length=256,
                        steps=64, block_length=32, microbatch_groups=0)
  config.eval.update(steps=64, block_length=32)
  config.train.microbatch_groups = 8
  config.mesh.update(data=1, fsdp=chips, tensor=1)
  return config


def compile_bytes(family: str, program: str, config, devices) -> int:
  if program == "train":
    result = tpu_compile.compile_train_step(config, devices)
  else:
    cache = {"sampler": config.rollout.cache}.get(program, program)
    result = tpu_compile.compile_decode(config, devices,
                                        tpu_compile.rollout_decoding(config, cache=cache),
                                        what=program)
  return result.memory["total"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--topology", default="v5e:2x2")
  parser.add_argument("--dtypes", default="float32,bfloat16")
  parser.add_argument("--families", default="llada,sdar")
  parser.add_argument("--programs", default="", help="Only these (default: every one).")
  parser.add_argument("--override", action="append", default=[], metavar="FIELD=VALUE")
  parser.add_argument("--output", default="", help="Also write the rows as JSON here.")
  args = parser.parse_args()
  overrides = {}
  for item in args.override:
    field, sep, value = item.partition("=")
    if not sep or not value.isdigit():
      parser.error(f"--override {item!r}: expected FIELD=INTEGER")
    overrides[field] = int(value)
  only = set(filter(None, args.programs.split(",")))
  devices = tpu_compile.topology_devices(args.topology)
  rows = []
  for family in args.families.split(","):
    for dtype in args.dtypes.split(","):
      for program in PROGRAMS[family]:
        if only and program not in only:
          continue
        configs = {k: config_for(family, dtype, k, len(devices), overrides) for k in KERNELS}
        model = specs.model_config(configs["auto"])
        row = dict(family=family, dtype=dtype, program=program,
                   head_dim=profiling.flops_shapes(model).head_dim)
        began = time.perf_counter()
        for kernel in KERNELS:
          row[kernel] = compile_bytes(family, program, configs[kernel], devices)
        row["compile_s"] = round(time.perf_counter() - began, 1)
        row["smaller"] = "splash" if row["splash"] < row["xla"] else "xla"
        row["auto_is_smaller"] = row["auto"] <= 1.01 * min(row["xla"], row["splash"])
        rows.append(row)
        print(json.dumps(row), flush=True)
  gib = lambda n: f"{n / 2**30:.3f}"
  print(f"\nsmall models on {args.topology} ({len(devices)} chips, fsdp {len(devices)}), 512 "
        "rollouts x 512 positions; GiB per chip\n")
  print("| family | head dim | compute | program | xla | splash | smaller | auto | "
        "auto is the smaller |")
  print("|---|---:|---|---|---:|---:|---|---:|---|")
  for r in rows:
    print(f"| {r['family']} | {r['head_dim']} | {r['dtype']} | {r['program']} | {gib(r['xla'])} | "
          f"{gib(r['splash'])} | {r['smaller']} | {gib(r['auto'])} | "
          f"{'yes' if r['auto_is_smaller'] else '**no**'} |")
  if args.output:
    with open(args.output, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
