"""SDARConfig: the shapes and dtypes of an SDAR block diffusion LM (the Qwen3 architecture).

Field names mirror the keys of SDAR's Hugging Face `config.json` (Qwen3 names: `hidden_size`,
`num_attention_heads`, ... plus SDAR's `block_size` and `mask_token_id`), so that a checkpoint's
config maps onto this dataclass one to one (see `hf_io.py`). As in `config.py`, the dtype fields
`remat` and `scan_layers` choose how the model is stored and run, not what it computes.

The released SDAR-1.7B-Chat config.json (JetLM) has: hidden_size 2048, 28 layers, 16 query and 8
key/value heads, head_dim 128, intermediate_size 6144, vocab_size 151936, rms_norm_eps 1e-6,
rope_theta 1e6, block_size 4, mask_token_id 151669, eos_token_id 151643, untied head
(`tie_word_embeddings: false`), no attention bias, no sliding window. The 4B and 8B entries below
take the shapes of Qwen3-4B and Qwen3-8B (from which SDAR-4B and SDAR-8B are initialized) with the
same SDAR keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from stabledrl_jax.models import layers


def _head_dim(config: "SDARConfig") -> int:
  if config.num_attention_heads % config.num_key_value_heads:
    raise ValueError(f"SDARConfig.num_attention_heads ({config.num_attention_heads}) must be "
                     f"divisible by num_key_value_heads ({config.num_key_value_heads})")
  return config.head_dim


@dataclasses.dataclass(frozen=True)
class SDARConfig:
  """Shapes, special tokens, block size and dtypes of an SDAR model.

  Attributes:
    hidden_size: model width D.
    num_hidden_layers: decoder layers.
    num_attention_heads: query heads H.
    num_key_value_heads: key/value heads K (H % K == 0; grouped-query attention).
    head_dim: per-head width hd; need not equal D / H (Qwen3-4B: 2560 / 32 = 80, hd = 128).
    intermediate_size: SwiGLU hidden width F.
    vocab_size: rows of the embedding and of the untied output head.
    rms_norm_eps: epsilon of every RMSNorm (layers, q/k norms, final norm).
    rope_theta: RoPE base.
    block_size: the diffusion block size (tokens decoded together; 4 for the released models).
    mask_token_id: the absorbing [MASK] token.
    eos_token_id: end of sequence (the token that fills a completion after it stops).
    stop_token_ids: every token that ends a completion (the release's generation_config.json
      names <|endoftext|> 151643 and <|im_end|> 151645); () means (eos_token_id,).
    max_position_embeddings: informational (written back to config.json); RoPE needs no table.
    param_dtype, dtype, logits_dtype: storage, compute and logits dtypes.
    remat: rematerialize each layer in the backward pass.
    scan_layers: the layers but the last as one `lax.scan` over their stacked parameters in the
      full-sequence and staircase passes (`models/scan.py`; not in cached decoding).
    attention: the attention kernel (`layers.ATTENTION_IMPLS`; as in LLaDA's ModelConfig).
  """

  hidden_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  intermediate_size: int
  vocab_size: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1_000_000.0
  block_size: int = 4
  mask_token_id: int = 151669
  eos_token_id: int = 151643
  stop_token_ids: tuple[int, ...] = ()
  max_position_embeddings: int = 32768
  param_dtype: Any = jnp.float32
  dtype: Any = jnp.float32
  logits_dtype: Any = jnp.float32
  remat: bool = False
  scan_layers: bool = False
  attention: str = layers.DEFAULT_ATTENTION

  def __post_init__(self):
    layers.check_config(self, integers=("hidden_size", "num_hidden_layers",
                                        "num_attention_heads", "num_key_value_heads", "head_dim",
                                        "intermediate_size", "vocab_size", "block_size",
                                        "max_position_embeddings"),
                        head_dim=_head_dim, token_limit="vocab_size")
    stops = tuple(int(t) for t in self.stop_token_ids) or (int(self.eos_token_id),)
    if stops[0] != self.eos_token_id or not all(0 <= t < self.vocab_size for t in stops):
      raise ValueError(f"SDARConfig.stop_token_ids {stops} must start with eos_token_id "
                       f"({self.eos_token_id}) and lie in [0, vocab_size)")
    object.__setattr__(self, "stop_token_ids", stops)

  @property
  def embedding_size(self) -> int:
    """Width of the logits (= vocab_size; the name the samplers read)."""
    return self.vocab_size

  def replace(self, **changes) -> SDARConfig:
    return dataclasses.replace(self, **changes)


_QWEN3_COMMON = dict(vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1_000_000.0, block_size=4,
                     mask_token_id=151669, eos_token_id=151643,
                     stop_token_ids=(151643, 151645),  # <|endoftext|>, <|im_end|>
                     max_position_embeddings=32768,
                     param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, logits_dtype=jnp.float32)

_CONFIGS = {
    # CPU unit tests: grouped-query attention and head_dim * heads != hidden_size (as in Qwen3-4B),
    # so that both paths always run.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, intermediate_size=128, vocab_size=128, mask_token_id=127,
                 eos_token_id=126, rope_theta=10000.0, block_size=4, max_position_embeddings=512),
    # CPU benchmarks: about 23M parameters (the shapes of the LLaDA 'small' config, with GQA).
    "small": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=64, intermediate_size=1024, vocab_size=16384,
                  mask_token_id=16383, eos_token_id=16382, rope_theta=10000.0, block_size=4,
                  max_position_embeddings=2048),
    # SDAR-1.7B-Chat: the released config.json.
    "sdar_1_7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, intermediate_size=6144,
                      **_QWEN3_COMMON),
    # SDAR-4B: Qwen3-4B shapes (for memory planning).
    "sdar_4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, intermediate_size=9728, **_QWEN3_COMMON),
    # SDAR-8B: Qwen3-8B shapes.
    "sdar_8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                    **_QWEN3_COMMON),
}

SDAR_CONFIG_NAMES = tuple(_CONFIGS)


def get_sdar_config(name: str, **overrides) -> SDARConfig:
  """The named SDAR config ('tiny', 'small', 'sdar_1_7b', 'sdar_4b', 'sdar_8b'), with overrides."""
  if name not in _CONFIGS:
    raise ValueError(f"unknown SDAR config {name!r}; choose from {SDAR_CONFIG_NAMES}")
  return SDARConfig(**{**_CONFIGS[name], **overrides})
