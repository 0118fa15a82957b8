"""Every path and value a command takes is checked up front (docs/reliability.md): an empty or
non-UTF-8 output path, a family option out of its range, a temperature or a generation length
the model cannot take are one-line errors before anything is written; a start that fails
leaves no debris in its workdir; a second Ctrl-C exits 130 wherever it lands."""

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import ml_collections
import pytest
from absl import flags

from stabledrl_jax import export, models, path_args
from stabledrl_jax.models import family, lora, peft_io
from stabledrl_jax.models.dream import sampler as dream_sampler
from stabledrl_jax.training.config import config_lib, run_spec, specs
from stabledrl_jax.training.inputs import data
from stabledrl_jax.training.loop import sweep, trainer
from stabledrl_jax.training.state import checkpointing, supervised
from stabledrl_jax.training.step import build

import test_hub
from test_evaluate import env, hf_checkpoint, options  # pylint: disable=unused-import
from test_training import tiny_config

REPO = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "configs" / "quickstart.py")
NOT_UTF8 = os.fsdecode(b"run\xff")  # As Python decodes the byte from argv: 'run\udcff'.


def dream(**updates) -> ml_collections.ConfigDict:
  """The quickstart on a tiny Dream model (its vocabulary: the alphabet's 33 characters)."""
  return sweep.with_overrides(config_lib.get("quickstart"), {
      "model.family": "dream", "rollout.remasking": "entropy", **updates})


def one_line(error: BaseException, start: str) -> None:
  message = str(error)
  assert message.startswith(start) and "\n" not in message, message


# ---------------------------------------------------------------------------
# Output paths: empty or not UTF-8, refused before anything is written.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["", NOT_UTF8], ids=["empty", "not-utf8"])
def test_a_workdir_that_is_empty_or_not_utf8_is_refused_before_anything_is_written(
    tmp_path, monkeypatch, name):
  """``--workdir=`` trained into the current directory; a name with the byte 0xff trained, then
  failed at its first orbax save. Both are one line, the CLI's naming the flag, before anything
  is written (here the current directory is tmp_path: it stays empty)."""
  monkeypatch.chdir(tmp_path)
  workdir = name and str(tmp_path / name)
  with pytest.raises(ValueError) as error:
    trainer.train(tiny_config(), workdir)
  one_line(error.value, "workdir ")
  from stabledrl_jax import train  # pylint: disable=g-import-not-at-top
  try:
    flags.FLAGS(["train", f"--config={QUICKSTART}", f"--workdir={workdir}"])
    with pytest.raises(SystemExit) as exited:
      train.main(["train"])
  finally:
    flags.FLAGS.unparse_flags()
  message = str(exited.value.code)
  assert message.startswith("error: --workdir ") and "\n" not in message, message
  assert ("is empty" if not name else r"run\xff' is not valid UTF-8") in message, message
  assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["", NOT_UTF8], ids=["empty", "not-utf8"])
def test_evaluate_and_export_refuse_an_empty_or_non_utf8_output(tmp_path, monkeypatch,
                                                                hf_checkpoint, name):
  from stabledrl_jax import evaluate  # pylint: disable=g-import-not-at-top
  monkeypatch.chdir(tmp_path)
  target = name and str(tmp_path / name)
  with pytest.raises(ValueError) as error:
    evaluate.run(options(hf_checkpoint, target))
  one_line(error.value, "--output_dir ")
  if name:  # '' is the default, OUTPUT_DIR/results.json.
    with pytest.raises(ValueError) as error:
      evaluate.run(options(hf_checkpoint, tmp_path / "out", output=target))
    one_line(error.value, "--output ")
  with pytest.raises(ValueError) as error:
    export.check_output(target)
  one_line(error.value, "--output ")
  assert not list(tmp_path.iterdir())


def test_path_args_says_what_is_wrong_with_a_name():
  path_args.check("runs/qs", "--workdir")
  path_args.check(pathlib.Path("runs") / "qs", "--workdir")
  for name, says in (("", "is empty"), ("  ", "is empty"), (b"run\xff", "not valid UTF-8"),
                     (NOT_UTF8, r"--workdir 'run\xff' is not valid UTF-8"), ("a\0b", "NUL")):
    with pytest.raises(ValueError, match=re.escape(says)):
      path_args.check(name, "--workdir")


