"""What the planner estimates without compiling: the per-device bytes of a row's parameters,
optimizer state, batch and KV cache (from the abstract inputs), and one RL step's analytic FLOPs
and projected time on a slice."""

from __future__ import annotations

import math
from typing import Any

from stabledrl_jax.plan import catalog
from stabledrl_jax.training.parallel import mesh as mesh_lib

def shard_bytes(tree) -> int:
  """One device's bytes of an abstract pytree with shardings (each leaf's largest shard)."""
  import jax  # pylint: disable=g-import-not-at-top
  return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
             for leaf in jax.tree.leaves(tree))


def state_bytes(what: str, config, devices) -> dict[str, int]:
  """Per device: the parameters' (and for train the optimizer's and the batch's) shards, and for
  the samplers the KV cache (2 x layers x rows x positions x kv heads x head dim, rows split over
  data x fsdp); from the abstract inputs, nothing compiled."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from stabledrl_jax import profiling  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.models import family as family_lib  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.config import specs  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.step import build
  if what == "train":
    _, state, batch, _ = build.abstract_update(config, devices)
    return dict(parameters_bytes=shard_bytes(state.params),
                optimizer_bytes=shard_bytes(state.opt_state), batch_bytes=shard_bytes(batch))
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  model_cfg = specs.model_config(config)
  _, state = build.abstract_params(config, mesh, model_cfg)
  r = config.rollout
  ways = mesh_lib.data_parallel_size(mesh)
  if what == "sampler":
    rows = (r.get("microbatch_groups", 0) or r.num_prompts) * r.group_size
    cached = family_lib.of(model_cfg).holds_kv_cache(r.get("cache", "none"))
  else:
    rows, cached = -(-config.eval.batch_size // ways) * ways, False
  shapes = profiling.flops_shapes(model_cfg)
  kv = 2 * shapes.n_layers * (rows // ways) * (r.prompt_length + r.gen_length) * (
      shapes.n_kv_heads * shapes.head_dim * jnp.dtype(model_cfg.dtype).itemsize)
  return dict(parameters_bytes=shard_bytes(state), kv_cache_bytes=int(kv) if cached else 0,
              rows=rows, positions=r.prompt_length + r.gen_length)


def rl_step_flops(config, *, cache: str | None = None) -> dict[str, Any]:
  """The analytic FLOPs of one RL step of a trainer config (``profiling.rl_step_flops_of_run``
  of its model config and run spec), by part."""
  from stabledrl_jax import profiling  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.config import specs  # pylint: disable=g-import-not-at-top
  resolved = specs.resolve(config, check=False)  # A count: the plan command checks first.
  return profiling.rl_step_flops_of_run(resolved.model, config.rollout, resolved.run,
                                        num_iterations=config.train.num_iterations, cache=cache)


def projection(config, *, config_label: str, overrides: list[str], topology: str,
               mfu: float) -> dict[str, Any]:
  """One RL step's analytic FLOPs and its time on ``topology`` at ``mfu`` (a projection)."""
  from stabledrl_jax import profiling  # pylint: disable=g-import-not-at-top
  name = catalog.topology_name(topology)
  chips, peak = catalog.chips(name), profiling.TPU_CHIP_PEAK_FLOPS[catalog.generation(name)]
  flops = rl_step_flops(config)
  step = profiling.projected_step_time(flops["total"], chips, peak, mfu)
  steps = int(config.train.num_steps)
  return dict(config=config_label, overrides=overrides, topology=topology, topology_name=name,
              chips=chips, peak_flops_per_chip=peak, mfu=mfu, step_flops=flops,
              step_seconds=step, num_steps=steps, run_hours=step * steps / 3600,
              cache=config.rollout.get("cache", "none"), projection=True)
