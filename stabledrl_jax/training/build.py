"""A run's parts, built on one path (docs/training.md, "One RL step"): the model, then from it
the graphdef, the run spec, the optimizer, the shardings, the state and the jitted update.

The trainer builds them concretely (``build_model``, ``parts``, ``initial_state``); the TPU
compile, the planner and the benchmarks build the same parts abstractly (``abstract_update``,
``abstract_params``): nothing is allocated, and nothing imports the trainer to compile.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from etils import epath
from flax import nnx

from stabledrl_jax import hub, input_files, models, workdir_files
from stabledrl_jax.models import hf_io, lora as lora_lib, peft_io
from stabledrl_jax.training import checkpointing, data, mesh as mesh_lib
from stabledrl_jax.training import rl_loss, run_spec as run_spec_lib, specs, train_step


# ---------------------------------------------------------------------------
# The model.
# ---------------------------------------------------------------------------


def build_model(config: ml_collections.ConfigDict, tokenizer, mesh) -> nnx.Module:
  """A checkpoint (``model.checkpoint``), else a fresh model of ``model.family``/``model.name``.

  Raises ValueError if the checkpoint is not of ``model.family``, or if its block size does
  not fit the rollout layout.
  """
  if not config.model.checkpoint:
    model_config = specs.model_config(config, tokenizer)
    return models.init_model(model_config, seed=config.seed, mesh=mesh)
  with input_files.named("config.model.checkpoint"):
    path = hub.local_path(config.model.checkpoint, download=config.model.download)
    model = models.from_pretrained(path, mesh=mesh, **_load_options(config))
  try:
    data.check_tokenizer(model.config, tokenizer)
  except ValueError as error:
    raise ValueError(f"config.tokenizer: {error} (model.checkpoint={config.model.checkpoint!r})"
                     ) from None
  if lora_lib.has_adapters(model):  # A PEFT adapter: its base with it.
    model = _continued_adapter(config, model)
  return check_loaded(config, model, config.model.checkpoint)


def _continued_adapter(config: ml_collections.ConfigDict, model: nnx.Module) -> nnx.Module:
  """A model loaded with a PEFT adapter: with ``model.lora.rank`` 0 its merged weights (every
  parameter trains); else the adapter itself trains on, if ``model.lora`` describes it (rank,
  alpha, the modules it adapts), as the official code continues one (the reference of KL terms
  is then its base)."""
  spec = lora_lib.spec_of(config.model.lora)
  if spec is None:
    return lora_lib.merge_adapters(model)
  adapters = lora_lib.adapters_of(model)
  rank, scale = next((a.a.shape[1], a.scale) for a in adapters.values())
  _check_adapter_spec(config, model, rank, scale, set(adapters))
  return model


def _check_adapter_spec(config: ml_collections.ConfigDict, model: nnx.Module, rank: int,
                        scale: float, adapted: set[str]) -> None:
  """Raises ValueError naming ``config.model.lora`` unless its rank, alpha and targets (on
  ``model``, abstract or not) describe the adapter of ``model.checkpoint``: rank ``rank``, scale
  alpha / r ``scale``, on the modules ``adapted``."""
  spec = lora_lib.spec_of(config.model.lora)
  chosen = set(lora_lib.targeted(model, spec))
  if (spec.rank, spec.scale) != (rank, scale) or chosen != adapted:
    short = sorted({name.rsplit(".", 1)[-1] for name in adapted})
    raise ValueError(
        f"config.model.lora: rank={spec.rank}, alpha={spec.alpha:g}, targets="
        f"{','.join(spec.targets)!r} do not describe the adapter model.checkpoint="
        f"{config.model.checkpoint!r} (r={rank}, lora_alpha={scale * rank:g}, {len(adapted)} "
        f"modules {','.join(short)}): set them so to train it on, or rank=0 to train its merged "
        "weights")


# What ``check_checkpoint`` reads of a checkpoint: its configs, no weights.
_CONFIG_FILES = ("config.json", "generation_config.json", "adapter_config.json")


def check_checkpoint(config: ml_collections.ConfigDict, tokenizer) -> None:
  """What ``build_model`` would refuse in ``model.checkpoint``, found from its config files
  alone (fetched from the Hub where it is an id, with no weight: a repository that cannot be
  fetched, offline, fails here): its family, rollout layout and sampler options
  (``specs.validate_model``), the tokenizer's fit, and a PEFT adapter's rank, alpha and
  targets against ``model.lora``. The trainer runs it before it creates anything in its
  workdir.

  Raises:
    ValueError / FileNotFoundError naming the config field.
  """
  if not config.model.checkpoint:
    return
  with input_files.named("config.model.checkpoint"):
    path = hub.local_path(config.model.checkpoint, files=_CONFIG_FILES,
                          download=config.model.download)
    input_files.check(path, "directory", what="checkpoint")
    adapter = None
    if peft_io.is_adapter_dir(path):
      adapter = peft_io.read_config(path)
      base = adapter["base_model_name_or_path"]
      model_config = models.load_config(hub.local_path(base, files=_CONFIG_FILES,
                                                       download=config.model.download))
    else:
      model_config = models.load_config(path)
  try:
    data.check_tokenizer(model_config, tokenizer)
  except ValueError as error:
    raise ValueError(f"config.tokenizer: {error} (model.checkpoint={config.model.checkpoint!r})"
                     ) from None
  specs.validate_model(config, model_config, config.model.checkpoint)
  if adapter is None or lora_lib.spec_of(config.model.lora) is None:
    return  # Rank 0: the adapter's merged weights train, whatever it adapts.
  with input_files.named("config.model.checkpoint"):
    local = hub.local_path(config.model.checkpoint, files=peft_io.FILES,
                           download=config.model.download)
    with contextlib.ExitStack() as stack:
      modules = peft_io.adapted_modules(
          local, hf_io.Reader(local, stack, single=peft_io.WEIGHTS_FILE))
  family = models.family.of(model_config)
  abstract = nnx.eval_shape(lambda: family.model_cls(model_config, rngs=nnx.Rngs(0)))
  rank = adapter["r"]
  _check_adapter_spec(config, abstract, rank, float(adapter["lora_alpha"]) / rank, set(modules))


def _load_options(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """``from_pretrained`` keywords: parameters stored in ``model.param_dtype`` (float32 master
  weights), computed in ``model.dtype``, with the run's model options (remat, scan_layers,
  attention)."""
  return dict(dtype=jnp.dtype(config.model.dtype), param_dtype=jnp.dtype(config.model.param_dtype),
              remat=config.model.remat, **specs.run_options(config))


def check_loaded(config: ml_collections.ConfigDict, model: nnx.Module, path: Any) -> nnx.Module:
  """A loaded model is of ``model.family`` and its sampler can decode the rollout layout."""
  family = models.family.of(model)
  if family.name != config.model.family:
    raise ValueError(f"config.model.family: {config.model.family!r}, but {path} holds a "
                     f"{family.name} model")
  family.check_rollout(config.rollout, model.config)
  return model


def load_pretrained(path: epath.Path, mesh, config: ml_collections.ConfigDict) -> nnx.Module:
  """``models.from_pretrained`` of a local or remote (copied to a local directory) checkpoint,
  with the run's dtypes and model options, as ``build_model``; checked by ``check_loaded``."""
  if checkpointing.is_local(path):
    model = models.from_pretrained(str(path), mesh=mesh, **_load_options(config))
  else:
    with workdir_files.local_staging() as local:
      target = epath.Path(local)
      for file in path.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
      model = models.from_pretrained(local, mesh=mesh, **_load_options(config))
  return check_loaded(config, model, path)


