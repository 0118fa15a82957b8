"""Hugging Face checkpoint IO: exact logits against an independent float64 numpy forward pass,
error reporting, save/load round trips, sharded loading on a fake 8-device mesh."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from stabledrl_jax import models
from stabledrl_jax.models import hf_io

import family_helpers

P = "model.transformer."

# A LLaDA config.json as the released checkpoints write it, scaled down. embedding_size >
# vocab_size and n_kv_heads < n_heads so that both paths are exercised.
HF_CONFIG = {
    "activation_type": "silu", "alibi": False, "architectures": ["LLaDAModelLM"],
    "attention_layer_norm": False, "bias_for_layer_norm": False, "block_group_size": 1,
    "block_type": "llama", "d_model": 64, "embedding_size": 112, "eos_token_id": 98,
    "include_bias": False, "include_qkv_bias": False, "init_fn": "mitchell",
    "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True,
    "mask_token_id": 99, "max_sequence_length": 256, "mlp_hidden_size": 96, "mlp_ratio": 4,
    "model_type": "llada", "multi_query_attention": None, "n_heads": 4, "n_kv_heads": 2,
    "n_layers": 2, "pad_token_id": 98, "rms_norm_eps": 1e-5, "rope": True,
    "rope_full_precision": True, "rope_theta": 10000.0, "scale_logits": False,
    "vocab_size": 100, "weight_tying": False,
}


def random_tensors(hf, seed=0):
  """HF-named float32 tensors in torch layout ([out, in] for Linear weights)."""
  rng = np.random.default_rng(seed)
  d, f, e = hf["d_model"], hf["mlp_hidden_size"], hf["embedding_size"]
  hd = d // hf["n_heads"]
  kv = hf["n_kv_heads"] * hd

  def linear(out_dim, in_dim):
    return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

  def norm():
    return (1.0 + 0.2 * rng.standard_normal(d)).astype(np.float32)

  t = {P + "wte.weight": rng.standard_normal((e, d)).astype(np.float32)}
  for i in range(hf["n_layers"]):
    b = f"{P}blocks.{i}."
    t.update({
        b + "attn_norm.weight": norm(), b + "ff_norm.weight": norm(),
        b + "q_proj.weight": linear(d, d), b + "k_proj.weight": linear(kv, d),
        b + "v_proj.weight": linear(kv, d), b + "attn_out.weight": linear(d, d),
        b + "ff_proj.weight": linear(f, d), b + "up_proj.weight": linear(f, d),
        b + "ff_out.weight": linear(d, f),
    })
  t[P + "ln_f.weight"] = norm()
  t[P + "ff_out.weight"] = linear(e, d)
  return t


def write_checkpoint(path, tensors, hf=HF_CONFIG, shards=1):
  return family_helpers.write_checkpoint(path, tensors, hf, shards)


def reference_logits(t, hf, tokens, key_mask=None):
  """LLaDA's forward pass in float64 numpy, straight from the HF-named tensors."""
  t = {k: np.asarray(v, np.float64) for k, v in t.items()}
  d, h, k_heads = hf["d_model"], hf["n_heads"], hf["n_kv_heads"]
  hd, eps = d // h, hf["rms_norm_eps"]
  b, length = tokens.shape

  def rms(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

  inv_freq = 1.0 / hf["rope_theta"] ** (np.arange(0, hd, 2) / hd)
  angles = np.arange(length)[:, None] * inv_freq[None, :]
  angles = np.concatenate([angles, angles], axis=-1)[None, :, None, :]

  def rope(x):
    rotated = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1)
    return x * np.cos(angles) + rotated * np.sin(angles)

  x = t[P + "wte.weight"][tokens]
  for i in range(hf["n_layers"]):
    w = lambda name: t[f"{P}blocks.{i}.{name}.weight"]
    y = rms(x, w("attn_norm"))
    q = rope((y @ w("q_proj").T).reshape(b, length, h, hd))
    k = rope((y @ w("k_proj").T).reshape(b, length, k_heads, hd))
    v = (y @ w("v_proj").T).reshape(b, length, k_heads, hd)
    k, v = np.repeat(k, h // k_heads, axis=2), np.repeat(v, h // k_heads, axis=2)
    scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(hd)
    if key_mask is not None:
      scores = np.where(key_mask[:, None, None, :], scores, -np.inf)
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    probs = scores / scores.sum(-1, keepdims=True)
    x = x + np.einsum("bhts,bshd->bthd", probs, v).reshape(b, length, d) @ w("attn_out").T
    y = rms(x, w("ff_norm"))
    gate, up = y @ w("ff_proj").T, y @ w("up_proj").T
    x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w("ff_out").T
  return rms(x, t[P + "ln_f.weight"]) @ t[P + "ff_out.weight"].T


def relative_error(got, want):
  return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


@pytest.fixture(scope="module")
def tensors():
  return random_tensors(HF_CONFIG)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tensors):
  return write_checkpoint(str(tmp_path_factory.mktemp("ckpt")), tensors)


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(1).integers(0, HF_CONFIG["vocab_size"], (2, 12)).astype(np.int32)


