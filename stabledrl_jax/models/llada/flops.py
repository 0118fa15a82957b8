"""Matmul FLOPs of a LLaDA forward pass, counted from the config (for throughput and MFU).

Counted: every matrix product, at 2 FLOPs per multiply-add. For a pass over B sequences of
length S (keys), of which T positions run their queries through the last block (T = S, or the n
of `encode(..., span=(start, n))`), and P positions projected to logits, with D = d_model,
H = n_heads, Kv = n_kv_heads, hd = head_dim, F = mlp_hidden_size, V = embedding_size:

    per block, for T' query positions (T' = S except the last block with a span: T):
      q_proj, attn_out     2 * T' * D * (H * hd)          each
      k_proj, v_proj       2 * S * D * (Kv * hd)          each (keys and values of every position)
      q . k, p . v         2 * T' * S * (H * hd)          each: 4 T' S D for the pair
      ff_proj, up_proj,    2 * T' * D * F                 each
      ff_out
    output head            2 * P * D * V

so a full pass (T' = S = P = L) costs per token 2 * (matmul parameters) + 4 * n_layers * L * D,
the matmul parameters being every kernel except the embedding table (a gather, no FLOPs).

Not counted: the embedding gather, RMSNorm, rotary embeddings, the softmax and the SwiGLU gate
(O(L * D) or O(L * S * H) elementwise work against the O(L * D^2) of the matmuls), the
log-softmax over the vocabulary (O(P * V) against O(P * V * D)), and the optimizer (O(params)).

Backward: each product C = A B needs dA = dC B^T and dB = A^T dC, two products of the same size,
so forward + backward = 3x the forward (`TRAIN_MULTIPLIER`); that holds for the attention products
too, and for the first block, since the embedding table is trained and needs the input gradient.
Rematerialization (`remat=True`) recomputes the blocks' forward in the backward pass: 4x for the
blocks (`REMAT_MULTIPLIER`), the head stays 3x.
"""

from __future__ import annotations

from stabledrl_jax.models.llada.config import ModelConfig

TRAIN_MULTIPLIER = 3
REMAT_MULTIPLIER = 4


def block_flops(config: ModelConfig, keys: int, queries: int,
                projected: int | None = None) -> int:
  """Matmul FLOPs of one transformer block for one sequence; ``projected``: the positions whose
  keys and values are computed (default: every key; a KV-cached call: its queries)."""
  d, f = config.d_model, config.mlp_hidden_size
  q_width = config.n_heads * config.head_dim
  kv_width = config.n_kv_heads * config.head_dim
  projected = keys if projected is None else projected
  projections = 2 * queries * d * q_width * 2 + 2 * projected * d * kv_width * 2
  attention = 2 * 2 * queries * keys * q_width
  mlp = 3 * 2 * queries * d * f
  return projections + attention + mlp


def head_flops(config: ModelConfig, positions: int) -> int:
  """Matmul FLOPs of the output head for `positions` hidden states."""
  return 2 * positions * config.d_model * config.embedding_size


def forward_flops(config: ModelConfig, batch: int, length: int, *, span: int | None = None,
                  logit_positions: int | None = None) -> int:
  """Matmul FLOPs of one forward pass over [batch, length] tokens.

  Args:
    config: the model.
    batch: sequences B.
    length: sequence length L (every position is a key).
    span: n when the last block runs its queries for n positions only (`encode(..., span=(s, n))`);
      None: all L.
    logit_positions: positions per sequence projected to logits (default: `span` or L).
  """
  queries = length if span is None else span
  logits = queries if logit_positions is None else logit_positions
  blocks = (config.n_layers - 1) * block_flops(config, length, length)
  blocks += block_flops(config, length, queries)
  return batch * (blocks + head_flops(config, logits))


def cached_forward_flops(config: ModelConfig, batch: int, length: int, *, queries: int,
                         logit_positions: int) -> int:
  """Matmul FLOPs of a KV-cached pass (``LLaDA.encode_cached`` then the head): ``queries``
  positions run every block, their keys and values are computed and every one of the ``length``
  positions is a key; ``logit_positions`` are projected to logits."""
  blocks = config.n_layers * block_flops(config, length, queries, projected=queries)
  return batch * (blocks + head_flops(config, logit_positions))


def train_flops(config: ModelConfig, batch: int, length: int, *, span: int | None = None) -> int:
  """Matmul FLOPs of forward + backward over [batch, length] tokens.

  ``span``: logits (and the last block's queries) for the last ``span`` positions only, as the
  likelihood estimators compute them (``estimators.LikelihoodSpec.scored_suffix``); None: all L.
  """
  logits = length if span is None else span
  blocks = forward_flops(config, batch, length, span=span) - batch * head_flops(config, logits)
  block_multiplier = REMAT_MULTIPLIER if config.remat else TRAIN_MULTIPLIER
  return block_multiplier * blocks + TRAIN_MULTIPLIER * batch * head_flops(config, logits)


def matmul_params(config: ModelConfig) -> int:
  """Parameters that enter matrix products: every kernel but the embedding table."""
  d, f = config.d_model, config.mlp_hidden_size
  q_width = config.n_heads * config.head_dim
  kv_width = config.n_kv_heads * config.head_dim
  per_block = 2 * d * q_width + 2 * d * kv_width + 3 * d * f
  return config.n_layers * per_block + d * config.embedding_size


def rl_step_parts(shapes, config, rollout, num_samples: int, cache: str
                  ) -> tuple[float, float, float]:
  """``family.Family.step_flops`` of LLaDA (and of any full-attention family whose sampler
  decodes in blocks as LLaDA's): the rollout rows' sampler FLOPs, one forward likelihood pass of
  K = ``num_samples`` samples and one training pass (``profiling.rl_step_flops_of_run``).

  Exact (cache none): every call a pass over L, the last block and the head on the current
  block; prefix/dual: each block's first call such a pass, its later calls KV-cached (dual: the
  block's positions; prefix: from the block on). Likelihoods: K passes over L, the last block
  and the head on the completion."""
  del config
  r = rollout
  rows, prompt, gen = r.num_prompts * r.group_size, r.prompt_length, r.gen_length
  length = prompt + gen
  block = r.block_length
  num_blocks = gen // block
  per_block = r.steps // num_blocks
  full = forward_flops(shapes, rows, length, span=block)
  if cache == "none":
    sampled = r.steps * full
  else:
    sampled = 0
    for b in range(num_blocks):
      queries = block if cache == "dual" else length - (prompt + b * block)
      cached = cached_forward_flops(shapes, rows, length, queries=queries, logit_positions=block)
      sampled += full + (per_block - 1) * cached
  forward = num_samples * forward_flops(shapes, rows, length, span=gen)
  train = num_samples * train_flops(shapes, rows, length, span=gen)
  return float(sampled), float(forward), float(train)
