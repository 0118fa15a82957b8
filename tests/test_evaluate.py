"""The evaluation harness: d1 generation files from a checkpoint, resumable, sharded, checked."""

import json
import types
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from stabledrl_jax import evaluate, models, scoring, tasks, tokenizers
from stabledrl_jax.training.config import run_spec
from stabledrl_jax.training.inputs import data
from stabledrl_jax.training.loop import trainer
from stabledrl_jax.training.parallel import mesh as mesh_lib
from stabledrl_jax.training.state import checkpoint_source
from stabledrl_jax.training.step import decoding
from test_training import tiny_config

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

COUNTDOWN = [{"input": "30,100,93", "output": "23"}, {"input": "83,18,75", "output": "10"},
             {"input": "76,41,59", "output": "24"}, {"input": "5,7,2", "output": "37"},
             {"input": "1,2,3", "output": "6"}]
SUDOKU = [("3102200002100320", "3142243142131324"), ("0140432014020000", "2143432114323214"),
          ("4310010000303420", "4312214312343421"), ("2004001203201003", "2134341243211243"),
          ("0024003101000413", "1324423131422413"), ("2013132000400200", "2413132431424231"),
          ("2100031004211000", "2143431234211234")]


def env():
  """A subprocess environment that imports this checkout on the CPU."""
  return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """d1's two test files, a few lines each."""
  path = tmp_path_factory.mktemp("data")
  (path / "countdown_cd3_test.jsonl").write_text(
      "".join(json.dumps(record) + "\n" for record in COUNTDOWN))
  (path / "4x4_test_sudoku.csv").write_text(
      "Puzzle,Solution\n" + "".join(f"{p},{s}\n" for p, s in SUDOKU))
  return path


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
  """A random tiny LLaDA in the Hugging Face layout, with the character tokenizer's ids."""
  tokenizer = tokenizers.CharTokenizer()
  config = models.get_config("tiny", vocab_size=tokenizer.vocab_size,
                             embedding_size=tokenizer.vocab_size, mask_token_id=tokenizer.mask_id,
                             eos_token_id=tokenizer.eos_id)
  path = tmp_path_factory.mktemp("hf") / "tiny-llada"
  models.save_pretrained(models.init_model(config, seed=0), str(path))
  return path


@pytest.fixture(scope="module")
def sdar_checkpoint(tmp_path_factory):
  """A random tiny SDAR (block diffusion) in the Hugging Face layout, character-tokenizer ids."""
  tokenizer = tokenizers.CharTokenizer()
  config = models.get_sdar_config("tiny", vocab_size=tokenizer.vocab_size,
                                  mask_token_id=tokenizer.mask_id, eos_token_id=tokenizer.eos_id)
  path = tmp_path_factory.mktemp("hf") / "tiny-sdar"
  models.save_pretrained(models.init_model(config, seed=0), str(path))
  return path


def _save_step(run, step, scale):
  """Saves the run's parameters times `scale` as checkpoint `step`: steps tell apart."""
  params = jax.tree.map(lambda x: x * scale, run.state.params)
  run.state = run.state.replace(params=params)
  run._save(step)
  run.checkpointer.wait()
  return params


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """A training workdir of the tiny quickstart (no SFT, no RL step): checkpoints 1 and 2."""
  path = tmp_path_factory.mktemp("workdir") / "tiny-run"
  run = trainer.Trainer(tiny_config(**{"sft.num_steps": 0, "data.eval_size": 4}), str(path))
  params = {1: _save_step(run, 1, 0.5), 2: _save_step(run, 2, 3.0)}
  run.close()
  return path, params


def options(checkpoint, output_dir, **overrides):
  """Small and fast: 32-token completions, 2 examples per shard."""
  return evaluate.Options(**{
      "checkpoint": str(checkpoint), "task": ["sudoku"], "output_dir": str(output_dir),
      "gen_lengths": [32], "limit": 5, "batch_size": 2, "shard_size": 2, "tokenizer": "char",
      "with_instruction": False, **overrides})


def shard_files(directory):
  return sorted(path.name for path in pathlib.Path(directory).glob("*_generations.json"))


# ---------------------------------------------------------------------------
# End to end.
# ---------------------------------------------------------------------------


