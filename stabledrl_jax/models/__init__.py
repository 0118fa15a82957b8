"""Models: the LLaDA masked diffusion transformer in Flax NNX and its Hugging Face checkpoint IO.

    config = get_config("tiny")                      # or "small", "llada_8b"
    model = LLaDA(config, rngs=nnx.Rngs(0))
    logits = model(tokens)                           # [B, L] -> [B, L, embedding_size]
    model = from_pretrained("/path/to/LLaDA-8B-Instruct", dtype=jnp.bfloat16, mesh=mesh)

Modules: `config` (ModelConfig, named configs), `layers` (RMSNorm, rotary, SwiGLU MLP, attention),
`llada` (the model), `sharding` (logical axis names and rules), `hf_io` (safetensors IO).
"""

from stabledrl_jax.models.config import CONFIG_NAMES, ModelConfig, get_config
from stabledrl_jax.models.hf_io import CheckpointError, from_pretrained, save_pretrained
from stabledrl_jax.models.llada import LLaDA, count_params, init_model, param_bytes
from stabledrl_jax.models.sharding import LOGICAL_AXIS_RULES, batch_sharding, param_shardings

__all__ = [
    "CONFIG_NAMES", "CheckpointError", "LLaDA", "LOGICAL_AXIS_RULES", "ModelConfig",
    "batch_sharding", "count_params", "from_pretrained", "get_config", "init_model",
    "param_bytes", "param_shardings", "save_pretrained",
]
