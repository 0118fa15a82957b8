"""Dream (models/dream/): the forward pass against a float64 numpy transcription of the official
modeling code, its checkpoint IO, tokenizer, and the official diffusion generate's rules."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from stabledrl_jax import models
from stabledrl_jax.models import family
from stabledrl_jax.models.dream import Dream, get_dream_config, sampler, tokenizer
from stabledrl_jax.training.config import run_spec

import family_helpers

# A Dream config.json as the release writes it (models/Dream-7B-Instruct/config.json), scaled
# down: grouped-query attention, untied head.
HF_CONFIG = {
    "architectures": ["DreamModel"], "attention_dropout": 0.0, "bos_token_id": 98,
    "eos_token_id": 98, "hidden_act": "silu", "hidden_size": 48, "initializer_range": 0.02,
    "intermediate_size": 80, "mask_token_id": 99, "max_position_embeddings": 256,
    "max_window_layers": 2, "model_type": "Dream", "num_attention_heads": 4,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "pad_token_id": 98, "rms_norm_eps": 1e-6,
    "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_mrope": False, "use_sliding_window": False, "vocab_size": 100,
}


def test_the_7b_config_has_the_released_parameter_count():
  """Dream-v0-Instruct-7B's model.safetensors.index.json: total_size 15231233024 bytes of bf16,
  7615616512 parameters in 339 tensors."""
  config = get_dream_config("dream_7b")
  assert models.count_params(config) == 15231233024 // 2
  layout = family.get("dream").checkpoint
  assert len(layout.param_names(config, layout.config_to_hf(config))) == 339
  assert (config.head_dim, config.mask_token_id, config.eos_token_id) == (128, 151666, 151643)


def random_tensors(hf, seed=0):
  """HF-named float32 tensors in torch layout ([out, in] for Linear weights), biases non-zero."""
  rng = np.random.default_rng(seed)
  d, f, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
  hd = d // hf["num_attention_heads"]
  q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd

  def linear(out_dim, in_dim):
    return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

  def vector(size, mean=0.0, scale=0.2):
    return (mean + scale * rng.standard_normal(size)).astype(np.float32)

  t = {"model.embed_tokens.weight": rng.standard_normal((v, d)).astype(np.float32)}
  for i in range(hf["num_hidden_layers"]):
    p = f"model.layers.{i}."
    t.update({
        p + "input_layernorm.weight": vector(d, 1.0),
        p + "post_attention_layernorm.weight": vector(d, 1.0),
        p + "self_attn.q_proj.weight": linear(q, d), p + "self_attn.q_proj.bias": vector(q),
        p + "self_attn.k_proj.weight": linear(kv, d), p + "self_attn.k_proj.bias": vector(kv),
        p + "self_attn.v_proj.weight": linear(kv, d), p + "self_attn.v_proj.bias": vector(kv),
        p + "self_attn.o_proj.weight": linear(d, q),
        p + "mlp.gate_proj.weight": linear(f, d), p + "mlp.up_proj.weight": linear(f, d),
        p + "mlp.down_proj.weight": linear(d, f),
    })
  t["model.norm.weight"] = vector(d, 1.0)
  t["lm_head.weight"] = linear(v, d)
  return t


def write_checkpoint(path, tensors, hf=HF_CONFIG, shards=1):
  return family_helpers.write_checkpoint(path, tensors, hf, shards)


def official_logits(t, hf, input_ids, attention_mask=None):
  """``DreamModel.forward(input_ids, attention_mask, position_ids).logits`` in float64 numpy, as
  the official diffusion generate calls it (generation_utils.py ``_sample``): with padding, the
  position ids are ``cumsum(mask) - 1`` with padding at 1 and the [B, 1, N, N] mask is
  mask_q AND mask_k; without, positions 0..N-1 and full attention. Written from
  modeling_dream.py (DreamRMSNorm, DreamRotaryEmbedding, apply_rotary_pos_emb, DreamMLP,
  repeat_kv, DreamSdpaAttention, DreamDecoderLayer, DreamBaseModel, DreamModel). A padding
  query attends to nothing: torch's SDPA gives it zeros (its safe softmax), so nothing of it
  reaches a real position; its rows are returned as NaN (they are not compared)."""
  t = {k: np.asarray(v, np.float64) for k, v in t.items()}
  h, kvh, eps = hf["num_attention_heads"], hf["num_key_value_heads"], hf["rms_norm_eps"]
  d = hf["hidden_size"]
  hd = d // h
  b, n = input_ids.shape
  if attention_mask is not None and (attention_mask == 0).any():
    tok_idx = np.cumsum(attention_mask, -1) - 1
    tok_idx[attention_mask == 0] = 1
    allowed = (attention_mask[:, None, :, None] > 0) & (attention_mask[:, None, None, :] > 0)
  else:
    tok_idx = np.broadcast_to(np.arange(n), (b, n))
    allowed = np.ones((b, 1, n, n), bool)

  def rms(x, w):  # DreamRMSNorm
    return w * (x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + eps))

  inv_freq = 1.0 / (hf["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.int64) / hd))
  freqs = tok_idx[:, :, None].astype(np.float64) * inv_freq[None, None, :]  # [B, N, hd/2]
  emb = np.concatenate([freqs, freqs], axis=-1)
  cos, sin = np.cos(emb)[:, None], np.sin(emb)[:, None]  # unsqueeze_dim=1: [B, 1, N, hd]

  def rotate_half(x):
    return np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1)

  hidden = t["model.embed_tokens.weight"][input_ids]
  for i in range(hf["num_hidden_layers"]):
    p = f"model.layers.{i}."
    lin = lambda x, name, bias=False: x @ t[p + name + ".weight"].T + (
        t[p + name + ".bias"] if bias else 0.0)
    residual = hidden
    x = rms(hidden, t[p + "input_layernorm.weight"])
    qs = lin(x, "self_attn.q_proj", True).reshape(b, n, h, hd).transpose(0, 2, 1, 3)
    ks = lin(x, "self_attn.k_proj", True).reshape(b, n, kvh, hd).transpose(0, 2, 1, 3)
    vs = lin(x, "self_attn.v_proj", True).reshape(b, n, kvh, hd).transpose(0, 2, 1, 3)
    qs, ks = qs * cos + rotate_half(qs) * sin, ks * cos + rotate_half(ks) * sin
    ks, vs = np.repeat(ks, h // kvh, axis=1), np.repeat(vs, h // kvh, axis=1)  # repeat_kv
    scores = qs @ ks.transpose(0, 1, 3, 2) / np.sqrt(hd)
    scores = np.where(allowed, scores, -np.inf)
    empty = ~allowed.any(-1, keepdims=True)
    scores = np.where(empty, 0.0, scores)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights = np.where(empty, 0.0, weights / weights.sum(-1, keepdims=True))
    attn = (weights @ vs).transpose(0, 2, 1, 3).reshape(b, n, d)
    hidden = residual + lin(attn, "self_attn.o_proj")
    residual = hidden
    x = rms(hidden, t[p + "post_attention_layernorm.weight"])
    gate = lin(x, "mlp.gate_proj")
    hidden = residual + lin(gate / (1.0 + np.exp(-gate)) * lin(x, "mlp.up_proj"),
                            "mlp.down_proj")
  logits = rms(hidden, t["model.norm.weight"]) @ t["lm_head.weight"].T
  if attention_mask is not None:
    logits = np.where(attention_mask[..., None] > 0, logits, np.nan)
  return logits


def relative_error(got, want):
  keep = ~np.isnan(want)
  got = np.asarray(got, np.float64)
  return float(np.max(np.abs(got - want)[keep]) / np.max(np.abs(want[keep])))


@pytest.fixture(scope="module")
def tensors():
  return random_tensors(HF_CONFIG)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tensors):
  return write_checkpoint(str(tmp_path_factory.mktemp("dream")), tensors)


@pytest.fixture(scope="module")
def loaded(checkpoint):
  return models.from_pretrained(checkpoint)  # dispatches on model_type "Dream"


def test_logits_match_the_official_forward_in_float64(loaded, tensors):
  assert isinstance(loaded, Dream)
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, 98, (2, 12)).astype(np.int32)
  want = official_logits(tensors, HF_CONFIG, tokens)
  got = loaded(jnp.asarray(tokens))
  assert got.shape == (2, 12, 100)
  assert relative_error(got, want) < 1e-5
  # A left-padded batch, as the official generate runs it: position ids skip the padding.
  mask = np.ones((2, 12), np.int64)
  mask[0, :3] = 0
  want = official_logits(tensors, HF_CONFIG, tokens, mask)
  assert np.isnan(want[0, :3]).all() and not np.isnan(want[0, 3:]).any()
  assert relative_error(loaded(jnp.asarray(tokens), jnp.asarray(mask)), want) < 1e-5
  # The padded row's real tokens see what an unpadded row of them alone sees.
  alone = official_logits(tensors, HF_CONFIG, tokens[:1, 3:])
  assert relative_error(np.asarray(loaded(jnp.asarray(tokens), jnp.asarray(mask)))[:1, 3:],
                        alone) < 1e-5


def test_predictions_are_the_generate_shift_and_the_suffix_is_their_tail(loaded):
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 98, (3, 10)), jnp.int32)
  mask = jnp.asarray(np.arange(10)[None] >= np.array([[0], [2], [5]]))
  raw = loaded(tokens, mask)
  shifted = loaded.predictions(tokens, mask)
  np.testing.assert_array_equal(shifted, jnp.concatenate([raw[:, :1], raw[:, :-1]], axis=1))
  np.testing.assert_allclose(loaded.predictions(tokens, mask, suffix=4), shifted[:, -4:],
                             rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="suffix=10"):
    loaded.predictions(tokens, mask, suffix=10)


def test_save_then_load_round_trips(tmp_path, tensors, loaded):
  family_helpers.assert_saves_and_reloads(
      loaded, str(tmp_path / "saved"), tensors, HF_CONFIG,
      ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
       "intermediate_size", "rms_norm_eps", "rope_theta", "vocab_size", "mask_token_id",
       "eos_token_id", "model_type", "tie_word_embeddings"))


def test_tied_embeddings_load_into_the_head(tmp_path, tensors):
  tied = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
  path = write_checkpoint(str(tmp_path / "tied"), tied, {**HF_CONFIG, "tie_word_embeddings": True})
  model = models.from_pretrained(path)
  np.testing.assert_array_equal(model.lm_head.kernel[...], tensors["model.embed_tokens.weight"].T)


@pytest.mark.parametrize("edit, error, message", [
    (lambda t, hf: t.pop("model.layers.1.self_attn.v_proj.bias"), models.CheckpointError,
     "layers.1.self_attn.v_proj.bias"),
    (lambda t, hf: t.update({"model.layers.0.self_attn.o_proj.bias": np.zeros(48, np.float32)}),
     models.CheckpointError, "o_proj.bias"),
    (lambda t, hf: hf.update(use_sliding_window=True), NotImplementedError, "use_sliding_window"),
    (lambda t, hf: hf.update(rope_scaling={"type": "yarn", "factor": 4.0}), NotImplementedError,
     "rope_scaling"),
    (lambda t, hf: hf.pop("mask_token_id"), models.CheckpointError, "mask_token_id"),
])
def test_bad_checkpoints_are_refused_by_name(tmp_path, tensors, edit, error, message):
  broken, hf = dict(tensors), dict(HF_CONFIG)
  edit(broken, hf)
  path = write_checkpoint(str(tmp_path / "broken"), broken, hf)
  with pytest.raises(error, match=message.replace(".", r"\.")):
    models.from_pretrained(path)


def test_the_chat_template_renders_as_the_official_one():
  """tokenizer_config.json's chat_template for [{"role": "user", "content": ...}] with
  add_generation_prompt=True: Qwen2's default system turn, the user turn, the assistant's."""
  assert tokenizer.chat_prompt("What is 2+2?", assistant_prefix="<reasoning>") == (
      "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
      "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<reasoning>")


def test_a_tokenizer_without_the_published_ids_is_refused(tmp_path):
  import tokenizers as hf_tokenizers  # pylint: disable=g-import-not-at-top
  vocab = {"[UNK]": 0, "a": 1, "b": 2}
  tok = hf_tokenizers.Tokenizer(hf_tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
  tok.add_special_tokens([tokenizer.EOS, tokenizer.EOT, tokenizer.MASK])
  path = tmp_path / "tokenizer.json"
  tok.save(str(path))
  loose = tokenizer.load(path, check_ids=False)
  assert (loose.mask_id, loose.eos_id, loose.eot_id) == (5, 3, 4)
  with pytest.raises(ValueError, match="Not Dream's special-token ids"):
    tokenizer.load(path)


# ---------------------------------------------------------------------------
# The sampler: the official generate's schedule and rules (generation_utils.py).
# ---------------------------------------------------------------------------


def test_the_schedule_and_reveal_counts_are_the_official_arithmetic():
  steps, eps = 7, 1e-3
  # torch.linspace(1, eps, steps + 1) in float32 (ATen's CPU kernel: step = (end - start) /
  # (n - 1); i < n / 2: start + step * i, else end - step * (n - 1 - i)).
  n, one, end = steps + 1, np.float32(1), np.float32(eps)
  step = (end - one) / np.float32(steps)
  t = np.array([one + step * np.float32(i) if i < n / 2 else end - step * np.float32(n - 1 - i)
                for i in range(n)], np.float32)
  np.testing.assert_array_equal(sampler.schedule(steps, eps), t)
  np.testing.assert_allclose(t, np.linspace(1, eps, n), rtol=1e-6)
  for masked in (1, 5, 33, 64):
    for i in range(steps):
      want = (int(np.float32(masked) * (np.float32(1) - t[i + 1] / t[i])) if i < steps - 1
              else masked)
      got = sampler.reveal_counts(jnp.array([masked]), i, steps, sampler.schedule(steps, eps))
      assert int(got[0]) == want, (masked, i)


def official_top_p(logits, top_p):
  """top_p_logits of generation_utils.py in numpy (sort, cumsum, shift right, scatter)."""
  order = np.argsort(-logits, axis=-1, kind="stable")
  sorted_logits = np.take_along_axis(logits, order, -1)
  e = np.exp(sorted_logits - sorted_logits.max(-1, keepdims=True))
  cumulative = np.cumsum(e / e.sum(-1, keepdims=True), -1)
  remove = cumulative > top_p
  remove[..., 1:] = remove[..., :-1].copy()
  remove[..., 0] = False
  mask = np.zeros_like(remove)
  np.put_along_axis(mask, order, remove, -1)
  return np.where(mask, np.finfo(logits.dtype).min, logits)


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_and_top_k_filter_as_the_official_functions(top_p):
  logits = np.random.default_rng(3).standard_normal((4, 6, 50)).astype(np.float32) * 2
  got = sampler.process_logits(jnp.asarray(logits), temperature=0.0, top_p=top_p, top_k=None)
  np.testing.assert_array_equal(np.asarray(got), official_top_p(logits, top_p))
  got = sampler.process_logits(jnp.asarray(logits), temperature=0.0, top_p=None, top_k=5)
  kept = np.asarray(got) > np.finfo(np.float32).min
  assert (kept.sum(-1) == 5).all()
  np.testing.assert_array_equal(kept, logits >= np.sort(logits, -1)[..., -5:-4])


def test_confidences_are_the_official_ones():
  logits = jnp.asarray(np.random.default_rng(4).standard_normal((3, 20)), jnp.float32)
  p = np.asarray(jax.nn.softmax(logits, -1), np.float64)
  key = jax.random.key(0)
  kw = dict(temperature=0.0, top_p=None, top_k=None)
  score, tokens = sampler.sample_tokens(logits, key, **kw)
  np.testing.assert_array_equal(tokens, p.argmax(-1))
  np.testing.assert_allclose(score, p.max(-1), rtol=1e-6)
  score, _ = sampler.sample_tokens(logits, key, confidence="margin", **kw)
  top = np.sort(p, -1)
  np.testing.assert_allclose(score, top[:, -1] - top[:, -2], rtol=1e-5)
  score, _ = sampler.sample_tokens(logits, key, confidence="neg_entropy", **kw)
  np.testing.assert_allclose(score, (p * np.log(p + 1e-10)).sum(-1), rtol=1e-5)


@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin", "entropy"])
def test_a_confidence_step_reveals_the_official_count_most_confident_first(alg):
  rng = np.random.default_rng(5)
  steps, mask_id = 4, 99
  x = jnp.asarray(np.where(rng.random((2, 16)) < 0.75, mask_id, 7), jnp.int32)
  x = x.at[1].set(x[0])  # One masked count per batch, as every batch here has.
  logits = jnp.asarray(rng.standard_normal((2, 16, 99)) * 3, jnp.float32)
  settings = sampler.Sampling(gen_length=16, steps=steps, alg=alg)
  timesteps = sampler.schedule(steps, settings.eps)
  masked = np.asarray(x == mask_id)
  score, tokens = sampler.sample_tokens(logits, jax.random.key(0), temperature=0.0, top_p=None,
                                        top_k=None, confidence=sampler._CONFIDENCE[alg])
  for i in range(steps):
    out = np.asarray(sampler.step(x, logits, jax.random.key(1), i, settings, mask_id, timesteps))
    count = int(sampler.reveal_counts(jnp.asarray(masked.sum(-1)), i, steps, timesteps)[0])
    revealed = masked & (out != mask_id)
    assert (revealed.sum(-1) == count).all()
    np.testing.assert_array_equal(out[~masked], np.asarray(x)[~masked])  # Decoded stay.
    for row in range(2):  # The revealed are the most confident masked positions.
      conf = np.where(masked[row], np.asarray(score[row]), -np.inf)
      best = np.sort(np.argsort(-conf, kind="stable")[:count])
      np.testing.assert_array_equal(np.flatnonzero(revealed[row]), best)
      np.testing.assert_array_equal(out[row][revealed[row]], np.asarray(tokens[row])[revealed[row]])


def test_origin_reveals_each_masked_position_with_probability_1_minus_s_over_t():
  steps, mask_id = 5, 99
  settings = sampler.Sampling(gen_length=4000, steps=steps, alg="origin")
  timesteps = sampler.schedule(steps, settings.eps)
  x = jnp.full((1, 4000), mask_id, jnp.int32)
  logits = jnp.zeros((1, 4000, 99), jnp.float32)
  for i in range(steps):
    out = sampler.step(x, logits, jax.random.key(i), i, settings, mask_id, timesteps)
    share = float(jnp.mean(out != mask_id))
    want = 1.0 if i == steps - 1 else float(1 - timesteps[i + 1] / timesteps[i])
    assert abs(share - want) < 4 * np.sqrt(want * (1 - want) / 4000) + 1e-9, (i, share, want)


def test_alg_temp_draws_positions_without_replacement_by_softmax_of_confidence():
  """Gumbel top-1 of score / alg_temp is a draw from softmax(score / alg_temp): the first
  position revealed, counted over many keys, against the official multinomial's law."""
  mask_id, alg_temp = 99, 0.5
  x = jnp.full((1, 4), mask_id, jnp.int32)
  logits = jnp.asarray(np.array([[[3.0, 0, 0], [1.0, 0, 0], [0.5, 0, 0], [0.0, 0, 0]]]) * 1.0,
                       jnp.float32)
  logits = jnp.pad(logits, ((0, 0), (0, 0), (0, 96)), constant_values=-1e9)
  score, _ = sampler.sample_tokens(logits, jax.random.key(0), temperature=0.0, top_p=None,
                                   top_k=None)
  law = np.asarray(jax.nn.softmax(score[0] / alg_temp), np.float64)
  # Of 4 masked positions, step 0 of 2 reveals floor(4 * (1 - t1 / t0)) = 1.
  steps2 = sampler.Sampling(gen_length=4, steps=2, alg="maskgit_plus", alg_temp=alg_temp)
  t2 = sampler.schedule(2, steps2.eps)
  assert int(sampler.reveal_counts(jnp.array([4]), 0, 2, t2)[0]) == 1
  step = jax.jit(lambda key: sampler.step(x, logits, key, 0, steps2, mask_id, t2))
  draws = 4000
  first = np.array([int(np.argmax(np.asarray(step(jax.random.key(k))[0]) != mask_id))
                    for k in range(draws)])
  counts = np.bincount(first, minlength=4) / draws
  assert np.all(np.abs(counts - law) < 4 * np.sqrt(law * (1 - law) / draws) + 1e-3), (counts, law)


