r"""Plan before you rent: does a config fit a TPU slice? ``python -m stabledrl_jax.plan``.

    python -m stabledrl_jax.plan --config llada8b_gsm8k --topology v5p-8,v5litepod-64 \
        --what train,sampler,evaluate --output plan.json --markdown plan.md

For each slice (``--topology``: a Cloud TPU accelerator type, v4-8, v5litepod-4 ... v5litepod-256,
v5p-8 ... v5p-256, v6e-4 ... v6e-256, or a topology name, v5e:8x8) it compiles, with libtpu's
real TPU compiler on this host (no TPU needed; ``stabledrl_jax.tpu_compile``), from abstract
inputs (nothing is allocated or run):

  train     the configured train step (``build.abstract_update``)
  sampler   the rollout sampler (``decoding.generate``), once per cache setting of the family
            (``--caches``; LLaDA: none / prefix / dual, SDAR: its own KV cache only) and
            remasking rule (``--remasking``: the configured rule, and the static / dynamic
            counterpart, whose program differs)
  evaluate  the evaluation decode (greedy, exact, ``eval.batch_size`` rows)

and reads the compiler's memory analysis: the bytes each chip needs (arguments, outputs less
donated, temporaries) against its HBM. A program that does not fit comes back as the compiler's
out-of-memory (RESOURCE_EXHAUSTED), recorded as a row with the bytes it reports, never a crash.
Where the given settings do not fit, a small ladder of settings is compiled (at most
``--max_ladder`` compiles a row): train: ``model.remat`` on, then smaller
``train.microbatch_groups``; sampler: rollout chunks (``rollout.microbatch_groups``: the groups
per sampler call); evaluate: smaller ``eval.batch_size``. The smallest setting is tried first;
if it fits, the largest fitting one is searched between it and the given one; it is the row's
``recommended``.

Without libtpu (``pip install 'jax[tpu]'``, or the test extra) or with ``--compiler=cpu`` it falls
back to XLA:CPU on as many fake CPU devices as the slice has (set before JAX starts its CPU
backend; the command does it): an upper bound (XLA:CPU upcasts bf16 products to f32 and keeps
more alive), marked ``"compiler": "cpu"``.

Times are projections, not measurements: ``rl_step_flops`` counts one RL
step's matmul FLOPs (rollout, scoring, updates), and the step time is that over the slice's chips
x bf16 peak x ``--mfu``. (XLA's ``cost_analysis()`` counts a loop body once, so its FLOPs of
these programs, whose layers and steps are loops, are not used.)

Output: ``--output plan.json`` holds {"rows": [...], "pending": [...], "projections": [...]};
it is rewritten after every compile, so a cut run keeps what it has, and rows already in it are
kept. ``--resume`` reuses the rows of the same (config, overrides, what, topology, compiler,
settings) instead of compiling them again. ``--dry_run`` lists what would be compiled as
pending rows. ``--markdown PATH`` (``-``: stdout) renders every row of the file as the table of
docs/pods.md ("Plan before you rent"); ``--render`` renders an existing file without compiling.

Row: {"what", "config", "overrides", "topology" (the name given), "topology_name" (libtpu's),
"compiler", "chips", "devices", "settings" ({field: value} compiled), "per_chip_bytes" (total,
or the out-of-memory's figure, or null), "memory" (argument, output, alias, temp, total per
chip), "chip_bytes" (one chip's HBM), "fits", "error" (out-of-memory or config error, one line),
"compile_seconds", "ladder" (whether the row is a rung of the search), "recommended" (the given
row's fitting settings, or null)}.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from typing import Any, Callable

from absl import app, flags, logging

from stabledrl_jax import cli_flags, workdir_files

_CONFIG = cli_flags.CONFIG
_TOPOLOGY = flags.DEFINE_string(
    "topology", "v5litepod-4", "Comma-separated TPU slices: Cloud TPU accelerator types (v4-8, "
    "v5litepod-64, v5p-8, v6e-64, ...) or libtpu topology names (v5e:8x8, v5p:2x2x1).")
_WHAT = flags.DEFINE_string("what", "train,sampler,evaluate",
                            "Comma-separated: train, sampler, evaluate.")
_CACHES = flags.DEFINE_string("caches", "", "The sampler's cache settings to compile (default: "
                              "every one the model family has).")
_REMASKING = flags.DEFINE_string(
    "remasking", "", "The sampler's remasking rules to compile (default: rollout.remasking and "
    "its static/dynamic counterpart).")
_OUTPUT = flags.DEFINE_string("output", "", "The plan JSON (rewritten after every compile).")
_RESUME = flags.DEFINE_bool("resume", False, "Reuse the rows already in --output.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Compile nothing: list the rows as pending.")
_MARKDOWN = flags.DEFINE_string("markdown", "", "Write the rows as a Markdown table here "
                                "('-': stdout).")
_RENDER = flags.DEFINE_bool("render", False, "Only render --output as --markdown (no --config).")
_COMPILER = flags.DEFINE_enum("compiler", "auto", ["auto", "tpu", "cpu"],
                              "tpu: libtpu; cpu: XLA:CPU on fake devices (an upper bound); "
                              "auto: tpu where libtpu is installed.")
_MAX_LADDER = flags.DEFINE_integer("max_ladder", 4, "At most this many extra compiles per row "
                                   "that does not fit (0: no recommendation).", lower_bound=0,
                                   upper_bound=64)
_MFU = flags.DEFINE_float("mfu", 0.4, "Model-FLOPs utilization of the time projections.")
_RECOMMEND = flags.DEFINE_bool("recommend", True, "Search settings that fit.")
_CHIP_GB = flags.DEFINE_float("chip_gb", 0.0, "One chip's memory in GB (1e9 bytes) instead of its "
                              "HBM (for cpu:N topologies: default 80).", lower_bound=0.0,
                              upper_bound=1e6)
_VERBOSE = cli_flags.VERBOSE

WHATS = ("train", "sampler", "evaluate")

# Chips of a 2-D slice (v5e, v6e) and of a 3-D one (v4, v5p): Cloud TPU's shapes.
_SHAPES_2D = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
              256: "16x16"}
_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
              256: "4x8x8", 512: "8x8x8"}
# Accelerator type prefix -> (topology generation, TensorCores counted per chip in the name).
_ACCELERATORS = {"v5litepod": ("v5e", 1), "v5e": ("v5e", 1), "v6e": ("v6e", 1),
                 "v5p": ("v5p", 2), "v4": ("v4", 2)}
# device_kind by generation (tpu_compile.CHIP_HBM_BYTES's keys).
_KINDS = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite"}
# Compile-only devices per chip: libtpu lists a v4 chip's two TensorCores as two devices.
_DEVICES_PER_CHIP = {"v4": 2}
# Remasking rules whose program differs from the configured one's (static vs dynamic loop).
_COUNTERPART = {"low_confidence": "threshold", "random": "threshold", "threshold": "low_confidence",
                "low_confidence_static": "low_confidence_dynamic",
                "low_confidence_dynamic": "low_confidence_static"}


def topology_name(text: str) -> str:
  """An accelerator type or topology name as libtpu's topology name.

  ``v5litepod-64`` -> ``v5e:8x8``; ``v5p-8`` (8 TensorCores, 4 chips) -> ``v5p:2x2x1``;
  ``v4-8`` -> ``v4:2x2x1``; ``v6e-64`` -> ``v6e:8x8``; ``v5e:8x8`` as is; ``cpu:N``: N
  devices of ``--chip_gb`` each (default 80 GB, an 80 GB GPU), compiled by XLA:CPU only.

  Raises:
    ValueError: an unknown accelerator type or size (naming it and the sizes there are).
  """
  text = text.strip()
  if re.fullmatch(r"cpu:\d+", text) and int(text[4:]) > 0:
    return text
  if ":" in text:
    generation = text.split(":", 1)[0]
    if generation not in _KINDS:
      raise ValueError(f"--topology {text!r}: unknown TPU generation {generation!r}; one of "
                       f"{sorted(_KINDS)}")
    return text
  match = re.fullmatch(r"(v5litepod|v5e|v5p|v6e|v4)-(\d+)", text)
  if not match:
    raise ValueError(f"--topology {text!r}: not an accelerator type (v4-8, v5litepod-64, v5p-8, "
                     "v6e-64, ...) nor a topology name (v5e:8x8)")
  generation, cores = _ACCELERATORS[match.group(1)]
  size = int(match.group(2))
  chips, rest = divmod(size, cores)
  shapes = _SHAPES_3D if generation in ("v4", "v5p") else _SHAPES_2D
  if rest or chips not in shapes:
    sizes = sorted(c * cores for c in shapes)
    raise ValueError(f"--topology {text!r}: {match.group(1)} comes in sizes {sizes}")
  return f"{generation}:{shapes[chips]}"


def _generation(name: str) -> str:
  return name.split(":", 1)[0]


def _chips(name: str) -> int:
  if name.startswith("cpu:"):
    return int(name[4:])
  return math.prod(int(d) for d in name.split(":", 1)[1].split("x"))


def chip_bytes(name: str, chip_gb: float = 0.0) -> int:
  """One chip's HBM (bytes) of a topology name's generation (``chip_gb`` > 0: that many GB)."""
  from stabledrl_jax import tpu_compile  # pylint: disable=g-import-not-at-top
  if chip_gb > 0:
    return int(chip_gb * 1e9)
  if name.startswith("cpu:"):
    return int(80e9)
  return tpu_compile.CHIP_HBM_BYTES[_KINDS[_generation(name)]]


def resolve_compiler(choice: str) -> str:
  """'tpu' or 'cpu' for ``--compiler`` (auto: tpu where libtpu imports)."""
  from stabledrl_jax import tpu_compile  # pylint: disable=g-import-not-at-top
  if choice == "auto":
    return "tpu" if tpu_compile.libtpu_available() else "cpu"
  if choice == "tpu" and not tpu_compile.libtpu_available():
    raise RuntimeError("--compiler=tpu needs libtpu: pip install 'jax[tpu]' (or the test extra: "
                       "pip install -e '.[test]'), or --compiler=cpu")
  return choice


def cpu_devices_needed(names: list[str]) -> int:
  return max(_chips(n) * _DEVICES_PER_CHIP.get(_generation(n), 1) for n in names)


def prepare_cpu_devices(count: int) -> None:
  """Asks for ``count`` fake CPU devices (before JAX starts its CPU backend).

  Raises:
    RuntimeError: JAX's backends already started with fewer.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  if not xla_bridge.backends_are_initialized():
    jax.config.update("jax_platforms", "cpu")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
      jax.config.update("jax_num_cpu_devices", count)
  have = len(jax.devices("cpu"))
  if have < count:
    raise RuntimeError(f"the cpu compiler needs {count} fake CPU devices and JAX already started "
                       f"with {have}: run the plan in a fresh process (or set XLA_FLAGS="
                       f"--xla_force_host_platform_device_count={count})")


