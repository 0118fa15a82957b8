"""LoRA adapters (models/lora.py): the adapter's math against a float64 re-derivation, PEFT's
target matching on the official module names, PEFT's merge, the base as the reference policy,
and a LoRA RL run that moves only the adapters."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stabledrl_jax import export, models
from stabledrl_jax.models import layers, lora
from stabledrl_jax.training.config import specs
from stabledrl_jax.training.loop import trainer
from stabledrl_jax.training.state import checkpoint_source
from stabledrl_jax.training.step import build, train_step

from test_training import tiny_config

D1_TARGETS = ("q_proj", "k_proj", "v_proj", "up_proj")


def _tiny(family="llada"):
  return models.init_model(models.family.get(family).get_config("tiny"), seed=0)


def _tokens(model):
  return jnp.arange(24).reshape(2, 12) % model.config.vocab_size


def test_an_adapter_adds_scale_times_x_a_b(rng=np.random.default_rng(0)):
  linear = layers.Linear(6, 5, axes=(layers.AX_EMBED, layers.AX_MLP), std=0.5,
                         dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  x = rng.normal(size=(3, 4, 6)).astype(np.float32)
  before = np.asarray(linear(jnp.asarray(x)))
  linear.lora = nnx.data(lora.Adapter(6, 5, rank=2, scale=1.5, axes=(layers.AX_EMBED,
                                      layers.AX_MLP), param_dtype=jnp.float32,
                                      key=jax.random.key(1)))
  np.testing.assert_array_equal(np.asarray(linear(jnp.asarray(x))), before)  # B starts at 0.
  a, b = rng.normal(size=(6, 2)), rng.normal(size=(2, 5))
  linear.lora.a[...] = jnp.asarray(a, jnp.float32)
  linear.lora.b[...] = jnp.asarray(b, jnp.float32)
  kernel = np.asarray(linear.kernel[...], np.float64)
  want = x.astype(np.float64) @ (kernel + 1.5 * a @ b)
  np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x))), want, rtol=2e-5, atol=2e-5)
  bound = 1 / np.sqrt(6)  # PEFT's lora_A init: uniform in +-1/sqrt(in).
  first = np.asarray(lora.Adapter(6, 5, rank=2, scale=1.0, axes=(None, None),
                                  param_dtype=jnp.float32, key=jax.random.key(2)).a[...])
  assert np.all(np.abs(first) <= bound) and first.std() > 0


def test_targets_are_the_official_names_matched_as_peft_matches_them():
  model = _tiny("llada")
  n = model.config.n_layers
  chosen = lora.targeted(model, lora.LoRASpec(4, 8.0, D1_TARGETS))
  assert sorted(chosen) == sorted(f"model.transformer.blocks.{i}.{p}" for i in range(n)
                                  for p in D1_TARGETS)
  # PEFT's suffix rule: LLaDA's "ff_out" is every block's down projection and the output head.
  heads = lora.targeted(model, lora.LoRASpec(4, 8.0, ("ff_out",)))
  assert "model.transformer.ff_out" in heads and heads["model.transformer.ff_out"] == ("lm_head",)
  assert len(heads) == n + 1
  # Names that LLaDA does not have (d1's o_proj, gate_proj, down_proj) are one line, not dropped.
  with pytest.raises(ValueError, match=r"^config\.model\.lora\.targets: \['o_proj'\] match no "
                     r"projection of llada \(its modules are named \['attn_out', "):
    lora.targeted(model, lora.LoRASpec(4, 8.0, ("q_proj", "o_proj")))
  sdar = _tiny("sdar")
  chosen = lora.targeted(sdar, lora.LoRASpec(4, 8.0, ("gate_proj", "o_proj")))
  assert chosen["model.layers.0.mlp.gate_proj"] == ("layers", 0, "mlp", "ff_proj")
  assert chosen["model.layers.0.self_attn.o_proj"] == ("layers", 0, "self_attn", "o_proj")


@pytest.mark.parametrize("family", ["llada", "sdar", "dream"])
def test_adapters_change_nothing_until_trained_and_off_is_the_base(family):
  model = _tiny(family)
  tokens = _tokens(model)
  base = np.asarray(model(tokens))
  lora.add_adapters(model, lora.LoRASpec(4, 8.0, ("q_proj", "v_proj", "up_proj")), seed=3)
  np.testing.assert_array_equal(np.asarray(model(tokens)), base)
  graphdef, params = nnx.split(model, nnx.Param)
  adapters, frozen = lora.split(params)
  assert {type(v) for v in jax.tree.leaves(adapters, is_leaf=lambda x: isinstance(
      x, nnx.Variable))} == {nnx.LoRAParam}
  moved = lora.join(jax.tree.map(lambda x: x + 0.05, adapters), frozen)
  assert np.abs(np.asarray(nnx.merge(graphdef, moved)(tokens)) - base).max() > 1e-3
  np.testing.assert_array_equal(
      np.asarray(nnx.merge(graphdef, lora.adapters_off(moved))(tokens)), base)
  with pytest.raises(ValueError, match="already has adapters"):
    lora.add_adapters(model, lora.LoRASpec(4, 8.0, ("q_proj",)))


def test_merged_kernels_are_peft_s_w_plus_alpha_over_r_b_a(rng=np.random.default_rng(1)):
  model = _tiny("llada")
  spec = lora.LoRASpec(rank=4, alpha=2.0, targets=("k_proj",))
  lora.add_adapters(model, spec)
  linear = model.blocks[0].attn.k_proj
  a = rng.normal(size=linear.lora.a.shape).astype(np.float32)
  b = rng.normal(size=linear.lora.b.shape).astype(np.float32)
  linear.lora.a[...], linear.lora.b[...] = jnp.asarray(a), jnp.asarray(b)
  merged = lora.merged_kernels(model)[("blocks", 0, "attn", "k_proj", "kernel")]
  # PEFT, in torch's layout: weight [out, in] + (lora_alpha / r) lora_B [out, r] @ lora_A [r, in].
  weight = np.asarray(linear.kernel[...], np.float64).T
  peft = weight + (2.0 / 4) * b.T.astype(np.float64) @ a.T.astype(np.float64)
  np.testing.assert_allclose(np.asarray(merged, np.float64).T, peft, rtol=1e-5, atol=1e-5)
  assert len(lora.merged_kernels(model)) == model.config.n_layers


def test_lora_config_errors_name_their_field():
  for field, value, says in (("model.lora.base_dtype", "int3", "base_dtype: 'int3' is not one"),
                             ("model.lora.targets", "q_prj", "targets: ['q_prj'] match no"),
                             ("model.lora.rank", -1, "model.lora.rank"),
                             ("model.lora.alpha", 0.0, "model.lora.alpha"),
                             ("model.lora.dropout", 1.0, "model.lora.dropout")):
    config = tiny_config(**{"model.lora.rank": 4, field: value})
    with pytest.raises(ValueError, match=re.escape(says)):
      specs.validate(config)


@pytest.mark.parametrize("base_dtype", ["bfloat16", "nf4"])
def test_a_lora_run_moves_only_the_adapters_and_keeps_the_base_bit_identical(tmp_path,
                                                                              base_dtype):
  """GRPO with its KL term (the reference: the base with the adapters off) and LoRA dropout, two
  steps of two updates: the base stays as it was, bit for bit, in bfloat16; every adapter's B moves; the
  optimizer holds moments of the adapters only."""
  config = tiny_config(**{"sft.num_steps": 0, "model.lora.rank": 4, "model.lora.alpha": 8.0,
                          "model.lora.dropout": 0.05, "model.lora.base_dtype": base_dtype,
                          "objective.name": "grpo", "objective.grpo.beta": 0.04,
                          "estimator.method": "mean_field"})
  run = trainer.Trainer(config, str(tmp_path))
  assert run.fns.start_params is None  # No copy of the weights for the reference.
  before = jax.device_get(run.state.params)
  run.run()
  run.close()
  after = jax.device_get(run.state.params)
  (a0, b0), (a1, b1) = lora.split(before), lora.split(after)
  base_leaves = jax.tree.leaves(b1)
  # A 4-bit base: packed bytes and float32 scales beside the bfloat16 head, embeddings, norms.
  assert {str(x.dtype) for x in base_leaves} == (
      {"bfloat16"} if base_dtype == "bfloat16" else {"bfloat16", "float32", "uint8"})
  for old, new in zip(jax.tree.leaves(b0), base_leaves):
    np.testing.assert_array_equal(old, new)
  adapters = {path: (np.asarray(x), np.asarray(y)) for (path, x), (_, y) in zip(
      jax.tree_util.tree_leaves_with_path(a0), jax.tree_util.tree_leaves_with_path(a1))}
  moved_b = [not np.array_equal(x, y) for path, (x, y) in adapters.items()
             if getattr(path[-2], "key", None) == "b"]  # [..., 'lora', 'b', .value]
  assert moved_b and all(moved_b)
  moments = [x.shape for x in jax.tree.leaves(run.state.opt_state) if np.ndim(x)]
  assert sorted(moments) == sorted(2 * [x.shape for x in jax.tree.leaves(a1)])
  trained = train_step.trained(run.state.params, lora=True)
  assert len(jax.tree.leaves(trained)) == len(jax.tree.leaves(a1))
  # The checkpoint holds the adapters (and their moments), not the base: rebuilt at resume.
  from stabledrl_jax.training.state import (  # pylint: disable=g-import-not-at-top
      checkpointing, lora_base)
  reader = checkpointing.Checkpointer(str(tmp_path), read_only=True)
  assert sorted(reader.stored_fields(2)["params"]) == sorted(x.shape for x in jax.tree.leaves(a1))
  assert reader.restore_meta(2)[lora_base.META_KEY] == {
      "source": "init", "base_dtype": base_dtype,
      "fingerprint": lora_base.identity(config, tmp_path)["fingerprint"]}
  reader.close()
  # The rerun resumes the adapters where they were.
  resumed = trainer.Trainer(config, str(tmp_path))
  assert resumed.start_step == 2
  for old, new in zip(jax.tree.leaves(after), jax.tree.leaves(jax.device_get(
      resumed.state.params))):
    np.testing.assert_array_equal(old, new)
  resumed.close()
  # evaluate's loader restores the adapters; export merges them into the kernels.
  tokens = jnp.arange(24).reshape(2, 12) % run.parts.model_config.vocab_size
  trained_logits = np.asarray(nnx.merge(run.parts.graphdef, jax.device_get(run.state.params))(tokens))
  source = checkpoint_source.resolve(str(tmp_path))
  loaded = checkpoint_source.load_model(source, mesh=run.mesh, dtype=jnp.float32)
  assert lora.has_adapters(loaded)
  np.testing.assert_allclose(np.asarray(loaded(tokens)), trained_logits, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="LoRA adapter arrays, which a Hugging Face checkpoint"):
    models.save_pretrained(loaded, str(tmp_path / "unmerged"))
  export.export(str(tmp_path), str(tmp_path / "merged"), merge=True)
  merged = models.from_pretrained(str(tmp_path / "merged"))
  assert not lora.has_adapters(merged)
  np.testing.assert_allclose(np.asarray(merged(tokens)), trained_logits, rtol=1e-4, atol=1e-4)


def test_the_ahead_of_time_update_of_a_lora_run_holds_less_than_a_full_one():
  """``build.abstract_update`` (the planner's and the TPU compile's path) builds the adapters,
  the bfloat16 base and the adapters' optimizer state."""
  sizes = {}
  for rank, base in ((0, "bfloat16"), (4, "bfloat16"), (4, "int4")):
    update, state, batch, key = build.abstract_update(tiny_config(**{
        "model.lora.rank": rank, "model.lora.base_dtype": base}))
    compiled = update.lower(state, batch, key).compile()
    sizes[rank, base] = compiled.memory_analysis().argument_size_in_bytes
    if rank and base == "bfloat16":
      assert {str(x.dtype) for x in jax.tree.leaves(lora.split(state.params)[1])} == {"bfloat16"}
  assert sizes[4, "bfloat16"] < sizes[0, "bfloat16"] / 3, sizes
  assert sizes[4, "int4"] < sizes[4, "bfloat16"], sizes


