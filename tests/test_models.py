"""The LLaDA model: configs, shapes, dtypes, attention semantics, sharding annotations."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stabledrl_jax import models
from stabledrl_jax.models import layers


@pytest.fixture(scope="module")
def tiny():
  return models.LLaDA(models.get_config("tiny"), rngs=nnx.Rngs(0))


def _tokens(config, shape, seed=0):
  return jax.random.randint(jax.random.key(seed), shape, 0, config.vocab_size, jnp.int32)


def _expected_params(c):
  attn = c.d_model * c.n_heads * c.head_dim * 2 + 2 * c.d_model * c.n_kv_heads * c.head_dim
  block = attn + 3 * c.d_model * c.mlp_hidden_size + 2 * c.d_model
  return 2 * c.embedding_size * c.d_model + c.n_layers * block + c.d_model


@pytest.mark.parametrize("changes, field", [
    (dict(d_model=66), "d_model"),        # not divisible by n_heads = 4
    (dict(d_model=60), "head_dim"),       # 60 / 4 = 15: RoPE needs an even head_dim
    (dict(n_kv_heads=3), "n_heads"),
    (dict(embedding_size=100), "embedding_size"),
    (dict(mask_token_id=128), "mask_token_id"),
    (dict(n_layers=0), "n_layers"),
    (dict(dtype=jnp.int32), "dtype"),
])
def test_invalid_config_names_the_field(changes, field):
  with pytest.raises(ValueError, match=field):
    models.get_config("tiny", **changes)


def test_named_configs_have_the_documented_sizes():
  assert models.count_params(models.get_config("llada_8b")) == 8_015_581_184
  small = models.count_params(models.get_config("small"))
  assert 10e6 <= small <= 50e6
  for name in models.CONFIG_NAMES:
    config = models.get_config(name)
    assert models.count_params(config) == _expected_params(config)
    assert models.param_bytes(config) == 2 * models.count_params(config)
  c = models.get_config("llada_8b")
  assert (c.d_model, c.n_heads, c.n_layers, c.mlp_hidden_size, c.vocab_size) == (
      4096, 32, 32, 12288, 126464)
  assert (c.mask_token_id, c.eos_token_id, c.rope_theta, c.rms_norm_eps) == (
      126336, 126081, 500000.0, 1e-5)


def test_count_params_matches_the_materialized_model(tiny):
  leaves = jax.tree.leaves(nnx.state(tiny, nnx.Param))
  assert sum(leaf.size for leaf in leaves) == models.count_params(tiny.config)


def test_logits_shape_and_dtypes(tiny):
  tokens = _tokens(tiny.config, (2, 7))
  logits = tiny(tokens)
  assert logits.shape == (2, 7, tiny.config.embedding_size)
  assert logits.dtype == jnp.float32
  np.testing.assert_array_equal(tiny.unembed(tiny.encode(tokens)), logits)

  config = models.get_config("tiny", param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
  model = models.LLaDA(config, rngs=nnx.Rngs(0))
  dtypes = {leaf.dtype for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))}
  assert dtypes == {jnp.dtype(jnp.bfloat16)}
  assert model.encode(tokens).dtype == jnp.bfloat16
  bf16_logits = model(tokens)
  assert bf16_logits.dtype == jnp.float32
  assert jnp.all(jnp.isfinite(bf16_logits))


def test_every_param_has_a_logical_sharding_annotation(tiny):
  known = {name for name, _ in models.LOGICAL_AXIS_RULES}
  params = nnx.to_flat_state(nnx.state(tiny, nnx.Param))
  assert len(params) == 2 + 9 * tiny.config.n_layers + 1
  for path, variable in params:
    axes = variable.get_metadata().get("out_sharding")
    assert axes is not None, path
    assert len(axes) == variable.ndim, path
    assert set(axes) <= known, path
  specs = nnx.get_partition_spec(nnx.state(tiny, nnx.Param))
  assert tuple(specs["blocks"][0]["mlp"]["ff_out"]["kernel"].get_value()) == ("mlp", "embed")
  assert tuple(specs["wte"]["embedding"].get_value()) == ("vocab", "embed")


def test_rules_map_logical_axes_to_the_mesh(tiny):
  mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  shardings = models.param_shardings(tiny, mesh)
  spec = lambda variable: variable.get_value().spec
  assert spec(shardings["wte"]["embedding"]) == jax.P("tensor", "fsdp")
  assert spec(shardings["lm_head"]["kernel"]) == jax.P("fsdp", "tensor")
  assert spec(shardings["blocks"][1]["attn"]["k_proj"]["kernel"]) == jax.P("fsdp", "tensor")
  assert spec(shardings["blocks"][1]["mlp"]["ff_out"]["kernel"]) == jax.P("tensor", "fsdp")
  assert spec(shardings["blocks"][1]["attn_norm"]["weight"]) == jax.P(None)
  assert models.batch_sharding(mesh).spec == jax.P(("data", "fsdp"), None)


def test_rotary_rotates_pairs_of_halves():
  cos, sin = layers.rotary_angles(5, 8, 10000.0)
  x = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
  y = layers.apply_rotary(x, cos, sin)
  # A rotation in each (i, i + hd/2) plane: norms per pair are kept, position 0 is unchanged.
  pair_norm = lambda a: a[..., :4] ** 2 + a[..., 4:] ** 2
  np.testing.assert_allclose(pair_norm(y), pair_norm(x), rtol=1e-5)
  np.testing.assert_allclose(y[:, 0], x[:, 0], rtol=1e-6)
  angle = 3 * 10000.0 ** (-2 * 1 / 8)  # position 3, frequency index 1
  expected = x[0, 3, 0, 1] * np.cos(angle) - x[0, 3, 0, 5] * np.sin(angle)
  np.testing.assert_allclose(y[0, 3, 0, 1], expected, rtol=1e-5)


def test_grouped_query_attention_equals_mha_with_repeated_kv_heads(tiny):
  config = tiny.config
  groups = config.n_heads // config.n_kv_heads
  mha = models.LLaDA(config.replace(n_kv_heads=config.n_heads), rngs=nnx.Rngs(1))

  def repeat_heads(kernel):  # [D, K * hd] -> [D, H * hd], query head h reads kv head h // groups
    kernel = kernel.reshape(kernel.shape[0], config.n_kv_heads, config.head_dim)
    return jnp.repeat(kernel, groups, axis=1).reshape(kernel.shape[0], -1)

  flat = []
  for path, variable in nnx.to_flat_state(nnx.state(tiny, nnx.Param)):
    value = variable[...]
    flat.append((path, variable.replace(
        repeat_heads(value) if path[-2] in ("k_proj", "v_proj") else value)))
  nnx.update(mha, nnx.from_flat_state(flat))
  tokens = _tokens(config, (2, 9))
  np.testing.assert_allclose(mha(tokens), tiny(tokens), rtol=1e-5, atol=1e-5)


def test_attention_is_bidirectional(tiny):
  tokens = _tokens(tiny.config, (1, 8))
  changed = tokens.at[0, -1].set((tokens[0, -1] + 1) % tiny.config.vocab_size)
  assert not np.allclose(tiny(tokens)[0, 0], tiny(changed)[0, 0])


def test_padding_keys_are_ignored(tiny):
  config = tiny.config
  real = _tokens(config, (1, 6), seed=1)
  pad = 3
  padded = jnp.concatenate([jnp.zeros((1, pad), jnp.int32), real], axis=1)
  repadded = padded.at[0, :pad].set(jnp.array([5, 9, 11]))
  mask = jnp.arange(pad + 6)[None] >= pad
  out = tiny(padded, mask)[:, pad:]
  np.testing.assert_allclose(tiny(repadded, mask)[:, pad:], out, rtol=1e-6, atol=1e-6)
  # RoPE only sees relative positions, so left padding leaves the real tokens' logits unchanged.
  np.testing.assert_allclose(out, tiny(real), rtol=1e-4, atol=1e-5)
  assert not np.allclose(tiny(padded)[:, pad:], out, atol=1e-4)


def test_remat_gives_the_same_logits_and_gradients(tiny):
  rematted = models.LLaDA(tiny.config.replace(remat=True), rngs=nnx.Rngs(0))
  tokens = _tokens(tiny.config, (2, 5))

  def loss(model):
    return jnp.mean(jax.nn.log_softmax(model(tokens))[..., 0])

  def jaxpr(model):
    graphdef, state = nnx.split(model)
    return str(jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(tokens))(state))

  assert jaxpr(rematted).count("remat") == tiny.config.n_layers
  assert "remat" not in jaxpr(tiny)
  grad = nnx.jit(nnx.grad(loss))
  g1, g2 = grad(tiny), grad(rematted)
  np.testing.assert_allclose(rematted(tokens), tiny(tokens), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("remat", [False, True])
def test_scanned_layers_give_the_same_logits_and_gradients(remat):
  # scan_layers stacks the blocks' parameters per call and runs them in a lax.scan: the same
  # function of the same (per-layer) parameters as the unrolled loop, masks and spans included.
  config = models.get_config("tiny", n_layers=4)
  loop = models.LLaDA(config, rngs=nnx.Rngs(0))
  scanned = models.LLaDA(config.replace(scan_layers=True, remat=remat), rngs=nnx.Rngs(0))
  tokens = _tokens(config, (2, 12), seed=3)
  mask = jnp.arange(12)[None].repeat(2, 0) >= jnp.array([[0], [4]])

  def outputs(model):
    def loss(model):
      logits = model.unembed(model.encode(tokens, mask, span=(4, 8)))
      return jnp.mean(jax.nn.log_softmax(logits)[..., 1]), logits
    (_, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return model(tokens, mask), logits, grads

  graphdef, _ = nnx.split(scanned)
  assert "scan" in str(jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(tokens))(
      nnx.state(scanned)))
  want, got = outputs(loop), outputs(scanned)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(got[2], want[2], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("remat", [False, True])
def test_encode_span_equals_a_slice_of_the_full_encoding(tiny, remat):
  model = tiny if not remat else models.LLaDA(tiny.config.replace(remat=True), rngs=nnx.Rngs(0))
  tokens = _tokens(tiny.config, (2, 12), seed=2)
  mask = jnp.arange(12)[None].repeat(2, 0) >= jnp.array([[0], [3]])
  full = model.encode(tokens, mask)
  span_fn = nnx.jit(lambda m, t, k, start: m.encode(t, k, span=(start, 4)))
  for start in (0, 5, 8):
    np.testing.assert_allclose(span_fn(model, tokens, mask, jnp.int32(start)),
                               full[:, start:start + 4], rtol=1e-5, atol=1e-5)
