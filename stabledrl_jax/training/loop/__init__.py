"""Loop: the run over steps (docs/training.md).

``run_build`` builds a run from its record and sources; ``trainer`` is the loop over it (rollouts,
updates, evaluations, checkpoints, the lock and the signals); ``collapse`` is the collapse rule
and the guard that acts on it; ``preemption`` the stop requests; ``step_metrics``, ``spikes`` and
``metrics_writer`` what each step logs; ``sweep`` many runs from one supervised start. The top
room: it imports every other, and none imports it.
"""
