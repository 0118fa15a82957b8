"""Transformer layers: Linear, Embed, RMSNorm, rotary embeddings, SwiGLU MLP, attention.

LLaDA (`llada.py`) and SDAR (`sdar.py`) are built from these; `dot_product_attention` is the
softmax-attention math both use (SDAR's attention layer adds q/k norms and its own masks).

Every parameter is an `nnx.Param` whose `out_sharding` metadata holds *logical* axis names, one
per array dimension (see `sharding.py` for the names and the default rules that map them to the
mesh axes ('data', 'fsdp', 'tensor')). The annotations are created with `eager_sharding=False`,
so a model can be built without a mesh (CPU tests); the trainer places the parameters with
`sharding.param_shardings` (or `nnx.get_partition_spec` under `flax.linen.logical_axis_rules`).

Parameters are stored in `param_dtype` and cast to the compute `dtype` at use; normalization
statistics, rotary embeddings and the attention softmax are computed in float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

Array = jax.Array

# Logical axis names (see sharding.py).
AX_VOCAB, AX_EMBED, AX_MLP, AX_HEADS, AX_KV_HEADS, AX_NORM = (
    "vocab", "embed", "mlp", "heads", "kv_heads", "norm")


def check_config(config: Any, *, integers: tuple[str, ...], head_dim: Any, token_limit: str
                 ) -> None:
  """The checks every model config shares (in its ``__post_init__``); ValueError naming the
  config class and field: ``integers`` positive integers, then an even head_dim
  (``head_dim(config)``, for rotary embeddings), the mask and EOS ids in [0, the
  ``token_limit`` field), positive rope_theta and rms_norm_eps; the dtype fields are converted to
  floating dtypes; ``attention`` is one of ATTENTION_IMPLS."""
  cls = type(config).__name__
  for name in integers:
    value = getattr(config, name)
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
      raise ValueError(f"{cls}.{name} must be a positive integer, got {value!r}")
  if head_dim(config) % 2:
    raise ValueError(f"{cls}.head_dim ({head_dim(config)}) must be even for rotary embeddings")
  for name in ("mask_token_id", "eos_token_id"):
    value = getattr(config, name)
    if not 0 <= value < getattr(config, token_limit):
      raise ValueError(f"{cls}.{name} ({value}) must lie in [0, {token_limit})")
  for name in ("rope_theta", "rms_norm_eps"):
    if not getattr(config, name) > 0:
      raise ValueError(f"{cls}.{name} must be > 0, got {getattr(config, name)}")
  for name in ("param_dtype", "dtype", "logits_dtype"):
    object.__setattr__(config, name, float_dtype(getattr(config, name), f"{cls}.{name}"))
  check_attention(config)


def float_dtype(value: Any, field: str):
  """A model config's dtype field as a floating dtype; ValueError naming ``field`` otherwise."""
  try:
    dtype = jnp.dtype(value)
  except TypeError as err:
    raise ValueError(f"{field}: {value!r} is not a dtype") from err
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{field} must be a floating dtype, got {dtype}")
  return dtype


def annotated_param(key: Array, shape: tuple[int, ...], *, std: float | None, dtype: Any,
                    axes: tuple[str, ...]) -> nnx.Param:
  """A parameter ~ N(0, std^2) truncated at 3 std (ones if std is None), with axis names."""
  if len(axes) != len(shape):
    raise ValueError(f"{len(axes)} axis names {axes} for a parameter of shape {shape}")
  if std is None:
    value = jnp.ones(shape, dtype)
  else:
    value = std * jax.random.truncated_normal(key, -3.0, 3.0, shape, jnp.float32)
    value = value.astype(dtype)
  return nnx.Param(value, out_sharding=axes, eager_sharding=False)


# A frozen kernel's quantized storage (``model.lora.base_dtype``; docs/training.md, "LoRA"): the
# qwix types, and the tile of input features that shares one scale (4-bit: bitsandbytes' NF4
# block of 64 weights; int8: one scale per output column).
QUANTIZED = {"int8": ("int8", None), "int4": (jnp.int4, 64), "nf4": ("nf4", 64)}
_PACKED = {jnp.dtype(jnp.int4): jnp.int8, jnp.dtype(jnp.uint4): jnp.uint8}


