"""Config: what a run is, checked once and resolved to one record (docs/training.md).

``config_lib`` holds the defaults of every field (``base_config``) and loads ``get_config()``
files; ``specs`` checks every field (one-line errors naming it) and resolves the config to
``run_spec.Resolved``, the frozen record of the whole run that everything after it takes;
``optimizer`` makes the optimizer from its spec. Imports only ``inputs`` (the tokenizer, for the
vocabulary checks) and ``parallel`` (the mesh's shape). Kept empty of imports so that
``config_lib`` loads without jax.
"""
