"""StableDRL-JAX: stable reinforcement learning for masked diffusion language models.

Layers, each importing only from the ones before it:
  objectives, estimators, block_estimators (pure functions of arrays; tasks and rewards, pure
  Python)  <-  models (one folder per family: module, checkpoint names, sampler)  <-  training
  (the RL loop)  <-  train, evaluate, export, plan (the commands).

Extending: an objective is one module in ``objectives/`` (or anywhere) with one registration; an
estimator one ``estimators.register_method`` call; a model family one folder under ``models/``
with one ``models.family.register`` call; a task one module in ``tasks/``.
"""

__version__ = "0.1.0"

# libtpu without a TPU: no warnings, no lock file (libtpu_env.py; before JAX starts a backend).
from stabledrl_jax import libtpu_env as _libtpu_env  # pylint: disable=g-import-not-at-top

_libtpu_env.quiet_without_tpu()
