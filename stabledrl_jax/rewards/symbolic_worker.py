"""Helper processes that run math-verify for threads that cannot bound it themselves.

A CPU-time deadline needs a signal, and Python runs signal handlers in the main thread only
(`deadline.call_with_deadline`). A reward called from any other thread (a thread pool
scoring a batch, a server) therefore hands its symbolic work to one of these helpers: a
``python -m stabledrl_jax.rewards.symbolic_helper`` process that runs each request on its own
main thread under the same deadline, and answers one JSON line per request. A helper that has
not answered ``wait_s(budget_s)`` after a request (sympy stuck in C code, which no signal
interrupts) is killed, the request gets None (no symbolic verdict: reward 0 unless the
normalized answers match), and the next request starts a fresh helper. The calling thread only
waits on a pipe, so it spends almost no CPU time; the helper's CPU time per request is bounded
by its deadline and, past that, by the kill. docs/reliability.md lists the fault.

Protocol (one line each way, UTF-8 JSON): the helper writes {"ready": true} once math-verify is
imported and warmed up, then for each request {"kind", "args", "budget_s"} it writes
{"result": true | false | null, "cpu_s": <its thread CPU seconds on the request>}.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import select
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

from absl import logging

from stabledrl_jax.rewards import deadline

# The helpers' program (this module imports nothing of the work it runs: no import cycle).
HELPER_MODULE = "stabledrl_jax.rewards.symbolic_helper"
# The helper's deadline caps a request at its CPU budget x deadline.WALL_FACTOR of wall
# time; the parent waits GRACE_S longer before it kills.
GRACE_S = 2.0
# Importing math-verify and sympy and warming them up takes 1-2 s of CPU; on a loaded machine
# much longer. A helper not ready by then is killed and the request gets None.
STARTUP_TIMEOUT_S = 120.0
# Helpers at once: concurrent callers beyond it wait for a free one (waiting costs no CPU).
MAX_WORKERS = max(1, min(4, os.cpu_count() or 1))
# After this many helpers in a row fail to start, symbolic checks off the main thread are off.
MAX_START_FAILURES = 3


class WorkerError(RuntimeError):
  """A helper died, sent garbage or did not answer in time (it has been killed)."""


def _read_line(fd: int, buffer: bytearray, timeout_s: float) -> bytes:
  """The next line from ``fd`` (without its newline) within ``timeout_s`` seconds of wall time.

  Raises:
    WorkerError: end of file, or no complete line in time.
  """
  end = time.monotonic() + timeout_s
  while b"\n" not in buffer:
    remaining = end - time.monotonic()
    if remaining <= 0:
      raise WorkerError(f"no answer within {timeout_s:.1f} s")
    readable, _, _ = select.select([fd], [], [], remaining)
    if not readable:
      continue
    chunk = os.read(fd, 65536)
    if not chunk:
      raise WorkerError("the helper process exited")
    buffer.extend(chunk)
  line, _, rest = bytes(buffer).partition(b"\n")
  buffer[:] = rest
  return line


class _Worker:
  """One helper process and its pipes."""

  def __init__(self):
    package_root = str(pathlib.Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    # The helper must import this very package, also from a source checkout that is not installed.
    env["PYTHONPATH"] = os.pathsep.join(
        [package_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    self.process = subprocess.Popen(
        [sys.executable, "-m", HELPER_MODULE],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
    self._buffer = bytearray()
    try:
      ready = json.loads(_read_line(self.process.stdout.fileno(), self._buffer,
                                    STARTUP_TIMEOUT_S))
      if ready != {"ready": True}:
        raise WorkerError(f"unexpected greeting {ready!r}")
    except (WorkerError, ValueError) as error:
      self.kill()
      raise WorkerError(f"the math-verify helper did not start: {error}") from None

  def request(self, kind: str, args: Sequence[Any], budget_s: float) -> tuple[Any, float]:
    """(result, the helper's CPU seconds) of one request; WorkerError (helper killed) if none."""
    line = json.dumps({"kind": kind, "args": list(args), "budget_s": budget_s}) + "\n"
    try:
      self.process.stdin.write(line.encode("utf-8"))
      self.process.stdin.flush()
      answer = json.loads(_read_line(self.process.stdout.fileno(), self._buffer,
                                     wait_s(budget_s)))
      return answer["result"], float(answer["cpu_s"])
    except (OSError, ValueError, KeyError, TypeError, WorkerError) as error:
      self.kill()
      raise WorkerError(str(error)) from None

  def alive(self) -> bool:
    return self.process.poll() is None

  def kill(self) -> None:
    if self.process.poll() is None:
      self.process.kill()
    self.process.wait()
    for pipe in (self.process.stdin, self.process.stdout):
      try:
        pipe.close()
      except OSError:
        pass


def wait_s(budget_s: float) -> float:
  """How long the parent waits for an answer to a request with CPU budget ``budget_s``."""
  return budget_s * deadline.WALL_FACTOR + GRACE_S


class WorkerPool:
  """Up to MAX_WORKERS helpers, started on demand, each serving one request at a time.

  ``stats`` counts requests, answers of None (the helper's deadline or an error), kills, and
  the largest CPU time a helper spent on one request.
  """

  def __init__(self):
    self._condition = threading.Condition()
    self._idle: list[_Worker] = []
    self._count = 0
    self._pid = os.getpid()
    self._start_failures = 0
    self.stats = {"requests": 0, "none": 0, "kills": 0, "max_cpu_s": 0.0}

  def _check_fork(self) -> None:
    # A forked child shares its parent's pipes: it starts over with helpers of its own.
    if os.getpid() != self._pid:
      self._idle, self._count, self._pid = [], 0, os.getpid()

  def _acquire(self) -> _Worker | None:
    with self._condition:
      self._check_fork()
      while True:
        if self._start_failures >= MAX_START_FAILURES:
          return None
        while self._idle:
          worker = self._idle.pop()
          if worker.alive():
            return worker
          worker.kill()
          self._count -= 1
        if self._count < MAX_WORKERS:
          self._count += 1
          break
        self._condition.wait()
    try:
      worker = _Worker()
    except (OSError, WorkerError) as error:
      with self._condition:
        self._count -= 1
        self._start_failures += 1
        failures = self._start_failures
        self._condition.notify()
      logging.warning("%s (%d of %d tries); symbolic checks off the main thread get no verdict",
                      error, failures, MAX_START_FAILURES)
      return None
    with self._condition:
      self._start_failures = 0
    return worker

  def _release(self, worker: _Worker | None) -> None:
    with self._condition:
      if worker is None:
        self._count -= 1
      elif os.getpid() == self._pid:
        self._idle.append(worker)
      self._condition.notify()

  def call(self, kind: str, args: Sequence[Any], budget_s: float) -> Any:
    """The helper's result for one request, or None (deadline, error, or a killed helper)."""
    worker = self._acquire()
    if worker is None:
      return None
    try:
      result, cpu_s = worker.request(kind, args, budget_s)
    except WorkerError as error:
      with self._condition:
        self.stats["requests"] += 1
        self.stats["none"] += 1
        self.stats["kills"] += 1
      logging.warning("math-verify helper killed (%s); the answer gets no symbolic verdict",
                      error)
      self._release(None)
      return None
    with self._condition:
      self.stats["requests"] += 1
      self.stats["none"] += result is None
      self.stats["max_cpu_s"] = max(self.stats["max_cpu_s"], cpu_s)
    self._release(worker)
    return result

  def close(self) -> None:
    """Stops every idle helper (busy ones are stopped by their caller's kill or at exit)."""
    with self._condition:
      self._check_fork()
      idle, self._idle = self._idle, []
      self._count -= len(idle)
    for worker in idle:
      worker.kill()


POOL = WorkerPool()
atexit.register(POOL.close)
