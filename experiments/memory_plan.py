"""Memory plan of the paper-scale train step: per-device bytes on FSDP meshes, compiled, not run.

    python experiments/memory_plan.py --output plan.json                      # LLaDA-8B, 3 meshes
    python experiments/memory_plan.py --model sdar_8b --output plan_sdar.json   # SDAR-8B
    python experiments/memory_plan.py --model tiny --meshes fsdp=8 --output /tmp/plan.json

The train step of `config_lib.llada8b_config` or `sdar8b_config` (32 prompts x 16 completions
of 256 + 256 tokens, 2 MC samples, bf16 parameters and AdamW moments; SDAR: the block ELBO, one
staircase pass over the clean copy and the K noised copies, (K + 1) x 512 positions) is compiled
ahead of time with
`train_step.make_update_fn` for meshes of fake CPU devices
(`--xla_force_host_platform_device_count`, set before JAX starts), from abstract inputs
(`jax.ShapeDtypeStruct` with the trainer's shardings; nothing is allocated), and XLA's memory
analysis of the compiled step gives the bytes each device needs (`profiling.compiled_memory`):

  parameters, optimizer   this device's shards of the state (from the shardings); donated, so the
                          updated state reuses their buffers
  batch                   this device's rows of the rollout batch
  activations             XLA's temporaries: activations kept for the backward pass, gradients,
                          logits, gathered FSDP weights and workspace, at the peak of its schedule
  per_device_bytes        arguments + outputs - donated + temporaries

for each setting of `model.remat` and `train.microbatch_groups` (the prompts, with their G
completions each, per gradient-accumulation microbatch; the batch is split over the data x fsdp
devices, so a microbatch needs at least one row per device). A row fits when per_device_bytes
<= the device's memory (`--device_gb`, default: 80 GB for the 8-device mesh, like 8 A100/H100,
16 GB for larger meshes, like TPU v5e slices). The activations are an upper bound for an
accelerator: XLA's CPU backend multiplies bf16 only after upcasting to float32, and it keeps the
kernels gathered for the forward pass until the backward pass (the whole model in float32 on each
device, about 26 GiB for LLaDA-8B, whatever the mesh).

The default plan compiles 12 steps (3 meshes x 2 remat x 2 microbatch sizes), 30-50 s each on 2
CPU cores. `--model` is a config name of `--family` (`models.get_config`, `models.get_sdar_config`);
the abstract model comes from `models.init_model`, as in the trainer.

`--sampler` plans the rollout sampler instead (LLaDA's `sampling.generate` for the config's
rollout: all P x G rows at once, as the trainer decodes them, rows split over data x fsdp), once
per `--caches` setting (none / prefix / dual, docs/models.md "Sampling"): XLA's bytes per device,
and the KV cache's own share (2 x layers x rows x positions x kv heads x head dim, per device).

JSON (`--output`): {"rows": [{"model", "mesh", "remat", "microbatch_groups",
"per_device_bytes", "device_bytes", "fits", "parameters_bytes", "optimizer_bytes", "batch_bytes",
"activations_bytes", "compile_seconds", "xla": {XLA's memory analysis}}, ...], "settings": {...}}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time


def _mesh(text: str) -> dict[str, int]:
  """'fsdp=8' or 'data=2,fsdp=4' -> {'data': 2, 'fsdp': 4, 'tensor': 1}."""
  sizes = {"data": 1, "fsdp": 1, "tensor": 1}
  for part in text.split(","):
    axis, size = part.split("=")
    if axis not in sizes:
      raise argparse.ArgumentTypeError(f"unknown mesh axis {axis!r} in {text!r}")
    sizes[axis] = int(size)
  return sizes


def _parse_args():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="llada_8b",
                      help="a model config name of --family (llada_8b, sdar_8b, tiny, ...)")
  parser.add_argument("--family", default="",
                      help="a registered model family (models.family.names(); default: the one "
                           "whose named configs hold --model, LLaDA's for a name both have); its "
                           "paper config (config_lib.sdar8b_config for sdar, else "
                           "llada8b_config with model.family set) gives the RL sizes")
  parser.add_argument("--task", default="gsm8k", help="the paper config's task (sizes only)")
  parser.add_argument("--meshes", default="fsdp=8;fsdp=64;fsdp=256",
                      type=lambda s: [_mesh(m) for m in s.split(";") if m])
  parser.add_argument("--device_gb", default="",
                      help="device memory in GB (1e9 bytes) per mesh, ';'-separated; default 80 "
                           "for 8 devices or fewer, else 16")
  parser.add_argument("--remat", default="true,false",
                      type=lambda s: [v.strip().lower() == "true" for v in s.split(",") if v])
  parser.add_argument("--microbatch_groups", default="",
                      help="comma-separated values to try; default: the smallest valid for each "
                           "mesh (the paper's 1 where it divides) and 4 times that")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      help="override a config field, e.g. --set rollout.gen_length=64")
  parser.add_argument("--sampler", action="store_true",
                      help="plan the rollout sampler (LLaDA) instead of the train step")
  parser.add_argument("--caches", default="none,prefix,dual",
                      type=lambda s: [c for c in s.split(",") if c],
                      help="with --sampler: the cache settings to compile")
  parser.add_argument("--output", default="", help="JSON file to write")
  return parser.parse_args()


def _override(config, assignment: str) -> None:
  """--set a.b=value: the value parsed as the field's current type."""
  field, value = assignment.split("=", 1)
  *path, name = field.split(".")
  node = config
  for part in path:
    node = node[part]
  current = node[name]
  node[name] = value.lower() == "true" if isinstance(current, bool) else type(current)(value)


