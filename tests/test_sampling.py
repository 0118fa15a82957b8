"""The low-confidence remasking sampler: schedule, determinism, known answers, CFG, EOS, and
agreement with a plain numpy transcription of LLaDA's reference generate loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stabledrl_jax import models
from stabledrl_jax.models import sampler_lib
from stabledrl_jax.models.llada.sampler import generate
from stabledrl_jax.models.sampler_lib import categorical, completion_mask, num_transfer_tokens

CONFIG = models.get_config("tiny")
MASK, EOS, V = CONFIG.mask_token_id, CONFIG.eos_token_id, CONFIG.embedding_size


class TableModel(nnx.Module):
  """A hand-built 'model' whose logits at position i are table[i], whatever the input.

  With `uncond_table`, rows whose first token is the mask token (the unconditional CFG pass, which
  masks the prompt) get uncond_table instead.
  """

  def __init__(self, table, uncond_table=None):
    self.config = CONFIG
    self.table = nnx.Variable(jnp.asarray(table, jnp.float32))
    self.uncond = nnx.Variable(jnp.asarray(table if uncond_table is None else uncond_table,
                                           jnp.float32))

  def encode(self, tokens, attention_mask=None, *, span=None):
    masked_prompt = (tokens[:, 0] == MASK)[:, None, None]
    hidden = jnp.where(masked_prompt, self.uncond[...][None], self.table[...][None])
    return jax.lax.dynamic_slice_in_dim(hidden, span[0], span[1], axis=1) if span else hidden

  def unembed(self, hidden):
    return hidden


def answer_table(length, answer_start, answer, margins):
  """Logits preferring answer[j] at position answer_start + j by margins[j] (nats)."""
  table = np.zeros((length, V), np.float32)
  for j, (token, margin) in enumerate(zip(answer, margins)):
    table[answer_start + j, token] = margin
  return table


@pytest.fixture(scope="module")
def tiny():
  return models.LLaDA(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def prompt():
  return jax.random.randint(jax.random.key(7), (3, 5), 0, 100, jnp.int32)


def test_num_transfer_tokens_follows_llada_schedule():
  got = num_transfer_tokens(jnp.array([8, 7, 3, 0]), 3)
  np.testing.assert_array_equal(got, [[3, 3, 2], [3, 2, 2], [1, 1, 1], [0, 0, 0]])
  for n in range(0, 40):
    for steps in range(1, 12):
      row = np.asarray(num_transfer_tokens(jnp.array([n]), steps))[0]
      assert row.sum() == n and row.max() - row.min() <= 1 and np.all(np.diff(row) <= 0)


@pytest.mark.parametrize("vocab, temperature", [(5, 1.0), (300, 0.7)])
def test_categorical_draws_from_the_tempered_softmax(vocab, temperature):
  logits = jax.random.normal(jax.random.key(0), (vocab,)) * 2.0
  logits = logits.at[1].set(-jnp.inf).at[vocab - 1].set(-jnp.inf)  # Never drawn.
  draws = 100_000
  keys = jax.random.split(jax.random.key(1), draws)
  got = jax.jit(jax.vmap(lambda k: categorical(k, logits, temperature)))(keys)
  freq = np.bincount(np.asarray(got), minlength=vocab) / draws
  want = np.asarray(jax.nn.softmax(logits / temperature))
  assert freq[1] == 0 and freq[vocab - 1] == 0
  # Binomial standard errors: every frequency within 5 of them.
  np.testing.assert_array_less(np.abs(freq - want), 5 * np.sqrt(want * (1 - want) / draws) + 1e-9)


def test_categorical_is_the_argmax_of_a_sure_distribution():
  logits = jnp.full((4, 3, 128), -jnp.inf).at[..., 77].set(0.0)
  keys = jax.random.key(2)
  np.testing.assert_array_equal(categorical(keys, logits, 1.0), np.full((4, 3), 77))


def test_prompt_untouched_no_mask_left_and_schedule_kept(tiny, prompt):
  gen_length, block_length, steps = 16, 8, 6  # 3 steps per block: 3, 3, 2 tokens
  for kwargs in (dict(), dict(temperature=1.0), dict(remasking="random", temperature=0.5)):
    tokens, reveal = generate(tiny, prompt, key=jax.random.key(0), gen_length=gen_length,
                              steps=steps, block_length=block_length, return_reveal_step=True,
                              **kwargs)
    assert tokens.shape == (3, 5 + gen_length)
    np.testing.assert_array_equal(tokens[:, :5], prompt)
    assert not np.any(np.asarray(tokens) == MASK), kwargs
    schedule = [3, 3, 2, 3, 3, 2]
    for row in np.asarray(reveal):
      np.testing.assert_array_equal(np.bincount(row, minlength=steps), schedule)
      # Blocks are decoded left to right: block 0 in steps 0-2, block 1 in steps 3-5.
      assert row[:8].max() <= 2 and row[8:].min() >= 3


def test_steps_equal_to_gen_length_reveal_one_token_per_step(tiny, prompt):
  _, reveal = generate(tiny, prompt, key=jax.random.key(0), gen_length=8, steps=8,
                       block_length=4, return_reveal_step=True)
  for row in np.asarray(reveal):
    np.testing.assert_array_equal(np.sort(row), np.arange(8))


def test_greedy_output_does_not_depend_on_the_key(tiny, prompt):
  run = lambda seed: generate(tiny, prompt, key=jax.random.key(seed), gen_length=16, steps=8,
                              block_length=8)
  np.testing.assert_array_equal(run(0), run(1))


def test_sampling_is_reproducible_from_the_key(tiny, prompt):
  run = lambda seed: np.asarray(generate(tiny, prompt, key=jax.random.key(seed), gen_length=16,
                                         steps=8, block_length=8, temperature=1.0))
  np.testing.assert_array_equal(run(3), run(3))
  assert not np.array_equal(run(3), run(4))


def test_hand_built_model_produces_its_answer_most_confident_first():
  prompt = jnp.array([[1, 2, 3]], jnp.int32)
  answer = [10, 20, 30, 40, 50, 60, 70, 80]
  margins = [2.0, 6.0, 1.0, 5.0, 3.0, 8.0, 4.0, 7.0]
  model = TableModel(answer_table(11, 3, answer, margins))
  tokens, reveal = generate(model, prompt, key=jax.random.key(0), gen_length=8, steps=8,
                            block_length=8, return_reveal_step=True)
  np.testing.assert_array_equal(tokens[0, 3:], answer)
  # One token per step, in decreasing order of the model's confidence.
  np.testing.assert_array_equal(np.argsort(np.asarray(reveal[0])), np.argsort(-np.array(margins)))
  # Within semi-autoregressive blocks of 4, the confidence order holds inside each block.
  _, reveal = generate(model, prompt, key=jax.random.key(0), gen_length=8, steps=8,
                       block_length=4, return_reveal_step=True)
  np.testing.assert_array_equal(reveal[0], [2, 0, 3, 1, 7, 4, 6, 5])


def test_confidence_is_the_probability_of_the_prediction_not_its_logit():
  prompt = jnp.array([[1, 2, 3]], jnp.int32)
  table = np.zeros((5, V), np.float32)
  table[3, 10], table[3, 11] = 5.0, 4.95  # top logit 5.0 but p = 0.36: a close runner-up
  table[4, 20] = 4.5                      # top logit 4.5, p = 0.42
  _, reveal = generate(TableModel(table), prompt, key=jax.random.key(0), gen_length=2, steps=2,
                       block_length=2, return_reveal_step=True)
  np.testing.assert_array_equal(reveal[0], [1, 0])


def test_random_remasking_still_decodes_the_argmax():
  prompt = jnp.array([[1, 2, 3], [4, 5, 6]], jnp.int32)
  answer = [11, 22, 33, 44, 55, 66, 77, 88]
  model = TableModel(answer_table(11, 3, answer, [4.0] * 8))
  tokens, reveal = generate(model, prompt, key=jax.random.key(5), gen_length=8, steps=8,
                            block_length=8, remasking="random", return_reveal_step=True)
  np.testing.assert_array_equal(tokens[:, 3:], [answer, answer])
  orders = {tuple(np.asarray(r)) for r in reveal}
  assert len(orders) == 2  # rows draw different random reveal orders


def test_classifier_free_guidance_combines_conditional_and_unconditional_logits():
  prompt = jnp.array([[1, 2, 3]], jnp.int32)
  cond = np.zeros((7, V), np.float32)
  uncond = np.zeros((7, V), np.float32)
  cond[3:, 10], cond[3:, 20] = 1.0, 0.9      # the conditional pass prefers 10, barely
  uncond[3:, 10], uncond[3:, 20] = 1.0, 0.0  # the unconditional pass prefers 10 more
  model = TableModel(cond, uncond)
  run = lambda scale: generate(model, prompt, key=jax.random.key(0), gen_length=4, steps=4,
                               block_length=4, cfg_scale=scale)
  np.testing.assert_array_equal(run(0.0)[0, 3:], [10] * 4)
  # uncond + 2 (cond - uncond): 10 -> 1.0, 20 -> 1.8.
  np.testing.assert_array_equal(run(1.0)[0, 3:], [20] * 4)


def test_stop_at_eos_fills_after_the_first_eos_and_skips_later_blocks():
  prompt = jnp.array([[1, 2, 3]], jnp.int32)
  answer = [10, 11, EOS, 12, 13, 14, 15, 16, 17, 18, 19, 20]
  model = TableModel(answer_table(15, 3, answer, [3.0] * 12))
  full = generate(model, prompt, key=jax.random.key(0), gen_length=12, steps=6, block_length=4)
  np.testing.assert_array_equal(full[0, 3:], answer)
  tokens, reveal = generate(model, prompt, key=jax.random.key(0), gen_length=12, steps=6,
                            block_length=4, stop_at_eos=True, return_reveal_step=True)
  np.testing.assert_array_equal(tokens[0, 3:], [10, 11, EOS] + [EOS] * 9)
  assert np.all(np.asarray(reveal[0, 4:]) == -1)  # blocks 2 and 3 were never run
  np.testing.assert_array_equal(completion_mask(tokens, 3, EOS)[0], [1, 1, 1] + [0] * 9)


def test_completion_mask():
  tokens = jnp.array([[0, 5, EOS, 5, EOS], [0, 5, 5, 5, 5]])
  np.testing.assert_array_equal(completion_mask(tokens, 1, EOS),
                                [[1, 1, 0, 0], [1, 1, 1, 1]])


def reference_generate(logits_fn, prompt, gen_length, steps, block_length, cfg_scale=0.0):
  """LLaDA's generate() (greedy, low_confidence) transcribed to numpy.

  The one intended difference: the mask token's logit is set to -inf (our sampler never
  reveals a mask token).
  """
  batch, prompt_len = prompt.shape
  x = np.full((batch, prompt_len + gen_length), MASK, np.int64)
  x[:, :prompt_len] = prompt
  prompt_index = x != MASK
  num_blocks = gen_length // block_length
  steps_per_block = steps // num_blocks
  for block in range(num_blocks):
    lo = prompt_len + block * block_length
    hi = lo + block_length
    block_masked = (x[:, lo:hi] == MASK).sum(1)
    schedule = np.array([[n // steps_per_block + (i < n % steps_per_block)
                          for i in range(steps_per_block)] for n in block_masked])
    for i in range(steps_per_block):
      mask_index = x == MASK
      if cfg_scale > 0:
        un_x = np.where(prompt_index, MASK, x)
        both = np.asarray(logits_fn(np.concatenate([x, un_x])), np.float64)
        logits = both[batch:] + (cfg_scale + 1) * (both[:batch] - both[batch:])
      else:
        logits = np.asarray(logits_fn(x), np.float64)
      logits[..., MASK] = -np.inf
      x0 = logits.argmax(-1)
      p = np.exp(logits - logits.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      x0_p = np.take_along_axis(p, x0[..., None], -1)[..., 0]
      x0_p[:, hi:] = -np.inf
      x0 = np.where(mask_index, x0, x)
      confidence = np.where(mask_index, x0_p, -np.inf)
      for j in range(batch):
        chosen = np.argsort(-confidence[j], kind="stable")[:schedule[j, i]]
        x[j, chosen] = x0[j, chosen]
  return x


@pytest.fixture(scope="module")
def peaked():
  """The tiny model with logits scaled x4: peaked distributions, as a trained model has, so that
  the probability order of the predictions differs from their logit order."""
  model = models.LLaDA(CONFIG, rngs=nnx.Rngs(1))
  model.lm_head.kernel[...] = 4.0 * model.lm_head.kernel[...]
  return model


@pytest.mark.parametrize("cfg_scale", [0.0, 0.5])
def test_matches_the_reference_loop(peaked, prompt, cfg_scale):
  logits_fn = jax.jit(lambda t: peaked(jnp.asarray(t, jnp.int32)))
  want = reference_generate(logits_fn, np.asarray(prompt), 16, 8, 8, cfg_scale)
  got = generate(peaked, prompt, key=jax.random.key(0), gen_length=16, steps=8, block_length=8,
                 cfg_scale=cfg_scale)
  np.testing.assert_array_equal(got, want)


def test_left_padded_prompts_decode_like_unpadded_ones(tiny, prompt):
  pad = 3
  padded = jnp.concatenate([jnp.zeros((3, pad), jnp.int32), prompt], axis=1)
  prompt_mask = jnp.arange(pad + 5)[None].repeat(3, 0) >= pad
  got = generate(tiny, padded, key=jax.random.key(0), gen_length=8, steps=4, block_length=8,
                 prompt_mask=prompt_mask)
  want = generate(tiny, prompt, key=jax.random.key(0), gen_length=8, steps=4, block_length=8)
  np.testing.assert_array_equal(got[:, pad:], want)


@pytest.mark.parametrize("kwargs, message", [
    (dict(gen_length=10, block_length=4, steps=4), "multiple of block_length"),
    (dict(gen_length=8, block_length=4, steps=3), "multiple of the number of blocks"),
    (dict(gen_length=8, block_length=4, steps=4, remasking="top_p"), "remasking"),
    (dict(gen_length=8, block_length=4, steps=4, remasking="threshold", threshold=1.5),
     "threshold"),
])
def test_invalid_arguments_are_rejected(tiny, prompt, kwargs, message):
  with pytest.raises(ValueError, match=message):
    generate(tiny, prompt, key=jax.random.key(0), **kwargs)


# ---------------------------------------------------------------------------
# Threshold decoding.
# ---------------------------------------------------------------------------


class RowTableModel(nnx.Module):
  """Logits tables[tokens[b, 0]] for row b: each prompt's first token picks its own table."""

  def __init__(self, tables):
    self.config = CONFIG
    self.tables = nnx.Variable(jnp.asarray(tables, jnp.float32))

  def encode(self, tokens, attention_mask=None, *, span=None):
    hidden = self.tables[...][tokens[:, 0]]
    return jax.lax.dynamic_slice_in_dim(hidden, span[0], span[1], axis=1) if span else hidden

  def unembed(self, hidden):
    return hidden


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_threshold_one_reveals_one_token_per_step_like_low_confidence(tiny, prompt, temperature):
  # No probability exceeds 1: each step reveals only the most confident token, which is
  # low_confidence with one step per token (and the same noise, step for step).
  kw = dict(key=jax.random.key(3), gen_length=16, block_length=8, temperature=temperature,
            return_reveal_step=True)
  tokens, reveal, stats = generate(tiny, prompt, steps=1, remasking="threshold", threshold=1.0,
                                   return_stats=True, **kw)
  want_tokens, want_reveal = generate(tiny, prompt, steps=16, **kw)
  np.testing.assert_array_equal(tokens, want_tokens)
  np.testing.assert_array_equal(reveal, want_reveal)
  np.testing.assert_array_equal(stats["model_calls"], [16, 16, 16])
  assert int(stats["forward_passes"]) == 16


