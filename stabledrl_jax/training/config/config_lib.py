"""Experiment configs: the full default tree and the paper settings.

Config files (``configs/*.py``) start from ``base_config()`` and override
fields; every field exists in every config, so ``--config.a.b=value`` works
for all of them. This module imports only ml_collections and the standard library, so that
loading a config file (``--help``, a notebook, a sweep) loads no JAX. What a run needs from a
config, and the check that names a bad field before anything compiles, are in
``training/config/specs.py``.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import pathlib
from typing import Any

import ml_collections
from ml_collections import config_dict

from stabledrl_jax import pyast


def base_config() -> ml_collections.ConfigDict:
  """Every field, with the paper-scale defaults (docs/training.md, "Configs") where they apply."""
  c = ml_collections.ConfigDict()
  c.seed = 113

  c.model = _model_section()
  # kind: 'char' (alphabet) or a model family's name, whose conventions apply to the
  # tokenizer.json at path: a file, a directory holding one, or a Hub id.
  c.tokenizer = ml_collections.ConfigDict(dict(kind="char", alphabet="", path=""))
  c.task = _task_section()
  c.data = ml_collections.ConfigDict(dict(
      train="synthetic", eval="synthetic", train_size=20_000, eval_size=256,
      generator=ml_collections.ConfigDict()))

  c.rollout = _rollout_section()

  c.objective = _objective_section()
  c.estimator = _estimator_section()

  c.optimizer = ml_collections.ConfigDict(dict(
      learning_rate=1e-6, schedule="linear", warmup_steps=0, end_lr_factor=0.0,
      b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1, grad_clip=0.2))
  c.train = _train_section()
  # steps 0: gen/2. family_options: the evaluation's own values of rollout.family_options.
  c.eval = ml_collections.ConfigDict(dict(
      every_steps=100, batch_size=64, steps=0,
      family_options=ml_collections.ConfigDict(family_option_fields())))
  c.logging = _logging_section()
  # The spike recorder (docs/diagnostics.md): a step whose largest pre-clip gradient norm exceeds
  # spike_factor x the median of the previous spike_window steps' (known for at least
  # spike_min_history steps), or that skipped an update as non-finite, leaves its rollouts,
  # rewards, advantages, per-sample log ratios and weights in <workdir>/spikes/step_<n>.npz
  # (spike_factor 0: non-finite steps only). kl_to_start: log kl_start/mean, the policy's KL
  # divergence from the start of RL on its own rollouts (two more scoring passes a step).
  c.diagnostics = ml_collections.ConfigDict(dict(spike_factor=10.0, spike_window=20,
                                                 spike_min_history=5, kl_to_start=False))
  # A checkpoint every `every_steps` RL steps, and also once `every_seconds` have passed since
  # the last one (0: off); SIGTERM (preemption) saves at the next step boundary.
  c.checkpoint = ml_collections.ConfigDict(dict(every_steps=100, every_seconds=0.0,
                                                max_to_keep=3))
  # Global axis sizes (training/parallel/mesh.py); dcn_data: how many slices the data axis spans.
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, dcn_data=1))
  c.sft = ml_collections.ConfigDict(dict(
      num_steps=0, batch_size=64, learning_rate=1e-3,
      demo_error_rate=0.0, demo_error_cells=1))  # an imperfect demonstrator (data.py)
  return c


def _model_section() -> ml_collections.ConfigDict:
  """``config.model``."""
  return ml_collections.ConfigDict(dict(
      family="llada",  # llada (full-attention masked diffusion) | sdar (block diffusion)
      # A config of the family: llada: tiny | small | llada_8b (models.get_config);
      # sdar: tiny | small | sdar_1_7b | sdar_4b | sdar_8b (models.get_sdar_config).
      name="tiny",
      # A Hugging Face checkpoint: a Hub id (GSAI-ML/LLaDA-8B-Instruct, fetched into the Hub
      # cache; HF_HUB_OFFLINE=1 reads the cache only) or a local directory; '' = random init (or
      # the SFT start).
      checkpoint="",
      # With several processes (docs/pods.md): 'each_host' (every host fetches into its own
      # cache) or 'process_0' (process 0 fetches into a cache all hosts share; stabledrl_jax/hub.py).
      download="each_host",
      # Fields of the family's config (ModelConfig / SDARConfig); the shapes both have may use
      # either family's name (d_model or hidden_size, ...: models.family.Family.aliases).
      overrides=ml_collections.ConfigDict(),
      dtype="float32",  # compute dtype of activations
      param_dtype="float32",
      remat=False,
      # Run the layers as a lax.scan over their stacked parameters (models/scan.py: with FSDP,
      # one layer's kernels gathered and one layer's gradients reduced at a time).
      scan_layers=False,
      # The attention kernel: auto | xla | splash (Pallas, TPU) | cudnn (GPU); '' = the model
      # config's default, auto: the kernel measured to need less memory (layers.attention_impl:
      # splash on TPU but in KV-cached calls of a head under 128; GPU: cudnn at 16 bits), else xla.
      attention="",
      # LoRA (models/lora.py, docs/training.md "LoRA"): rank r of the adapters, 0 = every
      # parameter trains (the default, as StableDRL's official code); alpha: the adapters' scale
      # is alpha / r; targets: the official modules to adapt, comma-separated, matched as PEFT
      # matches target_modules (the default: the four of d1's list that LLaDA has); dropout:
      # PEFT's lora_dropout on the adapters' input; dropout_passes: where it applies, 'update'
      # (the differentiated pass only) or 'every' (the rollouts' sampler and l_old too, as the
      # official trainers run them in train mode); base_dtype: how the frozen base is stored;
      # base: a Hub id or directory that replaces the base a PEFT adapter in model.checkpoint
      # names (its base_model_name_or_path; '' keeps it).
      lora=ml_collections.ConfigDict(dict(rank=0, alpha=16.0, targets="q_proj,k_proj,v_proj,up_proj",
                                          dropout=0.0, dropout_passes="update",
                                          base_dtype="bfloat16", base="")),
  ))

def _task_section() -> ml_collections.ConfigDict:
  """``config.task``."""
  # reward: the scheme (tasks.REWARD_SCHEMES): 'stabledrl' (the official StableDRL code's: its
  # correctness rewards plus anti_short_boxed) or 'd1' (correctness plus format terms).
  # prompt_style (tasks.PROMPT_STYLES), with with_instruction: 'd1' (the task's instruction in
  # the d1 layout, then the question) or 'stabledrl' (the official StableDRL templates).
  # reward_workers: processes that score rollouts in parallel (0: in this process; math-verify
  # can take 0.2 s an answer), each answer bounded by reward_timeout_s (past it: reward 0).
  return ml_collections.ConfigDict(dict(name="sudoku", with_instruction=False,
                                          prompt_style="d1", reward="stabledrl", reward_workers=0,
                                          reward_timeout_s=10.0))

def _rollout_section() -> ml_collections.ConfigDict:
  """``config.rollout``."""
  # steps: denoising steps over the whole completion. block_length: LLaDA's semi-autoregressive
  # blocks; SDAR decodes by its model's block_size (prompt_length and gen_length multiples of it)
  # and ignores it. remasking: llada: low_confidence | random (`steps` on an even schedule) |
  # threshold (every position above `threshold`, at least one per call; `steps` unused);
  # sdar: low_confidence (= static) | low_confidence_static | low_confidence_dynamic (every
  # position above `threshold`, or the static count if fewer pass); dream: its generate's alg,
  # origin | maskgit_plus | topk_margin | entropy, over the whole completion (block_length =
  # gen_length).
  return ml_collections.ConfigDict(dict(
      num_prompts=32, group_size=16, prompt_length=64, gen_length=256, steps=128,
      block_length=32, temperature=0.9, remasking="low_confidence", threshold=0.9,
      # LLaDA: block-wise KV caching of the rollout sampler (Fast-dLLM; models/llada/sampler.py):
      # none (exact) | prefix | dual; approximate rollouts, which StableDRL's ratio treatment is
      # built to tolerate. Evaluation stays exact unless evaluate's --cache says otherwise.
      cache="none",
      # Groups per sampler call (decoding.generate_rows; chunk c's noise fold_in(key, c)), so
      # that a slice of the rollout batch fits; 0: all at once.
      microbatch_groups=0,
      # Options of the family's own sampler beyond the common ones (Dream: top_p, top_k,
      # alg_temp, eps; models/dream/sampler.py). Every registered family's options are listed,
      # unset (None: the sampler's default), so that --config.rollout.family_options.<name>
      # works for any family (``family_option_fields``); a family refuses a name it does not
      # take only when it is set.
      family_options=ml_collections.ConfigDict(family_option_fields())))

def _objective_section() -> ml_collections.ConfigDict:
  """``config.objective``."""
  # Each objective's hyperparameters are its registered dataclass's (stabledrl_jax/objectives/),
  # defaulting to its official code's (docs/algorithms.md lists them with their sources). Its
  # section config.objective.<name> is generated from that dataclass (``objective_sections``),
  # one unset placeholder a field, so that --config.objective.<name>.<field>=value works; a
  # field left unset (None) keeps the default. An objective registered elsewhere needs no
  # section here (add one to your config file to override its fields).
  # advantage_baseline: '' = the objective's own (group_mean, or ESPO's leave_one_out).
  return ml_collections.ConfigDict(dict(
      name="stabledrl", scale_advantages_by_std=False, advantage_baseline="",
      **objective_sections()))

def _estimator_section() -> ml_collections.ConfigDict:
  """``config.estimator``."""
  # Every field left unset (None, or '') takes the value of the objective's official code
  # (``estimator_settings``): method (one the model family takes: estimators.methods() for
  # LLaDA), num_samples (K), normalize ('sum' | 'mean'), coupled_ratio (l_old on each update's
  # own masks, as d1 and ESPO; else once per rollout on independent masks, as StableDRL) and the
  # mask sampler's options.
  # For SDAR the methods are block estimators (rl_loss's docstring): elbo and block_random the
  # block ELBO, mean_field whole blocks masked; block_length, prompt_mask_prob and schedule
  # do not apply.
  # The mask samplers' options (block_length, prompt_mask_prob, schedule, coupled) are generated
  # from the registered methods' keyword-only arguments (``estimator_option_fields``).
  return ml_collections.ConfigDict(dict(
      method="",
      num_samples=config_dict.placeholder(int),
      normalize="",
      coupled_ratio=config_dict.placeholder(bool),
      **estimator_option_fields(),
      # Stress test (docs/stress_test.md): in this fraction of the samples (0: off), l_theta uses
      # "easy" masks (the last ceil(easy_rate * L) completion tokens, t_min) and l_old "hard"
      # ones (the first ceil(hard_rate * L), t_max), so that log rho explodes.
      stress=ml_collections.ConfigDict(dict(fraction=0.0, easy_rate=0.1, hard_rate=1.0))))

def _train_section() -> ml_collections.ConfigDict:
  """``config.train``."""
  # num_steps counts RL steps (rollout batches); each makes num_iterations optimizer updates,
  # over which the learning-rate schedule runs (num_steps * num_iterations in all).
  return ml_collections.ConfigDict(dict(
      num_steps=1000, num_iterations=2, microbatch_groups=0,  # 0: the whole batch at once
      max_consecutive_skips=10,
      # Log StableDRL's convex-hull bound max_j |A_j| ||grad s_j|| per update (per-sample
      # gradients: memory grows as batch x parameters, so for small models).
      gradient_bound=False,
      # A persistent XLA compilation cache (local or gs://; '' off): restarts skip compiling.
      compilation_cache_dir="",
      # Seconds a SIGTERM waits for the step boundary and its checkpoint before the command
      # ends at once (one process; a preemption's notice is about 30 s; 0: wait however long).
      stop_grace_s=60.0,
      # The collapse guard (training/loop/collapse.py; docs/reliability.md, "Collapse guard"), off
      # by default: after every step the study's rule (eval or the reward's window mean falling
      # past its margin after rising, or max_skipped skipped updates); on collapse 'restore'
      # (the best checkpoint by eval, the learning rate times lr_factor, at most max_restores
      # times) or 'stop'. A rerun of a run it stopped trains nothing unless go_on.
      collapse_guard=ml_collections.ConfigDict(dict(
          enabled=False, action="restore", lr_factor=0.5, max_restores=2, eval_margin=2.0,
          reward_margin=0.02, window=20, max_skipped=1, go_on=False))))

def _logging_section() -> ml_collections.ConfigDict:
  """``config.logging``."""
  # What process 0 logs besides metrics.jsonl and TensorBoard (docs/training.md, "Metrics").
  return ml_collections.ConfigDict(dict(
      # A few rollouts (prompt, completion, reward) every N RL steps in samples.jsonl and as
      # TensorBoard text (0: never).
      samples_every_steps=10, num_samples=4,
      # Peak dense bf16 TFLOP/s of one device for perf/mfu (0: known TPU / GPU kinds; none on
      # CPU, where only perf/tflops_per_s is logged).
      peak_tflops_per_device=0.0,
      # Weights & Biases (needs `pip install wandb`): off unless project is set.
      wandb=ml_collections.ConfigDict(dict(project="", entity="", name="")),
  ))


_PLACEHOLDER_TYPES = {"float": float, "int": int, "str": str, "bool": bool}


def objective_sections() -> dict[str, ml_collections.ConfigDict]:
  """{objective name: its config section} for every objective module of
  ``stabledrl_jax/objectives/``: one unset placeholder per field of the hyperparameter dataclass
  its ``register_objective(name, hparams=...)`` names, typed by the field's annotation.

  Read from the modules' source (``ast``), not imported, so that loading a config loads no JAX;
  the dataclass stays the only place a field is listed (tests/test_validation.py holds the
  sections to the registered dataclasses).
  """
  trees = [pyast.parse(path.read_text(), str(path))
           for path in sorted(_package_dir("objectives").glob("*.py"))]
  classes = {node.name: node for tree in trees for node in ast.walk(tree)
             if isinstance(node, ast.ClassDef)}
  sections = {}
  for tree in trees:
    for call in ast.walk(tree):
      if not (isinstance(call, ast.Call) and _called_name(call.func) == "register_objective"
              and call.args and isinstance(call.args[0], ast.Constant)):
        continue
      hparams = next((kw.value for kw in call.keywords if kw.arg == "hparams"), None)
      fields = {}
      if hparams is not None:
        for item in classes[_called_name(hparams)].body:
          if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            kind = _PLACEHOLDER_TYPES[ast.unparse(item.annotation)]
            fields[item.target.id] = config_dict.placeholder(kind)
      sections[call.args[0].value] = ml_collections.ConfigDict(fields)
  return sections


def estimator_option_fields() -> dict[str, Any]:
  """{option: unset placeholder} for every keyword-only argument of the mask samplers that
  ``stabledrl_jax/estimators.py`` registers (``register_method(name, sampler)``), typed by its
  annotation ('' for a string), so that each option is listed once, in its sampler's signature.

  Read from the module's source (``ast``), not imported: loading a config loads no JAX. A
  plugin method's own options are fields a config file adds (tests/test_plugins.py).
  """
  tree = pyast.parse((_package_dir("estimators").with_suffix(".py")).read_text())
  functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
  fields = {}
  for call in ast.walk(tree):
    if (isinstance(call, ast.Call) and _called_name(call.func) == "register_method"
        and len(call.args) == 2 and isinstance(call.args[1], ast.Name)):
      for arg in functions[call.args[1].id].args.kwonlyargs:
        kind = _PLACEHOLDER_TYPES[ast.unparse(arg.annotation)]
        fields.setdefault(arg.arg, "" if kind is str else config_dict.placeholder(kind))
  return fields


def family_option_fields() -> dict[str, Any]:
  """{option: unset placeholder} for every sampler option a model family under
  ``stabledrl_jax/models/`` declares (``Family.options`` of its ``register(Family(...))``: a
  dict of ``Option(kind, ...)``), typed by its kind, so that each option is declared once, in
  the family's record, and ``--config.rollout.family_options.<name>`` (and ``eval.``'s) can set
  it for any family.

  Read from the modules' source (``ast``), not imported: loading a config loads no JAX. The
  options dict may be written in the ``Family(...)`` call, or named there as a module-level dict
  of the family's package (``options=sampler.OPTIONS``). A family registered elsewhere (a
  plugin) lists its options in its config file (tests/test_validation.py holds these fields to
  the registered families').
  """
  return {name: config_dict.placeholder(kind) for name, kind in _family_option_kinds()}


@functools.lru_cache(maxsize=None)
def _family_option_kinds() -> tuple[tuple[str, type], ...]:
  """(option, type) of every option ``family_option_fields`` lists, parsed once a process
  (base_config, which every config load calls, builds both family_options sections from it)."""
  fields = {}
  for init in sorted(_package_dir("models").glob("*/__init__.py")):
    tree = pyast.parse(init.read_text(), str(init))
    for call in ast.walk(tree):
      if not (isinstance(call, ast.Call) and _called_name(call.func) == "Family"):
        continue
      declared = next((kw.value for kw in call.keywords if kw.arg == "options"), None)
      options = _module_dict(declared, tree, init.parent) if declared is not None else None
      for key, value in zip(options.keys, options.values) if options is not None else ():
        kind = value.args[0] if isinstance(value, ast.Call) and value.args else None
        if isinstance(key, ast.Constant) and isinstance(kind, ast.Name):
          fields.setdefault(key.value, _PLACEHOLDER_TYPES[kind.id])
  return tuple(fields.items())


def _module_dict(node: ast.AST, tree: ast.Module, package: pathlib.Path) -> ast.Dict | None:
  """The dict literal ``node`` is, or names: a module-level name of ``tree``, or ``module.NAME``
  of a module of ``package``."""
  if isinstance(node, ast.Dict):
    return node
  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
    path = package / f"{node.value.id}.py"
    if not path.is_file():
      return None
    tree, name = pyast.parse(path.read_text(), str(path)), node.attr
  elif isinstance(node, ast.Name):
    name = node.id
  else:
    return None
  for item in tree.body:
    if (isinstance(item, ast.Assign) and isinstance(item.value, ast.Dict)
        and any(isinstance(t, ast.Name) and t.id == name for t in item.targets)):
      return item.value
  return None


def _called_name(node: ast.AST) -> str:
  """``f`` of ``f``, ``a.f`` or ``a.b.f``."""
  return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _package_dir(name: str) -> pathlib.Path:
  return pathlib.Path(__file__).resolve().parents[2] / name


def config_names() -> tuple[str, ...]:
  """The names of the shipped config files (``configs/``, installed as ``stabledrl_jax.configs``)."""
  return tuple(sorted(p.stem for p in _configs_dir().glob("*.py") if p.stem != "__init__"))


def _configs_dir() -> pathlib.Path:
  try:
    spec = importlib.util.find_spec("stabledrl_jax.configs")
  except ModuleNotFoundError:
    spec = None
  if spec is not None and spec.submodule_search_locations:
    return pathlib.Path(list(spec.submodule_search_locations)[0])
  return pathlib.Path(__file__).resolve().parents[3] / "configs"  # A checkout on PYTHONPATH.


def config_path(name_or_path: str) -> str:
  """A ``--config`` value as a file path: an existing file as is, else a shipped config's name
  (``quickstart``, ``llada8b_gsm8k``), with ``:arg`` kept for ``get_config(arg)``."""
  path, colon, arg = name_or_path.partition(":")
  if os.path.exists(path) or path.endswith(".py") or os.sep in path:
    return name_or_path
  if path not in config_names():
    raise FileNotFoundError(f"--config {path!r} is neither a file nor a shipped config; the "
                            f"shipped ones are {config_names()}")
  return str(_configs_dir() / f"{path}.py") + colon + arg


def get(name_or_path: str) -> ml_collections.ConfigDict:
  """A shipped config by name (``get("quickstart")``) or a config file by path; ``NAME:arg``
  gives ``get_config(arg)`` (``get("llada8b_d1:math500")``), as ``--config`` does."""
  path, colon, arg = config_path(name_or_path).partition(":")
  return from_file(path, arg if colon else None)


def from_file(path: str | os.PathLike[str], arg: str | None = None
              ) -> ml_collections.ConfigDict:
  """``get_config()`` of a config file (e.g. to build one config file on another);
  ``get_config(arg)`` when ``arg`` is given (``--config path.py:arg``)."""
  spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
  if spec is None or not os.path.isfile(path):
    raise FileNotFoundError(f"no config file at {str(path)!r}")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config() if arg is None else module.get_config(arg)


def _paper_setting(task: str, learning_rate: float) -> ml_collections.ConfigDict:
  """The paper's RL setting (docs/training.md, "Configs") for ``task``, before the model is chosen."""
  c = base_config()  # seed 113, StableDRL with the SPG sandwich, ratio clip 5, no KL.
  # 512 answers a step, scored by 8 worker processes per host (math-verify is slow).
  c.task.update(name=task, with_instruction=True, prompt_style="stabledrl", reward_workers=8)
  c.data.update(train="hub", eval="hub", train_size=0, eval_size=0)
  c.rollout.update(num_prompts=32, group_size=16, prompt_length=256, gen_length=256,
                   temperature=0.9)
  c.optimizer.update(learning_rate=learning_rate, schedule="linear", grad_clip=0.2,
                     weight_decay=0.1)
  # 2000 optimizer updates with linear decay over them (the official total_steps counts
  # updates): 1000 rollout batches at mu = 2.
  c.train.update(num_steps=1000, num_iterations=2, microbatch_groups=1)
  c.eval.update(every_steps=100, batch_size=64, steps=0)
  # Also every 30 minutes: a preempted VM that misses its SIGTERM loses at most that.
  c.checkpoint.update(every_steps=50, every_seconds=1800.0, max_to_keep=3)
  c.mesh.update(data=1, fsdp=-1, tensor=1)
  return c


def llada8b_config(task: str, learning_rate: float) -> ml_collections.ConfigDict:
  """The paper's LLaDA-8B-Instruct setting (docs/training.md, "Configs") for ``task``.

  ``model.checkpoint`` and ``tokenizer.path`` name the released model on the Hub (fetched into
  the Hub cache on first use); a local directory works as well.
  """
  c = _paper_setting(task, learning_rate)
  # bfloat16 compute on float32 master weights (and AdamW moments): in bfloat16 an update of
  # lr 2e-6 on a weight of size 0.02 rounds away.
  c.model.update(name="llada_8b", checkpoint="GSAI-ML/LLaDA-8B-Instruct", dtype="bfloat16",
                 param_dtype="float32", remat=True, scan_layers=True)
  c.tokenizer.update(kind="llada", path="GSAI-ML/LLaDA-8B-Instruct")
  c.rollout.update(steps=128, block_length=32)
  return c


# The baselines' official LoRA and optimizer recipes on LLaDA-8B-Instruct (docs/training.md,
# "LoRA"), at the commits docs/algorithms.md cites. d1, SPG and wd1 hard-code a 4-bit NF4 base
# with double quantization and bfloat16 compute (d1 diffu-grpo/diffu_grpo_train.py:71-77, SPG
# spg/diffu_grpo_train.py:80-86, wd1 wd1/run_train.py:104-110); ESPO loads bfloat16 (no
# load_in_4bit: TRL's default, False). All four list the seven names q, k, v, o, up, down,
# gate_proj (d1 diffu_grpo_train.py:92-98, SPG :101-107, wd1 run_train.py:134-148, ESPO
# recipes/train.yaml:11): on LLaDA PEFT matches q_proj, k_proj, v_proj and up_proj of them and
# drops the rest without a word, so those four are the targets here. The 4-bit base is qwix's
# NF4 in blocks of 64 weights, bitsandbytes' block size (its scales are not quantized again:
# double quantization saves 0.4 bits a weight).
_D1_FAMILY_LORA = dict(rank=128, alpha=64.0, dropout=0.05,  # train.yaml:10-12 of each repository
                       targets="q_proj,k_proj,v_proj,up_proj")
BASELINE_RECIPES = {
    # d1 diffu-grpo/slurm_scripts/train.yaml: lr 3e-6 constant_with_warmup (l.34-35, warmup
    # ratio 1e-4: none here), AdamW 0.9 / 0.99 (l.23-24), weight decay 0.1 (l.25), clip 0.2
    # (l.26), beta 0.04 and epsilon 0.5 (l.68-69); mu (NUM_ITER) 12 on gsm8k and math, 8 on
    # countdown and sudoku ({gsm,math,countdown,sudoku}_base.sbatch:24).
    "grpo": dict(lora=_D1_FAMILY_LORA, base_dtype="nf4", learning_rate=3e-6, weight_decay=0.1,
                 mu=dict(gsm8k=12, math500=12, countdown=8, sudoku=8), hparams={}),
    # SPG spg/slurm_scripts/train.yaml: the same LoRA and optimizer (l.3-13, 23-35); mu 4 and
    # beta 0 (no KL) on every task, eubo_beta 1.5 (1.0 on sudoku), mix weight 0.5
    # (spg_mix/*.sbatch:28-50).
    "spg": dict(lora=_D1_FAMILY_LORA, base_dtype="nf4", learning_rate=3e-6, weight_decay=0.1,
                mu=dict(gsm8k=4, math500=4, countdown=4, sudoku=4),
                hparams=dict(sudoku=dict(eubo_beta=1.0))),
    # wd1 wd1/train.yaml: the same LoRA and optimizer (l.3-13, 23-35); mu 12, 8 on sudoku
    # (run/wll_NP_*.sh:22).
    "wd1": dict(lora=_D1_FAMILY_LORA, base_dtype="nf4", learning_rate=3e-6, weight_decay=0.1,
                mu=dict(gsm8k=12, math500=12, countdown=12, sudoku=8), hparams={}),
    # ESPO recipes/train.yaml:6-11 (LoRA, bfloat16 base), run_{task}_llada.sh: lr 3e-6
    # constant_with_warmup, weight decay 0.01, mu 8 (NUM_ITER, l.3), beta 1e-3 / 1e-3 / 3e-3 /
    # 1e-2 (l.28); epsilon 0.2 (train.yaml:18) but 0 on countdown (run_countdown_llada.sh:29).
    # Its code task trains every parameter (run_code_llada.sh:33) and is no task here.
    "espo": dict(lora=_D1_FAMILY_LORA, base_dtype="bfloat16", learning_rate=3e-6,
                 weight_decay=0.01, mu=dict(gsm8k=8, math500=8, countdown=8, sudoku=8),
                 hparams=dict(gsm8k=dict(beta=1e-3), math500=dict(beta=1e-3),
                              countdown=dict(beta=3e-3, epsilon=0.0),
                              sudoku=dict(beta=1e-2))),
}


def baseline_llada8b_config(objective: str, task: str) -> ml_collections.ConfigDict:
  """A baseline on LLaDA-8B-Instruct with its official training recipe, in a matched-budget
  comparison: LoRA on a frozen base (``BASELINE_RECIPES``: rank, alpha, dropout, targets, the
  base's storage), its learning rate, schedule, weight decay, mu and per-task hyperparameters.
  Rollouts, batch, prompts, rewards and evaluation are the paper's shared setting
  (``llada8b_config``), so that a comparison differs in the algorithm: not the baseline's
  published run (docs/training.md).

  Raises:
    ValueError: naming the objective or task that has no official recipe.
  """
  if objective not in BASELINE_RECIPES:
    raise ValueError(f"no official LoRA recipe for objective {objective!r}; the baselines are "
                     f"{sorted(BASELINE_RECIPES)} (StableDRL trains every parameter: "
                     "llada8b_<task>.py)")
  recipe = BASELINE_RECIPES[objective]
  if task not in recipe["mu"]:
    raise ValueError(f"{objective}'s official code ships no {task!r} recipe; its tasks are "
                     f"{sorted(recipe['mu'])}")
  c = llada8b_config(task, learning_rate=recipe["learning_rate"])
  c.objective.name = objective
  c.objective[objective].update(recipe["hparams"].get(task, {}))
  # LoRA dropout in every pass of the current policy: each trainer samples and scores l_old
  # with the model in train mode (transformers' Trainer.training_step calls model.train() before
  # TRL's _prepare_inputs generates; none calls .eval(): d1 diffu_grpo_trainer.py:409 and :458,
  # SPG spg_trainer.py:607 and :722, wd1 trainers/diffu_grpo_trainer.py:497 and :552, ESPO
  # espo_trainer.py:552 and :618).
  c.model.lora.update(recipe["lora"], base_dtype=recipe["base_dtype"], dropout_passes="every")
  c.optimizer.update(schedule="constant", weight_decay=recipe["weight_decay"], b1=0.9, b2=0.99,
                     grad_clip=0.2)
  c.train.num_iterations = recipe["mu"][task]
  return c


def sdar8b_config(task: str, learning_rate: float) -> ml_collections.ConfigDict:
  """The paper's RL setting on SDAR-8B-Chat (block diffusion, block size 4) for ``task``.

  The same RL hyperparameters as ``llada8b_config``; rollouts decode SDAR's way (its
  ``generate.py`` defaults): blocks of the model's size, at most one step per token (256 over
  the 256-token completion, 4 per block), revealing every position whose confidence passes
  0.9 (``low_confidence_dynamic``). ``block_random`` becomes the block ELBO (``rl_loss``).
  ``model.checkpoint`` and ``tokenizer.path`` name the released model on the Hub (fetched into
  the Hub cache on first use); a local directory works as well.
  """
  c = _paper_setting(task, learning_rate)
  c.model.update(family="sdar", name="sdar_8b", checkpoint="JetLM/SDAR-8B-Chat",
                 dtype="bfloat16", param_dtype="float32", remat=True, scan_layers=True)
  c.tokenizer.update(kind="sdar", path="JetLM/SDAR-8B-Chat")
  c.rollout.update(steps=256, block_length=4, remasking="low_confidence_dynamic",
                   threshold=0.9)
  return c