@pytest.mark.parametrize("alg", sampler.ALGS)
def test_generate_ends_with_no_mask_and_keeps_the_prompt(alg):
  model = Dream(get_dream_config("tiny"), rngs=nnx.Rngs(0))
  prompt = jnp.asarray(np.random.default_rng(6).integers(0, 120, (3, 5)), jnp.int32)
  mask = jnp.asarray(np.arange(5)[None] >= np.array([[0], [1], [3]]))
  settings = sampler.Sampling(gen_length=8, steps=3, alg=alg, temperature=0.7, top_p=0.9)
  tokens, stats = sampler.sample(model, prompt, mask, jax.random.key(0), settings)
  assert tokens.shape == (3, 13)
  np.testing.assert_array_equal(tokens[:, :5], prompt)
  assert not bool(jnp.any(tokens == model.config.mask_token_id))
  np.testing.assert_array_equal(stats["model_calls"], [3, 3, 3])


def test_the_family_maps_the_common_options_and_refuses_the_others_in_one_line():
  config = get_dream_config("tiny")
  d = run_spec.Decoding(gen_length=32, steps=16, block_length=32, remasking="entropy",
                        temperature=0.5)
  assert family.get("dream").sampling(d, config) == sampler.Sampling(
      gen_length=32, steps=16, alg="entropy", temperature=0.5)
  for change, message in ((dict(block_length=8), "block_length=8"),
                          (dict(cache="dual"), "no KV cache"),
                          (dict(remasking="low_confidence"), "generate algs"),
                          (dict(cfg_scale=1.0), "guidance")):
    with pytest.raises(ValueError, match=message) as error:
      d.with_options(**change).check(config)
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------------
# RL on Dream: every objective updates the model through its shifted predictions.
# ---------------------------------------------------------------------------

