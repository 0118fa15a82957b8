"""Decoding held-out prompts in batches over a mesh: the one path of every evaluation.

The trainer's periodic evaluation, ``python -m stabledrl_jax.evaluate`` and
``experiments/threshold_decoding.py`` all decode through ``generate_batches``: prompts in
batches of ``batch_size``, each padded to a multiple of the mesh's data-parallel size (copies of
its last row, dropped after), split over the mesh, decoded by the model family's sampler
(``models.family.generate``), with the batch's noise drawn from ``fold_in(key, batch)``. On a
mesh that spans several processes each process decodes, and gets back, only its own rows.

The sampler options of a decode are one record, ``run_spec.Decoding`` (its defaults written
once; ``steps=0`` means ``run_spec.default_steps``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import tqdm

from stabledrl_jax import models
from stabledrl_jax.models import family as family_lib
from stabledrl_jax.training.config import run_spec
from stabledrl_jax.training.inputs import data
from stabledrl_jax.training.parallel import mesh as mesh_lib, multihost


def generate(model: Any, prompt_tokens: jax.Array, prompt_mask: jax.Array, key: jax.Array,
             decoding: run_spec.Decoding) -> tuple[jax.Array, jax.Array]:
  """Completions of left-padded prompts [B, P] by the model's sampler: tokens [B, P + G] and the
  model calls each row needed [B]."""
  return family_lib.generate(model, prompt_tokens, prompt_mask, key, decoding)


def generate_rows(model: Any, prompt_tokens: np.ndarray, prompt_mask: np.ndarray,
                  key: jax.Array, decoding: run_spec.Decoding, *, mesh: jax.sharding.Mesh,
                  split: multihost.RowSplit, chunk_rows: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Decodes one batch of ``split.num_rows`` rows split over ``mesh``, given and returning this
  process's rows ``split.rows`` only: prompts [n, P] -> (tokens [n, P + G], model calls [n]).

  ``chunk_rows`` (0: all at once, one call with ``key``): decode in sampler calls of that many
  rows (a divisor of the batch and a multiple of the data x fsdp devices), so that the sampler's
  memory is a chunk's. Chunk c draws its noise from ``fold_in(key, c)`` and holds, on each
  device, the c-th run of chunk_rows / devices of that device's rows: the chunks are split as
  the batch is, and no row moves between devices.
  """
  if not chunk_rows or chunk_rows == split.num_rows:
    return _generate_rows(model, prompt_tokens, prompt_mask, key, decoding, mesh=mesh,
                          split=split)
  ways = mesh_lib.data_parallel_size(mesh)
  n = split.num_rows
  if chunk_rows < 0 or n % chunk_rows or chunk_rows % ways:
    raise ValueError(f"{chunk_rows} rows per sampler call must divide the batch of {n} rows "
                     f"and be a multiple of the {ways} data x fsdp devices")
  per_device, per_chunk = n // ways, chunk_rows // ways
  chunk_split = multihost.row_split(models.batch_sharding(mesh, ndim=1), chunk_rows)
  q = chunk_split.rows
  tokens = calls = None
  for c in range(n // chunk_rows):
    # Chunk row q is global row (device of q) * per_device + c * per_chunk + (q's offset).
    rows = (q // per_chunk) * per_device + c * per_chunk + q % per_chunk
    local = np.searchsorted(split.rows, rows)
    if not np.array_equal(split.rows[np.minimum(local, split.size - 1)], rows):
      raise ValueError(f"the rows of sampler chunk {c} are not on process "
                       f"{jax.process_index()}")
    out, out_calls = _generate_rows(model, prompt_tokens[local], prompt_mask[local],
                                    jax.random.fold_in(key, c), decoding, mesh=mesh,
                                    split=chunk_split)
    if tokens is None:
      tokens = np.empty((split.size,) + out.shape[1:], out.dtype)
      calls = np.empty((split.size,) + out_calls.shape[1:], out_calls.dtype)
    tokens[local], calls[local] = out, out_calls
  return tokens, calls


def _generate_rows(model: Any, prompt_tokens: np.ndarray, prompt_mask: np.ndarray,
                   key: jax.Array, decoding: run_spec.Decoding, *, mesh: jax.sharding.Mesh,
                   split: multihost.RowSplit) -> tuple[np.ndarray, np.ndarray]:
  """``generate_rows`` in one sampler call."""
  rows_sharding = models.batch_sharding(mesh, ndim=1)
  tokens, mask = multihost.to_global((prompt_tokens, prompt_mask), rows_sharding,
                                     split.num_rows)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # The model's constraints.
    out, calls = generate(model, tokens, mask, key, decoding)
  return multihost.local_rows(out, split), multihost.local_rows(calls, split)


@dataclasses.dataclass
class Decoded:
  """What ``generate_batches`` decoded on this process.

  Attributes:
    rows: indices into the prompts of the rows this process holds, in order [n].
    completions: their completion tokens [n, G] int32 (every token after a stop token is a
      stop token only as far as the sampler made it so).
    model_calls: the model calls each needed [n].
  """

  rows: np.ndarray
  completions: np.ndarray
  model_calls: np.ndarray


def generate_batches(model: Any, prompt_tokens: np.ndarray, prompt_mask: np.ndarray,
                     key: jax.Array, decoding: run_spec.Decoding, *, mesh: jax.sharding.Mesh,
                     batch_size: int, progress: tqdm.tqdm | None = None) -> Decoded:
  """Decodes every prompt [N, P] in batches of ``batch_size`` split over ``mesh``.

  ``mesh`` may span several processes (the trainer's): then every process passes the same
  prompts and decodes its own rows of each batch. A mesh of this process's devices decodes all.
  Batch b draws its noise from ``fold_in(key, b)``.
  """
  if batch_size < 1:
    raise ValueError(f"batch size must be >= 1, got {batch_size}")
  rows_sharding = models.batch_sharding(mesh, ndim=1)
  ways = mesh_lib.data_parallel_size(mesh)
  splits = {}  # By padded batch size: at most two sizes, one collective each.
  rows, completions, calls = [], [], []
  prompt_length = prompt_tokens.shape[1]
  for batch, start in enumerate(range(0, len(prompt_tokens), batch_size)):
    (tokens, mask), real = mesh_lib.pad_rows(
        [prompt_tokens[start:start + batch_size], prompt_mask[start:start + batch_size]], ways)
    if len(tokens) not in splits:
      splits[len(tokens)] = multihost.row_split(rows_sharding, len(tokens))
    split = splits[len(tokens)]
    out, out_calls = generate_rows(model, tokens[split.rows], mask[split.rows],
                                   jax.random.fold_in(key, batch), decoding, mesh=mesh,
                                   split=split)
    keep = split.rows < real
    rows.append(start + split.rows[keep])
    completions.append(out[keep, prompt_length:])
    calls.append(out_calls[keep])
    if progress is not None:
      progress.update(real)
  if not rows:
    return Decoded(np.zeros(0, int), np.zeros((0, decoding.gen_length), np.int32),
                   np.zeros(0, np.int32))
  return Decoded(np.concatenate(rows), np.concatenate(completions), np.concatenate(calls))


def score_batches(model: Any, tokenizer, task: Any, examples: Any, prompt_tokens: np.ndarray,
                  prompt_mask: np.ndarray, key: jax.Array, decoding: run_spec.Decoding, *,
                  mesh: jax.sharding.Mesh, batch_size: int,
                  reward_scheme: str) -> np.ndarray:
  """``generate_batches``, then each decoded row scored by its task: this process's totals
  [4] float64 of (metric's correct, metric's total, reward, model calls). The trainer sums them
  over the processes (``multihost.sum_over_rows``)."""
  decoded = generate_batches(model, prompt_tokens, prompt_mask, key, decoding, mesh=mesh,
                             batch_size=batch_size)
  texts = data.decode_completions(tokenizer, decoded.completions)
  totals = np.zeros(4)
  totals[3] = float(decoded.model_calls.sum())
  for text, row in zip(texts, decoded.rows):
    example = examples[int(row)]
    score = task.score(text, example)
    totals[:3] += (score.correct, score.total, task.reward(text, example, reward_scheme))
  return totals


def metrics_of(totals: np.ndarray, num_examples: int) -> dict[str, float]:
  """The evaluation metrics of summed ``score_batches`` totals: the task's metric in percent,
  the mean reward and the mean model calls per sequence."""
  correct, total, reward, calls = totals
  return {"eval/accuracy": 100.0 * correct / max(total, 1.0),
          "eval/reward_mean": reward / num_examples,
          "eval/model_calls": calls / num_examples}


def evaluate(model: Any, tokenizer, task: Any, prompts: data.PromptSet, key: jax.Array,
             decoding: run_spec.Decoding, *, mesh: jax.sharding.Mesh, batch_size: int,
             reward_scheme: str, split: multihost.RowSplit | None = None) -> dict[str, float]:
  """The held-out evaluation (the trainer's, and the experiments' on a restored model): the
  encoded ``prompts`` decoded by ``decoding`` (``score_batches``) and scored; the totals summed
  over the processes, where ``split`` says which process counts each row (one process: None).
  Returns ``metrics_of``'s: the task's metric in percent, the mean reward and model calls."""
  totals = score_batches(model, tokenizer, task, prompts.examples, prompts.tokens, prompts.mask,
                         key, decoding, mesh=mesh, batch_size=batch_size,
                         reward_scheme=reward_scheme)
  if split is not None:
    totals = multihost.sum_over_rows(totals, split)
  return metrics_of(totals, len(prompts.examples))