def test_threshold_zero_reveals_a_whole_block_per_call(tiny, prompt):
  tokens, reveal, stats = generate(tiny, prompt, key=jax.random.key(0), gen_length=16, steps=16,
                                   block_length=8, remasking="threshold", threshold=0.0,
                                   return_reveal_step=True, return_stats=True)
  assert not np.any(np.asarray(tokens) == MASK)
  np.testing.assert_array_equal(reveal, np.repeat([[0] * 8 + [8] * 8], 3, axis=0))
  np.testing.assert_array_equal(stats["model_calls"], [2, 2, 2])  # One call per block.
  # Each position gets the greedy prediction of the fully masked block.
  greedy_block = jnp.argmax(tiny(jnp.concatenate(
      [prompt, jnp.full((3, 16), MASK, jnp.int32)], axis=1))[:, 5:13], axis=-1)
  np.testing.assert_array_equal(tokens[:, 5:13], greedy_block)


def test_threshold_greedy_is_deterministic_and_keeps_the_prompt(tiny):
  prompt = jnp.array([[4, MASK, 9], [MASK, 1, 2]], jnp.int32)  # Masks inside prompts stay.
  run = lambda seed: generate(tiny, prompt, key=jax.random.key(seed), gen_length=16, steps=16,
                              block_length=8, remasking="threshold", threshold=0.05)
  out = run(0)
  np.testing.assert_array_equal(out, run(1))
  np.testing.assert_array_equal(out[:, :3], prompt)
  assert not np.any(np.asarray(out[:, 3:]) == MASK)


