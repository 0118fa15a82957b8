"""The planner's search: each row compiled (by an injected compile function) and, where the given
settings do not fit, a small ladder of settings searched for the largest that fits; the
compiler's out-of-memory read as a row, never a crash."""

from __future__ import annotations

import json
import re
import time
from typing import Any, Callable

from stabledrl_jax.plan import catalog, estimates, report
from stabledrl_jax.training.parallel import mesh as mesh_lib

# Remasking rules whose program differs from the configured one's (static vs dynamic loop).
COUNTERPART = {"low_confidence": "threshold", "random": "threshold", "threshold": "low_confidence",
               "low_confidence_static": "low_confidence_dynamic",
               "low_confidence_dynamic": "low_confidence_static"}

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


def apply_settings(config, settings: dict[str, Any]):
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


def _ways(config, num_devices: int) -> int:
  """data x fsdp: the devices a batch's rows split over (``mesh.mesh_shape``)."""
  data, fsdp, _ = mesh_lib.mesh_shape(config.mesh, num_devices)
  return data * fsdp


class Planner:
  """Compiles rows for one config on one slice, writing each to the plan file."""

  def __init__(self, config, *, config_label: str, overrides: list[str], compiler: str,
               store: report.Store, max_ladder: int = 4, dry_run: bool = False,
               caches: list[str] | None = None, remasking: list[str] | None = None,
               chip_gb: float = 0.0, say: Callable[[str], None] = print,
               compile_fn: Callable[[str, Any, list], Any] | None = None,
               state_bytes: Callable[[str, Any, list], dict[str, int]] | None = None):
    """``caches``, ``remasking``: the sampler's (None: the family's caches; the configured rule
    and its counterpart); ``chip_gb`` > 0: one chip's memory instead of its HBM. ``compile_fn``:
    (what, config, devices) -> a result whose ``memory`` holds per-device bytes (argument,
    output, alias, temp, total), or the compiler's out-of-memory raised (default
    ``compile_program``); ``state_bytes``: (what, config, devices) -> per-device bytes of the
    state's parts (default ``estimates.state_bytes``)."""
    self.config, self.label, self.overrides = config, config_label, overrides
    self.compiler, self.store, self.max_ladder = compiler, store, max_ladder
    self.dry_run, self.caches, self.remasking = dry_run, caches, remasking
    self.chip_gb, self.say = chip_gb, say
    self.compile_fn = compile_fn or compile_program
    self.state_bytes = state_bytes or estimates.state_bytes

  # One compile (or a row from the file).
  def row(self, what: str, topology: str, settings: dict[str, Any], *, variant: dict[str, Any],
          ladder: bool = False) -> dict[str, Any]:
    name = catalog.topology_name(topology)
    base = dict(what=what, config=self.label, overrides=self.overrides, topology=topology,
                topology_name=name, compiler=self.compiler, settings={**variant, **settings})
    key = report.Store.key(base)
    if self.store.resume and key in self.store.rows:
      return self.store.rows[key]
    if self.dry_run:
      self.store.pend(base)
      return dict(base, fits=None, pending=True)
    self.say(f"compiling {what} on {topology} ({name}, {self.compiler}) "
             f"{json.dumps(base['settings'])} ...")
    out = dict(base, ladder=ladder, chips=catalog.chips(name),
               chip_bytes=catalog.chip_bytes(name, self.chip_gb))
    start = time.perf_counter()
    try:
      devices = catalog.devices_for(name, self.compiler)
      out["devices"] = len(devices)
      per_chip = len(devices) // out["chips"]
      config = apply_settings(self.config, base["settings"])
      result = self.compile_fn(what, config, devices)
      memory = {k: v * per_chip for k, v in result.memory.items()}
      out.update(per_chip_bytes=memory["total"], memory=memory,
                 fits=memory["total"] <= out["chip_bytes"], error=None)
      out.update({k: v * per_chip for k, v in self.state_bytes(what, config, devices).items()})
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
    self.say(f"  {report.describe(out)}")
    self.store.put(out)
    return out

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
          r for r in [COUNTERPART.get(c.rollout.remasking)] if r in family.remasking]
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
    from stabledrl_jax.training.config import specs  # pylint: disable=g-import-not-at-top
    c = self.config
    try:
      ways = _ways(c, catalog.num_devices(catalog.topology_name(topology)))
    except ValueError:
      return []  # The mesh does not fit the slice: the row's error says so; no setting helps.
    if what == "train":
      groups, choices = given["train.microbatch_groups"], specs.microbatch_groups_for(c, ways)
      # A given microbatch that does not split over the devices: every valid one is a candidate.
      smaller = [g for g in choices if g <= groups] if groups in choices else choices
      return [{"train.microbatch_groups": g, "model.remat": True} for g in smaller]
    if what == "sampler":
      groups, choices = given["rollout.microbatch_groups"], specs.microbatch_groups_for(c, ways)
      smaller = [g for g in choices if g < groups] if groups in choices else choices
      return [{"rollout.microbatch_groups": g} for g in smaller]
    sizes, b = [], given["eval.batch_size"] // 2
    while b >= ways:
      sizes.append(-(-b // ways) * ways)
      b //= 2
    return [{"eval.batch_size": s} for s in sorted(set(sizes))]


def compile_program(what: str, config, devices) -> Any:
  """Compiles ``what`` (train, sampler, evaluate) of ``config`` for ``devices`` with the TPU
  compiler or XLA:CPU (``tpu_compile``); the result's ``memory`` is per device. The planner's
  default compile function. The config is resolved once (``specs.resolve``, every check over
  the slice's devices) and the program built from the record.

  Raises:
    ValueError: a setting the slice cannot take (the config check), naming the field.
  """
  from stabledrl_jax import tpu_compile  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.config import specs  # pylint: disable=g-import-not-at-top
  if what == "train":
    return tpu_compile.compile_train_step(config, devices)  # rl_step.abstract_programs.
  with config.unlocked():
    config.model.remat = False  # Inference: nothing is kept for a backward pass.
    # The train step's microbatch plays no part here; one that the slice cannot split (the
    # train row says so) must not refuse the sampler's or the evaluation's row.
    choices = specs.microbatch_groups_for(config, _ways(config, len(devices)))
    if choices and config.train.microbatch_groups not in choices + [0]:
      config.train.microbatch_groups = choices[-1]
  resolved = specs.resolve(config, len(devices))  # The sampler's chunks split over the mesh.
  rollout = resolved.rollout
  if what == "sampler":
    return tpu_compile.compile_decode(config, devices, rollout.sampling, model=resolved.model,
                                      rows=rollout.chunk_rows or rollout.num_rows,
                                      what="sampler")
  ways = resolved.data_ways
  rows = -(-config.eval.batch_size // ways) * ways  # Padded as decoding.generate_batches pads.
  return tpu_compile.compile_decode(config, devices, rollout.evaluation, model=resolved.model,
                                    rows=rows, what="evaluate")
