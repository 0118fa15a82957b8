"""How many examples a hypothesis test draws: its own count scaled by the profile.

Two profiles are registered (conftest.py): 'ci', the default, draws a quarter of each test's
count (at least 10), which keeps the suite near 10 minutes on 2 cores; 'full' draws each test's
own count: ``python -m pytest --hypothesis-profile=full`` (or HYPOTHESIS_PROFILE=full).
"""

import hypothesis

FULL = 100  # The 'full' profile's max_examples: a test's count as written.
CI = 25


def examples(count: int) -> int:
  """``count`` (the test's own number, the 'full' profile's) scaled to the loaded profile."""
  scaled = round(count * hypothesis.settings.default.max_examples / FULL)
  return count if scaled >= count else max(min(10, count), scaled)