def test_logits_match_float64_reference(checkpoint, tensors, tokens):
  model = models.from_pretrained(checkpoint)
  assert model.config.n_kv_heads == 2 and model.config.embedding_size == 112
  assert (model.config.mask_token_id, model.config.eos_token_id) == (99, 98)
  want = reference_logits(tensors, HF_CONFIG, tokens)
  got = model(jnp.asarray(tokens))
  assert got.shape == (2, 12, 112) and got.dtype == jnp.float32
  assert relative_error(got, want) < 1e-4


def test_padding_mask_matches_reference(checkpoint, tensors, tokens):
  model = models.from_pretrained(checkpoint)
  key_mask = np.ones(tokens.shape, bool)
  key_mask[0, :4] = False
  key_mask[1, -3:] = False
  want = reference_logits(tensors, HF_CONFIG, tokens, key_mask)
  got = model(jnp.asarray(tokens), jnp.asarray(key_mask))
  assert relative_error(got, want) < 1e-4


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path, tensors, checkpoint, tokens):
  sharded = write_checkpoint(str(tmp_path / "sharded"), tensors, shards=3)
  np.testing.assert_array_equal(models.from_pretrained(sharded)(tokens),
                                models.from_pretrained(checkpoint)(tokens))


def test_bf16_checkpoint_loads_exactly_in_bf16(tmp_path, tensors, tokens):
  bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
  path = write_checkpoint(str(tmp_path / "bf16"), bf16)
  model = models.from_pretrained(path, dtype=jnp.bfloat16)
  q = model.blocks[1].attn.q_proj.kernel[...]
  assert q.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(q), bf16[P + "blocks.1.q_proj.weight"].T)
  logits = model(jnp.asarray(tokens))
  assert logits.dtype == jnp.float32
  want = reference_logits({k: v.astype(np.float64) for k, v in bf16.items()}, HF_CONFIG, tokens)
  assert relative_error(logits, want) < 0.1  # bf16 activations: loose, but the same function


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop(P + "blocks.1.up_proj.weight"), "blocks.1.up_proj.weight"),
    (lambda t: t.update({P + "blocks.0.k_proj.weight": np.zeros((64, 64), np.float32)}),
     "blocks.0.k_proj.weight"),
    (lambda t: t.update({P + "blocks.0.q_proj.bias": np.zeros((64,), np.float32)}),
     "blocks.0.q_proj.bias"),
])
def test_bad_checkpoint_error_names_the_tensor(tmp_path, tensors, edit, message):
  broken = dict(tensors)
  edit(broken)
  path = write_checkpoint(str(tmp_path / "broken"), broken)
  with pytest.raises(models.CheckpointError, match=message.replace(".", r"\.")):
    models.from_pretrained(path)


def test_unsupported_architecture_is_refused(tmp_path, tensors):
  path = write_checkpoint(str(tmp_path / "tied"), tensors, hf={**HF_CONFIG, "weight_tying": True})
  with pytest.raises(NotImplementedError, match="weight_tying"):
    models.from_pretrained(path)


