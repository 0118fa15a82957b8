"""GSM8K: grade-school math word problems with a numeric answer.

Data: JSONL with {"question", "answer"} where the answer ends in "#### <number>" (the GSM8K
release format), or the Hub's openai/gsm8k ("main" config).
"""

from __future__ import annotations

from typing import Any, Mapping

from stabledrl_jax.rewards import d1_protocol, format_rewards, task_rewards
from stabledrl_jax.tasks import base

INSTRUCTION = (
    "Solve the math word problem step by step, then give the final numeric answer as "
    "\\boxed{number} inside the answer tags.\n"
    + base.ANSWER_FORMAT.format(answer="\\boxed{number}"))


def example_from_record(record: Mapping[str, Any]) -> base.Example:
  """A GSM8K row ({"question", "answer": "... #### 72"}) or a d1 generation record."""
  if "question" in record and "answer" in record:
    answer = str(record["answer"])
    return base.Example(question=str(record["question"]),
                        ground_truth=task_rewards.gsm8k_reference_value(answer),
                        reference=answer if "####" in answer else None)
  if "question" in record and "ground_truth" in record:
    return base.Example(question=str(record["question"]), ground_truth=record["ground_truth"])
  raise ValueError(f"not a GSM8K record: its columns are {sorted(record)}; expected question and "
                   "answer, or question and ground_truth")


def _correctness(completion: str, example: base.Example) -> float:
  if example.ground_truth is None:
    return 0.0
  return task_rewards.gsm8k_reward(completion, example.ground_truth)


def official_gold(example: base.Example) -> str:
  """The official reward's gold answer: the text after "####" of the GSM8K answer (its
  ``extract_answer_gsm8k``), else the numeric ground truth written out in full (``:.15g``, so
  1234567 stays 1234567, not 1.23457e+06)."""
  if example.reference and "####" in example.reference:
    return example.reference.split("####")[-1].strip()
  value = float(example.ground_truth)
  return str(int(value)) if value.is_integer() else f"{value:.15g}"


def _official_correctness(completion: str, example: base.Example) -> float:
  """+1 / -1: math-verify on the whole completion against the number after "####"."""
  return task_rewards.math_verify_reward(completion, official_gold(example))


def _format_term(function):
  return lambda completion, example: function(completion)


def _parse_answer(completion: str) -> str | None:
  value = task_rewards.gsm8k_prediction(completion)
  return None if value is None else f"{value:g}"


def _score(completion: str, example: base.Example) -> base.ItemScore:
  return base.ItemScore(float(d1_protocol.gsm8k_correct(completion, example.ground_truth)), 1.0)


TASK = base.register_task(base.Task(
    name="gsm8k",
    instruction=INSTRUCTION,
    rewards={
        "stabledrl": (base.RewardTerm("correctness", 1.0, _official_correctness),
                      base.ANTI_SHORT_BOXED),
        # The d1 mixture: correctness dominates; layout terms give a dense early signal.
        "d1": (
            base.RewardTerm("correctness", 2.0, _correctness),
            base.RewardTerm("tag_count", 0.5, _format_term(format_rewards.tag_count_reward)),
            base.RewardTerm("soft_format", 0.5, _format_term(format_rewards.soft_format_reward)),
            base.RewardTerm("strict_format", 0.5,
                            _format_term(format_rewards.strict_format_reward)),
        ),
    },
    parse_answer=_parse_answer,
    score=_score,
    example_from_record=example_from_record,
    hub_sources={"train": base.HubSource("openai/gsm8k", config="main", split="train"),
                 "test": base.HubSource("openai/gsm8k", config="main", split="test")},
    aliases=("gsm",),
    stabledrl_prompt=base.stabledrl_boxed_prompt,
    suite_position=0,
))
