"""StableDRL-JAX: stable reinforcement learning for masked diffusion language models.

Layers, each importing only from the ones before it:
  objectives, estimators (pure functions of arrays)  <- models <- sampling <- training.
"""

__version__ = "0.1.0"

# libtpu without a TPU: no warnings, no lock file (libtpu_env.py; before JAX starts a backend).
from stabledrl_jax import libtpu_env as _libtpu_env  # pylint: disable=g-import-not-at-top

_libtpu_env.quiet_without_tpu()
