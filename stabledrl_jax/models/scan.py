"""Layers applied in turn as one `lax.scan` over their parameters (`scan_layers=True` configs).

The models keep one module per layer (checkpoint names, sharding rules and the sampler's KV
cache index layers that way); `scan_layers` stacks the parameters at each call instead, along a
new leading axis that no mesh axis splits. Under FSDP each scan iteration then gathers one
layer's kernels and reduces one layer's weight gradients, where XLA schedules an unrolled loop's
gathers and gradient all-reduces together (on its CPU backend: every layer's float32 kernels and
full gradients live at once, 1.6 GiB per LLaDA-8B layer).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from stabledrl_jax.models.sharding import constrain, logical_axes

Array = jax.Array


def _stack(*variables: nnx.Variable) -> nnx.Variable:
  """The layers' values of one parameter, [n_layers, ...], sharded like one layer's."""
  value = jnp.stack([v[...] for v in variables])
  axes = logical_axes(variables[0])
  return variables[0].replace(value if axes is None else constrain(value, (None,) + axes))


def scan_layers(layers: Sequence[nnx.Module], x: Array, apply: Callable[[Any, Array], Array], *,
                remat: bool) -> Array:
  """``x`` through ``apply(layer, x)`` for each layer in order, as a ``lax.scan``.

  Args:
    layers: modules of one structure (the same graphdef), e.g. a model's blocks.
    x: the carried activation.
    apply: (layer, x) -> x of the same shape; everything else it needs is closed over.
    remat: rematerialize each iteration in the backward pass.

  Returns:
    The result of the last layer; gradients flow back to every layer's own parameters.
  """
  return scan_layers_indexed(layers, x, lambda layer, _, x: apply(layer, x), remat=remat)


def scan_layers_indexed(layers: Sequence[nnx.Module], carry: Any,
                        apply: Callable[[Any, Any, Any], Any], *, remat: bool = False,
                        xs: Any = None) -> Any:
  """``carry`` through ``apply(layer, (i, xs[i]), carry)`` for each layer i, as a ``lax.scan``.

  ``xs``: a pytree whose leaves have a leading axis of len(layers) (e.g. a per-layer KV cache
  [n_layers, ...]); ``apply`` gets layer i's slice. The index i (a traced int32) lets ``apply``
  write into a carried per-layer buffer in place (``lax.dynamic_update_index_in_dim``).
  """
  graphdef, first = nnx.split(layers[0])
  states = [first] + [nnx.split(layer)[1] for layer in layers[1:]]
  stacked = jax.tree.map(_stack, *states, is_leaf=lambda v: isinstance(v, nnx.Variable))

  def body(carry, inputs):
    state, index, x = inputs
    return apply(nnx.merge(graphdef, state), (index, x), carry), None

  if remat:
    body = jax.checkpoint(body)
  index = jnp.arange(len(layers), dtype=jnp.int32)
  return jax.lax.scan(body, carry, (stacked, index, xs))[0]