def test_threshold_call_count_is_what_the_loop_did():
  # p = e^8 / (e^8 + 126) = 0.96 for a margin of 8 nats, 0.055 for 2 (V = 128, mask excluded).
  # Row 0 is sure of all 8 tokens (one call), row 1 of none (one token per call), row 2 of half
  # (one call for those, then one per token).
  answer = list(range(10, 18))
  margins = {0: [8.0] * 8, 1: [2.0] * 8, 2: [8.0, 2.0] * 4}
  tables = np.zeros((3, 11, V), np.float32)
  for row, m in margins.items():
    tables[row] = answer_table(11, 3, answer, m)
  prompt = jnp.array([[0, 5, 5], [1, 5, 5], [2, 5, 5]], jnp.int32)
  tokens, reveal, stats = generate(RowTableModel(tables), prompt, key=jax.random.key(0),
                                   gen_length=8, steps=8, block_length=8, remasking="threshold",
                                   threshold=0.5, return_reveal_step=True, return_stats=True)
  np.testing.assert_array_equal(tokens[:, 3:], [answer] * 3)
  np.testing.assert_array_equal(stats["model_calls"], [1, 8, 5])
  assert int(stats["forward_passes"]) == 8  # The batch runs until its slowest row is done.
  for row, calls in zip(np.asarray(reveal), [1, 8, 5]):
    assert len(np.unique(row)) == calls  # Distinct reveal steps: the calls that revealed.
  np.testing.assert_array_equal(reveal[2, ::2], [0] * 4)  # The sure tokens in the first call.