class QuantScale(nnx.Param):
  """A `QuantizedKernel`'s scales: float32, whatever the base's storage dtype."""


class QuantizedKernel(nnx.Module):
  """A frozen kernel [in, out] stored quantized by qwix: ``qvalue`` (int8 [in, out]; 4-bit values
  packed two to a byte, [in, out / 2]) and ``scale`` [in / tile, out] (float32). Both are
  ``nnx.Param``s of the frozen base (never differentiated: only adapters train on one)."""

  def __init__(self, kernel: Array, qtype: str, axes: tuple[str, str]):
    import qwix  # pylint: disable=g-import-not-at-top
    if qtype not in QUANTIZED:
      raise ValueError(f"quantized storage {qtype!r} is not one of {sorted(QUANTIZED)}")
    kind, tile = QUANTIZED[qtype]
    tile = tile if tile and kernel.shape[0] % tile == 0 else None
    q = qwix.quantize(kernel.astype(jnp.float32), kind, channelwise_axes=(1,),
                      tiled_axes={0: tile} if tile else {})
    value = q.qvalue
    if jnp.dtype(value.dtype) in _PACKED:
      value = jax.lax.bitcast_convert_type(value.reshape(value.shape[0], -1, 2),
                                           _PACKED[jnp.dtype(value.dtype)])
    self.qtype = qtype
    self.unpacked = str(jnp.dtype(q.qvalue.dtype))
    self.qvalue = nnx.Param(value, out_sharding=axes, eager_sharding=False)
    self.scale = QuantScale(q.scale.astype(jnp.float32), out_sharding=(None, axes[1]),
                           eager_sharding=False)

  @property
  def shape(self) -> tuple[int, int]:
    rows, cols = self.qvalue.shape
    return rows, cols * (2 if self.unpacked in ("int4", "uint4") else 1)

  def qarray(self, dtype: Any):
    import qwix  # pylint: disable=g-import-not-at-top
    value = self.qvalue[...]
    if self.unpacked != str(value.dtype):
      value = jax.lax.bitcast_convert_type(value, jnp.dtype(self.unpacked)).reshape(self.shape)
    return qwix.QArray(value, self.scale[...].astype(dtype), zero_point=None,
                       qtype=QUANTIZED[self.qtype][0])

  def dot(self, rows: Array, dtype: Any, out_dtype: Any) -> Array:
    """rows [N, in] @ the kernel, [N, out] in ``out_dtype``."""
    import qwix  # pylint: disable=g-import-not-at-top
    return qwix.dot_general(rows, self.qarray(dtype), (((1,), (0,)), ((), ())),
                            preferred_element_type=out_dtype).astype(out_dtype)

  def dequantized(self) -> Array:
    """The kernel the quantized values stand for, [in, out] float32."""
    import qwix  # pylint: disable=g-import-not-at-top
    return qwix.dequantize(self.qarray(jnp.float32)).astype(jnp.float32)


class Linear(nnx.Module):
  """y = x @ kernel (+ its LoRA adapter's term), no bias. kernel: [in, out] (the transpose of a
  torch Linear weight), or a frozen `QuantizedKernel` (``lora.store_base``). ``lora``: None, or a
  ``models.lora.Adapter`` (``lora.add_adapters``)."""

  def __init__(self, in_features: int, out_features: int, *, axes: tuple[str, str], std: float,
               dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
    self.kernel = annotated_param(rngs.params(), (in_features, out_features), std=std,
                                  dtype=param_dtype, axes=axes)
    self.dtype = dtype
    self.lora = nnx.data(None)  # A data attribute: an adapter may be set later.

  def __call__(self, x: Array, out_dtype: Any = None) -> Array:
    """x: [..., in] -> [..., out] in `out_dtype` (default: the compute dtype)."""
    rows = x.reshape(-1, x.shape[-1]).astype(self.dtype)
    if isinstance(self.kernel, QuantizedKernel):  # A frozen quantized base (QLoRA).
      y = self.kernel.dot(rows, self.dtype, out_dtype or self.dtype)
      if self.lora is not None:
        y = y + self.lora(rows, self.dtype, y.dtype)
      return y.reshape(x.shape[:-1] + (self.kernel.shape[-1],))
    kernel = self.kernel[...].astype(self.dtype)
    # One 2-d product [rows, in] @ [in, out]. Written over [B, L, in] instead, the weight gradient
    # contracts two dimensions (B and L), and XLA's CPU backend then materializes a transposed
    # copy of the output gradient (fused with its producer, e.g. the SwiGLU backward) before
    # every such product: a third of the train step's time on the `small` config.
    y = jnp.dot(rows, kernel, preferred_element_type=out_dtype or self.dtype)
    if self.lora is not None:
      y = y + self.lora(rows, self.dtype, y.dtype)
    return y.reshape(x.shape[:-1] + (kernel.shape[-1],))


class Embed(nnx.Module):
  """Token embedding table: embedding [num_embeddings, features]."""

  def __init__(self, num_embeddings: int, features: int, *, std: float, dtype: Any,
               param_dtype: Any, rngs: nnx.Rngs):
    self.embedding = annotated_param(rngs.params(), (num_embeddings, features), std=std,
                                     dtype=param_dtype, axes=(AX_VOCAB, AX_EMBED))
    self.dtype = dtype

  def __call__(self, tokens: Array) -> Array:
    """tokens: [B, L] int -> [B, L, D]."""
    return jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)


