"""Rematerialization is a training-memory setting: a model built with ``remat=True`` decodes in
the samplers (whose loops trace the model inside a lax loop) exactly as without it, and its
loss and gradients are those of the model without it. The paper configs set ``remat=True`` and
the trainer decodes its rollouts with the same model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stabledrl_jax import models
from stabledrl_jax.models.llada import sampler as llada_sampler
from stabledrl_jax.models.sdar import sampler as sdar_sampler


def _pair(family):
  build, get = models.family.get(family).model_cls, models.family.get(family).get_config
  return (build(get("tiny", remat=False), rngs=nnx.Rngs(0)),
          build(get("tiny", remat=True), rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_a_remat_llada_samples_as_the_plain_one(cache):
  plain, remat = _pair("llada")
  prompt = jax.random.randint(jax.random.key(1), (2, 8), 3, 40)
  kw = dict(key=jax.random.key(0), gen_length=16, steps=8, block_length=8, temperature=0.9,
            cache=cache)
  np.testing.assert_array_equal(llada_sampler.generate(remat, prompt, **kw),
                                llada_sampler.generate(plain, prompt, **kw))


def test_a_remat_sdar_samples_as_the_plain_one():
  plain, remat = _pair("sdar")
  prompt = jax.random.randint(jax.random.key(1), (2, 8), 3, 40)
  kw = dict(key=jax.random.key(0), gen_length=8, steps=8, temperature=0.9)
  np.testing.assert_array_equal(sdar_sampler.generate(remat, prompt, **kw),
                                sdar_sampler.generate(plain, prompt, **kw))


@pytest.mark.parametrize("family", ["llada", "sdar", "dream"])
def test_remat_keeps_the_loss_and_gradients(family):
  plain, remat = _pair(family)
  tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 40)

  def loss(model):
    return jnp.sum(jnp.sin(model(tokens).astype(jnp.float32)))

  (l0, g0), (l1, g1) = (nnx.value_and_grad(loss)(m) for m in (plain, remat))
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(nnx.state(g1)), jax.tree.leaves(nnx.state(g0))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
