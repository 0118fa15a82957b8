r"""Where a training run reads its config: every read of a config field, by the module that
reads it, while ``Trainer`` builds and runs a tiny run (docs/training.md, the run_spec row).

  python experiments/config_reads.py [--workdir DIR]

Each ``ml_collections.ConfigDict`` attribute, item or ``get`` read is counted against the module
of the code that made it (the first frame outside ml_collections), and split into the reads
before the run is resolved (``specs.resolve``, validation included) and after it. Prints a
Markdown table: module, reads during validation and resolution, reads after. The aim
(#55): after resolution the config goes into the checkpoints' meta and the build's sources
(model, supervised start, tokenizer, data) alone; the loop reads the record.
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile

from absl import app, flags
import ml_collections

from stabledrl_jax.training.config import config_lib, specs
from stabledrl_jax.training.loop import trainer

_WORKDIR = flags.DEFINE_string("workdir", None, "Where the tiny run trains (default: a temp dir).")


def _tiny_config() -> ml_collections.ConfigDict:
  config = config_lib.get("quickstart")
  config.data.update(train_size=64, eval_size=8)
  config.rollout.update(num_prompts=2, group_size=4, steps=10)
  config.sft.update(num_steps=5, batch_size=16)
  config.train.update(num_steps=2, num_iterations=2)
  config.eval.update(every_steps=1)
  config.checkpoint.update(every_steps=1)
  return config


class _Reads:
  """Counts config reads by reading module and phase."""

  def __init__(self):
    self.counts = collections.Counter()
    self.phase = "resolve"
    self.inside = False

  def caller(self) -> str:
    frame = sys._getframe(2)  # pylint: disable=protected-access
    while frame is not None and ("ml_collections" in frame.f_code.co_filename
                                 or frame.f_code.co_filename == __file__):
      frame = frame.f_back
    if frame is None:
      return "?"
    path = frame.f_code.co_filename
    marker = f"stabledrl_jax{os.sep}"
    return (path[path.rindex(marker):].replace(os.sep, ".").removesuffix(".py")
            if marker in path else os.path.basename(path))

  def install(self):
    reads = self
    originals = {}
    for name in ("__getattr__", "__getitem__", "get"):
      original = getattr(ml_collections.ConfigDict, name)
      originals[name] = original

      def counted(self, *args, _original=original, **kwargs):
        if reads.inside:  # A read inside a read (get -> __getitem__): counted once.
          return _original(self, *args, **kwargs)
        reads.counts[(reads.phase, reads.caller())] += 1
        reads.inside = True
        try:
          return _original(self, *args, **kwargs)
        finally:
          reads.inside = False

      setattr(ml_collections.ConfigDict, name, counted)
    return originals


def count_reads(config: ml_collections.ConfigDict, workdir: str) -> collections.Counter:
  """{(phase, module): reads} of ``trainer.train(config, workdir)``: phase 'resolve' until
  ``specs.resolve`` returns (validation included), then 'after'."""
  reads = _Reads()
  real_resolve = specs.resolve

  def resolve(*args, **kwargs):
    reads.phase = "resolve"
    try:
      return real_resolve(*args, **kwargs)
    finally:
      reads.phase = "after"

  specs.resolve = resolve
  originals = reads.install()
  try:
    trainer.train(config, workdir)
  finally:
    for name, original in originals.items():
      setattr(ml_collections.ConfigDict, name, original)
    specs.resolve = real_resolve
  return reads.counts


def main(argv):
  del argv
  workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="config_reads_")
  counts = count_reads(_tiny_config(), workdir)
  modules = sorted({module for _, module in counts})
  rows = [(m, counts[("resolve", m)], counts[("after", m)]) for m in modules]
  rows.sort(key=lambda r: (-r[2], -r[1], r[0]))
  print(f"Config reads of a tiny run (2 RL steps, evaluation every step) in {workdir}:\n")
  print("| module | validation and resolution | after |")
  print("|---|---:|---:|")
  for module, before, after in rows:
    print(f"| {module} | {before} | {after} |")
  print(f"| all ({len(modules)} modules) | {sum(r[1] for r in rows)} | "
        f"{sum(r[2] for r in rows)} |")


if __name__ == "__main__":
  app.run(main)