def test_an_sdar_checkpoint_is_evaluated_through_its_block_sampler(tmp_path, sdar_checkpoint,
                                                                   data_dir):
  """The harness decodes block diffusion models too: prompts padded to whole blocks, the block
  sampler, d1 files and the scored table; the same as decoding the prompts directly."""
  results = evaluate.run(options(sdar_checkpoint, tmp_path / "out", data_dir=str(data_dir)))
  (setup, result), = results.items()
  assert setup == "sudoku_tiny-sdar_32_16" and result.n == 5
  written = json.loads((tmp_path / "out" / "sudoku_tiny-sdar_32_16_0_generations.json").read_text())
  model = models.from_pretrained(str(sdar_checkpoint))
  block = model.config.block_size
  assert written["settings"]["prompt"]["length"] % block == 0
  task = tasks.get_task("sudoku")
  examples = evaluate.load_test_set("sudoku", data_dir=str(data_dir), limit=2)
  style = evaluate.PromptStyle(False, "", written["settings"]["prompt"]["length"])
  tokens, mask = evaluate.styled_prompts(tokenizers.CharTokenizer(), task, examples, style)
  direct, _ = decoding.generate(model, tokens, mask, jax.random.key(0), run_spec.Decoding(
      32, 16, stop_at_eos=True))
  texts = [tokenizers.CharTokenizer().decode(row) for row in np.asarray(direct)[:, tokens.shape[1]:]]
  assert [g["generations"] for g in written["generations"]] == texts


def test_cli_writes_d1_files_that_the_scoring_cli_reads(tmp_path, hf_checkpoint, data_dir):
  out = tmp_path / "out"
  completed = subprocess.run(
      [sys.executable, "-m", "stabledrl_jax.evaluate", f"--checkpoint={hf_checkpoint}",
       "--task=countdown,sudoku", "--gen_lengths=32,64", f"--output_dir={out}",
       f"--data_dir={data_dir}", "--tokenizer=char", "--nowith_instruction", "--limit=4",
       "--shard_size=2", "--batch_size=2"],
      cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
  assert completed.returncode == 0, completed.stderr[-3000:]
  # d1's naming: TASK_MODEL_GENLEN_STEPS_SHARD, steps = length / 2; 4 examples, 2 a shard.
  assert shard_files(out) == sorted(
      f"{task}_tiny-llada_{length}_{length // 2}_{shard}_generations.json"
      for task in ("countdown", "sudoku") for length in (32, 64) for shard in (0, 1))
  for path in out.glob("*_generations.json"):
    written = json.loads(path.read_text())
    assert all(set(record) == {"question", "generations", "ground_truth"}
               for record in written["generations"])
    assert written["block_length"] == 32
    assert written["diffusion_steps"] == written["gen_length"] // 2
  countdown = json.loads((out / "countdown_tiny-llada_32_16_1_generations.json").read_text())
  assert countdown["generations"][0]["question"] == "Numbers: [76, 41, 59]\nTarget: 24"
  assert countdown["generations"][0]["ground_truth"] == [[76, 41, 59], 24]
  # The scoring CLI reads the directory, pooling the shards of each setup; its table and JSON
  # are what the run printed and wrote.
  assert scoring.main([str(out), "--output", str(tmp_path / "scored.json")]) == 0
  scored = json.loads((tmp_path / "scored.json").read_text())
  assert json.loads((out / "results.json").read_text()) == scored
  assert {setup: result["n"] for setup, result in scored.items()} == {
      "countdown_tiny-llada_32_16": 4, "countdown_tiny-llada_64_32": 4,
      "sudoku_tiny-llada_32_16": 4, "sudoku_tiny-llada_64_32": 4}
  assert "sudoku_tiny-llada_64_32" in completed.stdout and "accuracy" in completed.stdout


def test_workdir_is_read_at_its_latest_or_chosen_step(tmp_path, workdir):
  path, saved = workdir
  latest = checkpoint_source.resolve(str(path))
  assert (latest.kind, latest.step, latest.name) == ("workdir", 2, "tiny-run-step2")
  mesh = mesh_lib.make_mesh(ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1)))
  for source, step in ((latest, 2), (checkpoint_source.resolve(str(path), step=1), 1)):
    model = checkpoint_source.load_model(source, mesh=mesh, dtype=np.float32)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model, nnx.Param), saved[step])
  # The workdir's own tokenizer (its 29-character alphabet), prompts and held-out puzzles.
  evaluate.run(options(path, tmp_path, step=1, tokenizer="", with_instruction=None,
                       data=["sudoku=synthetic"], limit=0))
  written = json.loads((tmp_path / "sudoku_tiny-run-step1_32_16_0_generations.json").read_text())
  assert written["checkpoint_path"] == str(path / "checkpoints" / "1")
  assert written["settings"]["prompt"]["with_instruction"] is False
  assert written["settings"]["prompt"]["template"] == latest.config.task.prompt_style == "d1"
  held_out = data.make_examples(latest.config, "eval")
  assert [r["question"] for r in written["generations"]] == [ex.question for ex in held_out][:2]