def test_fixed_schedules_report_every_step_as_a_call(tiny, prompt):
  _, stats = generate(tiny, prompt, key=jax.random.key(0), gen_length=16, steps=6,
                      block_length=8, return_stats=True)
  np.testing.assert_array_equal(stats["model_calls"], [6, 6, 6])
  assert int(stats["forward_passes"]) == 6


def test_categorical_never_draws_a_zero_probability_token_at_a_chunk_boundary():
  """A uniform that lands exactly on (or just past) the mass of the first chunk must not draw the
  next chunk's first token when that token has probability 0."""
  vocab, rows = 32, 2000  # chunks of 4 tokens
  logits = jax.random.normal(jax.random.key(0), (rows, vocab)) * 3
  logits = logits.at[:, 4].set(-jnp.inf)  # the first token of chunk 1
  weights = np.exp(np.asarray(logits - logits.max(-1, keepdims=True), np.float32))
  totals = weights.reshape(rows, -1, 4).sum(-1)
  cdf = np.cumsum(totals, -1, dtype=np.float32)
  draws = []
  for ulps in range(4):
    target = cdf[:, 0]
    for _ in range(ulps):
      target = np.nextafter(target, np.float32(np.inf))
    uniform = (target / cdf[:, -1]).astype(np.float32)
    draws.append(np.asarray(sampler_lib.categorical_from_uniform(jnp.asarray(uniform), logits,
                                                                 1.0)))
  assert not np.any(np.concatenate(draws) == 4)


