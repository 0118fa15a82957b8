"""Training: the RL loop and everything it is built from (imports nothing on its own).

Modules: ``trainer`` (the RL loop: rollouts, l_old / l_ref, updates, metrics, checkpoints),
``rollout`` (the host half of a step: sample, decode, score, advantages, the batch),
``run_spec`` (what the update takes from the config, resolved once), ``train_step`` (the jitted
update), ``rl_loss`` (the RL loss of a microbatch), ``supervised`` (SFT warm starts), ``sweep``
(many runs from one supervised start), ``config_lib`` and ``specs`` (configs, their checks and
their resolution), ``data`` (tasks -> token arrays), ``decoding`` (batched evaluation decoding),
``checkpointing`` (preemption-safe train state), ``checkpoint_source`` (the model and tokenizer
a checkpoint path holds, for inference), ``optimizer``, ``mesh``, ``multihost``,
``reward_pool``, ``metrics_writer``, ``spikes``.

Extending: an objective or an estimator is a registration outside this package
(``stabledrl_jax.objectives``, ``stabledrl_jax.estimators``); a new config field is added in
``config_lib`` with its check in ``specs``; what a step samples and scores is
``rollout.RolloutCollector``.

Kept empty of imports so that ``config_lib`` (and ``--config NAME``) loads without jax.
"""
