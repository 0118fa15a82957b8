"""python -m stabledrl_jax.export: a workdir (or any checkpoint) -> a Hugging Face checkpoint that
from_pretrained reads back bit for bit, in the official names, with its tokenizer files and the
run's training config, so that it evaluates as the workdir does."""

import json
import os
import pathlib
import stat

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from stabledrl_jax import evaluate, export, models, tokenizers
from stabledrl_jax.models import hf_io
from stabledrl_jax.training.inputs import data
from stabledrl_jax.training.loop import trainer
from stabledrl_jax.training.parallel import mesh as mesh_lib
from stabledrl_jax.training.state import checkpoint_source, supervised

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


# ---------------------------------------------------------------------------
# An export evaluates as its workdir: it carries the run's training config.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """The quickstart at toy size: a short supervised start (sft_model) and one RL step."""
  path = tmp_path_factory.mktemp("trained") / "quick"
  trainer.train(tiny_config(**{"sft.num_steps": 20, "train.num_steps": 1,
                               "train.num_iterations": 1, "data.eval_size": 8}), str(path))
  return path


def _evaluate(checkpoint, output_dir, **overrides):
  """Greedy evaluation on the synthetic held-out puzzles, with the checkpoint's own tokenizer
  and prompt style (nothing named on the command line)."""
  return evaluate.run(evaluate.Options(**{
      "checkpoint": str(checkpoint), "task": ["sudoku"], "output_dir": str(output_dir),
      "gen_lengths": [40], "block_length": 40, "steps": 20, "data": ["sudoku=synthetic"],
      "batch_size": 8, "shard_size": 8, "model_name": "m", **overrides}))


def _generations(output_dir):
  (path,) = pathlib.Path(output_dir).glob("*_generations.json")
  return json.loads(path.read_text())


@pytest.mark.parametrize("which", ["workdir", "sft_model"])
def test_an_export_evaluates_as_its_workdir(trained, tmp_path, which, capsys):
  """The same results.json, the same puzzles, prompts and completions: the workdir's held-out
  puzzles (an independent draw of data.make_examples) in its prompt style (no instruction)."""
  checkpoint = trained if which == "workdir" else trained / supervised.SFT_DIR
  exported = tmp_path / "exported"
  export.export(str(checkpoint), str(exported))
  assert not (exported / "tokenizer.json").exists()  # a character tokenizer: in the config
  _evaluate(checkpoint, tmp_path / "a")
  _evaluate(exported, tmp_path / "b", tokenizer=str(trained))  # (the tokenizer aside)
  assert "note:" not in capsys.readouterr().err  # nothing guessed for either
  assert (tmp_path / "a" / "results.json").read_text() == (
      tmp_path / "b" / "results.json").read_text()
  a, b = _generations(tmp_path / "a"), _generations(tmp_path / "b")
  assert a["settings"] == b["settings"] and a["settings"]["prompt"]["with_instruction"] is False
  assert a["generations"] == b["generations"]
  config = checkpoint_source.resolve(str(trained)).config
  assert [r["question"] for r in b["generations"]] == [
      ex.question for ex in data.make_examples(config, "eval")]
  assert any(r["generations"].strip() for r in b["generations"])  # decoded, not empty
  record = json.loads((exported / checkpoint_source.EXPORT_FILE).read_text())
  assert record["config"] == json.loads((trained / "config.json").read_text())
  # Its own tokenizer: the alphabet of the config it carries.
  _evaluate(exported, tmp_path / "c")
  assert _generations(tmp_path / "c")["generations"] == b["generations"]