def _dropped_rows(key, i, rows, rate):
  """The rows adapter i sees under ``with_dropout(model, key, rate)``, in numpy."""
  k = jax.random.wrap_key_data(jax.random.key_data(jax.random.fold_in(key, i)))
  keep = np.asarray(jax.random.bernoulli(k, 1 - rate, rows.shape))
  return np.where(keep, rows / (1 - rate), 0.0)


def test_lora_dropout_drops_the_adapter_input_only_and_only_where_keyed(rng=np.random.default_rng(2)):
  linear = layers.Linear(6, 5, axes=(layers.AX_EMBED, layers.AX_MLP), std=0.5,
                         dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  holder = nnx.List([linear])
  linear.lora = nnx.data(lora.Adapter(6, 5, rank=2, scale=1.5, axes=(layers.AX_EMBED,
                                      layers.AX_MLP), param_dtype=jnp.float32,
                                      key=jax.random.key(1)))
  a, b = rng.normal(size=(6, 2)), rng.normal(size=(2, 5))
  linear.lora.a[...], linear.lora.b[...] = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  x = rng.normal(size=(7, 6)).astype(np.float32)
  plain = np.asarray(linear(jnp.asarray(x)))
  key = jax.random.key(9)
  # Not keyed (rollouts, evaluation) or rate 0: deterministic, the plain adapter.
  lora.with_dropout(holder, key, 0.0)
  np.testing.assert_array_equal(np.asarray(linear(jnp.asarray(x))), plain)
  # A module that is no model: adapters_of needs the projections map, so key the adapter itself.
  linear.lora.dropout_rate = 0.5
  linear.lora.dropout_key = lora.DropoutKey(jax.random.key_data(jax.random.fold_in(key, 0)))
  kernel = np.asarray(linear.kernel[...], np.float64)
  want = x @ kernel + 1.5 * _dropped_rows(key, 0, x.astype(np.float64), 0.5) @ a @ b
  np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x))), want, rtol=2e-5, atol=2e-5)
  assert not np.allclose(want, plain, atol=1e-3)