def main():
  args = _parse_args()
  devices_needed = max(math.prod(m.values()) for m in args.meshes)
  # Fake CPU devices must be requested before JAX initializes its backends.
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={devices_needed}").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.models import family as family_lib  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training import config_lib, specs  # pylint: disable=g-import-not-at-top

  if jax.device_count() < devices_needed:
    sys.exit(f"{jax.device_count()} devices, {devices_needed} needed: XLA_FLAGS was set before "
             "this script without enough fake devices")
  gbs = [float(g) for g in args.device_gb.split(";") if g] if args.device_gb else []
  if gbs and len(gbs) != len(args.meshes):
    sys.exit("--device_gb needs one value per mesh")
  family = args.family or next(
      (name for name in family_lib.names() if args.model in family_lib.get(name).config_names),
      "llada")
  if family not in family_lib.names():
    sys.exit(f"--family {family!r} is not one of {family_lib.names()}")
  rows = []
  for i, mesh_sizes in enumerate(args.meshes):
    ways = math.prod(mesh_sizes.values())
    device_bytes = int((gbs[i] if gbs else (80 if ways <= 8 else 16)) * 1e9)
    paper_config = config_lib.sdar8b_config if family == "sdar" else config_lib.llada8b_config
    config = paper_config(args.task, learning_rate=1e-6)
    config.model.update(family=family, name=args.model)
    config.mesh.update(**mesh_sizes)
    for assignment in args.set:
      _override(config, assignment)
    label = ",".join(f"{a}={s}" for a, s in mesh_sizes.items() if s > 1) or "1 device"
    if args.sampler:
      if not family_lib.get(family).caches or "dual" not in family_lib.get(family).caches:
        sys.exit(f"--sampler plans LLaDA's KV-cached sampler; {family!r} has none")
      config.model.remat = False  # Inference: nothing is kept for a backward pass.
      specs.validate(config, num_devices=ways)
      for cache in args.caches:
        print(f"compiling the {args.model} sampler on {label}, cache={cache} ...", flush=True)
        row = sampler_row(config, jax.devices()[:ways], device_bytes, cache)
        rows.append(dict(model=args.model, mesh=label, **row))
      continue
    if args.microbatch_groups:
      groups = [int(g) for g in args.microbatch_groups.split(",")]
    else:
      groups = _default_groups(config, mesh_sizes["data"] * mesh_sizes["fsdp"])
    for group in groups:
      for remat in args.remat:
        config.train.microbatch_groups = group
        config.model.remat = remat
        specs.validate(config, num_devices=ways)
        print(f"compiling {args.model} on {label}, remat={remat}, microbatch_groups={group} ...",
              flush=True)
        row = plan_row(config, jax.devices()[:ways], device_bytes)
        rows.append(dict(model=args.model, mesh=label, **row))
  print()
  (print_sampler_table if args.sampler else print_table)(rows)
  if args.output:
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
      json.dump(dict(rows=rows, settings=dict(model=args.model, task=args.task,
                                              jax=jax.__version__)), f, indent=2)
    print(f"\nwrote {args.output}")


def _default_groups(config, ways: int) -> list[int]:
  """The smallest microbatch (in groups) whose rows split over `ways` devices, and 4x that."""
  r = config.rollout
  valid = [g for g in range(1, r.num_prompts + 1)
           if r.num_prompts % g == 0 and g * r.group_size % ways == 0]
  if not valid:
    raise ValueError(f"no microbatch of {r.num_prompts} prompts x {r.group_size} splits over "
                     f"{ways} devices")
  smallest = valid[0]
  return sorted({smallest, next((g for g in valid if g >= 4 * smallest), valid[-1])})


