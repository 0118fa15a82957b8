"""Dream: a Qwen2-architecture transformer with bidirectional attention and shifted predictions.

    h_0 = embed_tokens[tokens]
    n   = input_layernorm(h)
    h   = h + o_proj(Attention(q_proj(n) + b_q, k_proj(n) + b_k, v_proj(n) + b_v))
    h   = h + mlp(post_attention_layernorm(h))          SwiGLU: down(silu(gate(x)) * up(x))
    logits = lm_head(norm(h))                           untied head, width vocab_size

As the official modeling code (``modeling_dream.py`` of Dream-org/Dream-v0-Instruct-7B, read in
monash-yann/dllm-research@db71702 models/Dream-7B-Instruct/): biases on q, k and v only,
grouped-query attention with no causal mask, RoPE on q and k. ``model(tokens)`` returns what
``DreamModel.forward(...).logits`` returns: the logits at position i predict token i + 1.
Dream keeps its autoregressive initialization's alignment, and its users shift:
``generation_utils.py`` concatenates ``[logits[:, :1], logits[:, :-1]]`` so that position i's
row predicts token i. ``predictions`` returns that shifted view, which the sampler and the
likelihood estimators read (docs/models.md, "Dream").

Positions: with an attention mask, position ids count the real tokens (``cumsum(mask) - 1``,
padding at 1), and padding keys get no weight, as the official generate does for a padded batch;
without one, 0..L-1.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from stabledrl_jax.models import layers, qwen, scan as scan_lib
from stabledrl_jax.models.dream.config import DreamConfig
from stabledrl_jax.models.sharding import constrain

Array = jax.Array

_HIDDEN_AXES = ("batch", None, None)


class BiasedLinear(layers.Linear):
  """``layers.Linear`` plus a bias [out] (Qwen2's q, k and v projections); LoRA adapts it as
  PEFT adapts a biased ``nn.Linear``: the adapter's term is added to x W + b."""

  def __init__(self, in_features: int, out_features: int, *, axes: tuple[str, str], std: float,
               dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
    super().__init__(in_features, out_features, axes=axes, std=std, dtype=dtype,
                     param_dtype=param_dtype, rngs=rngs)
    self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype), out_sharding=(axes[1],),
                          eager_sharding=False)

  def __call__(self, x: Array, out_dtype: Any = None) -> Array:
    y = super().__call__(x, out_dtype)
    return y + self.bias[...].astype(y.dtype)


def rotary(positions: Array, head_dim: int, theta: float) -> tuple[Array, Array]:
  """cos, sin [B, L, hd] float32 for position ids [B, L]."""
  b, length = positions.shape
  cos, sin = layers.rotary_angles_at(positions.reshape(-1), head_dim, theta)
  return cos.reshape(b, length, head_dim), sin.reshape(b, length, head_dim)


def apply_rotary(x: Array, cos: Array, sin: Array) -> Array:
  """x [B, L, N, hd] rotated by per-row angles cos, sin [B, L, hd] (rotate-half, float32)."""
  x32 = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  return (x32 * cos[:, :, None] + rotated * sin[:, :, None]).astype(x.dtype)


def positions_of(attention_mask: Array | None, batch: int, length: int) -> Array:
  """Position ids [B, L]: the official generate's ``cumsum(mask) - 1`` with padding at 1 (a
  row without padding gets 0..L-1), or 0..L-1 for every row without a mask."""
  if attention_mask is None:
    return jnp.broadcast_to(jnp.arange(length), (batch, length))
  mask = attention_mask.astype(jnp.int32)
  return jnp.where(mask > 0, jnp.cumsum(mask, axis=-1) - 1, 1)


class Attention(nnx.Module):
  """Bidirectional grouped-query attention with biased q, k, v and RoPE.

  q_proj: [D, H * hd] + [H * hd], k_proj / v_proj: [D, K * hd] + [K * hd], o_proj: [H * hd, D].
  Query head h reads key/value head h // (H / K) (torch's repeat_kv).
  """

  def __init__(self, config: DreamConfig, *, out_std: float, rngs: nnx.Rngs):
    self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
    self.head_dim = config.head_dim
    self.attention = config.attention
    self.dtype = config.dtype
    d = config.hidden_size
    kw = dict(dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)
    q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
    self.q_proj = BiasedLinear(d, q_width, axes=(layers.AX_EMBED, layers.AX_HEADS),
                               std=d**-0.5, **kw)
    self.k_proj = BiasedLinear(d, kv_width, axes=(layers.AX_EMBED, layers.AX_KV_HEADS),
                               std=d**-0.5, **kw)
    self.v_proj = BiasedLinear(d, kv_width, axes=(layers.AX_EMBED, layers.AX_KV_HEADS),
                               std=d**-0.5, **kw)
    self.o_proj = layers.Linear(q_width, d, axes=(layers.AX_HEADS, layers.AX_EMBED), std=out_std,
                                **kw)

  def __call__(self, x: Array, cos: Array, sin: Array, key_mask: Array | None,
               span: tuple[Array | int, int] | None = None) -> Array:
    """x [B, L, D], cos / sin [B, L, hd], key_mask [B, L] bool or None -> [B, L, D] (or
    [B, n, D] for the queries of span = (start, n); keys and values cover every position)."""
    b, length = x.shape[:2]
    xq, cos_q, sin_q = x, cos, sin
    if span is not None:
      start, n = span
      xq, cos_q, sin_q = (jax.lax.dynamic_slice_in_dim(a, start, n, axis=1)
                          for a in (x, cos, sin))
    t = xq.shape[1]
    groups = self.n_heads // self.n_kv_heads
    q = apply_rotary(self.q_proj(xq).reshape(b, t, self.n_heads, self.head_dim), cos_q, sin_q)
    q = q.reshape(b, t, self.n_kv_heads, groups, self.head_dim)
    k = apply_rotary(self.k_proj(x).reshape(b, length, self.n_kv_heads, self.head_dim), cos, sin)
    v = self.v_proj(x).reshape(b, length, self.n_kv_heads, self.head_dim)
    impl = layers.attention_impl(self.attention, self.dtype)
    if impl == "xla":
      mask = None if key_mask is None else key_mask[:, None, :]
      out = layers.dot_product_attention(q, k, v, mask, dtype=self.dtype)
    else:
      query_keep = key_mask if key_mask is None or span is None else (
          jax.lax.dynamic_slice_in_dim(key_mask, span[0], t, axis=1))
      out = layers.kernel_attention(q, k, v, impl=impl, allowed=None, key_keep=key_mask,
                                    query_keep=query_keep, dtype=self.dtype)
    return self.o_proj(out.reshape(b, t, self.n_heads * self.head_dim))


