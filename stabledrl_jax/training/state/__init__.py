"""State: what outlives a process (docs/reliability.md).

``checkpointing`` saves and restores the train state (preemption-safe, orbax); ``lora_base``
fingerprints the base a LoRA run trains on; ``supervised`` makes and caches the supervised start
a run begins from; ``checkpoint_source`` reads a checkpoint (a workdir, an export, a Hugging Face
directory) back as a model and a tokenizer for inference. Imports the rooms below it (``config``,
``inputs``, ``parallel``, ``step``); never the loop.
"""