class RMSNorm(nnx.Module):
  """x / sqrt(mean(x^2) + eps) in float32, cast back to the compute dtype, times a learned scale."""

  def __init__(self, features: int, *, eps: float, dtype: Any, param_dtype: Any):
    self.weight = annotated_param(None, (features,), std=None, dtype=param_dtype,
                                  axes=(AX_NORM,))
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x: Array) -> Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    return normed.astype(self.dtype) * self.weight[...].astype(self.dtype)


def rotary_angles(length: int, head_dim: int, theta: float) -> tuple[Array, Array]:
  """cos, sin: [L, head_dim] float32 for positions 0..L-1, rotate-half layout.

  inv_freq_j = theta^(-2j / head_dim), j < head_dim / 2; angle = position * inv_freq, repeated
  for both halves of the head dimension.
  """
  return rotary_angles_at(jnp.arange(length), head_dim, theta)


def rotary_angles_at(positions: Array, head_dim: int, theta: float) -> tuple[Array, Array]:
  """cos, sin: [L, head_dim] float32 for the given positions [L] (int, may be traced)."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles = jnp.asarray(positions).astype(jnp.float32)[:, None] * inv_freq[None, :]
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: Array, cos: Array, sin: Array) -> Array:
  """x: [B, L, N, head_dim] -> x * cos + rotate_half(x) * sin, computed in float32."""
  x32 = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  out = x32 * cos[None, :, None, :] + rotated * sin[None, :, None, :]
  return out.astype(x.dtype)


def query_span(x: Array, cos: Array, sin: Array,
               span: tuple[Array | int, int] | None) -> tuple[Array, Array, Array]:
  """The queries' inputs and rotary angles: all positions, or the n of span = (start, n).

  x: [B, L, D], cos / sin: [L, hd] -> [B, n, D], [n, hd], [n, hd].
  """
  if span is None:
    return x, cos, sin
  start, length = span
  return (jax.lax.dynamic_slice_in_dim(x, start, length, axis=1),
          jax.lax.dynamic_slice_in_dim(cos, start, length, axis=0),
          jax.lax.dynamic_slice_in_dim(sin, start, length, axis=0))


class MLP(nnx.Module):
  """SwiGLU: ff_out(silu(ff_proj(x)) * up_proj(x))."""

  def __init__(self, d_model: int, hidden: int, *, out_std: float, dtype: Any, param_dtype: Any,
               rngs: nnx.Rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.ff_proj = Linear(d_model, hidden, axes=(AX_EMBED, AX_MLP), std=d_model**-0.5, **kw)
    self.up_proj = Linear(d_model, hidden, axes=(AX_EMBED, AX_MLP), std=d_model**-0.5, **kw)
    self.ff_out = Linear(hidden, d_model, axes=(AX_MLP, AX_EMBED), std=out_std, **kw)

  def __call__(self, x: Array) -> Array:
    return self.ff_out(jax.nn.silu(self.ff_proj(x)) * self.up_proj(x))


class Attention(nnx.Module):
  """Bidirectional multi-head attention with grouped-query support and RoPE on q and k.

  q_proj: [D, H * hd], k_proj / v_proj: [D, K * hd], attn_out: [H * hd, D]. Query head h uses
  key/value head h // (H / K), as torch's repeat_kv does. Scores are q.k / sqrt(hd), accumulated
  and soft-maxed in float32; keys where `key_mask` is False get zero weight.
  """

  def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, *, out_std: float, dtype: Any,
               param_dtype: Any, rngs: nnx.Rngs, attention: str = "xla"):
    self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
    self.attention = attention  # model.attention (`attention_impl`)
    self.head_dim = d_model // n_heads
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    std = d_model**-0.5
    q_width, kv_width = n_heads * self.head_dim, n_kv_heads * self.head_dim
    self.q_proj = Linear(d_model, q_width, axes=(AX_EMBED, AX_HEADS), std=std, **kw)
    self.k_proj = Linear(d_model, kv_width, axes=(AX_EMBED, AX_KV_HEADS), std=std, **kw)
    self.v_proj = Linear(d_model, kv_width, axes=(AX_EMBED, AX_KV_HEADS), std=std, **kw)
    self.attn_out = Linear(q_width, d_model, axes=(AX_HEADS, AX_EMBED), std=out_std, **kw)
    self.dtype = dtype

  def _queries(self, xq: Array, cos_q: Array, sin_q: Array) -> Array:
    b, length = xq.shape[:2]
    q = apply_rotary(self.q_proj(xq).reshape(b, length, self.n_heads, self.head_dim), cos_q, sin_q)
    return q.reshape(b, length, self.n_kv_heads, self.n_heads // self.n_kv_heads, self.head_dim)

  def _keys_values(self, x: Array, cos: Array, sin: Array) -> tuple[Array, Array]:
    """Rotated keys and values of x [B, n, D]: [B, n, K, hd] each."""
    b, length = x.shape[:2]
    k = self.k_proj(x).reshape(b, length, self.n_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(b, length, self.n_kv_heads, self.head_dim)
    return apply_rotary(k, cos, sin), v

  def __call__(self, x: Array, cos: Array, sin: Array, key_mask: Array | None,
               span: tuple[Array | int, int] | None = None, *,
               return_kv: bool = False) -> Array | tuple[Array, tuple[Array, Array]]:
    """x: [B, L, D]; cos, sin: [L, hd]; key_mask: [B, L] bool or None -> [B, L, D].

    With span = (start, n), only the queries at positions start..start+n-1 are computed (keys and
    values still cover every position) and the output is [B, n, D]. ``return_kv``: also the
    rotated keys and values of every position, [B, L, K, hd] each (a KV cache, ``cached``).
    """
    b = x.shape[0]
    xq, cos_q, sin_q = query_span(x, cos, sin, span)
    length = xq.shape[1]
    # Queries first: the order the ops had before the KV cache existed, which XLA's CPU fusion
    # follows; another order reassociates float sums and moves every trained result slightly.
    q = self._queries(xq, cos_q, sin_q)
    k, v = self._keys_values(x, cos, sin)
    impl = attention_impl(self.attention, self.dtype)
    if impl == "xla":
      mask = None if key_mask is None else key_mask[:, None, :]
      out = dot_product_attention(q, k, v, mask, dtype=self.dtype)
    else:
      query_keep = key_mask if key_mask is None or span is None else (
          jax.lax.dynamic_slice_in_dim(key_mask, span[0], length, axis=1))
      out = kernel_attention(q, k, v, impl=impl, allowed=None, key_keep=key_mask,
                             query_keep=query_keep, dtype=self.dtype)
    out = self.attn_out(out.reshape(b, length, self.n_heads * self.head_dim))
    return (out, (k, v)) if return_kv else out

  def cached(self, xq: Array, cos_q: Array, sin_q: Array, key_mask: Array | None,
             cache: tuple[Array, Array], start: Array | int, fresh_from: Array | int) -> Array:
    """Attention of the n positions start..start+n-1 over a KV cache of all L positions.

    Args:
      xq: [B, n, D], the inputs at those positions; cos_q, sin_q: [n, hd], their angles.
      key_mask: [B, L] bool or None.
      cache: keys and values [B, L, K, hd] of every position (``return_kv``).
      start: the first query position (int or traced).
      fresh_from: positions >= fresh_from among the queries' attend to (and are attended with)
        keys and values computed now from xq; every other position keeps the cache's.

    Returns:
      [B, n, D].
    """
    b, length = xq.shape[:2]
    k_new, v_new = self._keys_values(xq, cos_q, sin_q)
    fresh = (start + jnp.arange(length) >= fresh_from)[None, :, None, None]

    def merged(cached: Array, new: Array) -> Array:
      old = jax.lax.dynamic_slice_in_dim(cached, start, length, axis=1)
      return jax.lax.dynamic_update_slice_in_dim(
          cached, jnp.where(fresh, new.astype(cached.dtype), old), start, axis=1)

    k, v = merged(cache[0], k_new), merged(cache[1], v_new)
    impl = attention_impl(self.attention, self.dtype, cached=True, head_dim=self.head_dim)
    if impl == "xla":
      mask = None if key_mask is None else key_mask[:, None, :]
      out = dot_product_attention(self._queries(xq, cos_q, sin_q), k, v, mask, dtype=self.dtype)
    else:
      query_keep = None if key_mask is None else jax.lax.dynamic_slice_in_dim(
          key_mask, start, length, axis=1)
      out = kernel_attention(self._queries(xq, cos_q, sin_q), k, v, impl=impl, allowed=None,
                             key_keep=key_mask, query_keep=query_keep, dtype=self.dtype)
    return self.attn_out(out.reshape(b, length, self.n_heads * self.head_dim))


def dot_product_attention(q: Array, k: Array, v: Array, mask: Array | None, *,
                          dtype: Any) -> Array:
  """Grouped-query softmax attention; the math shared by the LLaDA and SDAR attention layers.

  Args:
    q: [B, T, K, G, hd] queries, already rotated (query head h = k * G + g reads kv head k).
    k: [B, S, K, hd] rotated keys.
    v: [B, S, K, hd] values.
    mask: bool, broadcastable to [B, T, S] (True: the query may attend to the key), or None.
    dtype: compute dtype of the probabilities and the output.

  Returns:
    [B, T, K, G, hd]. Scores q.k / sqrt(hd) are accumulated and soft-maxed in float32; masked
    keys get the score finfo(float32).min, hence exactly zero weight.
  """
  b, t, kv_heads, groups, head_dim = q.shape
  s = k.shape[1]
  # Canonical batched-matmul layouts ([B, K, G*T, hd] @ [B, K, hd, S]): XLA's CPU backend runs
  # these about 2x faster than the same contraction written as one 5-d einsum.
  q_rows = jnp.transpose(q, (0, 2, 3, 1, 4)).reshape(b, kv_heads, groups * t, head_dim)
  k_cols = jnp.transpose(k, (0, 2, 3, 1))  # [B, K, hd, S]
  scores = jnp.matmul(q_rows, k_cols, preferred_element_type=jnp.float32)
  scores = scores.reshape(b, kv_heads, groups, t, s) * (head_dim**-0.5)
  if mask is not None:
    mask = jnp.broadcast_to(mask, (b, t, s))
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  out = jnp.matmul(probs.reshape(b, kv_heads, groups * t, s),
                   jnp.transpose(v, (0, 2, 1, 3)).astype(dtype))  # [B, K, G*T, hd]
  return jnp.transpose(out.reshape(b, kv_heads, groups, t, head_dim), (0, 3, 1, 2, 4))


# ---------------------------------------------------------------------------
# Attention kernels for accelerators: model.attention = auto | xla | splash | cudnn.
# ---------------------------------------------------------------------------

ATTENTION_IMPLS = ("auto", "xla", "splash", "cudnn")
# The one default (the model configs' `attention` field; config_lib's model.attention '' keeps
# it): the platform's kernel by measurement (`attention_impl`), else "xla".
DEFAULT_ATTENTION = "auto"
# Splash attention's tiles: the sequence axes are padded to multiples of this (block_q and
# block_kv must be multiples of 128 on TPU).
SPLASH_TILE = 128


def check_attention(config: Any) -> None:
  """``config.attention`` is one of ATTENTION_IMPLS; else a ValueError naming model.attention.
  (A config class without the field, a plugin's, has nothing to check.)"""
  value = getattr(config, "attention", "xla")
  if value not in ATTENTION_IMPLS:
    raise ValueError(f"model.attention: {value!r} is not one of {', '.join(ATTENTION_IMPLS)} "
                     f"({type(config).__name__}.attention)")


def target_platform() -> str:
  """The platform the computation being traced is for: that of the abstract mesh in context
  (the trainer and the samplers trace under their mesh's, which may be TPU devices compiled
  for from a CPU host), else JAX's default backend."""
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else getattr(mesh, "abstract_device", None)
  return device.platform if device is not None else jax.default_backend()


def attention_impl(name: str, dtype: Any, *, cached: bool = False,
                   head_dim: int | None = None) -> str:
  """The kernel ``model.attention = name`` runs for a compute ``dtype``: 'xla', 'splash' or
  'cudnn'.

  'auto' is, on TPU, a rule drawn from the TPU compiler's bytes (docs/performance.md,
  "Attention kernel", from ``experiments/attention_choice.py``; the cases it gets wrong are
  listed there): splash, except in a call over a KV cache (``cached``: a block of queries over
  every position, LLaDA's prefix and dual caches, SDAR's sampler) whose ``head_dim`` does not
  fill the TPU's 128 lanes, where splash's padded layouts of the whole cache cost more than the
  scores it saves (xla is chosen there). On GPU cudnn for bfloat16 / float16 compute (cuDNN's
  flash attention takes no float32); else xla (the CPU default).
  """
  if name != "auto":
    return name
  platform = target_platform()
  if platform == "tpu":
    lanes_padded = head_dim is None or head_dim % SPLASH_TILE != 0
    return "xla" if cached and lanes_padded else "splash"
  if platform in ("gpu", "cuda") and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
    return "cudnn"
  return "xla"


def kernel_attention(q: Array, k: Array, v: Array, *, impl: str, allowed: np.ndarray | None,
                     key_keep: Array | None, query_keep: Array | None, dtype: Any) -> Array:
  """`dot_product_attention` by an accelerator kernel, for a mask given by its parts.

  The mask is ``allowed[t, s] & key_keep[b, s]``: a static pattern (block-causal, staircase,
  ...) and per-row key padding.

  Args:
    q: [B, T, K, G, hd] rotated queries (query head h = k * G + g reads kv head k).
    k, v: [B, S, K, hd].
    impl: 'splash' (Pallas TPU; interpreted on other platforms) or 'cudnn'.
    allowed: [T, S] numpy bool (None: every key), known at trace time.
    key_keep: [B, S] bool, False for keys no query may see (padding), or None.
    query_keep: [B, T] bool, the queries' own entries of key_keep (splash only): a query with
      False (a padding position, whose output nothing reads) attends to the masked keys instead,
      so that no row of the kernel is empty. None: every query is kept.
    dtype: compute dtype of the probabilities and the output.

  Returns:
    [B, T, K, G, hd] in dtype: the values of `dot_product_attention` at every kept query (at a
    padding query splash's differ, as said).
  """
  if impl == "splash":
    return _splash_attention(q, k, v, allowed, key_keep, query_keep, dtype)
  if impl == "cudnn":
    return _jax_nn_attention(q, k, v, allowed, key_keep, dtype, implementation="cudnn")
  raise ValueError(f"model.attention: no kernel {impl!r} (one of splash, cudnn)")


def _jax_nn_attention(q: Array, k: Array, v: Array, allowed: np.ndarray | None,
                      key_keep: Array | None, dtype: Any, *, implementation: str) -> Array:
  """`jax.nn.dot_product_attention` ([B, T, N, hd] layout, the same grouped heads)."""
  b, t, kv_heads, groups, head_dim = q.shape
  if implementation == "cudnn" and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"model.attention='cudnn' needs a bfloat16 or float16 compute dtype "
                     f"(model.dtype), got {jnp.dtype(dtype).name}; use 'xla' or 'auto'")
  mask = None
  if allowed is not None:
    mask = jnp.asarray(allowed)[None, None]
  if key_keep is not None:
    keys = key_keep.astype(bool)[:, None, None, :]
    mask = keys if mask is None else mask & keys
  out = jax.nn.dot_product_attention(
      q.reshape(b, t, kv_heads * groups, head_dim).astype(dtype), k.astype(dtype),
      v.astype(dtype), mask=mask, implementation=implementation)
  return out.reshape(b, t, kv_heads, groups, head_dim).astype(dtype)


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def _splash_block(length: int) -> int:
  """The largest of 512, 256, 128 that divides the padded length (a multiple of 128)."""
  return next(b for b in (512, 256, SPLASH_TILE) if length % b == 0)


