"""MATH-500: competition math problems with LaTeX answers (Lightman et al.'s MATH subset).

Data: JSONL / Parquet with {"problem", "answer"} (or a full "solution" whose last \\boxed{} is
the answer), or the Hub's HuggingFaceH4/MATH-500.
"""

from __future__ import annotations

from typing import Any, Mapping

from stabledrl_jax.rewards import d1_protocol
from stabledrl_jax.rewards import format_rewards
from stabledrl_jax.rewards import task_rewards
from stabledrl_jax.tasks import base

INSTRUCTION = (
    "Solve the competition math problem step by step, then give the final answer in simplest "
    "form as \\boxed{answer} inside the answer tags.\n"
    + base.ANSWER_FORMAT.format(answer="\\boxed{answer}"))


def example_from_record(record: Mapping[str, Any]) -> base.Example:
  """A MATH row ({"problem", "answer"} and/or "solution") or a d1 generation record."""
  question = record.get("problem", record.get("question"))
  if question is None:
    raise ValueError(f"Not a MATH record: {sorted(record)}")
  solution = record.get("solution")
  if record.get("answer") is not None:
    answer = str(record["answer"])
  elif record.get("ground_truth") is not None:
    answer = str(record["ground_truth"])
  elif solution is not None:
    answer = task_rewards.math_reference(str(solution))
  else:
    raise ValueError(f"MATH record without an answer: {sorted(record)}")
  return base.Example(question=str(question), ground_truth=answer,
                      reference=None if solution is None else str(solution))


def _correctness(completion: str, example: base.Example) -> float:
  return task_rewards.math_reward(completion, example.ground_truth)


def _boxed_format(completion: str, example: base.Example) -> float:
  del example
  return format_rewards.boxed_answer_format_reward(completion)


def _score(completion: str, example: base.Example) -> base.ItemScore:
  return base.ItemScore(float(d1_protocol.math_correct(completion, example.ground_truth)), 1.0)


TASK = base.register_task(base.Task(
    name="math500",
    instruction=INSTRUCTION,
    reward_terms=(
        base.RewardTerm("correctness", 2.0, _correctness),
        base.RewardTerm("boxed_format", 0.5, _boxed_format),
    ),
    parse_answer=task_rewards.math_prediction,
    score=_score,
    example_from_record=example_from_record,
    hub_source=base.HubSource("HuggingFaceH4/MATH-500", split="test"),
    aliases=("math",),
))