def test_a_workdir_from_before_a_config_field_existed_still_loads(tmp_path, workdir):
  """Fields added to the config since the run (here model.family) take their defaults."""
  path, saved = workdir
  old = tmp_path / "old-run"
  shutil.copytree(path, old)
  config = json.loads((old / "config.json").read_text())
  del config["model"]["family"]
  (old / "config.json").write_text(json.dumps(config))
  source = checkpoint_source.resolve(str(old))
  assert source.config.model.family == "llada"
  mesh = mesh_lib.make_mesh(ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1)))
  model = checkpoint_source.load_model(source, mesh=mesh, dtype=np.float32)
  jax.tree.map(np.testing.assert_array_equal, nnx.state(model, nnx.Param), saved[2])


def test_the_supervised_start_of_a_workdir_takes_the_workdir_tokenizer(tmp_path, workdir):
  path = tmp_path / "run"
  config = json.loads((workdir[0] / "config.json").read_text())
  path.mkdir()
  (path / "config.json").write_text(json.dumps(config))
  model = models.init_model(models.get_config("tiny", vocab_size=33, embedding_size=33,
                                              mask_token_id=1, eos_token_id=2))
  models.save_pretrained(model, str(path / "sft_model"))
  source = checkpoint_source.resolve(str(path / "sft_model"))
  assert (source.kind, source.name) == ("huggingface", "run-sft_model")
  for spec in ("", str(path), str(path / "config.json")):  # its own, or named
    tokenizer = checkpoint_source.load_tokenizer(source, spec)
    assert tokenizer.alphabet == config["tokenizer"]["alphabet"]
  data.check_tokenizer(model.config, tokenizer)


class Interrupted(Exception):
  """Stands for a kill in the middle of a run."""


def _counting_generate(monkeypatch, fail_at=None):
  """Counts sampler calls; the call numbered `fail_at` raises, as a killed run would stop."""
  calls = []
  real = decoding.generate

  def generate(*args, **kwargs):
    calls.append(1)
    if len(calls) == fail_at:
      raise Interrupted
    return real(*args, **kwargs)

  monkeypatch.setattr(decoding, "generate", generate)
  return calls


def test_an_interrupted_run_resumes_at_the_next_unfinished_shard(tmp_path, monkeypatch,
                                                                  hf_checkpoint, data_dir):
  """5 puzzles, 2 a shard, one sampler call a shard: shards 0 and 1 finish, then a kill."""
  config = options(hf_checkpoint, tmp_path / "resumed", data_dir=str(data_dir))
  _counting_generate(monkeypatch, fail_at=3)
  with pytest.raises(Interrupted):
    evaluate.run(config)
  names = [f"sudoku_tiny-llada_32_16_{shard}_generations.json" for shard in range(3)]
  assert shard_files(tmp_path / "resumed") == names[:2]
  assert not [p for p in (tmp_path / "resumed").iterdir() if p.name.endswith(".tmp")]
  finished = {name: (tmp_path / "resumed" / name).stat().st_mtime_ns for name in names[:2]}

  calls = _counting_generate(monkeypatch)
  evaluate.run(config)
  assert len(calls) == 1  # Only shard 2 was decoded; 0 and 1 were kept as they were.
  assert shard_files(tmp_path / "resumed") == names
  assert {name: (tmp_path / "resumed" / name).stat().st_mtime_ns
          for name in names[:2]} == finished
  evaluate.run(config)
  assert len(calls) == 1  # A finished run has nothing left to decode.

  # What an uninterrupted run writes, to the record.
  evaluate.run(options(hf_checkpoint, tmp_path / "straight", data_dir=str(data_dir)))
  for name in names:
    resumed = json.loads((tmp_path / "resumed" / name).read_text())
    straight = json.loads((tmp_path / "straight" / name).read_text())
    assert resumed["generations"] == straight["generations"]


