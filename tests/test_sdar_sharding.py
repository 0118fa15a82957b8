"""SDAR on a fake 8-device mesh (data=2, fsdp=2, tensor=2): parameters are created in their
shards, and the staircase ELBO and the cached sampler give what one device gives."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import AxisType, PartitionSpec as P
    from stabledrl_jax import block_estimators as be, models
    from stabledrl_jax.models.sdar.sampler import generate

    assert len(jax.devices()) == 8, jax.devices()
    config = models.get_sdar_config("tiny")
    single = models.SDAR(config, rngs=nnx.Rngs(0))
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    model = models.init_model(config, seed=0, mesh=mesh)
    q = model.layers[0].self_attn.q_proj.kernel[...]
    assert q.sharding.spec == P("fsdp", "tensor"), q.sharding
    assert {s.data.shape for s in q.addressable_shards} == {(32, 64)}
    want = single.layers[0].self_attn.q_proj.kernel[...]
    np.testing.assert_array_equal(np.asarray(q), np.asarray(want))

    tokens = jax.random.randint(jax.random.key(0), (4, 16), 0, 120)
    prompt_mask = jnp.arange(16)[None].repeat(4, 0) < 5
    completion = ~prompt_mask
    shard = lambda x: jax.device_put(x, models.batch_sharding(mesh))

    @nnx.jit
    def elbo(m, tokens, prompt_mask, completion):
      fn = lambda noisy, clean, mask: m.staircase(noisy, clean, mask)
      return be.estimate_block_elbo(fn, tokens, prompt_mask, completion, jax.random.key(1),
                                    mask_id=config.mask_token_id, block_size=config.block_size,
                                    num_samples=2)

    got = elbo(model, shard(tokens), shard(prompt_mask), shard(completion))
    want = elbo(single, tokens, prompt_mask, completion)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    kw = dict(key=jax.random.key(0), gen_length=8, steps=2)
    np.testing.assert_array_equal(generate(model, shard(tokens[:, :6]), **kw),
                                  generate(single, tokens[:, :6], **kw))
    print("OK")
""")


def test_sharded_staircase_elbo_and_sampling_match_one_device():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-4000:]