@pytest.mark.parametrize("family", ["llada", "sdar", "dream"])
def test_lora_dropout_is_the_same_under_scan_layers_and_remat(family):
  config = models.family.get(family).get_config("tiny")
  outputs = []
  for scan, remat in ((False, False), (True, True)):
    model = models.init_model(dataclasses.replace(config, scan_layers=scan, remat=remat), seed=0)
    lora.add_adapters(model, lora.LoRASpec(4, 8.0, ("q_proj", "up_proj")), seed=3)
    for i, adapter in enumerate(lora.adapters_of(model).values()):
      adapter.b[...] = 0.3 * jax.random.normal(jax.random.key(i), adapter.b.shape)
    tokens = _tokens(model)
    clean = np.asarray(model(tokens))
    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def dropped(params, key):
      return lora.with_dropout(nnx.merge(graphdef, params), key, 0.3)(tokens)

    noisy = np.asarray(dropped(params, jax.random.key(5)))
    assert not np.allclose(noisy, clean, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(dropped(params, jax.random.key(5))), noisy)
    assert not np.allclose(np.asarray(dropped(params, jax.random.key(6))), noisy, atol=1e-4)
    outputs.append(noisy)
  np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


# The official recipes, re-read from each repository (config_lib.BASELINE_RECIPES cites the lines):
# objective, mu per task (NUM_ITER), weight decay, the base's storage; every one LoRA r 128, alpha 64, dropout 0.05,
# lr 3e-6 constant.
OFFICIAL = {
    "llada8b_d1": ("grpo", dict(gsm8k=12, math500=12, countdown=8, sudoku=8), 0.1, "nf4"),
    "llada8b_spg": ("spg", dict(gsm8k=4, math500=4, countdown=4, sudoku=4), 0.1, "nf4"),
    "llada8b_wd1": ("wd1", dict(gsm8k=12, math500=12, countdown=12, sudoku=8), 0.1, "nf4"),
    "llada8b_espo": ("espo", dict(gsm8k=8, math500=8, countdown=8, sudoku=8), 0.01, "bfloat16"),
}


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_each_baseline_s_8b_config_trains_lora_as_its_official_code(name):
  from stabledrl_jax.training.config import config_lib  # pylint: disable=g-import-not-at-top
  objective, mu, weight_decay, base_dtype = OFFICIAL[name]
  for task, iterations in mu.items():
    config = config_lib.get(f"{name}:{task}")
    specs.validate(config)
    assert (config.objective.name, config.task.name, config.train.num_iterations) == (
        objective, task, iterations)
    lora_section = config.model.lora
    assert (lora_section.rank, lora_section.alpha, lora_section.dropout) == (128, 64.0, 0.05)
    assert lora_section.base_dtype == base_dtype  # d1, SPG, wd1: bitsandbytes' 4-bit NF4.
    assert lora_section.targets == "q_proj,k_proj,v_proj,up_proj"  # d1's seven on LLaDA.
    assert (config.optimizer.learning_rate, config.optimizer.schedule) == (3e-6, "constant")
    assert (config.optimizer.weight_decay, config.optimizer.grad_clip) == (weight_decay, 0.2)
    assert specs.resolve_run(config, specs.model_config(config)).lora
  assert config_lib.get("llada8b_spg:sudoku").objective.spg.eubo_beta == 1.0
  espo = {task: specs.objective_params(config_lib.get(f"llada8b_espo:{task}")) for task in mu}
  # ESPO run_<task>_llada.sh:28-29: beta per task; epsilon 0 on countdown, else train.yaml's 0.2.
  assert {task: (h.beta, h.epsilon) for task, h in espo.items()} == {
      "gsm8k": (1e-3, 0.2), "math500": (1e-3, 0.2), "countdown": (3e-3, 0.0),
      "sudoku": (1e-2, 0.2)}
  with pytest.raises(ValueError, match="ships no 'code' recipe; its tasks are"):
    config_lib.get(f"{name}:code")


