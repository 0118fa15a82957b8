"""LLaDA: a LLaMA-style transformer with bidirectional attention and no time conditioning.

    h_0 = wte[tokens]
    h   = h + attn_out(Attention(attn_norm(h)))          for each of the n_layers blocks
    h   = h + ff_out(silu(ff_proj(ff_norm(h))) * up_proj(ff_norm(h)))
    logits = lm_head(ln_f(h))                             untied output head, width embedding_size

`model(tokens, attention_mask)` returns logits [B, L, embedding_size]. The two halves are also
exposed, `encode` (tokens -> final normed hidden states) and `unembed` (hidden -> logits), so that
callers that need logits at a few positions only (the sampler needs one block) skip the rest of
the output projection, which is the largest matmul of a small model.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from stabledrl_jax.models import layers, scan as scan_lib
from stabledrl_jax.models.llada.config import ModelConfig
from stabledrl_jax.models.sharding import constrain

Array = jax.Array


class Block(nnx.Module):
  """Pre-norm residual block: attention then SwiGLU MLP."""

  def __init__(self, config: ModelConfig, layer_index: int, *, rngs: nnx.Rngs):
    kw = dict(dtype=config.dtype, param_dtype=config.param_dtype)
    # LLaDA/OLMo "mitchell" init: std 1/sqrt(fan_in), output projections also / sqrt(2 (i + 1)).
    depth_scale = 1.0 / math.sqrt(2.0 * (layer_index + 1))
    self.attn_norm = layers.RMSNorm(config.d_model, eps=config.rms_norm_eps, **kw)
    self.attn = layers.Attention(config.d_model, config.n_heads, config.n_kv_heads,
                                 out_std=config.d_model**-0.5 * depth_scale, rngs=rngs,
                                 attention=config.attention, **kw)
    self.ff_norm = layers.RMSNorm(config.d_model, eps=config.rms_norm_eps, **kw)
    self.mlp = layers.MLP(config.d_model, config.mlp_hidden_size,
                          out_std=config.mlp_hidden_size**-0.5 * depth_scale, rngs=rngs, **kw)

  def __call__(self, x: Array, cos: Array, sin: Array, key_mask: Array | None,
               span: tuple[Array | int, int] | None = None) -> Array:
    """x: [B, L, D] -> [B, L, D], or [B, n, D] for the positions of span = (start, n)."""
    residual = x if span is None else jax.lax.dynamic_slice_in_dim(x, span[0], span[1], axis=1)
    x = residual + self.attn(self.attn_norm(x), cos, sin, key_mask, span)
    return x + self.mlp(self.ff_norm(x))

  def with_kv(self, x: Array, cos: Array, sin: Array, key_mask: Array | None,
              span: tuple[Array | int, int] | None = None
              ) -> tuple[Array, tuple[Array, Array]]:
    """``__call__`` and the block's keys and values of every position ([B, L, K, hd] each)."""
    residual = x if span is None else jax.lax.dynamic_slice_in_dim(x, span[0], span[1], axis=1)
    out, kv = self.attn(self.attn_norm(x), cos, sin, key_mask, span, return_kv=True)
    x = residual + out
    return x + self.mlp(self.ff_norm(x)), kv

  def cached(self, xq: Array, cos_q: Array, sin_q: Array, key_mask: Array | None,
             cache: tuple[Array, Array], start: Array | int, fresh_from: Array | int) -> Array:
    """The block for the positions start..start+n-1 alone, over a KV cache (``Attention.cached``)."""
    x = xq + self.attn.cached(self.attn_norm(xq), cos_q, sin_q, key_mask, cache, start,
                              fresh_from)
    return x + self.mlp(self.ff_norm(x))


# Activations split over the batch rule's mesh axes (see `sharding.constrain`).
_HIDDEN_AXES = ("batch", None, None)