def test_a_shard_of_other_settings_is_not_taken_for_finished(tmp_path, hf_checkpoint, data_dir):
  evaluate.run(options(hf_checkpoint, tmp_path, data_dir=str(data_dir), limit=2))
  with pytest.raises(ValueError, match="other settings or examples"):
    evaluate.run(options(hf_checkpoint, tmp_path, data_dir=str(data_dir), limit=2,
                         with_instruction=True))


_SHARDED_SCRIPT = textwrap.dedent("""
    import sys
    import jax, ml_collections, numpy as np
    from jax.sharding import PartitionSpec as P
    from stabledrl_jax import evaluate, tasks, tokenizers
    from stabledrl_jax.training.parallel import mesh as mesh_lib
    from stabledrl_jax.training.state import checkpoint_source

    checkpoint, data_dir, out = sys.argv[1:]
    assert jax.device_count() == 8, jax.devices()
    source = checkpoint_source.resolve(checkpoint)
    tokenizer = tokenizers.CharTokenizer()
    task = tasks.get_task("countdown")
    examples = evaluate.load_test_set("countdown", data_dir=data_dir)
    tokens, mask = evaluate.styled_prompts(tokenizer, task, examples,
                                           evaluate.PromptStyle(with_instruction=False))
    assert not mask.all()  # ragged prompts, left-padded
    settings = evaluate.SamplerSettings.d1(32)
    completions = {}
    for name, shape, devices in (("one", (1, 1, 1), jax.devices()[:1]),
                                 ("eight", (2, 2, 2), jax.devices())):
      mesh = mesh_lib.make_mesh(ml_collections.ConfigDict(dict(zip(mesh_lib.MESH_AXES, shape))),
                                devices=devices)
      model = checkpoint_source.load_model(source, mesh=mesh, dtype=np.float32)
      # 5 prompts in batches of 3: 3 rows padded to 4 (data x fsdp), then 2 rows.
      completions[name] = evaluate.sample_completions(
          model, tokens, mask, settings, mesh=mesh, batch_size=3, key=jax.random.key(0))
    assert model.blocks[0].attn.q_proj.kernel[...].sharding.spec == P("fsdp", "tensor")
    np.testing.assert_array_equal(completions["eight"], completions["one"])
    assert completions["one"].shape == (5, 32)
    assert (completions["one"][:, 0] != tokenizer.eos_id).all()  # not trivially equal
    evaluate.run(evaluate.Options(checkpoint=checkpoint, task=["countdown"], output_dir=out,
                                  gen_lengths=[32], data_dir=data_dir, batch_size=3,
                                  tokenizer="char", with_instruction=False, mesh=(2, 2, 2)))
    print("OK")
""")