OBJECTIVES = [
    ("stabledrl", {}),
    ("stabledrl", {"objective.stabledrl.surrogate": "sandwich", "estimator.method": ""}),
    ("grpo", {"objective.grpo.level": "token", "estimator.method": ""}),  # d1: mean_field
    ("grpo", {"objective.grpo.level": "sequence"}),
    ("espo", {"estimator.method": ""}),  # Its own ELBO with complements.
    ("espo", {"estimator.method": "", "estimator.coupled": False,
              "estimator.num_samples": 1}),  # The option without complements.
    ("spg", {}),
    ("wd1", {}),
]


def dream_config(**updates):
  from stabledrl_jax.training.config import config_lib  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.loop import sweep
  c = config_lib.get("quickstart")
  c.model.family = "dream"
  c.rollout.update(remasking="entropy", num_prompts=2, group_size=4, steps=8)
  return sweep.with_overrides(c, updates)


def _batch(model_config, n=8, prompt=6, gen=10, seed=0):
  """Left-padded prompts, completions ending in EOS padding (ids 4 .. 27)."""
  return family_helpers.random_batch(model_config.eos_token_id, n=n, prompt=prompt, gen=gen,
                                     seed=seed, num_tokens=24, min_prompt=2, min_completion=3,
                                     pad_prompt=True)


