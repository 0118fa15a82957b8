"""Deprecated: the plan command (``python -m stabledrl_jax.plan``) is the one way to plan.

    python -m stabledrl_jax.plan --config llada8b_gsm8k --topology v5p-8,v5litepod-64 \
        --output plan.json                       # libtpu's TPU compiler, per chip of a slice

This script keeps its old flags and runs the same planner (``stabledrl_jax.plan.Planner``) with
XLA:CPU on fake devices, one ``cpu:N`` slice per ``--meshes`` entry (an upper bound: XLA:CPU
upcasts bf16 products to f32; docs/performance.md):

    python experiments/memory_plan.py --output plan.json                      # LLaDA-8B, 3 meshes
    python experiments/memory_plan.py --model sdar_8b --output plan_sdar.json   # SDAR-8B
    python experiments/memory_plan.py --model tiny --meshes fsdp=8 --output /tmp/plan.json
    python experiments/memory_plan.py --sampler --meshes "fsdp=8"             # per cache setting

The config is the paper's (``config_lib.llada8b_config`` or ``sdar8b_config`` for ``--task``)
with ``model.name = --model``; ``--set a.b=value`` overrides a field. The train step is compiled
for each ``--remat`` x ``--microbatch_groups`` (default: the smallest valid and 4x that), the
sampler (``--sampler``) for each ``--caches`` setting. A device's memory is ``--device_gb``
(default: 80 GB for 8 devices or fewer, else 16). Rows are the plan command's (its docstring),
with ``settings`` holding the mesh and the compiled values.
"""

from __future__ import annotations

import argparse
import math
import sys


def _mesh(text: str) -> dict[str, int]:
  """'fsdp=8' or 'data=2,fsdp=4' -> {'data': 2, 'fsdp': 4, 'tensor': 1}."""
  sizes = {"data": 1, "fsdp": 1, "tensor": 1}
  for part in text.split(","):
    axis, _, size = part.partition("=")
    if axis not in sizes or not size.isdigit():
      raise argparse.ArgumentTypeError(f"--meshes: bad entry {part!r} in {text!r} "
                                       "(data=N, fsdp=N, tensor=N)")
    sizes[axis] = int(size)
  return sizes


def _parse_args():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="llada_8b", help="a model config name of --family")
  parser.add_argument("--family", default="", help="a registered model family (default: the "
                      "one whose named configs hold --model, LLaDA's for a name both have)")
  parser.add_argument("--task", default="gsm8k", help="the paper config's task (sizes only)")
  parser.add_argument("--meshes", default="fsdp=8;fsdp=64;fsdp=256",
                      type=lambda s: [_mesh(m) for m in s.split(";") if m])
  parser.add_argument("--device_gb", default="", help="GB (1e9 bytes) per device per mesh, "
                      "';'-separated; default 80 for 8 devices or fewer, else 16")
  parser.add_argument("--remat", default="true,false",
                      type=lambda s: [v.strip().lower() == "true" for v in s.split(",") if v])
  parser.add_argument("--microbatch_groups", default="", help="comma-separated values to try")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      help="override a config field, e.g. --set rollout.gen_length=64")
  parser.add_argument("--sampler", action="store_true", help="plan the rollout sampler")
  parser.add_argument("--caches", default="", type=lambda s: [c for c in s.split(",") if c],
                      help="with --sampler: the cache settings (default: the family's)")
  parser.add_argument("--output", default="", help="JSON file to write")
  return parser.parse_args()


def _override(config, assignment: str) -> None:
  """--set a.b=value: the value parsed as the field's current type."""
  field, _, value = assignment.partition("=")
  *path, name = field.split(".")
  node = config
  for part in path:
    node = node[part]
  current = node[name]
  node[name] = value.lower() == "true" if isinstance(current, bool) else type(current)(value)


def main():
  args = _parse_args()
  print("experiments/memory_plan.py is deprecated: python -m stabledrl_jax.plan plans with the "
        "TPU compiler (docs/pods.md, 'Plan before you rent')", file=sys.stderr)
  from stabledrl_jax import plan  # pylint: disable=g-import-not-at-top
  plan.prepare_cpu_devices(max(math.prod(m.values()) for m in args.meshes))
  from stabledrl_jax.models import family as family_lib  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.config import config_lib, specs  # pylint: disable=g-import-not-at-top

  gbs = [float(g) for g in args.device_gb.split(";") if g] if args.device_gb else []
  if gbs and len(gbs) != len(args.meshes):
    sys.exit("--device_gb needs one value per mesh")
  family = args.family or next(
      (name for name in family_lib.names() if args.model in family_lib.get(name).config_names),
      "llada")
  if family not in family_lib.names():
    sys.exit(f"--family {family!r} is not one of {family_lib.names()}")
  if args.sampler:
    bad = [c for c in args.caches if c not in family_lib.get(family).caches]
    if bad:
      sys.exit(f"--caches {bad[0]!r}: the {family} sampler has {family_lib.get(family).caches}")
  paper_config = config_lib.sdar8b_config if family == "sdar" else config_lib.llada8b_config
  config = paper_config(args.task, learning_rate=1e-6)
  config.model.update(family=family, name=args.model, checkpoint="")
  for assignment in args.set:
    _override(config, assignment)
  store = plan.Store(args.output, resume=False)
  label = f"paper {args.task} config, model.name={args.model}"
  for i, mesh in enumerate(args.meshes):
    ways = math.prod(mesh.values())
    planner = plan.Planner(config, config_label=label, overrides=args.set, compiler="cpu",
                           store=store, max_ladder=0, caches=args.caches or None,
                           remasking=[config.rollout.remasking],
                           chip_gb=gbs[i] if gbs else (80 if ways <= 8 else 16),
                           say=lambda s: print(s, flush=True))
    at = {f"mesh.{axis}": size for axis, size in mesh.items()}
    if args.sampler:
      planner.config = plan.apply_settings(config, at)
      planner.plan("sampler", f"cpu:{ways}")
      continue
    meshed = plan.apply_settings(config, at)
    valid = specs.microbatch_groups_for(meshed, mesh["data"] * mesh["fsdp"])
    if args.microbatch_groups:
      groups = [int(g) for g in args.microbatch_groups.split(",")]
    elif valid:
      groups = sorted({valid[0], next((g for g in valid if g >= 4 * valid[0]), valid[-1])})
    else:
      sys.exit(f"no microbatch of {config.rollout.num_prompts} prompts splits over {ways} "
               "devices")
    for group in groups:
      for remat in args.remat:
        planner.row("train", f"cpu:{ways}", {**at, "train.microbatch_groups": group,
                                             "model.remat": remat}, variant={})
  print()
  print(plan.markdown(dict(rows=list(store.rows.values()))), end="")
  if args.output:
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
  main()