def _splash_attention(q: Array, k: Array, v: Array, allowed: np.ndarray | None,
                      key_keep: Array | None, query_keep: Array | None, dtype: Any) -> Array:
  """Pallas TPU splash attention; the sequence axes padded to whole tiles.

  Padding keys are hidden from every real query by the static mask; padding queries see every
  key (their rows are dropped). Key padding of the rows is segment ids: a key's id is 1 where
  key_keep, else 0, and a query's its query_keep: real queries see the kept keys only.
  Under a mesh the kernel runs per device (shard_map over the batch rule's axes and, where the
  kv heads split evenly, 'tensor'), as a custom call XLA cannot partition.
  """
  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu import splash_attention as splash
  from stabledrl_jax.models import sharding as sharding_lib

  b, t, kv_heads, groups, head_dim = q.shape
  s = k.shape[1]
  heads = kv_heads * groups
  t_pad, s_pad = _round_up(t, SPLASH_TILE), _round_up(s, SPLASH_TILE)
  static = np.zeros((t_pad, s_pad), bool)
  static[:t, :s] = True if allowed is None else np.asarray(allowed, bool)
  static[t:, :] = True
  if not static[:t].any(axis=1).all():
    raise ValueError("splash attention: a query row of the static mask sees no key")
  interpret = target_platform() != "tpu"
  block_q, block_kv = _splash_block(t_pad), _splash_block(s_pad)
  block_sizes = splash.BlockSizes(
      block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv, block_q_dkv=block_q,
      block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv, block_q_dq=block_q,
      block_kv_dq=block_kv)

  # [B, H, T, hd] and [B, K, S, hd], q pre-scaled (the kernel does not scale).
  qh = (q.astype(jnp.float32) * head_dim**-0.5).astype(dtype)
  qh = jnp.transpose(qh, (0, 2, 3, 1, 4)).reshape(b, heads, t, head_dim)
  qh = jnp.pad(qh, ((0, 0), (0, 0), (0, t_pad - t), (0, 0)))
  kh, vh = (jnp.pad(jnp.transpose(x.astype(dtype), (0, 2, 1, 3)),
                    ((0, 0), (0, 0), (0, s_pad - s), (0, 0))) for x in (k, v))
  segments = None
  if key_keep is not None:
    keep_q = jnp.ones((b, t), bool) if query_keep is None else query_keep.astype(bool)
    segments = (jnp.pad(keep_q.astype(jnp.int32), ((0, 0), (0, t_pad - t))),
                jnp.pad(key_keep.astype(jnp.int32), ((0, 0), (0, s_pad - s))))

  def attend(qh, kh, vh, segments):
    local_heads = qh.shape[1]
    kernel = splash.make_splash_mha(
        splash.MultiHeadMask([splash.NumpyMask(static)] * local_heads),
        block_sizes=block_sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
    if segments is None:
      return jax.vmap(kernel)(qh, kh, vh)
    return jax.vmap(lambda q1, k1, v1, sq, sk: kernel(
        q1, k1, v1, segment_ids=splash.SegmentIds(sq, sk)))(qh, kh, vh, *segments)

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    out = attend(qh, kh, vh, segments)
  else:
    rows = sharding_lib.partition_spec(("batch",), (b,), mesh)[0]
    tensor = mesh.shape.get("tensor", 1)
    head_axis = "tensor" if tensor > 1 and kv_heads % tensor == 0 else None
    spec = jax.sharding.PartitionSpec(rows, head_axis, None, None)
    row_spec = jax.sharding.PartitionSpec(rows, None)
    seg_specs = None if segments is None else (row_spec, row_spec)
    out = jax.shard_map(attend, mesh=mesh, in_specs=(spec, spec, spec, seg_specs),
                        out_specs=spec, check_vma=False)(qh, kh, vh, segments)
  out = out[:, :, :t].reshape(b, kv_heads, groups, t, head_dim)
  return jnp.transpose(out, (0, 3, 1, 2, 4)).astype(dtype)