@pytest.mark.parametrize("max_shard_bytes", [None, 60_000])
def test_save_then_load_round_trips(tmp_path, tensors, checkpoint, max_shard_bytes):
  model = models.from_pretrained(checkpoint)
  out = str(tmp_path / "saved")
  kwargs = {} if max_shard_bytes is None else dict(max_shard_bytes=max_shard_bytes)
  models.save_pretrained(model, out, **kwargs)
  files = sorted(os.listdir(out))
  # Readable like any new file (safetensors alone would write 0600); the suite's umask.
  umask = os.umask(0)
  os.umask(umask)
  assert {oct(os.stat(os.path.join(out, f)).st_mode & 0o777) for f in files} == {
      oct(0o666 & ~umask)}
  if max_shard_bytes is None:
    assert files == ["config.json", "model.safetensors"]
  else:
    assert "model.safetensors.index.json" in files and len(files) > 3
  # The files hold exactly the original tensors, under the same names and layouts.
  written = {}
  for name in files:
    if name.endswith(".safetensors"):
      written.update(load_file(os.path.join(out, name)))
  assert set(written) == set(tensors)
  for name, value in tensors.items():
    np.testing.assert_array_equal(written[name], value, err_msg=name)
  with open(os.path.join(out, "config.json")) as f:
    saved_config = json.load(f)
  for key in ("d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "vocab_size",
              "embedding_size", "rope_theta", "rms_norm_eps", "mask_token_id", "eos_token_id"):
    assert saved_config[key] == HF_CONFIG[key], key
  reloaded = models.from_pretrained(out)
  assert reloaded.config == model.config
  for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(reloaded))):
    np.testing.assert_array_equal(a, b)


def test_sharded_loading_on_a_fake_8_device_mesh(checkpoint, tokens):
  script = textwrap.dedent(f"""
      import jax, jax.numpy as jnp, numpy as np
      from flax import nnx
      from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
      from stabledrl_jax import models
      from stabledrl_jax.models import hf_io

      assert len(jax.devices()) == 8, jax.devices()
      reads = []
      original = hf_io._read_slice
      def spy(tensor_slice, index):
        out = original(tensor_slice, index)
        reads.append(out.size)
        return out
      hf_io._read_slice = spy

      path = {checkpoint!r}
      tokens = np.array({tokens.tolist()!r}, np.int32)
      tokens = jnp.asarray(np.concatenate([tokens, tokens[:, ::-1]]))  # batch 4 = data x fsdp
      single = models.from_pretrained(path)
      want = np.asarray(single(tokens))
      assert not reads  # the unsharded load reads whole tensors

      mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                           axis_types=(AxisType.Auto,) * 3)
      model = models.from_pretrained(path, mesh=mesh)
      wte = model.wte.embedding[...]
      assert wte.sharding.spec == P("tensor", "fsdp"), wte.sharding
      assert {{s.data.shape for s in wte.addressable_shards}} == {{(56, 32)}}
      ff = model.blocks[0].mlp.ff_proj.kernel[...]
      assert ff.sharding.spec == P("fsdp", "tensor"), ff.sharding
      assert {{s.data.shape for s in ff.addressable_shards}} == {{(32, 48)}}
      # Devices read their own shards only (a replicated tensor is read once and copied).
      arrays = jax.tree.leaves(nnx.state(model))
      assert sum(reads) <= sum(s.data.size for a in arrays for s in a.addressable_shards)
      assert max(reads) == wte.size // 4 == max(s.data.size for s in wte.addressable_shards)

      batch = jax.device_put(tokens, models.batch_sharding(mesh))
      got = np.asarray(nnx.jit(lambda m, t: m(t))(model, batch))
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

      # The sampler runs on the sharded model as on one device (greedy: same tokens).
      from stabledrl_jax.models.llada.sampler import generate
      kw = dict(key=jax.random.key(0), gen_length=8, steps=4, block_length=4)
      np.testing.assert_array_equal(generate(model, batch, **kw), generate(single, tokens, **kw))

      fresh = models.init_model(model.config, seed=3, mesh=mesh)
      q = fresh.blocks[1].attn.q_proj.kernel[...]
      assert q.sharding.spec == P("fsdp", "tensor"), q.sharding
      reference = models.LLaDA(model.config, rngs=nnx.Rngs(3)).blocks[1].attn.q_proj.kernel[...]
      np.testing.assert_array_equal(np.asarray(q), np.asarray(reference))
      explicit = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                               axis_types=(AxisType.Explicit,) * 3)
      try:
        models.from_pretrained(path, mesh=explicit)
        raise AssertionError("an Explicit mesh was accepted")
      except ValueError as err:
        assert "AxisType.Auto" in str(err), err
      print("OK")
  """)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-4000:]