def devices_for(name: str, compiler: str) -> list[Any]:
  """The slice's devices: libtpu's compile-only ones, or fake CPU ones."""
  from stabledrl_jax import tpu_compile  # pylint: disable=g-import-not-at-top
  if compiler == "tpu":
    if name.startswith("cpu:"):
      raise RuntimeError(f"--topology {name}: fake CPU devices need --compiler=cpu")
    return tpu_compile.topology_devices(name)
  import jax  # pylint: disable=g-import-not-at-top
  count = _chips(name) * _DEVICES_PER_CHIP.get(_generation(name), 1)
  prepare_cpu_devices(count)
  return jax.devices("cpu")[:count]


_SIZE = re.compile(r"([\d.]+)\s*([KMGT]i?)?B?\b")
_UNITS = {None: 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _bytes(number: str, unit: str | None) -> int:
  return int(float(number) * _UNITS[unit[0] if unit else None])


def parse_out_of_memory(message: str) -> dict[str, Any] | None:
  """The compiler's out-of-memory (RESOURCE_EXHAUSTED) as {"error", "needed_bytes",
  "available_bytes"} (the figures it gives, None where it gives none); None for other errors.

  libtpu says e.g. "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for
  HLO temporaries (266.17G) exceeds available HBM (15.75G)." or "... Used 20.5G of 15.75G hbm".
  """
  if "RESOURCE_EXHAUSTED" not in message and "Ran out of memory" not in message:
    return None
  line = next((l.strip() for l in message.splitlines() if "RESOURCE_EXHAUSTED" in l
               or "memory" in l.lower()), message.strip().splitlines()[0])
  needed = available = None
  used = re.search(r"Used\s+([\d.]+)([KMGT])\w*\s+of\s+([\d.]+)([KMGT])", line)
  if used:
    needed, available = _bytes(used.group(1), used.group(2)), _bytes(used.group(3),
                                                                     used.group(4))
  else:
    req = re.search(r"required[^(]*\(([\d.]+)([KMGT])\w*\)", line)
    avail = re.search(r"available[^(]*\(([\d.]+)([KMGT])\w*\)", line)
    needed = _bytes(req.group(1), req.group(2)) if req else None
    available = _bytes(avail.group(1), avail.group(2)) if avail else None
  return dict(error=line[:400], needed_bytes=needed, available_bytes=available)


# ---- the rows ----------------------------------------------------------------------------------


def _apply(config, settings: dict[str, Any]):
  """A copy of ``config`` with ``settings`` ({dotted field: value}) set."""
  config = config.copy_and_resolve_references()
  with config.unlocked():
    for dotted, value in settings.items():
      *path, field = dotted.split(".")
      node = config
      for part in path:
        node = node[part]
      node[field] = value
  return config


def _ways(config, devices) -> int:
  """data x fsdp: the devices a batch's rows split over."""
  from stabledrl_jax.training import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  return mesh_lib.data_parallel_size(mesh_lib.make_mesh(config.mesh, devices))


def _chunk_choices(config, ways: int) -> list[int]:
  """Groups per call that divide the prompts and whose rows split over ``ways`` devices."""
  r = config.rollout
  return [g for g in range(1, r.num_prompts + 1)
          if r.num_prompts % g == 0 and g * r.group_size % ways == 0]


class Planner:
  """Compiles rows for one config on one slice, writing each to the plan file."""

  def __init__(self, config, *, config_label: str, overrides: list[str], compiler: str,
               store: "Store", max_ladder: int = 4, dry_run: bool = False,
               caches: list[str] | None = None, remasking: list[str] | None = None,
               chip_gb: float = 0.0, say: Callable[[str], None] = print):
    """``caches``, ``remasking``: the sampler's (None: the family's caches; the configured rule
    and its counterpart); ``chip_gb`` > 0: one chip's memory instead of its HBM."""
    self.config, self.label, self.overrides = config, config_label, overrides
    self.compiler, self.store, self.max_ladder = compiler, store, max_ladder
    self.dry_run, self.caches, self.remasking = dry_run, caches, remasking
    self.chip_gb, self.say = chip_gb, say

  # One compile (or a row from the file).
  def row(self, what: str, topology: str, settings: dict[str, Any], *, variant: dict[str, Any],
          ladder: bool = False) -> dict[str, Any]:
    name = topology_name(topology)
    base = dict(what=what, config=self.label, overrides=self.overrides, topology=topology,
                topology_name=name, compiler=self.compiler, settings={**variant, **settings})
    key = Store.key(base)
    if self.store.resume and key in self.store.rows:
      return self.store.rows[key]
    if self.dry_run:
      self.store.pend(base)
      return dict(base, fits=None, pending=True)
    self.say(f"compiling {what} on {topology} ({name}, {self.compiler}) "
             f"{json.dumps(base['settings'])} ...")
    out = dict(base, ladder=ladder, chips=_chips(name),
               chip_bytes=chip_bytes(name, self.chip_gb))
    start = time.perf_counter()
    try:
      devices = devices_for(name, self.compiler)
      out["devices"] = len(devices)
      per_chip = len(devices) // out["chips"]
      config = _apply(self.config, base["settings"])
      result = self._compile(what, config, devices)
      memory = {k: v * per_chip for k, v in result.memory.items()}
      out.update(per_chip_bytes=memory["total"], memory=memory,
                 fits=memory["total"] <= out["chip_bytes"], error=None)
      out.update({k: v * per_chip for k, v in _state_bytes(what, config, devices).items()})
    except Exception as error:  # pylint: disable=broad-except  (a row, never a crash)
      oom = parse_out_of_memory(str(error))
      if oom is not None:
        out.update(per_chip_bytes=oom["needed_bytes"], memory=None, fits=False,
                   error=oom["error"], available_bytes=oom["available_bytes"])
      elif isinstance(error, ValueError):  # The config check: settings this slice cannot take.
        out.update(per_chip_bytes=None, memory=None, fits=False,
                   error=str(error).strip().splitlines()[0][:400])
      else:
        raise
    out["compile_seconds"] = round(time.perf_counter() - start, 2)
    self.say(f"  {_describe(out)}")
    self.store.put(out)
    return out

  def _compile(self, what: str, config, devices):
    from stabledrl_jax import tpu_compile  # pylint: disable=g-import-not-at-top
    # pylint: disable-next=g-import-not-at-top
    from stabledrl_jax.training import decoding as decoding_lib, specs
    if what == "train":
      specs.validate(config, num_devices=len(devices))
      return tpu_compile.compile_train_step(config, devices)
    ways = _ways(config, devices)
    with config.unlocked():
      config.model.remat = False  # Inference: nothing is kept for a backward pass.
      # The train step's microbatch plays no part here; one that the slice cannot split (the
      # train row says so) must not refuse the sampler's or the evaluation's row.
      choices = _chunk_choices(config, ways)
      if choices and config.train.microbatch_groups not in choices + [0]:
        config.train.microbatch_groups = choices[-1]
    specs.validate(config, num_devices=len(devices))
    if what == "sampler":
      r = config.rollout
      groups = r.get("microbatch_groups", 0) or r.num_prompts
      if groups * r.group_size % ways:
        raise ValueError(f"config.rollout.microbatch_groups: {groups} groups x {r.group_size} "
                         f"rows do not split over data x fsdp = {ways} devices")
      return tpu_compile.compile_decode(config, devices,
                                        tpu_compile.rollout_decoding(config, cache=r.cache),
                                        rows=groups * r.group_size, what="sampler")
    rows = -(-config.eval.batch_size // ways) * ways  # Padded as decoding.generate_batches pads.
    return tpu_compile.compile_decode(config, devices, decoding_lib.Decoding.of_eval(config),
                                      rows=rows, what="evaluate")

  # The ladder.
  def search(self, what: str, topology: str, given: dict[str, Any], candidates: list[dict],
             variant: dict[str, Any]) -> dict[str, Any] | None:
    """The largest fitting of ``candidates`` (ordered from the least memory to the given one's
    neighbour), in at most ``max_ladder`` compiles; None if the smallest does not fit."""
    candidates = [c for c in candidates if c != given]
    if not candidates or self.max_ladder < 1:
      return None
    budget = self.max_ladder
    smallest = self.row(what, topology, candidates[0], variant=variant, ladder=True)
    budget -= 1
    if not smallest.get("fits"):
      return None
    lo, hi = 0, len(candidates)  # candidates[lo] fits; the given one (past hi - 1) does not.
    while hi - lo > 1 and budget > 0:
      mid = (lo + hi) // 2
      budget -= 1
      if self.row(what, topology, candidates[mid], variant=variant, ladder=True).get("fits"):
        lo = mid
      else:
        hi = mid
    return candidates[lo]

  def plan(self, what: str, topology: str) -> list[dict[str, Any]]:
    """The rows of ``what`` on ``topology``: the given settings, and the ladder's where needed."""
    from stabledrl_jax.models import family as family_lib  # pylint: disable=g-import-not-at-top
    c = self.config
    rows = []
    if what == "train":
      groups = c.train.microbatch_groups or c.rollout.num_prompts
      given = {"train.microbatch_groups": int(groups), "model.remat": bool(c.model.remat)}
      variants = [{}]
    elif what == "sampler":
      family = family_lib.get(c.model.family)
      caches = list(self.caches or family.caches)
      bad = [x for x in caches if x not in family.caches]
      if bad:
        raise ValueError(f"--caches {bad[0]!r}: the {family.name} sampler has {family.caches}")
      rules = list(self.remasking) if self.remasking else [c.rollout.remasking] + [
          r for r in [_COUNTERPART.get(c.rollout.remasking)] if r in family.remasking]
      bad = [x for x in rules if x not in family.remasking]
      if bad:
        raise ValueError(f"--remasking {bad[0]!r}: the {family.name} sampler has "
                         f"{family.remasking}")
      groups = c.rollout.get("microbatch_groups", 0) or c.rollout.num_prompts
      given = {"rollout.microbatch_groups": int(groups)}
      variants = [{"rollout.cache": cache, "rollout.remasking": rule}
                  for cache in caches for rule in rules]
    else:
      given = {"eval.batch_size": int(c.eval.batch_size)}
      variants = [{}]
    for variant in variants:
      row = self.row(what, topology, given, variant=variant)
      rows.append(row)
      if row.get("fits") is False and not self.dry_run:
        found = self.search(what, topology, given, self._candidates(what, topology, given),
                            variant)
        row["recommended"] = None if found is None else {**variant, **found}
        self.store.put(row)
    return rows

  def _candidates(self, what: str, topology: str, given: dict[str, Any]) -> list[dict]:
    """Settings from the least memory up to the given one's."""
    c = self.config
    name = topology_name(topology)
    devices = _chips(name) * _DEVICES_PER_CHIP.get(_generation(name), 1)
    ways = _data_ways(c, devices)
    if what == "train":
      groups, choices = given["train.microbatch_groups"], _chunk_choices(c, ways)
      # A given microbatch that does not split over the devices: every valid one is a candidate.
      smaller = [g for g in choices if g <= groups] if groups in choices else choices
      return [{"train.microbatch_groups": g, "model.remat": True} for g in smaller]
    if what == "sampler":
      groups, choices = given["rollout.microbatch_groups"], _chunk_choices(c, ways)
      smaller = [g for g in choices if g < groups] if groups in choices else choices
      return [{"rollout.microbatch_groups": g} for g in smaller]
    sizes, b = [], given["eval.batch_size"] // 2
    while b >= ways:
      sizes.append(-(-b // ways) * ways)
      b //= 2
    return [{"eval.batch_size": s} for s in sorted(set(sizes))]


def _shard_bytes(tree) -> int:
  """One device's bytes of an abstract pytree with shardings (each leaf's largest shard)."""
  import jax  # pylint: disable=g-import-not-at-top
  return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
             for leaf in jax.tree.leaves(tree))


def _state_bytes(what: str, config, devices) -> dict[str, int]:
  """Per device: the parameters' (and for train the optimizer's and the batch's) shards, and for
  the samplers the KV cache (2 x layers x rows x positions x kv heads x head dim, rows split over
  data x fsdp); from the abstract inputs, nothing compiled."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from stabledrl_jax import profiling  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training import build, specs  # pylint: disable=g-import-not-at-top
  if what == "train":
    _, state, batch, _ = build.abstract_update(config, devices)
    return dict(parameters_bytes=_shard_bytes(state.params),
                optimizer_bytes=_shard_bytes(state.opt_state), batch_bytes=_shard_bytes(batch))
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  model_cfg = specs.model_config(config)
  _, state = build.abstract_params(config, mesh, model_cfg)
  r = config.rollout
  ways = mesh_lib.data_parallel_size(mesh)
  if what == "sampler":
    rows = (r.get("microbatch_groups", 0) or r.num_prompts) * r.group_size
    cached = r.cache != "none" or not hasattr(model_cfg, "d_model")  # SDAR's always caches.
  else:
    rows, cached = -(-config.eval.batch_size // ways) * ways, False
  shapes = profiling.flops_shapes(model_cfg)
  kv = 2 * shapes.n_layers * (rows // ways) * (r.prompt_length + r.gen_length) * (
      shapes.n_kv_heads * shapes.head_dim * jnp.dtype(model_cfg.dtype).itemsize)
  return dict(parameters_bytes=_shard_bytes(state), kv_cache_bytes=int(kv) if cached else 0,
              rows=rows, positions=r.prompt_length + r.gen_length)


def _data_ways(config, num_devices: int) -> int:
  """data x fsdp of ``config.mesh`` on ``num_devices`` (-1: the rest), without a mesh."""
  sizes = {a: int(config.mesh[a]) for a in ("data", "fsdp", "tensor")}
  known = math.prod(s for s in sizes.values() if s != -1)
  sizes = {a: (num_devices // known if s == -1 else s) for a, s in sizes.items()}
  return sizes["data"] * sizes["fsdp"]


def _list(text: str) -> list[str]:
  return [x.strip() for x in text.split(",") if x.strip()]


def _gib(n: int | None) -> str:
  return "?" if n is None else f"{n / 2**30:.3g}"


def _describe(row: dict[str, Any]) -> str:
  if row.get("memory"):
    m = row["memory"]
    fit = "fits" if row["fits"] else "does NOT fit"
    return (f"{_gib(m['total'])} GiB per chip ({_gib(m['argument'])} arguments + "
            f"{_gib(m['temp'])} temporaries) of {_gib(row['chip_bytes'])}: {fit}, "
            f"{row['compile_seconds']} s")
  return f"does NOT fit: {row['error']} ({row['compile_seconds']} s)"


# ---- the plan file -----------------------------------------------------------------------------


class Store:
  """The plan JSON: rows by key, written (atomically) after every change."""

  def __init__(self, path: str, resume: bool):
    self.path, self.resume = path, resume
    self.rows: dict[str, dict] = {}
    self.pending: dict[str, dict] = {}
    self.projections: dict[str, dict] = {}
    if path and os.path.exists(path):
      try:
        with open(path) as f:
          data = json.load(f)
        for row in data["rows"]:
          self.rows[self.key(row)] = row
        for row in data.get("pending", []):
          self.pending[self.key(row)] = row
        for p in data.get("projections", []):
          self.projections[self._pkey(p)] = p
      except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"--output {path}: not a plan file ({type(error).__name__}: "
                         f"{error}); move it away or choose another --output") from None

  @staticmethod
  def key(row: dict[str, Any]) -> str:
    return json.dumps([row["config"], row["overrides"], row["what"], row["topology"],
                       row["compiler"], row["settings"]], sort_keys=True)

  @staticmethod
  def _pkey(p: dict[str, Any]) -> str:
    return json.dumps([p["config"], p["overrides"], p["topology"], p["mfu"]], sort_keys=True)

  def put(self, row: dict[str, Any]) -> None:
    key = self.key(row)
    self.rows[key] = row
    self.pending.pop(key, None)
    self.write()

  def pend(self, row: dict[str, Any]) -> None:
    key = self.key(row)
    if key not in self.rows:
      self.pending[key] = dict(row, pending=True)
    self.write()

  def project(self, p: dict[str, Any]) -> None:
    self.projections[self._pkey(p)] = p
    self.write()

  def write(self) -> None:
    if not self.path:
      return
    data = dict(rows=list(self.rows.values()), pending=list(self.pending.values()),
                projections=list(self.projections.values()))
    try:
      with workdir_files.writing(self.path):
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
      workdir_files.write_text(self.path, json.dumps(data, indent=1) + "\n")
    except workdir_files.WorkdirError as error:
      raise workdir_files.WorkdirError(f"--output: {error}") from None


# ---- time projections --------------------------------------------------------------------------


def rl_step_flops(config, *, cache: str | None = None) -> dict[str, Any]:
  """The analytic FLOPs of one RL step of a trainer config (``profiling.rl_step_flops_of_run``
  of its model config and run spec), by part."""
  from stabledrl_jax import profiling  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training import specs  # pylint: disable=g-import-not-at-top
  model_cfg = specs.model_config(config)
  return profiling.rl_step_flops_of_run(model_cfg, config.rollout,
                                        specs.resolve_run(config, model_cfg),
                                        num_iterations=config.train.num_iterations, cache=cache)


def projection(config, *, config_label: str, overrides: list[str], topology: str,
               mfu: float) -> dict[str, Any]:
  """One RL step's analytic FLOPs and its time on ``topology`` at ``mfu`` (a projection)."""
  from stabledrl_jax import profiling  # pylint: disable=g-import-not-at-top
  name = topology_name(topology)
  chips, peak = _chips(name), profiling.TPU_CHIP_PEAK_FLOPS[_generation(name)]
  flops = rl_step_flops(config)
  step = profiling.projected_step_time(flops["total"], chips, peak, mfu)
  steps = int(config.train.num_steps)
  return dict(config=config_label, overrides=overrides, topology=topology, topology_name=name,
              chips=chips, peak_flops_per_chip=peak, mfu=mfu, step_flops=flops,
              step_seconds=step, num_steps=steps, run_hours=step * steps / 3600,
              cache=config.rollout.get("cache", "none"), projection=True)


# ---- Markdown ----------------------------------------------------------------------------------


def _settings_text(settings: dict[str, Any] | None) -> str:
  if not settings:
    return ""
  return ", ".join(f"`{k}={v}`" for k, v in settings.items())


def markdown(data: dict[str, Any]) -> str:
  """The plan file's rows (given settings; ladder rungs as their recommendation) and time
  projections as Markdown tables (docs/pods.md)."""
  lines = ["| config | slice | what | settings | GiB per chip (arguments + temporaries) | "
           "HBM GiB | fits | recommended | compiler | compile s |",
           "|---|---|---|---|---|---:|---|---|---|---:|"]
  rows = [r for r in data.get("rows", []) if not r.get("ladder")]
  rows += [dict(r, pending=True) for r in data.get("pending", [])]
  order = {}  # Slices in the order they first appear; within one, train, sampler, evaluate.
  for r in rows:
    order.setdefault((r["config"], r["topology"]), len(order))
  rows.sort(key=lambda r: (order[r["config"], r["topology"]], WHATS.index(r["what"])))
  for r in rows:
    name = r.get("topology_name") or topology_name(r["topology"])
    unit = "devices" if name.startswith("cpu:") else "chips"
    slice_text = (f"{r['topology']} ({_chips(name)} {unit})" if name == r["topology"] else
                  f"{r['topology']} (`{name}`, {_chips(name)} {unit})")
    config = r["config"] + "".join(f" `{o}`" for o in r.get("overrides", []))
    if r.get("pending"):
      lines.append(f"| {config} | {slice_text} | {r['what']} | {_settings_text(r['settings'])} "
                   f"| not compiled yet | {_gib(chip_bytes(name))} | | | {r['compiler']} | |")
      continue
    if r.get("memory"):
      m = r["memory"]
      size = f"{_gib(m['total'])} ({_gib(m['argument'])} + {_gib(m['temp'])})"
    elif r.get("per_chip_bytes"):
      size = f"out of memory: needs {_gib(r['per_chip_bytes'])}"
    else:
      size = f"not compiled: {r.get('error', '')}"
    fits = {True: "yes", False: "**no**", None: "?"}[r.get("fits")]
    rec = ""
    if r.get("fits") is False:
      rec = _settings_text(r["recommended"]) if r.get("recommended") else "none found"
    lines.append(f"| {config} | {slice_text} | {r['what']} | {_settings_text(r['settings'])} | "
                 f"{size} | {_gib(r['chip_bytes'])} | {fits} | {rec} | {r['compiler']} | "
                 f"{r['compile_seconds']:.0f} |")
  lines += _attention_savings(rows)
  projections = data.get("projections", [])
  if projections:
    lines += ["", "Projected time (analytic FLOPs at the stated MFU, not measured; "
              "`plan.rl_step_flops`):", "",
              "| config | slice | step PFLOP (rollout + scoring + updates) | MFU | "
              "step s | hours for the run's steps |", "|---|---|---|---:|---:|---:|"]
    for p in projections:
      f = p["step_flops"]
      name = p["topology_name"]
      config = p["config"] + "".join(f" `{o}`" for o in p.get("overrides", []))
      lines.append(f"| {config} | {p['topology']} ({_chips(name)} chips, "
                   f"{p['peak_flops_per_chip'] / 1e12:.0f} TFLOP/s each) | "
                   f"{f['total'] / 1e15:.1f} ({f['rollout'] / 1e15:.1f} + "
                   f"{f['scoring'] / 1e15:.1f} + {f['updates'] / 1e15:.1f}; cache "
                   f"{p['cache']}) | {p['mfu']:.2f} | {p['step_seconds']:.1f} | "
                   f"{p['run_hours']:.1f} ({p['num_steps']} steps) |")
  return "\n".join(lines) + "\n"


_XLA_ATTENTION = "config.model.attention=xla"


def _attention_savings(rows: list[dict[str, Any]]) -> list[str]:
  """A table of what the kernel attention saves: each compiled row planned again with
  ``--config.model.attention=xla`` (softmax attention that materializes the [B, H, L, L]
  scores) beside the row without that override (``auto``: splash on TPU)."""
  def key(r, drop=()):
    overrides = tuple(o for o in r.get("overrides", []) if o not in drop)
    return (r["config"], overrides, r["topology"], r["what"], r["compiler"],
            json.dumps(r["settings"], sort_keys=True))

  compiled = [r for r in rows if not r.get("pending") and r.get("per_chip_bytes")]
  kernel = {key(r): r for r in compiled if _XLA_ATTENTION not in r.get("overrides", [])}
  pairs = [(kernel[key(r, (_XLA_ATTENTION,))], r) for r in compiled
           if _XLA_ATTENTION in r.get("overrides", []) and key(r, (_XLA_ATTENTION,)) in kernel]
  if not pairs:
    return []
  lines = ["", "Attention kernel: the same programs with `--config.model.attention=xla` (softmax "
           "attention over materialized [B, H, L, L] scores) against the default (`auto`: "
           "splash attention with the tpu compiler, the same xla attention with the cpu one; "
           "a row that ran out of memory gives the bytes the compiler asked for):", "",
           "| config | slice | what | settings | GiB per chip, default | GiB per chip, xla | "
           "saved GiB |", "|---|---|---|---|---:|---:|---:|"]
  for auto, xla in pairs:
    config = auto["config"] + "".join(f" `{o}`" for o in auto.get("overrides", []))
    a, x = auto["per_chip_bytes"], xla["per_chip_bytes"]
    out_of_memory = "" if xla.get("memory") else " (out of memory)"
    lines.append(f"| {config} | {auto['topology']} | {auto['what']} | "
                 f"{_settings_text(auto['settings'])} | {_gib(a)} | {_gib(x)}{out_of_memory} | "
                 f"{_gib(x - a)} |")
  return lines


def _write_markdown(path: str, data: dict[str, Any]) -> None:
  text = markdown(data)
  if path == "-":
    sys.stdout.write(text)
  else:
    try:
      workdir_files.write_text(path, text)
    except workdir_files.WorkdirError as error:
      raise workdir_files.WorkdirError(f"--markdown: {error}") from None


# ---- the command -------------------------------------------------------------------------------


def _overrides(argv: list[str]) -> list[str]:
  """The ``--config.a.b=value`` flags, as given (they are part of a row's key)."""
  return [a[2:] for a in argv if a.startswith("--config.") or a.startswith("--noconfig.")]


def _config_label(argv: list[str]) -> str:
  for i, arg in enumerate(argv):
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
    if arg.startswith("--config="):
      return arg[len("--config="):]
  return ""


_ARGV: list[str] = []


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  try:
    run_plan()
  except (ValueError, RuntimeError, FileNotFoundError) as error:
    if _VERBOSE.value:
      raise
    sys.exit(f"error: {str(error).strip().splitlines()[0] if str(error).strip() else error}"
             " (--verbose shows the traceback)")


def run_plan() -> None:
  """The command's work, from its flags."""
  if _RENDER.value:
    if not _OUTPUT.value or not _MARKDOWN.value:
      raise ValueError("--render needs --output (the plan file) and --markdown")
    _write_markdown(_MARKDOWN.value, _load(_OUTPUT.value))
    return
  if _CONFIG.value is None:
    raise ValueError("--config is required (a shipped config's name or a config file)")
  whats = _list(_WHAT.value)
  bad = [w for w in whats if w not in WHATS]
  if bad or not whats:
    raise ValueError(f"--what {_WHAT.value!r}: choose from {','.join(WHATS)}")
  topologies = _list(_TOPOLOGY.value)
  if not topologies:
    raise ValueError("--topology: give at least one slice (v5litepod-4, v5p-8, v5e:8x8, ...)")
  names = [topology_name(t) for t in topologies]
  if not 0 < _MFU.value <= 1:
    raise ValueError(f"--mfu must be in (0, 1], got {_MFU.value}")
  for flag, path in (("--output", _OUTPUT.value), ("--markdown", _MARKDOWN.value)):
    if path and path != "-":  # Before any compile: a sweep must not end unable to write.
      workdir_files.check_writable(os.path.dirname(os.path.abspath(path)), flag)
      if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory; name a file")
  compiler = resolve_compiler(_COMPILER.value)
  if compiler == "cpu" and not _DRY_RUN.value:
    prepare_cpu_devices(cpu_devices_needed(names))
  if compiler == "tpu":  # Every name libtpu knows, before the first compile.
    for name in names:
      devices_for(name, compiler)
  from stabledrl_jax.training import specs  # pylint: disable=g-import-not-at-top
  config = _CONFIG.value
  specs.validate(config)  # Field errors before any compile (the slice's are rows).
  store = Store(_OUTPUT.value, resume=_RESUME.value)
  label, overrides = _config_label(_ARGV), _overrides(_ARGV)
  planner = Planner(config, config_label=label, overrides=overrides, compiler=compiler,
                    store=store, max_ladder=_MAX_LADDER.value if _RECOMMEND.value else 0,
                    dry_run=_DRY_RUN.value, caches=_list(_CACHES.value) or None,
                    remasking=_list(_REMASKING.value) or None, chip_gb=_CHIP_GB.value,
                    say=lambda s: print(s, flush=True))
  for topology in [t for t in topologies if not topology_name(t).startswith("cpu:")]:
    store.project(projection(config, config_label=label, overrides=overrides,
                             topology=topology, mfu=_MFU.value))
  if _DRY_RUN.value:  # Every given row pending first, so that a cut sweep shows what is left.
    for topology in topologies:
      for what in whats:
        planner.plan(what, topology)
  else:
    planner.dry_run = True
    for topology in topologies:
      for what in whats:
        planner.plan(what, topology)
    planner.dry_run = False
    for topology in topologies:
      for what in whats:
        planner.plan(what, topology)
  data = _load(_OUTPUT.value) if _OUTPUT.value else dict(
      rows=list(store.rows.values()), pending=list(store.pending.values()),
      projections=list(store.projections.values()))
  print()
  print(markdown(data), end="")
  if _MARKDOWN.value and _MARKDOWN.value != "-":
    _write_markdown(_MARKDOWN.value, data)
  if _OUTPUT.value:
    print(f"\nwrote {_OUTPUT.value}")


def _load(path: str) -> dict[str, Any]:
  if not os.path.exists(path):
    raise FileNotFoundError(f"--output {path}: no such plan file")
  store = Store(path, resume=True)
  return dict(rows=list(store.rows.values()), pending=list(store.pending.values()),
              projections=list(store.projections.values()))


def run() -> None:
  """The console script ``stabledrl-plan``: ``--config NAME`` resolved, then absl."""
  global _ARGV
  argv = cli_flags.resolve_argv(sys.argv)
  _ARGV = list(sys.argv)
  app.run(main, argv=argv)


if __name__ == "__main__":
  run()
