"""A run's parts, built on one path (docs/training.md, "One RL step"): the model, then from it
the graphdef, the run spec, the optimizer, the shardings, the state and the jitted update.

The trainer builds them concretely (``build_model``, ``parts``, ``initial_state``); the TPU
compile, the planner and the benchmarks build the same parts abstractly (``abstract_update``,
``abstract_params``): nothing is allocated, and nothing imports the trainer to compile.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
from etils import epath
from flax import nnx

from stabledrl_jax import hub, input_files, models, workdir_files
from stabledrl_jax.models import lora as lora_lib, peft_io
from stabledrl_jax.training.config import optimizer as optimizer_lib, run_spec as run_spec_lib
from stabledrl_jax.training.config import specs
from stabledrl_jax.training.inputs import data
from stabledrl_jax.training.parallel import mesh as mesh_lib
from stabledrl_jax.training.step import rl_loss, train_step


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
    model = models.from_pretrained(path, mesh=mesh, lora_base=config.model.lora.get("base") or None,
                                   **_load_options(config))
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


def checkpoint_config(config: ml_collections.ConfigDict) -> Any:
  """The model config of ``model.checkpoint`` (a PEFT adapter's: its base's), from its config
  files alone (fetched from the Hub where it is an id, with no weight: a repository that cannot
  be fetched, offline, fails here); None without a checkpoint. Errors name the config field."""
  if not config.model.checkpoint:
    return None
  with input_files.named("config.model.checkpoint"):
    path = hub.local_path(config.model.checkpoint, files=_CONFIG_FILES,
                          download=config.model.download)
    input_files.check(path, "directory", what="checkpoint")
    adapter = peft_io.is_adapter_dir(path)
  base = config.model.lora.get("base")
  if base and not adapter:
    raise ValueError(f"config.model.lora.base: {base!r} replaces a PEFT adapter's base, but "
                     f"model.checkpoint {config.model.checkpoint!r} is no adapter (it has no "
                     f"{peft_io.CONFIG_FILE})")
  with input_files.named("config.model.lora.base" if base else "config.model.checkpoint"):
    if adapter:
      path = hub.local_path(peft_io.base_of(path, base), files=_CONFIG_FILES,
                            download=config.model.download)
    return models.load_config(path)


def check_checkpoint(config: ml_collections.ConfigDict, tokenizer, model_config: Any) -> None:
  """What ``build_model`` would refuse in ``model.checkpoint``, found from its config files
  alone (``model_config``, read by ``checkpoint_config``; None: no checkpoint, nothing to
  check): its family, rollout layout and sampler options (``specs.validate_model``), the
  tokenizer's fit, and a PEFT adapter's rank, alpha and targets against ``model.lora``. A run
  checks it before it creates anything in its workdir (``run_build.read_inputs``).

  Raises:
    ValueError / FileNotFoundError naming the config field.
  """
  if model_config is None:
    return
  specs.validate_model(config, model_config, config.model.checkpoint)
  with input_files.named("config.model.checkpoint"):
    path = hub.local_path(config.model.checkpoint, files=_CONFIG_FILES,
                          download=config.model.download)
    adapter = peft_io.read_config(path) if peft_io.is_adapter_dir(path) else None
  try:
    data.check_tokenizer(model_config, tokenizer)
  except ValueError as error:
    raise ValueError(f"config.tokenizer: {error} (model.checkpoint={config.model.checkpoint!r})"
                     ) from None
  if adapter is None or lora_lib.spec_of(config.model.lora) is None:
    return  # Rank 0: the adapter's merged weights train, whatever it adapts.
  with input_files.named("config.model.checkpoint"):
    local = hub.local_path(config.model.checkpoint, files=peft_io.FILES,
                           download=config.model.download)
    with contextlib.ExitStack() as stack:
      modules = peft_io.adapted_modules(local, peft_io.open_weights(local, stack))
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
  if workdir_files.is_local(path):
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
    optimizer: the optimizer's spec (``tx``, ``lr_schedule``: its learning rate per update).
    state_shardings: the ``TrainState``'s shardings.
    batch_sharding: rows split over the mesh's data axes (rank-1 spec: any rank).
    replicated: a sharding that every device holds whole.
    signature: what the jitted functions of the step depend on, hashable: ((the graph, the
      mesh, the run, the parameters' shapes, dtypes and shardings), the optimizer). They are
      memoized on it (``memoized``; the scoring passes on its first part, which no optimizer
      changes), so a second run of the same shape in one process traces nothing.
  """

  mesh: jax.sharding.Mesh
  model_config: Any
  graphdef: Any
  run: run_spec_lib.RunSpec
  rollout: run_spec_lib.RolloutSpec
  optimizer: optimizer_lib.OptimizerSpec
  state_shardings: Any
  batch_sharding: jax.sharding.NamedSharding
  replicated: jax.sharding.NamedSharding
  signature: Any

  def with_lr_scale(self, scale: float) -> Parts:
    """The same parts with the learning rate at ``scale`` x the configured one (the same
    optimizer state layout, so the shardings carry over)."""
    optimizer = self.optimizer.scaled(scale)
    return dataclasses.replace(self, optimizer=optimizer,
                               signature=(self.signature[0], optimizer))


