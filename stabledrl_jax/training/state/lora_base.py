"""A LoRA run's checkpoints hold its adapters, not its frozen base (docs/training.md, "LoRA").

The base is rebuilt where the run began: ``model.checkpoint`` (a PEFT adapter's base, if it is
one), else the supervised start ``<workdir>/sft_model``, else a fresh initialization of
``model.name`` from ``seed``; then ``model.lora.base_dtype`` stores it as at the start
(``build.with_lora``). Each checkpoint's meta records the base's identity, ``identity()``: where
it comes from and a fingerprint of it (SHA-256 of each safetensors file's size, header (tensor
names, shapes, dtypes, offsets) and first and last MiB of data; of the model config and seed
for a fresh one). A resume whose base has another identity is refused in one line: the adapters
were trained on another model.

A base inside the workdir (its supervised start) is recorded relative to it (``WORKDIR_MARK``
and the path below the workdir), so that a workdir moved or copied elsewhere resumes, exports
and evaluates; a Hub id, or an absolute path, only for a base outside it.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import ml_collections
from etils import epath

from stabledrl_jax import hub, workdir_files
from stabledrl_jax.models import lora as lora_lib, peft_io

META_KEY = "lora_base"
_SAMPLE = 1 << 20  # Bytes of data hashed at each end of a safetensors file.
# How an identity names a base inside the workdir: "<workdir>/sft_model".
WORKDIR_MARK = "<workdir>"


def source(config: ml_collections.ConfigDict, workdir: epath.PathLike) -> str:
  """Where the frozen base of ``config``'s run comes from: a checkpoint path or Hub id, the
  workdir's ``sft_model``, or 'init' (a fresh model of ``model.name`` from ``seed``)."""
  if config.model.checkpoint:
    return config.model.checkpoint
  if config.sft.num_steps:
    return os.fspath(epath.Path(workdir) / "sft_model")
  return "init"


def replaced_base(config: ml_collections.ConfigDict) -> str | None:
  """The base a run put in place of its PEFT adapter checkpoint's (``model.lora.base``; a
  workdir of an older version has no such field), else None."""
  return config.model.get("lora", {}).get("base") or None


def fingerprint_dir(path: str) -> str:
  """SHA-256 over the safetensors files of a checkpoint directory: each file's name, size,
  header and first and last MiB (a fingerprint, not a hash of every byte: it reads a few MiB of
  an 8B model)."""
  digest = hashlib.sha256()
  directory = epath.Path(path)  # Local or gs:// (a supervised start in a gs:// workdir).
  files = sorted((f for f in directory.iterdir() if f.name.endswith(".safetensors")),
                 key=lambda f: f.name)
  if not files:
    raise ValueError(f"{path} has no safetensors files to identify the LoRA base by")
  for file in files:
    with workdir_files.open_regular(file, "rb", what="LoRA base weights", error=ValueError) as f:
      f.seek(0, os.SEEK_END)
      size = f.tell()
      f.seek(0)
      digest.update(f"{file.name}:{size}".encode())
      header = f.read(8)
      length = int.from_bytes(header, "little") if len(header) == 8 else 0
      digest.update(header + f.read(min(length, size)))
      digest.update(f.read(_SAMPLE))
      f.seek(max(size - _SAMPLE, 0))
      digest.update(f.read(_SAMPLE))
  return digest.hexdigest()


def recorded_source(where: str, workdir: epath.PathLike) -> str:
  """``where`` as an identity records it: below ``WORKDIR_MARK`` if it lies inside the local
  ``workdir``, else as given."""
  if ("://" in str(where) or "://" in str(workdir) or where == "init"
      or not os.path.exists(where)):  # A Hub id is never a path below the workdir.
    return where
  base, root = os.path.realpath(where), os.path.realpath(os.fspath(workdir))
  if base == root or not base.startswith(root + os.sep):
    return where
  return f"{WORKDIR_MARK}/{os.path.relpath(base, root)}"


def identity(config: ml_collections.ConfigDict, workdir: epath.PathLike) -> dict[str, Any]:
  """{"source", "base_dtype", "fingerprint"} of the frozen base of ``config``'s LoRA run (the
  source relative to the workdir where it lies inside it: ``recorded_source``)."""
  where = source(config, workdir)
  if where == "init":
    model = {k: v for k, v in json.loads(config.model.to_json_best_effort()).items()
             if k != "lora"}
    text = json.dumps({"model": model,
                       "tokenizer": json.loads(config.tokenizer.to_json_best_effort()),
                       "seed": config.seed}, sort_keys=True)
    mark = hashlib.sha256(text.encode()).hexdigest()
  else:
    base = peft_io.unwrapped(where, replaced_base(config))  # A PEFT adapter: its base.
    mark = fingerprint_dir(hub.local_path(base))
  return {"source": recorded_source(where, workdir), "base_dtype": config.model.lora.base_dtype,
          "fingerprint": mark}


def _same_base(saved: dict[str, Any], current: dict[str, Any]) -> bool:
  """Whether two identities name one base: equal, or a workdir's own supervised start recorded
  by an older version as an absolute path (``.../sft_model``) and now relative, with the same
  fingerprint and storage."""
  if saved == current:
    return True
  old, new = str(saved.get("source", "")), str(current.get("source", ""))
  relative = new.startswith(WORKDIR_MARK + "/")
  return (relative and os.path.isabs(old) and old.endswith(new[len(WORKDIR_MARK):])
          and {k: v for k, v in saved.items() if k != "source"}
          == {k: v for k, v in current.items() if k != "source"})


def check(saved: dict[str, Any] | None, current: dict[str, Any], where: str) -> None:
  """ValueError in one line if checkpoint ``where``'s base (its meta's ``saved`` identity) is
  not the one this run rebuilt."""
  if saved is None or _same_base(saved, current):
    return
  raise ValueError(f"{where} holds LoRA adapters trained on the base {saved['source']!r} "
                   f"(stored as {saved['base_dtype']}, fingerprint {saved['fingerprint'][:12]}), "
                   f"but this run's base is {current['source']!r} (stored as "
                   f"{current['base_dtype']}, fingerprint {current['fingerprint'][:12]}): "
                   "restore that base, or start a new --workdir")


def saved_params(params: Any) -> Any:
  """What a LoRA run's checkpoint holds of its parameters: the adapters."""
  return lora_lib.split(params)[0]


def holds_adapters_only(stored_params: list[tuple[int, ...]], params: Any) -> bool:
  """Whether a checkpoint whose ``params`` arrays have ``stored_params`` shapes holds the
  adapters alone (this version) rather than adapters and base (before it)."""
  adapters = sorted(tuple(x.shape) for x in jax.tree.leaves(saved_params(params)))
  return sorted(stored_params) == adapters
