"""Training: the RL loop and everything it is built from, one subpackage per job.

The rooms, each importing only those listed before it (``tests/test_packaging.py`` checks):

- ``inputs``: tasks and examples to fixed-shape token arrays; rewards scored on the host.
- ``parallel``: the device mesh and the processes of a multi-host run.
- ``config``: what a run is: the config files' defaults, every field's check, and the record
  (``run_spec.Resolved``) it resolves to once; the optimizer.
- ``step``: the programs of one RL step: the rollouts, the likelihood scoring, the loss and the
  jitted update, and the parts (model, optimizer, shardings) they are built on.
- ``state``: what outlives a process: checkpoints, LoRA bases, the supervised start, a
  checkpoint read back for inference.
- ``loop``: the run over steps: its build, the trainer, the collapse guard, preemption, metrics
  and sweeps.

Extending: an objective or an estimator is a registration outside this package
(``stabledrl_jax.objectives``, ``stabledrl_jax.estimators``); a new config field is added in
``config/config_lib.py`` with its check in ``config/specs.py``; what a step samples and scores
is ``step/rollout.py``'s ``RolloutCollector``.

Kept empty of imports (as ``config/__init__.py`` is) so that ``config_lib``, and with it
``--config NAME``, loads without jax.
"""

# Where each module of the flat layout went (before the rooms): a config file or notebook that
# still imports ``from stabledrl_jax.training import config_lib`` is told the new path.
_ROOM_OF = {
    "data": "inputs", "reward_pool": "inputs", "mesh": "parallel", "multihost": "parallel",
    "config_lib": "config", "specs": "config", "run_spec": "config", "optimizer": "config",
    "rl_loss": "step", "train_step": "step", "build": "step", "rl_step": "step",
    "rollout": "step", "decoding": "step", "lora_base": "state", "checkpointing": "state",
    "checkpoint_source": "state", "supervised": "state", "collapse": "loop", "spikes": "loop",
    "step_metrics": "loop", "metrics_writer": "loop", "preemption": "loop", "run_build": "loop",
    "trainer": "loop", "sweep": "loop",
}


def __getattr__(name: str):
  if name in _ROOM_OF:
    room = _ROOM_OF[name]
    raise ImportError(f"stabledrl_jax.training.{name} is now stabledrl_jax.training.{room}."
                      f"{name}: import it as 'from stabledrl_jax.training.{room} import {name}' "
                      "(docs/training.md)")
  raise AttributeError(f"module 'stabledrl_jax.training' has no attribute {name!r}")