def plan_row(config, devices, device_bytes: int) -> dict:
  """Compiles the configured train step on `devices` from abstract inputs; reads its memory."""
  from stabledrl_jax import profiling  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training import trainer  # pylint: disable=g-import-not-at-top

  start = time.perf_counter()
  update, state, batch, key = trainer.abstract_update(config, devices)
  compiled = update.lower(state, batch, key).compile()
  seconds = time.perf_counter() - start
  memory = profiling.compiled_memory(compiled)
  params = _shard_bytes(state.params)
  optimizer = _shard_bytes(state.opt_state)
  batch_bytes = _shard_bytes(batch)
  return dict(remat=bool(config.model.remat),
              microbatch_groups=int(config.train.microbatch_groups),
              per_device_bytes=memory["total"], device_bytes=device_bytes,
              fits=memory["total"] <= device_bytes, parameters_bytes=params,
              optimizer_bytes=optimizer, batch_bytes=batch_bytes,
              activations_bytes=memory["temp"], compile_seconds=seconds, xla=memory)


def sampler_row(config, devices, device_bytes: int, cache: str) -> dict:
  """Compiles the rollout sampler of `config` with `cache` on `devices` from abstract inputs."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from stabledrl_jax import models, profiling, sampling  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training import decoding, mesh as mesh_lib, specs  # pylint: disable=g-import-not-at-top

  start = time.perf_counter()
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  model_cfg = specs.model_config(config)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: models.init_model(model_cfg, seed=0)))
  state = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s), state,
                       models.param_shardings(state, mesh))
  r = config.rollout
  n, length = r.num_prompts * r.group_size, r.prompt_length + r.gen_length
  rows = models.batch_sharding(mesh, ndim=2)
  prompt = jax.ShapeDtypeStruct((n, r.prompt_length), jnp.int32, sharding=rows)
  prompt_mask = jax.ShapeDtypeStruct((n, r.prompt_length), jnp.bool_, sharding=rows)
  key = jax.eval_shape(lambda: jax.random.key(0))
  key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec()))
  settings = decoding.Decoding.of_rollout(r, temperature=r.temperature, steps=r.steps,
                                          cache=cache)
  dynamic = settings.remasking == "threshold"
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    compiled = sampling._generate.lower(  # pylint: disable=protected-access
        graphdef, state, prompt, prompt_mask, key, gen_length=settings.gen_length,
        steps=0 if dynamic else settings.steps, block_length=settings.block_length,
        temperature=float(settings.temperature), remasking=settings.remasking,
        threshold=float(settings.threshold) if dynamic else 0.0,
        cfg_scale=float(settings.cfg_scale), stop_at_eos=False, cache=cache).compile()
  seconds = time.perf_counter() - start
  memory = profiling.compiled_memory(compiled)
  rows_per_device = prompt.sharding.shard_shape(prompt.shape)[0]
  kv_bytes = 0 if cache == "none" else (
      2 * model_cfg.n_layers * rows_per_device * length * model_cfg.n_kv_heads
      * model_cfg.head_dim * jnp.dtype(model_cfg.dtype).itemsize)
  return dict(what="sampler", cache=cache, rows=n, positions=length,
              per_device_bytes=memory["total"], device_bytes=device_bytes,
              fits=memory["total"] <= device_bytes, parameters_bytes=_shard_bytes(state),
              kv_cache_bytes=int(kv_bytes), activations_bytes=memory["temp"],
              compile_seconds=seconds, xla=memory)


def print_sampler_table(rows: list[dict]) -> None:
  gib = 2**30
  print("| model | mesh | rows x positions | cache | parameters GiB | KV cache GiB | "
        "temporaries GiB | total GiB / device | device GiB | fits |")
  print("|---|---|---|---|---:|---:|---:|---:|---:|---|")
  for r in rows:
    print(f"| {r['model']} | {r['mesh']} | {r['rows']} x {r['positions']} | {r['cache']} | "
          f"{r['parameters_bytes'] / gib:.2f} | {r['kv_cache_bytes'] / gib:.2f} | "
          f"{r['activations_bytes'] / gib:.2f} | {r['per_device_bytes'] / gib:.2f} | "
          f"{r['device_bytes'] / gib:.1f} | {'yes' if r['fits'] else 'no'} |")


def _shard_bytes(tree) -> int:
  """Bytes of one device's shards of an abstract pytree (the largest shard of each leaf)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape)
    total += int(np.prod(shape)) * leaf.dtype.itemsize
  return total


def print_table(rows: list[dict]) -> None:
  gib = 2**30
  print("| model | mesh | remat | microbatch groups | parameters GiB | optimizer GiB | "
        "activations GiB | total GiB / device | device GiB | fits |")
  print("|---|---|---|---:|---:|---:|---:|---:|---:|---|")
  for r in rows:
    print(f"| {r['model']} | {r['mesh']} | {r['remat']} | {r['microbatch_groups']} | "
          f"{r['parameters_bytes'] / gib:.2f} | {r['optimizer_bytes'] / gib:.2f} | "
          f"{r['activations_bytes'] / gib:.2f} | {r['per_device_bytes'] / gib:.2f} | "
          f"{r['device_bytes'] / gib:.1f} | {'yes' if r['fits'] else 'no'} |")


if __name__ == "__main__":
  main()
