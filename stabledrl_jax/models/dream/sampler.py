"""Dream's diffusion generate: the official ``_sample`` of ``generation_utils.py``
(Dream-org/Dream-v0-Instruct-7B; docs/models.md, "Dream"), with static shapes.

The completion's G positions start as [MASK] and are decoded over ``steps`` steps on the
schedule t_i = linspace(1, eps, steps + 1)[i]; each step runs the model on the whole sequence and
reads its shifted logits (``Dream.predictions``). With s = t_{i+1}:

  origin        each masked position is revealed with probability 1 - s / t (1 at the last step),
                its token drawn from the processed logits;
  maskgit_plus  every masked position gets a token and a confidence (its probability);
  topk_margin   ... confidence the top-1 minus top-2 probability;
  entropy       ... confidence sum p log(p + 1e-10) (the negative entropy);
                then floor(n * (1 - s / t)) of the n masked positions are revealed (all at the
                last step): the most confident, or with ``alg_temp`` > 0 drawn without
                replacement from softmax(confidence / alg_temp) (the Gumbel top-k trick, the
                same distribution as torch.multinomial's).

Logits are processed as ``sample_tokens``: divided by the temperature (> 0), then top-p (the
smallest prefix of the sorted distribution whose mass exceeds top_p is kept, the first token
always), then top-k; the token is drawn from their softmax (temperature > 0) or taken as its
argmax, the confidence being its probability.

The official count of tokens to reveal is the batch's mean number of masked positions; every
row of a batch here has the same number (one prompt width, one completion length, the same count
revealed each step), so the per-row count used here is that mean. There is no early stop: every
row runs ``steps`` model calls.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from stabledrl_jax.models import family, sampler_lib

Array = jax.Array

ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")
# The options beyond the common ones (``rollout.family_options``), at the official defaults,
# with the values each takes (the family record's ``options``: declared here once). top_k 0
# would keep no token (the official top_k_logits indexes an empty top-k): unset means off.
OPTIONS = {
    "top_p": family.Option(float, None, low=0.0, high=1.0, low_open=True,
                           note="the nucleus mass kept; 1 or unset: off"),
    "top_k": family.Option(int, None, low=1, high_of=lambda config: config.vocab_size,
                           high_name="the model's vocabulary size",
                           note="the most likely tokens kept; unset: all"),
    "alg_temp": family.Option(float, None, low=0.0, high=100.0,
                              note="of the draw of the positions to reveal; 0 or unset: the "
                              "most confident"),
    "eps": family.Option(float, 1e-3, low=0.0, high=1.0, low_open=True, high_open=True,
                         note="the last time of the schedule"),
}


@dataclasses.dataclass(frozen=True)
class Sampling:
  """The official generation options (``DreamGenerationConfig``; its defaults).

  Attributes:
    gen_length: completion tokens G (``max_new_tokens``).
    steps: denoising steps (model calls).
    alg: one of ALGS.
    alg_temp: temperature of the confidence-weighted draw of the positions to reveal (None or 0:
      the most confident).
    temperature: of the token draw (0: argmax).
    top_p: nucleus mass in (0, 1] (None or 1: off).
    top_k: tokens kept, at least 1 (None: off).
    eps: the last time of the schedule.
  """

  gen_length: int
  steps: int
  alg: str = "origin"
  alg_temp: float | None = None
  temperature: float = 0.0
  top_p: float | None = None
  top_k: int | None = None
  eps: float = OPTIONS["eps"].default

  def __post_init__(self):
    if self.alg not in ALGS:
      raise ValueError(f"Dream's sampler: alg {self.alg!r} is not one of {ALGS}")
    for name in ("gen_length", "steps"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"Dream's sampler: {name} must be a positive integer, got {value!r}")
    if self.temperature < 0:
      raise ValueError(f"Dream's sampler: temperature must be >= 0, got {self.temperature}")
    for name, option in OPTIONS.items():  # Their ranges, as declared (no model: no vocabulary).
      family.check_option(f"rollout.family_options.{name}", option, getattr(self, name))


def schedule(steps: int, eps: float) -> Array:
  """t_0..t_steps = ``torch.linspace(1, eps, steps + 1)`` in float32, by torch's arithmetic: a
  step of (eps - 1) / steps, the first half counted up from 1 and the rest down from eps."""
  n = steps + 1
  start, end = jnp.float32(1.0), jnp.float32(eps)
  step = (end - start) / jnp.float32(steps)
  index = jnp.arange(n, dtype=jnp.float32)
  return jnp.where(jnp.arange(n) < n / 2, start + step * index,
                   end - step * jnp.float32(n - 1 - index))


def reveal_counts(masked: Array, step: Array | int, steps: int, timesteps: Array) -> Array:
  """How many of ``masked`` [B] positions step ``step`` reveals: floor(n (1 - s / t)), all at
  the last step (float32 arithmetic, as the official ``int(num_mask_token * (1 - s / t))``)."""
  t, s = timesteps[step], timesteps[step + 1]
  share = masked.astype(jnp.float32) * (1.0 - s / t)
  return jnp.where(step < steps - 1, jnp.floor(share).astype(jnp.int32), masked)


def process_logits(logits: Array, *, temperature: float, top_p: float | None,
                   top_k: int | None) -> Array:
  """``sample_tokens``' logits processing: / temperature (> 0), then top-p, then top-k; removed
  entries at finfo.min. logits: [..., V] float32."""
  if temperature > 0:
    logits = logits / temperature
  low = jnp.finfo(logits.dtype).min
  if top_p is not None and top_p < 1:
    order = jnp.argsort(-logits, axis=-1, stable=True)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    # Removed where the mass before it already exceeds top_p: the official mask shifted right.
    remove = jnp.concatenate([jnp.zeros_like(cumulative[..., :1], bool),
                              cumulative[..., :-1] > top_p], axis=-1)
    inverse = jnp.argsort(order, axis=-1)
    logits = jnp.where(jnp.take_along_axis(remove, inverse, axis=-1), low, logits)
  if top_k is not None:
    kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][..., -1:]
    logits = jnp.where(logits < kth, low, logits)
  return logits


def sample_tokens(logits: Array, key: Array, *, temperature: float, top_p: float | None,
                  top_k: int | None, confidence: str = "probability") -> tuple[Array, Array]:
  """Tokens and confidences of logits [..., V] (``sample_tokens``): confidence 'probability'
  (the token's), 'margin' (top-1 minus top-2) or 'neg_entropy'. Returns ([...] float32,
  [...] int32)."""
  logits = process_logits(logits.astype(jnp.float32), temperature=temperature, top_p=top_p,
                          top_k=top_k)
  probs = jax.nn.softmax(logits, axis=-1)
  if temperature > 0:  # Already divided by the temperature.
    tokens = sampler_lib.categorical(key, logits, 1.0)
    score = jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]
  else:
    tokens, score = jnp.argmax(probs, axis=-1), jnp.max(probs, axis=-1)
  if confidence == "margin":
    top2 = jax.lax.top_k(probs, 2)[0]
    score = top2[..., 0] - top2[..., 1]
  elif confidence == "neg_entropy":
    score = jnp.sum(probs * jnp.log(probs + 1e-10), axis=-1)
  return score, tokens.astype(jnp.int32)


_CONFIDENCE = {"maskgit_plus": "probability", "topk_margin": "margin", "entropy": "neg_entropy"}


def step(x: Array, logits: Array, key: Array, index: Array | int, settings: Sampling,
         mask_id: int, timesteps: Array) -> Array:
  """One denoising step on the completion: x [B, G] (masked where == mask_id), logits
  [B, G, V] (its shifted rows) -> x with this step's positions revealed."""
  masked = x == mask_id
  k_draw, k_tokens, k_order = jax.random.split(key, 3)
  s = settings
  if s.alg == "origin":
    t, t_next = timesteps[index], timesteps[index + 1]
    p_transfer = jnp.where(index < s.steps - 1, 1.0 - t_next / t, 1.0)
    _, tokens = sample_tokens(logits, k_tokens, temperature=s.temperature, top_p=s.top_p,
                              top_k=s.top_k)
    reveal = masked & (jax.random.uniform(k_draw, x.shape) < p_transfer)
    return jnp.where(reveal, tokens, x)
  score, tokens = sample_tokens(logits, k_tokens, temperature=s.temperature, top_p=s.top_p,
                                top_k=s.top_k, confidence=_CONFIDENCE[s.alg])
  count = reveal_counts(jnp.sum(masked, axis=-1), index, s.steps, timesteps)  # [B]
  score = jnp.where(masked, score, -jnp.inf)
  if s.alg_temp:  # Gumbel top-k: a draw without replacement from softmax(score / alg_temp).
    score = score / s.alg_temp + jax.random.gumbel(k_order, score.shape)
  reveal = masked & (sampler_lib.rank_descending(score) < count[:, None])
  return jnp.where(reveal, tokens, x)