def with_lora(config: ml_collections.ConfigDict, model: nnx.Module, mesh=None) -> nnx.Module:
  """``model`` with ``config.model.lora``'s adapters (rank 0: as it is), created over ``mesh``,
  and its frozen base stored as ``model.lora.base_dtype`` (``lora.store_base``)."""
  section = config.model.get("lora")  # A workdir of an older version has none.
  spec = None if section is None else lora_lib.spec_of(section)
  if spec is None:
    return model
  if not lora_lib.has_adapters(model):  # A PEFT adapter's are kept (build_model).
    lora_lib.add_adapters(model, spec, seed=config.seed, mesh=mesh)
  return lora_lib.store_base(model, section.get("base_dtype", "bfloat16"))


def abstract_params(config: ml_collections.ConfigDict, mesh, model_config: Any = None,
                    *, seed: int = 0) -> tuple[Any, Any]:
  """(graphdef, params) of a fresh ``model_config`` (default: the config's) as the run holds it
  (``with_lora``: adapters on the stored base), params as ``jax.ShapeDtypeStruct`` sharded over
  ``mesh`` by the training rules. Nothing is allocated."""
  model_config = specs.model_config(config) if model_config is None else model_config
  graphdef, params = nnx.split(nnx.eval_shape(lambda: with_lora(
      config, models.init_model(model_config, seed=seed))), nnx.Param)
  params = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s),
                        params, models.param_shardings(params, mesh))
  return graphdef, params