@pytest.mark.parametrize("objective,extra", OBJECTIVES)
def test_every_objective_updates_a_dream_model(objective, extra):
  import dataclasses  # pylint: disable=g-import-not-at-top
  import functools  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.config import specs  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.inputs import data
  from stabledrl_jax.training.step import train_step
  config = dream_config(**{"objective.name": objective, "rollout.gen_length": 10,
                           "rollout.block_length": 10, "rollout.steps": 10, "eval.steps": 10,
                           **extra})
  specs.validate(config)
  model_config = specs.model_config(config, data.make_tokenizer(config.tokenizer))
  assert type(model_config).__name__ == "DreamConfig"
  model = models.init_model(model_config.replace(num_hidden_layers=1), seed=0)
  graphdef, params = nnx.split(model, nnx.Param)
  batch = _batch(model_config)
  run = dataclasses.replace(specs.resolve_run(config, model_config), group_size=4,
                            num_microbatches=2)
  old = jax.jit(functools.partial(train_step.estimate_no_grad, graphdef=graphdef, run=run))(
      params, batch, jax.random.key(1))
  assert np.all(np.isfinite(old))
  tx = optax.adam(1e-3)
  state = train_step.create_train_state(params, tx, seed=0)
  update = jax.jit(functools.partial(train_step.update_step, graphdef=graphdef, tx=tx, run=run))
  new_state, metrics = update(state, batch.replace(old_logp=old, ref_logp=old - 0.1),
                              jax.random.key(2))
  assert np.isfinite(float(metrics["loss"])) and int(metrics["skipped"]) == 0
  assert float(metrics["grad_norm"]) > 0
  changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), params, new_state.params)
  assert all(jax.tree.leaves(changed))  # The q, k, v biases and the head included.