# ---------------------------------------------------------------------------
# Block-wise KV caching (Fast-dLLM): cache="prefix" | "dual".
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("remasking", ["low_confidence", "threshold"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_one_step_per_block_makes_every_cache_exact(prompt, cache, remasking, temperature):
  """A block's first call is a full pass that rebuilds the cache: with one step per block (or
  threshold 0: one call per block) the cached sampler is the exact one, token for token."""
  model = models.LLaDA(models.get_config("tiny", n_layers=3), rngs=nnx.Rngs(1))
  mask = jnp.ones(prompt.shape, bool).at[0, :2].set(False)
  kw = dict(key=jax.random.key(3), gen_length=24, steps=3, block_length=8,
            temperature=temperature, remasking=remasking, threshold=0.0, prompt_mask=mask)
  np.testing.assert_array_equal(generate(model, prompt, cache=cache, **kw),
                                generate(model, prompt, **kw))


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("cfg_scale", [0.0, 1.5])
def test_a_one_layer_model_is_cached_exactly_at_any_step_count(prompt, cache, cfg_scale):
  """With one layer a position's keys and values depend on its own token only, and the cached
  positions' tokens do not change inside a block: the cache is exact for any schedule."""
  model = models.LLaDA(models.get_config("tiny", n_layers=1), rngs=nnx.Rngs(2))
  kw = dict(key=jax.random.key(4), gen_length=16, steps=16, block_length=8, temperature=0.9,
            cfg_scale=cfg_scale)
  np.testing.assert_array_equal(generate(model, prompt, cache=cache, **kw),
                                generate(model, prompt, **kw))


def test_deeper_models_are_approximated_not_recomputed(prompt):
  """With several layers and several steps per block the cached context is stale inside a block
  (the point of the cache): some decoded token differs from the exact sampler's."""
  model = models.LLaDA(models.get_config("tiny", n_layers=3), rngs=nnx.Rngs(1))
  kw = dict(key=jax.random.key(3), gen_length=32, steps=32, block_length=16, temperature=0.9)
  exact = np.asarray(generate(model, prompt, **kw))
  for cache in ("prefix", "dual"):
    assert (np.asarray(generate(model, prompt, cache=cache, **kw)) != exact).any(), cache


def test_encode_cached_over_a_fresh_cache_is_the_exact_pass():
  model = models.LLaDA(models.get_config("tiny", n_layers=2), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, 100)
  mask = jnp.ones((2, 24), bool).at[0, :3].set(False)
  full = model.encode(tokens, mask)
  _, cache = model.encode_kv(tokens, mask)
  np.testing.assert_allclose(model.encode_cached(tokens[:, 8:16], 8, cache, mask),
                             full[:, 8:16], atol=1e-5)
  prefix = model.encode_cached(tokens[:, 4:], 4, cache, mask, fresh_from=8)
  np.testing.assert_allclose(prefix[:, 4:12], full[:, 8:16], atol=1e-5)


def test_scanned_layers_build_and_read_the_cache_as_unrolled_ones(prompt):
  """``scan_layers`` (the paper configs) runs encode_kv and encode_cached as one scan over the
  layers that carries the cache: the same hidden states, cache and cached samples."""
  unrolled = models.LLaDA(models.get_config("tiny", n_layers=3), rngs=nnx.Rngs(0))
  scanned = models.LLaDA(models.get_config("tiny", n_layers=3, scan_layers=True),
                         rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, 100)
  mask = jnp.ones((2, 24), bool).at[1, :2].set(False)
  (h0, c0), (h1, c1) = (m.encode_kv(tokens, mask, span=(8, 8)) for m in (unrolled, scanned))
  np.testing.assert_allclose(h1, h0, atol=1e-5)
  for a, b in zip(c0, c1):
    assert a.shape == b.shape == (3, 2, 24, 2, 16) and a.dtype == b.dtype
    np.testing.assert_allclose(b, a, atol=1e-5)
  np.testing.assert_allclose(scanned.encode_cached(tokens[:, 8:16], 8, c1, mask),
                             unrolled.encode_cached(tokens[:, 8:16], 8, c0, mask), atol=1e-5)
  written = scanned.encode_kv(tokens, mask, cache=jax.tree.map(jnp.ones_like, c1))[1]
  np.testing.assert_allclose(written[0], scanned.encode_kv(tokens, mask)[1][0], atol=1e-6)
  kw = dict(key=jax.random.key(3), gen_length=32, steps=32, block_length=16, temperature=0.0)
  for cache in ("prefix", "dual"):
    np.testing.assert_array_equal(generate(scanned, prompt, cache=cache, **kw),
                                  generate(unrolled, prompt, cache=cache, **kw))


class CacheProbe(nnx.Module):
  """A hand-built model whose cached calls read the cache: the cache holds the sequence it was
  built from, and a cached call predicts token 20 + (masked blocks in that snapshot) everywhere,
  while a full call predicts token 5 at every position, most confidently at the block's first."""

  def __init__(self, block_length):
    self.config = CONFIG
    self.block_length = block_length

  def _full(self, tokens, span):
    b, length = tokens.shape
    logits = jnp.zeros((b, length, V)).at[:, :, 5].set(3.0).at[:, span[0], 5].set(9.0)
    return jax.lax.dynamic_slice_in_dim(logits, span[0], span[1], axis=1)

  def encode(self, tokens, attention_mask=None, *, span=None):
    return self._full(tokens, span)

  def encode_kv(self, tokens, attention_mask=None, *, span=None):
    snapshot = tokens.astype(jnp.float32)[None, :, :, None, None]
    return self._full(tokens, span), (snapshot, snapshot)

  def encode_cached(self, tokens, start, cache, attention_mask=None, *, fresh_from=None):
    masked_blocks = jnp.sum(cache[0][0, :, :, 0, 0] == MASK, axis=1) // self.block_length
    token = (20 + masked_blocks).astype(jnp.int32)
    logits = jax.nn.one_hot(token, V) * 10.0
    return jnp.broadcast_to(logits[:, None], (tokens.shape[0], tokens.shape[1], V))

  def unembed(self, hidden):
    return hidden


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_the_cache_is_rebuilt_at_the_start_of_every_block(prompt, cache):
  """Two steps per block of two tokens: the first (a full pass) reveals token 5 at the block's
  first position, the second (cached) reads the cache built at this block's start, where
  4 - b blocks were still masked: block b ends with token 20 + 4 - b."""
  got = np.asarray(generate(CacheProbe(2), prompt, key=jax.random.key(0), gen_length=8, steps=8,
                            block_length=2, cache=cache))[:, prompt.shape[1]:]
  np.testing.assert_array_equal(got, np.tile([5, 24, 5, 23, 5, 22, 5, 21], (len(got), 1)))


def test_an_unknown_cache_is_rejected(tiny, prompt):
  with pytest.raises(ValueError, match="cache must be one of"):
    generate(tiny, prompt, key=jax.random.key(0), gen_length=8, steps=8, block_length=8,
             cache="full")


# ---------------------------------------------------------------------------
# Rollouts decoded in chunks (rollout.microbatch_groups; training/decoding.generate_rows).
# ---------------------------------------------------------------------------

_CHUNKS_SCRIPT = r"""
import sys
import jax, jax.numpy as jnp, ml_collections, numpy as np
from flax import nnx
from stabledrl_jax import models
from stabledrl_jax.training.config import run_spec
from stabledrl_jax.training.parallel import mesh as mesh_lib, multihost
from stabledrl_jax.training.step import decoding
devices = int(sys.argv[1])
mesh = mesh_lib.make_mesh(ml_collections.ConfigDict(dict(data=1, fsdp=devices, tensor=1)))
model = models.LLaDA(models.get_config("tiny", n_layers=2), rngs=nnx.Rngs(0))
n, chunk = 16, 8
prompt = np.asarray(jax.random.randint(jax.random.key(1), (n, 6), 0, 50), np.int32)
mask = np.ones(prompt.shape, bool)
mask[0, :2] = False
key = jax.random.key(7)
split = multihost.row_split(models.batch_sharding(mesh, ndim=1), n)
for temperature in (0.0, 0.9):
  settings = run_spec.Decoding(8, 8, block_length=4, temperature=temperature, cache="dual")
  run = lambda c: decoding.generate_rows(model, prompt, mask, key, settings, mesh=mesh,
                                         split=split, chunk_rows=c)
  whole, chunked = run(0), run(chunk)
  assert np.array_equal(chunked[0], run(chunk)[0])  # reproducible
  if temperature == 0:  # Greedy: the noise is unused, chunks change nothing.
    assert np.array_equal(whole[0], chunked[0]) and np.array_equal(whole[1], chunked[1])
    continue
  # Chunk c: the c-th run of chunk / devices rows of each device's n / devices, key fold_in(c).
  per_device, per_chunk = n // devices, chunk // devices
  for c in range(n // chunk):
    rows = np.concatenate([np.arange(d * per_device + c * per_chunk,
                                     d * per_device + (c + 1) * per_chunk)
                           for d in range(devices)])
    alone = decoding.generate(model, jnp.asarray(prompt[rows]), jnp.asarray(mask[rows]),
                              jax.random.fold_in(key, c), settings)[0]
    assert np.array_equal(chunked[0][rows], np.asarray(alone)), c
  assert not np.array_equal(whole[0], chunked[0])  # other noise than the one-call batch's
print("ok")
"""


@pytest.mark.parametrize("devices", [1, 4])
def test_chunked_rollouts_are_chunks_decoded_alone(devices):
  """generate_rows with chunk_rows: greedy decoding equals one call; sampled, chunk c's rows
  (each device's c-th run of rows) equal those rows decoded alone with fold_in(key, c), and
  the result is reproducible. 4 fake devices: a subprocess (XLA_FLAGS before JAX starts)."""
  import os, subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-c", _CHUNKS_SCRIPT, str(devices)], env=env,
                        capture_output=True, text=True, timeout=900)
  assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_bad_chunks_are_one_line_errors_naming_the_field():
  import ml_collections  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.config import specs  # pylint: disable=g-import-not-at-top
  rollout = lambda g: ml_collections.ConfigDict(dict(num_prompts=4, group_size=2,
                                                     microbatch_groups=g))
  specs.check_chunks(rollout(0), 8)
  specs.check_chunks(rollout(2), 4)
  with pytest.raises(ValueError, match=r"^rollout.microbatch_groups=3 does not divide"):
    specs.check_chunks(rollout(3), 1)
  with pytest.raises(ValueError, match=r"^rollout.microbatch_groups=1 gives 2 rows.*4 data"):
    specs.check_chunks(rollout(1), 4)
  with pytest.raises(ValueError, match=r"^rollout.microbatch_groups must be an integer >= 0"):
    specs.check_chunks(rollout(-1), 1)