@pytest.mark.slow  # 7 s on idle cores, 21 s under load: two processes compile.
def test_eight_fake_devices_decode_what_one_device_decodes(tmp_path, hf_checkpoint, data_dir):
  """Token for token, greedy; then the files of a run on 8 devices equal a 1-device run's."""
  sharded = subprocess.run(
      [sys.executable, "-c", _SHARDED_SCRIPT, str(hf_checkpoint), str(data_dir),
       str(tmp_path / "eight")],
      env={**env(), "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert sharded.returncode == 0 and "OK" in sharded.stdout, sharded.stderr[-4000:]
  evaluate.run(evaluate.Options(checkpoint=str(hf_checkpoint), task=["countdown"],
                                output_dir=str(tmp_path / "one"), gen_lengths=[32],
                                data_dir=str(data_dir), batch_size=3, tokenizer="char",
                                with_instruction=False))
  name = "countdown_tiny-llada_32_16_0_generations.json"
  eight = json.loads((tmp_path / "eight" / name).read_text())
  one = json.loads((tmp_path / "one" / name).read_text())
  assert eight["generations"] == one["generations"]


# ---------------------------------------------------------------------------
# Pieces.
# ---------------------------------------------------------------------------


def test_d1_settings_and_file_names():
  settings = evaluate.SamplerSettings.d1(256)
  assert (settings.steps, settings.block_length, settings.temperature) == (128, 32, 0.0)
  assert evaluate.SamplerSettings.d1(256, steps=64).steps == 64
  path = evaluate.generation_path("out", "gsm8k", "instruct", settings, 3)
  assert path.name == "gsm8k_instruct_256_128_3_generations.json"
  assert scoring.setup_of(path) == "gsm8k_instruct_256_128"
  assert evaluate.model_name_of("LLaDA_8B Instruct/") == "LLaDA-8B-Instruct"


def test_hosts_write_interleaved_shards_that_never_collide():
  per_host = [evaluate.shard_ids(1319, 128, p, 3) for p in range(3)]
  assert per_host[0] == [0, 3, 6, 9]
  assert sorted(sum(per_host, [])) == list(range(11))  # every shard once, 11 = ceil(1319/128)


def test_two_hosts_write_the_files_of_one_host_between_them(tmp_path, hf_checkpoint, data_dir):
  source = checkpoint_source.resolve(str(hf_checkpoint))
  mesh = mesh_lib.make_mesh(ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1)))
  model = checkpoint_source.load_model(source, mesh=mesh, dtype=np.float32)
  examples = evaluate.load_test_set("sudoku", data_dir=str(data_dir))
  common = dict(model=model, tokenizer=tokenizers.CharTokenizer(),
                task=tasks.get_task("sudoku"), examples=examples,
                settings=evaluate.SamplerSettings.d1(32), model_name="m", mesh=mesh,
                key=jax.random.key(0), style=evaluate.PromptStyle(with_instruction=False),
                batch_size=2, shard_size=2)
  hosts = [evaluate.generate_shards(output_dir=tmp_path / "two", process_index=p,
                                    process_count=2, **common) for p in range(2)]
  assert [[path.name.split("_")[-2] for path in paths] for paths in hosts] == [
      ["0", "2"], ["1", "3"]]
  evaluate.generate_shards(output_dir=tmp_path / "one", **common)
  assert shard_files(tmp_path / "two") == shard_files(tmp_path / "one")
  pooled = scoring.score_generation_files([tmp_path / "two"])
  assert pooled["sudoku_m_32_16"].n == len(examples) == 7
  for name in shard_files(tmp_path / "one"):
    assert (json.loads((tmp_path / "two" / name).read_text())["generations"]
            == json.loads((tmp_path / "one" / name).read_text())["generations"])


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="needs ../shared/data (not in user clones)")
def test_default_test_sets_are_d1s_files():
  assert len(evaluate.load_test_set("countdown", data_dir=str(SHARED_DATA))) == 256
  sudoku = evaluate.load_test_set("sudoku", data_dir=str(SHARED_DATA), limit=10)
  assert len(sudoku) == 10 and sudoku[0].question == "Sudoku puzzle: 3102200002100320"


def test_a_directory_of_generation_files_gives_its_questions(tmp_path):
  """The first setup of the task, shards in numeric order (shard 10 after shard 2)."""
  task = tasks.get_task("sudoku")
  examples = [task.example_from_record({"Puzzle": p, "Solution": s}) for p, s in SUDOKU]
  for setup, order in (("sudoku_a_128_64", (0, 2, 10)), ("sudoku_b_256_128", (10, 2, 0))):
    for position, shard in enumerate(order):
      scoring.write_generations(tmp_path / f"{setup}_{shard}_generations.json",
                                   examples[2 * position:2 * position + 2], ["", ""])
  scoring.write_generations(tmp_path / "countdown_a_128_64_0_generations.json", [], [])
  loaded = evaluate.load_test_set("sudoku", str(tmp_path), limit=5)
  assert loaded == examples[:5]
  with pytest.raises(ValueError, match="no gsm8k_"):
    evaluate.load_test_set("gsm8k", str(tmp_path))


def test_synthetic_test_sets_need_no_files():
  examples = evaluate.load_test_set("countdown", "synthetic", data_dir="/nonexistent", limit=3)
  assert len(examples) == 3 and all(isinstance(ex, tasks.Example) for ex in examples)


# ---------------------------------------------------------------------------
# Bad input: clear errors, before any model is loaded.
# ---------------------------------------------------------------------------


def test_unknown_task_is_named():
  assert evaluate.task_names(["all"]) == ["gsm8k", "math500", "countdown", "sudoku"]
  with pytest.raises(ValueError, match="unknown task 'chess'; choose from countdown, gsm8k"):
    evaluate.task_names(["sudoku", "chess"])


