"""A deterministic, resumable batch iterator over a sequence of examples.

Epoch e visits the examples in the order `permutation(seed, e)` (or in file order without
shuffling); batches run on across epoch boundaries, so every batch is full and the stream is
endless. The whole position is two integers, so a checkpoint stores `state()` as JSON and
`restore(state)` continues exactly where the run stopped.
"""

from __future__ import annotations

from typing import Generic, Sequence, TypeVar

import numpy as np

T = TypeVar("T")


class DataIterator(Generic[T]):
  """Endless iterator of batches (lists) of `batch_size` items.

  Args:
    data: any sequence with `len` and integer indexing (a list of `Example`s, a synthetic
      generator).
    batch_size: items per batch.
    seed: selects the per-epoch permutations.
    shuffle: visit each epoch in a fresh permutation (else in order).
  """

  def __init__(self, data: Sequence[T], batch_size: int, *, seed: int = 0, shuffle: bool = True):
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    if len(data) == 0:
      raise ValueError("Cannot iterate over an empty dataset.")
    self._data = data
    self._batch_size = batch_size
    self._seed = seed
    self._shuffle = shuffle
    self._epoch = 0
    self._position = 0  # index into the current epoch's order
    self._order_epoch = -1
    self._order: np.ndarray | None = None

  def _epoch_order(self) -> np.ndarray:
    if self._order_epoch != self._epoch:
      n = len(self._data)
      if self._shuffle:
        self._order = np.random.default_rng([self._seed, self._epoch]).permutation(n)
      else:
        self._order = np.arange(n)
      self._order_epoch = self._epoch
    return self._order

  def __iter__(self) -> "DataIterator[T]":
    return self

  def __next__(self) -> list[T]:
    batch = []
    while len(batch) < self._batch_size:
      order = self._epoch_order()
      take = min(self._batch_size - len(batch), len(order) - self._position)
      batch.extend(self._data[int(index)]
                   for index in order[self._position:self._position + take])
      self._position += take
      if self._position == len(order):
        self._epoch += 1
        self._position = 0
    return batch

  @property
  def epoch(self) -> int:
    """Completed passes over the data."""
    return self._epoch

  def state(self) -> dict[str, int]:
    """The position, plus the settings that must match on restore; JSON-serializable ints."""
    return {
        "epoch": self._epoch,
        "position": self._position,
        "seed": self._seed,
        "batch_size": self._batch_size,
        "num_examples": len(self._data),
        "shuffle": int(self._shuffle),
    }

  def restore(self, state: dict[str, int]) -> None:
    """Continues from a `state()`; the data and settings must be the ones it came from."""
    expected = {"seed": self._seed, "batch_size": self._batch_size,
                "num_examples": len(self._data), "shuffle": int(self._shuffle)}
    mismatched = {key: (int(state[key]), value) for key, value in expected.items()
                  if key in state and int(state[key]) != value}
    if mismatched:
      raise ValueError(f"Iterator state does not match this iterator (state, here): {mismatched}")
    position = int(state["position"])
    if not 0 <= position < len(self._data):
      raise ValueError(f"position {position} out of range for {len(self._data)} examples.")
    self._epoch = int(state["epoch"])
    self._position = position

  # Aliases for trainers that expect the get_state / set_state naming.
  get_state = state
  set_state = restore