# ---------------------------------------------------------------------------
# Family options and temperatures: declared once, in range, settable from the command line.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("option,value,says", [
    ("top_p", 1.5, r"must be a finite number in \(0, 1\]"),
    ("top_p", 1e300, r"must be a finite number in \(0, 1\]"),
    ("top_p", 0.0, r"must be a finite number in \(0, 1\]"),
    ("top_k", 10**6, r"must be an integer in \[1, 33\] \(.*33: the model's vocabulary size\)"),
    ("top_k", 0, r"must be an integer in \[1, 33\]"),
    ("alg_temp", 1e300, r"must be a finite number in \[0, 100\]"),
    ("eps", 1.0, r"must be a finite number in \(0, 1\)"),
])
@pytest.mark.parametrize("section", ["rollout", "eval"])
def test_a_dream_option_out_of_its_range_is_a_config_error(option, value, says, section):
  """top_p=1.5 or 1e300 and top_k=10**6 trained (top_k above the vocabulary keeps every token;
  top_k 0 keeps none, as the official top_k_logits indexes an empty top-k)."""
  with pytest.raises(ValueError, match=says) as error:
    specs.validate(dream(**{f"{section}.family_options.{option}": value}))
  one_line(error.value, f"config.{section}.family_options.{option}: ")


def test_a_checkpoint_s_options_are_checked_before_its_vocabulary_is_known():
  """With model.checkpoint the vocabulary comes with its config.json (``build.check_checkpoint``
  bounds top_k then); the static ranges are validation's."""
  config = dream(**{"model.checkpoint": "/some/dir", "rollout.family_options.top_p": 1.5})
  with pytest.raises(ValueError, match=r"^config\.rollout\.family_options\.top_p: must be"):
    specs.validate(config)
  specs.validate(dream(**{"model.checkpoint": "/some/dir", "rollout.family_options.top_k": 10**6}))


def test_the_options_are_declared_once_by_the_family_record():
  """base_config lists every registered family's options, unset, typed as declared; the Dream
  record's options are its sampler's, whose settings record checks the same ranges."""
  declared = {}
  for name in family.names():
    for option, spec in family.get(name).options.items():
      declared.setdefault(option, spec.kind)
  assert family.get("dream").options is dream_sampler.OPTIONS
  assert set(declared) == {"top_p", "top_k", "alg_temp", "eps"}
  for section in ("rollout", "eval"):
    fields = config_lib.base_config()[section].family_options
    assert {k: fields.get_type(k) for k in fields} == declared
    assert all(fields[k] is None for k in fields)
  with pytest.raises(ValueError, match=r"^rollout\.family_options\.top_p: must be"):
    dream_sampler.Sampling(gen_length=8, steps=4, top_p=1.5)


def test_family_options_are_set_from_the_command_line_and_refused_by_name_elsewhere(monkeypatch):
  """--config.rollout.family_options.top_p=0.9 was "no such field" (an empty section that config
  flags cannot add to); now every registered family's option is a field. Dream takes it; LLaDA
  refuses it by name when it is set, and an unset one passes on to no sampler."""
  args = ["--config.model.family=dream", "--config.rollout.remasking=entropy",
          "--config.rollout.family_options.top_p=0.9", "--config.eval.family_options.top_k=5"]
  from stabledrl_jax import cli_flags  # pylint: disable=g-import-not-at-top
  cli_flags.check_config_flags(["--config", QUICKSTART, *args])
  from stabledrl_jax import train  # pylint: disable=g-import-not-at-top,unused-import
  argv = ["train", f"--config={QUICKSTART}", "--workdir=/unused", *args]
  monkeypatch.setattr(sys, "argv", argv)  # config_flags reads the overrides there.
  try:  # The command line's own --config flag (absl's config_flags), as the CLI parses it.
    flags.FLAGS(argv)
    config = flags.FLAGS.config
  finally:
    flags.FLAGS.unparse_flags()
  assert config.rollout.family_options.top_p == 0.9 and config.eval.family_options.top_k == 5
  specs.validate(config)
  evaluation = run_spec.Decoding.of_eval(config)
  assert dict(evaluation.family_options) == {"top_p": 0.9, "top_k": 5}
  llada = sweep.with_overrides(config, {"model.family": "llada",
                                        "rollout.remasking": "low_confidence"})
  with pytest.raises(ValueError) as error:
    specs.validate(llada)
  one_line(error.value, "config.rollout.family_options.top_p: the llada family's sampler takes "
           "none")
  plain = config_lib.get("quickstart")
  specs.validate(plain)
  assert run_spec.Decoding.of_eval(plain).family_options == ()