def sample(model: Any, prompt_tokens: Array, prompt_mask: Array | None, key: Array,
           settings: Sampling) -> tuple[Array, dict[str, Array]]:
  """Completions of left-padded prompts by Dream's diffusion generate (one jitted program).

  Args:
    model: a ``Dream`` module.
    prompt_tokens: [B, P] int, left-padded.
    prompt_mask: [B, P], True for real tokens (None: all real).
    key: PRNG key (token draws, ``origin``'s reveals, ``alg_temp``'s order).
    settings: the generation options.

  Returns:
    tokens [B, P + G] and {"model_calls": [B] int32}.
  """
  prompt_tokens, prompt_mask = sampler_lib.check_prompts(prompt_tokens, prompt_mask)
  if prompt_mask is None:
    prompt_mask = jnp.ones(prompt_tokens.shape, bool)
  graphdef, state = nnx.split(model)
  return _sample(graphdef, state, prompt_tokens.astype(jnp.int32), prompt_mask.astype(bool), key,
                 settings=settings)


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"))
def _sample(graphdef: Any, state: Any, prompt_tokens: Array, prompt_mask: Array, key: Array, *,
            settings: Sampling) -> tuple[Array, dict[str, Array]]:
  model = nnx.merge(graphdef, state)
  b = prompt_tokens.shape[0]
  g, mask_id = settings.gen_length, model.config.mask_token_id
  attention = jnp.concatenate([prompt_mask, jnp.ones((b, g), bool)], axis=1)
  timesteps = schedule(settings.steps, settings.eps)

  def body(index, carry):
    completion, key = carry
    key, step_key = jax.random.split(key)
    x = jnp.concatenate([prompt_tokens, completion], axis=1)
    logits = model.predictions(x, attention, suffix=g)
    return step(completion, logits, step_key, index, settings, mask_id, timesteps), key

  completion = jnp.full((b, g), mask_id, jnp.int32)
  completion, _ = jax.lax.fori_loop(0, settings.steps, body, (completion, key))
  tokens = jnp.concatenate([prompt_tokens, completion], axis=1)
  return tokens, {"model_calls": jnp.full((b,), settings.steps, jnp.int32)}


def generate(model: Any, prompt: Array, *, key: Array, gen_length: int, steps: int,
             prompt_mask: Array | None = None, **options) -> Array:
  """``sample`` for a prompt batch [B, P] (all real tokens unless ``prompt_mask``), the other
  options as ``Sampling``'s; returns tokens [B, P + G]."""
  tokens, _ = sample(model, prompt, prompt_mask, key,
                     Sampling(gen_length=gen_length, steps=steps, **options))
  return tokens
