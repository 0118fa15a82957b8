"""Locating the final answer in a completion: <answer> tags, \\boxed{}, numbers.

Every function here is linear in the length of the text. Regular expressions with lazy `.*?` spans
are quadratic on hostile input (many opening tags and no closing one), so spans are found with
`str.find` instead, and only bounded patterns are left to `re`.
"""

from __future__ import annotations

import re

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"
REASONING_OPEN = "<reasoning>"
REASONING_CLOSE = "</reasoning>"

# Rewards give 0 to longer completions: no generation budget produces them, and the bound keeps
# every reward fast on hostile input (Python-level scans stay under ~10 ms).
MAX_COMPLETION_CHARS = 100_000

# A decimal number as people write it: optional sign, thousands separators, fraction digits.
_NUMBER = re.compile(r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|-?\.[0-9]+")
_ANY_DIGIT = re.compile(r"[0-9]")
# Longer numeric strings are not answers; refusing them keeps float() cheap on hostile input.
_MAX_NUMBER_CHARS = 64


def oversized(completion: str) -> bool:
  """True for completions longer than MAX_COMPLETION_CHARS (rewards score them 0)."""
  return len(completion) > MAX_COMPLETION_CHARS


def last_answer_tag(text: str) -> str | None:
  """Content of the last complete <answer>...</answer> pair, stripped; None if there is none.

  The pair is the last "</answer>" and the last "<answer>" before it, so text outside the tags
  and earlier drafts are ignored.
  """
  close = text.rfind(ANSWER_CLOSE)
  if close < 0:
    return None
  open_ = text.rfind(ANSWER_OPEN, 0, close)
  if open_ < 0:
    return None
  return text[open_ + len(ANSWER_OPEN):close].strip()


def first_answer_tag(text: str) -> str | None:
  """Content from the first "<answer>" to the next "</answer>", stripped; None if unmatched.

  This is what `re.search(r"<answer>(.*?)</answer>", text, re.DOTALL)` returns, without its
  quadratic worst case.
  """
  open_ = text.find(ANSWER_OPEN)
  if open_ < 0:
    return None
  close = text.find(ANSWER_CLOSE, open_ + len(ANSWER_OPEN))
  if close < 0:
    return None
  return text[open_ + len(ANSWER_OPEN):close].strip()


def balanced_brace_end(text: str, open_brace: int) -> int | None:
  """Index of the "}" that closes the "{" at `open_brace`, or None if it is never closed.

  Jumps between braces with `str.find`, so text without braces costs C speed.
  """
  depth = 0
  index = open_brace
  next_open = text.find("{", index)
  next_close = text.find("}", index)
  while next_close >= 0:
    if 0 <= next_open < next_close:
      depth += 1
      next_open = text.find("{", next_open + 1)
    else:
      depth -= 1
      if depth == 0:
        return next_close
      next_close = text.find("}", next_close + 1)
  return None


def last_boxed(text: str) -> str | None:
  """Content of the last \\boxed{...} (or \\fbox{...}), with nested braces balanced.

  Returns None when there is no such command, when it is not followed by "{", or when its
  braces never close (a generation cut off inside the box).
  """
  for command in ("\\boxed", "\\fbox"):
    start = text.rfind(command)
    if start >= 0:
      break
  else:
    return None
  open_brace = start + len(command)
  if text[open_brace:open_brace + 1] != "{":
    return None
  end = balanced_brace_end(text, open_brace)
  if end is None:
    return None
  return text[open_brace + 1:end]


def parse_number(number: str) -> float | None:
  """The value of a string such as "1,234.5", "$18", "-3" or "18."; None if it is not one.

  Thousands separators, a leading "$" and surrounding whitespace or a trailing period are
  tolerated; anything longer than 64 characters is refused.
  """
  cleaned = number.strip().lstrip("$").rstrip(".").replace(",", "")
  if not cleaned or len(cleaned) > _MAX_NUMBER_CHARS or not _NUMBER.fullmatch(cleaned):
    return None
  return float(cleaned)


def last_number(text: str) -> float | None:
  """The value of the last number in the text, or None if there is none."""
  if not _ANY_DIGIT.search(text):  # a plain character-class scan is far cheaper than _NUMBER
    return None
  last = None
  for match in _NUMBER.finditer(text):
    last = match.group(0)
  return None if last is None else parse_number(last)
