"""Host-side data plumbing: tasks and examples -> fixed-shape token arrays.

Prompts are left-padded to ``prompt_length`` (so every completion starts at the
same position, as the sampler needs); completions occupy the next
``gen_length`` positions. Everything returned is numpy, ready to shard.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import ml_collections
import numpy as np
from absl import logging

from stabledrl_jax import input_files, tasks, tokenizers
from stabledrl_jax.models import family


def make_tokenizer(config: ml_collections.ConfigDict):
  """``config.tokenizer``: kind 'char' (with ``alphabet``), or a model family's name, whose
  conventions (``models.family.Family.tokenizer``) apply to the tokenizer.json at ``path``."""
  if config.kind == "char":
    return tokenizers.CharTokenizer(config.alphabet or tokenizers.DEFAULT_ALPHABET)
  if config.kind not in family.names():
    raise ValueError(f"config.tokenizer.kind: {config.kind!r} is not 'char' or one of the "
                     f"model families {family.names()}")
  with input_files.named("config.tokenizer.path"):
    return family.get(config.kind).tokenizer(config.path)


def format_prompt(tokenizer, task: tasks.Task, example: tasks.Example, *,
                  with_instruction: bool, assistant_prefix: str = "",
                  style: str = tasks.DEFAULT_PROMPT_STYLE) -> str:
  """The prompt text in ``style`` (``Task.prompt``); chat tokenizers wrap it in their chat
  template.

  ``assistant_prefix`` starts the assistant's turn of a chat template (d1's evaluation prompts
  end with "<reasoning>"); tokenizers without a template ignore it.
  """
  text = task.prompt(example, with_instruction=with_instruction, style=style)
  if hasattr(tokenizer, "chat_prompt"):
    return tokenizer.chat_prompt(text, assistant_prefix=assistant_prefix)
  return text


def answer_text(example: tasks.Example, reference: str | None = None) -> str:
  """Supervised target: the reference in the <answer> layout the rewards read."""
  reference = example.reference if reference is None else reference
  if reference is None:
    raise ValueError(f"Example {example.question!r} has no reference answer to imitate.")
  return f"<answer>{reference}</answer>"


def check_alphabet(tokenizer, task: tasks.Task, examples: Sequence[tasks.Example], *,
                   limit: int = 64) -> None:
  """Raises ValueError naming ``config.tokenizer.alphabet`` when a character tokenizer cannot
  spell the reference answers (in the ``answer_text`` layout) of the first ``limit`` examples:
  their characters would become ``<unk>``, so no completion could be read as an answer and
  every reward would be 0. Other tokenizers pass.
  """
  if not isinstance(tokenizer, tokenizers.CharTokenizer):
    return
  known = set(tokenizer.alphabet)
  missing, shown = set(), None
  for index in range(min(len(examples), limit)):
    example = examples[index]
    if example.reference is None:
      continue
    text = answer_text(example)
    gaps = set(text) - known
    if gaps and shown is None:
      shown = text
    missing |= gaps
  if missing:
    raise ValueError(
        f"config.tokenizer.alphabet: {tokenizer.alphabet!r} cannot encode "
        f"{''.join(sorted(missing))!r}, which task {task.name!r}'s answers use (e.g. "
        f"{shown[:60]!r}): no completion could spell an answer; add the characters (or leave "
        "the alphabet '' for the default)")


def noisy_demonstration(task: tasks.Task, example: tasks.Example, rng: np.random.Generator, *,
                        error_rate: float, error_cells: int) -> str:
  """The reference as an imperfect demonstrator writes it.

  With probability ``error_rate`` the demonstrator makes its habitual mistake:
  in sudoku, the digit of each of the first ``error_cells`` blank cells is
  replaced by the next digit (4 wraps to 1). A model fitted on such
  demonstrations samples the right digit often but decodes the wrong one
  greedily (for rates above 1/2): the gap between pass@k and pass@1 that RL
  can close.
  """
  reference = example.reference
  if error_rate == 0.0 or rng.random() >= error_rate:
    return reference
  if task.demonstrate is None:
    raise ValueError(f"config.sft.demo_error_rate > 0 needs a task with an imperfect "
                     f"demonstrator (Task.demonstrate), and {task.name!r} has none.")
  return task.demonstrate(example, error_cells)


def encode_prompts(tokenizer, texts: Sequence[str], prompt_length: int | None
                   ) -> tuple[np.ndarray, np.ndarray]:
  """Left-padded prompts: tokens [P, prompt_length] int32 and mask [P, prompt_length] bool
  (True: a real token). ``prompt_length`` None: the longest prompt's length.

  The one prompt encoder of training and evaluation.
  """
  try:
    return tokenizer.encode_batch(texts, length=prompt_length or None, padding_side="left")
  except ValueError as error:  # Name the setting to raise; never truncate a prompt.
    longest = max(range(len(texts)), key=lambda i: len(tokenizer.encode(texts[i])))
    raise ValueError(f"{error} (config.rollout.prompt_length / --prompt_length): "
                     f"{texts[longest][:80]!r}...") from None


def encode_completions(tokenizer, texts: Sequence[str], gen_length: int) -> np.ndarray:
  """Completions followed by EOS up to ``gen_length`` (LLaDA's SFT layout): [B, gen_length]."""
  tokens = np.full((len(texts), gen_length), tokenizer.eos_id, np.int32)
  for row, text in enumerate(texts):
    ids = tokenizer.encode(text)
    if len(ids) >= gen_length:
      raise ValueError(f"A target of {len(ids)} tokens does not fit config.rollout.gen_length="
                       f"{gen_length} with its EOS.")
    tokens[row, :len(ids)] = ids
  return tokens


def decode_completions(tokenizer, completion_tokens: np.ndarray) -> list[str]:
  """Text of each completion, up to its first EOS."""
  return [tokenizer.decode(row) for row in np.asarray(completion_tokens)]


def make_examples(config: ml_collections.ConfigDict, split: str) -> Sequence[tasks.Example]:
  """``config.data.{train,eval}``: 'synthetic' (the task's generator), 'hub' or a local file.

  With a character tokenizer, its alphabet must spell the first examples' answers
  (``check_alphabet``): checked once here, when the data is made, not on every batch.
  """
  examples = _make_examples(config, split)
  if config.tokenizer.kind == "char":
    check_alphabet(make_tokenizer(config.tokenizer), tasks.get_task(config.task.name), examples)
  return examples


def _make_examples(config: ml_collections.ConfigDict, split: str) -> Sequence[tasks.Example]:
  source = config.data.train if split == "train" else config.data.eval
  size = config.data.train_size if split == "train" else config.data.eval_size
  seed = config.seed + (0 if split == "train" else 1)
  hub_split = "train" if split == "train" else "test"
  if source != "synthetic":  # A file, a Hub dataset, or "hub": the task's default (network).
    with input_files.named(f"config.data.{'train' if split == 'train' else 'eval'}"):
      return tasks.load_examples(config.task.name, None if source == "hub" else source,
                                 split=hub_split, limit=size or None)
  task = tasks.get_task(config.task.name)
  if task.generator is None:
    having = [name for name in tasks.list_tasks() if tasks.get_task(name).generator]
    raise ValueError(f"config.data.{split}='synthetic' needs a task with a generator "
                     f"({', '.join(having)}), got {task.name!r}.")
  return task.generator(size, seed=seed, split=hub_split, **dict(config.data.generator))


@dataclasses.dataclass
class PromptSet:
  """Encoded prompts of a list of examples."""

  examples: list[Any]
  tokens: np.ndarray  # [P, prompt_length]
  mask: np.ndarray  # [P, prompt_length]


def encode_examples(spec: Any, tokenizer, task: tasks.Task,
                    examples: Sequence[tasks.Example]) -> PromptSet:
  """The prompts of ``examples``, written and padded as ``spec`` (a ``run_spec.RolloutSpec``,
  ``specs.resolve_rollout``) says."""
  texts = [format_prompt(tokenizer, task, ex, with_instruction=spec.with_instruction,
                         style=spec.prompt_style) for ex in examples]
  tokens, mask = encode_prompts(tokenizer, texts, spec.prompt_length)
  return PromptSet(list(examples), tokens, mask)


def fitting_examples(spec: Any, tokenizer, task: tasks.Task, examples: Sequence[tasks.Example],
                     *, split: str) -> list[tasks.Example]:
  """The examples whose prompts fit ``spec.prompt_length`` tokens (``spec``: a
  ``run_spec.RolloutSpec``); the others are skipped, their count logged once, naming the
  setting (a dataset with a few long prompts must not stop a run). StableDRL's official code has
  no cap; d1, SPG and wd1 keep a prompt's last 200 tokens and ESPO its last 400, which drops its
  start (docs/algorithms.md). Raises ValueError naming ``config.rollout.prompt_length`` when
  none fits.
  """
  examples = list(examples)
  if not examples:
    return examples
  texts = [format_prompt(tokenizer, task, ex, with_instruction=spec.with_instruction,
                         style=spec.prompt_style) for ex in examples]
  lengths = [len(tokenizer.encode(text)) for text in texts]
  kept = [ex for ex, n in zip(examples, lengths) if n <= spec.prompt_length]
  skipped = len(examples) - len(kept)
  if not kept:
    raise ValueError(f"config.rollout.prompt_length: none of the {len(examples)} {split} "
                     f"prompts fits {spec.prompt_length} tokens (the shortest has "
                     f"{min(lengths)}, the longest {max(lengths)})")
  if skipped:
    logging.warning("config.data.%s: skipped %d of %d prompts longer than "
                    "config.rollout.prompt_length=%d tokens (the longest has %d); raise it to "
                    "keep them", split, skipped, len(examples), spec.prompt_length, max(lengths))
  return kept


def check_tokenizer(model_config: Any, tokenizer) -> None:
  """Raises ValueError when the tokenizer's mask or EOS id, or its vocabulary, is not the model's:
  the sampler would then reveal tokens the tokenizer cannot read."""
  mismatches = []
  if tokenizer.mask_id != model_config.mask_token_id:
    mismatches.append(f"mask id {tokenizer.mask_id} vs {model_config.mask_token_id}")
  if tokenizer.eos_id != model_config.eos_token_id:
    mismatches.append(f"EOS id {tokenizer.eos_id} vs {model_config.eos_token_id}")
  if tokenizer.vocab_size < model_config.vocab_size:
    mismatches.append(f"vocabulary {tokenizer.vocab_size} < {model_config.vocab_size}")
  if mismatches:
    raise ValueError("the tokenizer does not fit the model (tokenizer vs model): "
                     + ", ".join(mismatches))
