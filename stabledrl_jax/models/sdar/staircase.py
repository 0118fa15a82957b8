"""Block-diffusion attention masks: block-causal, and the staircase layout [x_t ; x_0].

Blocks are fixed by absolute position: position i belongs to block i // block_size, over the whole
sequence (prompt included), as in SDAR. A block diffusion LM factorizes the likelihood over blocks,
log p(z) = sum_k log p(z_k | z_<k), and models each factor by masked diffusion inside the block.

Plain (decoding) attention is *block-causal*: a query in block b sees every key in blocks <= b.

The *staircase* layout scores every block's diffusion term in one pass. Its input is the noisy
sequence x_t (every block partly masked) followed by the clean sequence x_0, both at positions
0..n-1 (the same RoPE positions):

    query \\ key        noisy block j           clean block j
    noisy block b      j == b (own block)      j < b (clean prefix)
    clean block b      never                   j <= b (block-causal)

So noisy block b sees exactly what a plain block-causal pass over [x_0 blocks < b ; x_t block b]
would show it, and the logits of all noisy blocks come out of one pass of length 2n. A noisy token
never sees its own clean copy, nor anything of a later block.

With R Monte Carlo samples of x_t for the same x_0, the input is [x_t^1 ; ... ; x_t^R ; x_0]
(length (R + 1) n): each noisy stream sees only itself and the shared clean stream, so the clean
stream is computed once for the R samples.

Forms of the mask, from the most to the least memory:
  * `staircase_mask`: the dense [(R+1)n, (R+1)n] bool array (tests, short sequences);
  * `segment_ids` + `visible`: two int vectors of length (R+1)n (block and stream of each
    position) from which any entry of the mask is computed on the fly;
  * `staircase_tile_mask`: the mask at block granularity, [(R+1)nb, (R+1)nb] (it is constant on
    every block_size x block_size tile; the dense mask is its Kronecker product with a tile of
    ones);
  * `staircase_attention`: never forms a (R+1)n x (R+1)n array at all. It splits the attention
    into the three visible parts (clean -> clean block-causal [n, n], noisy -> clean prefix [n, n],
    noisy -> own block [n, block_size]) and soft-maxes the noisy queries over their two parts
    jointly. Its score arrays are those of two plain passes of length n, a quarter less compute
    and half the memory of dense attention over 2n positions (R = 1).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stabledrl_jax.models.layers import dot_product_attention

Array = jax.Array


# ---------------------------------------------------------------------------
# Masks.
# ---------------------------------------------------------------------------


def block_causal_mask(q_positions: Array, k_positions: Array, block_size: int) -> Array:
  """[T, S] bool: the query at q_positions[t] may see the key at k_positions[s].

  True iff block(key) <= block(query), blocks being position // block_size. Positions may be
  traced (the cached decoder passes start + arange(block_size)).
  """
  q_blocks = jnp.asarray(q_positions) // block_size
  k_blocks = jnp.asarray(k_positions) // block_size
  return q_blocks[:, None] >= k_blocks[None, :]


def segment_ids(n: int, block_size: int, num_samples: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """Block and stream of each position of [x_t^1 ; ... ; x_t^R ; x_0].

  Returns:
    blocks: [(R + 1) n] int32, block index (position within its stream // block_size).
    streams: [(R + 1) n] int32, r for the noisy stream of sample r (0..R-1), R for the clean one.
  """
  _check_lengths(n, block_size, num_samples)
  blocks = np.tile(np.arange(n, dtype=np.int32) // block_size, num_samples + 1)
  streams = np.repeat(np.arange(num_samples + 1, dtype=np.int32), n)
  return blocks, streams


def visible(q_block, q_stream, k_block, k_stream, clean_stream: int):
  """The staircase rule for broadcastable (block, stream) ids of queries and keys (numpy or jax).

  clean -> clean: k_block <= q_block; noisy -> clean: k_block < q_block; noisy -> noisy: same
  stream and same block; clean -> noisy: never.
  """
  q_clean = q_stream == clean_stream
  k_clean = k_stream == clean_stream
  clean_to_clean = q_clean & k_clean & (k_block <= q_block)
  noisy_to_clean = ~q_clean & k_clean & (k_block < q_block)
  own_block = ~q_clean & ~k_clean & (q_stream == k_stream) & (k_block == q_block)
  return clean_to_clean | noisy_to_clean | own_block


@functools.lru_cache(maxsize=16)
def staircase_mask(n: int, block_size: int, num_samples: int = 1) -> np.ndarray:
  """The dense staircase mask [(R + 1) n, (R + 1) n] bool (read-only; built once per shape)."""
  blocks, streams = segment_ids(n, block_size, num_samples)
  mask = visible(blocks[:, None], streams[:, None], blocks[None, :], streams[None, :],
                 num_samples)
  mask.setflags(write=False)
  return mask


@functools.lru_cache(maxsize=16)
def staircase_tile_mask(num_blocks: int, num_samples: int = 1) -> np.ndarray:
  """The staircase mask at block granularity: [(R + 1) nb, (R + 1) nb] bool (read-only).

  `np.kron(tile_mask, np.ones((block_size, block_size)))` is the dense mask.
  """
  blocks, streams = segment_ids(num_blocks, 1, num_samples)
  mask = visible(blocks[:, None], streams[:, None], blocks[None, :], streams[None, :],
                 num_samples)
  mask.setflags(write=False)
  return mask


def _check_lengths(n: int, block_size: int, num_samples: int) -> None:
  if block_size < 1 or num_samples < 1:
    raise ValueError(f"block_size ({block_size}) and num_samples ({num_samples}) must be >= 1")
  if n < 1 or n % block_size:
    raise ValueError(f"the sequence length ({n}) must be a positive multiple of block_size "
                     f"({block_size})")


# ---------------------------------------------------------------------------
# Staircase attention.
# ---------------------------------------------------------------------------


def staircase_attention(q: Array, k: Array, v: Array, *, num_samples: int, block_size: int,
                        key_mask: Array | None, dtype: Any) -> Array:
  """Attention over [x_t^1 ; ... ; x_t^R ; x_0] under the staircase mask, without a dense mask.

  Args:
    q: [B, (R + 1) n, K, G, hd] rotated queries (query head k * G + g reads kv head k).
    k: [B, (R + 1) n, K, hd] rotated keys.
    v: [B, (R + 1) n, K, hd] values.
    num_samples: R, the number of noisy streams.
    block_size: the diffusion block size (n must be a multiple of it).
    key_mask: [B, n] bool, False for padding positions (in every stream), or None.
    dtype: compute dtype of the probabilities and the output.

  Returns:
    [B, (R + 1) n, K, G, hd], equal (up to float summation order) to `dot_product_attention`
    with `staircase_mask(n, block_size, R)`.
  """
  batch, total, kv_heads, groups, head_dim = q.shape
  r = num_samples
  n = total // (r + 1)
  _check_lengths(n, block_size, r)
  if total != (r + 1) * n:
    raise ValueError(f"{total} positions are not {r + 1} streams of equal length")
  nb = n // block_size
  qn = q[:, :r * n].reshape(batch, r, n, kv_heads, groups, head_dim)
  kn = k[:, :r * n].reshape(batch, r, n, kv_heads, head_dim)
  vn = v[:, :r * n].reshape(batch, r, n, kv_heads, head_dim)
  qc, kc, vc = q[:, r * n:], k[:, r * n:], v[:, r * n:]
  positions = jnp.arange(n)
  keys_ok = jnp.ones((batch, n), bool) if key_mask is None else key_mask.astype(bool)

  # Clean stream: block-causal over the clean keys.
  clean_mask = block_causal_mask(positions, positions, block_size)[None] & keys_ok[:, None, :]
  out_clean = dot_product_attention(qc, kc, vc, clean_mask, dtype=dtype)

  # Noisy streams: the clean prefix (blocks < own) and the own noisy block, one joint softmax.
  scale = head_dim**-0.5
  lowest = jnp.finfo(jnp.float32).min
  prefix = (positions[:, None] // block_size) > (positions[None, :] // block_size)  # [n, n]
  prefix = prefix[None] & keys_ok[:, None, :]  # [B, n, n]
  scores_prefix = jnp.einsum("brtkgh,bskh->brkgts", qn, kc,
                             preferred_element_type=jnp.float32) * scale
  scores_prefix = jnp.where(prefix[:, None, None, None], scores_prefix, lowest)
  qn_blocks = qn.reshape(batch, r, nb, block_size, kv_heads, groups, head_dim)
  kn_blocks = kn.reshape(batch, r, nb, block_size, kv_heads, head_dim)
  vn_blocks = vn.reshape(batch, r, nb, block_size, kv_heads, head_dim)
  scores_own = jnp.einsum("brjtkgh,brjskh->brkgjts", qn_blocks, kn_blocks,
                          preferred_element_type=jnp.float32) * scale
  own_ok = keys_ok.reshape(batch, 1, 1, 1, nb, 1, block_size)
  scores_own = jnp.where(own_ok, scores_own, lowest)
  scores_own = scores_own.reshape(batch, r, kv_heads, groups, n, block_size)
  probs = jax.nn.softmax(jnp.concatenate([scores_prefix, scores_own], axis=-1), axis=-1)
  probs = probs.astype(dtype)
  probs_prefix, probs_own = probs[..., :n], probs[..., n:]
  out_noisy = jnp.einsum("brkgts,bskh->brtkgh", probs_prefix, vc.astype(dtype))
  probs_own = probs_own.reshape(batch, r, kv_heads, groups, nb, block_size, block_size)
  out_own = jnp.einsum("brkgjts,brjskh->brjtkgh", probs_own, vn_blocks.astype(dtype))
  out_noisy = out_noisy + out_own.reshape(batch, r, n, kv_heads, groups, head_dim)
  out_noisy = out_noisy.reshape(batch, r * n, kv_heads, groups, head_dim)
  return jnp.concatenate([out_noisy, out_clean], axis=1)


def dense_staircase_attention(q: Array, k: Array, v: Array, *, num_samples: int, block_size: int,
                              key_mask: Array | None, dtype: Any) -> Array:
  """The same as `staircase_attention` through the dense mask (reference; O(((R+1)n)^2) memory)."""
  batch, total = q.shape[:2]
  n = total // (num_samples + 1)
  mask = jnp.asarray(staircase_mask(n, block_size, num_samples))[None]
  if key_mask is not None:
    keys_ok = jnp.tile(key_mask.astype(bool), (1, num_samples + 1))
    mask = mask & keys_ok[:, None, :]
  return dot_product_attention(q, k, v, jnp.broadcast_to(mask, (batch, total, total)),
                               dtype=dtype)


STAIRCASE_IMPLS = {"split": staircase_attention, "dense": dense_staircase_attention}
