"""Rewards of a batch of completions, scored in parallel on the host.

A rollout batch holds hundreds of answers, and math-verify can take 0.2 s on one; scored one
after another they would stall every step. ``RewardScorer(workers=W)`` keeps W worker
processes (spawned, so that no JAX state is forked) and hands them one answer each at a time.
Each answer is bounded: one that is not scored ``timeout_s`` after the answer before it (a
parser stuck on pathological input) gets 0 for every term, and the pool is replaced once the
batch is done, so that the stuck worker goes with it. ``workers=0`` scores in this process
(tests, the CPU quickstart), with the rewards' own deadlines only.

The pool starts with the scorer, and each worker imports math-verify and warms it up first
(about 1.3 s of CPU), while the trainer compiles its first step: no answer's time bound pays it.
"""

from __future__ import annotations

import multiprocessing
from typing import Any, Sequence

import numpy as np
from absl import logging

from stabledrl_jax import tasks
from stabledrl_jax.rewards import math_equivalence


def _start_worker() -> None:
  """A worker's start: math-verify imported and warmed up before the first answer."""
  math_equivalence.warm_up()


def score_one(task_name: str, scheme: str, text: str, example: Any) -> list[float]:
  """The unweighted value of each reward term of ``scheme`` for one completion."""
  task = tasks.get_task(task_name)
  values = task.reward_components(text, example, scheme)
  return [float(values[term.name]) for term in task.reward_terms(scheme)]


class RewardScorer:
  """``scorer(texts, examples) -> [N, terms]`` float32 values of the reward terms.

  Args:
    task: the task whose reward terms score the completions.
    scheme: its reward scheme (``tasks.REWARD_SCHEMES``).
    workers: worker processes (0: score in this process).
    timeout_s: the bound on each answer in a worker (see the module docstring).
  """

  def __init__(self, task: tasks.Task, scheme: str, *, workers: int = 0,
               timeout_s: float = 10.0):
    self.task, self.scheme = task, scheme
    self.terms = task.reward_terms(scheme)
    self.weights = np.array([term.weight for term in self.terms], np.float32)
    self.workers, self.timeout_s = workers, timeout_s
    self._pool = None
    self.timeouts = 0  # answers that ran out of time, over the scorer's life
    if workers:
      self._get_pool()  # Started now: the workers warm up while the trainer compiles.

  def _get_pool(self):
    if self._pool is None:
      self._pool = multiprocessing.get_context("spawn").Pool(self.workers,
                                                             initializer=_start_worker)
    return self._pool

  def __call__(self, texts: Sequence[str], examples: Sequence[Any]) -> np.ndarray:
    if len(texts) != len(examples):
      raise ValueError(f"{len(texts)} completions but {len(examples)} examples")
    if not self.workers:
      rows = [score_one(self.task.name, self.scheme, t, e) for t, e in zip(texts, examples)]
      return np.array(rows, np.float32).reshape(len(texts), len(self.terms))
    pool = self._get_pool()
    pending = [pool.apply_async(score_one, (self.task.name, self.scheme, t, e))
               for t, e in zip(texts, examples)]
    rows, stuck = [], 0
    for result in pending:
      try:
        rows.append(result.get(timeout=self.timeout_s))
      except multiprocessing.TimeoutError:
        rows.append([0.0] * len(self.terms))
        stuck += 1
    if stuck:
      self.timeouts += stuck
      logging.warning("%d of %d answers were not scored within task.reward_timeout_s=%s s; "
                      "they get reward 0", stuck, len(texts), self.timeout_s)
      self.close()  # The stuck workers go with the pool; a fresh one warms up for the next.
      self._get_pool()
    return np.array(rows, np.float32).reshape(len(texts), len(self.terms))

  def rewards(self, components: np.ndarray) -> np.ndarray:
    """The training reward of each row of ``components``: sum of weight x term [N]."""
    return components @ self.weights

  def close(self) -> None:
    if self._pool is not None:
      self._pool.terminate()
      self._pool.join()
      self._pool = None