class DecoderLayer(qwen.QwenLayer):
  """Pre-norm residual layer: attention then SwiGLU MLP."""

  def __init__(self, config: DreamConfig, layer_index: int, *, rngs: nnx.Rngs):
    super().__init__(config, layer_index, Attention, rngs=rngs)

  def __call__(self, x: Array, cos: Array, sin: Array, key_mask: Array | None,
               span: tuple[Array | int, int] | None = None) -> Array:
    residual = x if span is None else jax.lax.dynamic_slice_in_dim(x, span[0], span[1], axis=1)
    x = residual + self.self_attn(self.input_layernorm(x), cos, sin, key_mask, span)
    return x + self.mlp(self.post_attention_layernorm(x))


class Dream(qwen.QwenModel):
  """The Dream masked diffusion transformer (``qwen.QwenModel``'s parameters).

  Args:
    config: shapes, special tokens and dtypes.
    rngs: parameter initialization keys (`nnx.Rngs(seed)`).
  """

  layer_cls = DecoderLayer

  def encode(self, tokens: Array, attention_mask: Array | None = None, *,
             span: tuple[Array | int, int] | None = None) -> Array:
    """Final hidden states (after ``norm``).

    Args:
      tokens: [B, L] int token ids.
      attention_mask: [B, L], True (or 1) for real tokens; padding keys get no weight and the
        position ids skip them. None: every position is real.
      span: (start, n), n static: the hidden states of positions start..start+n-1 only; the last
        layer then computes only those queries (the same values as slicing the full result).

    Returns:
      [B, L, D] (or [B, n, D] with span) in the compute dtype.
    """
    chex.assert_rank(tokens, 2)
    b, length = tokens.shape
    key_mask = None if attention_mask is None else attention_mask.astype(bool)
    cos, sin = rotary(positions_of(key_mask, b, length), self.config.head_dim,
                      self.config.rope_theta)
    x = constrain(self.embed_tokens(tokens), _HIDDEN_AXES)
    x = scan_lib.apply_layers(self.layers, x, cos, sin, key_mask, remat=self.config.remat,
                              scan=self.config.scan_layers, axes=_HIDDEN_AXES, span=span)
    return constrain(self.norm(x), _HIDDEN_AXES)

  def unembed(self, hidden: Array) -> Array:
    """hidden: [B, ..., D] -> logits [B, ..., vocab_size] in `config.logits_dtype`."""
    logits = self.lm_head(hidden, out_dtype=self.config.logits_dtype)
    return constrain(logits, ("batch",) + (None,) * (logits.ndim - 2) + (layers.AX_VOCAB,))

  def __call__(self, tokens: Array, attention_mask: Array | None = None) -> Array:
    """tokens [B, L] -> the official forward's logits [B, L, vocab_size]: row i predicts
    token i + 1 (see ``predictions`` for the rows the diffusion loss and sampler read)."""
    return self.unembed(self.encode(tokens, attention_mask))

  def predictions(self, tokens: Array, attention_mask: Array | None = None, *,
                  suffix: int | None = None) -> Array:
    """Dream's shifted logits: row i predicts token i, ``[raw[:, :1], raw[:, :-1]]``.

    Args:
      tokens, attention_mask: as ``encode``.
      suffix: n < L: the rows of the last n positions only, [B, n, V] (their hidden states are
        those of positions L-n-1..L-2; the last layer and the head run for those alone).

    Returns:
      [B, L, vocab_size] (or [B, n, vocab_size]) in `config.logits_dtype`.
    """
    length = tokens.shape[1]
    if suffix is None:
      raw = self(tokens, attention_mask)
      return jnp.concatenate([raw[:, :1], raw[:, :-1]], axis=1)
    if not 0 < suffix < length:
      raise ValueError(f"suffix={suffix}: Dream's shifted rows of the last n positions need "
                       f"0 < n < L={length} (row L-n reads position L-n-1)")
    return self.unembed(self.encode(tokens, attention_mask, span=(length - suffix - 1, suffix)))
