"""Staircase attention masks: the visibility rules, their compact forms, and the split kernel."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stabledrl_jax.models import layers
from stabledrl_jax.models.sdar import staircase


def rule(q, k, n, block_size, num_samples):
  """The staircase rule for positions q, k of [x_t^1 ; ... ; x_t^R ; x_0], spelled out."""
  q_stream, q_pos = divmod(q, n)
  k_stream, k_pos = divmod(k, n)
  q_block, k_block = q_pos // block_size, k_pos // block_size
  q_clean, k_clean = q_stream == num_samples, k_stream == num_samples
  if q_clean:
    return k_clean and k_block <= q_block
  if k_clean:
    return k_block < q_block
  return k_stream == q_stream and k_block == q_block


@pytest.mark.parametrize("n, block_size, num_samples", [(8, 2, 1), (12, 4, 1), (6, 3, 2),
                                                        (4, 1, 1)])
def test_dense_mask_follows_the_rule_table(n, block_size, num_samples):
  mask = staircase.staircase_mask(n, block_size, num_samples)
  size = (num_samples + 1) * n
  assert mask.shape == (size, size) and mask.dtype == bool
  want = np.array([[rule(q, k, n, block_size, num_samples) for k in range(size)]
                   for q in range(size)])
  np.testing.assert_array_equal(mask, want)


@pytest.mark.parametrize("n, block_size, num_samples", [(16, 4, 1), (12, 2, 3)])
def test_noisy_token_never_sees_its_clean_copy_or_a_later_block(n, block_size, num_samples):
  mask = staircase.staircase_mask(n, block_size, num_samples)
  clean = num_samples * n
  for r, i in itertools.product(range(num_samples), range(n)):
    q = r * n + i
    assert not mask[q, clean + i]                      # its own clean copy
    block_end = (i // block_size + 1) * block_size
    assert not mask[q, clean + block_end:].any()       # later clean blocks
    assert not mask[q, r * n + block_end:(r + 1) * n].any()  # later noisy blocks
    others = [s for s in range(num_samples) if s != r]
    assert not any(mask[q, s * n:(s + 1) * n].any() for s in others)  # other samples
    # What it does see: its own noisy block and the clean blocks before it, nothing else.
    start = (i // block_size) * block_size
    assert mask[q, r * n + start:r * n + block_end].all()
    assert mask[q, clean:clean + start].all()
    assert mask[q].sum() == block_size + start
  assert not mask[clean:, :clean].any()  # the clean stream never sees a noisy one


def test_tile_mask_is_the_dense_mask_at_block_granularity():
  n, block_size = 12, 3
  for num_samples in (1, 2):
    tile = staircase.staircase_tile_mask(n // block_size, num_samples)
    np.testing.assert_array_equal(
        np.kron(tile, np.ones((block_size, block_size), bool)).astype(bool),
        staircase.staircase_mask(n, block_size, num_samples))


def test_segment_ids_and_visible_give_any_entry():
  n, block_size, num_samples = 8, 2, 2
  blocks, streams = staircase.segment_ids(n, block_size, num_samples)
  assert blocks.shape == streams.shape == (24,)
  mask = staircase.staircase_mask(n, block_size, num_samples)
  rng = np.random.default_rng(0)
  for q, k in rng.integers(0, 24, size=(50, 2)):
    got = staircase.visible(blocks[q], streams[q], blocks[k], streams[k], num_samples)
    assert got == mask[q, k]


def test_masks_are_built_once_and_read_only():
  a = staircase.staircase_mask(8, 4)
  assert staircase.staircase_mask(8, 4) is a
  with pytest.raises(ValueError):
    a[0, 0] = True


def test_block_causal_mask():
  mask = np.asarray(staircase.block_causal_mask(jnp.arange(6), jnp.arange(6), 2))
  want = np.array([[k // 2 <= q // 2 for k in range(6)] for q in range(6)])
  np.testing.assert_array_equal(mask, want)
  # Traced query positions (the cached decoder): block 2 sees blocks 0..2.
  rows = np.asarray(staircase.block_causal_mask(4 + jnp.arange(2), jnp.arange(8), 2))
  np.testing.assert_array_equal(rows, [[1] * 6 + [0] * 2] * 2)


def test_invalid_lengths_are_rejected():
  with pytest.raises(ValueError, match="multiple of block_size"):
    staircase.staircase_mask(10, 4)
  with pytest.raises(ValueError, match="num_samples"):
    staircase.segment_ids(8, 4, 0)


def _qkv(key, batch, total, kv_heads=2, groups=2, head_dim=8):
  kq, kk, kv = jax.random.split(key, 3)
  q = jax.random.normal(kq, (batch, total, kv_heads, groups, head_dim))
  k = jax.random.normal(kk, (batch, total, kv_heads, head_dim))
  v = jax.random.normal(kv, (batch, total, kv_heads, head_dim))
  return q, k, v


@pytest.mark.parametrize("num_samples", [1, 2])
def test_split_kernel_equals_dense_masked_attention(num_samples):
  n, block_size, batch = 12, 4, 2
  q, k, v = _qkv(jax.random.key(0), batch, (num_samples + 1) * n)
  key_mask = jnp.ones((batch, n), bool).at[1, :3].set(False)  # row 1: 3 left-padding positions
  kw = dict(num_samples=num_samples, block_size=block_size, key_mask=key_mask,
            dtype=jnp.float32)
  got = staircase.staircase_attention(q, k, v, **kw)
  want = staircase.dense_staircase_attention(q, k, v, **kw)
  # And against the generic kernel with the mask built here from the rule table.
  size = (num_samples + 1) * n
  table = np.array([[rule(a, b, n, block_size, num_samples) for b in range(size)]
                    for a in range(size)])
  keys_ok = np.tile(np.asarray(key_mask), (1, num_samples + 1))
  direct = layers.dot_product_attention(q, k, v, table[None] & keys_ok[:, None, :],
                                        dtype=jnp.float32)
  np.testing.assert_allclose(want, direct, rtol=1e-6, atol=1e-6)
  # Padding queries (row 1, positions 0-2 of every stream) see nothing real; compare the rest.
  real = np.tile(np.asarray(key_mask), (1, num_samples + 1))
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got)[0], np.asarray(want)[0], rtol=1e-5, atol=1e-5)


def test_split_kernel_never_forms_a_2n_by_2n_array():
  n, block_size, batch = 64, 4, 1
  q, k, v = _qkv(jax.random.key(1), batch, 2 * n)
  kw = dict(num_samples=1, block_size=block_size, key_mask=None, dtype=jnp.float32)

  def largest(fn):
    jaxpr = jax.make_jaxpr(lambda q, k, v: fn(q, k, v, **kw))(q, k, v).jaxpr
    sizes = [int(np.prod(var.aval.shape)) for eqn in jaxpr.eqns for var in eqn.outvars]
    return max(sizes)

  heads = 4  # kv_heads * groups
  dense = largest(staircase.dense_staircase_attention)
  split = largest(staircase.staircase_attention)
  assert dense >= heads * (2 * n) ** 2
  # The largest array of the split kernel: the noisy queries' scores, [heads, n, n + block].
  assert split <= heads * n * (n + block_size)
  assert split < dense / 3
