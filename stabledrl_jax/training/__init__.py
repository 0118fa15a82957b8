"""Training: the RL loop and everything it is built from (imports nothing on its own).

Modules: ``trainer`` (the RL loop), ``train_step`` (the jitted update), ``rl_loss`` (the RL loss
of a microbatch), ``supervised`` (SFT warm starts), ``sweep`` (many runs from one supervised
start), ``config_lib`` and ``specs`` (configs and their checks), ``data`` (tasks -> token arrays),
``decoding`` (batched evaluation decoding), ``checkpointing`` (preemption-safe train state),
``checkpoint_source`` (the model and tokenizer a checkpoint path holds, for inference),
``optimizer``, ``mesh``, ``multihost``, ``reward_pool``, ``metrics_writer``, ``spikes``.

Kept empty of imports so that ``config_lib`` (and ``--config NAME``) loads without jax.
"""
