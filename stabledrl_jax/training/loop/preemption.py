"""Signals during a run: SIGTERM and Ctrl-C stop it at a step boundary, agreed by every process;
a second Ctrl-C, or a SIGTERM whose grace period ran out, stops it at once (docs/reliability.md).

Python runs a signal's handler only when the main thread returns to the interpreter, which it
does not while it waits inside a long jitted call (a rollout, an XLA compile). So a command-line
run (``hard_stop``) also has a watchdog thread woken by the signal itself
(``signal.set_wakeup_fd``): it answers a second Ctrl-C, and a SIGTERM after
``train.stop_grace_s`` seconds, within a moment wherever the main thread is: it releases the
workdir's LOCK, says what was kept (the last checkpoint) and ends the process.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable

import jax
from jax.experimental import multihost_utils

from stabledrl_jax.training.parallel import multihost


# Set once any watcher of this process has taken a Ctrl-C: a later one, answered by a command
# line's ``CommandLineInterrupts``, is the second.
_INTERRUPTED = threading.Event()
# The last command-line (``hard_stop``) watcher: after it is closed, ``CommandLineInterrupts``
# stops as it would (its LOCK released, what was kept said).
_LAST_WATCHER = []


class CommandLineInterrupts:
  """Ctrl-C in a command-line process outside a trainer's ``PreemptionWatcher`` (which takes
  over SIGINT while it is installed, and gives it back when it is uninstalled or closed):
  validation, the gaps of the build, an evaluation, and the teardown after a run has stopped.

  With ``raise_first`` the first Ctrl-C raises KeyboardInterrupt in the main thread, as Python
  does (the command says what it kept and exits 130). Any other is answered by a watchdog
  thread woken by the signal itself (``signal.set_wakeup_fd``: it answers even while the main
  thread waits inside a long jitted call, an orbax save or the interpreter's exit): one line,
  and the process ends at once with status 130. Never a KeyboardInterrupt traceback from an
  atexit callback or a library's thread, and never exit status 0 after a Ctrl-C. Install it
  from the main thread; the process keeps it until it exits.
  """

  def __init__(self, *, raise_first: bool = False):
    self._raise_first = raise_first
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.signal(signal.SIGINT, self._on_interrupt)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(target=self._watch, args=(read,), name="stabledrl-interrupt-watchdog",
                     daemon=True).start()

  def exit_at_first(self) -> None:
    """From now on (the command's work is done) any Ctrl-C ends the process at once."""
    self._raise_first = False

  def _on_interrupt(self, *_):
    if self._raise_first:  # The watchdog answers a second one, if this one is not taken.
      raise KeyboardInterrupt

  def _watch(self, read: int) -> None:
    """Reads the signal numbers the C-level handler writes to the pipe."""
    count = 0
    while True:
      try:
        data = os.read(read, 64)
      except OSError:
        return
      if not data:
        return
      for signum in data:
        if signum != signal.SIGINT:
          continue
        count += 1
        if self._raise_first and count == 1:
          continue  # The main thread's KeyboardInterrupt.
        again = " again" if count > 1 or _INTERRUPTED.is_set() else ""
        if _LAST_WATCHER:  # A trainer's: its LOCK released, and what it kept said.
          stop = _LAST_WATCHER[-1]._stop_now  # pylint: disable=protected-access
          stop(f"Interrupted{again}: stopping now", 128 + signal.SIGINT)
        print(f"\nInterrupted{again}: stopping now.", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + signal.SIGINT)  # pylint: disable=protected-access


class PreemptionWatcher:
  """Whether a SIGTERM or SIGINT asks the run to stop, agreed by every process at one step
  boundary (of the supervised start or of RL).

  SIGTERM (preemption, ``kill``): with several processes ``jax.distributed``'s preemption sync
  point (its own SIGTERM handler, and on TPUs the maintenance notices), so that all stop at the
  same boundary; one process: a handler that sets a flag. SIGINT (Ctrl-C): a handler that sets
  a flag (process 0's decides for all). A second SIGINT stops at once: ``on_abort`` (the
  trainer releases its LOCK), then KeyboardInterrupt, or with ``hard_stop`` (the command line)
  the watchdog ends the process with exit status 130. With ``hard_stop`` and one process, a
  SIGTERM not answered within ``grace_s`` seconds (0: no limit) ends it with status 143. The
  handlers are installed from the main thread only, by ``install``, and restored by
  ``uninstall``; the flags stay set across.

  Args:
    on_abort: called before an immediate stop (the trainer releases its LOCK).
    grace_s: how long a SIGTERM waits for the step boundary and its save (``hard_stop`` only).
    hard_stop: end the process from the watchdog (a command-line run; never in a notebook).
    kept: what an immediate stop keeps, in words (the last checkpoint).
  """

  def __init__(self, on_abort: Callable[[], None] | None = None, *, grace_s: float = 0.0,
               hard_stop: bool = False, kept: Callable[[], str] | None = None):
    self._flag = threading.Event()
    self._interrupted = threading.Event()
    self._finished = threading.Event()  # Set by ``close``: a pending grace period is moot.
    self._previous = {}
    self._on_abort = on_abort
    self._grace_s = grace_s
    self._kept = kept
    self._pipe = None
    self._wakeup = None
    if hard_stop and threading.current_thread() is threading.main_thread():
      _LAST_WATCHER[:] = [self]
      self._pipe = os.pipe()
      os.set_blocking(self._pipe[1], False)
      threading.Thread(target=self._watch, name="stabledrl-signal-watchdog",
                       daemon=True).start()
    self.install()

  def install(self) -> None:
    if self._previous or threading.current_thread() is not threading.main_thread():
      return
    if jax.process_count() == 1:
      self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_term)
    self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_interrupt)
    if self._pipe is not None:
      self._wakeup = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)

  def _on_term(self, *_):
    self._flag.set()

  def _on_interrupt(self, *_):
    if self._pipe is not None:  # The watchdog counts and answers (it sees the signal first).
      self._interrupted.set()
      return
    if self._interrupted.is_set():  # The second Ctrl-C: stop now.
      print("\nInterrupted again: stopping now, without saving.", file=sys.stderr, flush=True)
      if self._on_abort is not None:
        self._on_abort()
      raise KeyboardInterrupt
    _INTERRUPTED.set()
    self._interrupted.set()
    print("\nInterrupted: saving at the end of this step (Ctrl-C again to stop now).",
          file=sys.stderr, flush=True)

  def _watch(self) -> None:
    """The watchdog: reads the signal numbers the C-level handler writes to the pipe."""
    interrupts, read = 0, self._pipe[0]
    while True:
      try:
        data = os.read(read, 64)
      except OSError:
        data = b""
      if not data or 0 in data:  # ``close``'s sentinel, or its end closed.
        os.close(read)
        return
      for signum in data:
        if signum == signal.SIGINT:
          interrupts += 1
          _INTERRUPTED.set()
          if interrupts == 1:
            self._interrupted.set()
            print("\nInterrupted: saving at the end of this step (Ctrl-C again to stop now).",
                  file=sys.stderr, flush=True)
          else:
            self._stop_now("Interrupted again: stopping now, without saving", 128 + signum)
        elif signum == signal.SIGTERM and jax.process_count() == 1:
          self._flag.set()
          if self._grace_s > 0:
            print(f"\nSIGTERM: saving at the end of this step, or stopping in "
                  f"{self._grace_s:g} s (train.stop_grace_s).", file=sys.stderr, flush=True)
            threading.Thread(target=self._grace, args=(128 + signum,), daemon=True).start()

  def _grace(self, status: int) -> None:
    if not self._finished.wait(self._grace_s):
      self._stop_now(f"SIGTERM: the run did not reach a step boundary and save within "
                     f"train.stop_grace_s={self._grace_s:g} s; stopping now", status)

  def _stop_now(self, why: str, status: int) -> None:
    """Releases the workdir, says what was kept, and ends the process (no teardown: the
    interpreter would free XLA's client under a computation still running on its threads)."""
    kept = ""
    if self._kept is not None:
      try:
        kept = f"; {self._kept()}"
      except Exception:  # pylint: disable=broad-except
        kept = ""
    print(f"\n{why}{kept}.", file=sys.stderr, flush=True)
    try:
      if self._on_abort is not None:
        self._on_abort()
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(status)  # pylint: disable=protected-access

  def reached(self, step: int) -> bool:
    """Whether to stop at the boundary after ``step`` (every process asks at the same ones).

    ``step`` is the number orbax saves that boundary's checkpoint under (the supervised step,
    then the RL step): orbax's ``CheckpointManager.save`` asks the same preemption sync point
    with it, so both must count alike, or one of them consumes the sync point unseen.
    """
    interrupted = multihost.agree(self._interrupted.is_set())
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step) or interrupted
    return self._flag.is_set() or interrupted

  def uninstall(self) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    if self._previous and self._pipe is not None:
      signal.set_wakeup_fd(self._wakeup if self._wakeup is not None else -1)
      self._wakeup = None
    self._previous = {}

  def close(self) -> None:
    """Restores the handlers and ends the watchdog (the run is over: no grace period runs)."""
    self.uninstall()
    self._finished.set()
    if self._pipe is not None:
      _, write = self._pipe
      self._pipe = None
      try:
        os.write(write, b"\0")  # The watchdog reads it, closes its end and ends.
      except OSError:
        pass
      os.close(write)
