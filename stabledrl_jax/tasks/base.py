"""`Example`, `Task` and the task registry.

A task bundles what the RL loop and the evaluator need to know about a problem family:

- how a question becomes a prompt (`Task.prompt`), in a named style: 'd1' (the task's
  instruction in the d1 layout of <reasoning> and <answer> tags, then the question) or
  'stabledrl' (the official StableDRL dataloaders' templates);
- the training reward of a completion: a weighted sum of named terms (`Task.reward`), under a
  named scheme: 'stabledrl' (the official StableDRL code's rewards, the default) or 'd1';
- the extracted answer, for logs (`Task.parse_answer`);
- the evaluation metric of the d1 protocol (`Task.score`), which is what papers report;
- how raw dataset records become examples (`Task.example_from_record`), and where the
  dataset lives on the Hugging Face Hub.

Tasks register themselves by name; `get_task("countdown")` returns one. A task is one module:
it builds a `Task` (its synthetic generator, its imperfect demonstrator and its place in the
evaluation suite included) and calls `register_task`; to ship it, import the module in
`stabledrl_jax/tasks/__init__.py`; a task registered from the user's own code works the same
(see docs/tasks.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from stabledrl_jax.rewards import format_rewards

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


# The official StableDRL math and GSM8K prompts: the problem, then this (its mixed math/GSM8K
# dataloader, which both official math configs use, appends it to every problem with no space;
# its raw string doubles the backslashes, so the model reads "\\boxed{}": kept as published,
# docs/algorithms.md).
STABLEDRL_BOXED_INSTRUCTION = (r"(Please put the final answer in \\boxed{} tag, "
                               r"i.e. $\\boxed{answer here}$)")


def stabledrl_boxed_prompt(example: Example) -> str:
  """The official StableDRL prompt of a math or GSM8K problem."""
  return example.question + STABLEDRL_BOXED_INSTRUCTION


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


# The reward schemes every task defines: the official StableDRL training loop's (its
# dataloaders' rewards plus `anti_short_boxed_reward`), and d1's (correctness plus format terms).
REWARD_SCHEMES = ("stabledrl", "d1")
DEFAULT_REWARD_SCHEME = "stabledrl"

# How a question becomes a prompt (`Task.prompt`): 'd1' (`Task.instruction`, a blank line, the
# question) or 'stabledrl' (`Task.stabledrl_prompt`, the official dataloaders' templates).
PROMPT_STYLES = ("d1", "stabledrl")
DEFAULT_PROMPT_STYLE = "d1"

# StableDRL adds this term to every task's reward (docs/algorithms.md).
ANTI_SHORT_BOXED = RewardTerm(
    "anti_short_boxed", 1.0,
    lambda completion, example: format_rewards.anti_short_boxed_reward(completion))


@dataclasses.dataclass(frozen=True)
class HubSource:
  """Where a task's data lives on the Hugging Face Hub.

  Attributes:
    path, config, split: the dataset, its configuration and split.
    keep: records to keep (None: all), e.g. the official MATH training filter.
  """

  path: str
  config: str | None = None
  split: str = "train"
  keep: Callable[[Mapping[str, Any]], bool] | None = None


@dataclasses.dataclass(frozen=True)
class Task:
  """A problem family: prompt formatting, reward, answer parsing and evaluation metric.

  Attributes:
    name: registry name; also the first field of d1 generation file names ("gsm8k_...").
    instruction: the text placed before the question in a prompt.
    rewards: for each scheme of `REWARD_SCHEMES`, the terms `reward` sums with their weights.
    parse_answer: completion -> the answer the reward reads (None if absent), for logs.
    score: (completion, example) -> `ItemScore` under the d1 evaluation protocol.
    example_from_record: a raw dataset record (JSONL line, CSV row, Hub row) -> `Example`.
    hub_sources: the default Hugging Face dataset of each split ('train', 'test'), where there
      is one: the official StableDRL configs' training sets.
    aliases: other names accepted by `get_task`.
    stabledrl_prompt: example -> the prompt of the official StableDRL dataloader (its
      template, instruction included); None if the official code has no such task.
    generator: ``(size, *, seed, split, **options) -> examples``, the synthetic dataset of
      ``data.train='synthetic'`` (options: ``config.data.generator``); None: the task has none.
    demonstrate: the reference as an imperfect demonstrator writes it when it errs,
      ``(example, error_cells) -> reference`` (``config.sft.demo_error_rate``); None: none.
    suite_position: its place in ``evaluate --task all`` (d1's evaluation suite), None if it
      is not part of it.
    test_file: the packaged test set ``evaluate`` reads by default (``tasks.PACKAGED_DATA``),
      None: the task's Hub test set.
  """

  name: str
  instruction: str
  rewards: Mapping[str, tuple[RewardTerm, ...]]
  parse_answer: Callable[[str], str | None]
  score: Callable[[str, Example], ItemScore]
  example_from_record: Callable[[Mapping[str, Any]], Example]
  hub_sources: Mapping[str, HubSource] = dataclasses.field(default_factory=dict)
  aliases: tuple[str, ...] = ()
  stabledrl_prompt: Callable[[Example], str] | None = None
  generator: Callable[..., Any] | None = None
  demonstrate: Callable[[Example, int], str] | None = None
  suite_position: int | None = None
  test_file: str | None = None

  def __post_init__(self):
    if set(self.rewards) != set(REWARD_SCHEMES):
      raise ValueError(f"Task {self.name!r} defines reward schemes {sorted(self.rewards)}; "
                       f"every task defines {REWARD_SCHEMES}.")

  def reward_terms(self, scheme: str = DEFAULT_REWARD_SCHEME) -> tuple[RewardTerm, ...]:
    """The terms of a reward scheme (ValueError naming the schemes for an unknown one)."""
    if scheme not in self.rewards:
      raise ValueError(f"Unknown reward scheme {scheme!r}; choose one of {REWARD_SCHEMES}.")
    return self.rewards[scheme]

  def prompt(self, example: Example, *, with_instruction: bool = True,
             style: str = DEFAULT_PROMPT_STYLE) -> str:
    """The user message in ``style`` (`PROMPT_STYLES`), or the bare question.

    'd1': the instruction, a blank line, the question. 'stabledrl': the official template.
    Chat templates (e.g. LLaDA's) are applied by the tokenizer, not here.
    """
    if style not in PROMPT_STYLES:
      raise ValueError(f"Unknown prompt style {style!r}; choose one of {PROMPT_STYLES}.")
    if not with_instruction:
      return example.question
    if style == "stabledrl":
      if self.stabledrl_prompt is None:
        raise ValueError(f"Task {self.name!r} has no official StableDRL prompt; use the 'd1' "
                         "prompt style.")
      return self.stabledrl_prompt(example)
    return f"{self.instruction}\n\n{example.question}"

  def reward_components(self, completion: str, example: Example,
                        scheme: str = DEFAULT_REWARD_SCHEME) -> dict[str, float]:
    """Each reward term's unweighted value, by name (for logging)."""
    return {term.name: term.function(completion, example) for term in self.reward_terms(scheme)}

  def reward(self, completion: str, example: Example,
             scheme: str = DEFAULT_REWARD_SCHEME) -> float:
    """The training reward: sum of weight * term."""
    return sum(term.weight * term.function(completion, example)
               for term in self.reward_terms(scheme))

  def max_reward(self, scheme: str = DEFAULT_REWARD_SCHEME) -> float:
    """The largest possible `reward` (every term is at most 1)."""
    return sum(max(term.weight, 0.0) for term in self.reward_terms(scheme))


_REGISTRY: dict[str, Task] = {}


def register_task(task: Task) -> Task:
  """Adds a task under its name and aliases; a name may be registered only once."""
  for key in (task.name, *task.aliases):
    if key in _REGISTRY and _REGISTRY[key] is not task:
      raise ValueError(f"A task named {key!r} is already registered.")
  for key in (task.name, *task.aliases):
    _REGISTRY[key] = task
  return task


def unregister_task(name: str) -> None:
  """Removes the task called ``name`` and its aliases (a plug-in's test cleans up after itself)."""
  task = get_task(name)
  for key in (task.name, *task.aliases):
    _REGISTRY.pop(key, None)


def get_task(name: str) -> Task:
  """The registered task called `name` (or one of its aliases)."""
  try:
    return _REGISTRY[name]
  except KeyError:
    raise KeyError(f"Unknown task {name!r}; registered: {', '.join(list_tasks())}.") from None


def suite() -> list[str]:
  """The tasks of ``evaluate --task all``, in their ``suite_position`` order."""
  tasks = {task.name: task for task in _REGISTRY.values() if task.suite_position is not None}
  return sorted(tasks, key=lambda name: tasks[name].suite_position)


def list_tasks() -> list[str]:
  """Names of the registered tasks (not aliases), sorted."""
  return sorted({task.name for task in _REGISTRY.values()})
