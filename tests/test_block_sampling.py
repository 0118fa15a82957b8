"""The block diffusion sampler: cached decoding equals uncached decoding, SDAR's remasking rules
against a numpy transcription of its loop, schedules, EOS, padding and reproducibility."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stabledrl_jax import models
from stabledrl_jax.models import sampler_lib
from stabledrl_jax.models.sdar.sampler import generate

CONFIG = models.get_sdar_config("tiny")
BS, MASK = CONFIG.block_size, CONFIG.mask_token_id


@pytest.fixture(scope="module")
def peaked():
  """The tiny model with logits scaled x6: peaked distributions as a trained model has, so that
  the dynamic rule's threshold is crossed and several tokens are revealed in one step."""
  model = models.SDAR(CONFIG, rngs=nnx.Rngs(1))
  model.lm_head.kernel[...] = 6.0 * model.lm_head.kernel[...]
  return model


@pytest.fixture(scope="module")
def prompt():
  return jax.random.randint(jax.random.key(7), (3, 6), 0, 100, jnp.int32)


def reference_generate(logits_fn, prompt, gen_length, steps, remasking, threshold):
  """SDAR's block_diffusion_generate (greedy) transcribed to numpy, batched, without a cache.

  Intended differences: the mask token is never predicted; the reveal count of a step follows the
  even schedule over the block's *masked* positions (SDAR uses block_length, which differs only
  in the block holding the prompt's tail, where SDAR may overwrite prompt tokens); rows that are
  complete do nothing.
  """
  batch, prompt_len = prompt.shape
  num_blocks = -(-(prompt_len + gen_length) // BS)
  x = np.full((batch, num_blocks * BS), MASK, np.int64)
  x[:, :prompt_len] = prompt
  for block in range(prompt_len // BS, num_blocks):
    lo, hi = block * BS, (block + 1) * BS
    free = np.arange(lo, hi) >= prompt_len
    n_masked = ((x[:, lo:hi] == MASK) & free).sum(1)
    schedule = np.array([[n // steps + (i < n % steps) for i in range(steps)] for n in n_masked])
    for i in range(steps):
      mask_index = (x[:, lo:hi] == MASK) & free
      if not mask_index.any():
        break
      logits = np.asarray(logits_fn(x[:, :hi]), np.float64)[:, lo:hi]  # plain block-causal pass
      logits[..., MASK] = -np.inf
      x0 = logits.argmax(-1)
      p = np.exp(logits - logits.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      confidence = np.where(mask_index, np.take_along_axis(p, x0[..., None], -1)[..., 0], -np.inf)
      for j in range(batch):
        if not mask_index[j].any():
          continue
        count = max(schedule[j, i], 1)
        transfer = np.zeros(BS, bool)
        transfer[np.argsort(-confidence[j], kind="stable")[:count]] = True
        high = confidence[j] > threshold
        if remasking == "low_confidence_dynamic" and high.sum() >= count:
          transfer = high
        x[j, lo:hi] = np.where(transfer & mask_index[j], x0[j], x[j, lo:hi])
  return x[:, :prompt_len + gen_length]


@pytest.mark.parametrize("remasking", ["low_confidence_static", "low_confidence_dynamic"])
def test_cached_equals_uncached_and_the_reference_loop(peaked, prompt, remasking):
  kw = dict(key=jax.random.key(0), gen_length=10, steps=3, remasking=remasking,
            stop_at_eos=False, return_reveal_step=True)
  cached, cached_steps = generate(peaked, prompt, **kw)
  uncached, uncached_steps = generate(peaked, prompt, use_cache=False, **kw)
  np.testing.assert_array_equal(cached, uncached)  # token for token
  np.testing.assert_array_equal(cached_steps, uncached_steps)  # and step for step
  logits_fn = nnx.jit(lambda model, t: model(t))
  want = reference_generate(lambda t: logits_fn(peaked, jnp.asarray(t, jnp.int32)),
                            np.asarray(prompt), 10, 3, remasking, 0.9)
  np.testing.assert_array_equal(cached, want)
  np.testing.assert_array_equal(cached[:, :6], prompt)
  assert not np.any(np.asarray(cached) == MASK)
  if remasking == "low_confidence_dynamic":  # the threshold did fire: fewer steps were needed
    per_block = [len(set(row[j:j + 4])) for row in np.asarray(cached_steps) for j in (2, 6)]
    assert min(per_block) < 3


def test_static_schedule_and_block_order(peaked, prompt):
  # Prompt 6: block 1 holds 2 prompt and 2 completion positions, then blocks 2 and 3 (4 each).
  tokens, reveal = generate(peaked, prompt, key=jax.random.key(0), gen_length=10, steps=3,
                            remasking="low_confidence_static", stop_at_eos=False,
                            return_reveal_step=True)
  assert tokens.shape == (3, 16)
  for row in np.asarray(reveal):
    # Global step = block * steps + step. Block 1: 2 masked over 3 steps -> 1, 1, 0.
    np.testing.assert_array_equal(np.sort(row[:2]), [3, 4])
    # Blocks 2 and 3: 4 masked over 3 steps -> 2, 1, 1.
    for block, part in ((2, row[2:6]), (3, row[6:10])):
      np.testing.assert_array_equal(np.bincount(part - block * 3, minlength=3), [2, 1, 1])


@pytest.mark.parametrize("remasking", ["low_confidence_static", "low_confidence_dynamic"])
@pytest.mark.parametrize("stop_at_eos", [False, True])
def test_model_calls_count_the_steps_that_revealed_a_token(peaked, prompt, remasking,
                                                            stop_at_eos):
  # Every call reveals at least one token of a row that still has masks, so a row's calls are
  # its distinct reveal steps; rows finished by EOS make no more calls.
  _, reveal, stats = generate(peaked, prompt, key=jax.random.key(0), gen_length=10, steps=3,
                              remasking=remasking, stop_at_eos=stop_at_eos,
                              return_reveal_step=True, return_stats=True)
  distinct = [len(set(row[row >= 0].tolist())) for row in np.asarray(reveal)]
  np.testing.assert_array_equal(stats["model_calls"], distinct)
  if remasking == "low_confidence_static" and not stop_at_eos:
    np.testing.assert_array_equal(stats["model_calls"], [2 + 3 + 3] * 3)  # See the test above.


def test_dynamic_threshold_limits(peaked, prompt):
  kw = dict(key=jax.random.key(0), gen_length=8, steps=4, stop_at_eos=False,
            return_reveal_step=True)
  static = generate(peaked, prompt, remasking="low_confidence_static", **kw)
  never = generate(peaked, prompt, remasking="low_confidence_dynamic", threshold=1.0, **kw)
  np.testing.assert_array_equal(never[0], static[0])  # tau = 1: nothing passes, as static
  np.testing.assert_array_equal(never[1], static[1])
  _, always = generate(peaked, prompt, remasking="low_confidence_dynamic", threshold=0.0, **kw)
  # tau = 0: every masked position passes, so each block is decoded in its first step.
  np.testing.assert_array_equal(np.asarray(always) % 4, 0)


def test_sampling_is_reproducible_from_the_key_and_greedy_ignores_it(peaked, prompt):
  run = lambda seed, t: np.asarray(generate(peaked, prompt, key=jax.random.key(seed),
                                            gen_length=8, steps=2, temperature=t))
  np.testing.assert_array_equal(run(3, 1.0), run(3, 1.0))
  assert not np.array_equal(run(3, 1.0), run(4, 1.0))
  np.testing.assert_array_equal(run(3, 0.0), run(4, 0.0))


def test_eos_stops_a_row_and_fills_after_it(peaked, prompt):
  kw = dict(key=jax.random.key(0), gen_length=12, steps=2, remasking="low_confidence_static")
  free = np.asarray(generate(peaked, prompt, stop_at_eos=False, **kw))
  stop = int(free[0, 10])  # a token that row 0 decodes in block 2 (positions 8-11)
  got, reveal = generate(peaked, prompt, eos_token_ids=(stop,), return_reveal_step=True, **kw)
  got, reveal = np.asarray(got), np.asarray(reveal)
  for row, (want_row, got_row) in enumerate(zip(free, got)):
    hits = np.flatnonzero(want_row[6:] == stop)
    if hits.size == 0:
      np.testing.assert_array_equal(got_row, want_row)
      continue
    first = 6 + hits[0]
    np.testing.assert_array_equal(got_row[:first + 1], want_row[:first + 1])
    assert np.all(got_row[first + 1:] == stop)
    # Blocks after the one holding the stop token were never decoded.
    block_end = (first // BS + 1) * BS
    assert np.all(reveal[row, block_end - 6:] == -1)


def test_padding_by_whole_blocks_decodes_like_no_padding(peaked, prompt):
  padded = jnp.concatenate([jnp.zeros((3, BS), jnp.int32), prompt], axis=1)
  prompt_mask = jnp.arange(BS + 6)[None].repeat(3, 0) >= BS
  kw = dict(key=jax.random.key(0), gen_length=8, steps=2)
  got = generate(peaked, padded, prompt_mask=prompt_mask, **kw)
  np.testing.assert_array_equal(got[:, BS:], generate(peaked, prompt, **kw))


@pytest.mark.parametrize("kwargs, message", [
    (dict(gen_length=0, steps=2), "positive"),
    (dict(gen_length=8, steps=2, remasking="random"), "remasking"),
    (dict(gen_length=8, steps=2, temperature=-1.0), "temperature"),
    (dict(gen_length=8, steps=2, eos_token_ids=()), "eos_token_ids"),
])
def test_invalid_arguments_are_rejected(peaked, prompt, kwargs, message):
  with pytest.raises(ValueError, match=message):
    generate(peaked, prompt, key=jax.random.key(0), **kwargs)


def test_every_stop_token_of_the_config_ends_a_completion(peaked, prompt):
  """With the config's stop tokens (an end-of-turn besides EOS) a row stops at either one, the
  rest filled with EOS, and the trainer's completion mask ends at the first of them."""
  kw = dict(key=jax.random.key(0), gen_length=12, steps=2, remasking="low_confidence_static")
  free = np.asarray(generate(peaked, prompt, stop_at_eos=False, **kw))
  turn_end = int(free[0, 9])
  eos = CONFIG.eos_token_id
  chat = models.SDAR(CONFIG.replace(stop_token_ids=(eos, turn_end)), rngs=nnx.Rngs(1))
  nnx.update(chat, nnx.state(peaked))
  got = np.asarray(generate(chat, prompt, **kw))
  first = 6 + np.flatnonzero(free[0, 6:] == turn_end)[0]
  np.testing.assert_array_equal(got[0, :first + 1], free[0, :first + 1])
  assert np.all(got[0, first + 1:] == eos)
  mask = np.asarray(sampler_lib.completion_mask(got, 6, models.family.stop_ids(chat.config)))
  assert mask[0].sum() == first + 1 - 6 and mask[0, :first + 1 - 6].all()
