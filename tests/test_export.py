"""python -m stabledrl_jax.export: a workdir (or any checkpoint) -> a Hugging Face checkpoint that
from_pretrained reads back bit for bit, in the official names, with its tokenizer files."""

import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from stabledrl_jax import export, models
from stabledrl_jax.models import hf_io
from stabledrl_jax.training import checkpoint_source, mesh as mesh_lib, trainer

from test_hub import REPO_ID, _hub_cache
from test_training import tiny_config


def _params(model):
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _stored(path):
  """{tensor name: (dtype string, array)} of a checkpoint directory (single file or shards)."""
  out = {}
  for file in sorted(path.glob("*.safetensors")):
    with safe_open(str(file), framework="numpy") as f:
      for name in f.keys():
        out[name] = f.get_slice(name).get_dtype()
  return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """A tiny run with one finished RL step (no supervised start)."""
  path = tmp_path_factory.mktemp("run")
  trainer.train(tiny_config(**{"sft.num_steps": 0, "train.num_steps": 1,
                               "train.num_iterations": 1}), str(path))
  return path


def _workdir_model(workdir, dtype=jnp.float32):
  source = checkpoint_source.resolve(str(workdir))
  mesh = mesh_lib.make_mesh(ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1)),
                            devices=jax.local_devices())
  return checkpoint_source.load_model(source, mesh=mesh, dtype=dtype)


def test_a_workdir_exports_and_loads_back_bit_for_bit(workdir, tmp_path, capsys):
  out = tmp_path / "hf"
  assert export.main(["--workdir", str(workdir), "--output", str(out),
                      "--max_shard_size", "100KB"]) == 0
  assert "character tokenizer" in capsys.readouterr().out
  index = json.loads((out / hf_io.INDEX_FILE).read_text())
  files = sorted(set(index["weight_map"].values()))
  assert len(files) > 1 and all((out / f).is_file() for f in files)
  assert all(name.startswith("model.transformer.") for name in index["weight_map"])
  config = json.loads((out / hf_io.CONFIG_FILE).read_text())
  assert config["model_type"] == "llada" and config["torch_dtype"] == "float32"
  loaded = models.from_pretrained(str(out))
  for a, b in zip(_params(_workdir_model(workdir)), _params(loaded)):
    np.testing.assert_array_equal(a, b)


def test_the_export_dtype_is_chosen_on_export(workdir, tmp_path):
  out = tmp_path / "bf16"
  export.export(str(workdir), str(out), dtype="bfloat16")
  assert set(_stored(out).values()) == {"BF16"}
  assert json.loads((out / hf_io.CONFIG_FILE).read_text())["torch_dtype"] == "bfloat16"
  loaded = models.from_pretrained(str(out), dtype=jnp.bfloat16)
  for a, b in zip(_params(_workdir_model(workdir)), _params(loaded)):
    np.testing.assert_array_equal(a.astype(jnp.bfloat16), b)


def test_a_hub_checkpoint_exports_with_its_tokenizer_files(tmp_path, monkeypatch):
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(_hub_cache(tmp_path / "cache")))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  out = tmp_path / "out"
  assert export.export(REPO_ID, str(out)) == ["tokenizer.json"]
  assert (out / "tokenizer.json").is_file()
  for a, b in zip(_params(models.from_pretrained(REPO_ID)), _params(models.from_pretrained(
      str(out)))):
    np.testing.assert_array_equal(a, b)


def test_an_sdar_checkpoint_exports_in_qwen_names(tmp_path):
  config = models.get_sdar_config("tiny", num_hidden_layers=1)
  model = models.init_model(config, seed=2)
  models.save_pretrained(model, str(tmp_path / "sdar"))
  export.export(str(tmp_path / "sdar"), str(tmp_path / "out"))
  names = _stored(tmp_path / "out")
  assert "model.layers.0.self_attn.q_norm.weight" in names and "lm_head.weight" in names
  for a, b in zip(_params(model), _params(models.from_pretrained(str(tmp_path / "out")))):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("args,match", [
    (["--dtype", "int8"], "invalid choice"),
    (["--max_shard_size", "lots"], "max_shard_size"),
    (["--step", "99"], "no checkpoint of step 99"),
])
def test_bad_arguments_are_named(workdir, tmp_path, args, match, capsys):
  with pytest.raises(SystemExit):
    export.main(["--workdir", str(workdir), "--output", str(tmp_path / "x"), *args])
  assert match in capsys.readouterr().err
