"""Models: LLaDA (full-attention masked diffusion) and SDAR (block diffusion) in Flax NNX, and
their Hugging Face checkpoint IO.

    config = get_config("tiny")                      # or "small", "llada_8b"
    model = LLaDA(config, rngs=nnx.Rngs(0))
    logits = model(tokens)                           # [B, L] -> [B, L, embedding_size]

    sdar = SDAR(get_sdar_config("tiny"), rngs=nnx.Rngs(0))
    logits = sdar(tokens)                            # block-causal, [B, L, vocab_size]
    logits = sdar.staircase(noisy, clean)            # [x_t ; x_0] in one pass: [B, L, vocab_size]

    model = from_pretrained("/path/to/checkpoint", dtype=jnp.bfloat16, mesh=mesh)  # by model_type
    config = load_config("/path/to/checkpoint")     # its config.json alone

Modules: `config` / `sdar_config` (configs), `layers` (RMSNorm, rotary, SwiGLU MLP, attention),
`llada` and `sdar` (the models), `staircase` (block-causal and staircase attention masks),
`sharding` (logical axis names and rules), `hf_io` (safetensors IO).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stabledrl_jax.models.config import CONFIG_NAMES, ModelConfig, get_config
from stabledrl_jax.models.hf_io import (CheckpointError, from_pretrained, load_config,
                                        save_pretrained)
from stabledrl_jax.models.llada import LLaDA
from stabledrl_jax.models.sdar import SDAR, KVCache
from stabledrl_jax.models.sdar_config import SDAR_CONFIG_NAMES, SDARConfig, get_sdar_config
from stabledrl_jax.models.sharding import (LOGICAL_AXIS_RULES, batch_sharding, init_sharded,
                                           param_shardings)


def _model_class(config: ModelConfig | SDARConfig):
  return SDAR if isinstance(config, SDARConfig) else LLaDA


@functools.lru_cache(maxsize=32)
def count_params(config: ModelConfig | SDARConfig) -> int:
  """Parameters of the model a config describes (LLaDA or SDAR), traced abstractly."""
  abstract = nnx.eval_shape(lambda: _model_class(config)(config, rngs=nnx.Rngs(0)))
  leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
  return int(sum(np.prod(leaf.shape) for leaf in leaves))


def param_bytes(config: ModelConfig | SDARConfig, dtype=jnp.bfloat16) -> int:
  """Bytes taken by the parameters of the model of `config` stored in `dtype`."""
  return count_params(config) * jnp.dtype(dtype).itemsize


def init_model(config: ModelConfig | SDARConfig, *, seed: int = 0, mesh=None,
               rules=LOGICAL_AXIS_RULES):
  """A freshly initialized LLaDA or SDAR (by config type); with a mesh, created in its shards."""
  build = lambda: _model_class(config)(config, rngs=nnx.Rngs(seed))
  return build() if mesh is None else init_sharded(build, mesh, rules)


__all__ = [
    "CONFIG_NAMES", "CheckpointError", "KVCache", "LLaDA", "LOGICAL_AXIS_RULES", "ModelConfig",
    "SDAR", "SDARConfig", "SDAR_CONFIG_NAMES", "batch_sharding", "count_params",
    "from_pretrained", "get_config", "get_sdar_config", "init_model", "load_config",
    "param_bytes", "param_shardings", "save_pretrained",
]
