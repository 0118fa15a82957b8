"""`Example`, `Task` and the task registry.

A task bundles what the RL loop and the evaluator need to know about a problem family:

- how a question becomes a prompt (`Task.prompt`);
- the training reward of a completion: a weighted sum of named terms (`Task.reward`);
- the extracted answer, for logs (`Task.parse_answer`);
- the evaluation metric of the d1 protocol (`Task.score`), which is what papers report;
- how raw dataset records become examples (`Task.example_from_record`), and where the
  dataset lives on the Hugging Face Hub.

Tasks register themselves by name; `get_task("countdown")` returns one. To add a task, build a
`Task` in a new module of this package, `register_task` it, and import the module in
`stabledrl_jax/tasks/__init__.py` (see docs/tasks.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

# The answer layout every instruction asks for, and that the format rewards check.
ANSWER_FORMAT = """Reply in exactly this layout:
<reasoning>
your step-by-step thinking
</reasoning>
<answer>
{answer}
</answer>"""


@dataclasses.dataclass(frozen=True)
class Example:
  """One problem, in the record layout of d1 generation files.

  Attributes:
    question: the problem as shown to the model after the task instruction
      (countdown "Numbers: [49, 55, 53]\\nTarget: 51"; sudoku "... Sudoku puzzle: <16 digits>").
    ground_truth: JSON-serializable answer as d1 files store it: float (gsm8k), LaTeX str
      (math500), [numbers, target] (countdown), solution digit string (sudoku).
    reference: a worked answer, if the source has one (GSM8K rationale, a countdown expression
      that reaches the target, a sudoku solution): material for supervised warm starts.
  """

  question: str
  ground_truth: Any
  reference: str | None = None


@dataclasses.dataclass(frozen=True)
class ItemScore:
  """One item's contribution to an accuracy: `correct` out of `total`.

  Most tasks score 0 or 1 out of 1. Sudoku scores blank cells (e.g. 5 of 8), and the d1 protocol
  pools cells over the set, so accuracy = sum(correct) / sum(total).
  """

  correct: float
  total: float


RewardFunction = Callable[[str, Example], float]


@dataclasses.dataclass(frozen=True)
class RewardTerm:
  """A named, weighted component of a task's reward."""

  name: str
  weight: float
  function: RewardFunction


@dataclasses.dataclass(frozen=True)
class HubSource:
  """Where a task's data lives on the Hugging Face Hub."""

  path: str
  config: str | None = None
  split: str = "train"


@dataclasses.dataclass(frozen=True)
class Task:
  """A problem family: prompt formatting, reward, answer parsing and evaluation metric.

  Attributes:
    name: registry name; also the first field of d1 generation file names ("gsm8k_...").
    instruction: the text placed before the question in a prompt.
    reward_terms: summed with their weights by `reward`.
    parse_answer: completion -> the answer the reward reads (None if absent), for logs.
    score: (completion, example) -> `ItemScore` under the d1 evaluation protocol.
    example_from_record: a raw dataset record (JSONL line, CSV row, Hub row) -> `Example`.
    hub_source: default Hugging Face dataset, if there is one.
    aliases: other names accepted by `get_task`.
  """

  name: str
  instruction: str
  reward_terms: tuple[RewardTerm, ...]
  parse_answer: Callable[[str], str | None]
  score: Callable[[str, Example], ItemScore]
  example_from_record: Callable[[Mapping[str, Any]], Example]
  hub_source: HubSource | None = None
  aliases: tuple[str, ...] = ()

  def prompt(self, example: Example, *, with_instruction: bool = True) -> str:
    """The user message: instruction, blank line, question (or the bare question).

    Chat templates (e.g. LLaDA's) are applied by the tokenizer, not here.
    """
    if not with_instruction:
      return example.question
    return f"{self.instruction}\n\n{example.question}"

  def reward_components(self, completion: str, example: Example) -> dict[str, float]:
    """Each reward term's unweighted value, by name (for logging)."""
    return {term.name: term.function(completion, example) for term in self.reward_terms}

  def reward(self, completion: str, example: Example) -> float:
    """The training reward: sum of weight * term."""
    return sum(term.weight * term.function(completion, example) for term in self.reward_terms)

  @property
  def max_reward(self) -> float:
    """The largest possible `reward` (every term is in [0, 1])."""
    return sum(max(term.weight, 0.0) for term in self.reward_terms)


_REGISTRY: dict[str, Task] = {}


def register_task(task: Task) -> Task:
  """Adds a task under its name and aliases; a name may be registered only once."""
  for key in (task.name, *task.aliases):
    if key in _REGISTRY and _REGISTRY[key] is not task:
      raise ValueError(f"A task named {key!r} is already registered.")
  for key in (task.name, *task.aliases):
    _REGISTRY[key] = task
  return task


def get_task(name: str) -> Task:
  """The registered task called `name` (or one of its aliases)."""
  try:
    return _REGISTRY[name]
  except KeyError:
    raise KeyError(f"Unknown task {name!r}; registered: {', '.join(list_tasks())}.") from None


def list_tasks() -> list[str]:
  """Names of the registered tasks (not aliases), sorted."""
  return sorted({task.name for task in _REGISTRY.values()})