def test_the_likelihood_reads_the_shifted_rows():
  """mean_field's log-probability of a completion (the prompt kept clean), through the family's
  likelihood function, is the float64 sum over the masked completion of log softmax(the raw
  logits of the position before)."""
  from stabledrl_jax import estimators  # pylint: disable=g-import-not-at-top
  model = Dream(get_dream_config("tiny", num_hidden_layers=1), rngs=nnx.Rngs(1))
  batch = _batch(model.config, n=2, seed=3)
  fn = family.likelihood_fn(model, batch.attention_mask)
  logp = estimators.estimate_logp(fn, batch.tokens, batch.prompt_mask, batch.completion_mask,
                                  jax.random.key(0), method="mean_field",
                                  mask_id=model.config.mask_token_id, suffix=10,
                                  prompt_mask_prob=0.0)
  noisy = np.where(np.asarray(batch.completion_mask), model.config.mask_token_id,
                   np.asarray(batch.tokens))
  past = np.asarray(estimators.past_completion(batch.prompt_mask, batch.completion_mask))
  noisy = np.where(past, model.config.mask_token_id, noisy)
  raw = np.asarray(model(jnp.asarray(noisy), batch.attention_mask), np.float64)
  logprobs = raw - raw.max(-1, keepdims=True)
  logprobs -= np.log(np.exp(logprobs).sum(-1, keepdims=True))
  tokens = np.asarray(batch.tokens)
  want = [sum(logprobs[b, i - 1, tokens[b, i]] for i in np.flatnonzero(batch.completion_mask[b]))
          for b in range(2)]
  np.testing.assert_allclose(np.asarray(logp), want, rtol=1e-5)


