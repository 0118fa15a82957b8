r"""Which hardware runs which LLaDA-8B config: LoRA (bfloat16 or 4-bit base) against full-parameter.

    python experiments/lora_hardware.py --output runs/lora_hardware.json [--readme README.md]

Compiles each (config, slice) below with ``python -m stabledrl_jax.plan`` (the train step, and the
rollout sampler with the dual KV cache), libtpu's TPU compiler for the TPU slices and XLA:CPU on
one fake device with 80 GB for "one 80 GB GPU" (an upper bound: XLA:CPU upcasts bf16 products to
float32 and keeps more alive; no GPU compiler runs here). Every row is kept in ``--output`` and
a rerun compiles only what is missing (``--resume``). Prints a Markdown table and with
``--readme`` writes it between the README's ``<!-- lora-hardware:begin -->`` and
``<!-- lora-hardware:end -->``. An 8B compile takes 5 to 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quickstart_seeds  # pylint: disable=g-import-not-at-top,wrong-import-position  (its writer)

# (config, what it is, slices). The sampler is the same program for every objective on a base of
# one storage, so it is compiled for one config of each.
RUNS = [
    ("llada8b_stabledrl_lora:gsm8k", "LoRA r 128, bfloat16 base (ESPO's; StableDRL on LoRA)",
     ["v5litepod-8", "v6e-8", "cpu:1"]),
    ("llada8b_d1:gsm8k", "LoRA r 128, NF4 base (d1, SPG, wd1)", ["v5litepod-8", "cpu:1"]),
    ("llada8b_gsm8k", "StableDRL, every parameter (the paper's)", ["v5litepod-8", "v6e-8"]),
]
MARKER = "lora-hardware"  # The README's <!-- lora-hardware:begin --> ... :end -->.
_NAMES = {"cpu:1": "one 80 GB GPU (XLA:CPU bound)"}


def plan(config: str, topology: str, output: str, max_ladder: int) -> None:
  compiler = ["--compiler=cpu", "--chip_gb=80"] if topology.startswith("cpu:") else []
  subprocess.run([sys.executable, "-m", "stabledrl_jax.plan", "--config", config,
                  f"--topology={topology}", "--what=train,sampler", "--caches=dual",
                  "--remasking=low_confidence", f"--output={output}", "--resume",
                  f"--max_ladder={max_ladder}", *compiler], check=True)


def _gb(value) -> str:
  return "" if value is None else f"{value / 2**30:.1f}"


def table(output: str) -> str:
  with open(output) as f:
    rows = [r for r in json.load(f)["rows"] if not r.get("ladder")]
  lines = ["| config | slice | train step GiB per chip | sampler GiB per chip | HBM GiB | runs |",
           "|---|---|---:|---:|---:|---|"]
  for config, what, slices in RUNS:
    for topology in slices:
      found = {r["what"]: r for r in rows if r["config"] == config and r["topology"] == topology}
      if not found:
        continue

      def size(kind):
        r = found.get(kind)
        if r is None:
          return "", None
        need = r["memory"]["total"] if r.get("memory") else r.get("per_chip_bytes")
        changed = {k: v for k, v in (r.get("recommended") or {}).items()
                   if r.get("settings", {}).get(k) != v}
        note = "" if r.get("fits") or not changed else " (fits with " + ", ".join(
            f"{k}={v}" for k, v in changed.items()) + ")"
        return _gb(need) + note, r.get("fits") or bool(r.get("recommended"))

      (train, train_ok), (sampler, sampler_ok) = size("train"), size("sampler")
      chip = next(iter(found.values()))["chip_bytes"]
      runs = "yes" if train_ok and sampler_ok else "**no**"
      lines.append(f"| `{config}` ({what}) | {_NAMES.get(topology, topology)} | {train} | "
                   f"{sampler} | {_gb(chip)} | {runs} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--output", default="runs/lora_hardware.json")
  parser.add_argument("--readme", default=None)
  parser.add_argument("--max_ladder", type=int, default=2,
                      help="settings searched where the given ones do not fit (the planner's)")
  parser.add_argument("--render", action="store_true", help="only render --output")
  args = parser.parse_args(argv)
  if not args.render:
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    for config, _, slices in RUNS:
      for topology in slices:
        plan(config, topology, args.output, args.max_ladder)
  text = table(args.output)
  print(text)
  if args.readme:
    quickstart_seeds.rewrite_readme(args.readme, text, MARKER)
  return 0


if __name__ == "__main__":
  sys.exit(main())
