"""The host half of an RL step (docs/training.md, "One RL step"): this process's groups of a
drawn batch encoded, sampled from pi_old, decoded and scored; group advantages; the stress
selection; the global ``RolloutBatch`` the updates take; whole-batch statistics.

``RolloutCollector`` does it, one call per step, and returns a ``Rollouts`` record; the trainer
then scores l_old / l_ref and runs the updates on ``Rollouts.batch``. Every process draws the
same global batch and keeps the groups whose rows live on its devices
(``multihost.RowSplit``); ``RolloutStats`` holds every process's rows, gathered once.

To change what a step samples or scores (another reward pipeline, filtering of groups), change
``RolloutCollector.__call__``; the update side needs only a ``Rollouts`` with its fields.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stabledrl_jax import estimators, models, objectives
from stabledrl_jax.models import lora as lora_lib, sampler_lib
from stabledrl_jax.training.config import run_spec
from stabledrl_jax.training.inputs import data, reward_pool
from stabledrl_jax.training.parallel import multihost
from stabledrl_jax.training.step import decoding, rl_loss

# fold_in(rollout key, DROPOUT_STREAM): the rollouts' LoRA dropout masks
# (model.lora.dropout_passes='every'), apart from the sampler's own noise.
DROPOUT_STREAM = 0x5A3D


@dataclasses.dataclass(frozen=True)
class RolloutStats:
  """Host-side statistics of every process's rollouts, groups contiguous (N rows)."""

  rewards: np.ndarray  # [N] float32, the scheme's total reward.
  abs_advantages: np.ndarray  # [N] float32, |A|.
  lengths: np.ndarray  # [N] float32, completion tokens up to and including the first stop.
  model_calls: np.ndarray  # [N] float32, the sampler's model calls for the row.
  truncated: np.ndarray  # [N] float32, 1 where the completion holds no stop token.
  components: np.ndarray  # [N, T] float32, the reward's terms (``RewardScorer.terms``).

  @classmethod
  def gather(cls, split: multihost.RowSplit, *, rewards, abs_advantages, lengths, model_calls,
             truncated, components) -> RolloutStats:
    """From this process's rows ([B] each, components [B, T]): one collective for all."""
    rows = multihost.gather_rows(np.column_stack(
        [rewards, abs_advantages, lengths, model_calls, truncated, components]
    ).astype(np.float32), split)
    return cls(rewards=rows[:, 0], abs_advantages=rows[:, 1], lengths=rows[:, 2],
               model_calls=rows[:, 3], truncated=rows[:, 4], components=rows[:, 5:])

  def metrics(self, term_names: list[str], group_size: int) -> dict[str, float]:
    """The step's rollout metrics, named as TRL and tunix users know them (docs/training.md,
    "Metrics")."""
    group_std = self.rewards.reshape(-1, group_size).std(axis=-1)
    return {
        "rewards/mean": float(self.rewards.mean()), "rewards/std": float(self.rewards.std()),
        **{f"rewards/{name}": float(self.components[:, j].mean())
           for j, name in enumerate(term_names)},
        "frac_reward_zero_std": float(np.mean(group_std < 1e-6)),
        "advantage/abs_mean": float(self.abs_advantages.mean()),
        "completions/mean_length": float(self.lengths.mean()),
        "completions/min_length": float(self.lengths.min()),
        "completions/max_length": float(self.lengths.max()),
        "completions/clipped_ratio": float(self.truncated.mean()),
        "rollout/calls_per_completion": float(self.model_calls.mean()),
    }


