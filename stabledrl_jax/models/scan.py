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


def _apply(layer: nnx.Module, x: Array, *args: Any) -> Array:
  return layer(x, *args)


# graph_updates=False: the layer's variables are inputs, never written back, so the remat also
# runs inside a sampler's loops, whose trace cannot update variables of the enclosing one.
_apply_remat = nnx.remat(_apply, graph_updates=False)


def _span_fn(length: int) -> Callable[..., Array]:
  """Applies a layer to the queries of positions start..start+length-1 (length static)."""

  def apply(layer: nnx.Module, x: Array, *args_and_start: Any) -> Array:
    *args, start = args_and_start
    return layer(x, *args, (start, length))

  return apply


def apply_layers(layers: Sequence[nnx.Module], x: Array, *args: Any, remat: bool, scan: bool,
                 axes: tuple[Any, ...], span: tuple[Array | int, int] | None = None) -> Array:
  """``x`` through ``layer(x, *args)`` for each layer in order, the last on ``span`` alone.

  Args:
    layers: the model's layers (LLaDA's blocks, Dream's decoder layers), each called as
      ``layer(x, *args)`` and, for the last with a span, ``layer(x, *args, span)``.
    x: [B, L, D] activations.
    *args: what every layer takes besides ``x`` (rotary angles, the key mask).
    remat: rematerialize each layer in the backward pass.
    scan: all but the last layer as one ``lax.scan`` (``scan_layers``).
    axes: the activations' logical axes between layers (``sharding.constrain``).
    span: (start, n), n static: the last layer computes only those queries.

  Returns:
    The last layer's output, [B, L, D] (or [B, n, D] with a span), not constrained.
  """
  apply = _apply_remat if remat else _apply
  *body, last = layers
  if scan and body:
    x = scan_layers(body, x, lambda layer, x: constrain(layer(x, *args), axes), remat=remat)
  else:
    for layer in body:
      x = constrain(apply(layer, x, *args), axes)
  if span is None:
    return apply(last, x, *args)
  apply_span = _span_fn(int(span[1]))
  if remat:
    apply_span = nnx.remat(apply_span, graph_updates=False)
  return apply_span(last, x, *args, span[0])


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
