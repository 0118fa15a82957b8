"""SDAR: a block diffusion LM on the Qwen3 architecture, in Flax NNX.

    h_0 = embed_tokens[tokens]
    for each layer:  h = h + o_proj(Attention(input_layernorm(h)))
                     y = post_attention_layernorm(h)
                     h = h + down_proj(silu(gate_proj(y)) * up_proj(y))
    logits = lm_head(norm(h))                           untied head, width vocab_size

Attention is grouped-query with a per-head RMSNorm on queries and keys (q_norm, k_norm over
head_dim, applied before RoPE), RoPE with theta from the config (rotate-half, float32), scores
q.k / sqrt(head_dim) soft-maxed in float32. No biases. Predictions are *not shifted*: the logits at
position i predict the token at position i (a masked position predicts itself), as in SDAR's
training loss and sampler (`JetAstra/SDAR`, `training/model/SDAR-4B-Chat/modeling_sdar.py` and
`generate.py`); there is no next-token shift as in an autoregressive Qwen3.

The model is used in three ways, which differ only in which keys each query sees (`staircase.py`):

  * `model(tokens)` / `encode(tokens, span=...)`: block-causal attention over one sequence (the
    decoding mask). `encode(..., span=(start, n))` runs the last layer for n queries only.
  * `staircase(noisy, clean)` / `staircase_encode`: the training / likelihood layout [x_t ; x_0]
    of length 2n (or [x_t^1 ; ... ; x_t^R ; x_0] for R samples sharing one clean stream); returns
    the logits (hidden states) of the noisy streams, block k conditioned on the clean blocks < k.
  * `extend(tokens, cache, commit=...)`: cached decoding. The new tokens attend to the KV cache of
    the finished blocks and block-causally to each other; with commit=True their keys and values
    are written to the cache.

Module attributes follow the Qwen3 / SDAR checkpoint names (`embed_tokens`, `layers.{i}.self_attn.
{q,k,v,o}_proj`, `q_norm`, `k_norm`, `input_layernorm`, `post_attention_layernorm`, `norm`,
`lm_head`); the MLP is the shared SwiGLU `layers.MLP`, whose ff_proj / up_proj / ff_out are
gate_proj / up_proj / down_proj (`checkpoint.py` has the table). Every parameter carries
logical axis names from `sharding.py`, as in LLaDA.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stabledrl_jax.models import layers, qwen, scan as scan_lib
from stabledrl_jax.models.sdar import staircase as staircase_lib
from stabledrl_jax.models.sdar.config import SDARConfig
from stabledrl_jax.models.sharding import constrain

Array = jax.Array


# ---------------------------------------------------------------------------
# Attention kernels: (q, k, v, aux) -> output. Static, hashable descriptions (so that they can be
# static arguments of nnx.remat); the arrays they need travel in `aux`.
# ---------------------------------------------------------------------------


# With model.attention a kernel (`layers.kernel_attention`), each mask is a static pattern and
# the key padding; a pattern that depends on a traced position is rewritten into one that does
# not (a block-aligned span of queries: `_cached_layout`).


def _block_causal_np(t: int, s: int, block_size: int) -> np.ndarray:
  """`staircase.block_causal_mask` of positions arange(t) over arange(s), as numpy."""
  return (np.arange(t)[:, None] // block_size) >= (np.arange(s)[None, :] // block_size)


def _cached_layout(q, k_prefix, v_prefix, prefix_visible, k_own, v_own, own_keep, block_size,
                   impl, dtype):
  """Queries of whole blocks at a block boundary over [prefix keys ; their own keys]: the
  prefix keys where prefix_visible [B, S], their own block-causally (`layers.kernel_attention`)."""
  m, s = k_own.shape[1], k_prefix.shape[1]
  allowed = np.concatenate([np.ones((m, s), bool), _block_causal_np(m, m, block_size)], axis=1)
  keys = jnp.concatenate([k_prefix, k_own.astype(k_prefix.dtype)], axis=1)
  values = jnp.concatenate([v_prefix, v_own.astype(v_prefix.dtype)], axis=1)
  return layers.kernel_attention(q, keys, values, impl=impl, allowed=allowed,
                                 key_keep=jnp.concatenate([prefix_visible, own_keep], axis=1),
                                 query_keep=own_keep, dtype=dtype)


def _check_kernel_span(config: SDARConfig, span: tuple[Array | int, int]) -> None:
  """A kernel's span (`_BlockCausal`) must start on a block boundary: checked where the start
  is a Python or numpy int (a traced start, the block sampler's, is one by construction)."""
  start = span[0]
  if (layers.attention_impl(config.attention, config.dtype) != "xla"
      and isinstance(start, (int, np.integer)) and start % config.block_size):
    raise ValueError(f"model.attention={config.attention!r}: a span of queries must start on a "
                     f"block boundary (a multiple of block_size={config.block_size}), got "
                     f"start={int(start)}; use attention='xla' for other starts")


@dataclasses.dataclass(frozen=True)
class _BlockCausal:
  """aux = (q_positions [T'], k_positions [T], key_mask [B, T] or None).

  The positions are arange(T) for both, or start + arange(T') for the queries of a span (for a
  kernel: start a multiple of block_size, as the block sampler's are).
  """

  block_size: int
  dtype: Any
  attention: str = "xla"

  def __call__(self, q, k, v, aux):
    q_positions, k_positions, key_mask = aux
    impl = layers.attention_impl(self.attention, self.dtype)
    if impl != "xla":
      return self._kernel(q, k, v, aux, impl)
    mask = staircase_lib.block_causal_mask(q_positions, k_positions, self.block_size)[None]
    if key_mask is not None:
      mask = mask & key_mask[:, None, :]
    return layers.dot_product_attention(q, k, v, mask, dtype=self.dtype)

  def _kernel(self, q, k, v, aux, impl):
    q_positions, _, key_mask = aux
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    keep = jnp.ones((b, s), bool) if key_mask is None else key_mask
    if t == s:  # Every position: the static block-causal mask.
      allowed = _block_causal_np(t, s, self.block_size)
      return layers.kernel_attention(q, k, v, impl=impl, allowed=allowed, key_keep=key_mask,
                                     query_keep=key_mask, dtype=self.dtype)
    # A span at `start`: the keys before it are its prefix, its own keys block-causal.
    start = q_positions[0]
    prefix_visible = keep & (jnp.arange(s) < start)[None, :]
    k_own, v_own, own_keep = (jax.lax.dynamic_slice_in_dim(x, start, t, axis=1)
                              for x in (k, v, keep))
    return _cached_layout(q, k, v, prefix_visible, k_own, v_own, own_keep, self.block_size,
                          impl, self.dtype)


@dataclasses.dataclass(frozen=True)
class _Staircase:
  """aux = key_mask [B, n] or None."""

  num_samples: int
  block_size: int
  impl: str
  dtype: Any
  attention: str = "xla"

  def __call__(self, q, k, v, aux):
    kernel = layers.attention_impl(self.attention, self.dtype)
    if kernel != "xla":  # The dense staircase pattern; the kernel skips its empty tiles.
      n = q.shape[1] // (self.num_samples + 1)
      allowed = staircase_lib.staircase_mask(n, self.block_size, self.num_samples)
      keep = None if aux is None else jnp.tile(aux.astype(bool), (1, self.num_samples + 1))
      return layers.kernel_attention(q, k, v, impl=kernel, allowed=allowed, key_keep=keep,
                                     query_keep=keep, dtype=self.dtype)
    attend = staircase_lib.STAIRCASE_IMPLS[self.impl]
    return attend(q, k, v, num_samples=self.num_samples, block_size=self.block_size,
                  key_mask=aux, dtype=self.dtype)


@dataclasses.dataclass(frozen=True)
class _Cached:
  """aux = (cache_k [B, S, K, hd], cache_v, cache_visible [B, S], q_positions [m], new_mask [B, m]).

  Keys: the cached ones (visible where cache_visible) followed by the m new ones, which the new
  queries see block-causally.
  """

  block_size: int
  dtype: Any
  attention: str = "xla"

  def __call__(self, q, k, v, aux):
    cache_k, cache_v, cache_visible, q_positions, new_mask = aux
    impl = layers.attention_impl(self.attention, self.dtype, cached=True, head_dim=q.shape[-1])
    if impl != "xla":  # The cache's length is a multiple of block_size (`SDAR.extend`).
      return _cached_layout(q, cache_k, cache_v, cache_visible, k, v, new_mask, self.block_size,
                            impl, self.dtype)
    own = staircase_lib.block_causal_mask(q_positions, q_positions, self.block_size)[None]
    own = own & new_mask[:, None, :]
    old = jnp.broadcast_to(cache_visible[:, None, :], (q.shape[0], q.shape[1],
                                                       cache_visible.shape[1]))
    mask = jnp.concatenate([old, own], axis=-1)
    keys = jnp.concatenate([cache_k, k.astype(cache_k.dtype)], axis=1)
    values = jnp.concatenate([cache_v, v.astype(cache_v.dtype)], axis=1)
    return layers.dot_product_attention(q, keys, values, mask, dtype=self.dtype)


# ---------------------------------------------------------------------------
# Modules.
# ---------------------------------------------------------------------------


class Attention(nnx.Module):
  """Qwen3 attention: q/k/v projections, per-head RMSNorm of q and k, RoPE, a given kernel, o_proj.

  q_proj: [D, H * hd], k_proj / v_proj: [D, K * hd], o_proj: [H * hd, D]; q_norm, k_norm: [hd].
  """

  def __init__(self, config: SDARConfig, *, out_std: float, rngs: nnx.Rngs):
    d, hd = config.hidden_size, config.head_dim
    self.n_heads, self.n_kv_heads, self.head_dim = (
        config.num_attention_heads, config.num_key_value_heads, hd)
    kw = dict(dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)
    std = d**-0.5
    q_width, kv_width = self.n_heads * hd, self.n_kv_heads * hd
    self.q_proj = layers.Linear(d, q_width, axes=(layers.AX_EMBED, layers.AX_HEADS), std=std, **kw)
    self.k_proj = layers.Linear(d, kv_width, axes=(layers.AX_EMBED, layers.AX_KV_HEADS), std=std,
                                **kw)
    self.v_proj = layers.Linear(d, kv_width, axes=(layers.AX_EMBED, layers.AX_KV_HEADS), std=std,
                                **kw)
    self.o_proj = layers.Linear(q_width, d, axes=(layers.AX_HEADS, layers.AX_EMBED), std=out_std,
                                **kw)
    norm_kw = dict(eps=config.rms_norm_eps, dtype=config.dtype, param_dtype=config.param_dtype)
    self.q_norm = layers.RMSNorm(hd, **norm_kw)
    self.k_norm = layers.RMSNorm(hd, **norm_kw)

  def __call__(self, x: Array, cos: Array, sin: Array, kernel: Any, aux: Any,
               span: tuple[Array | int, int] | None = None) -> tuple[Array, tuple[Array, Array]]:
    """x: [B, T, D]; cos, sin: [T, hd] -> (out [B, T', D], (k, v) [B, T, K, hd] rotated keys).

    With span = (start, n), only the queries of positions start..start+n-1 are computed (T' = n).
    """
    b, length, _ = x.shape
    groups = self.n_heads // self.n_kv_heads
    xq, cos_q, sin_q = layers.query_span(x, cos, sin, span)
    q_len = xq.shape[1]
    q = self.q_norm(self.q_proj(xq).reshape(b, q_len, self.n_heads, self.head_dim))
    q = layers.apply_rotary(q, cos_q, sin_q).reshape(b, q_len, self.n_kv_heads, groups,
                                                     self.head_dim)
    k = self.k_norm(self.k_proj(x).reshape(b, length, self.n_kv_heads, self.head_dim))
    k = layers.apply_rotary(k, cos, sin)
    v = self.v_proj(x).reshape(b, length, self.n_kv_heads, self.head_dim)
    out = kernel(q, k, v, aux)
    return self.o_proj(out.reshape(b, q_len, self.n_heads * self.head_dim)), (k, v)


class DecoderLayer(qwen.QwenLayer):
  """Pre-norm residual layer: attention then SwiGLU MLP."""

  def __init__(self, config: SDARConfig, layer_index: int, *, rngs: nnx.Rngs):
    super().__init__(config, layer_index, Attention, rngs=rngs)

  def __call__(self, x: Array, cos: Array, sin: Array, kernel: Any, aux: Any,
               span: tuple[Array | int, int] | None = None) -> tuple[Array, tuple[Array, Array]]:
    """x: [B, T, D] -> ([B, T or n, D], this layer's (k, v))."""
    residual = x if span is None else jax.lax.dynamic_slice_in_dim(x, span[0], span[1], axis=1)
    attn, kv = self.self_attn(self.input_layernorm(x), cos, sin, kernel, aux, span)
    x = residual + attn
    return x + self.mlp(self.post_attention_layernorm(x)), kv


def _apply_layer(layer: DecoderLayer, x: Array, cos: Array, sin: Array, aux: Any,
                 span_start: Array | int, kernel: Any, span_length: int | None):
  span = None if span_length is None else (span_start, span_length)
  return layer(x, cos, sin, kernel, aux, span)


# graph_updates=False: as LLaDA's (models/llada/model.py), usable inside a sampler's loops.
_apply_layer_remat = nnx.remat(_apply_layer, static_argnums=(6, 7), graph_updates=False)


@flax.struct.dataclass
class KVCache:
  """Keys and values of the finished blocks, one entry per layer.

  Attributes:
    keys: per layer [B, S, K, hd] rotated, normed keys (compute dtype).
    values: per layer [B, S, K, hd].
    key_mask: [B, S] bool, False for padding positions (never attended to).
    length: int32 scalar; positions [0, length) are filled.
  """

  keys: tuple[Array, ...]
  values: tuple[Array, ...]
  key_mask: Array
  length: Array


class SDAR(qwen.QwenModel):
  """The SDAR block diffusion transformer (``qwen.QwenModel``'s parameters).

  Args:
    config: shapes, special tokens, block size and dtypes.
    rngs: parameter initialization keys (`nnx.Rngs(seed)`).
  """

  layer_cls = DecoderLayer

  # -- the layer stack ------------------------------------------------------

  def _stack(self, x: Array, cos: Array, sin: Array, kernel: Any, auxes: list[Any], *,
             last_span: tuple[Array | int, int] | None = None,
             keep_kv: bool = True) -> tuple[Array, list]:
    """Runs every layer; the last one on `last_span` only. Returns (x, per-layer (k, v)).

    Without `keep_kv`, and with `scan_layers` (then auxes[:-1] must all be auxes[0]), the layers
    but the last run as one scan (`models/scan.py`) and only the last layer's (k, v) is returned.
    """
    kvs = []
    x = constrain(x, ("batch", None, None))
    apply = _apply_layer_remat if self.config.remat else _apply_layer
    count = len(self.layers)
    start = 0
    if self.config.scan_layers and not keep_kv and count > 1:
      aux = auxes[0]
      x = scan_lib.scan_layers(
          self.layers[:-1], x,
          lambda layer, x: constrain(layer(x, cos, sin, kernel, aux)[0], ("batch", None, None)),
          remat=self.config.remat)
      start = count - 1
    for i, layer in enumerate(self.layers):
      if i < start:
        continue
      span_start, span_length = (0, None)
      if i == count - 1 and last_span is not None:
        span_start, span_length = last_span[0], int(last_span[1])
      x, kv = apply(layer, x, cos, sin, auxes[i], span_start, kernel, span_length)
      # Rows stay split over the batch's mesh axes (see `sharding.constrain`): otherwise GSPMD
      # may split the model dimension instead and compute every row on every device.
      x = constrain(x, ("batch", None, None))
      kvs.append(kv)
    return x, kvs

  def _rotary(self, positions: Array) -> tuple[Array, Array]:
    return layers.rotary_angles_at(positions, self.config.head_dim, self.config.rope_theta)

  # -- plain block-causal use -----------------------------------------------

  def encode(self, tokens: Array, attention_mask: Array | None = None, *,
             span: tuple[Array | int, int] | None = None) -> Array:
    """Final hidden states (after `norm`) under block-causal attention.

    Args:
      tokens: [B, L] int token ids; position i is in block i // block_size.
      attention_mask: [B, L] bool, True for real tokens; padding keys get no attention weight.
      span: (start, n), n static: return positions start..start+n-1 only; the last layer then
        computes only those queries (the same values as slicing the full result).

    Returns:
      [B, L, D] (or [B, n, D] with span) in the compute dtype.
    """
    chex.assert_rank(tokens, 2)
    length = tokens.shape[1]
    key_mask = None if attention_mask is None else attention_mask.astype(bool)
    positions = jnp.arange(length)
    cos, sin = self._rotary(positions)
    kernel = _BlockCausal(self.config.block_size, self.config.dtype, self.config.attention)
    auxes = [(positions, positions, key_mask)] * len(self.layers)
    if span is not None:
      _check_kernel_span(self.config, span)
      auxes[-1] = (span[0] + jnp.arange(span[1]), positions, key_mask)
    x, _ = self._stack(self.embed_tokens(tokens), cos, sin, kernel, auxes, last_span=span,
                       keep_kv=False)
    return self.norm(x)

  def unembed(self, hidden: Array) -> Array:
    """hidden: [..., D] -> logits [..., vocab_size] in `config.logits_dtype`."""
    return self.lm_head(hidden, out_dtype=self.config.logits_dtype)

  def __call__(self, tokens: Array, attention_mask: Array | None = None) -> Array:
    """tokens: [B, L] int -> logits [B, L, vocab_size], block-causal (see `encode`)."""
    return constrain(self.unembed(self.encode(tokens, attention_mask)), ("batch", None, "vocab"))

  # -- the staircase layout -------------------------------------------------

  def staircase_encode(self, noisy: Array, clean: Array, attention_mask: Array | None = None, *,
                       impl: str = "split", batch_major: bool = False) -> Array:
    """Final hidden states (after `norm`) of the noisy streams of [x_t^1 ; ... ; x_t^R ; x_0].

    Noisy block k sees itself and the clean blocks < k; the clean stream is block-causal and
    shared by the R noisy streams (`staircase.py`). Split from `staircase` as `encode` is from
    `__call__`, so that a caller can unembed in chunks instead of materializing [R, B, n, V].

    Args:
      noisy: [B, n] or [R, B, n] int, x_t (masked positions hold mask_token_id).
      clean: [B, n] int, x_0. n must be a multiple of block_size.
      attention_mask: [B, n] bool, False for padding positions (of every stream), or None.
      impl: 'split' (no (R+1)n x (R+1)n array; the default) or 'dense' (the dense mask).
      batch_major: return [B, R * n, D] (stream r at [r n, (r + 1) n)) instead.

    Returns:
      [B, n, D] for noisy [B, n], or [R, B, n, D] for noisy [R, B, n], in the compute dtype.
    """
    squeeze = noisy.ndim == 2
    if squeeze:
      noisy = noisy[None]
    chex.assert_rank([noisy, clean], [3, 2])
    chex.assert_equal_shape([noisy[0], clean])
    if impl not in staircase_lib.STAIRCASE_IMPLS:
      raise ValueError(f"impl must be one of {sorted(staircase_lib.STAIRCASE_IMPLS)}, got {impl!r}")
    r, b, n = noisy.shape
    if n % self.config.block_size:
      raise ValueError(f"the sequence length ({n}) must be a multiple of block_size "
                       f"({self.config.block_size})")
    key_mask = None if attention_mask is None else attention_mask.astype(bool)
    streams = jnp.concatenate([jnp.transpose(noisy, (1, 0, 2)).reshape(b, r * n), clean], axis=1)
    cos, sin = self._rotary(jnp.tile(jnp.arange(n), r + 1))
    kernel = _Staircase(r, self.config.block_size, impl, self.config.dtype,
                        self.config.attention)
    x, _ = self._stack(self.embed_tokens(streams), cos, sin, kernel, [key_mask] * len(self.layers),
                       keep_kv=False)
    hidden = self.norm(x[:, :r * n])
    if batch_major:  # [B, R n, D]: rows that stay split over the batch when flattened.
      return hidden
    hidden = constrain(jnp.transpose(hidden.reshape(b, r, n, -1), (1, 0, 2, 3)),
                       (None, "batch", None, None))
    return hidden[0] if squeeze else hidden

  def staircase(self, noisy: Array, clean: Array, attention_mask: Array | None = None, *,
                impl: str = "split") -> Array:
    """Logits of the noisy streams of [x_t^1 ; ... ; x_t^R ; x_0] in one pass.

    The logits of noisy block k equal those of block k of
    `model(concat(clean blocks < k, noisy block k))`. Arguments as in `staircase_encode`.

    Returns:
      logits [B, n, V] for noisy [B, n], or [R, B, n, V] for noisy [R, B, n].
    """
    squeeze = noisy.ndim == 2
    streams = noisy[None] if squeeze else noisy
    # The head runs on batch-major rows: flattening [R, B, n, D] puts the split batch axis
    # second, and GSPMD then splits the model dimension instead, every device computing (and
    # all-reducing) every row's [n, V] logits.
    hidden = self.staircase_encode(streams, clean, attention_mask, impl=impl, batch_major=True)
    r, b, n = streams.shape
    logits = constrain(self.unembed(hidden), ("batch", None, "vocab"))
    logits = constrain(jnp.transpose(logits.reshape(b, r, n, -1), (1, 0, 2, 3)),
                       (None, "batch", None, "vocab"))
    return logits[0] if squeeze else logits

  # -- cached decoding ------------------------------------------------------

  def init_cache(self, batch: int, max_length: int, key_mask: Array | None = None) -> KVCache:
    """An empty cache for `max_length` positions; key_mask [B, max_length] marks padding."""
    c = self.config
    shape = (batch, max_length, c.num_key_value_heads, c.head_dim)
    zeros = tuple(jnp.zeros(shape, c.dtype) for _ in range(c.num_hidden_layers))
    if key_mask is None:
      key_mask = jnp.ones((batch, max_length), bool)
    chex.assert_shape(key_mask, (batch, max_length))
    return KVCache(keys=zeros, values=zeros, key_mask=key_mask.astype(bool),
                   length=jnp.zeros((), jnp.int32))

  def extend(self, tokens: Array, cache: KVCache, *, commit: bool) -> tuple[Array, KVCache]:
    """Hidden states of m new tokens at positions cache.length..+m-1, reading the cache.

    The new tokens see every cached position (earlier blocks) and each other block-causally, so
    the result equals `encode` of the whole sequence at those positions when the cache holds the
    keys of the earlier positions (prefill and committed blocks).

    Args:
      tokens: [B, m] int, m static (a prompt prefill, or one block).
      cache: the cache; cache.length must be a multiple of block_size.
      commit: write the new keys and values at [length, length + m) and advance length.

    Returns:
      (hidden [B, m, D] after `norm`, the cache (updated if commit)).
    """
    chex.assert_rank(tokens, 2)
    m = tokens.shape[1]
    start = cache.length
    positions = start + jnp.arange(m)
    cos, sin = self._rotary(positions)
    size = cache.key_mask.shape[1]
    cache_visible = cache.key_mask & (jnp.arange(size) < start)[None, :]
    new_mask = jax.lax.dynamic_slice_in_dim(cache.key_mask, start, m, axis=1)
    auxes = [(cache.keys[i], cache.values[i], cache_visible, positions, new_mask)
             for i in range(len(self.layers))]
    kernel = _Cached(self.config.block_size, self.config.dtype, self.config.attention)
    x, kvs = self._stack(self.embed_tokens(tokens), cos, sin, kernel, auxes)
    if commit:
      keys = tuple(jax.lax.dynamic_update_slice_in_dim(cache.keys[i], k.astype(cache.keys[i].dtype),
                                                       start, axis=1)
                   for i, (k, _) in enumerate(kvs))
      values = tuple(jax.lax.dynamic_update_slice_in_dim(cache.values[i],
                                                         v.astype(cache.values[i].dtype),
                                                         start, axis=1)
                     for i, (_, v) in enumerate(kvs))
      cache = cache.replace(keys=keys, values=values, length=start + m)
    return self.norm(x), cache
