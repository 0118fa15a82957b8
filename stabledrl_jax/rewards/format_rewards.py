"""Format rewards for the <reasoning>...</reasoning><answer>...</answer> layout (d1 conventions).

All return a float in [0, 1] (tasks weight them) and are linear-time string checks; completions
longer than `extraction.MAX_COMPLETION_CHARS` score 0.

Prompts that end with an opened "<reasoning>" tag (the d1 evaluation prompts do) produce
completions without it; pass `reasoning_prefilled=True` so the tag counts as written.
"""

from __future__ import annotations

import re

from stabledrl_jax.rewards import extraction

_TAGS = (extraction.REASONING_OPEN, extraction.REASONING_CLOSE, extraction.ANSWER_OPEN,
         extraction.ANSWER_CLOSE)
_STRICT_OPEN = extraction.REASONING_OPEN + "\n"
_STRICT_MIDDLE = "\n" + extraction.REASONING_CLOSE + "\n" + extraction.ANSWER_OPEN + "\n"
_STRICT_CLOSE = "\n" + extraction.ANSWER_CLOSE
# Penalty per character of text after the final </answer> in `tag_count_reward`.
_TRAILING_TEXT_PENALTY = 0.001


def _as_written(completion: str, reasoning_prefilled: bool) -> str:
  """The completion as if the prompt's "<reasoning>" were part of it ("" if oversized)."""
  if extraction.oversized(completion):
    return ""
  return extraction.REASONING_OPEN + completion if reasoning_prefilled else completion


def strict_format_reward(completion: str, *, reasoning_prefilled: bool = False) -> float:
  """1.0 for exactly "<reasoning>\\n...\\n</reasoning>\\n<answer>\\n...\\n</answer>" (then only
  whitespace), each tag once; else 0.0."""
  text = _as_written(completion, reasoning_prefilled).rstrip()
  if any(text.count(tag) != 1 for tag in _TAGS):
    return 0.0
  middle = text.find(_STRICT_MIDDLE)
  well_formed = (text.startswith(_STRICT_OPEN) and middle >= len(_STRICT_OPEN)
                 and text.endswith(_STRICT_CLOSE)
                 and len(text) - len(_STRICT_CLOSE) >= middle + len(_STRICT_MIDDLE))
  return 1.0 if well_formed else 0.0


def soft_format_reward(completion: str, *, reasoning_prefilled: bool = False) -> float:
  """1.0 if the text opens with <reasoning>, closes it, then (after whitespace only) has an
  <answer>...</answer> pair; anything may follow. Else 0.0."""
  text = _as_written(completion, reasoning_prefilled).lstrip()
  if not text.startswith(extraction.REASONING_OPEN):
    return 0.0
  reasoning_close = text.find(extraction.REASONING_CLOSE, len(extraction.REASONING_OPEN))
  if reasoning_close < 0:
    return 0.0
  after_reasoning = reasoning_close + len(extraction.REASONING_CLOSE)
  answer_open = text.find(extraction.ANSWER_OPEN, after_reasoning)
  if answer_open < 0 or text[after_reasoning:answer_open].strip():
    return 0.0
  answer_close = text.find(extraction.ANSWER_CLOSE, answer_open + len(extraction.ANSWER_OPEN))
  return 1.0 if answer_close >= 0 else 0.0


def tag_count_reward(completion: str, *, reasoning_prefilled: bool = False) -> float:
  """0.25 for each of the four tags that appears exactly once, minus 0.001 per non-blank
  character after the last </answer>; clipped to [0, 1]. A dense signal early in training."""
  text = _as_written(completion, reasoning_prefilled)
  score = 0.25 * sum(text.count(tag) == 1 for tag in _TAGS)
  answer_close = text.rfind(extraction.ANSWER_CLOSE)
  if answer_close >= 0:
    trailing = text[answer_close + len(extraction.ANSWER_CLOSE):].strip()
    score -= _TRAILING_TEXT_PENALTY * len(trailing)
  return min(1.0, max(0.0, score))


def boxed_answer_format_reward(completion: str, *, reasoning_prefilled: bool = False) -> float:
  """0.5 for an <answer>...</answer> pair plus 0.5 if it holds a closed \\boxed{...} (MATH)."""
  del reasoning_prefilled  # only the answer matters here; kept for a uniform signature
  if extraction.oversized(completion):
    return 0.0
  tag = extraction.last_answer_tag(completion)
  if tag is None:
    return 0.0
  return 1.0 if extraction.last_boxed(tag) is not None else 0.5


# The official StableDRL training loop adds this to every task's reward (docs/algorithms.md).
_PURE_BOXED = re.compile(r"[\s$]*\\boxed\{[^}]*\}[\s$]*[.?!'\"“”’]*\s*")
_BOXED_SPAN = re.compile(r"\\boxed\{.*?\}", flags=re.DOTALL)
_WHITESPACE = re.compile(r"\s+")


def anti_short_boxed_reward(completion: str, *, min_total_chars: int = 200,
                            non_boxed_ratio_threshold: float = 0.85) -> float:
  """0.0 for a short answer that is (mostly) a bare \\boxed{}, else 1.0 (StableDRL's rule).

  Short: fewer than ``min_total_chars`` non-whitespace characters. Mostly boxed: the whole text
  is one \\boxed{...} (optionally in $ and followed by punctuation), or deleting every
  \\boxed{...} (up to its first "}") leaves under ``non_boxed_ratio_threshold`` of the
  non-whitespace characters. An empty completion scores 0; one without \\boxed{} scores 1.
  """
  if extraction.oversized(completion):
    return 1.0  # Long by any measure (and not worth a regex pass).
  text = completion.strip()
  total = len(_WHITESPACE.sub("", text))
  if total >= min_total_chars:
    return 1.0
  pure_boxed = _PURE_BOXED.fullmatch(text) is not None
  outside = len(_WHITESPACE.sub("", _BOXED_SPAN.sub("", text)))
  ratio = outside / (total + 1e-6)
  return 0.0 if pure_boxed or ratio < non_boxed_ratio_threshold else 1.0
