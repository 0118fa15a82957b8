"""Hugging Face Hub ids wherever a checkpoint or tokenizer path is taken.

``local_path("GSAI-ML/LLaDA-8B-Instruct")`` is the local snapshot of that repository, fetched
with ``huggingface_hub.snapshot_download``: cached in the Hub cache (``HF_HUB_CACHE`` /
``HF_HOME``), read from the cache alone when ``HF_HUB_OFFLINE=1``, only the files the project
reads (safetensors, config and tokenizer files; not the repository's PyTorch code). A local
path (a directory or file that exists, or anything that is not ``owner/name``) is returned as
it is, so every caller takes either.

Several processes (docs/pods.md) choose with ``download``:

* ``"each_host"``: every process fetches into its host's cache (hosts with their own disks;
  processes sharing a cache are safe, huggingface_hub locks each file);
* ``"process_0"``: process 0 fetches while the others wait, then they read the same cache
  (``HF_HUB_CACHE`` on storage all hosts share).
"""

from __future__ import annotations

import os
import re
from typing import Sequence

# What a tokenizer and a model checkpoint need from a repository (not its PyTorch code).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "vocab.json", "merges.txt")
MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors",
               "model.safetensors.index.json", "adapter_config.json",  # A PEFT adapter's too.
               "stabledrl_jax.json") + TOKENIZER_FILES
DOWNLOAD_MODES = ("each_host", "process_0")

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_hub_id(path: str) -> bool:
  """``owner/name`` that is not an existing local path (nor a URL or an absolute path)."""
  path = str(path)
  return bool(_REPO_ID.fullmatch(path)) and not os.path.exists(path)


def local_path(path: str, *, files: Sequence[str] = MODEL_FILES, download: str = "each_host",
               revision: str | None = None) -> str:
  """``path`` itself, or the local snapshot directory of the Hub repository it names.

  Args:
    path: a local path, or a Hub repository id (``owner/name``).
    files: the file patterns to fetch (``MODEL_FILES``, ``TOKENIZER_FILES``).
    download: ``"each_host"`` or ``"process_0"`` (the module docstring).
    revision: a branch, tag or commit (None: the default branch).

  Raises:
    FileNotFoundError: the repository is not in the cache and cannot be fetched (offline, or no
      network), with what to do.
  """
  if not is_hub_id(path):
    return path
  if download not in DOWNLOAD_MODES:
    raise ValueError(f"download={download!r} is not one of {DOWNLOAD_MODES}")
  import huggingface_hub  # pylint: disable=g-import-not-at-top
  from huggingface_hub import errors  # pylint: disable=g-import-not-at-top

  def fetch(local_files_only: bool) -> str:
    try:
      return huggingface_hub.snapshot_download(
          repo_id=path, revision=revision, allow_patterns=list(files),
          local_files_only=local_files_only)
    except (errors.LocalEntryNotFoundError, errors.RepositoryNotFoundError,
            errors.RevisionNotFoundError, OSError) as error:
      offline = local_files_only or os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")
      raise FileNotFoundError(
          f"{path!r} is not a local path, and as a Hugging Face Hub id it could not be "
          + ("found in the Hub cache (HF_HUB_OFFLINE is set, or another process was to fetch "
             "it)" if offline else "fetched")
          + f": {type(error).__name__}. Pass a local directory, or fetch it first with "
          f"`huggingface-cli download {path}`.") from None

  import jax  # pylint: disable=g-import-not-at-top
  if download == "each_host" or jax.process_count() == 1:
    return fetch(local_files_only=False)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  local = fetch(local_files_only=False) if jax.process_index() == 0 else None
  multihost_utils.sync_global_devices(f"hub download {path}")
  return local or fetch(local_files_only=True)