# ---------------------------------------------------------------------------
# Unreadable files: one line naming the file (docs/reliability.md).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name,content,message", [
    ("config.json", "{not json", "is not valid JSON"),
    ("config.json", "[1, 2]", "holds a JSON list, not an object"),
    ("config.json", "\"llada\"", "holds a JSON str, not an object"),
    ("generation_config.json", "\x00\x01", "is not valid JSON"),
])
def test_a_config_file_that_is_not_a_json_object_is_named(tmp_path, tensors, name, content,
                                                          message):
  path = write_checkpoint(str(tmp_path / "ckpt"), tensors)
  with open(os.path.join(path, name), "w") as f:
    f.write(content)
  for load in (models.from_pretrained, hf_io.load_config):
    with pytest.raises(models.CheckpointError) as error:
      load(path)
    assert str(error.value).startswith(os.path.join(path, name) + " ")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_missing_config_json_is_named(tmp_path, tensors):
  path = write_checkpoint(str(tmp_path / "ckpt"), tensors)
  os.remove(os.path.join(path, "config.json"))
  with pytest.raises(FileNotFoundError, match=f"no config.json at {os.path.join(path, '')}"):
    models.from_pretrained(path)


@pytest.mark.parametrize("content,message", [
    ("{\"weight_map\": ", "is not valid JSON"),
    ("[\"model-00001-of-00002.safetensors\"]", "holds a JSON list"),
    ("{\"metadata\": {}}", "has no \"weight_map\" object"),
    ("{\"weight_map\": {\"a\": 3}}", "has no \"weight_map\" object"),
])
def test_an_index_that_is_not_a_weight_map_is_named(tmp_path, tensors, content, message):
  path = write_checkpoint(str(tmp_path / "sharded"), tensors, shards=2)
  index = os.path.join(path, "model.safetensors.index.json")
  with open(index, "w") as f:
    f.write(content)
  with pytest.raises(models.CheckpointError) as error:
    models.from_pretrained(path)
  assert str(error.value).startswith(index + " ") and message in str(error.value)


@pytest.mark.parametrize("dtype,code", [(np.int32, "I32"), (np.int64, "I64"), (np.bool_, "BOOL"),
                                        (np.uint8, "U8")])
def test_non_float_weights_are_refused_naming_tensor_and_file(tmp_path, tensors, dtype, code):
  """Integer weights would load as whole numbers and score 0: refused, the tensor named."""
  name = P + "blocks.1.v_proj.weight"
  broken = dict(tensors)
  broken[name] = (broken[name] * 100).astype(dtype)
  path = write_checkpoint(str(tmp_path / "ints"), broken)
  with pytest.raises(models.CheckpointError) as error:
    models.from_pretrained(path)
  assert str(error.value) == (
      f"tensor {name!r} of {os.path.join(path, 'model.safetensors')} has dtype {code}, not a "
      "float (F64, F32, F16, BF16)")
  # float16 and float64 are floats: cast to the parameter dtype, as before.
  halves = write_checkpoint(str(tmp_path / "f16"), {**tensors, name: tensors[name].astype(
      np.float16)})
  assert models.from_pretrained(halves) is not None
