"""Rewards (what RL optimizes) and the d1 evaluation protocol (what papers report).

Host-side, pure Python: no JAX, cheap to import (math-verify is imported on first use).

- `task_rewards`: countdown_reward, sudoku_reward, gsm8k_reward, math_reward, in [0, 1].
- `format_rewards`: <reasoning>/<answer> layout rewards, in [0, 1].
- `d1_protocol`: per-item correctness exactly as the d1 scorer decides it.
- `arithmetic`: the safe evaluator behind countdown (never `eval`).
- `extraction`, `math_equivalence`: shared answer extraction and normalization.
- `deadline`, `symbolic_worker`, `symbolic_helper`: math-verify's CPU-time bound on any thread
  (a signal deadline on the main thread; elsewhere helper processes that are killed if late).

Every reward accepts any string as the completion and returns a finite float.

To add a reward: a function of the completion string (and the answer fields it needs) here,
made a term of a task's reward scheme with ``tasks.base.RewardTerm``; a test that feeds it
garbled and hostile strings.
"""

from stabledrl_jax.rewards.arithmetic import evaluate_arithmetic
from stabledrl_jax.rewards.format_rewards import boxed_answer_format_reward, soft_format_reward
from stabledrl_jax.rewards.format_rewards import strict_format_reward, tag_count_reward
from stabledrl_jax.rewards.math_equivalence import math_answers_match, normalize_math_answer
from stabledrl_jax.rewards.math_equivalence import symbolic_equivalent
from stabledrl_jax.rewards.task_rewards import countdown_reward, gsm8k_reward, math_reward
from stabledrl_jax.rewards.task_rewards import official_countdown_reward, sudoku_reward

__all__ = [
    "boxed_answer_format_reward",
    "countdown_reward",
    "evaluate_arithmetic",
    "gsm8k_reward",
    "math_answers_match",
    "math_reward",
    "normalize_math_answer",
    "official_countdown_reward",
    "soft_format_reward",
    "strict_format_reward",
    "sudoku_reward",
    "symbolic_equivalent",
    "tag_count_reward",
]
