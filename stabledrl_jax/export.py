r"""Export a trained model: a LoRA run's adapters in PEFT's format, any other as a Hugging Face
checkpoint.

    python -m stabledrl_jax.export --workdir runs/llada8b_gsm8k --output exports/gsm8k \
        [--step 400] [--merge] [--dtype bfloat16] [--max_shard_size 5GB]

(installed: ``stabledrl-export``). ``--workdir`` is a training workdir (the parameters of its
latest or ``--step`` checkpoint; its config.json gives the architecture) or any checkpoint
``python -m stabledrl_jax.evaluate`` reads (a Hugging Face directory, a PEFT adapter, a Hub id).

A model with LoRA adapters (``model.lora.rank`` > 0, or a PEFT adapter) gets, by default, a PEFT
adapter directory (``models.peft_io``): ``adapter_config.json`` (r, lora_alpha, target_modules,
lora_dropout, and ``base_model_name_or_path``: the run's ``model.checkpoint`` (an adapter's: its
base, or the run's ``model.lora.base``), or its supervised start ``<workdir>/sft_model``; a PEFT
adapter exported as one names ``--lora_base`` where given) and ``adapter_model.safetensors`` in
PEFT's tensor names for the official modeling code; ``peft``'s ``PeftModel.from_pretrained`` and our
loaders read it on that base. ``--merge`` writes the merged Hugging Face checkpoint instead (W +
(alpha / r) A B in each adapted kernel), as does every model without adapters:

* ``config.json`` (and ``generation_config.json`` for a chat model's stop tokens) in the keys of
  the family's official modeling code (``models/<family>/checkpoint.py``),
* the parameters as safetensors in the official tensor names and layouts, split into
  ``model-0000k-of-0000n.safetensors`` files with ``model.safetensors.index.json`` past
  ``--max_shard_size``, in ``--dtype`` (default: float32, lossless).

Either way ``--output`` also gets

* the tokenizer files of the run (tokenizer.json and the configs beside it); a character
  tokenizer has none, and the export says so,
* ``stabledrl_jax.json``: the run's training config (``checkpoint_source.EXPORT_FILE``), so that
  ``python -m stabledrl_jax.evaluate`` formats prompts, builds the tokenizer (a character
  tokenizer's alphabet) and draws synthetic test sets as it does for the workdir: the export and
  the workdir give the same results. A plain Hugging Face source has no such config, and gets none.

The files get the mode of any newly created file (0666 less the umask; ``hf_io.save_pretrained``).
``--output`` must be new or empty; ``--overwrite`` replaces a non-empty one. The export is
written into a directory beside ``--output`` and renamed into place when complete
(``workdir_files.staged_dir``): a failed export leaves ``--output`` as it was.

The official PyTorch code (``trust_remote_code``) and inference servers load the result, and
``models.from_pretrained`` reads it back bit for bit. One process: every tensor passes through
host memory (an 8B model in float32 needs about 32 GB of it).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
from typing import Sequence

from stabledrl_jax import path_args, workdir_files

DTYPES = ("float32", "bfloat16", "float16")
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMG]?)B?", re.IGNORECASE)


def parse_size(text: str) -> int:
  """'5GB', '500MB', '1024' -> bytes (powers of 1000, as transformers' max_shard_size)."""
  match = _SIZE.fullmatch(text.strip())
  if not match:
    raise ValueError(f"--max_shard_size {text!r} is not a size such as 5GB or 500MB")
  scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}[match.group(2).upper()]
  return int(float(match.group(1)) * scale)


def tokenizer_dir(source) -> str | None:
  """The directory whose tokenizer files go with ``source`` (None: a character tokenizer)."""
  from stabledrl_jax import hub  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.state import checkpoint_source  # pylint: disable=g-import-not-at-top
  if source.kind in (checkpoint_source.HUGGING_FACE, checkpoint_source.PEFT) and os.path.isfile(
      os.path.join(source.path, "tokenizer.json")):
    return source.path
  if source.config is None or source.config.tokenizer.kind == "char":
    return None
  path = hub.local_path(source.config.tokenizer.path, files=hub.TOKENIZER_FILES)
  return path if os.path.isdir(path) else os.path.dirname(path)


def check_output(output: str, *, overwrite: bool = False) -> None:
  """ValueError naming ``--output`` unless it is, or can be created as, a writable directory
  that is empty (or may be replaced: ``overwrite``); nothing is created here. An empty or
  non-UTF-8 name is refused (``path_args.check``)."""
  path_args.check(output, "--output")
  path = pathlib.Path(os.path.abspath(output))
  if path.is_symlink():
    raise ValueError(f"--output {output!r} is a symbolic link (to {os.readlink(path)}): name "
                     "the directory itself")
  if path.exists() and not path.is_dir():
    raise ValueError(f"--output {output!r} is an existing file, not a directory")
  if path.is_dir() and any(path.iterdir()) and not overwrite:
    raise ValueError(f"--output {output!r} is a directory that is not empty "
                     f"({len(list(path.iterdir()))} entries): choose a new one, or pass "
                     "--overwrite to replace it")
  ancestor = next(p for p in (path, *path.parents) if p.exists())
  if not ancestor.is_dir():
    raise ValueError(f"--output {output!r} cannot be created: {ancestor} is a file")
  if not os.access(ancestor, os.W_OK | os.X_OK):
    raise ValueError(f"--output {output!r} is not writable: no write permission on {ancestor}")