@pytest.mark.parametrize("temperature", [1e300, 101.0])
def test_a_decoding_temperature_is_bounded(temperature):
  config = models.get_config("tiny")
  with pytest.raises(ValueError, match=r"^temperature: must be at most 100 "):
    run_spec.Decoding(gen_length=32, temperature=temperature).check(config)
  run_spec.Decoding(gen_length=32, temperature=run_spec.MAX_TEMPERATURE).check(config)


def test_evaluate_bounds_the_temperature_and_the_generation_length(tmp_path, hf_checkpoint):
  """--temperature 1e300 scored 0.00 after an overflow warning; --gen_lengths 1000000 ended in a
  45-line JaxRuntimeError. Both are one line naming the flag, before any weight is read."""
  from stabledrl_jax import evaluate  # pylint: disable=g-import-not-at-top
  out = tmp_path / "out"
  with pytest.raises(ValueError) as error:
    evaluate.run(options(hf_checkpoint, out, temperature=1e300))
  one_line(error.value, "--temperature must be finite and >= 0, at most 100 ")
  limit = models.load_config(str(hf_checkpoint)).max_sequence_length
  with pytest.raises(ValueError) as error:
    evaluate.run(options(hf_checkpoint, out, gen_lengths=[1_000_000]))
  one_line(error.value, "--gen_lengths 1000000: ")
  assert f"the {limit} positions the llada model is made for" in str(error.value)
  # A completion that fits alone is taken, whatever the prompts (rotary positions go on).
  config = models.load_config(str(hf_checkpoint))
  evaluate._check_positions(limit, config)  # pylint: disable=protected-access
  assert not out.exists()


# ---------------------------------------------------------------------------
# No debris: everything is checked before the workdir is made; a late failure removes what
# this invocation created (empty directories only), never what was there before.
# ---------------------------------------------------------------------------


def countdown(**updates):
  """The quickstart on countdown (its alphabet and generator reset for the task), keeping the
  quickstart's imperfect demonstrator (sft.demo_error_rate 0.75), which only sudoku has."""
  config = config_lib.get("quickstart")
  config.data.generator = ml_collections.ConfigDict()
  return sweep.with_overrides(config, {"task.name": "countdown", "tokenizer.alphabet": "",
                                       "data.train_size": 64, "data.eval_size": 8, **updates})


def test_a_demonstrator_error_rate_on_a_task_without_one_leaves_no_workdir(tmp_path):
  """It failed at the first supervised step, leaving empty checkpoints/ and sft_progress/."""
  workdir = tmp_path / "run"
  with pytest.raises(ValueError) as error:
    trainer.train(countdown(), str(workdir))
  one_line(error.value, "config.sft.demo_error_rate: 0.75 > 0 needs a task with an imperfect "
           "demonstrator")
  assert not workdir.exists()
  specs.validate(countdown(**{"sft.demo_error_rate": 0.0}))


def _adapter(tmp_path, config):
  """A PEFT adapter (r=4, lora_alpha=8 on q, k, v and up) on a base of ``config``'s model."""
  model = models.init_model(specs.model_config(config), seed=0)
  base = str(tmp_path / "base")
  models.save_pretrained(model, base)
  lora.add_adapters(model, lora.LoRASpec(4, 8.0, ("q_proj", "k_proj", "v_proj", "up_proj")))
  peft_io.save_adapter(model, str(tmp_path / "adapter"), base=base)
  return str(tmp_path / "adapter")


@pytest.mark.parametrize("setting", [{"model.lora.rank": 8}, {"model.lora.alpha": 16.0},
                                     {"model.lora.targets": "q_proj"}],
                         ids=["rank", "alpha", "targets"])
def test_a_peft_adapter_the_lora_settings_do_not_describe_leaves_no_workdir(tmp_path, setting):
  config = tiny_config(**{"sft.num_steps": 0, "model.lora.rank": 4, "model.lora.alpha": 8.0})
  adapter = _adapter(tmp_path, config)
  config = sweep.with_overrides(config, {"model.checkpoint": adapter})
  tokenizer = data.make_tokenizer(config.tokenizer)
  build.check_checkpoint(config, tokenizer, build.checkpoint_config(config))  # As it is: fine.
  workdir = tmp_path / "run"
  with pytest.raises(ValueError) as error:
    trainer.train(sweep.with_overrides(config, setting), str(workdir))
  one_line(error.value, "config.model.lora: ")
  assert "do not describe the adapter" in str(error.value)
  assert not workdir.exists()


