r"""Greedy eval accuracy of a trained workdir under each KV-cache setting of the sampler.

  python experiments/cache_accuracy.py runs/quickstart [--block_lengths 40,8] [--output F.json]

Loads the workdir's latest checkpoint (``checkpoint_source.load_model``; the workdir is opened
read-only, so a training may go on beside it) and decodes its held-out prompts greedily (the
trainer's evaluation, ``decoding.evaluate``: the task's metric in percent) with every ``cache``
the model's family takes (none = exact; LLaDA: prefix, dual; docs/models.md, "Sampling") and
remasking rule
(low_confidence with the run's eval steps; threshold with ``--threshold``), for each block
length (the quickstart's completion is one block of 40; with blocks of 8 the cache is reused
across 5 blocks). Prints a Markdown table: accuracy, the change from the exact sampler, model
calls per sequence and seconds (on whatever machine; a shared one varies).
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
from absl import app, flags, logging

from stabledrl_jax.training.loop import run_build
from stabledrl_jax.training.state import checkpoint_source
from stabledrl_jax.training.step import decoding

_BLOCK_LENGTHS = flags.DEFINE_list("block_lengths", ["40", "8"], "Block lengths to decode with.")
_THRESHOLD = flags.DEFINE_float("threshold", 0.9, "tau of the threshold rows.")
_OUTPUT = flags.DEFINE_string("output", None, "Also write the rows as JSON here.")


def accuracy_rows(workdir: str, block_lengths: list[int], threshold: float
                  ) -> tuple[checkpoint_source.CheckpointSource, int, list[dict]]:
  """(the checkpoint, the number of held-out prompts, a row per block length, remasking rule
  and cache) of ``workdir``'s latest checkpoint."""
  config = checkpoint_source.training_config(workdir)
  if config is None:
    raise app.UsageError(f"{workdir} is not a training workdir (no config.json)")
  source = checkpoint_source.resolve(workdir)
  inputs = run_build.read_inputs(config)
  resolved, mesh = inputs.resolved, inputs.mesh
  model = checkpoint_source.load_model(source, mesh=mesh, dtype=jnp.dtype(config.model.dtype))
  key = jax.random.key(config.seed + 1)  # The trainer's evaluation key.
  rows = []
  for block_length in block_lengths:
    for remasking in ("low_confidence", "threshold"):
      exact = None
      for cache in resolved.family_record.caches:
        start = time.perf_counter()
        settings = resolved.rollout.evaluation.with_options(
            cache=cache, remasking=remasking, threshold=threshold, block_length=block_length)
        metrics = decoding.evaluate(model, inputs.tokenizer, inputs.task, inputs.eval_prompts,
                                    key, settings, mesh=mesh,
                                    batch_size=resolved.loop.eval_batch_size,
                                    reward_scheme=resolved.data.reward)
        seconds = time.perf_counter() - start
        exact = metrics["eval/accuracy"] if cache == "none" else exact
        rows.append({"block_length": block_length, "remasking": remasking, "cache": cache,
                     "accuracy": metrics["eval/accuracy"],
                     "change": metrics["eval/accuracy"] - exact,
                     "model_calls": metrics["eval/model_calls"],
                     "reward_mean": metrics["eval/reward_mean"], "seconds": seconds})
  return source, len(inputs.eval_prompts.examples), rows


def main(argv):
  if len(argv) != 2:
    raise app.UsageError("usage: cache_accuracy.py WORKDIR [--block_lengths 40,8]")
  logging.set_verbosity(logging.WARNING)  # Not orbax's INFO lines.
  workdir = argv[1]
  source, num_prompts, rows = accuracy_rows(workdir, [int(b) for b in _BLOCK_LENGTHS.value],
                                            _THRESHOLD.value)
  print(f"Greedy eval accuracy of {workdir} (step {source.step}), "
        f"{num_prompts} held-out prompts:\n")
  print("| block | remasking | cache | accuracy | vs exact | calls / seq | seconds |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['block_length']} | {r['remasking']} | {r['cache']} | {r['accuracy']:.2f} | "
          f"{r['change']:+.2f} | {r['model_calls']:.1f} | {r['seconds']:.1f} |")
  if _OUTPUT.value:
    with open(_OUTPUT.value, "w") as f:
      json.dump({"workdir": workdir, "step": source.step, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
