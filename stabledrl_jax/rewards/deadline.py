"""A CPU-time deadline for work in the main thread (a SIGALRM timer that waits out a loaded
machine). ``math_equivalence`` bounds math-verify with it; off the main thread, where no signal
can be armed, ``symbolic_worker``'s helper processes run the same deadline on their own main
thread. docs/reliability.md lists the fault."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

# The wall-clock cap of a deadline, as a multiple of its CPU budget: on a loaded machine the work
# gets less CPU than wall time, and a correct answer should not lose its reward for that.
WALL_FACTOR = 5.0


class DeadlineExceeded(BaseException):
  """Raised by the timer signal; a BaseException so library `except Exception` cannot eat it."""


class NoSignals(RuntimeError):
  """This thread cannot run a signal deadline (not the main thread, or signals refused)."""


def signals_usable() -> bool:
  """Whether this thread can run a signal deadline (the main thread, on a POSIX system)."""
  return (hasattr(signal, "setitimer")
          and threading.current_thread() is threading.main_thread())


# Where an exception is dropped as "unraisable": finalizers, and the hooks that report them.
_UNRAISABLE_FRAMES = frozenset({"__del__", "unraisable_hook", "unraisablehook"})


def _in_finalizer(frame: Any, depth: int = 64) -> bool:
  """Whether ``frame`` runs inside a ``__del__`` or an unraisable-exception hook (within
  ``depth`` frames)."""
  while frame is not None and depth:
    if frame.f_code.co_name in _UNRAISABLE_FRAMES:
      return True
    frame, depth = frame.f_back, depth - 1
  return False


def call_with_deadline(function, seconds: float, *, wall_factor: float = WALL_FACTOR):
  """Runs function() in the main thread until it has used ``seconds`` of this thread's CPU time.

  A wall-clock timer (SIGALRM) wakes up when ``seconds`` have passed; if this thread has used
  less CPU time than that (a loaded machine), it sleeps again for the rest of the budget, up to
  ``wall_factor`` x ``seconds`` of wall time in all. Past the budget it raises
  DeadlineExceeded. Work in C code that never returns to the interpreter is not interrupted;
  `safe_for_symbolic` keeps such work out. A timer the caller had armed is restored after.

  Raises:
    NoSignals: not in the main thread, or signals refused (``math_equivalence.bounded_call``
    hands the work to a helper process then).
  """
  if not signals_usable():
    raise NoSignals("a signal deadline needs the main thread")
  start_cpu, start_wall = time.thread_time(), time.monotonic()
  wall_cap = seconds * wall_factor
  armed = [True]

  def on_alarm(signum, frame):
    del signum
    if not armed[0]:
      return
    used = time.thread_time() - start_cpu
    elapsed = time.monotonic() - start_wall
    if used >= seconds or elapsed >= wall_cap:
      # The timer fires again shortly until one reaches the work: raised inside a __del__ (a
      # finalizer the collector runs at any point) or a hook reporting one, the exception would
      # be dropped as "unraisable" (and fail a test run), so it is not raised there.
      signal.setitimer(signal.ITIMER_REAL, 0.01)
      if not _in_finalizer(frame):
        raise DeadlineExceeded()
      return
    signal.setitimer(signal.ITIMER_REAL, max(min(seconds - used, wall_cap - elapsed), 1e-3))

  try:
    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
  except ValueError as error:  # the main thread of a sub-interpreter
    raise NoSignals(str(error)) from None
  previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
  try:
    return function()
  finally:
    while armed[0]:  # An alarm between the work's end and the disarming is ignored.
      try:
        signal.setitimer(signal.ITIMER_REAL, 0)
        armed[0] = False
      except DeadlineExceeded:
        pass
    signal.signal(signal.SIGALRM,
                  signal.SIG_DFL if previous_handler is None else previous_handler)
    if previous_delay > 0:
      remaining = previous_delay - (time.monotonic() - start_wall)
      signal.setitimer(signal.ITIMER_REAL, max(remaining, 1e-3), previous_interval)