@dataclasses.dataclass(frozen=True)
class Rollouts:
  """One RL step's rollouts: this process's B rows, and the global batch of all N.

  ``batch.old_logp`` and ``batch.ref_logp`` are zeros: the trainer scores them.
  """

  batch: rl_loss.RolloutBatch  # Global arrays over the mesh's batch axis, [N, P + G].
  tokens: np.ndarray  # [B, P + G] int, prompts and completions.
  advantages: np.ndarray  # [B] float32.
  stressed: np.ndarray | None  # [B] bool: the stress test's "hard" rows; None without it.
  stats: RolloutStats  # Every process's rows.
  samples: list[dict[str, Any]]  # Rollouts to log: {prompt, completion, reward}.
  seconds: float  # Drawing, encoding and sampling, wall time.
  reward_seconds: float = 0.0  # Decoding the texts, scoring them on the host, the advantages.


class RolloutCollector:
  """Samples and scores one step's rollouts: ``collector(params, examples, key, ...)``."""

  def __init__(self, run: run_spec.RunSpec, spec: run_spec.RolloutSpec, *, tokenizer, task,
               scorer: reward_pool.RewardScorer, graphdef, model_config, mesh):
    """``run`` and ``spec`` resolved from the config (``specs.resolve_run``,
    ``specs.resolve_rollout``): the collector reads no config."""
    self.run = run
    self.spec = spec
    self.tokenizer = tokenizer
    self.task = task
    self.scorer = scorer
    self.graphdef = graphdef
    self.mesh = mesh
    self.stop_ids = np.asarray(models.family.stop_ids(model_config))
    # Rank-1 spec: the leading (batch) axis split, valid for arrays of any rank.
    self.batch_sharding = models.batch_sharding(mesh, ndim=1)
    self._splits: dict[int, multihost.RowSplit] = {}
    self.split = self.split_of(spec.num_rows)
    self.groups = self.split.groups(spec.group_size)  # This process's groups of a drawn batch.

  def split_of(self, num_rows: int) -> multihost.RowSplit:
    """This process's rows of a batch of ``num_rows`` (cached: one collective per size)."""
    if num_rows not in self._splits:
      self._splits[num_rows] = multihost.row_split(self.batch_sharding, num_rows)
    return self._splits[num_rows]

  def __call__(self, params, drawn: list[Any], key: jax.Array, stress_key: jax.Array, *,
               num_samples: int = 0) -> Rollouts:
    """The rollouts of ``drawn`` (the step's global batch of examples; this process keeps its
    groups), sampled with ``key`` from ``params``; ``stress_key`` selects the stressed rows;
    ``num_samples`` of them decoded for the log."""
    spec, split = self.spec, self.split
    start = time.perf_counter()
    examples = [drawn[int(g)] for g in self.groups]
    prompts = data.encode_examples(spec, self.tokenizer, self.task, examples)
    prompt_tokens = np.repeat(prompts.tokens, spec.group_size, axis=0)
    prompt_mask = np.repeat(prompts.mask, spec.group_size, axis=0)
    tokens, calls = self.generate(params, prompt_tokens, prompt_mask, key,
                                  num_rows=split.num_rows)
    seconds = time.perf_counter() - start

    start = time.perf_counter()
    prompt_length = prompt_tokens.shape[1]
    texts = data.decode_completions(self.tokenizer, tokens[:, prompt_length:])
    components = self.scorer(texts, [examples[i // spec.group_size] for i in range(len(texts))])
    rewards = self.scorer.rewards(components)
    # Groups never span processes: the advantages of this process's rows are its own.
    advantages = np.asarray(objectives.group_advantages(
        jnp.asarray(rewards), spec.group_size, scale_by_std=self.run.scale_advantages_by_std,
        baseline=self.run.baseline))
    reward_seconds = time.perf_counter() - start
    stressed = None
    if spec.stress_fraction > 0:  # One selection for l_theta and l_old.
      stressed = np.asarray(estimators.stress_selection(
          stress_key, split.num_rows, spec.stress_fraction))[split.rows]
    completion = self.completion_mask(tokens)
    samples = [dict(prompt=p, completion=c, reward=float(w)) for p, c, w in zip(
        data.decode_completions(self.tokenizer, prompt_tokens[:num_samples]),
        texts[:num_samples], rewards[:num_samples])] if num_samples else []
    stats = RolloutStats.gather(
        split, rewards=rewards, abs_advantages=np.abs(advantages), lengths=completion.sum(-1),
        model_calls=calls,
        # Completions that hit the length limit: no stop token anywhere in them.
        truncated=~np.isin(tokens[:, prompt_length:], self.stop_ids).any(-1),
        components=components)
    batch = self.make_batch(tokens, prompt_mask, completion, advantages, stressed,
                            num_rows=split.num_rows)
    return Rollouts(batch=batch, tokens=tokens, advantages=advantages, stressed=stressed,
                    stats=stats, samples=samples, seconds=seconds,
                    reward_seconds=reward_seconds)

  def generate(self, params, prompt_tokens: np.ndarray, prompt_mask: np.ndarray, key, *,
               num_rows: int | None = None, **options) -> tuple[np.ndarray, np.ndarray]:
    """Rollouts: completions [B, P + G] and the model calls each needed [B], of this process's
    rows.

    ``prompt_tokens`` and ``prompt_mask`` [B, P] are this process's rows (``split_of``) of a
    batch of ``num_rows`` (default B: one process). ``options`` (temperature, steps, remasking,
    threshold, cache) override the rollout sampler's (``spec.sampling``).
    """
    settings = self.spec.sampling.with_options(**options)
    split = self.split_of(len(prompt_tokens) if num_rows is None else num_rows)
    chunk_rows = self.spec.chunk_rows  # rollout.microbatch_groups x group_size
    if split.num_rows % max(chunk_rows, 1):  # Not a rollout batch: one sampler call.
      chunk_rows = 0
    model = nnx.merge(self.graphdef, params)
    if self.run.lora_dropout_every_pass:  # The official trainers sample in train mode.
      model = lora_lib.with_dropout(model, jax.random.fold_in(key, DROPOUT_STREAM),
                                    self.run.lora_dropout, per_call=True)
    return decoding.generate_rows(model, prompt_tokens, prompt_mask, key, settings,
                                  mesh=self.mesh, split=split, chunk_rows=chunk_rows)

  def completion_mask(self, tokens: np.ndarray) -> np.ndarray:
    """[B, G] bool: each rollout's completion tokens, up to and including its first stop."""
    prompt_length = tokens.shape[1] - self.spec.gen_length
    return np.asarray(sampler_lib.completion_mask(tokens, prompt_length, self.stop_ids))

  def make_batch(self, tokens: np.ndarray, prompt_mask: np.ndarray, completion: np.ndarray,
                 advantages: np.ndarray, stressed: np.ndarray | None = None, *,
                 num_rows: int | None = None) -> rl_loss.RolloutBatch:
    """Global arrays of the rollouts, sharded over the batch axis, from this process's rows
    of a batch of ``num_rows`` (default: ``len(tokens)``, one process); ``completion`` is
    ``completion_mask(tokens)``."""
    gen_length = self.spec.gen_length
    no_gen = np.zeros((tokens.shape[0], gen_length), bool)
    no_prompt = np.zeros_like(prompt_mask)
    logp_shape = tokens.shape if self.run.likelihood.token_level else tokens.shape[:1]
    batch = rl_loss.RolloutBatch(
        tokens=tokens.astype(np.int32),
        prompt_mask=np.concatenate([prompt_mask, no_gen], axis=1),
        completion_mask=np.concatenate([no_prompt, completion], axis=1),
        attention_mask=np.concatenate([prompt_mask, ~no_gen], axis=1),
        advantages=advantages.astype(np.float32),
        old_logp=np.zeros(logp_shape, np.float32),
        ref_logp=np.zeros(logp_shape, np.float32), stressed=stressed)
    return multihost.to_global(batch, self.batch_sharding,
                               len(tokens) if num_rows is None else num_rows)