def export(workdir: str, output: str, *, step: int | None = None, dtype: str = "float32",
           max_shard_bytes: int = 5 * 10**9, overwrite: bool = False, merge: bool = False,
           lora_base: str = "") -> list[str]:
  """Writes the PEFT adapter (a model with adapters, unless ``merge``) or the Hugging Face
  checkpoint of ``workdir`` (or ``step``) to ``output``.

  ``output`` must not exist or be empty, unless ``overwrite``. Everything is written into a
  directory staged beside it and renamed into place at the end (an existing ``output`` is then
  swapped out and removed, ``workdir_files.staged_dir``): a failed or killed export leaves
  ``output`` as it was.

  Returns:
    the tokenizer files copied (empty for a character tokenizer).

  Raises:
    ValueError / FileNotFoundError naming the bad argument.
  """
  if dtype not in DTYPES:
    raise ValueError(f"--dtype {dtype!r} is not one of {DTYPES}")
  if max_shard_bytes <= 0:
    raise ValueError("--max_shard_size must be positive")
  check_output(output, overwrite=overwrite)
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top

  from stabledrl_jax import hub, models  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.models import lora, peft_io  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.state import checkpoint_source  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.parallel import (  # pylint: disable=g-import-not-at-top
      mesh as mesh_lib)

  source = checkpoint_source.resolve(workdir, step, lora_base=lora_base)
  if os.path.abspath(output) == os.path.abspath(source.path):
    raise ValueError(f"--output {output!r} is the checkpoint being exported")
  mesh = mesh_lib.make_mesh(ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1)),
                            devices=jax.local_devices())
  as_adapter = not merge and checkpoint_source.model_has_adapters(source)
  base = checkpoint_source.adapter_base(source) if as_adapter else None
  if as_adapter and base is None:
    raise ValueError(f"{source.path} trained LoRA adapters on a freshly initialized model, which "
                     "no PEFT adapter can name as its base: pass --merge for the merged model")
  model = checkpoint_source.load_model(source, mesh=mesh, dtype=jnp.dtype(dtype))
  if not as_adapter and lora.has_adapters(model):  # --merge: W + (alpha / r) A B.
    lora.merge_adapters(model)
  dropout = float(source.config.model.lora.get("dropout", 0.0)) if source.config else 0.0
  copied = []
  directory = tokenizer_dir(source)
  record = checkpoint_source.export_record(source)
  try:
    with workdir_files.staged_dir(output, overwrite=overwrite) as staging:
      if as_adapter:
        peft_io.save_adapter(model, os.fspath(staging), base=base, dropout=dropout,
                             dtype=jnp.dtype(dtype))
      else:
        models.save_pretrained(model, os.fspath(staging), max_shard_bytes=max_shard_bytes)
      if directory is not None:
        for name in hub.TOKENIZER_FILES:
          # An input: a FIFO or a device there is one line naming it (a ValueError, not the
          # output's WorkdirError), never opened.
          content = workdir_files.read_bytes(os.path.join(directory, name), "tokenizer file",
                                             error=ValueError, missing_ok=True)
          if content is not None:
            workdir_files.write_bytes(os.path.join(staging, name), content)
            copied.append(name)
      if record is not None:
        workdir_files.write_text(os.path.join(staging, checkpoint_source.EXPORT_FILE),
                                 json.dumps(record, indent=2, sort_keys=True))
  except workdir_files.WorkdirError as error:
    raise ValueError(f"--output: {error}") from None
  return copied


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m stabledrl_jax.export",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True,
                      help="a training workdir, a Hugging Face checkpoint directory or a Hub id")
  parser.add_argument("--output", required=True, help="the Hugging Face checkpoint directory")
  parser.add_argument("--step", type=int, default=None,
                      help="a checkpoint step of the workdir (default: the latest)")
  parser.add_argument("--dtype", default="float32", choices=DTYPES,
                      help="dtype of the stored tensors (default float32: lossless)")
  parser.add_argument("--max_shard_size", default="5GB",
                      help="split the tensors into files of at most this size (default 5GB)")
  parser.add_argument("--merge", action="store_true",
                      help="a LoRA model: write the merged Hugging Face checkpoint instead of its "
                      "PEFT adapter")
  parser.add_argument("--lora_base", default="",
                      help="a PEFT adapter's base model (a Hub id or directory) in place of the "
                      "one its adapter_config.json names; the export names it")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace a non-empty --output (written aside, then swapped in)")
  args = parser.parse_args(argv)
  try:
    copied = export(args.workdir, args.output, step=args.step, dtype=args.dtype,
                    max_shard_bytes=parse_size(args.max_shard_size), overwrite=args.overwrite,
                    merge=args.merge, lora_base=args.lora_base)
  except (ValueError, FileNotFoundError, NotImplementedError) as error:
    parser.error(str(error))
  print(f"wrote {args.output}"
        + (f" with {', '.join(copied)}" if copied else
           " (a character tokenizer: no tokenizer files)"))
  return 0


def run() -> None:
  """The console script ``stabledrl-export``."""
  sys.exit(main())


if __name__ == "__main__":
  run()