def params_signature(params: Any) -> tuple[Any, ...]:
  """The parameters' tree, shapes, dtypes and shardings (concrete or abstract), hashable."""
  leaves, treedef = jax.tree.flatten(params)
  return treedef, tuple((tuple(x.shape), str(x.dtype), x.sharding) for x in leaves)


def parts(resolved: run_spec_lib.Resolved, mesh, graphdef: Any, params: Any) -> Parts:
  """The parts of a resolved run (``specs.resolve``) on the model (``graphdef``, ``params``:
  concrete or abstract, with their shardings) placed on ``mesh``."""
  run = resolved.run
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  shardings = train_step.state_shardings(
      resolved.tx, params, jax.tree.map(lambda p: p.sharding, params), replicated,
      objective_state=run.initial_state(), lora=run.lora)
  signature = ((graphdef, mesh, run, params_signature(params)), resolved.optimizer)
  return Parts(mesh=mesh, model_config=resolved.model, graphdef=graphdef, run=run,
               rollout=resolved.rollout, optimizer=resolved.optimizer, state_shardings=shardings,
               batch_sharding=models.batch_sharding(mesh, ndim=1), replicated=replicated,
               signature=signature)


# The jitted functions of the runs built in this process, by what they depend on (``memoized``).
_MEMO: collections.OrderedDict[Any, Any] = collections.OrderedDict()
_MEMO_SIZE = 64


def memoized(key: Any, make: Callable[[], Any]) -> Any:
  """``make()`` once per ``key`` (hashable) in this process, the last ``_MEMO_SIZE`` kept: a
  jitted function of a run's parts, so that a second run of the same shape (a test, a sweep, a
  rerun in a notebook) reuses its traces and executables."""
  try:
    _MEMO.move_to_end(key)
    return _MEMO[key]
  except KeyError:
    made = _MEMO[key] = make()
    while len(_MEMO) > _MEMO_SIZE:
      _MEMO.popitem(last=False)
    return made


def initial_state(parts_: Parts, params: Any, seed: int) -> train_step.TrainState:
  """A fresh ``TrainState`` of ``params``, placed by ``parts_.state_shardings``."""
  run = parts_.run
  create = memoized(("initial_state", parts_.signature, seed), lambda: jax.jit(
      lambda p: train_step.create_train_state(p, parts_.optimizer.tx, seed, run.initial_state(),
                                              lora=run.lora),
      out_shardings=parts_.state_shardings))
  return create(params)


def make_update(parts_: Parts):
  """The jitted update of the run (``train_step.make_update_fn``), state donated and pinned;
  memoized on the parts' signature."""
  return memoized(("update", parts_.signature), lambda: train_step.make_update_fn(
      parts_.graphdef, parts_.optimizer.tx, state_shardings=parts_.state_shardings,
      batch_shardings=parts_.batch_sharding, replicated=parts_.replicated, run=parts_.run))


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


def abstract_parts(config: ml_collections.ConfigDict, devices=None
                   ) -> tuple[Parts, train_step.TrainState, rl_loss.RolloutBatch, Any]:
  """The parts of ``config`` and abstract inputs for its programs: nothing is allocated. The
  model is ``model.name`` fresh (not ``model.checkpoint``), placed on the config's mesh over
  ``devices`` (default: all) by the same rules as in training.

  Returns:
    (parts, state, batch, key): ``jax.ShapeDtypeStruct`` pytrees of a ``TrainState``, a
    ``RolloutBatch`` of P x G rollouts and a PRNG key, with their shardings.
  """
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  resolved = specs.resolve(config, mesh.devices.size)
  graphdef, params = abstract_params(config, mesh, resolved.model, seed=config.seed)
  built = parts(resolved, mesh, graphdef, params)
  state = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      jax.eval_shape(lambda p: train_step.create_train_state(
          p, built.optimizer.tx, config.seed, built.run.initial_state(),
          lora=built.run.lora), params),
      built.state_shardings)
  key = jax.eval_shape(lambda: jax.random.key(0))
  key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=built.replicated)
  return built, state, abstract_batch(built), key


def abstract_update(config: ml_collections.ConfigDict, devices=None):
  """The update of ``config`` and abstract inputs for it (``abstract_parts``), for
  ahead-of-time compilation: ``update.lower(state, batch, key).compile()``.

  Returns:
    (update, state, batch, key): the jitted update and the abstract inputs.
  """
  built, state, batch, key = abstract_parts(config, devices)
  return make_update(built), state, batch, key
