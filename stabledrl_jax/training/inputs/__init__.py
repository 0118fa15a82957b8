"""Inputs: what a run reads and scores on the host, with no device in sight.

``data`` turns a task's examples into left-padded prompts and completions of fixed shape (numpy,
ready to shard), and makes the tokenizer a config names; ``reward_pool`` scores a batch of
decoded answers in worker processes, each answer bounded in time. Nothing here imports jax, the
models or any other room of ``training``.
"""