# ---------------------------------------------------------------------------
# The parts of the update.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Parts:
  """What the RL step is built of, for one model on one mesh.

  Attributes:
    mesh: the device mesh.
    model_config: the model's config.
    graphdef: the model's graph (``nnx.split``); its parameters live in the state.
    run: the resolved run (``Resolved.run``): objective, likelihood, microbatches, LoRA.
    rollout: the resolved rollouts (``Resolved.rollout``): batch, prompts, sampler, eval.
    tx: the optimizer; ``schedule`` its learning rate per update, over ``num_updates``.
    state_shardings: the ``TrainState``'s shardings.
    batch_sharding: rows split over the mesh's data axes (rank-1 spec: any rank).
    replicated: a sharding that every device holds whole.
  """

  mesh: jax.sharding.Mesh
  model_config: Any
  graphdef: Any
  run: run_spec_lib.RunSpec
  rollout: run_spec_lib.RolloutSpec
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  num_updates: int
  state_shardings: Any
  batch_sharding: jax.sharding.NamedSharding
  replicated: jax.sharding.NamedSharding


def parts(resolved: run_spec_lib.Resolved, mesh, graphdef: Any, params: Any) -> Parts:
  """The parts of a resolved run (``specs.resolve``) on the model (``graphdef``, ``params``:
  concrete or abstract, with their shardings) placed on ``mesh``."""
  run = resolved.run
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  shardings = train_step.state_shardings(
      resolved.tx, params, jax.tree.map(lambda p: p.sharding, params), replicated,
      objective_state=run.initial_state(), lora=run.lora)
  return Parts(mesh=mesh, model_config=resolved.model, graphdef=graphdef, run=run,
               rollout=resolved.rollout, tx=resolved.tx, schedule=resolved.schedule,
               num_updates=resolved.num_updates, state_shardings=shardings,
               batch_sharding=models.batch_sharding(mesh, ndim=1), replicated=replicated)


def initial_state(parts_: Parts, params: Any, seed: int) -> train_step.TrainState:
  """A fresh ``TrainState`` of ``params``, placed by ``parts_.state_shardings``."""
  run = parts_.run
  return jax.jit(lambda p: train_step.create_train_state(
      p, parts_.tx, seed, run.initial_state(), lora=run.lora),
                 out_shardings=parts_.state_shardings)(params)


def make_update(parts_: Parts):
  """The jitted update of the run (``train_step.make_update_fn``), state donated and pinned."""
  return train_step.make_update_fn(
      parts_.graphdef, parts_.tx, state_shardings=parts_.state_shardings,
      batch_shardings=parts_.batch_sharding, replicated=parts_.replicated, run=parts_.run)


def abstract_batch(parts_: Parts) -> rl_loss.RolloutBatch:
  """A ``RolloutBatch`` of the run's P x G rollouts as ``jax.ShapeDtypeStruct``."""
  r = parts_.rollout
  n, length = r.num_rows, r.prompt_length + r.gen_length
  array = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=parts_.batch_sharding)
  logp = (n, length) if parts_.run.likelihood.token_level else (n,)
  return rl_loss.RolloutBatch(
      tokens=array((n, length), jnp.int32), prompt_mask=array((n, length), bool),
      completion_mask=array((n, length), bool), attention_mask=array((n, length), bool),
      advantages=array((n,), jnp.float32), old_logp=array(logp, jnp.float32),
      ref_logp=array(logp, jnp.float32),
      stressed=array((n,), bool) if r.stress_fraction > 0 else None)


def abstract_update(config: ml_collections.ConfigDict, devices=None):
  """The update of ``config`` and abstract inputs for it: nothing is allocated.

  For ahead-of-time compilation (the TPU compile, the planner):
  ``update.lower(state, batch, key).compile()``. The model is ``model.name`` fresh (not
  ``model.checkpoint``), placed on the config's mesh over ``devices`` (default: all) by the
  same rules as in training.

  Returns:
    (update, state, batch, key): the jitted update and ``jax.ShapeDtypeStruct`` pytrees of a
    ``TrainState``, a ``RolloutBatch`` of P x G rollouts and a PRNG key, with their shardings.
  """
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  resolved = specs.resolve(config, mesh.devices.size)
  graphdef, params = abstract_params(config, mesh, resolved.model, seed=config.seed)
  built = parts(resolved, mesh, graphdef, params)
  state = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      jax.eval_shape(lambda p: train_step.create_train_state(
          p, built.tx, config.seed, built.run.initial_state(), lora=built.run.lora), params),
      built.state_shardings)
  key = jax.eval_shape(lambda: jax.random.key(0))
  key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=built.replicated)
  return make_update(built), state, abstract_batch(built), key
