"""The plan command's flags and work: ``python -m stabledrl_jax.plan`` (``stabledrl-plan``); the
rows, their search and the tables are ``plan.search``, ``plan.estimates`` and ``plan.report``."""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging

from stabledrl_jax import cli_flags, workdir_files
from stabledrl_jax.plan import catalog, estimates, report, search

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


def _list(text: str) -> list[str]:
  return [x.strip() for x in text.split(",") if x.strip()]


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
    report.write_markdown(_MARKDOWN.value, report.load(_OUTPUT.value))
    return
  if _CONFIG.value is None:
    raise ValueError("--config is required (a shipped config's name or a config file)")
  whats = _list(_WHAT.value)
  bad = [w for w in whats if w not in report.WHATS]
  if bad or not whats:
    raise ValueError(f"--what {_WHAT.value!r}: choose from {','.join(report.WHATS)}")
  topologies = _list(_TOPOLOGY.value)
  if not topologies:
    raise ValueError("--topology: give at least one slice (v5litepod-4, v5p-8, v5e:8x8, ...)")
  names = [catalog.topology_name(t) for t in topologies]
  if not 0 < _MFU.value <= 1:
    raise ValueError(f"--mfu must be in (0, 1], got {_MFU.value}")
  for flag, path in (("--output", _OUTPUT.value), ("--markdown", _MARKDOWN.value)):
    if path and path != "-":  # Before any compile: a sweep must not end unable to write.
      workdir_files.check_writable(os.path.dirname(os.path.abspath(path)), flag)
      if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory; name a file")
  compiler = catalog.resolve_compiler(_COMPILER.value)
  if compiler == "cpu" and not _DRY_RUN.value:
    catalog.prepare_cpu_devices(catalog.cpu_devices_needed(names))
  if compiler == "tpu":  # Every name libtpu knows, before the first compile.
    for name in names:
      catalog.devices_for(name, compiler)
  from stabledrl_jax.training.config import specs  # pylint: disable=g-import-not-at-top
  config = _CONFIG.value
  specs.validate(config)  # Field errors before any compile (the slice's are rows).
  store = report.Store(_OUTPUT.value, resume=_RESUME.value)
  label, overrides = _config_label(_ARGV), _overrides(_ARGV)
  planner = search.Planner(config, config_label=label, overrides=overrides, compiler=compiler,
                    store=store, max_ladder=_MAX_LADDER.value if _RECOMMEND.value else 0,
                    dry_run=_DRY_RUN.value, caches=_list(_CACHES.value) or None,
                    remasking=_list(_REMASKING.value) or None, chip_gb=_CHIP_GB.value,
                    say=lambda s: print(s, flush=True))
  for topology in [t for t in topologies if not catalog.topology_name(t).startswith("cpu:")]:
    store.project(estimates.projection(config, config_label=label, overrides=overrides,
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
  data = report.load(_OUTPUT.value) if _OUTPUT.value else dict(
      rows=list(store.rows.values()), pending=list(store.pending.values()),
      projections=list(store.projections.values()))
  print()
  print(report.markdown(data), end="")
  if _MARKDOWN.value and _MARKDOWN.value != "-":
    report.write_markdown(_MARKDOWN.value, data)
  if _OUTPUT.value:
    print(f"\nwrote {_OUTPUT.value}")


def run() -> None:
  """The console script ``stabledrl-plan``: ``--config NAME`` resolved, then absl."""
  global _ARGV
  argv = cli_flags.resolve_argv(sys.argv)
  _ARGV = list(sys.argv)
  app.run(main, argv=argv)
