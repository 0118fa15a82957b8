"""The shipped ``get_config()`` files, installed as the package ``stabledrl_jax.configs``.

``--config quickstart`` (a name) and ``--config configs/quickstart.py`` (a path) both select
``quickstart.py`` here (``training/config_lib.config_path``).
"""
