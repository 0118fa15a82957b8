"""The program of ``symbolic_worker``'s helper processes: ``python -m
stabledrl_jax.rewards.symbolic_helper`` warms up math-verify, then answers one JSON line per
request (the protocol is in ``symbolic_worker``'s docstring), each run under
``math_equivalence.run_bounded_here``'s deadline on this process's main thread."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from stabledrl_jax.rewards import math_equivalence


def main() -> None:
  """The helper's loop (see the module docstring for the protocol)."""
  # Stray prints (a library's) must not corrupt the protocol: it gets its own copy of stdout,
  # and fd 1 goes to stderr.
  protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
  os.dup2(2, 1)
  # Ctrl-C is the parent's to handle; the helper ends when its stdin closes.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  math_equivalence.warm_up()
  protocol.write(json.dumps({"ready": True}) + "\n")
  protocol.flush()
  for line in sys.stdin:
    start = time.thread_time()
    try:
      request = json.loads(line)
      result = math_equivalence.run_bounded_here(request["kind"], request["args"],
                                                 float(request["budget_s"]))
    except (ValueError, KeyError, TypeError):
      result = None
    protocol.write(json.dumps({"result": result, "cpu_s": time.thread_time() - start}) + "\n")
    protocol.flush()


if __name__ == "__main__":
  main()
