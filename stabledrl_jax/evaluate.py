r"""Evaluate a checkpoint: d1-protocol generations for each task and length, then d1 scoring.

    python -m stabledrl_jax.evaluate --checkpoint PATH --task gsm8k|math500|countdown|sudoku|all \
        --gen_lengths 128,256,512 --output_dir DIR

PATH is a training workdir (its latest orbax checkpoint, or --step) or a Hugging Face checkpoint
directory (see training/state/checkpoint_source.py). The prompt style, the tokenizer and synthetic
test sets follow the checkpoint's training config (a workdir's config.json, the stabledrl_jax.json
of an export): an export evaluates as its workdir. A checkpoint without one gets d1's prompts, and a
line on stderr says what was guessed. For each task and generation length the test examples become
left-padded prompts, decoded with d1's settings (steps = length / 2, blocks of 32, greedy; each can
be overridden) in batches split over the data axes of the mesh, and are written in d1's format to
DIR/TASK_MODEL_GENLEN_STEPS_SHARD_generations.json, one file per shard of --shard_size examples.
Then the table and JSON of the scoring CLI (`python -m stabledrl_jax.scoring DIR`) for every
generation file in DIR.

Resuming: each shard file is written atomically once all its rows are decoded, so rerunning the
same command skips the finished shards and starts at the first unfinished one. Row noise comes
from fold_in(seed, shard, batch), so a resumed run writes what an uninterrupted one would.

Several processes (docs/pods.md; on TPU pods, Slurm and Open MPI detected, elsewhere
--coordinator_address HOST:PORT --num_processes N --process_id I): process p of P decodes shards
p, p + P, ... on a mesh of its own devices, so file names never collide and no process waits
for another before the end; then process 0 scores the directory (with every process's files
when the directory is shared).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pathlib
import re
import signal
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm
from absl import app, flags, logging

from stabledrl_jax import hub, models, path_args, scoring, tasks, workdir_files
from stabledrl_jax.models import family as family_lib
from stabledrl_jax.training.config import config_lib, run_spec
from stabledrl_jax.training.inputs import data
from stabledrl_jax.training.parallel import mesh as mesh_lib, multihost
from stabledrl_jax.training.state import checkpoint_source
from stabledrl_jax.training.step import decoding

D1_ASSISTANT_PREFIX = "<reasoning>"
_MODEL_NAME = re.compile(r"[A-Za-z0-9.-]+")


# The sampler settings of one decoding setup (d1's: `SamplerSettings.d1(gen_length)`).
SamplerSettings = run_spec.Decoding


@dataclasses.dataclass(frozen=True)
class PromptStyle:
  """How a question becomes a prompt (`data.format_prompt`) and its length.

  Attributes:
    with_instruction: the task's instruction before the question.
    assistant_prefix: the start of the assistant's turn, for chat tokenizers.
    length: P, the padded prompt length (0: the longest prompt of the task).
    template: the prompt style (``tasks.PROMPT_STYLES``: 'd1' or 'stabledrl').
  """

  with_instruction: bool = True
  assistant_prefix: str = ""
  length: int = 0
  template: str = tasks.DEFAULT_PROMPT_STYLE


# ---------------------------------------------------------------------------
# Test data, prompts and file names.
# ---------------------------------------------------------------------------


def load_test_set(task_name: str, source: str = "", *, data_dir: str = str(tasks.PACKAGED_DATA),
                  limit: int = 0, seed: int = 0,
                  workdir_config: ml_collections.ConfigDict | None = None
                  ) -> list[tasks.Example]:
  """The examples a task is evaluated on.

  Args:
    task_name: a registered task.
    source: '' (d1's test set: DATA_DIR/countdown_cd3_test.jsonl, DATA_DIR/4x4_test_sudoku.csv,
      the Hub's test splits of gsm8k and math500), a local file, a directory of d1 generation
      files (the questions of the task's first setup there, e.g. those of d1's baselines),
      'hub' (the task's Hub dataset), a Hub dataset name, or 'synthetic' (the task's generator;
      for a checkpoint of a workdir that trained this task, seeded and configured as that
      workdir's held-out set).
    data_dir: where d1's test files are (default: the copies that ship with the package).
    limit: keep the first `limit` examples (0: all; 'synthetic': how many, default 256).
    seed: the generator's seed (config.seed; the held-out set uses seed + 1).
    workdir_config: the training config of the checkpoint's workdir, if any.
  """
  task = tasks.get_task(task_name)
  if source == "synthetic":
    if workdir_config is not None and workdir_config.task.name == task.name:
      config = copy.deepcopy(workdir_config)
    else:
      config = config_lib.base_config()
      config.seed = seed
      config.task.name = task.name
    config.data.eval = "synthetic"
    config.data.eval_size = limit or config.data.eval_size or 256
    return list(data.make_examples(config, "eval"))
  if source and os.path.isdir(source):
    records = scoring.setup_records(source, task.name)[:limit or None]
    return [task.example_from_record(record) for record in records]
  if not source and task.test_file:
    source = os.path.join(data_dir, task.test_file)
    if not os.path.isfile(source):
      raise FileNotFoundError(f"d1's {task.name} test set {source} does not exist; point "
                              f"--data_dir at it, or give another source (--data {task.name}="
                              "synthetic, a file or a Hub dataset)")
  hub_default = source in ("", "hub")
  try:
    return tasks.load_examples(task, None if hub_default else source, split="test",
                               limit=limit or None)
  except ImportError as error:  # No `datasets`: say how to evaluate offline.
    raise ImportError(f"{error} A directory of d1 generation files also gives a test set: "
                      f"--data {task.name}=DIR.") from None


def styled_prompts(tokenizer, task: tasks.Task, examples: Sequence[tasks.Example],
                   style: PromptStyle) -> tuple[np.ndarray, np.ndarray]:
  """The examples' prompts in ``style``, left-padded by ``data.encode_prompts``: tokens [N, P]
  int32 and their mask [N, P] bool (True: real token)."""
  texts = [data.format_prompt(tokenizer, task, example, with_instruction=style.with_instruction,
                              assistant_prefix=style.assistant_prefix, style=style.template)
           for example in examples]
  return data.encode_prompts(tokenizer, texts, style.length or None)


def block_aligned(style: PromptStyle, tokenizer, task: tasks.Task,
                  examples: Sequence[tasks.Example], block_size: int | None,
                  settings: Sequence[SamplerSettings]) -> PromptStyle:
  """``style`` with a prompt length that fills whole blocks of a block diffusion model (SDAR's
  blocks are fixed by absolute position); unchanged for full attention.

  Raises:
    ValueError: ``--prompt_length`` or a generation length is not a multiple of the block size.
  """
  if not block_size:
    return style
  for setting in settings:
    if setting.gen_length % block_size:
      raise ValueError(f"generation length {setting.gen_length} is not a multiple of the "
                       f"model's block size {block_size}")
  if style.length:
    if style.length % block_size:
      raise ValueError(f"--prompt_length={style.length} is not a multiple of the model's block "
                       f"size {block_size}")
    return style
  width = styled_prompts(tokenizer, task, examples, style)[0].shape[1]
  return dataclasses.replace(style, length=-(-width // block_size) * block_size)


def model_name_of(name: str) -> str:
  """`name` as the MODEL field of a file name: runs of characters other than letters, digits, '.'
  and '-' become '-', so that the name's fields split on '_' unambiguously."""
  return re.sub(r"[^A-Za-z0-9.-]+", "-", name).strip("-") or "model"


def generation_path(output_dir: str | os.PathLike, task_name: str, model_name: str,
                    settings: SamplerSettings, shard: int) -> pathlib.Path:
  """DIR/TASK_MODEL_GENLEN_STEPS_SHARD_generations.json, d1's naming."""
  if not _MODEL_NAME.fullmatch(model_name):
    raise ValueError(f"model name {model_name!r} may hold only letters, digits, '.' and '-'")
  return pathlib.Path(output_dir) / (f"{task_name}_{model_name}_{settings.gen_length}_"
                                     f"{settings.steps}_{shard}_generations.json")


def shard_ids(num_examples: int, shard_size: int, process_index: int = 0,
              process_count: int = 1) -> list[int]:
  """The shards host `process_index` of `process_count` writes: p, p + P, p + 2P, ...

  Shard k always holds examples [k * shard_size, (k + 1) * shard_size), whatever the number of
  hosts, so a run resumed on another number of hosts keeps the finished shards.
  """
  num_shards = -(-num_examples // shard_size)
  return list(range(process_index, num_shards, process_count))


# ---------------------------------------------------------------------------
# Generation.
# ---------------------------------------------------------------------------


def sample_completions(model: Any, prompt_tokens: np.ndarray, prompt_mask: np.ndarray,
                       settings: SamplerSettings, *, mesh: jax.sharding.Mesh, batch_size: int,
                       key: jax.Array, progress: tqdm.tqdm | None = None) -> np.ndarray:
  """Completions of every prompt, decoded in batches split over this process's ``mesh``
  (``decoding.generate_batches``, the path every evaluation shares): [N, G] int32 numpy.

  Args:
    model: a model of any family (parameters placed on `mesh`).
    prompt_tokens: [N, P] left-padded prompts.
    prompt_mask: [N, P] bool, True for real prompt tokens.
    settings: the sampler's options; decoding stops once every row of a block has ended.
    mesh: the (data, fsdp, tensor) mesh of this process's devices.
    batch_size: rows per sampler call, padded to a multiple of data x fsdp.
    key: PRNG key; batch b draws from fold_in(key, b).
    progress: optional tqdm bar, advanced by the real rows of each batch.

  Returns:
    [N, G] completion tokens; every token after a row's first EOS is EOS.
  """
  settings = dataclasses.replace(settings, stop_at_eos=True)
  return decoding.generate_batches(model, prompt_tokens, prompt_mask, key, settings, mesh=mesh,
                                   batch_size=batch_size, progress=progress).completions


def _check_sizes(batch_size: int, shard_size: int) -> None:
  if batch_size < 1 or shard_size < 1:
    raise ValueError(f"batch size ({batch_size}) and shard size ({shard_size}) must be >= 1")


def _check_finished(path: pathlib.Path, header: dict[str, Any],
                    examples: Sequence[tasks.Example]) -> None:
  """Raises ValueError unless the shard at `path` was written with `header` for `examples`."""
  # A FIFO or a device named like the shard is one line naming it, never opened.
  text = workdir_files.read_bytes(path, "generation file", error=ValueError)
  try:
    written = json.loads(text)
  except ValueError as error:
    raise ValueError(f"{path} is not a readable generation file ({error}); delete it to decode "
                     "its shard again") from None
  questions = [record.get("question") for record in written.get("generations", [])]
  if written.get("settings") != header or questions != [ex.question for ex in examples]:
    raise ValueError(f"{path} holds generations of other settings or examples; evaluate into "
                     "another output directory or under another model name")


def generate_shards(model: Any, tokenizer, task: tasks.Task,
                    examples: Sequence[tasks.Example], settings: SamplerSettings, *,
                    output_dir: str | os.PathLike, model_name: str, mesh: jax.sharding.Mesh,
                    key: jax.Array, style: PromptStyle = PromptStyle(), batch_size: int = 64,
                    shard_size: int = 128, process_index: int = 0, process_count: int = 1,
                    metadata: dict[str, Any] | None = None) -> list[pathlib.Path]:
  """Decodes this host's unfinished shards of `examples` and writes each in d1's format.

  A shard already in `output_dir` is checked (same settings, same questions) and skipped, so an
  interrupted run resumes at its first unfinished shard.

  Args:
    model, tokenizer, task: the policy, its tokenizer and the `tasks.Task`.
    examples: the test set; shard k holds examples [k * shard_size, (k + 1) * shard_size).
    settings: the sampler's options.
    output_dir: where the generation files go.
    model_name: the MODEL field of the file names.
    mesh: the device mesh of `model`.
    key: PRNG key; shard k, batch b draws from fold_in(fold_in(key, k), b).
    style: prompt formatting and length.
    batch_size, shard_size: rows per sampler call, examples per file.
    process_index, process_count: this host and the number of hosts (see `shard_ids`).
    metadata: extra top-level fields of every file (d1 keeps model_path etc. there).

  Returns:
    The paths of this host's shards, finished now or before.
  """
  _check_sizes(batch_size, shard_size)
  os.makedirs(output_dir, exist_ok=True)  # The user's own directory: a link to one is fine.
  # Every shard pads to the task's longest prompt: one compiled shape for the whole set, and the
  # same on every host.
  tokens, mask = styled_prompts(tokenizer, task, examples, style)
  # What a finished shard must match to be kept (JSON round trip: lists, not tuples).
  header = json.loads(json.dumps({**settings.describe(),
                                  "prompt": dataclasses.asdict(style),
                                  "shard_size": shard_size, "num_examples": len(examples)}))
  mine = shard_ids(len(examples), shard_size, process_index, process_count)
  paths, pending = [], []
  for shard in mine:
    path = generation_path(output_dir, task.name, model_name, settings, shard)
    rows = slice(shard * shard_size, (shard + 1) * shard_size)
    if path.exists():
      _check_finished(path, header, examples[rows])
    else:
      pending.append((shard, rows, path))
    paths.append(path)
  total = sum(len(examples[rows]) for _, rows, _ in pending)
  progress = tqdm.tqdm(total=total, desc=f"{task.name} {settings.gen_length}", unit="example",
                       dynamic_ncols=True, disable=not total)
  try:
    for shard, rows, path in pending:
      start = time.perf_counter()
      completions = sample_completions(model, tokens[rows], mask[rows], settings, mesh=mesh,
                                       batch_size=batch_size, key=jax.random.fold_in(key, shard),
                                       progress=progress)
      texts = data.decode_completions(tokenizer, completions)
      scoring.write_generations(
          path, examples[rows], texts, **(metadata or {}), gen_length=settings.gen_length,
          diffusion_steps=settings.steps, block_length=settings.block_length,
          metrics={"wall_time": time.perf_counter() - start, "total_processed": len(texts)},
          shard=shard, settings=header)
  finally:
    progress.close()
  return paths


# ---------------------------------------------------------------------------
# The command.
# ---------------------------------------------------------------------------


# The sampler flags default to the one set of decoding defaults (`run_spec.Decoding`).
_DECODING = {field.name: field.default for field in dataclasses.fields(run_spec.Decoding)}


@dataclasses.dataclass(frozen=True)
class Options:
  """Everything a run needs; the CLI flags of the same names (see `define_flags`)."""

  checkpoint: str
  task: Sequence[str]
  output_dir: str
  gen_lengths: Sequence[int] = (128, 256, 512)
  step: int | None = None
  lora_base: str = ""
  steps: int = _DECODING["steps"]
  block_length: int | None = None  # None: the family's official (Family.eval_decoding), or d1's
  temperature: float = _DECODING["temperature"]
  remasking: str | None = None  # None: as block_length
  threshold: float = _DECODING["threshold"]
  cfg_scale: float = _DECODING["cfg_scale"]
  cache: str = _DECODING["cache"]
  batch_size: int = 64
  shard_size: int = 128
  limit: int = 0
  data: Sequence[str] = ()
  data_dir: str = str(tasks.PACKAGED_DATA)
  seed: int = 0
  model_name: str = ""
  tokenizer: str = ""
  dtype: str = "auto"
  mesh: Sequence[int] = (-1, 1, 1)
  prompt_length: int = 0
  with_instruction: bool | None = None
  prompt_style: str | None = None
  assistant_prefix: str | None = None
  output: str = ""


def task_names(requested: Sequence[str]) -> list[str]:
  """'all' -> the evaluation suite (``tasks.suite()``: d1's four tasks); otherwise each name
  checked against the registry."""
  names = []
  for name in requested:
    if name == "all":
      names.extend(tasks.suite())
    elif name in tasks.list_tasks():
      names.append(name)
    else:
      raise ValueError(f"unknown task {name!r}; choose from {', '.join(tasks.list_tasks())} "
                       "or 'all'")
  return list(dict.fromkeys(names))


def data_sources(pairs: Sequence[str], names: Sequence[str]) -> dict[str, str]:
  """'task=source' pairs -> {task: source}; tasks not named get '' (d1's test set)."""
  sources = {name: "" for name in names}
  for pair in pairs:
    task, sep, source = pair.partition("=")
    if not sep or task not in sources:
      raise ValueError(f"data source {pair!r} is not TASK=SOURCE for an evaluated task "
                       f"({', '.join(names)})")
    sources[task] = source
  return sources


def decoding_settings(options: Options, model_config: Any) -> list[SamplerSettings]:
  """One decoding setup per generation length: the command line's options, and where it names
  no block length or remasking rule, the model family's official evaluation settings
  (``Family.eval_decoding``: Dream's whole-completion entropy decoding), else d1's."""
  official = family_lib.of(model_config).eval_decoding
  given = {k: v for k, v in (("block_length", options.block_length),
                             ("remasking", options.remasking)) if v is not None}
  settings = []
  for length in options.gen_lengths:
    fields = dict(block_length=_DECODING["block_length"], remasking=_DECODING["remasking"])
    fields.update(official(length))
    fields.update(given)
    settings.append(SamplerSettings.d1(length, steps=options.steps,
                                       temperature=options.temperature,
                                       threshold=options.threshold, cfg_scale=options.cfg_scale,
                                       cache=options.cache, **fields))
  return settings


def _check_decoding(settings: Sequence[SamplerSettings], model_config: Any, where: str) -> None:
  """Raises ValueError, naming the checkpoint and its family, unless its sampler takes every
  setting (``Decoding.check``)."""
  for setting in settings:
    try:
      setting.check(model_config)
    except ValueError as error:
      family = family_lib.of(model_config).name
      raise ValueError(f"{where} (a {family} checkpoint): {error}") from None


def _check_positions(gen_length: int, model_config: Any) -> None:
  """Raises ValueError naming ``--gen_lengths`` if a completion of ``gen_length`` tokens alone
  exceeds the positions the model is made for (``Family.max_positions``: config.json's
  max_position_embeddings, LLaDA's max_sequence_length). Prompt and completion together may go
  past them, as the official evaluations allow: rotary positions go on there."""
  family = family_lib.of(model_config)
  limit = family.max_positions(model_config)
  if limit is not None and gen_length > limit:
    raise ValueError(f"--gen_lengths {gen_length}: more than the {limit} positions the "
                     f"{family.name} model is made for; use at most {limit}")


def _prompt_style(options: Options, source: checkpoint_source.CheckpointSource,
                  tokenizer: Any) -> PromptStyle:
  """The prompts' style: the options', else those the workdir trained on, else d1's (the
  task's instruction, d1's template)."""
  with_instruction = options.with_instruction
  if with_instruction is None:
    with_instruction = (source.config.task.with_instruction if source.config is not None
                        else True)
  template = options.prompt_style
  if template is None:
    template = (source.config.task.get("prompt_style", tasks.DEFAULT_PROMPT_STYLE)
                if source.config is not None else tasks.DEFAULT_PROMPT_STYLE)
  if template not in tasks.PROMPT_STYLES:
    raise ValueError(f"--prompt_style {template!r} is not one of {tasks.PROMPT_STYLES}")
  prefix = options.assistant_prefix
  if prefix is None:
    prefix = default_assistant_prefix(tokenizer, template)
  return PromptStyle(with_instruction, prefix, options.prompt_length, template)


def run(options: Options) -> dict[str, scoring.SetupResult] | None:
  """Generates the missing shards of every task and length, then scores OUTPUT_DIR.

  Returns:
    {setup: scoring.SetupResult} of every setup in OUTPUT_DIR (host 0; other hosts: None).

  Raises:
    ValueError, FileNotFoundError: bad options, found before any model is loaded when possible.
  """
  # Everything cheap is checked before the model is loaded.
  if not isinstance(options.limit, int) or options.limit < 0:
    raise ValueError(f"--limit must be >= 1 (or 0, the default: every example), got "
                     f"{options.limit}")
  if not 0 <= options.temperature <= run_spec.MAX_TEMPERATURE:  # NaN is not.
    raise ValueError(f"--temperature must be finite and >= 0, at most "
                     f"{run_spec.MAX_TEMPERATURE:g} (0: greedy; far above 1 the completions are "
                     f"close to uniform noise), got {options.temperature}")
  names = task_names(options.task)
  sources = data_sources(options.data, names)
  if not options.gen_lengths:
    raise ValueError("no generation length given")
  _check_sizes(options.batch_size, options.shard_size)
  if options.model_name and not _MODEL_NAME.fullmatch(options.model_name):
    raise ValueError(f"model name {options.model_name!r} may hold only letters, digits, '.' "
                     "and '-' (its fields are split on '_')")
  path_args.check(options.output_dir, "--output_dir")  # Empty: the current directory.
  if options.output:  # '' is OUTPUT_DIR/results.json.
    path_args.check(options.output, "--output")
  if any(not isinstance(n, int) or n < 1 for n in options.gen_lengths):
    raise ValueError(f"--gen_lengths must be positive integers, got {list(options.gen_lengths)}")
  if multihost.is_primary():  # Before any decoding: a run must not end unable to write.
    workdir_files.check_writable(options.output_dir, "--output_dir")
    if options.output:
      workdir_files.check_writable(os.path.dirname(os.path.abspath(options.output)), "--output")
  try:
    mesh = mesh_lib.make_mesh(ml_collections.ConfigDict(dict(zip(mesh_lib.MESH_AXES,
                                                                 options.mesh))),
                              devices=jax.local_devices())
  except ValueError as error:
    raise ValueError(f"mesh (data, fsdp, tensor) = {tuple(options.mesh)}: {error}") from None
  dtype = options.dtype
  if dtype == "auto":  # bf16 wherever it is fast; float32 on CPUs.
    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
  dtype = jnp.dtype(dtype)
  if hub.is_hub_id(options.checkpoint):  # Its config.json alone first: before any weight fetch.
    hub_config = models.load_config(options.checkpoint, dtype=dtype, param_dtype=dtype)
    _check_decoding(decoding_settings(options, hub_config), hub_config, options.checkpoint)
  source = checkpoint_source.resolve(options.checkpoint, options.step,
                                     lora_base=options.lora_base)
  model_config = checkpoint_source.model_config(source, dtype=dtype)
  settings = decoding_settings(options, model_config)
  _check_decoding(settings, model_config, source.path)  # No weight is read yet.
  _check_positions(max(options.gen_lengths), model_config)
  tokenizer = checkpoint_source.load_tokenizer(source, options.tokenizer)
  data.check_tokenizer(model_config, tokenizer)
  test_sets = {name: load_test_set(name, sources[name], data_dir=options.data_dir,
                                   limit=options.limit, seed=options.seed,
                                   workdir_config=source.config) for name in names}

  style = _prompt_style(options, source, tokenizer)
  # Each task's prompt layout, before any weight is read.
  styles = {name: block_aligned(style, tokenizer, tasks.get_task(name), test_sets[name],
                                family_lib.block_size(model_config), settings)
            for name in names}
  if multihost.is_primary():
    note = guess_note(source, options, style, sources)
    if note:
      print(note, file=sys.stderr)
  model = checkpoint_source.load_model(source, mesh=mesh, dtype=dtype)
  model_name = options.model_name or model_name_of(source.name)
  # d1's fields: the base model, and what was loaded into it ('' for none).
  metadata = {"model_path": source.path, "checkpoint_path": (
      source.checkpoint_path if source.kind == checkpoint_source.WORKDIR else "")}
  key = jax.random.key(options.seed)
  for name in names:
    for setting in settings:
      generate_shards(model, tokenizer, tasks.get_task(name), test_sets[name], setting,
                      output_dir=options.output_dir, model_name=model_name, mesh=mesh, key=key,
                      style=styles[name], batch_size=options.batch_size,
                      shard_size=options.shard_size,
                      process_index=jax.process_index(), process_count=jax.process_count(),
                      metadata=metadata)
  multihost.sync("stabledrl_jax.evaluate: all shards written")
  if jax.process_index() != 0:
    return None
  output = options.output or os.path.join(options.output_dir, "results.json")
  return scoring.report([options.output_dir], output)


def default_assistant_prefix(tokenizer, template: str) -> str:
  """d1's evaluation starts the assistant's turn with "<reasoning>" (chat tokenizers only); the
  official StableDRL prompts end with the chat template's generation prompt alone."""
  if template != "d1" or not hasattr(tokenizer, "chat_prompt"):
    return ""
  return D1_ASSISTANT_PREFIX


def guess_note(source: checkpoint_source.CheckpointSource, options: Options,
               style: PromptStyle, sources: dict[str, str]) -> str:
  """The one line that says which prompt style and data a run guessed, for a checkpoint that
  carries no training config (a plain Hugging Face checkpoint); '' when nothing was guessed."""
  guessed = []
  if source.config is None:
    if options.with_instruction is None:
      guessed.append(f"with_instruction={style.with_instruction}")
    if options.assistant_prefix is None:
      guessed.append(f"assistant_prefix={style.assistant_prefix!r}")
    if options.prompt_style is None and style.with_instruction:
      guessed.append(f"prompt_style={style.template}")
  for name, data_source in sources.items():
    if data_source == "synthetic" and (source.config is None
                                       or source.config.task.name != name):
      guessed.append(f"{name}=synthetic from the default generator (seed {options.seed})")
  if not guessed:
    return ""
  where = ("carries no training config (no "
           f"{checkpoint_source.EXPORT_FILE}, not inside a training workdir)"
           if source.config is None else
           f"was trained on {source.config.task.name!r}, not on every task evaluated")
  used = ", ".join(f"{name}={data_source or 'd1-test-set'}"
                   for name, data_source in sources.items())
  return f"note: {source.path} {where}; guessed {', '.join(guessed)}; data {used}"


def define_flags() -> None:
  defaults = Options(checkpoint="", task=(), output_dir="")
  flags.DEFINE_string("checkpoint", None, "A training workdir or a Hugging Face checkpoint "
                      "directory.")
  flags.DEFINE_list("task", None, "gsm8k, math500, countdown, sudoku (comma-separated) or all.")
  flags.DEFINE_string("output_dir", None, "Where the generation files and results.json go.")
  flags.DEFINE_list("gen_lengths", [str(n) for n in defaults.gen_lengths],
                    "Generation lengths, each a multiple of the block length, at most the "
                    "model's positions (config.json's max_position_embeddings).")
  flags.DEFINE_integer("step", None, "Checkpoint step of a workdir (default: the latest).")
  flags.DEFINE_string("lora_base", defaults.lora_base, "A PEFT adapter's base model (a Hub id or "
                      "directory) in place of the one its adapter_config.json names.")
  flags.DEFINE_integer("steps", defaults.steps, "Denoising steps (0: gen_length / 2, d1's).")
  flags.DEFINE_integer("block_length", defaults.block_length, "Semi-autoregressive block size "
                       "(default: the model family's official evaluation: 32 for LLaDA, d1's; "
                       "the whole completion for Dream).")
  flags.DEFINE_float("temperature", defaults.temperature, "Sampling temperature (0: greedy; at "
                     "most 100).")
  flags.DEFINE_string("remasking", defaults.remasking,
                      "Remasking rule, any the model's sampler takes (LLaDA: low_confidence, "
                      "random, threshold; SDAR: low_confidence, low_confidence_static, "
                      "low_confidence_dynamic; Dream: origin, maskgit_plus, topk_margin, "
                      "entropy). Default: the family's official (low_confidence; Dream: "
                      "entropy).")
  flags.DEFINE_float("threshold", defaults.threshold, "tau of --remasking=threshold: reveal "
                     "every position more confident than tau, at least one per model call.")
  flags.DEFINE_float("cfg_scale", defaults.cfg_scale, "Classifier-free guidance (0: off).")
  flags.DEFINE_enum("cache", defaults.cache, list(family_lib.caches()),
                    "The sampler's KV cache, any the model's family takes (none: exact; LLaDA: "
                    "Fast-dLLM's block-wise prefix or dual).")
  flags.DEFINE_integer("batch_size", defaults.batch_size, "Rows per sampler call, all devices.")
  flags.DEFINE_integer("shard_size", defaults.shard_size,
                       "Examples per generation file; keep it when resuming.")
  flags.DEFINE_integer("limit", defaults.limit, "Evaluate the first N examples of each task "
                       "(0: all; synthetic data: N puzzles, default 256).")
  flags.DEFINE_multi_string("data", [], "TASK=SOURCE: a local file, a directory of d1 generation "
                            "files (their questions), 'hub', a Hub dataset name or 'synthetic' "
                            "(default: d1's test set).")
  flags.DEFINE_string("data_dir", defaults.data_dir, "Where d1's countdown and sudoku test "
                      "files are.")
  flags.DEFINE_integer("seed", defaults.seed, "Sampling seed (temperature > 0) and the seed of "
                       "synthetic test sets.")
  flags.DEFINE_string("model_name", defaults.model_name, "MODEL field of the file names "
                      "(default: the checkpoint directory's name, plus -stepN for a workdir).")
  flags.DEFINE_string("tokenizer", defaults.tokenizer, "'char', a tokenizer.json, or a training "
                      "workdir or its config.json (default: the checkpoint's own).")
  flags.DEFINE_enum("dtype", defaults.dtype, ["auto", "float32", "bfloat16"],
                    "Parameter and compute dtype (auto: float32 on CPU, else bfloat16).")
  flags.DEFINE_list("mesh", [str(n) for n in defaults.mesh], "data,fsdp,tensor sizes over this "
                    "host's devices; one may be -1 (the rest).")
  flags.DEFINE_integer("prompt_length", defaults.prompt_length,
                       "Padded prompt length (0: the longest prompt of the task).")
  flags.DEFINE_boolean("with_instruction", None, "Put the task's instruction before the question "
                       "(default: as the checkpoint's training config says: a workdir's, an "
                       "export's stabledrl_jax.json; yes for plain Hugging Face checkpoints).")
  flags.DEFINE_enum("prompt_style", None, list(tasks.PROMPT_STYLES),
                    "The prompt's template with --with_instruction: d1 (the task's instruction "
                    "in the d1 layout) or stabledrl (the official StableDRL templates); default: "
                    "the checkpoint's training config's, else d1.")
  flags.DEFINE_string("assistant_prefix", None, "Start of the assistant's turn for chat "
                      f"tokenizers (default: {D1_ASSISTANT_PREFIX!r} with the d1 prompt style, "
                      "as d1's evaluation; none with the stabledrl one, as its training).")
  flags.DEFINE_string("output", defaults.output, "Results JSON (default: OUTPUT_DIR/results.json).")
  flags.DEFINE_boolean("distributed", False,
                       "Call jax.distributed.initialize() even where no cluster is detected "
                       "(TPU pods, Slurm and Open MPI are detected without it).")
  multihost.define_flags()
  flags.mark_flags_as_required(["checkpoint", "task", "output_dir"])


def options_from_flags() -> Options:
  """The parsed flags as `Options`; ValueError for lists that are not integers."""
  values = {field.name: flags.FLAGS[field.name].value for field in dataclasses.fields(Options)}
  try:
    values["gen_lengths"] = [int(n) for n in values["gen_lengths"]]
    values["mesh"] = [int(n) for n in values["mesh"]]
  except ValueError as error:
    raise ValueError(f"--gen_lengths and --mesh take integers: {error}") from None
  if len(values["mesh"]) != 3:
    raise ValueError(f"--mesh takes three sizes (data,fsdp,tensor), got {values['mesh']}")
  return Options(**values)


# The command line's Ctrl-C handling (``run_cli``); none in-process.
_INTERRUPTS: list[Any] = []


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.ERROR)  # orbax warns about read-only directories at WARNING.
  try:
    multihost.initialize_from_flags(force=flags.FLAGS.distributed)
    run(options_from_flags())
  except KeyboardInterrupt:
    # Ctrl-C: the finished shards are kept (each written whole); exit at once, skipping the
    # interpreter's teardown (XLA's threads may still run a computation).
    print(f"\nInterrupted: stopped; the finished generation files in "
          f"{flags.FLAGS.output_dir} are kept: rerun the same command to continue.",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(128 + signal.SIGINT)  # pylint: disable=protected-access
  except (ValueError, FileNotFoundError, NotImplementedError, ImportError, KeyError,
          workdir_files.WorkdirError) as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(1)
  for interrupts in _INTERRUPTS:  # Done: a Ctrl-C from here ends the process at once.
    interrupts.exit_at_first()


def run_cli() -> None:
  """The console script ``stabledrl-evaluate``: the first Ctrl-C stops it (the finished
  shards are kept), a second exits 130 at once even inside a long jitted call
  (``preemption.CommandLineInterrupts``)."""
  from stabledrl_jax.training.loop import preemption  # pylint: disable=g-import-not-at-top
  define_flags()
  _INTERRUPTS[:] = [preemption.CommandLineInterrupts(raise_first=True)]
  app.run(main)


if __name__ == "__main__":
  run_cli()
