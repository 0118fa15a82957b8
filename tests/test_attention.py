"""model.attention: the kernels (splash through Pallas' interpreter, cudnn's wrapper) against the
XLA path, forward and gradients, on every mask the models build (docs/models.md).

Splash runs interpreted on CPU (the TPU compiler's own verdict is tests/test_tpu_compile.py).
Float32 throughout: the kernels and the XLA path then agree to float rounding (1e-5 relative);
outputs at padding queries are excluded (splash's differ there, and nothing reads them).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stabledrl_jax import models
from stabledrl_jax.models import layers
from stabledrl_jax.models.sdar import staircase as staircase_lib
from stabledrl_jax.training.config import config_lib, specs

RTOL = 1e-5


def _close(actual, expected, what):
  """|actual - expected| <= RTOL * max|expected| (leaf by leaf for pytrees)."""
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    scale = max(np.max(np.abs(e)), 1e-30)
    err = np.max(np.abs(a - e)) / scale
    assert err <= RTOL, f"{what}: relative error {err:.2e}"


def _value_and_grad(model, fn, weights):
  """fn(model) and the gradient of sum(sin(fn(model)) * weights) over the parameters."""
  graphdef, state = nnx.split(model)

  def loss(state):
    out = fn(nnx.merge(graphdef, state))
    return jnp.sum(jnp.sin(out) * weights), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
  return out, grads


def _pair(config, seed=0):
  """The same parameters under attention='xla' and 'splash'."""
  return (models.init_model(config.replace(attention="xla"), seed=seed),
          models.init_model(config.replace(attention="splash"), seed=seed))


def _compare(config, fn, weights, what):
  xla_model, splash_model = _pair(config)
  expected = _value_and_grad(xla_model, fn, weights)
  actual = _value_and_grad(splash_model, fn, weights)
  _close(actual[0] * (weights != 0), expected[0] * (weights != 0), f"{what} forward")
  _close(actual[1], expected[1], f"{what} gradients")


def _left_padded(batch, length, pads, vocab, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab - 2, size=(batch, length)).astype(np.int32)
  mask = np.ones((batch, length), bool)
  for row, pad in enumerate(pads):
    mask[row, :pad] = False
  return jnp.asarray(tokens), jnp.asarray(mask)


# -- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_an_unknown_attention_is_a_one_line_error_naming_the_field(family):
  get = models.get_config if family == "llada" else models.get_sdar_config
  with pytest.raises(ValueError, match=r"^model\.attention: 'flash' is not one of auto, xla, "
                                       r"splash, cudnn") as error:
    get("tiny", attention="flash")
  assert "\n" not in str(error.value)
  assert get("tiny").attention == layers.DEFAULT_ATTENTION == "auto"


def test_the_config_field_reaches_the_model_config():
  config = config_lib.base_config()
  assert config.model.attention == ""  # The model config's default.
  assert specs.model_config(config).attention == layers.DEFAULT_ATTENTION
  config.model.attention = "splash"
  assert specs.model_config(config).attention == "splash"
  config.model.attention = "flash"
  for checkpoint in ("", "/some/checkpoint"):  # Caught before any checkpoint is read.
    config.model.checkpoint = checkpoint
    with pytest.raises(ValueError, match=r"^config\.model\.attention: 'flash' is not one of "
                                         r"auto, xla, splash, cudnn") as error:
      specs.validate(config)
    assert "\n" not in str(error.value)


def _abstract_mesh(platform):
  device = jax.sharding.AbstractDevice(device_kind=platform, num_cores=None, platform=platform)
  return jax.sharding.AbstractMesh((1,), ("data",), abstract_device=device)


def test_auto_picks_by_the_target_platform():
  assert layers.attention_impl("auto", jnp.float32) == "xla"  # CPU: today's code.
  with jax.sharding.use_abstract_mesh(_abstract_mesh("tpu")):
    assert layers.attention_impl("auto", jnp.float32) == "splash"
    # Measured (experiments/attention_choice.py): a call over a KV cache whose head dimension
    # does not fill the 128 lanes needs less with xla, in either dtype; at 128 (LLaDA-8B's)
    # splash needs less everywhere.
    for dtype in (jnp.float32, jnp.bfloat16):
      assert layers.attention_impl("auto", dtype) == "splash"
      assert layers.attention_impl("auto", dtype, cached=True, head_dim=64) == "xla"
      assert layers.attention_impl("auto", dtype, cached=True) == "xla"
      assert layers.attention_impl("auto", dtype, cached=True, head_dim=128) == "splash"
      assert layers.attention_impl("auto", dtype, cached=True, head_dim=256) == "splash"
  with jax.sharding.use_abstract_mesh(_abstract_mesh("gpu")):
    assert layers.attention_impl("auto", jnp.bfloat16) == "cudnn"
    assert layers.attention_impl("auto", jnp.float32) == "xla"  # cuDNN has no float32 kernel.
  for name in ("xla", "splash", "cudnn"):
    assert layers.attention_impl(name, jnp.float32) == name
    assert layers.attention_impl(name, jnp.float32, cached=True) == name


def test_the_xla_path_is_the_cpu_default_bit_for_bit():
  """'auto' on CPU is the 'xla' code: identical logits and gradients (no reassociation)."""
  config = models.get_config("tiny")
  tokens, mask = _left_padded(2, 12, (0, 3), config.vocab_size)
  weights = jnp.ones((2, 12, config.embedding_size))
  fn = lambda m: m(tokens, mask)
  auto = _value_and_grad(models.init_model(config, seed=0), fn, weights)
  xla = _value_and_grad(models.init_model(config.replace(attention="xla"), seed=0), fn, weights)
  for a, b in zip(jax.tree.leaves(auto), jax.tree.leaves(xla)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- the kernels on their own -------------------------------------------------------------------


def _qkv(b, t, s, kv_heads, groups, head_dim, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(keys[0], (b, t, kv_heads, groups, head_dim)),
          jax.random.normal(keys[1], (b, s, kv_heads, head_dim)),
          jax.random.normal(keys[2], (b, s, kv_heads, head_dim)))


def test_splash_pads_any_length_and_matches_the_dense_mask():
  """T = 5 queries over S = 130 keys (neither a multiple of the 128 tile), a random pattern,
  key padding, grouped heads: the padded kernel equals `dot_product_attention`."""
  q, k, v = _qkv(2, 5, 130, 2, 3, 16)
  rng = np.random.default_rng(1)
  allowed = rng.random((5, 130)) < 0.5
  allowed[:, 7] = True  # every query sees a kept key
  keep = np.ones((2, 130), bool)
  keep[1, 100:] = False
  keep_q = np.ones((2, 5), bool)
  expected = layers.dot_product_attention(q, k, v, allowed[None] & keep[:, None, :],
                                          dtype=jnp.float32)
  actual = layers.kernel_attention(q, k, v, impl="splash", allowed=allowed,
                                   key_keep=jnp.asarray(keep), query_keep=jnp.asarray(keep_q),
                                   dtype=jnp.float32)
  _close(actual, expected, "splash")


def test_a_static_pattern_with_an_empty_row_is_refused():
  q, k, v = _qkv(1, 4, 8, 1, 1, 8)
  allowed = np.ones((4, 8), bool)
  allowed[2] = False
  with pytest.raises(ValueError, match="sees no key"):
    layers.kernel_attention(q, k, v, impl="splash", allowed=allowed, key_keep=None,
                            query_keep=None, dtype=jnp.float32)


def test_the_cudnn_wrapper_layout_and_mask():
  """The cudnn path's call of jax.nn.dot_product_attention (layouts, grouped heads, the mask),
  run by its XLA implementation (the cuDNN kernel itself needs a GPU)."""
  q, k, v = _qkv(2, 6, 9, 2, 2, 8)
  allowed = np.tril(np.ones((6, 9), bool), k=3)
  keep = jnp.asarray(np.arange(9)[None, :] >= np.array([[0], [2]]))
  expected = layers.dot_product_attention(q, k, v, allowed[None] & keep[:, None, :],
                                          dtype=jnp.float32)
  actual = layers._jax_nn_attention(  # pylint: disable=protected-access
      q, k, v, allowed, keep, jnp.float32, implementation="xla")
  _close(actual, expected, "jax.nn.dot_product_attention")
  with pytest.raises(ValueError, match=r"model.attention='cudnn' needs a bfloat16 or float16"):
    layers.kernel_attention(q, k, v, impl="cudnn", allowed=None, key_keep=None,
                            query_keep=None, dtype=jnp.float32)


# -- the models through splash ------------------------------------------------------------------


def test_llada_bidirectional_with_padding():
  """Full bidirectional attention over left-padded prompts (the key mask), a span of queries and
  the KV-cached block (``encode_cached``), forward and gradients."""
  config = models.get_config("tiny")
  b, length = 2, 12
  tokens, mask = _left_padded(b, length, (0, 3), config.vocab_size)
  keep = mask[:, :, None].astype(jnp.float32)
  weights = keep * jnp.linspace(0.5, 1.5, config.embedding_size)
  _compare(config, lambda m: m(tokens, mask), weights, "llada full")
  span_weights = weights[:, 4:8]
  _compare(config, lambda m: m.unembed(m.encode(tokens, mask, span=(4, 4))), span_weights,
           "llada span")

  def cached(m):
    _, cache = m.encode_kv(tokens, mask)
    return m.unembed(m.encode_cached(tokens[:, 8:], 8, cache, mask, fresh_from=10))

  _compare(config, cached, weights[:, 8:], "llada cached")


def _sdar_config():
  return models.get_sdar_config("tiny", block_size=4)


def test_sdar_block_causal_and_a_span():
  config = _sdar_config()
  tokens, mask = _left_padded(2, 12, (0, 4), config.vocab_size)
  weights = mask[:, :, None].astype(jnp.float32) * jnp.linspace(0.5, 1.5, config.vocab_size)
  _compare(config, lambda m: m(tokens, mask), weights, "sdar block-causal")
  # The block sampler's uncached call: the block at a traced boundary start.
  start = jnp.int32(4)
  _compare(config, lambda m: m.unembed(m.encode(tokens, mask, span=(start, 4))),
           weights[:, 4:8], "sdar span")
  splash_model = models.init_model(config.replace(attention="splash"))
  with pytest.raises(ValueError, match=r"^model.attention='splash': a span of queries must "
                                       r"start on a block boundary"):
    splash_model.encode(tokens, mask, span=(2, 4))


def test_sdar_staircase():
  """The staircase layout [x_t^1 ; x_t^2 ; x_0] (R = 2) with padding."""
  config = _sdar_config()
  clean, mask = _left_padded(2, 8, (0, 4), config.vocab_size)
  rng = np.random.default_rng(3)
  noisy = jnp.where(jnp.asarray(rng.random((2, 2, 8)) < 0.5), config.mask_token_id, clean[None])
  weights = (mask[None, :, :, None].astype(jnp.float32)
             * jnp.linspace(0.5, 1.5, config.vocab_size))
  assert staircase_lib.staircase_mask(8, 4, 2).shape == (24, 24)
  # Splash takes the dense pattern whatever `impl`; the XLA reference is the default split form
  # (tests/test_staircase.py checks it against the dense one).
  _compare(config, lambda m: m.staircase(noisy, clean, mask), weights, "sdar staircase")


def test_sdar_cached_queries_over_longer_keys():
  """``extend``: a block's queries over the cache of the prompt (committed) and themselves."""
  config = _sdar_config()
  tokens, mask = _left_padded(2, 12, (0, 3), config.vocab_size)
  full_mask = jnp.concatenate([mask, jnp.ones((2, 4), bool)], axis=1)
  block = tokens[:, :4] + 1

  def extend(m):
    cache = m.init_cache(2, 16, full_mask)
    _, cache = m.extend(tokens, cache, commit=True)
    hidden, _ = m.extend(block, cache, commit=False)
    return m.unembed(hidden)

  weights = jnp.ones((2, 4, config.vocab_size)) * jnp.linspace(0.5, 1.5, config.vocab_size)
  _compare(config, extend, weights, "sdar extend")
