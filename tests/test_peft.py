"""PEFT's adapter format (models/peft_io.py), checked against ``peft`` itself: an adapter we write
is read by ``peft.PeftModel`` onto a torch model with the official module names and merges to
our weights (LLaDA's logits against the float64 forward of test_hf_io); an adapter ``peft`` writes
loads into our model with the same logits; the format's fields and every refusal name the file
and field. The peft tests skip only where torch and peft are not installed (CI installs them:
the ``peft`` extra)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from stabledrl_jax import export, models
from stabledrl_jax.models import hf_io, lora, peft_io
from stabledrl_jax.training.loop import trainer
from stabledrl_jax.training.state import checkpoint_source, supervised
from stabledrl_jax.training.step import build

import test_dream
import test_hf_io
import test_sdar
from test_training import tiny_config, workdir_with_start

D1_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "gate_proj")


def _base(tmp_path, family):
  """A Hugging Face base checkpoint of random tensors (the family's own test layout)."""
  module = {"llada": test_hf_io, "sdar": test_sdar, "dream": test_dream}[family]
  tensors = module.random_tensors(module.HF_CONFIG)
  return module.write_checkpoint(str(tmp_path / f"base_{family}"), tensors), tensors


def _with_trained_adapters(model, targets, seed=0):
  """``model`` with rank-4 adapters whose A and B are random (B moved from zero)."""
  lora.add_adapters(model, lora.LoRASpec(4, 8.0, targets), seed=seed)
  for i, adapter in enumerate(lora.adapters_of(model).values()):
    adapter.b[...] = 0.2 * jax.random.normal(jax.random.key(100 + i), adapter.b.shape)
  return model


def _tokens(model):
  return jnp.arange(24).reshape(2, 12) % model.config.vocab_size


def _merged_hf(model):
  """Our merged model's tensors in the official names and torch layouts."""
  out = {}
  merged = lora.merged_kernels(model)
  for name, path in lora.projections(model).items():
    if path + ("kernel",) in merged:
      out[name + ".weight"] = np.asarray(merged[path + ("kernel",)], np.float32).T
  return out


def test_the_adapter_files_have_peft_s_names_shapes_and_fields(tmp_path):
  base, _ = _base(tmp_path, "llada")
  model = _with_trained_adapters(models.from_pretrained(base), ("q_proj", "up_proj"))
  peft_io.save_adapter(model, str(tmp_path / "adapter"), base=base, dropout=0.05)
  config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
  assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8.0, 0.05)
  assert config["target_modules"] == ["q_proj", "up_proj"]
  assert config["base_model_name_or_path"] == base and config["bias"] == "none"
  assert not (config["use_rslora"] or config["use_dora"] or config["fan_in_fan_out"])
  tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
  hf = test_hf_io.HF_CONFIG
  d, f = hf["d_model"], hf["mlp_hidden_size"]
  want = {}
  for i in range(hf["n_layers"]):
    for module, out_dim in (("q_proj", d), ("up_proj", f)):
      name = f"base_model.model.model.transformer.blocks.{i}.{module}"
      want[name + ".lora_A.weight"] = (4, d)
      want[name + ".lora_B.weight"] = (out_dim, 4)
  assert {k: v.shape for k, v in tensors.items()} == want
  # The one adapter's A and B, transposed: the merge is W + alpha/r B A in torch's layout.
  adapter = lora.adapters_of(model)["model.transformer.blocks.1.up_proj"]
  a = tensors["base_model.model.model.transformer.blocks.1.up_proj.lora_A.weight"]
  b = tensors["base_model.model.model.transformer.blocks.1.up_proj.lora_B.weight"]
  w = models.from_pretrained(base).blocks[1].mlp.up_proj.kernel[...]
  np.testing.assert_allclose(np.asarray(w).T + 2.0 * b @ a,
                             _merged_hf(model)["model.transformer.blocks.1.up_proj.weight"],
                             rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(a.T, np.asarray(adapter.a[...]))
  # Read back: the base it names with the adapter on it, the same logits.
  tokens = _tokens(model)
  back = peft_io.from_pretrained(str(tmp_path / "adapter"))
  np.testing.assert_array_equal(np.asarray(back(tokens)), np.asarray(model(tokens)))


def test_targets_that_select_part_of_a_suffix_are_written_as_full_names(tmp_path):
  base, _ = _base(tmp_path, "llada")
  model = _with_trained_adapters(models.from_pretrained(base), ("blocks.0.q_proj",))
  peft_io.save_adapter(model, str(tmp_path / "a"), base=base)
  config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
  assert config["target_modules"] == ["model.transformer.blocks.0.q_proj"]


def _edit_config(path, **changes):
  file = os.path.join(path, "adapter_config.json")
  with open(file) as f:
    config = json.load(f)
  config.update(changes)
  with open(file, "w") as f:
    json.dump(config, f)


@pytest.mark.parametrize("changes,says", [
    (dict(use_rslora=True), "use_rslora: True; only False is supported"),
    (dict(use_dora=True), "use_dora: True; only False"),
    (dict(bias="all"), "bias: 'all'; only 'none'"),
    (dict(peft_type="IA3"), "peft_type: 'IA3'; only 'LORA'"),
    (dict(r=0), "r: 0 is not a positive integer"),
    (dict(lora_alpha="x"), "lora_alpha: 'x' is not a positive number"),
    (dict(rank_pattern={"q_proj": 8}), "rank_pattern: {'q_proj': 8}; only an empty value"),
    (dict(base_model_name_or_path=None), "base_model_name_or_path: None: the adapter does not"),
])
def test_what_the_adapter_config_asks_that_we_cannot_do_is_one_line(tmp_path, changes, says):
  base, _ = _base(tmp_path, "llada")
  path = str(tmp_path / "adapter")
  peft_io.save_adapter(_with_trained_adapters(models.from_pretrained(base), ("q_proj",)), path,
                       base=base)
  _edit_config(path, **changes)
  with pytest.raises(ValueError, match=r"adapter_config\.json: " + __import__("re").escape(says)):
    peft_io.from_pretrained(path)


def test_bad_adapter_tensors_are_named(tmp_path):
  base, _ = _base(tmp_path, "llada")
  path = str(tmp_path / "adapter")
  peft_io.save_adapter(_with_trained_adapters(models.from_pretrained(base), ("q_proj",)), path,
                       base=base)
  _edit_config(path, target_modules=["q_proj", "up_proj"])  # up_proj: the last case's.
  file = os.path.join(path, "adapter_model.safetensors")
  tensors = load_file(file)
  name = "base_model.model.model.transformer.blocks.0.q_proj.lora_B.weight"
  cases = [
      ({k: v for k, v in tensors.items() if k != name},
       "blocks.0.q_proj.lora_A.weight has no base_model.model.model.transformer.blocks.0.q_proj"
       ".lora_B.weight"),
      ({**tensors, name: np.zeros((3, 4), np.float32)}, "has shape (3, 4), expected (64, 4)"),
      ({**tensors, "base_model.model.model.transformer.blocks.0.q_proj.weight":
        np.zeros((2, 2), np.float32)}, "is no LoRA weight"),
      ({"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": np.zeros((4, 64), np.float32),
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight": np.zeros((96, 4), np.float32)},
       "'model.layers.0.mlp.up_proj' is no projection of the llada model (its projections: "
       "attn_out, ff_out, ff_proj, k_proj, q_proj, up_proj, v_proj, named like"),
  ]
  for content, says in cases:
    save_file(content, file)
    with pytest.raises(hf_io.CheckpointError, match=__import__("re").escape(says)):
      peft_io.from_pretrained(path)
  os.remove(file)
  with pytest.raises(FileNotFoundError, match="has neither adapter_model.safetensors nor "
                     "adapter_model.bin"):
    peft_io.from_pretrained(path)


# Module names as the official modeling code has them, and adapter configs of every kind peft
# takes: the selection must be peft's own (peft.tuners.tuners_utils.check_target_module_exists).
_MODULES = [f"model.transformer.blocks.{i}.{p}" for i in (0, 1, 11)
            for p in ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")]
_SELECTIONS = [
    dict(target_modules=["q_proj"]), dict(target_modules=["q_proj", "v_proj", "nothing"]),
    dict(target_modules="all-linear"), dict(target_modules=r".*\.(q|k)_proj"),
    dict(target_modules=r"model\.transformer\.blocks\.1\..*"),
    dict(target_modules=["blocks.0.q_proj", "up_proj"]),
    dict(target_modules=["q_proj", "k_proj", "up_proj"], exclude_modules=["blocks.1.k_proj"]),
    dict(target_modules=["q_proj", "k_proj"], exclude_modules=r".*blocks\.11\..*"),
    dict(target_modules=["proj"]), dict(target_modules=["transformer.blocks.0.q_proj"]),
    dict(target_modules=None), dict(target_modules="q_proj"),
]


@pytest.mark.parametrize("selection", _SELECTIONS, ids=str)
def test_the_modules_an_adapter_selects_are_peft_s(selection):
  tuners_utils = pytest.importorskip("peft.tuners.tuners_utils")
  peft = pytest.importorskip("peft")
  reference = peft.LoraConfig(r=4, lora_alpha=8, **{k: v for k, v in selection.items()
                                                    if not (k == "target_modules" and v is None)})
  for module in _MODULES:
    if selection.get("target_modules") == "all-linear":  # peft expands it to every linear layer.
      want = True
    elif selection.get("target_modules") is None:  # peft's defaults for the model type.
      want = True
    else:
      want = bool(tuners_utils.check_target_module_exists(reference, module))
      want = want and not isinstance(tuners_utils.check_target_module_exists(reference, module),
                                     tuners_utils._ExcludedModule)  # pylint: disable=protected-access
    assert peft_io.selects(selection, module) == want, (selection, module)


def test_tensors_the_adapter_config_does_not_select_are_one_line(tmp_path):
  """target_modules ["q_proj"] over tensors for q_proj and up_proj: peft applies q_proj's and
  leaves up_proj's unused, so the logits would differ from the file's intent without a word;
  here it is refused, naming the module and the fields. exclude_modules the same."""
  base, _ = _base(tmp_path, "llada")
  path = str(tmp_path / "adapter")
  peft_io.save_adapter(_with_trained_adapters(models.from_pretrained(base), ("q_proj", "up_proj")),
                       path, base=base)
  peft_io.from_pretrained(path)  # As written (target_modules q_proj, up_proj): fine.
  _edit_config(path, target_modules=["q_proj"])
  with pytest.raises(hf_io.CheckpointError, match=(
      r"adapter_model\.safetensors: tensors for 'model\.transformer\.blocks\.0\.up_proj' \(and 1 "
      r"more modules\), which adapter_config\.json's target_modules \['q_proj'\] does not select")):
    peft_io.from_pretrained(path)
  _edit_config(path, target_modules=["q_proj", "up_proj"], exclude_modules=r".*blocks\.1\..*")
  with pytest.raises(hf_io.CheckpointError, match=r"tensors for 'model\.transformer\.blocks\.1\."
                     r"q_proj' \(and 1 more modules\), .*exclude_modules"):
    peft_io.from_pretrained(path)
  _edit_config(path, exclude_modules="[unclosed")
  with pytest.raises(ValueError, match=r"exclude_modules: '\[unclosed' is no regular expression"):
    peft_io.from_pretrained(path)


def test_an_adapter_model_bin_loads_as_its_safetensors(tmp_path):
  """An older peft's adapter_model.bin (a PyTorch state dict) gives the same model as the
  safetensors file; torch.load runs with weights_only=True, so a pickle that would run code is
  refused in one line, and without torch the error says what to install."""
  torch = pytest.importorskip("torch")
  base, _ = _base(tmp_path, "llada")
  path = str(tmp_path / "adapter")
  peft_io.save_adapter(_with_trained_adapters(models.from_pretrained(base), ("q_proj",)), path,
                       base=base)
  want = jax.tree.leaves(nnx_state(peft_io.from_pretrained(path)))
  file = os.path.join(path, "adapter_model.safetensors")
  torch.save({k: torch.from_numpy(v) for k, v in load_file(file).items()},
             os.path.join(path, "adapter_model.bin"))
  os.remove(file)
  got = jax.tree.leaves(nnx_state(peft_io.from_pretrained(path)))
  for a, b in zip(want, got, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  class Hostile:
    def __reduce__(self):
      return (os.system, ("echo hostile",))

  torch.save({"x": Hostile()}, os.path.join(path, "adapter_model.bin"))
  with pytest.raises(hf_io.CheckpointError, match=r"adapter_model\.bin cannot be read as a "
                     r"PyTorch state dict: "):
    peft_io.from_pretrained(path)
  torch.save({"base_model.model.x.lora_A.weight": [1, 2]}, os.path.join(path, "adapter_model.bin"))
  with pytest.raises(hf_io.CheckpointError, match=r"adapter_model\.bin is not a state dict"):
    peft_io.from_pretrained(path)


def test_an_adapter_model_bin_without_torch_says_what_to_install(tmp_path, monkeypatch):
  import sys  # pylint: disable=g-import-not-at-top
  path = tmp_path / "adapter"
  path.mkdir()
  (path / "adapter_model.bin").write_bytes(b"not read")
  monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError.
  import contextlib  # pylint: disable=g-import-not-at-top
  with contextlib.ExitStack() as stack, pytest.raises(
      hf_io.CheckpointError, match=r"adapter_model\.bin: a PyTorch file, which needs torch to "
      r"read \(pip install torch"):
    peft_io.open_weights(str(path), stack)


def nnx_state(model):
  from flax import nnx  # pylint: disable=g-import-not-at-top
  return nnx.state(model, nnx.Param)


# ---------------------------------------------------------------------------
# Against peft itself (torch on the CPU).
# ---------------------------------------------------------------------------


def _torch_model(tensors, name_or_path=None):
  """A torch module tree with the official module names holding ``tensors``: each 2-d
  ``<module>.weight`` of a projection an ``nn.Linear`` (what PEFT adapts), the rest plain;
  ``name_or_path`` as a transformers model's (what peft writes as the base)."""
  torch = pytest.importorskip("torch")

  class Holder(torch.nn.Module):

    def prepare_inputs_for_generation(self, *args, **kwargs):  # PeftModelForCausalLM reads it.
      del args, kwargs
      return {}

  root = Holder()
  root.name_or_path = name_or_path
  for name, value in tensors.items():
    *parents, module_name, leaf = name.split(".")
    module = root
    for part in parents:
      if not hasattr(module, part):
        module.add_module(part, torch.nn.Module())
      module = getattr(module, part)
    value = torch.from_numpy(np.array(value, np.float32))
    if leaf == "bias" and isinstance(getattr(module, module_name, None), torch.nn.Linear):
      getattr(module, module_name).bias = torch.nn.Parameter(value)  # Qwen2's q, k, v biases.
    elif leaf == "weight" and value.ndim == 2 and not module_name.endswith(("wte", "embed_tokens")):
      linear = torch.nn.Linear(value.shape[1], value.shape[0], bias=False)
      linear.weight.data = value
      module.add_module(module_name, linear)
    else:
      holder = torch.nn.Module()
      holder.weight = torch.nn.Parameter(value)
      module.add_module(module_name, holder)
  return root


def _merged_by_peft(model):
  return {k: v.detach().numpy() for k, v in model.merge_and_unload().state_dict().items()}


@pytest.mark.parametrize("family", ["llada", "sdar", "dream"])
def test_peft_reads_our_adapter_and_merges_to_our_weights(tmp_path, family):
  peft = pytest.importorskip("peft")
  base, tensors = _base(tmp_path, family)
  model = _with_trained_adapters(models.from_pretrained(base), D1_TARGETS[:1] + D1_TARGETS[4:5]
                                 + (("o_proj", "down_proj") if family != "llada" else ()))
  peft_io.save_adapter(model, str(tmp_path / "adapter"), base=base)
  merged = _merged_by_peft(peft.PeftModel.from_pretrained(_torch_model(tensors),
                                                          str(tmp_path / "adapter")))
  ours = _merged_hf(model)
  assert ours and set(ours) <= set(merged)
  for name, value in ours.items():
    np.testing.assert_allclose(merged[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
  for name in set(merged) - set(ours):  # Everything else is the base, untouched.
    np.testing.assert_array_equal(merged[name], tensors[name])
  _check_against_the_float64_forward(family, model, merged)


def _check_against_the_float64_forward(family, model, merged):
  """peft's merged weights in the family's float64 forward (LLaDA, Dream) give our logits."""
  tokens = _tokens(model)
  if family == "llada":
    want = test_hf_io.reference_logits(merged, test_hf_io.HF_CONFIG, np.asarray(tokens))
    assert test_hf_io.relative_error(model(tokens), want) < 1e-5
  elif family == "dream":  # Its q, k, v biases are the base's (LoRA leaves them).
    want = test_dream.official_logits(merged, test_dream.HF_CONFIG, np.asarray(tokens))
    assert test_dream.relative_error(model(tokens), want) < 1e-5


@pytest.mark.parametrize("family", ["llada", "sdar", "dream"])
def test_an_adapter_peft_writes_loads_into_our_model_with_its_logits(tmp_path, family):
  peft = pytest.importorskip("peft")
  base, tensors = _base(tmp_path, family)
  # d1's seven names: on LLaDA peft adapts q, k, v and up only (it drops names that match no
  # module), on SDAR all seven.
  config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=list(D1_TARGETS),
                           lora_dropout=0.05, init_lora_weights=False, task_type="CAUSAL_LM",
                           base_model_name_or_path=base)
  wrapped = peft.get_peft_model(_torch_model(tensors, name_or_path=base), config)
  wrapped.save_pretrained(str(tmp_path / "written_by_peft"))
  merged = _merged_by_peft(wrapped)
  path = str(tmp_path / "written_by_peft")
  assert json.loads(open(os.path.join(path, "adapter_config.json")).read())[
      "base_model_name_or_path"] == base
  ours = models.from_pretrained(path)  # The adapter directory: its base with it.
  adapted = sorted(name.rsplit(".", 1)[-1] for name in lora.adapters_of(ours))
  assert set(adapted) == ({"q_proj", "k_proj", "v_proj", "up_proj"} if family == "llada"
                          else set(D1_TARGETS))
  for name, value in _merged_hf(ours).items():
    np.testing.assert_allclose(value, merged[name], rtol=1e-5, atol=1e-6, err_msg=name)
  _check_against_the_float64_forward(family, ours, merged)


# ---------------------------------------------------------------------------
# A LoRA workdir: exported as an adapter, evaluated and trained on from one.
# ---------------------------------------------------------------------------


def _trained_lora_workdir(tmp_path, sft_start):
  """One RL step of a rank-4 LoRA run on the shared supervised start, in ``tmp_path/run``:
  (workdir, config, the closed Trainer, tokens, the trained model's logits of them)."""
  workdir = workdir_with_start(tmp_path / "run", sft_start)
  config = tiny_config(**{"model.lora.rank": 4, "model.lora.alpha": 8.0,
                          "model.lora.base_dtype": "float32", "train.num_steps": 1})
  run = trainer.Trainer(config, str(workdir))
  run.run()
  tokens = jnp.arange(24).reshape(2, 12) % run.parts.model_config.vocab_size
  from flax import nnx  # pylint: disable=g-import-not-at-top
  trained = np.asarray(nnx.merge(run.parts.graphdef, jax.device_get(run.state.params))(tokens))
  run.close()
  return workdir, config, run, tokens, trained


def test_a_lora_run_exports_a_peft_adapter_on_its_start_and_trains_on_from_it(tmp_path,
                                                                            sft_start):
  workdir, config, run, tokens, trained = _trained_lora_workdir(tmp_path, sft_start)
  out = tmp_path / "adapter"
  export.export(str(workdir), str(out))
  assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors",
                                     "stabledrl_jax.json"]  # A character tokenizer: no files.
  record = json.loads((out / "adapter_config.json").read_text())
  assert record["base_model_name_or_path"] == str(workdir / supervised.SFT_DIR)
  source = checkpoint_source.resolve(str(out))
  assert source.kind == checkpoint_source.PEFT and source.config is not None
  loaded = checkpoint_source.load_model(source, mesh=run.mesh, dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(loaded(tokens)), trained, rtol=1e-5, atol=1e-5)
  # --merge: the Hugging Face checkpoint of the same model.
  export.export(str(workdir), str(tmp_path / "merged"), merge=True)
  merged = models.from_pretrained(str(tmp_path / "merged"))
  assert not lora.has_adapters(merged)
  np.testing.assert_allclose(np.asarray(merged(tokens)), trained, rtol=1e-4, atol=1e-4)
  # model.checkpoint = the adapter: rank 0 trains its merged weights; the same LoRA settings
  # train the adapter on; others are one line.
  start = {"model.checkpoint": str(out), "sft.num_steps": 0, "train.num_steps": 0}
  full = build.build_model(tiny_config(**start), run.inputs.tokenizer, run.mesh)
  assert not lora.has_adapters(full)
  np.testing.assert_allclose(np.asarray(full(tokens)), trained, rtol=1e-4, atol=1e-4)
  on = build.build_model(tiny_config(**start, **{"model.lora.rank": 4,
                                                   "model.lora.alpha": 8.0}),
                           run.inputs.tokenizer, run.mesh)
  assert lora.has_adapters(on)
  np.testing.assert_allclose(np.asarray(on(tokens)), trained, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match=r"^config\.model\.lora: rank=8, alpha=16, targets=.* do "
                     r"not describe the adapter model\.checkpoint=.* \(r=4, lora_alpha=8, "):
    build.build_model(tiny_config(**start, **{"model.lora.rank": 8}), run.inputs.tokenizer,
                      run.mesh)
  # The checkpoints hold the adapters; a base that changed since is refused, naming both.
  file = workdir / supervised.SFT_DIR / "model.safetensors"
  tensors = load_file(str(file))
  name = sorted(tensors)[0]
  tensors[name] = tensors[name] + 1.0
  save_file(tensors, str(file), metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"holds LoRA adapters trained on the base .*sft_model' "
                     r"\(stored as float32, fingerprint [0-9a-f]{12}\), but this run's base is"):
    trainer.Trainer(config, str(workdir))
  with pytest.raises(ValueError, match="holds LoRA adapters trained on the base"):
    checkpoint_source.load_model(checkpoint_source.resolve(str(workdir)), mesh=run.mesh,
                                 dtype=jnp.float32)


def test_a_moved_lora_workdir_resumes_exports_and_evaluates(tmp_path, sft_start):
  """The base's identity names the workdir's own supervised start relative to the workdir
  (``<workdir>/sft_model``): after ``mv W W2`` the run resumes, exports (its adapter names W2's
  start) and evaluates with the same logits; an edited start is still refused. A checkpoint of
  an older version, which recorded the start's absolute path, is read after a move too."""
  from stabledrl_jax.training.state import (  # pylint: disable=g-import-not-at-top
      checkpointing, lora_base)
  workdir, config, run, tokens, trained = _trained_lora_workdir(tmp_path, sft_start)
  reader = checkpointing.Checkpointer(str(workdir), read_only=True)
  assert reader.restore_meta(1)[lora_base.META_KEY]["source"] == "<workdir>/sft_model"
  reader.close()
  moved = tmp_path / "moved"
  os.rename(workdir, moved)
  resumed = trainer.Trainer(tiny_config(**{**{"model.lora.rank": 4, "model.lora.alpha": 8.0,
                                              "model.lora.base_dtype": "float32"},
                                           "train.num_steps": 2}), str(moved))
  try:
    assert resumed.start_step == 1
  finally:
    resumed.close()
  loaded = checkpoint_source.load_model(checkpoint_source.resolve(str(moved)), mesh=run.mesh,
                                        dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(loaded(tokens)), trained, rtol=1e-5, atol=1e-5)
  export.export(str(moved), str(tmp_path / "adapter"))
  record = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert record["base_model_name_or_path"] == str(moved / supervised.SFT_DIR)
  # An older version's identity (the absolute path it was trained at) after the move.
  old = {**lora_base.identity(config, moved), "source": str(workdir / supervised.SFT_DIR)}
  lora_base.check(old, lora_base.identity(config, moved), "old")
  with pytest.raises(ValueError, match="holds LoRA adapters trained on the base"):
    lora_base.check({**old, "fingerprint": "0" * 64}, lora_base.identity(config, moved), "old")
  # An edited start in the moved workdir is refused.
  file = moved / supervised.SFT_DIR / "model.safetensors"
  tensors = load_file(str(file))
  name = sorted(tensors)[0]
  save_file({**tensors, name: tensors[name] + 1.0}, str(file), metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"trained on the base '<workdir>/sft_model'"):
    trainer.Trainer(config, str(moved))


def test_a_lora_run_from_a_fresh_model_exports_merged_only(tmp_path):
  config = tiny_config(**{"sft.num_steps": 0, "model.lora.rank": 2, "train.num_steps": 1})
  trainer.train(config, str(tmp_path / "run"))
  with pytest.raises(ValueError, match="freshly initialized model, which no PEFT adapter can "
                     "name as its base: pass --merge"):
    export.export(str(tmp_path / "run"), str(tmp_path / "adapter"))
  assert not (tmp_path / "adapter").exists()
  export.export(str(tmp_path / "run"), str(tmp_path / "merged"), merge=True)
  assert (tmp_path / "merged" / "model.safetensors").is_file()


def test_a_lora_base_replaces_the_one_an_adapter_names(tmp_path):
  """An adapter written on its authors' machine names their directory as its base:
  ``model.lora.base`` (training), ``--lora_base`` (evaluate, export) point it at another, with
  the same model as the adapter on that base; set where there is no adapter, it is one line."""
  from stabledrl_jax.training.config import specs  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  base, _ = _base(tmp_path, "llada")
  path = str(tmp_path / "adapter")
  model = _with_trained_adapters(models.from_pretrained(base), ("q_proj",))
  tokens = _tokens(model)
  want = np.asarray(model(tokens))
  peft_io.save_adapter(model, path, base=str(tmp_path / "authors" / "llada"))
  with pytest.raises((FileNotFoundError, ValueError), match="authors/llada"):
    models.from_pretrained(path)
  np.testing.assert_allclose(np.asarray(models.from_pretrained(path, lora_base=base)(tokens)),
                             want, rtol=1e-5, atol=1e-5)
  # Training: the base's config is what the up-front checks read.
  config = tiny_config(**{"model.checkpoint": path, "model.lora.base": base})
  assert build.checkpoint_config(config) == models.load_config(base)
  with pytest.raises(ValueError, match=r"^config\.model\.lora\.base: .* but model\.checkpoint .* "
                     r"is no adapter \(it has no adapter_config\.json\)$"):
    build.checkpoint_config(tiny_config(**{"model.checkpoint": base, "model.lora.base": base}))
  with pytest.raises(ValueError, match=r"^config\.model\.lora\.base: .* which is empty$"):
    specs.validate(tiny_config(**{"model.lora.base": base}))
  # Evaluate and export: --lora_base.
  mesh = mesh_lib.make_mesh(ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1)))
  source = checkpoint_source.resolve(path, lora_base=base)
  loaded = checkpoint_source.load_model(source, mesh=mesh, dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(loaded(tokens)), want, rtol=1e-5, atol=1e-5)
  assert export.main(["--workdir", path, "--output", str(tmp_path / "out"),
                      "--lora_base", base]) == 0
  record = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
  assert record["base_model_name_or_path"] == base
  with pytest.raises(ValueError, match=r"^--lora_base .* replaces a PEFT adapter's base, and "
                     r".* is a Hugging Face checkpoint, with no base$"):
    checkpoint_source.resolve(base, lora_base=base)
