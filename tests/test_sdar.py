"""The SDAR model: configs, block-causal and staircase attention, cached decoding, sharding
annotations, and Hugging Face IO checked against an independent float64 numpy forward pass."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stabledrl_jax import models

import family_helpers

CONFIG = models.get_sdar_config("tiny")
BS = CONFIG.block_size
MASK = CONFIG.mask_token_id


@pytest.fixture(scope="module")
def tiny():
  return models.SDAR(CONFIG, rngs=nnx.Rngs(0))


# Jitted entry points: one compilation per shape instead of an op-by-op (eager) dispatch.
plain = nnx.jit(lambda model, tokens, mask=None: model(tokens, mask))
stair = nnx.jit(lambda model, noisy, clean, mask=None, impl="split": model.staircase(
    noisy, clean, mask, impl=impl), static_argnames="impl")


def _tokens(shape, seed=0):
  return jax.random.randint(jax.random.key(seed), shape, 0, CONFIG.vocab_size - 2, jnp.int32)


def _expected_params(c):
  q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
  layer = 2 * c.hidden_size * q + 2 * c.hidden_size * kv + 3 * c.hidden_size * c.intermediate_size
  layer += 2 * c.hidden_size + 2 * c.head_dim
  return 2 * c.vocab_size * c.hidden_size + c.num_hidden_layers * layer + c.hidden_size


# ---------------------------------------------------------------------------
# Configs and parameters.
# ---------------------------------------------------------------------------


def test_named_configs_have_the_released_shapes():
  c = models.get_sdar_config("sdar_8b")
  assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
          c.head_dim, c.intermediate_size, c.vocab_size) == (36, 4096, 32, 8, 128, 12288, 151936)
  assert (c.rope_theta, c.mask_token_id, c.block_size, c.rms_norm_eps) == (1e6, 151669, 4, 1e-6)
  assert c.param_dtype == jnp.bfloat16 and c.logits_dtype == jnp.float32
  assert models.count_params(c) == 8_190_735_360  # Qwen3-8B with its untied head
  four = models.get_sdar_config("sdar_4b")
  assert (four.hidden_size, four.num_hidden_layers, four.head_dim, four.intermediate_size) == (
      2560, 36, 128, 9728)
  for name in models.SDAR_CONFIG_NAMES:
    config = models.get_sdar_config(name)
    assert models.count_params(config) == _expected_params(config), name
    assert models.param_bytes(config) == 2 * models.count_params(config)
  assert 10e6 <= models.count_params(models.get_sdar_config("small")) <= 50e6


@pytest.mark.parametrize("changes, field", [
    (dict(num_key_value_heads=3), "num_attention_heads"),
    (dict(head_dim=15), "head_dim"),
    (dict(mask_token_id=128), "mask_token_id"),
    (dict(block_size=0), "block_size"),
    (dict(dtype=jnp.int32), "dtype"),
])
def test_invalid_config_names_the_field(changes, field):
  with pytest.raises(ValueError, match=field):
    models.get_sdar_config("tiny", **changes)


def test_every_param_has_a_logical_sharding_annotation(tiny):
  known = {name for name, _ in models.LOGICAL_AXIS_RULES}
  params = nnx.to_flat_state(nnx.state(tiny, nnx.Param))
  assert len(params) == 2 + 11 * CONFIG.num_hidden_layers + 1
  assert sum(v.size for _, v in params) == models.count_params(CONFIG)
  for path, variable in params:
    axes = variable.get_metadata().get("out_sharding")
    assert axes is not None and len(axes) == variable.ndim and set(axes) <= known, path
  mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  shardings = models.param_shardings(tiny, mesh)
  spec = lambda variable: variable.get_value().spec
  attn = shardings["layers"][0]["self_attn"]
  assert spec(attn["q_proj"]["kernel"]) == jax.P("fsdp", "tensor")
  assert spec(attn["o_proj"]["kernel"]) == jax.P("tensor", "fsdp")
  assert spec(attn["q_norm"]["weight"]) == jax.P(None)
  assert spec(shardings["embed_tokens"]["embedding"]) == jax.P("tensor", "fsdp")
  sharded = models.init_model(CONFIG, seed=0, mesh=mesh)
  # The same draws; the jitted sharded init and the eager one may round the last bit of a
  # truncated-normal transform differently (they are separately compiled programs).
  np.testing.assert_allclose(sharded.lm_head.kernel[...], tiny.lm_head.kernel[...], rtol=1e-6)


def test_logits_shape_and_dtypes(tiny):
  tokens = _tokens((2, 8))
  logits = plain(tiny, tokens)
  assert logits.shape == (2, 8, CONFIG.vocab_size) and logits.dtype == jnp.float32
  model = models.SDAR(CONFIG.replace(param_dtype=jnp.bfloat16, dtype=jnp.bfloat16),
                      rngs=nnx.Rngs(0))
  assert {leaf.dtype for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))} == {
      jnp.dtype(jnp.bfloat16)}
  assert nnx.jit(lambda m, t: m.encode(t))(model, tokens).dtype == jnp.bfloat16
  out = plain(model, tokens)
  assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))
  assert stair(model, tokens, tokens).dtype == jnp.float32


# ---------------------------------------------------------------------------
# Attention semantics.
# ---------------------------------------------------------------------------


def test_attention_is_block_causal(tiny):
  tokens = _tokens((1, 12))
  base = plain(tiny, tokens)
  for pos in (5, 7):  # inside block 1
    changed = plain(tiny, tokens.at[0, pos].set((tokens[0, pos] + 1) % 100))
    np.testing.assert_array_equal(changed[:, :4], base[:, :4])     # earlier block: untouched
    assert not np.allclose(changed[:, 4], base[:, 4], atol=1e-5)   # own block: bidirectional
    assert not np.allclose(changed[:, 8:], base[:, 8:], atol=1e-5)  # later blocks see it


def test_grouped_query_attention_equals_mha_with_repeated_kv_heads(tiny):
  groups = CONFIG.num_attention_heads // CONFIG.num_key_value_heads
  mha = models.SDAR(CONFIG.replace(num_key_value_heads=CONFIG.num_attention_heads),
                    rngs=nnx.Rngs(1))

  def repeat_heads(kernel):  # [D, K * hd] -> [D, H * hd]
    kernel = kernel.reshape(kernel.shape[0], CONFIG.num_key_value_heads, CONFIG.head_dim)
    return jnp.repeat(kernel, groups, axis=1).reshape(kernel.shape[0], -1)

  flat = []
  for path, variable in nnx.to_flat_state(nnx.state(tiny, nnx.Param)):
    value = variable[...]
    flat.append((path, variable.replace(
        repeat_heads(value) if path[-2] in ("k_proj", "v_proj") else value)))
  nnx.update(mha, nnx.from_flat_state(flat))
  tokens = _tokens((2, 8))
  np.testing.assert_allclose(plain(mha, tokens), plain(tiny, tokens), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(stair(mha, tokens, tokens), stair(tiny, tokens, tokens),
                             rtol=1e-5, atol=1e-5)


def _noised(tokens, seed):
  drop = jax.random.bernoulli(jax.random.key(seed), 0.5, tokens.shape)
  return jnp.where(drop, MASK, tokens)


def test_staircase_block_k_equals_a_plain_pass_on_the_clean_prefix_and_block_k(tiny):
  clean = _tokens((2, 16), seed=3)
  noisy = _noised(clean, 4)
  logits = stair(tiny, noisy, clean)
  assert logits.shape == (2, 16, CONFIG.vocab_size)
  for k in range(4):
    inputs = jnp.concatenate([clean[:, :k * BS], noisy[:, k * BS:(k + 1) * BS]], axis=1)
    np.testing.assert_allclose(logits[:, k * BS:(k + 1) * BS], plain(tiny, inputs)[:, k * BS:],
                               rtol=1e-5, atol=1e-5)


def test_staircase_split_dense_and_samples_agree(tiny):
  clean = _tokens((2, 12), seed=5)
  noisy = jnp.stack([_noised(clean, 6), _noised(clean, 7), _noised(clean, 8)])
  mask = jnp.ones((2, 12), bool).at[1, :4].set(False)  # row 1: one block of left padding
  split = stair(tiny, noisy, clean, mask)
  dense = stair(tiny, noisy, clean, mask, impl="dense")
  assert split.shape == (3, 2, 12, CONFIG.vocab_size)
  real = np.asarray(mask)  # padding queries see no real key: their outputs are arbitrary
  np.testing.assert_allclose(np.asarray(split)[:, real], np.asarray(dense)[:, real],
                             rtol=1e-5, atol=1e-5)
  for r in range(3):  # R samples in one pass == R separate passes
    np.testing.assert_allclose(np.asarray(split[r])[real],
                               np.asarray(stair(tiny, noisy[r], clean, mask))[real],
                               rtol=1e-5, atol=1e-5)
  # A block of left padding leaves the later blocks as without it (blocks stay aligned).
  unpadded = stair(tiny, noisy[:, 1:, 4:], clean[1:, 4:])
  np.testing.assert_allclose(split[:, 1:, 4:], unpadded, rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError, match="multiple of block_size"):
    tiny.staircase(clean[:, :10], clean[:, :10])
  with pytest.raises(ValueError, match="impl"):
    tiny.staircase(clean, clean, impl="flash")


def test_cached_extension_equals_the_full_block_causal_pass(tiny):
  tokens = _tokens((2, 16), seed=9)
  key_mask = jnp.ones((2, 16), bool).at[0, :3].set(False)
  full = nnx.jit(lambda m, t, k: m.encode(t, k))(tiny, tokens, key_mask)
  extend = nnx.jit(lambda m, t, c, commit: m.extend(t, c, commit=commit),
                   static_argnames="commit")
  cache = tiny.init_cache(2, 16, key_mask)
  hidden, cache = extend(tiny, tokens[:, :8], cache, commit=True)  # prefill two blocks
  np.testing.assert_allclose(hidden, full[:, :8], rtol=1e-5, atol=1e-5)
  assert int(cache.length) == 8
  peek, same = extend(tiny, tokens[:, 8:12], cache, commit=False)
  assert int(same.length) == 8
  np.testing.assert_allclose(peek, full[:, 8:12], rtol=1e-5, atol=1e-5)
  _, cache = extend(tiny, tokens[:, 8:12], cache, commit=True)
  last, cache = extend(tiny, tokens[:, 12:], cache, commit=True)
  np.testing.assert_allclose(last, full[:, 12:], rtol=1e-5, atol=1e-5)
  jitted = nnx.jit(lambda m, t, s: m.encode(t, key_mask, span=(s, 4)))
  np.testing.assert_allclose(jitted(tiny, tokens, jnp.int32(8)), full[:, 8:12],
                             rtol=1e-5, atol=1e-5)


def test_remat_gives_the_same_logits_and_gradients(tiny):
  rematted = models.SDAR(CONFIG.replace(remat=True), rngs=nnx.Rngs(0))
  clean = _tokens((2, 8), seed=11)
  noisy = _noised(clean, 12)

  def loss(model):
    return jnp.mean(jax.nn.log_softmax(model.staircase(noisy, clean))[..., 0])

  graphdef, state = nnx.split(rematted)
  jaxpr = str(jax.make_jaxpr(lambda s: nnx.merge(graphdef, s).staircase(noisy, clean))(state))
  assert jaxpr.count("remat") == CONFIG.num_hidden_layers
  grad = nnx.jit(nnx.grad(loss))
  g1, g2 = grad(tiny), grad(rematted)
  np.testing.assert_allclose(stair(rematted, noisy, clean), stair(tiny, noisy, clean), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("remat", [False, True])
def test_scanned_layers_give_the_same_staircase_encoding_and_gradients(remat):
  config = CONFIG.replace(num_hidden_layers=3)
  loop = models.SDAR(config, rngs=nnx.Rngs(0))
  scanned = models.SDAR(config.replace(scan_layers=True, remat=remat), rngs=nnx.Rngs(0))
  clean = _tokens((2, 8), seed=13)
  noisy = _noised(clean, 14)
  key_mask = jnp.arange(8)[None].repeat(2, 0) >= jnp.array([[0], [4]])

  def outputs(model):
    def loss(model):
      return jnp.mean(jax.nn.log_softmax(model.staircase(noisy, clean, key_mask))[..., 0])
    grads = nnx.grad(loss)(model)
    return (model.staircase(noisy, clean, key_mask), model.encode(clean, key_mask, span=(4, 4)),
            grads)

  graphdef, state = nnx.split(scanned)
  assert "scan" in str(jax.make_jaxpr(
      lambda s: nnx.merge(graphdef, s).staircase(noisy, clean))(state))
  want, got = outputs(loop), outputs(scanned)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------
# Hugging Face IO against a float64 numpy forward pass written from the tensor names.
# ---------------------------------------------------------------------------

# An SDAR config.json as the released checkpoints write it, scaled down (head_dim * heads !=
# hidden_size and GQA, as in Qwen3-4B).
HF_CONFIG = {
    "architectures": ["SDARForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "block_size": 4, "bos_token_id": 90, "eos_token_id": 98, "head_dim": 16,
    "hidden_act": "silu", "hidden_size": 48, "intermediate_size": 80,
    "mask_token_id": 99, "max_position_embeddings": 256, "max_window_layers": 2,
    "model_type": "sdar", "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 10000.0,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": False, "use_sliding_window": False, "vocab_size": 100,
}


def random_tensors(hf, seed=0):
  """HF-named float32 tensors in torch layout ([out, in] for Linear weights)."""
  rng = np.random.default_rng(seed)
  d, f, v, hd = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"], hf["head_dim"]
  q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd

  def linear(out_dim, in_dim):
    return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

  def norm(size):
    return (1.0 + 0.2 * rng.standard_normal(size)).astype(np.float32)

  t = {"model.embed_tokens.weight": rng.standard_normal((v, d)).astype(np.float32)}
  for i in range(hf["num_hidden_layers"]):
    p = f"model.layers.{i}."
    t.update({
        p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
        p + "self_attn.q_proj.weight": linear(q, d), p + "self_attn.k_proj.weight": linear(kv, d),
        p + "self_attn.v_proj.weight": linear(kv, d), p + "self_attn.o_proj.weight": linear(d, q),
        p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
        p + "mlp.gate_proj.weight": linear(f, d), p + "mlp.up_proj.weight": linear(f, d),
        p + "mlp.down_proj.weight": linear(d, f),
    })
  t["model.norm.weight"] = norm(d)
  t["lm_head.weight"] = linear(v, d)
  return t


def write_checkpoint(path, tensors, hf=HF_CONFIG, shards=1):
  return family_helpers.write_checkpoint(path, tensors, hf, shards)


def reference_logits(t, hf, tokens, positions, mask):
  """The SDAR / Qwen3 forward pass in float64 numpy with an explicit [T, T] attention mask."""
  t = {k: np.asarray(v, np.float64) for k, v in t.items()}
  h, kvh, hd, eps = (hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"],
                     hf["rms_norm_eps"])
  b, length = tokens.shape

  def rms(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

  inv_freq = 1.0 / hf["rope_theta"] ** (np.arange(0, hd, 2) / hd)
  angles = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
  angles = np.concatenate([angles, angles], axis=-1)[None, :, None, :]

  def rope(x):
    rotated = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1)
    return x * np.cos(angles) + rotated * np.sin(angles)

  x = t["model.embed_tokens.weight"][tokens]
  for i in range(hf["num_hidden_layers"]):
    w = lambda name: t[f"model.layers.{i}.{name}.weight"]
    y = rms(x, w("input_layernorm"))
    q = rope(rms((y @ w("self_attn.q_proj").T).reshape(b, length, h, hd), w("self_attn.q_norm")))
    k = rope(rms((y @ w("self_attn.k_proj").T).reshape(b, length, kvh, hd),
                 w("self_attn.k_norm")))
    v = (y @ w("self_attn.v_proj").T).reshape(b, length, kvh, hd)
    k, v = np.repeat(k, h // kvh, axis=2), np.repeat(v, h // kvh, axis=2)
    scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(hd)
    scores = np.where(mask[None, None], scores, -np.inf)
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    probs = scores / scores.sum(-1, keepdims=True)
    x = x + np.einsum("bhts,bshd->bthd", probs, v).reshape(b, length, h * hd) @ w(
        "self_attn.o_proj").T
    y = rms(x, w("post_attention_layernorm"))
    gate, up = y @ w("mlp.gate_proj").T, y @ w("mlp.up_proj").T
    x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w("mlp.down_proj").T
  return rms(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


def relative_error(got, want):
  return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


@pytest.fixture(scope="module")
def tensors():
  return random_tensors(HF_CONFIG)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tensors):
  return write_checkpoint(str(tmp_path_factory.mktemp("sdar")), tensors)


def test_logits_match_float64_reference(checkpoint, tensors):
  model = models.from_pretrained(checkpoint)  # dispatches on model_type
  assert isinstance(model, models.SDAR)
  c = model.config
  assert (c.head_dim, c.num_key_value_heads, c.block_size, c.mask_token_id, c.eos_token_id) == (
      16, 2, 4, 99, 98)
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, 98, (2, 12)).astype(np.int32)
  bs = HF_CONFIG["block_size"]
  # Plain decoding pass: block-causal.
  pos = np.arange(12)
  block_causal = pos[None, :] // bs <= pos[:, None] // bs
  want = reference_logits(tensors, HF_CONFIG, tokens, pos, block_causal)
  got = plain(model, jnp.asarray(tokens))
  assert got.shape == (2, 12, 100)
  assert relative_error(got, want) < 1e-4
  # Staircase pass [x_t ; x_0]: the reference runs 24 positions with the rule written out here.
  noisy = np.where(rng.random((2, 12)) < 0.5, 99, tokens).astype(np.int32)
  stream = np.arange(24) >= 12
  blk = (np.arange(24) % 12) // bs
  q_clean, k_clean = stream[:, None], stream[None, :]
  q_blk, k_blk = blk[:, None], blk[None, :]
  mask = ((q_clean & k_clean & (k_blk <= q_blk)) | (~q_clean & k_clean & (k_blk < q_blk))
          | (~q_clean & ~k_clean & (k_blk == q_blk)))
  want = reference_logits(tensors, HF_CONFIG, np.concatenate([noisy, tokens], 1),
                          np.tile(pos, 2), mask)[:, :12]
  assert relative_error(stair(model, jnp.asarray(noisy), jnp.asarray(tokens)), want) < 1e-4


def test_save_then_load_round_trips(tmp_path, tensors, checkpoint):
  family_helpers.assert_saves_and_reloads(
      models.from_pretrained(checkpoint), str(tmp_path / "saved"), tensors, HF_CONFIG,
      ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
       "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta", "vocab_size",
       "block_size", "mask_token_id", "model_type"))


def test_tied_embeddings_load_into_the_head(tmp_path, tensors):
  tied = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
  path = write_checkpoint(str(tmp_path / "tied"), tied, {**HF_CONFIG, "tie_word_embeddings": True})
  model = models.from_pretrained(path)
  np.testing.assert_array_equal(model.lm_head.kernel[...], tensors["model.embed_tokens.weight"].T)


@pytest.mark.parametrize("edit, error, message", [
    (lambda t, hf: t.pop("model.layers.1.self_attn.k_norm.weight"), models.CheckpointError,
     "layers.1.self_attn.k_norm.weight"),
    (lambda t, hf: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}),
     models.CheckpointError, "q_proj.bias"),
    (lambda t, hf: hf.update(attention_bias=True), NotImplementedError, "attention_bias"),
    (lambda t, hf: hf.update(model_type="sdar_moe"), NotImplementedError, "sdar_moe"),
    (lambda t, hf: hf.pop("block_size"), models.CheckpointError, "block_size"),
])
def test_bad_checkpoints_are_refused_by_name(tmp_path, tensors, edit, error, message):
  broken, hf = dict(tensors), dict(HF_CONFIG)
  edit(broken, hf)
  path = write_checkpoint(str(tmp_path / "broken"), broken, hf)
  with pytest.raises(error, match=message.replace(".", r"\.")):
    models.from_pretrained(path)


def test_a_tied_checkpoint_that_also_stores_the_head_loads_tied(tmp_path, tensors):
  """As transformers loads it: the stored lm_head.weight is not read, the head is the embedding."""
  path = write_checkpoint(str(tmp_path / "tied_with_head"), dict(tensors),
                          {**HF_CONFIG, "tie_word_embeddings": True})
  model = models.from_pretrained(path)
  np.testing.assert_array_equal(model.lm_head.kernel[...], tensors["model.embed_tokens.weight"].T)
  assert not np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])


def test_generation_config_stop_tokens_load_and_save(tmp_path, tensors):
  """SDAR's generation_config.json names <|endoftext|> and <|im_end|>: both end a completion."""
  path = write_checkpoint(str(tmp_path / "chat"), dict(tensors), HF_CONFIG)
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [97, 98], "pad_token_id": 98}, f)
  model = models.from_pretrained(path)
  assert model.config.eos_token_id == 98 and model.config.stop_token_ids == (98, 97)
  models.save_pretrained(model, str(tmp_path / "again"))
  assert models.from_pretrained(str(tmp_path / "again")).config.stop_token_ids == (98, 97)
  assert models.get_sdar_config("sdar_8b").stop_token_ids == (151643, 151645)
  assert models.get_sdar_config("tiny").stop_token_ids == (126,)
  with pytest.raises(ValueError, match="stop_token_ids"):
    models.get_sdar_config("tiny", stop_token_ids=(5, 126))