def test_a_dream_workdir_exports_to_a_checkpoint_that_loads_with_the_same_logits(tmp_path):
  """A tiny Dream run (char tokenizer, no supervised start) exported in the Hugging Face layout:
  the official tensor names, and the same logits when loaded back."""
  from stabledrl_jax import export  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.loop import trainer  # pylint: disable=g-import-not-at-top
  config = dream_config(**{"sft.num_steps": 0, "train.num_steps": 1, "train.num_iterations": 1,
                           "eval.every_steps": 0, "data.train_size": 16, "data.eval_size": 4,
                           "checkpoint.every_steps": 1})
  workdir = tmp_path / "run"
  run = trainer.Trainer(config, str(workdir))
  run.run()
  out = tmp_path / "hf"
  export.export(str(workdir), str(out))
  written = load_file(os.path.join(out, "model.safetensors"))
  assert "model.layers.0.self_attn.q_proj.bias" in written and "lm_head.weight" in written
  assert json.loads((out / "config.json").read_text())["model_type"] == "Dream"
  loaded = models.from_pretrained(str(out))
  trained = nnx.merge(run.parts.graphdef, run.state.params)
  tokens = jnp.arange(24).reshape(2, 12) % loaded.config.vocab_size
  np.testing.assert_allclose(np.asarray(loaded(tokens)), np.asarray(trained(tokens)), rtol=1e-5,
                             atol=1e-5)


def test_espo_s_dream_recipe_scores_each_mask_and_its_complement():
  """ESPO's code always runs the complementary pass (``_get_elbo_mc`` defaults to
  reduce_var=True and its callers never pass the recipe's ``reduce_var false``): the recipe's
  config keeps it, with one sample (num_mc 1); dropping it is an option."""
  from stabledrl_jax.training.config import config_lib, specs  # pylint: disable=g-import-not-at-top
  config = config_lib.get("dream7b_espo")
  settings = specs.estimator_settings(config)
  assert (settings["method"], settings["num_samples"], settings["coupled"]) == (
      "espo_elbo", 1, True)
  assert config_lib.get("dream7b_espo:gsm8k").estimator.coupled


def test_espo_s_dream_recipe_warms_up_over_a_thousandth_of_its_updates():
  """warmup_ratio 0.001 (run_demo_dream.sh:30) of the run's updates, rounded up as transformers
  does (``math.ceil(ratio * max_steps)``)."""
  import math  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.config import config_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.get("dream7b_espo")
  updates = config.train.num_steps * config.train.num_iterations
  assert config.optimizer.warmup_steps == math.ceil(0.001 * updates) == 8
