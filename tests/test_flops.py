"""The matmul FLOP count of `models.llada.flops` against XLA's own count of the compiled computation."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from stabledrl_jax import models
from stabledrl_jax.models.llada import flops


def xla_flops(fn, *args) -> float:
  return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]


@pytest.fixture(scope="module", params=["tiny", "mha"])
def model(request):
  # tiny has grouped-query attention (4 query heads, 2 kv heads); "mha" every head its own k/v.
  overrides = dict(n_kv_heads=4) if request.param == "mha" else {}
  return models.LLaDA(models.get_config("tiny", **overrides), rngs=nnx.Rngs(0))


# XLA also counts the elementwise work (norms, softmax, rotary), which the formula leaves out on
# purpose; with d_model 64 that is a few percent.
TOLERANCE = 0.1


def test_forward_count_matches_xla(model):
  graphdef, state = nnx.split(model)
  tokens = jnp.zeros((3, 40), jnp.int32)
  got = xla_flops(lambda s, t: nnx.merge(graphdef, s)(t), state, tokens)
  want = flops.forward_flops(model.config, 3, 40)
  assert want <= got <= (1 + TOLERANCE) * want


def test_span_count_matches_xla(model):
  graphdef, state = nnx.split(model)
  tokens = jnp.zeros((3, 40), jnp.int32)
  got = xla_flops(
      lambda s, t: (lambda m: m.unembed(m.encode(t, span=(8, 16))))(nnx.merge(graphdef, s)),
      state, tokens)
  want = flops.forward_flops(model.config, 3, 40, span=16)
  assert want <= got <= (1 + TOLERANCE) * want


def test_forward_and_backward_are_three_forwards(model):
  graphdef, params = nnx.split(model, nnx.Param)
  tokens = jnp.zeros((3, 40), jnp.int32)
  loss = lambda p, t: jnp.sum(jax.nn.log_softmax(nnx.merge(graphdef, p)(t)))
  got = xla_flops(jax.grad(loss), params, tokens)
  want = flops.train_flops(model.config, 3, 40)
  assert want == 3 * flops.forward_flops(model.config, 3, 40)
  assert want <= got <= (1 + TOLERANCE) * want


def test_suffix_training_count_matches_xla(model):
  # The likelihood estimators' pass: logits of the last 16 of 40 positions, forward + backward.
  graphdef, params = nnx.split(model, nnx.Param)
  tokens = jnp.zeros((3, 40), jnp.int32)

  def loss(p, t):
    m = nnx.merge(graphdef, p)
    return jnp.sum(jax.nn.log_softmax(m.unembed(m.encode(t, span=(24, 16)))))

  got = xla_flops(jax.grad(loss), params, tokens)
  want = flops.train_flops(model.config, 3, 40, span=16)
  assert want < flops.train_flops(model.config, 3, 40)
  assert want <= got <= (1 + TOLERANCE) * want


def test_per_token_count_is_two_per_matmul_parameter_plus_attention(model):
  config = model.config
  length = 40
  per_token = flops.forward_flops(config, 1, length) / length
  attention = 4 * config.n_layers * length * config.d_model
  assert per_token == 2 * flops.matmul_params(config) + attention
  embedding = config.embedding_size * config.d_model
  norms = (2 * config.n_layers + 1) * config.d_model
  assert flops.matmul_params(config) == models.count_params(config) - embedding - norms


@pytest.mark.parametrize("queries", [8, 24])  # dual: the block; prefix: the completion onward
def test_kv_cached_count_matches_xla(model, queries):
  graphdef, state = nnx.split(model)
  tokens = jnp.zeros((3, 40), jnp.int32)
  cache = jax.eval_shape(lambda s: nnx.merge(graphdef, s).encode_kv(tokens)[1], state)
  cache = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), cache)

  def cached(s, t, kv):
    m = nnx.merge(graphdef, s)
    hidden = m.encode_cached(t[:, 16:16 + queries], 16, kv)
    return m.unembed(hidden[:, :8])

  got = xla_flops(cached, state, tokens, cache)
  want = flops.cached_forward_flops(model.config, 3, 40, queries=queries, logit_positions=8)
  assert want <= got <= (1 + TOLERANCE) * want