def test_a_plain_checkpoint_says_what_it_guessed(tmp_path, capsys):
  """No stabledrl_jax.json, no enclosing workdir: one line names the prompt style and data."""
  tokenizer = tokenizers.CharTokenizer()
  config = models.get_config("tiny", vocab_size=tokenizer.vocab_size,
                             embedding_size=tokenizer.vocab_size,
                             mask_token_id=tokenizer.mask_id, eos_token_id=tokenizer.eos_id)
  models.save_pretrained(models.init_model(config, seed=0), str(tmp_path / "plain"))
  _evaluate(tmp_path / "plain", tmp_path / "out", tokenizer="char", limit=2, batch_size=2,
            shard_size=2)
  notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
  assert len(notes) == 1
  assert ("with_instruction=True" in notes[0] and "assistant_prefix=''" in notes[0]
          and "sudoku=synthetic from the default generator (seed 0)" in notes[0]), notes
  assert _generations(tmp_path / "out")["settings"]["prompt"]["with_instruction"] is True
  # Exporting it writes no training config; over an earlier export (--overwrite) the stale one
  # goes with the rest of the directory it replaces.
  (tmp_path / "again").mkdir()
  (tmp_path / "again" / checkpoint_source.EXPORT_FILE).write_text("{}")
  export.export(str(tmp_path / "plain"), str(tmp_path / "again"), overwrite=True)
  assert not (tmp_path / "again" / checkpoint_source.EXPORT_FILE).exists()


def test_a_broken_export_record_is_named(workdir, tmp_path):
  export.export(str(workdir), str(tmp_path / "out"))
  (tmp_path / "out" / checkpoint_source.EXPORT_FILE).write_text("{not json")
  with pytest.raises(ValueError, match="stabledrl_jax.json is not readable JSON"):
    checkpoint_source.resolve(str(tmp_path / "out"))
  (tmp_path / "out" / checkpoint_source.EXPORT_FILE).write_text('{"config": {}}')
  with pytest.raises(ValueError, match="stabledrl_jax.json holds no training config"):
    checkpoint_source.resolve(str(tmp_path / "out"))


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o027, 0o640)])
def test_exported_files_have_the_mode_of_new_files(workdir, tmp_path, umask, mode):
  previous = os.umask(umask)
  try:
    export.export(str(workdir), str(tmp_path / "out"), max_shard_bytes=100_000)
  finally:
    os.umask(previous)
  files = sorted((tmp_path / "out").iterdir())
  assert any(f.name.endswith(".safetensors") for f in files)
  assert {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {
      f.name: oct(mode) for f in files}


def test_an_output_that_is_a_file_is_named(workdir, tmp_path, capsys):
  target = tmp_path / "model.bin"
  target.write_text("keep me")
  with pytest.raises(SystemExit):
    export.main(["--workdir", str(workdir), "--output", str(target)])
  assert f"--output '{target}' is an existing file, not a directory" in capsys.readouterr().err
  assert target.read_text() == "keep me"


def test_a_non_empty_output_is_refused_unless_overwrite_which_swaps_it(workdir, tmp_path,
                                                                         capsys):
  """export --output DIR wrote beside another checkpoint's files without a word; now it refuses
  a non-empty directory, and --overwrite writes aside and swaps the whole directory."""
  out = tmp_path / "out"
  out.mkdir()
  (out / "model.safetensors").write_text("another checkpoint")
  (out / "notes.txt").write_text("mine")
  with pytest.raises(SystemExit):
    export.main(["--workdir", str(workdir), "--output", str(out)])
  err = capsys.readouterr().err
  assert f"--output '{out}' is a directory that is not empty" in err and "--overwrite" in err
  assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "notes.txt"]
  assert (out / "model.safetensors").read_text() == "another checkpoint"
  assert export.main(["--workdir", str(workdir), "--output", str(out), "--overwrite"]) == 0
  assert not (out / "notes.txt").exists() and (out / "config.json").exists()
  assert models.from_pretrained(str(out)) is not None
  assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # Nothing staged is left.


def test_a_failed_export_leaves_the_output_as_it_was(workdir, tmp_path, monkeypatch):
  out = tmp_path / "out"
  out.mkdir()
  (out / "keep.txt").write_text("mine")
  import errno  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.models import hf_io  # pylint: disable=g-import-not-at-top

  def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(hf_io, "save_file", full)
  with pytest.raises(ValueError, match=r"^--output: cannot write .*model.safetensors: no space"):
    export.export(str(workdir), str(out), overwrite=True)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
  assert [p.name for p in out.iterdir()] == ["keep.txt"]