@pytest.mark.parametrize("settings,message", [
    (evaluate.SamplerSettings.d1(100), r"gen_length \(100\) must be a multiple of block_length"),
    (evaluate.SamplerSettings.d1(128, steps=6), r"multiple of the number of blocks \(4\)"),
    (evaluate.SamplerSettings.d1(128, remasking="entropy"), "remasking must be one of"),
    (evaluate.SamplerSettings.d1(128, remasking="threshold", threshold=1.5),
     r"threshold must lie in \[0, 1\]"),
    (evaluate.SamplerSettings.d1(128, temperature=-1.0), "must be >= 0"),
])
def test_bad_sampler_settings(settings, message):
  with pytest.raises(ValueError, match=message):
    settings.check(models.get_config("tiny"))


def test_each_family_checks_the_settings_by_its_own_sampler():
  """SDAR's rules are SDAR's: its record takes the steps per block; what it has no use for is
  named."""
  sdar = models.get_sdar_config("tiny")
  dynamic = evaluate.SamplerSettings.d1(64, remasking="low_confidence_dynamic")
  dynamic.check(sdar)  # LLaDA's sampler has no such rule; SDAR's has.
  record = models.family.of(sdar).sampling(dynamic, sdar)
  assert record.steps == -(-dynamic.steps // (64 // sdar.block_size))
  assert record.stop_ids == tuple(sdar.stop_token_ids)
  with pytest.raises(ValueError, match="SDAR's sampler always keeps the keys and values"):
    evaluate.SamplerSettings.d1(64, cache="dual").check(sdar)
  with pytest.raises(ValueError, match="remasking 'random' is not one of SDAR's"):
    evaluate.SamplerSettings.d1(64, remasking="random").check(sdar)
  with pytest.raises(ValueError, match="remasking must be one of"):  # LLaDA's check.
    dynamic.check(models.get_config("tiny"))


def test_threshold_decoding_is_a_sampler_setting_and_recorded_only_when_used():
  dynamic = evaluate.SamplerSettings.d1(128, remasking="threshold", threshold=0.8)
  dynamic.check(models.get_config("tiny"))
  assert dynamic.describe()["threshold"] == 0.8
  assert "threshold" not in evaluate.SamplerSettings.d1(128).describe()


def test_a_path_that_is_no_checkpoint(tmp_path, hf_checkpoint, workdir):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    checkpoint_source.resolve(str(tmp_path / "missing"))
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(ValueError, match="neither a training workdir .*, a Hugging Face .* nor a PEFT adapter"):
    checkpoint_source.resolve(str(tmp_path))
  with pytest.raises(ValueError, match=r"no checkpoint of step 7; it has \[1, 2\]"):
    checkpoint_source.resolve(str(workdir[0]), step=7)
  with pytest.raises(ValueError, match="selects a checkpoint of a training workdir"):
    checkpoint_source.resolve(str(hf_checkpoint), step=1)
  (tmp_path / "checkpoints").mkdir()
  (tmp_path / "config.json").write_text(json.dumps({"model": {}, "tokenizer": {}}))
  with pytest.raises(ValueError, match="no finished checkpoint yet"):
    checkpoint_source.resolve(str(tmp_path))


def test_a_tokenizer_that_does_not_fit_the_model(hf_checkpoint):
  source = checkpoint_source.resolve(str(hf_checkpoint))
  with pytest.raises(ValueError, match="no tokenizer.json and is not inside a training workdir"):
    checkpoint_source.load_tokenizer(source)
  with pytest.raises(ValueError, match=r"vocabulary 33 < 101"):
    data.check_tokenizer(models.load_config(str(hf_checkpoint)),
                                      tokenizers.CharTokenizer(" /0123456789:<>Sadeklnoprsuwz"))


@pytest.mark.parametrize("overrides,message", [
    ({"data": ["countdown=synthetic"]}, "not TASK=SOURCE for an evaluated task"),
    ({"model_name": "my_model"}, "model name 'my_model'"),
    ({"mesh": (3, 1, 1)}, r"needs 3 devices, but 1 are available"),
    ({"batch_size": 0}, r"batch size \(0\) and shard size \(2\) must be >= 1"),
    ({"data_dir": "/nonexistent"}, "point --data_dir at it"),
    # The checkpoint's family's sampler judges the settings (LLaDA's has no dynamic rule).
    ({"remasking": "low_confidence_dynamic"}, "remasking must be one of"),
    ({"gen_lengths": [100]}, r"gen_length \(100\) must be a multiple of block_length"),
])
def test_bad_options(tmp_path, hf_checkpoint, overrides, message):
  with pytest.raises((ValueError, FileNotFoundError), match=message):
    evaluate.run(options(hf_checkpoint, tmp_path / "out", **overrides))
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("checkpoint,overrides,message", [
    ("sdar_checkpoint", {"cache": "dual"}, r"\(a sdar checkpoint\): .*SDAR's sampler always keeps"),
    ("sdar_checkpoint", {"remasking": "random"}, "remasking 'random' is not one of SDAR's"),
    ("workdir", {"remasking": "low_confidence_dynamic"},
     r"tiny-run \(a llada checkpoint\): remasking must be one of"),
])
def test_each_checkpoint_refuses_what_its_own_sampler_refuses(tmp_path, request, checkpoint,
                                                              overrides, message):
  path = request.getfixturevalue(checkpoint)
  path = path[0] if isinstance(path, tuple) else path
  with pytest.raises(ValueError, match=message):
    evaluate.run(options(path, tmp_path / "out", **overrides))
  assert not (tmp_path / "out").exists()


def test_the_cli_reports_a_sampler_setting_the_checkpoint_refuses(tmp_path, hf_checkpoint):
  completed = subprocess.run(
      [sys.executable, "-m", "stabledrl_jax.evaluate", f"--checkpoint={hf_checkpoint}",
       f"--output_dir={tmp_path / 'out'}", "--task=sudoku", "--gen_lengths=100"],
      cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
  assert completed.returncode == 1, completed.stderr[-2000:]
  (line,) = [l for l in completed.stderr.splitlines() if "must be a multiple of block_length" in l]
  assert line.startswith("error: ") and "(a llada checkpoint)" in line
  assert "Traceback" not in completed.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,message", [
    (["--task=chess"], "unknown task 'chess'"),
    (["--task=sudoku", "--checkpoint=/nonexistent"], "does not exist"),
    (["--task=sudoku", "--limit=-1"], "--limit must be >= 1 (or 0, the default: every example)"),
    (["--task=sudoku", "--temperature=nan"], "--temperature must be finite and >= 0"),
    (["--task=sudoku", "--temperature=inf"], "--temperature must be finite and >= 0"),
    (["--task=sudoku", "--temperature=-0.5"], "--temperature must be finite and >= 0"),
])
def test_cli_reports_bad_input(tmp_path, argv, message):
  completed = subprocess.run(
      [sys.executable, "-m", "stabledrl_jax.evaluate", f"--checkpoint={tmp_path}",
       f"--output_dir={tmp_path / 'out'}", *argv],
      cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
  assert completed.returncode == 1 and message in completed.stderr, completed.stderr[-2000:]
  (line,) = [l for l in completed.stderr.splitlines() if message in l]
  assert line.startswith("error: ")  # one line, no traceback
  assert "Traceback" not in completed.stderr
  assert not (tmp_path / "out").exists()


def test_a_kv_cached_evaluation_records_its_cache(tmp_path, hf_checkpoint, data_dir):
  """--cache dual: decoded by the cached sampler, the setting in each file's metadata (so a
  resumed run of other settings does not take the shards for its own); with one step per block
  (steps = blocks) it is the exact sampler's decode."""
  exact = evaluate.run(options(hf_checkpoint, tmp_path / "exact", steps=1, data_dir=str(data_dir)))
  cached = evaluate.run(options(hf_checkpoint, tmp_path / "dual", steps=1, cache="dual",
                                data_dir=str(data_dir)))
  assert {k: v.accuracy for k, v in cached.items()} == {k: v.accuracy for k, v in exact.items()}
  for path in (tmp_path / "dual").glob("*_generations.json"):
    assert json.loads(path.read_text())["settings"]["cache"] == "dual"
  for path in (tmp_path / "exact").glob("*_generations.json"):
    assert "cache" not in json.loads(path.read_text())["settings"]
    twin = tmp_path / "dual" / path.name
    assert json.loads(path.read_text())["generations"] == json.loads(twin.read_text())[
        "generations"]


def test_the_assistant_prefix_follows_the_prompt_style():
  """d1's evaluation starts the answer with <reasoning>; the official StableDRL prompts do not
  (their training used the chat template's generation prompt alone)."""
  chat = types.SimpleNamespace(chat_prompt=lambda text, assistant_prefix="": text)
  assert evaluate.default_assistant_prefix(chat, "d1") == evaluate.D1_ASSISTANT_PREFIX
  assert evaluate.default_assistant_prefix(chat, "stabledrl") == ""
  assert evaluate.default_assistant_prefix(object(), "d1") == ""  # no chat template
