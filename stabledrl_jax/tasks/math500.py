"""MATH: competition math problems with LaTeX answers; evaluated on MATH-500.

Data: JSONL / Parquet with {"problem", "answer"} (or a full "solution" whose last \\boxed{} is
the answer), or the Hub: training on MATH (qwedsacf/competition_math, levels 1-4, as the official
StableDRL config), testing on HuggingFaceH4/MATH-500 (Lightman et al.'s subset).
"""

from __future__ import annotations

from typing import Any, Mapping

from stabledrl_jax.rewards import d1_protocol, format_rewards, task_rewards
from stabledrl_jax.tasks import base

INSTRUCTION = (
    "Solve the competition math problem step by step, then give the final answer in simplest "
    "form as \\boxed{answer} inside the answer tags.\n"
    + base.ANSWER_FORMAT.format(answer="\\boxed{answer}"))


def example_from_record(record: Mapping[str, Any]) -> base.Example:
  """A MATH row ({"problem", "answer"} and/or "solution") or a d1 generation record."""
  question = record.get("problem", record.get("question"))
  if question is None:
    raise ValueError(f"not a MATH record: its columns are {sorted(record)}; expected problem (or "
                     "question) and answer, solution or ground_truth")
  solution = record.get("solution")
  if record.get("answer") is not None:
    answer = str(record["answer"])
  elif record.get("ground_truth") is not None:
    answer = str(record["ground_truth"])
  elif solution is not None:
    answer = task_rewards.math_reference(str(solution))
  else:
    raise ValueError(f"a MATH record without an answer: its columns are {sorted(record)}; "
                     "expected answer, solution or ground_truth")
  return base.Example(question=str(question), ground_truth=answer,
                      reference=None if solution is None else str(solution))


def _correctness(completion: str, example: base.Example) -> float:
  return task_rewards.math_reward(completion, example.ground_truth)


def _official_correctness(completion: str, example: base.Example) -> float:
  """+1 / -1: math-verify on the whole completion against the full solution (or the answer)."""
  gold = example.reference if example.reference is not None else example.ground_truth
  return task_rewards.math_verify_reward(completion, str(gold))


def official_training_record(record: Mapping[str, Any]) -> bool:
  """The official StableDRL MATH training filter: levels 1 to 4, a problem of 1 to 1499
  characters and at most 300 words."""
  level = str(record.get("level", ""))
  digits = "".join(char for char in level if char.isdigit())
  problem = str(record.get("problem", ""))
  return (bool(digits) and int(digits) <= 4 and 0 < len(problem) < 1500
          and len(problem.split()) <= 300)


def _boxed_format(completion: str, example: base.Example) -> float:
  del example
  return format_rewards.boxed_answer_format_reward(completion)


def _score(completion: str, example: base.Example) -> base.ItemScore:
  return base.ItemScore(float(d1_protocol.math_correct(completion, example.ground_truth)), 1.0)


TASK = base.register_task(base.Task(
    name="math500",
    instruction=INSTRUCTION,
    rewards={
        "stabledrl": (base.RewardTerm("correctness", 1.0, _official_correctness),
                      base.ANTI_SHORT_BOXED),
        "d1": (base.RewardTerm("correctness", 2.0, _correctness),
               base.RewardTerm("boxed_format", 0.5, _boxed_format)),
    },
    parse_answer=task_rewards.math_prediction,
    score=_score,
    example_from_record=example_from_record,
    # Training as the official StableDRL config: MATH (qwedsacf/competition_math, whose one split
    # holds the 12.5k problems), levels 1-4; evaluation on MATH-500.
    hub_sources={
        "train": base.HubSource("qwedsacf/competition_math", split="train",
                                keep=official_training_record),
        "test": base.HubSource("HuggingFaceH4/MATH-500", split="test"),
    },
    aliases=("math",),
    stabledrl_prompt=base.stabledrl_boxed_prompt,
    suite_position=1,
))
