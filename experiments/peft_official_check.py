r"""An adapter we export, read by ``peft`` into the official LLaDA modeling code: the same logits.

    python experiments/peft_official_check.py --adapter DIR --peers_dir third_party

``--adapter`` is a PEFT adapter directory (``python -m stabledrl_jax.export`` of a LoRA run)
whose ``adapter_config.json`` names a LLaDA base directory. The official ``LLaDAModelLM``
(StableDRL's ``networks/modeling_llada.py``, read at run time from ``--peers_dir`` in the layout
of ``experiments/gpu_check_peers.py``, never committed) is built from the base's config.json
and weights; ``peft.PeftModel.from_pretrained`` puts the adapter on it. Both it and our loader
(``models.peft_io.from_pretrained``) compute the logits of random tokens in float32; the table
gives the largest difference relative to the largest logit, with the adapter and without (the
base alone, as a check of the two forward passes). CPU only; torch and peft: the ``peft`` extra.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check_peers  # pylint: disable=g-import-not-at-top,wrong-import-position


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--adapter", required=True)
  parser.add_argument("--peers_dir", required=True)
  parser.add_argument("--rows", type=int, default=2)
  parser.add_argument("--length", type=int, default=24)
  args = parser.parse_args(argv)
  import peft  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top

  from stabledrl_jax import models  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.models import peft_io  # pylint: disable=g-import-not-at-top

  missing = gpu_check_peers.missing_files("official", args.peers_dir)
  if missing:
    parser.error(f"--peers_dir {args.peers_dir} has no {', '.join(missing)}")
  base = peft_io.read_config(args.adapter)["base_model_name_or_path"]
  modeling, configuration, _ = gpu_check_peers.load_peer("official", args.peers_dir)
  official = gpu_check_peers.load_model(modeling, configuration, base, torch.device("cpu"))
  ours_base = models.from_pretrained(base)
  ours = peft_io.from_pretrained(args.adapter)
  tokens = np.random.default_rng(0).integers(0, ours.config.vocab_size - 2,
                                             (args.rows, args.length))

  def theirs(model) -> np.ndarray:
    with torch.no_grad():
      return model(torch.from_numpy(tokens)).logits.float().numpy()

  without = theirs(official)
  adapted = peft.PeftModel.from_pretrained(official, args.adapter).eval()
  with_adapter = theirs(adapted)
  rows = [("base alone", np.asarray(ours_base(tokens)), without),
          ("with the adapter", np.asarray(ours(tokens)), with_adapter)]
  print("| model | max abs difference / max abs logit | max abs logit change by the adapter |")
  print("|---|---:|---:|")
  for name, mine, official_logits in rows:
    error = np.abs(mine - official_logits).max() / np.abs(official_logits).max()
    change = np.abs(with_adapter - without).max()
    print(f"| {name} | {error:.2e} | {change:.3f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
