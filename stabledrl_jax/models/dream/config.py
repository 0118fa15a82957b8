"""DreamConfig: the shapes and dtypes of a Dream masked diffusion LM (the Qwen2 architecture).

Field names mirror the keys of Dream's Hugging Face `config.json` (Qwen2's `hidden_size`,
`num_attention_heads`, ... plus Dream's `mask_token_id`), so that a checkpoint's config maps onto
this dataclass one to one (``checkpoint.py``). The dtype fields, `remat`, `scan_layers` and
`attention` are ours, as in LLaDA's ModelConfig: they choose how the model is stored and run, not
what it computes.

Dream-v0-Instruct-7B's config.json (Dream-org; the copy read is
monash-yann/dllm-research@db71702 models/Dream-7B-Instruct/config.json): hidden_size 3584, 28
layers, 28 query and 4 key/value heads (head_dim 128), intermediate_size 18944, vocab_size
152064, rms_norm_eps 1e-6, rope_theta 1e6, mask_token_id 151666, bos / eos / pad 151643, untied
head, no sliding window, no rope scaling.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from stabledrl_jax.models import layers


def _head_dim(config: "DreamConfig") -> int:
  for name, divisor in (("hidden_size", "num_attention_heads"),
                        ("num_attention_heads", "num_key_value_heads")):
    if getattr(config, name) % getattr(config, divisor):
      raise ValueError(f"DreamConfig.{name} ({getattr(config, name)}) must be divisible by "
                       f"{divisor} ({getattr(config, divisor)})")
  return config.head_dim


@dataclasses.dataclass(frozen=True)
class DreamConfig:
  """Shapes, special tokens and dtypes of a Dream model.

  Attributes:
    hidden_size: model width D.
    num_hidden_layers: decoder layers.
    num_attention_heads: query heads H; head_dim = D / H (Qwen2's rule).
    num_key_value_heads: key/value heads K (H % K == 0; grouped-query attention).
    intermediate_size: SwiGLU hidden width F.
    vocab_size: rows of the embedding and of the untied output head.
    rms_norm_eps: epsilon of every RMSNorm.
    rope_theta: RoPE base.
    mask_token_id: the absorbing [MASK] token.
    eos_token_id: end of sequence (also the padding: pad_token_id is the same token in the
      release).
    max_position_embeddings: informational (written back to config.json); RoPE needs no table.
    param_dtype, dtype, logits_dtype: storage, compute and logits dtypes.
    remat: rematerialize each layer in the backward pass.
    scan_layers: the layers but the last as one `lax.scan` over their stacked parameters
      (`models/scan.py`).
    attention: the attention kernel (`layers.ATTENTION_IMPLS`; as in LLaDA's ModelConfig).
  """

  hidden_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  intermediate_size: int
  vocab_size: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1_000_000.0
  mask_token_id: int = 151666
  eos_token_id: int = 151643
  max_position_embeddings: int = 131072
  param_dtype: Any = jnp.float32
  dtype: Any = jnp.float32
  logits_dtype: Any = jnp.float32
  remat: bool = False
  scan_layers: bool = False
  attention: str = layers.DEFAULT_ATTENTION

  def __post_init__(self):
    layers.check_config(self, integers=("hidden_size", "num_hidden_layers",
                                        "num_attention_heads", "num_key_value_heads",
                                        "intermediate_size", "vocab_size",
                                        "max_position_embeddings"),
                        head_dim=_head_dim, token_limit="vocab_size")

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_attention_heads

  @property
  def embedding_size(self) -> int:
    """Width of the logits (= vocab_size; the name the samplers read)."""
    return self.vocab_size

  def replace(self, **changes) -> DreamConfig:
    return dataclasses.replace(self, **changes)


_CONFIGS = {
    # CPU unit tests: grouped-query attention (4 query heads, 2 kv heads), so that path runs.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, vocab_size=128, mask_token_id=127,
                 eos_token_id=126, rope_theta=10000.0, max_position_embeddings=512),
    # CPU benchmarks: about 23M parameters (the shapes of the other families' 'small').
    "small": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
                  num_key_value_heads=2, intermediate_size=1024, vocab_size=16384,
                  mask_token_id=16383, eos_token_id=16382, rope_theta=10000.0,
                  max_position_embeddings=2048),
    # Dream-v0-Instruct-7B (and -Base): the released config.json, bf16 weights and activations.
    "dream_7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                     rms_norm_eps=1e-6, rope_theta=1_000_000.0, mask_token_id=151666,
                     eos_token_id=151643, max_position_embeddings=131072,
                     param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, logits_dtype=jnp.float32),
}

DREAM_CONFIG_NAMES = tuple(_CONFIGS)


def get_dream_config(name: str, **overrides) -> DreamConfig:
  """The named Dream config ('tiny', 'small', 'dream_7b'), with optional field overrides."""
  if name not in _CONFIGS:
    raise ValueError(f"unknown Dream config {name!r}; choose from {DREAM_CONFIG_NAMES}")
  return DreamConfig(**{**_CONFIGS[name], **overrides})