def test_a_hub_model_that_cannot_be_fetched_leaves_no_workdir(tmp_path, monkeypatch):
  """dream7b_espo offline: the tokenizer and the model's config.json are fetched before the
  workdir is made (the weights are not, yet)."""
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=r"^config\.tokenizer\.path: 'Dream-org/Dream-v0-"
                     r"Instruct-7B' is not a local path"):
    trainer.train(config_lib.get("dream7b_espo"), str(workdir))
  assert not workdir.exists()
  # The model alone (a tokenizer that is there): its config.json is what fails.
  config = tiny_config(**{"model.checkpoint": "nobody/nothing", "sft.num_steps": 0})
  with pytest.raises(ValueError) as error:
    trainer.train(config, str(workdir))
  one_line(error.value, "config.model.checkpoint: 'nobody/nothing' is not a local path")
  assert not workdir.exists()


def test_a_failure_after_the_workdir_was_made_removes_only_what_this_start_created(
    tmp_path, monkeypatch):
  """Weights that cannot be read are found only when they are loaded (here a Hub cache that
  holds the config files and no weights): the workdir this start created goes; in a workdir
  that existed, what was there stays and the empty directories it added go."""
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
  cache = test_hub._hub_cache(tmp_path / "cache")  # pylint: disable=protected-access
  snapshot = (cache / ("models--" + test_hub.REPO_ID.replace("/", "--")) / "snapshots"
              / test_hub.COMMIT)
  for weights in snapshot.glob("*.safetensors*"):
    weights.unlink()
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  config = tiny_config(**{"model.checkpoint": test_hub.REPO_ID, "tokenizer.kind": "llada",
                          "tokenizer.path": test_hub.REPO_ID, "sft.num_steps": 0,
                          "rollout.prompt_length": 64})
  new = tmp_path / "new" / "run"  # Its parent is created too, and removed.
  with pytest.raises(Exception) as error:  # pylint: disable=broad-except
    trainer.train(config, str(new))
  assert "safetensors" in str(error.value), error.value  # The weights, read in the workdir.
  assert not (tmp_path / "new").exists()
  existing = tmp_path / "existing"
  (existing / "notes").mkdir(parents=True)
  (existing / "notes" / "a.txt").write_text("mine")
  (existing / "empty_before").mkdir()
  with pytest.raises(Exception):  # pylint: disable=broad-except
    trainer.train(config, str(existing))
  assert sorted(p.name for p in existing.iterdir()) == ["empty_before", "notes"]
  assert (existing / "notes" / "a.txt").read_text() == "mine"


def test_remove_debris_keeps_files_and_what_was_there(tmp_path):
  (tmp_path / "old_empty").mkdir()
  (tmp_path / "new_empty" / "deeper").mkdir(parents=True)
  (tmp_path / "new_with_file").mkdir()
  (tmp_path / "new_with_file" / "x").write_text("x")
  (tmp_path / "new_file").write_text("y")
  path_args.remove_debris(tmp_path, {"old_empty"})
  assert sorted(p.name for p in tmp_path.iterdir()) == ["new_file", "new_with_file", "old_empty"]
  created = path_args.missing_dirs(tmp_path / "a" / "b")
  assert created == [str(tmp_path / "a" / "b"), str(tmp_path / "a")]
  (tmp_path / "a" / "b").mkdir(parents=True)
  (tmp_path / "a" / "keep").write_text("z")  # Someone's file: the parent stays.
  path_args.remove_created(created)
  assert not (tmp_path / "a" / "b").exists() and (tmp_path / "a" / "keep").exists()


# ---------------------------------------------------------------------------
# A second Ctrl-C: exit 130, no traceback, wherever it lands.
# ---------------------------------------------------------------------------

