r"""Greedy eval accuracy of a trained workdir under each KV-cache setting of the sampler.

  python experiments/cache_accuracy.py runs/quickstart [--block_lengths 40,8] [--output F.json]

Restores the workdir's latest checkpoint and decodes its held-out prompts greedily (the
trainer's evaluation: ``Trainer.evaluate``, the task's metric in percent) with every
``cache`` (none = exact, prefix, dual; docs/models.md, "Sampling") and remasking rule
(low_confidence with the run's eval steps; threshold with ``--threshold``), for each block
length (the quickstart's completion is one block of 40; with blocks of 8 the cache is reused
across 5 blocks). Prints a Markdown table: accuracy, the change from the exact sampler, model
calls per sequence and seconds (on whatever machine; a shared one varies).
"""

from __future__ import annotations

import json
import time

import jax
from absl import app, flags, logging

from stabledrl_jax.models.llada.sampler import CACHES
from stabledrl_jax.training import checkpoint_source, trainer

_BLOCK_LENGTHS = flags.DEFINE_list("block_lengths", ["40", "8"], "Block lengths to decode with.")
_THRESHOLD = flags.DEFINE_float("threshold", 0.9, "tau of the threshold rows.")
_OUTPUT = flags.DEFINE_string("output", None, "Also write the rows as JSON here.")


def main(argv):
  if len(argv) != 2:
    raise app.UsageError("usage: cache_accuracy.py WORKDIR [--block_lengths 40,8]")
  logging.set_verbosity(logging.WARNING)  # Not orbax's INFO lines.
  workdir = argv[1]
  config = checkpoint_source.training_config(workdir)
  if config is None:
    raise app.UsageError(f"{workdir} is not a training workdir (no config.json)")
  run = trainer.Trainer(config, workdir)
  rows = []
  try:
    key = jax.random.key(config.seed + 1)  # The trainer's evaluation key.
    for block_length in (int(b) for b in _BLOCK_LENGTHS.value):
      for remasking in ("low_confidence", "threshold"):
        exact = None
        for cache in CACHES:
          start = time.perf_counter()
          metrics = run.evaluate(run.state.params, key, cache=cache, remasking=remasking,
                                 threshold=_THRESHOLD.value, block_length=block_length)
          seconds = time.perf_counter() - start
          exact = metrics["eval/accuracy"] if cache == "none" else exact
          rows.append({"block_length": block_length, "remasking": remasking, "cache": cache,
                       "accuracy": metrics["eval/accuracy"],
                       "change": metrics["eval/accuracy"] - exact,
                       "model_calls": metrics["eval/model_calls"], "seconds": seconds})
  finally:
    run.close()
  print(f"Greedy eval accuracy of {workdir} (step {int(run.state.step)}), "
        f"{len(run.eval_prompts.examples)} held-out prompts:\n")
  print("| block | remasking | cache | accuracy | vs exact | calls / seq | seconds |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['block_length']} | {r['remasking']} | {r['cache']} | {r['accuracy']:.2f} | "
          f"{r['change']:+.2f} | {r['model_calls']:.1f} | {r['seconds']:.1f} |")
  if _OUTPUT.value:
    with open(_OUTPUT.value, "w") as f:
      json.dump({"workdir": workdir, "step": int(run.state.step), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