def test_stabledrl_stays_full_parameter_and_its_lora_config_is_offered():
  from stabledrl_jax.training.config import config_lib  # pylint: disable=g-import-not-at-top
  assert config_lib.get("llada8b_gsm8k").model.lora.rank == 0
  config = config_lib.get("llada8b_stabledrl_lora:countdown")
  specs.validate(config)
  assert (config.objective.name, config.task.name, config.model.lora.rank) == (
      "stabledrl", "countdown", 128)
  assert "NOT the paper's setting" in open(config_lib.config_path("llada8b_stabledrl_lora")).read()


@pytest.mark.parametrize("qtype,bytes_per_weight,error", [("int8", 1, 0.01), ("int4", 0.5, 0.15),
                                                          ("nf4", 0.5, 0.15)])
def test_a_quantized_kernel_packs_and_computes_with_the_values_it_stands_for(
    qtype, bytes_per_weight, error, rng=np.random.default_rng(3)):
  kernel = (0.05 * rng.standard_normal((128, 48))).astype(np.float32)
  q = layers.QuantizedKernel(jnp.asarray(kernel), qtype, (layers.AX_EMBED, layers.AX_MLP))
  assert q.shape == (128, 48)
  assert q.qvalue[...].nbytes == 128 * 48 * bytes_per_weight  # 4-bit: two weights a byte.
  values = np.asarray(q.dequantized(), np.float64)
  assert 0 < np.abs(values - kernel).max() <= error * np.abs(kernel).max()
  rows = rng.standard_normal((5, 128)).astype(np.float32)
  np.testing.assert_allclose(np.asarray(q.dot(jnp.asarray(rows), jnp.float32, jnp.float32)),
                             rows.astype(np.float64) @ values, rtol=1e-4, atol=1e-4)
  linear = layers.Linear(128, 48, axes=(layers.AX_EMBED, layers.AX_MLP), std=0.05,
                         dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  linear.kernel = q
  np.testing.assert_allclose(np.asarray(linear(jnp.asarray(rows[None]))[0]),
                             rows.astype(np.float64) @ values, rtol=1e-4, atol=1e-4)


def test_store_base_quantizes_every_projection_but_the_head_and_merge_restores_floats(tmp_path):
  model = _tiny("llada")
  tokens = _tokens(model)
  lora.add_adapters(model, lora.LoRASpec(4, 8.0, D1_TARGETS), seed=1)
  lora.store_base(model, "int8")
  quantized = {name for name, path in lora.projections(model).items()
               if isinstance(lora._at(model, path).kernel, layers.QuantizedKernel)}
  assert "model.transformer.ff_out" not in quantized
  assert len(quantized) == 7 * model.config.n_layers  # Adapted or not, every block's seven.
  logits = np.asarray(model(tokens))
  plain = lora.store_base(_tiny("llada"), "nf4")  # No adapters, but a quantized base.
  with pytest.raises(ValueError, match="quantized kernels, which a Hugging Face checkpoint"):
    models.save_pretrained(plain, str(tmp_path / "never"))
  assert not (tmp_path / "never").exists()
  lora.merge_adapters(model)
  assert not lora.has_adapters(model) and not [
      p for p in nnx.to_flat_state(nnx.state(model, nnx.Param)) if p[0][-1] == "qvalue"]
  np.testing.assert_allclose(np.asarray(model(tokens)), logits, rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match=r"base_dtype: 'int3' is not one of"):
    lora.store_base(model, "int3")


def test_the_planned_sampler_of_a_lora_run_samples_with_its_stored_base():
  """tpu_compile.compile_decode (the planner's sampler rows) builds the model as the run holds
  it: adapters on a bfloat16 or 4-bit base, not the float32 master weights of a full run."""
  from stabledrl_jax import tpu_compile  # pylint: disable=g-import-not-at-top
  sizes = {}
  for rank, base in ((0, "bfloat16"), (4, "bfloat16"), (4, "int4")):
    config = tiny_config(**{"model.lora.rank": rank, "model.lora.base_dtype": base})
    result = tpu_compile.compile_decode(config, jax.devices()[:1],
                                        tpu_compile.rollout_decoding(config))
    sizes[rank, base] = result.memory["argument"]
  assert sizes[4, "int4"] < sizes[4, "bfloat16"] < sizes[0, "bfloat16"], sizes


def test_lora_dropout_in_every_pass_perturbs_the_rollouts_and_l_old(tmp_path):
  """model.lora.dropout_passes: 'update' (dropout in the differentiated pass only) samples and
  scores l_old as the model without dropout; 'every' (the official trainers, in train mode)
  gives other rollouts and another l_old under the same keys. The sampler's calls draw masks of
  their own: the adapter's output under one key differs between two inputs beyond the inputs'
  own difference."""
  config = tiny_config(**{"sft.num_steps": 0, "model.lora.rank": 4, "model.lora.alpha": 8.0,
                          "model.lora.dropout": 0.5, "rollout.temperature": 0.0})
  run = trainer.Trainer(config, str(tmp_path))
  try:
    params = jax.tree.map(lambda x: x, run.state.params)
    adapters, base = lora.split(params)
    adapters = jax.tree_util.tree_map_with_path(  # B moved from zero: the adapters act.
        lambda path, x: 0.5 * jax.random.normal(jax.random.key(len(str(path))), x.shape, x.dtype)
        if getattr(path[-2], "key", None) == "b" else x, adapters)
    params = lora.join(adapters, base)
    collect, update_only = run.fns.collect, run.parts.run
    assert not update_only.lora_dropout_every_pass and update_only.lora_dropout == 0.5
    every = dataclasses.replace(update_only, lora_dropout_every_pass=True)
    prompts = run.inputs.eval_prompts
    tokens = np.repeat(prompts.tokens[:2], 4, axis=0)
    mask = np.repeat(prompts.mask[:2], 4, axis=0)
    key = jax.random.key(3)

    def rollouts(spec):
      collect.run = spec
      return collect.generate(params, tokens, mask, key)[0]

    plain = rollouts(update_only)
    np.testing.assert_array_equal(rollouts(update_only), plain)  # Deterministic.
    assert not np.array_equal(rollouts(every), plain)
    batch = collect.make_batch(plain, mask, collect.completion_mask(plain),
                               np.ones(len(plain), np.float32))
    score = lambda spec: np.asarray(train_step.estimate_no_grad(
        params, batch, key, graphdef=run.parts.graphdef, run=spec))
    np.testing.assert_array_equal(score(update_only), score(update_only))
    assert not np.allclose(score(every), score(update_only))
  finally:
    collect.run = run.parts.run
    run.close()
  adapter = lora.Adapter(8, 8, rank=2, scale=1.0, axes=(None, None), param_dtype=jnp.float32,
                         key=jax.random.key(0))
  adapter.b[...] = jnp.ones((2, 8))
  adapter.dropout_rate, adapter.dropout_per_call = 0.5, True
  adapter.dropout_key = lora.DropoutKey(jax.random.key_data(jax.random.key(1)))
  x = jnp.ones((4, 8))
  # The same input twice: the same masks; another input (x scaled): masks of its own.
  np.testing.assert_array_equal(adapter(x, jnp.float32, jnp.float32),
                                adapter(x, jnp.float32, jnp.float32))
  assert not np.allclose(adapter(2 * x, jnp.float32, jnp.float32),
                         2 * adapter(x, jnp.float32, jnp.float32))


def test_the_baselines_apply_lora_dropout_in_every_pass_as_their_trainers():
  """d1, SPG, wd1 and ESPO sample and score l_old with the model in train mode (HF Trainer's
  training_step calls model.train() before TRL's _prepare_inputs generates; no .eval() in their
  trainers): their configs default to 'every'; StableDRL's LoRA variant keeps 'update'."""
  from stabledrl_jax.training.config import config_lib  # pylint: disable=g-import-not-at-top
  for name in ("llada8b_d1", "llada8b_spg", "llada8b_wd1", "llada8b_espo", "dream7b_espo"):
    config = config_lib.get(name)
    assert config.model.lora.dropout_passes == "every", name
    assert specs.resolve_run(config, specs.model_config(config)).lora_dropout_every_pass
  assert config_lib.get("llada8b_stabledrl_lora").model.lora.dropout_passes == "update"
  with pytest.raises(ValueError, match=r"^config\.model\.lora\.dropout_passes: 'all' is not one "
                     r"of \('update', 'every'\)"):
    specs.validate(tiny_config(**{"model.lora.dropout_passes": "all"}))