class LLaDA(nnx.Module):
  """The LLaDA masked diffusion transformer.

  Args:
    config: shapes, special tokens and dtypes.
    rngs: parameter initialization keys (`nnx.Rngs(seed)`).
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    kw = dict(dtype=config.dtype, param_dtype=config.param_dtype)
    self.wte = layers.Embed(config.embedding_size, config.d_model, std=config.d_model**-0.5,
                            rngs=rngs, **kw)
    self.blocks = nnx.List([Block(config, i, rngs=rngs) for i in range(config.n_layers)])
    self.ln_f = layers.RMSNorm(config.d_model, eps=config.rms_norm_eps, **kw)
    self.lm_head = layers.Linear(config.d_model, config.embedding_size,
                                 axes=(layers.AX_EMBED, layers.AX_VOCAB), std=config.d_model**-0.5,
                                 rngs=rngs, **kw)

  def encode(self, tokens: Array, attention_mask: Array | None = None, *,
             span: tuple[Array | int, int] | None = None) -> Array:
    """Final hidden states after ln_f.

    Args:
      tokens: [B, L] int token ids.
      attention_mask: [B, L] bool, True for real tokens; padding keys get no attention weight.
        None: every position is attended to (LLaDA's default).
      span: (start, n) with n static and start an int or a traced scalar: return the hidden
        states of positions start..start+n-1 only. The last block then computes only those
        queries and their MLP (exactly the same values; less work when n << L).

    Returns:
      [B, L, D] (or [B, n, D] with span) in the compute dtype.
    """
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be [B, L], got shape {tokens.shape}")
    if attention_mask is not None:
      attention_mask = attention_mask.astype(bool)
    cos, sin = layers.rotary_angles(tokens.shape[1], self.config.head_dim, self.config.rope_theta)
    x = constrain(self.wte(tokens), _HIDDEN_AXES)
    x = scan_lib.apply_layers(self.blocks, x, cos, sin, attention_mask, remat=self.config.remat,
                              scan=self.config.scan_layers, axes=_HIDDEN_AXES, span=span)
    return constrain(self.ln_f(x), _HIDDEN_AXES)

  def encode_kv(self, tokens: Array, attention_mask: Array | None = None, *,
                span: tuple[Array | int, int] | None = None,
                cache: tuple[Array, Array] | None = None
                ) -> tuple[Array, tuple[Array, Array]]:
    """``encode`` and a KV cache: every layer's rotated keys and values of every position,
    [n_layers, B, L, K, hd] each (for ``encode_cached``).

    ``cache``: a buffer of that shape and dtype to write them into, layer by layer with
    ``dynamic_update_slice``, returned in place of a new stack. A sampler that carries its cache
    through a loop and no longer needs the old contents passes it, so that XLA updates the
    carried buffer in place: one cache is live, not the old one, the layers' keys and values
    and their stack (the same values either way). With ``scan_layers`` the blocks but the last
    run as one ``lax.scan`` (as in ``encode``) that carries the cache.
    """
    if attention_mask is not None:
      attention_mask = attention_mask.astype(bool)
    cos, sin = layers.rotary_angles(tokens.shape[1], self.config.head_dim, self.config.rope_theta)
    x = constrain(self.wte(tokens), _HIDDEN_AXES)
    *body, last = self.blocks
    if cache is None:
      shape = (len(self.blocks), *tokens.shape, self.config.n_kv_heads, self.config.head_dim)
      cache = (jnp.zeros(shape, self.config.dtype), jnp.zeros(shape, self.config.dtype))

    def write(cache: tuple[Array, Array], i: Array | int, kv: tuple[Array, Array]):
      return tuple(jax.lax.dynamic_update_index_in_dim(c, t.astype(c.dtype), i, 0)
                   for c, t in zip(cache, kv))

    def layer(block: Block, index_and_none, carry):
      x, cache = carry
      x, kv = block.with_kv(x, cos, sin, attention_mask)
      return constrain(x, _HIDDEN_AXES), write(cache, index_and_none[0], kv)

    if self.config.scan_layers and body:
      x, cache = scan_lib.scan_layers_indexed(body, (x, cache), layer)
    else:
      for i, block in enumerate(body):
        x, cache = layer(block, (i, None), (x, cache))
    x, kv = last.with_kv(x, cos, sin, attention_mask, span)
    return constrain(self.ln_f(x), _HIDDEN_AXES), write(cache, len(body), kv)

  def encode_cached(self, tokens: Array, start: Array | int, cache: tuple[Array, Array],
                    attention_mask: Array | None = None, *,
                    fresh_from: Array | int | None = None) -> Array:
    """Hidden states of the positions start..start+n-1 from those positions' tokens alone.

    Every other position is seen through ``cache`` (``encode_kv`` of an earlier sequence): its
    keys and values are reused, not recomputed. This is block-wise KV caching for a
    bidirectional model (Fast-dLLM): approximate once the cached positions' context has changed.

    Args:
      tokens: [B, n] the tokens at positions start..start+n-1 (n static).
      start: the first position (int or traced).
      cache: keys and values [n_layers, B, L, K, hd].
      attention_mask: [B, L] bool, or None.
      fresh_from: query positions >= fresh_from use their keys and values computed now; those
        before it keep the cache's (default: start, all fresh).

    Returns:
      [B, n, D] after ln_f.
    """
    if attention_mask is not None:
      attention_mask = attention_mask.astype(bool)
    fresh_from = start if fresh_from is None else fresh_from
    positions = start + jnp.arange(tokens.shape[1])
    cos, sin = layers.rotary_angles_at(positions, self.config.head_dim, self.config.rope_theta)
    x = constrain(self.wte(tokens), _HIDDEN_AXES)

    def layer(block: Block, index_and_kv, x):
      return constrain(block.cached(x, cos, sin, attention_mask, index_and_kv[1], start,
                                    fresh_from), _HIDDEN_AXES)

    if self.config.scan_layers:
      x = scan_lib.scan_layers_indexed(self.blocks, x, layer, xs=cache)
    else:
      for i, block in enumerate(self.blocks):
        x = layer(block, (i, (cache[0][i], cache[1][i])), x)
    return constrain(self.ln_f(x), _HIDDEN_AXES)

  def unembed(self, hidden: Array) -> Array:
    """hidden: [B, ..., D] -> logits [B, ..., embedding_size] in `config.logits_dtype`."""
    logits = self.lm_head(hidden, out_dtype=self.config.logits_dtype)
    return constrain(logits, ("batch",) + (None,) * (logits.ndim - 2) + (layers.AX_VOCAB,))

  def __call__(self, tokens: Array, attention_mask: Array | None = None) -> Array:
    """tokens: [B, L] int -> logits [B, L, embedding_size] (see `encode` for the mask)."""
    return self.unembed(self.encode(tokens, attention_mask))
