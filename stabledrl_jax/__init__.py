"""StableDRL-JAX: stable reinforcement learning for masked diffusion language models.

Layers, each importing only from the ones before it:
  losses, estimators (pure functions of arrays)  <- models <- sampling <- training.
"""

__version__ = "0.1.0"
