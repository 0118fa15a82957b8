"""Threshold decoding against LLaDA's fixed schedule: model calls per sequence and greedy accuracy.

    python -m stabledrl_jax.train --config configs/quickstart.py --workdir /tmp/qs   # once
    python experiments/threshold_decoding.py --workdir /tmp/qs --output /tmp/qs/threshold.json

Loads the latest checkpoint of a run directory (or, if it has none, its supervised start
`<workdir>/sft_model`), rebuilds the run's held-out set from its `config.json`, and decodes it
greedily through the trainer's evaluation path (`training/step/decoding.py`):

  low_confidence   LLaDA's schedule with the evaluation's steps (`eval.steps`, else gen_length / 2)
  threshold tau    `remasking="threshold"`: every masked position of the block whose confidence
                   exceeds tau, at least one per step (`sampling.generate`)

and prints a table: the task's accuracy (the trainer's `eval/accuracy`), mean model calls per
sequence, and the ratio of calls to low_confidence's. The run directory is only read.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp

from stabledrl_jax import tasks
from stabledrl_jax.training.config import run_spec, specs
from stabledrl_jax.training.inputs import data
from stabledrl_jax.training.parallel import mesh as mesh_lib
from stabledrl_jax.training.state import checkpoint_source, supervised
from stabledrl_jax.training.step import decoding


def load_source(workdir: str) -> checkpoint_source.CheckpointSource:
  """The run's latest checkpoint, or its supervised start if it has none."""
  try:
    return checkpoint_source.resolve(workdir)
  except ValueError:
    start = os.path.join(workdir, supervised.SFT_DIR)
    if not os.path.isdir(start):
      raise FileNotFoundError(f"{workdir} has neither checkpoints nor {supervised.SFT_DIR}/") from None
    return checkpoint_source.resolve(start)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="a trainer run directory")
  parser.add_argument("--thresholds", default="0.5,0.7,0.9,0.95")
  parser.add_argument("--output", default="", help="JSON file to write")
  args = parser.parse_args()
  thresholds = [float(t) for t in args.thresholds.split(",") if t]

  source = load_source(args.workdir)
  config = source.config
  mesh = mesh_lib.make_mesh(config.mesh)
  model = checkpoint_source.load_model(source, mesh=mesh, dtype=jnp.float32)
  tokenizer = data.make_tokenizer(config.tokenizer)
  task = tasks.get_task(config.task.name)
  prompts = data.encode_examples(specs.resolve_rollout(config), tokenizer, task, data.make_examples(config, "eval"))
  key = jax.random.key(config.seed + 1)  # The trainer's evaluation key.
  r = config.rollout
  evaluate = lambda settings: decoding.metrics_of(decoding.score_batches(
      model, tokenizer, task, prompts.examples, prompts.tokens, prompts.mask, key, settings,
      mesh=mesh, batch_size=config.eval.batch_size, reward_scheme=config.task.reward),
      len(prompts.examples))
  base = run_spec.Decoding.of_rollout(r, temperature=0.0, steps=config.eval.steps,
                                      remasking="low_confidence")
  settings = [("low_confidence", f"low_confidence, {base.steps} steps", base, {})]
  for tau in thresholds:
    options = dict(remasking="threshold", threshold=tau)
    settings.append((f"threshold_{tau}", f"threshold tau = {tau}",
                     run_spec.Decoding.of_rollout(r, temperature=0.0, steps=config.eval.steps,
                                                  **options), options))
  rows = []
  for name, label, setting, options in settings:
    evaluate(setting)  # Compiles; the timed call below does not.
    start = time.perf_counter()
    result = evaluate(setting)
    rows.append(dict(name=name, label=label, accuracy=result["eval/accuracy"],
                     model_calls=result["eval/model_calls"],
                     seconds=time.perf_counter() - start, **options))
  first = rows[0]
  for row in rows:
    row["calls_vs_low_confidence"] = row["model_calls"] / first["model_calls"]
    row["accuracy_vs_low_confidence"] = row["accuracy"] - first["accuracy"]

  origin = f"checkpoint step {source.step}" if source.step is not None else supervised.SFT_DIR
  print(f"{args.workdir} ({origin}): {len(prompts.examples)} held-out prompts, "
        f"gen_length {r.gen_length}, block_length {r.block_length}, greedy\n")
  print("| decoding | accuracy % | model calls / sequence | calls vs low_confidence | "
        "eval seconds |")
  print("|---|---:|---:|---:|---:|")
  for row in rows:
    print(f"| {row['label']} | {row['accuracy']:.2f} | {row['model_calls']:.2f} | "
          f"{row['calls_vs_low_confidence']:.2f}x | {row['seconds']:.2f} |")
  if args.output:
    with open(args.output, "w") as f:
      json.dump(dict(workdir=args.workdir, source=origin, eval_steps=base.steps, rows=rows), f,
                indent=2)
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
  main()