READY = "rl step started"
EXITING = "interpreter exiting"
# The command line with a marker as each RL step starts and the interpreter's exit held 600 s
# (an atexit callback registered first runs last): the second Ctrl-C lands in the teardown after
# the first stopped the run, where it raised KeyboardInterrupt in an atexit callback ("Exception
# ignored ...") and the process exited 0.
_HELD_EXIT = f"""
import atexit, sys, time
atexit.register(lambda: (print({EXITING!r}, flush=True), time.sleep(600)))
from stabledrl_jax.training.step import rl_step
real = rl_step.rl_step

def marked(*args, **kwargs):
  print({READY!r}, flush=True)
  return real(*args, **kwargs)

rl_step.rl_step = marked
from stabledrl_jax import train
sys.argv = ["stabledrl_jax.train", *sys.argv[1:]]
train.run()
"""


def _signal_at(process, markers, timeout_s=300):
  """Reads ``process``'s output; at each of ``markers`` (in order) sends SIGINT. Returns (exit
  code, output)."""
  lines, pending, deadline = [], list(markers), time.monotonic() + timeout_s
  try:
    for line in process.stdout:
      lines.append(line)
      if pending and pending[0] in line:  # tqdm's bar may start the line.
        pending.pop(0)
        process.send_signal(signal.SIGINT)
      if not pending or time.monotonic() > deadline:
        break
    lines.append(process.communicate(timeout=120)[0])
    return process.returncode, "".join(lines)
  finally:
    if process.poll() is None:
      process.kill()
      process.wait()


@pytest.mark.slow
def test_a_second_ctrl_c_after_the_run_stopped_exits_130_without_a_traceback(tmp_path):
  workdir = tmp_path / "run"
  process = subprocess.Popen(
      [sys.executable, "-c", _HELD_EXIT, f"--config={QUICKSTART}", f"--workdir={workdir}",
       "--config.sft.num_steps=0", "--config.train.num_steps=200",
       "--config.data.train_size=64", "--config.data.eval_size=8",
       "--config.rollout.num_prompts=2", "--config.rollout.group_size=4",
       "--config.rollout.steps=10", "--config.eval.every_steps=0"],
      cwd=REPO, env={**env(), "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True)
  code, out = _signal_at(process, [READY, EXITING])
  assert code == 128 + signal.SIGINT, out
  assert "Stopped by a signal: saved step 1" in out, out
  assert "Interrupted again: stopping now; the last checkpoint is step 1" in out, out
  assert "Traceback" not in out and "Exception ignored" not in out, out
  assert not (workdir / checkpointing.WorkdirLock.NAME).exists()
  assert (workdir / checkpointing.CHECKPOINT_DIR / "1").is_dir()
  assert not (workdir / supervised.SFT_DIR).exists()


# evaluate with its decoding held 600 s as inside a long XLA call, where the main thread runs no
# Python signal handler (here: SIGINT blocked in it, so that only another thread takes it): the
# first Ctrl-C waits for the call to return, the second ends the process at once.
_HELD_DECODE = f"""
import signal, sys, time
from stabledrl_jax.training.step import decoding

def held(*args, **kwargs):
  signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
  print({READY!r}, flush=True)
  time.sleep(600)

decoding.generate = held
from stabledrl_jax import evaluate
sys.argv = ["stabledrl_jax.evaluate", *sys.argv[1:]]
evaluate.run_cli()
"""


@pytest.mark.slow
def test_a_second_ctrl_c_during_evaluate_exits_130_at_once(tmp_path, hf_checkpoint):
  process = subprocess.Popen(
      [sys.executable, "-c", _HELD_DECODE, f"--checkpoint={hf_checkpoint}",
       f"--output_dir={tmp_path / 'out'}", "--task=sudoku", "--data=sudoku=synthetic",
       "--limit=2", "--gen_lengths=32", "--tokenizer=char", "--nowith_instruction"],
      cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  # Two Ctrl-Cs 0.3 s apart inside the held call.
  lines = []
  try:
    for line in process.stdout:
      lines.append(line)
      if READY in line:
        time.sleep(1.0)  # Inside the held call (Python would take it between two bytecodes).
        process.send_signal(signal.SIGINT)
        time.sleep(0.3)
        process.send_signal(signal.SIGINT)
        break
    lines.append(process.communicate(timeout=60)[0])
    code = process.returncode
  finally:
    if process.poll() is None:
      process.kill()
      process.wait()
  out = "".join(lines)
  assert code == 128 + signal.SIGINT, out
  assert "Interrupted again: stopping now." in out and "Traceback" not in out, out
