"""Step: the programs one RL step runs, and the parts they are built on.

``build`` makes the parts (model, optimizer, shardings, the train state) and the jitted update,
memoized on what they depend on; ``rollout`` samples, decodes, scores and batches completions
through ``decoding``; ``rl_step`` composes a step's programs (l_old and l_ref scoring, the update)
and their ahead-of-time forms; ``train_step`` is the update and ``rl_loss`` the loss of one
microbatch. Imports ``config``, ``inputs`` and ``parallel``; never the state or the loop.
"""
