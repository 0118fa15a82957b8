"""Logical axis names of the model parameters and the default rules that place them on a mesh.

Each parameter dimension carries one logical name (unfused heads: q/k/v kernels keep the
torch layout [d_model, heads * head_dim], so a 'heads' dimension spans heads * head_dim):

    name       dimension                                  parameters
    'vocab'    embedding_size                             wte.embedding, lm_head.kernel
    'embed'    d_model                                    every kernel and the embedding
    'mlp'      mlp_hidden_size                            ff_proj, up_proj, ff_out
    'heads'    n_heads * head_dim                         q_proj, attn_out
    'kv_heads' n_kv_heads * head_dim                      k_proj, v_proj
    'norm'     d_model of an RMSNorm scale                attn_norm, ff_norm, ln_f

`LOGICAL_AXIS_RULES` maps them to the mesh axes ('data', 'fsdp', 'tensor'): the model dimension is
split over 'fsdp' (ZeRO-3 style: gathered per layer by XLA), the wide dimensions over 'tensor'
(Megatron style), norms replicated. 'batch' is the rule for activations and data: the model pins
its hidden states and logits to it with `constrain` (active when traced under a mesh, as the
trainer's steps are), so that XLA gathers the kernels rather than the activations. Splitting
'heads' / 'kv_heads' over 'tensor' falls on head boundaries when n_heads and n_kv_heads are
multiples of the 'tensor' size.

The rules are data: pass your own tuple to `param_shardings` (or to `flax.linen.logical_to_mesh_*`)
to change the layout without touching the model.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

LogicalRules = Sequence[tuple[str, Any]]

LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("norm", None),
)


def check_auto_mesh(mesh: Mesh) -> None:
  """The model relies on GSPMD propagation: every mesh axis must be `AxisType.Auto`."""
  explicit = [name for name, kind in zip(mesh.axis_names, mesh.axis_types)
              if kind != jax.sharding.AxisType.Auto]
  if explicit:
    raise ValueError(f"mesh axes {explicit} are not AxisType.Auto; the model has no explicit-"
                     "sharding annotations on activations. Create the mesh with "
                     "jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * n)")


def logical_axes(variable: nnx.Variable) -> tuple[str | None, ...] | None:
  """The logical axis names of a parameter (None if it has none)."""
  axes = variable.get_metadata().get("out_sharding")
  return tuple(axes) if axes else None


def partition_spec(axes: Sequence[str | None], shape: Sequence[int] | None, mesh: Mesh,
                   rules: LogicalRules = LOGICAL_AXIS_RULES) -> PartitionSpec:
  """Mesh PartitionSpec for an array with logical `axes` (None entries: replicated).

  Mesh axes the mesh does not have are dropped. Given `shape`, a dimension whose size is not
  divisible by the product of its mesh axes is replicated instead (XLA needs even shards), so
  small test configs shard wherever they can.
  """
  spec = tuple(nn.logical_to_mesh_axes(tuple(axes), tuple(rules)))
  spec += (None,) * (len(axes) - len(spec))
  sizes = (None,) * len(axes) if shape is None else tuple(shape)
  entries = []
  for size, mesh_axes in zip(sizes, spec):
    if mesh_axes is None:
      names = ()
    else:
      names = mesh_axes if isinstance(mesh_axes, tuple) else (mesh_axes,)
    names = tuple(n for n in names if n in mesh.shape)
    ways = 1
    for n in names:
      ways *= mesh.shape[n]
    if not names or (size is not None and size % ways):
      entries.append(None)
    else:
      entries.append(names[0] if len(names) == 1 else names)
  return PartitionSpec(*entries)


def param_shardings(tree: Any, mesh: Mesh, rules: LogicalRules = LOGICAL_AXIS_RULES) -> Any:
  """NamedSharding for every array in `tree` (a model, or its state, concrete or abstract).

  Arrays without axis names are replicated. The result has the structure of `nnx.state(tree)`
  when `tree` is a module, else of `tree`, with each Variable's value replaced by its sharding.
  """
  state = nnx.state(tree) if isinstance(tree, nnx.Module) else tree

  def one(x):
    if isinstance(x, nnx.Variable):
      axes = logical_axes(x)
      shape = x.shape
      spec = PartitionSpec() if axes is None else partition_spec(axes, shape, mesh, rules)
      return x.replace(NamedSharding(mesh, spec))
    return NamedSharding(mesh, PartitionSpec())

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def constrain(x: jax.Array, logical_axes: Sequence[str | None],
              rules: LogicalRules = LOGICAL_AXIS_RULES) -> jax.Array:
  """Pins an activation to the mesh axes of its logical axes, when a mesh is in context.

  Under `jax.sharding.use_abstract_mesh(mesh)` at trace time (the trainer traces its jitted steps
  so), `x` gets `with_sharding_constraint` to the spec of `logical_axes`; otherwise it is returned
  unchanged (single device, tests). Without these pins on the activations, GSPMD is free to
  split a product over the contracted model dimension (where 'fsdp' splits the kernels) and
  all-reduce full, unsharded outputs: for LLaDA-8B the [rows, 126464] logits of every row on
  every device.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, partition_spec(logical_axes, x.shape, mesh, rules))


def batch_sharding(mesh: Mesh, ndim: int = 2,
                   rules: LogicalRules = LOGICAL_AXIS_RULES) -> NamedSharding:
  """Sharding of a [B, ...] data array: the batch over the 'batch' rule's mesh axes."""
  spec = partition_spec(("batch",) + (None,) * (ndim - 1), None, mesh, rules)
  return NamedSharding(mesh, spec)


def init_sharded(build: Callable[[], nnx.Module], mesh: Mesh,
                 rules: LogicalRules = LOGICAL_AXIS_RULES) -> nnx.Module:
  """`build()` with every parameter created directly in its shards (no full host copy).

  `build` must be deterministic (it runs twice: abstractly for the shapes, then under jit).
  """
  check_auto_mesh(mesh)
  abstract = nnx.eval_shape(build)
  shardings = param_shardings(abstract, mesh, rules)

  @jax.jit
  def init():
    return jax.lax.with_sharding_constraint(nnx.state(build()), shardings)

  return nnx.merge(nnx.graphdef(abstract), init())
