"""Models: one folder per family, each registered in ``family`` (LLaDA, SDAR, Dream), and their
Hugging Face checkpoint IO.

    config = get_config("tiny")                      # or "small", "llada_8b"
    model = LLaDA(config, rngs=nnx.Rngs(0))
    logits = model(tokens)                           # [B, L] -> [B, L, embedding_size]

    dream = Dream(get_dream_config("tiny"), rngs=nnx.Rngs(0))
    logits = dream.predictions(tokens)               # shifted: row i predicts token i

    sdar = SDAR(get_sdar_config("tiny"), rngs=nnx.Rngs(0))
    logits = sdar(tokens)                            # block-causal, [B, L, vocab_size]
    logits = sdar.staircase(noisy, clean)            # [x_t ; x_0] in one pass: [B, L, vocab_size]

    model = from_pretrained("/path/to/checkpoint", dtype=jnp.bfloat16, mesh=mesh)  # by model_type
    config = load_config("/path/to/checkpoint")     # its config.json alone
    family.of(config).generate / .likelihood / ...   # what differs between families

    from stabledrl_jax.models.llada.sampler import generate    # SDAR's: models.sdar.sampler
    tokens = generate(model, prompt, key=key, gen_length=256, steps=128, block_length=32)

Modules: ``family`` (the family record and registry), ``llada/``, ``sdar/`` and ``dream/`` (config,
module, checkpoint names, sampler and the family's registration), ``sampler_lib`` (what the samplers
share), ``layers`` (RMSNorm, rotary, SwiGLU MLP, attention), ``scan`` (scanned layers), ``sharding``
(logical axis names and rules), ``hf_io`` (safetensors IO for every family).

Adding a family: a folder ``<name>/`` with those modules whose ``__init__.py`` registers a
``family.Family``, and one import below (docs/models.md, "Adding a model").
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stabledrl_jax import hub, input_files
from stabledrl_jax.models import family, hf_io, peft_io
from stabledrl_jax.models.hf_io import CheckpointError, load_config, save_pretrained
# Each family's package registers it.
from stabledrl_jax.models.llada import CONFIG_NAMES, LLaDA, ModelConfig, get_config
from stabledrl_jax.models.sdar import (SDAR, SDAR_CONFIG_NAMES, KVCache, SDARConfig,
                                       get_sdar_config)
from stabledrl_jax.models.dream import DREAM_CONFIG_NAMES, Dream, DreamConfig, get_dream_config
from stabledrl_jax.models.sharding import (LOGICAL_AXIS_RULES, batch_sharding, init_sharded,
                                           param_shardings)


@functools.lru_cache(maxsize=32)
def count_params(config) -> int:
  """Parameters of the model a config describes (any registered family), traced abstractly."""
  model_cls = family.of(config).model_cls
  abstract = nnx.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0)))
  leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
  return int(sum(np.prod(leaf.shape) for leaf in leaves))


def param_bytes(config, dtype=jnp.bfloat16) -> int:
  """Bytes taken by the parameters of the model of `config` stored in `dtype`."""
  return count_params(config) * jnp.dtype(dtype).itemsize


def from_pretrained(path: str, *, lora_base: str | None = None, **kwargs) -> nnx.Module:
  """A model of a registered family (by config.json's model_type) from a checkpoint directory
  or Hugging Face Hub id (``hf_io.from_pretrained``, where ``kwargs`` are described), or a PEFT
  LoRA adapter's: its base (``lora_base`` where given, else the one it names) with its adapters
  on it (``peft_io.from_pretrained``)."""
  local = hub.local_path(path)
  input_files.check(local, "directory", what="checkpoint")
  if peft_io.is_adapter_dir(local):
    return peft_io.from_pretrained(local, base=lora_base, **kwargs)
  peft_io.unwrapped(local, lora_base)  # A base to replace, but no adapter: one line.
  return hf_io.from_pretrained(local, **kwargs)


def init_model(config, *, seed: int = 0, mesh=None, rules=LOGICAL_AXIS_RULES):
  """A freshly initialized model of ``config``'s family; with a mesh, created in its shards."""
  model_cls = family.of(config).model_cls
  build = lambda: model_cls(config, rngs=nnx.Rngs(seed))
  return build() if mesh is None else init_sharded(build, mesh, rules)


__all__ = [
    "CONFIG_NAMES", "CheckpointError", "DREAM_CONFIG_NAMES", "Dream", "DreamConfig", "KVCache",
    "LLaDA", "LOGICAL_AXIS_RULES", "ModelConfig", "SDAR", "SDARConfig", "SDAR_CONFIG_NAMES",
    "batch_sharding", "count_params", "family", "from_pretrained", "get_config",
    "get_dream_config", "get_sdar_config", "init_model", "load_config", "param_bytes",
    "param_shardings", "save_pretrained",
]
