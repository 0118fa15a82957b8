"""Threshold decoding against LLaDA's fixed schedule: model calls per sequence and greedy accuracy.

    python -m stabledrl_jax.train --config configs/quickstart.py --workdir /tmp/qs   # once
    python experiments/threshold_decoding.py --workdir /tmp/qs --output /tmp/qs/threshold.json

Loads the latest checkpoint of a run directory (or, if it has none, its supervised start
`<workdir>/sft_model`), rebuilds the run's held-out set from its `config.json`, and decodes it
greedily, as the trainer's evaluation does:

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
import tempfile
import time

import jax
from flax import nnx

from stabledrl_jax import models
from stabledrl_jax.training import checkpointing, config_lib, trainer as trainer_lib


def load_config(workdir: str):
  """The run's config.json over `base_config()`: fields added since the run keep their defaults."""
  with open(os.path.join(workdir, "config.json")) as f:
    saved = json.load(f)
  config = config_lib.base_config()
  config.update(saved)
  return config


def trained_params(trainer: trainer_lib.Trainer, workdir: str) -> tuple[object, str]:
  """The parameters of the run's latest checkpoint (or its supervised start) and their source."""
  if os.path.isdir(os.path.join(workdir, "checkpoints")):
    checkpointer = checkpointing.Checkpointer(workdir)
    step = checkpointer.latest_step()
    if step is not None:
      state, _ = checkpointer.restore(step, checkpointing.abstract_like(trainer.state))
      checkpointer.close()
      return state.params, f"checkpoint step {step}"
  path = os.path.join(workdir, trainer_lib.SFT_DIR)
  if not os.path.exists(os.path.join(path, "config.json")):
    raise FileNotFoundError(f"{workdir} has neither checkpoints nor {trainer_lib.SFT_DIR}/")
  model = models.from_pretrained(path, mesh=trainer.mesh)
  return nnx.split(model, nnx.Param)[1], trainer_lib.SFT_DIR


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="a trainer run directory")
  parser.add_argument("--thresholds", default="0.5,0.7,0.9,0.95")
  parser.add_argument("--output", default="", help="JSON file to write")
  args = parser.parse_args()
  thresholds = [float(t) for t in args.thresholds.split(",") if t]

  config = load_config(args.workdir)
  config.sft.num_steps = 0  # The parameters come from the run; nothing is fitted here.
  with tempfile.TemporaryDirectory() as scratch:  # The trainer writes its own files there.
    trainer = trainer_lib.Trainer(config, scratch)
    params, source = trained_params(trainer, args.workdir)
    key = jax.random.key(config.seed + 1)
    r = config.rollout
    steps = config.eval.steps or max(r.gen_length // 2, r.gen_length // r.block_length)
    settings = [("low_confidence", f"low_confidence, {steps} steps", {})]
    settings += [(f"threshold_{tau}", f"threshold tau = {tau}",
                  dict(remasking="threshold", threshold=tau)) for tau in thresholds]
    rows = []
    for name, label, options in settings:
      trainer.evaluate(params, key, **options)  # Compiles; the timed call below does not.
      start = time.perf_counter()
      result = trainer.evaluate(params, key, **options)
      rows.append(dict(name=name, label=label, accuracy=result["eval/accuracy"],
                       model_calls=result["eval/model_calls"],
                       seconds=time.perf_counter() - start, **options))
    trainer.writer.close()
    trainer.checkpointer.close()
  base = rows[0]
  for row in rows:
    row["calls_vs_low_confidence"] = row["model_calls"] / base["model_calls"]
    row["accuracy_vs_low_confidence"] = row["accuracy"] - base["accuracy"]

  print(f"{args.workdir} ({source}): {len(trainer.eval_prompts.examples)} held-out prompts, "
        f"gen_length {r.gen_length}, block_length {r.block_length}, greedy\n")
  print("| decoding | accuracy % | model calls / sequence | calls vs low_confidence | "
        "eval seconds |")
  print("|---|---:|---:|---:|---:|")
  for row in rows:
    print(f"| {row['label']} | {row['accuracy']:.2f} | {row['model_calls']:.2f} | "
          f"{row['calls_vs_low_confidence']:.2f}x | {row['seconds']:.2f} |")
  if args.output:
    with open(args.output, "w") as f:
      json.dump(dict(workdir=args.workdir, source=source, eval_steps=steps, rows=rows), f,
                indent=2)
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
  main()
