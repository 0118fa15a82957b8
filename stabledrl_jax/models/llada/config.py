"""ModelConfig: the shapes and dtypes of a LLaDA-architecture masked diffusion transformer.

Field names mirror the keys of LLaDA's Hugging Face `config.json` (`d_model`, `n_heads`, ...), so
that a checkpoint's config maps onto this dataclass one to one (see `hf_io.py`). The dtype fields,
`remat` and `scan_layers` are ours: they choose how the model is stored and run, not what it computes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from stabledrl_jax.models import layers


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes, special tokens and dtypes of a LLaDA model.

  Attributes:
    d_model: hidden width D.
    n_heads: query heads H; head_dim = d_model // n_heads.
    n_kv_heads: key/value heads K (K == H: multi-head; K < H: grouped-query attention).
    n_layers: transformer blocks.
    mlp_hidden_size: SwiGLU hidden width F.
    vocab_size: tokens of the tokenizer.
    embedding_size: rows of the input embedding and of the output head (>= vocab_size; None means
      vocab_size). The model returns logits of width embedding_size, as LLaDA's reference code
      does; for LLaDA-8B the two are equal (126464).
    rope_theta: RoPE base.
    rms_norm_eps: RMSNorm epsilon.
    mask_token_id: the absorbing [MASK] token.
    eos_token_id: end-of-sequence token (used by the sampler's EOS handling).
    max_sequence_length: informational (written back to config.json); RoPE needs no table.
    param_dtype: storage dtype of the parameters.
    dtype: compute dtype of activations and matmuls.
    logits_dtype: dtype of the returned logits (float32 keeps log-probs accurate under bf16).
    remat: rematerialize each block in the backward pass (saves activation memory).
    scan_layers: run the blocks but the last as one `lax.scan` over their parameters, stacked
      when the model is called (the parameters and checkpoints keep one entry per layer). Same
      values; with FSDP, each iteration gathers one layer's kernels and reduces one layer's
      gradients, where an unrolled loop lets XLA keep them all (see README, "Memory plan").
    attention: the attention kernel (`layers.ATTENTION_IMPLS`): 'auto' (the platform's: splash
      on TPU, cudnn on GPU for 16-bit compute, else xla), 'xla', 'splash' or 'cudnn'.
  """

  d_model: int
  n_heads: int
  n_kv_heads: int
  n_layers: int
  mlp_hidden_size: int
  vocab_size: int
  embedding_size: int | None = None
  rope_theta: float = 500000.0
  rms_norm_eps: float = 1e-5
  mask_token_id: int = 126336
  eos_token_id: int = 126081
  max_sequence_length: int = 4096
  param_dtype: Any = jnp.float32
  dtype: Any = jnp.float32
  logits_dtype: Any = jnp.float32
  remat: bool = False
  scan_layers: bool = False
  attention: str = layers.DEFAULT_ATTENTION

  def __post_init__(self):
    if self.embedding_size is None:
      object.__setattr__(self, "embedding_size", self.vocab_size)

    def head_dim(config):
      for name, divisor in (("d_model", "n_heads"), ("n_heads", "n_kv_heads")):
        if getattr(config, name) % getattr(config, divisor):
          raise ValueError(f"ModelConfig.{name} ({getattr(config, name)}) must be divisible by "
                           f"{divisor} ({getattr(config, divisor)})")
      return config.head_dim

    layers.check_config(self, integers=("d_model", "n_heads", "n_kv_heads", "n_layers",
                                        "mlp_hidden_size", "vocab_size", "embedding_size",
                                        "max_sequence_length"),
                        head_dim=head_dim, token_limit="embedding_size")
    if self.embedding_size < self.vocab_size:
      raise ValueError(f"ModelConfig.embedding_size ({self.embedding_size}) must be >= "
                       f"vocab_size ({self.vocab_size})")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)


_CONFIGS = {
    # CPU unit tests; grouped-query attention (4 query heads, 2 kv heads), so that path always runs.
    "tiny": dict(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=128,
                 vocab_size=128, mask_token_id=127, eos_token_id=126, rope_theta=10000.0,
                 max_sequence_length=512),
    # CPU benchmarks: about 23M parameters.
    "small": dict(d_model=384, n_heads=6, n_kv_heads=6, n_layers=6, mlp_hidden_size=1024,
                  vocab_size=16384, mask_token_id=16383, eos_token_id=16382,
                  max_sequence_length=2048),
    # LLaDA-8B (Base and Instruct): the released shapes, bf16 weights and activations.
    "llada_8b": dict(d_model=4096, n_heads=32, n_kv_heads=32, n_layers=32, mlp_hidden_size=12288,
                     vocab_size=126464, embedding_size=126464, rope_theta=500000.0,
                     rms_norm_eps=1e-5, mask_token_id=126336, eos_token_id=126081,
                     max_sequence_length=4096, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16,
                     logits_dtype=jnp.float32),
}

CONFIG_NAMES = tuple(_CONFIGS)


def get_config(name: str, **overrides) -> ModelConfig:
  """The named config ('tiny', 'small', 'llada_8b'), with optional field overrides."""
  if name not in _CONFIGS:
    raise ValueError(f"unknown model config {name!r}; choose from {CONFIG_NAMES}")
  return ModelConfig(**{**_CONFIGS[name], **overrides})
