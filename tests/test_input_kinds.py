"""No file of the workdir or of an input is opened before its kind is known (issue #54, item 3;
docs/reliability.md): a FIFO (whose open waits for a writer for good: the programs hung, deaf to
Ctrl-C), a link to one, a directory or a device (/dev/zero reads without end; the tests plant
/dev/null) where a regular file belongs is one line naming the file and what it is, in the
error type its command line reports (``workdir_files.open_regular``, ``regular_file``,
``check_tree``).

Every call runs in a thread that must end within ``LIMIT_S``: a regression fails the test
instead of hanging the suite. Two command lines check the whole path: a FIFO as ``LOCK`` (train)
and as ``adapter_model.safetensors`` (evaluate).
"""

import contextlib
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types

import jax.numpy as jnp
import optax
import pytest
from etils import epath

from stabledrl_jax import cli_flags, evaluate, input_files, scoring, tasks, tokenizers
from stabledrl_jax import workdir_files
from stabledrl_jax.models import hf_io, peft_io
from stabledrl_jax.plan import report
from stabledrl_jax.training.loop import collapse, metrics_writer, spikes, sweep
from stabledrl_jax.training.state import checkpoint_source, checkpointing, lora_base
from stabledrl_jax.training.step import train_step

import test_hf_io

LIMIT_S = 15  # Each call here takes well under a second; a blocked open never returns.

# A kind of entry planted where a regular file belongs, and the words its error must hold.
KINDS = {"fifo": "a FIFO", "link_to_fifo": "a FIFO", "directory": "a directory",
         "device": "a character device"}
NOT_DIRECTORIES = ("fifo", "link_to_fifo", "device")


# The FIFOs planted by the running test: what the watchdog (``_promptly``) opens.
_FIFOS = []

# The watchdog process: after argv[1] seconds it opens each FIFO of argv[2:] for writing, a few
# times, so that a reader blocked on one gets end-of-file. A thread cannot do it: a library that
# blocks in open() while holding the GIL (safetensors does) stops every thread of the process.
_UNBLOCK = """
import os, sys, time
time.sleep(float(sys.argv[1]))
for _ in range(50):
  for fifo in sys.argv[2:]:
    try:
      os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
      pass
  time.sleep(0.1)
"""


@pytest.fixture
def plant(tmp_path):
  """``plant(path, kind)``: ``kind`` at ``path`` (a link's FIFO in ``tmp_path/elsewhere``, out
  of the way of every directory a test reads; the device is /dev/null, which a regression
  reads as empty rather than without end); returns ``path``."""
  elsewhere = tmp_path / "elsewhere"

  def plant_one(path, kind):
    path = pathlib.Path(path)
    if kind == "fifo":
      os.mkfifo(path)
      _FIFOS.append(path)
    elif kind == "link_to_fifo":
      elsewhere.mkdir(exist_ok=True)
      target = elsewhere / f"{len(list(elsewhere.iterdir()))}.fifo"
      os.mkfifo(target)
      _FIFOS.append(target)
      path.symlink_to(target)
    elif kind == "directory":
      path.mkdir()
    elif kind == "device":
      path.symlink_to(os.devnull)
    else:
      raise ValueError(kind)
    return path

  yield plant_one
  _FIFOS.clear()


def _promptly(function, *args, **kwargs):
  """``function(*args, **kwargs)`` in a thread that must end within LIMIT_S: (result, error).

  A call blocked on a planted FIFO is released by a watchdog process after LIMIT_S (it ends,
  the test fails, the suite goes on)."""
  watchdog = (subprocess.Popen([sys.executable, "-S", "-c", _UNBLOCK, str(LIMIT_S),
                                *map(str, _FIFOS)]) if _FIFOS else None)
  outcome = {}

  def target():
    try:
      outcome["result"] = function(*args, **kwargs)
    except BaseException as error:  # pylint: disable=broad-except
      outcome["error"] = error

  start = time.monotonic()
  thread = threading.Thread(target=target, daemon=True)
  thread.start()
  thread.join(LIMIT_S)
  elapsed = time.monotonic() - start
  if watchdog is not None:
    if thread.is_alive():  # Blocked without the GIL: the watchdog releases it now.
      with contextlib.suppress(subprocess.TimeoutExpired):
        watchdog.wait(10)
    watchdog.kill()
    watchdog.wait()
  assert elapsed < LIMIT_S and not thread.is_alive(), (
      f"{getattr(function, '__name__', function)} blocked on {args}")
  return outcome.get("result"), outcome.get("error")


def _refused(error_type, path, kind, function, *args, **kwargs):
  """``function`` raises ``error_type`` promptly, one line naming ``path`` and ``kind``."""
  _, error = _promptly(function, *args, **kwargs)
  assert isinstance(error, error_type), repr(error)
  message = str(error)
  assert "\n" not in message and str(path) in message and KINDS[kind] in message, message
  return message


# ---------------------------------------------------------------------------
# The helper itself.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_the_helper_refuses_each_kind_in_one_line_of_the_callers_type(tmp_path, plant, kind):
  (tmp_path / "d").mkdir()
  path = plant(tmp_path / "d" / "file.json", kind)
  message = _refused(ValueError, path, kind, workdir_files.read_text, path, "the thing",
                     error=ValueError)
  assert message.startswith(f"the thing {path}: {KINDS[kind]}, not a regular file"), message
  if kind in ("link_to_fifo", "device"):
    assert message.endswith(f"(a symbolic link to {os.readlink(path)})"), message
  _refused(workdir_files.WorkdirError, path, kind, workdir_files.regular_file, path)
  _refused(workdir_files.WorkdirError, path, kind, workdir_files.open_regular, path, "rb",
           missing_ok=True)


def test_the_helper_reads_regular_files_and_names_what_is_missing(tmp_path):
  regular = tmp_path / "a.txt"
  regular.write_text("text")
  (tmp_path / "link").symlink_to(regular)
  assert workdir_files.read_text(tmp_path / "link") == "text"
  assert workdir_files.read_bytes(regular) == b"text"
  assert workdir_files.read_text(tmp_path / "missing", missing_ok=True) is None
  (tmp_path / "dangling").symlink_to(tmp_path / "gone")
  assert workdir_files.read_text(tmp_path / "dangling", missing_ok=True) is None
  with pytest.raises(workdir_files.WorkdirError,
                     match=rf"^{tmp_path}/dangling: does not exist \(a symbolic link to "):
    workdir_files.read_text(tmp_path / "dangling")
  with pytest.raises(workdir_files.WorkdirError, match=r": a symbolic link \(to .*a.txt\), "
                     "which is not followed$"):
    workdir_files.read_text(tmp_path / "link", follow_links=False)
  # A socket, in a short directory (a socket's path has at most 107 bytes).
  short = tempfile.mkdtemp(prefix="kinds-")
  try:
    server = socket.socket(socket.AF_UNIX)
    server.bind(os.path.join(short, "s"))
    with pytest.raises(workdir_files.WorkdirError, match=r"s: a socket, not a regular file$"):
      workdir_files.read_text(os.path.join(short, "s"))
    server.close()
  finally:
    shutil.rmtree(short)


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_what_takes_the_files_place_after_the_check_is_still_refused(tmp_path, plant, kind,
                                                                     monkeypatch):
  """The window between ``os.stat`` and ``open``: the non-blocking open and the descriptor's
  ``fstat`` refuse what is there now."""
  path = plant(tmp_path / "file", kind)
  monkeypatch.setattr(workdir_files, "problem", lambda *args, **kwargs: None)
  _refused(ValueError, path, kind, workdir_files.read_text, path, error=ValueError)


def test_remove_never_opens_what_it_removes(tmp_path, plant):
  """``shutil.rmtree`` of a FIFO opens it (and waits for good): the supervised start's progress
  directory and a sweep's workdir go through ``workdir_files.remove``."""
  fifo = plant(tmp_path / "sft_progress", "fifo")
  _promptly(workdir_files.remove, fifo)
  outside = tmp_path / "outside.txt"
  outside.write_text("precious")
  (tmp_path / "link").symlink_to(outside)
  (tmp_path / "tree" / "inner").mkdir(parents=True)
  plant(tmp_path / "tree" / "inner" / "pipe", "fifo")
  for name in ("link", "tree"):
    _promptly(workdir_files.remove, tmp_path / name)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["outside.txt"]
  assert outside.read_text() == "precious"


# ---------------------------------------------------------------------------
# The workdir's own files: a WorkdirError (the command line's "error: ..." line).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_the_workdir_lock(tmp_path, plant, kind):
  lock = plant(tmp_path / checkpointing.WorkdirLock.NAME, kind)
  if kind in ("link_to_fifo", "device"):  # A link is never followed: replaced by a lock file.
    result, error = _promptly(checkpointing.WorkdirLock, tmp_path)
    assert error is None and not lock.is_symlink(), error
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    result.release()
    return
  message = _refused(workdir_files.WorkdirError, lock, kind, checkpointing.WorkdirLock, tmp_path)
  assert message.startswith(f"the workdir lock {lock}"), message
  assert sorted(p.name for p in tmp_path.iterdir()) == ["LOCK"]  # Nothing written.


@pytest.mark.parametrize("name", ["metrics.jsonl", "samples.jsonl"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_metrics_and_samples_logs(tmp_path, plant, kind, name):
  path = plant(tmp_path / name, kind)
  what = name.split(".")[0]
  message = _refused(workdir_files.WorkdirError, path, kind, metrics_writer.MetricsWriter,
                     tmp_path, tensorboard=False)
  assert message.startswith(f"{what} log {path}: "), message
  _refused(workdir_files.WorkdirError, path, kind, metrics_writer.read_metrics, path)


@pytest.mark.parametrize("kind", KINDS)
def test_the_wandb_run_id(tmp_path, plant, kind, monkeypatch):
  """Read before W&B starts (a stand-in module: nothing is sent)."""
  fake = types.SimpleNamespace(util=types.SimpleNamespace(generate_id=lambda: "new"),
                               init=lambda **kwargs: pytest.fail("W&B started"))
  monkeypatch.setitem(sys.modules, "wandb", fake)
  path = plant(tmp_path / "wandb_run_id", kind)
  wandb_log = metrics_writer._Wandb  # pylint: disable=protected-access
  _refused(workdir_files.WorkdirError, path, kind, wandb_log, epath.Path(tmp_path),
           {"project": "p"}, {})


@pytest.mark.parametrize("kind", KINDS)
def test_the_collapse_guards_events_file(tmp_path, plant, kind):
  path = plant(tmp_path / collapse.EVENTS_FILE, kind)
  _refused((ValueError, workdir_files.WorkdirError), path, kind, collapse.load_events,
           epath.Path(path))


@pytest.mark.parametrize("kind", KINDS)
def test_the_sweeps_result_and_the_planners_output(tmp_path, plant, kind):
  (tmp_path / "run").mkdir()
  result = plant(tmp_path / "run" / sweep._RESULT_FILE, kind)  # pylint: disable=protected-access
  _refused(workdir_files.WorkdirError, result, kind, sweep.finished_run, str(tmp_path / "run"))
  plan = plant(tmp_path / "plan.json", kind)
  message = _refused(ValueError, plan, kind, report.Store, str(plan), resume=True)
  assert message.startswith(f"--output {plan}: "), message


@pytest.mark.parametrize("kind", KINDS)
def test_spike_and_generation_files(tmp_path, plant, kind):
  spike = plant(tmp_path / "step_3.npz", kind)
  _refused(ValueError, spike, kind, spikes.read_spike, spike)
  shard = plant(tmp_path / "sudoku_m_32_16_0_generations.json", kind)
  check_finished = evaluate._check_finished  # pylint: disable=protected-access
  message = _refused(ValueError, shard, kind, check_finished, shard, {}, [])
  assert message.startswith(f"generation file {shard}: "), message
  _refused(ValueError, shard, kind, scoring.read_generation_file, shard)


# ---------------------------------------------------------------------------
# An orbax checkpoint: its step's files are checked by kind before orbax opens any.
# ---------------------------------------------------------------------------


def _state(value):
  return train_step.create_train_state({"w": jnp.full((4,), value)}, optax.adam(0.1), seed=0)


@pytest.mark.parametrize("kind", NOT_DIRECTORIES)
def test_a_fifo_among_a_checkpoints_files_is_damage_not_a_hang(tmp_path, plant, kind):
  """orbax and tensorstore open a FIFO planted in ``checkpoints/<step>/`` and wait for good (a
  resume hung): the newer step is set aside as damaged and the run resumes from the older one;
  with no older one, one line says why."""
  checkpointer = checkpointing.Checkpointer(tmp_path, async_save=False)
  for step in (1, 2):
    checkpointer.save(step, _state(float(step)), {"data": {}})
  checkpointer.close()
  metadata = tmp_path / "checkpoints" / "2" / "state" / "_METADATA"
  metadata.unlink()
  plant(metadata, kind)
  # Not closed on a failure: closing would wait on orbax's blocked read.
  checkpointer = checkpointing.Checkpointer(tmp_path, async_save=False)
  result, error = _promptly(checkpointing.restore_run, checkpointer, _state(0.0), None)
  assert error is None, error
  restored, _ = result
  assert float(restored.params["w"][0]) == 1.0 and checkpointer.all_steps() == [1]
  assert (tmp_path / checkpointing.DAMAGED_DIR / "2" / "state").is_dir()
  # The only step left damaged: one line naming the file and its kind, nothing moved.
  (tmp_path / "checkpoints" / "1" / "meta" / "metadata").unlink()
  plant(tmp_path / "checkpoints" / "1" / "meta" / "metadata", kind)
  message = _refused(ValueError, tmp_path / "checkpoints" / "1" / "meta" / "metadata", kind,
                     checkpointing.restore_run, checkpointer, _state(0.0), None)
  assert message.startswith(f"no checkpoint in {tmp_path / 'checkpoints'} can be restored"), (
      message)
  assert checkpointer.all_steps() == [1]
  checkpointer.close()


@pytest.mark.parametrize("kind", NOT_DIRECTORIES)
def test_a_fifo_as_a_steps_checkpoint_metadata_or_leftover_is_one_line(tmp_path, plant, kind):
  """What orbax reads as it opens the directory (each step's ``_CHECKPOINT_METADATA``), and a
  killed save's leftover ``<step>.orbax-checkpoint-tmp*`` (``shutil.rmtree`` opens its
  argument), are never opened either."""
  checkpointer = checkpointing.Checkpointer(tmp_path, async_save=False)
  checkpointer.save(1, _state(1.0), {"data": {}})
  checkpointer.close()
  metadata = tmp_path / "checkpoints" / "1" / "_CHECKPOINT_METADATA"
  metadata.unlink()
  plant(metadata, kind)
  for read_only in (True, False):
    _refused(workdir_files.WorkdirError, metadata, kind, checkpointing.Checkpointer, tmp_path,
             read_only=read_only)
  shutil.rmtree(tmp_path / "checkpoints" / "1")
  leftover = plant(tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp-7", kind)
  _, error = _promptly(lambda: checkpointing.Checkpointer(tmp_path).close())
  assert error is None and not os.path.lexists(leftover), error


# ---------------------------------------------------------------------------
# What a run reads: checkpoints, adapters, tokenizers, data (ValueErrors: the field is named).
# ---------------------------------------------------------------------------


def _hf_dir(path):
  os.makedirs(path)
  path = pathlib.Path(path)
  (path / hf_io.CONFIG_FILE).write_text(json.dumps(test_hf_io.HF_CONFIG))
  return path


@pytest.mark.parametrize("name", [hf_io.SINGLE_FILE, hf_io.CONFIG_FILE, hf_io.INDEX_FILE])
@pytest.mark.parametrize("kind", KINDS)
def test_a_hugging_face_checkpoint_or_the_supervised_start(tmp_path, plant, kind, name):
  """``sft_model`` and ``model.checkpoint`` alike (``models.from_pretrained``); the weights
  are opened by name by safetensors, so they are checked first."""
  directory = _hf_dir(tmp_path / "sft_model")
  if name == hf_io.CONFIG_FILE:
    (directory / name).unlink()
  path = plant(directory / name, kind)
  error_type = FileNotFoundError if name != hf_io.SINGLE_FILE else hf_io.CheckpointError
  _refused(error_type, path, kind, hf_io.from_pretrained, str(directory))


@pytest.mark.parametrize("kind", KINDS)
def test_a_lora_bases_weights_are_fingerprinted_only_as_regular_files(tmp_path, plant, kind):
  directory = _hf_dir(tmp_path / "base")
  path = plant(directory / hf_io.SINGLE_FILE, kind)
  _refused(ValueError, path, kind, lora_base.fingerprint_dir, str(directory))


@pytest.mark.parametrize("kind", NOT_DIRECTORIES)
def test_a_checkpoint_directory_that_is_not_one(tmp_path, plant, kind):
  path = plant(tmp_path / "sft_model", kind)
  _refused(input_files.InputError, path, kind, hf_io.from_pretrained, str(path))
  (tmp_path / "w").mkdir()
  checkpoints = plant(tmp_path / "w" / "checkpoints", kind)
  if kind == "fifo":
    message = _refused(workdir_files.WorkdirError, checkpoints, kind, checkpointing.Checkpointer,
                       tmp_path / "w")
    assert message == f"cannot write {checkpoints}: a FIFO is in the way of a directory", message
  else:  # A link in the workdir is never followed, whatever it points to.
    _, error = _promptly(checkpointing.Checkpointer, tmp_path / "w")
    assert isinstance(error, workdir_files.WorkdirError), repr(error)
    assert str(error).startswith(f"{checkpoints} is a symbolic link"), error


@pytest.mark.parametrize("name", [peft_io.WEIGHTS_FILE, peft_io.CONFIG_FILE])
@pytest.mark.parametrize("kind", KINDS)
def test_a_peft_adapter(tmp_path, plant, kind, name):
  directory = tmp_path / "adapter"
  directory.mkdir()
  if name == peft_io.WEIGHTS_FILE:
    (directory / peft_io.CONFIG_FILE).write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj"],
         "base_model_name_or_path": str(tmp_path / "base")}))
  path = plant(directory / name, kind)
  error_type = hf_io.CheckpointError if name == peft_io.WEIGHTS_FILE else FileNotFoundError
  message = _refused(error_type, path, kind, peft_io.load_adapter, None, str(directory))
  if name == peft_io.WEIGHTS_FILE:
    assert message.startswith(f"adapter weights {path}: "), message


@pytest.mark.parametrize("kind", KINDS)
def test_a_workdirs_config_and_an_exports_record(tmp_path, plant, kind):
  (tmp_path / "checkpoints").mkdir()
  config = plant(tmp_path / "config.json", kind)
  _refused(input_files.InputError, config, kind, checkpoint_source.training_config, tmp_path)
  record = plant(tmp_path / checkpoint_source.EXPORT_FILE, kind)
  _refused(input_files.InputError, record, kind, checkpoint_source.exported_config,
           str(tmp_path))


@pytest.mark.parametrize("kind", NOT_DIRECTORIES)
def test_a_tokenizer_file(tmp_path, plant, kind, monkeypatch):
  path = plant(tmp_path / "tokenizer.json", kind)
  load = lambda: tokenizers.HFTokenizer.from_file(path, mask_token="<m>", eos_token="<e>")
  _refused(FileNotFoundError, path, kind, load)  # input_files' check, as before.
  # Even past that check, the file is opened only as a regular file.
  monkeypatch.setattr(input_files, "problem", lambda *args, **kwargs: None)
  _refused(tokenizers.TokenizerError, path, kind, load)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
@pytest.mark.parametrize("kind", NOT_DIRECTORIES)
def test_a_data_file(tmp_path, plant, kind, suffix, monkeypatch):
  if suffix == ".parquet":
    pytest.importorskip("pyarrow")
  path = plant(tmp_path / f"train{suffix}", kind)
  _refused(input_files.InputError, path, kind, tasks.read_records, path)
  # Even past input_files' check, the file is opened only as a regular file.
  monkeypatch.setattr(input_files, "check", lambda *args, **kwargs: None)
  _refused(input_files.InputError, path, kind, tasks.read_records, path)


@pytest.mark.parametrize("kind", KINDS)
def test_a_config_file(tmp_path, plant, kind):
  path = plant(tmp_path / "mine.py", kind)
  message = _refused(ValueError, path, kind, cli_flags.check_config_flags, ["--config", str(path)])
  assert message.startswith(f"--config {path}: "), message


# ---------------------------------------------------------------------------
# The command lines, end to end: one line, exit 1, nothing left waiting.
# ---------------------------------------------------------------------------


def _cli(*args):
  return subprocess.run([sys.executable, "-m", *map(str, args)], capture_output=True, text=True,
                        timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))


def _error_line(out):
  lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
  assert out.returncode == 1 and len(lines) == 1 and "Traceback" not in out.stderr, (
      out.stderr[-3000:])
  return lines[0]


def test_train_with_a_fifo_as_its_lock_says_so_and_exits(tmp_path, plant):
  lock = plant(tmp_path / "LOCK", "fifo")
  line = _error_line(_cli("stabledrl_jax.train", "--config", "quickstart", "--workdir", tmp_path))
  assert line.startswith(f"error: the workdir lock {lock}: a FIFO, not a regular file"), line
  assert sorted(p.name for p in tmp_path.iterdir()) == ["LOCK"]


def test_evaluate_with_a_fifo_as_the_adapter_weights_says_so_and_exits(tmp_path, plant):
  """The base (the char tokenizer's ids, room for sudoku's prompts) is read; the adapter's
  weights, a FIFO, are refused before safetensors opens them."""
  hf = dict(test_hf_io.HF_CONFIG, mask_token_id=1, eos_token_id=2, pad_token_id=0,
            vocab_size=101, max_sequence_length=1024)
  base = test_hf_io.write_checkpoint(str(tmp_path / "base"), test_hf_io.random_tensors(hf), hf)
  adapter = tmp_path / "adapter"
  adapter.mkdir()
  (adapter / peft_io.CONFIG_FILE).write_text(json.dumps(
      {"peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj"],
       "base_model_name_or_path": base}))
  weights = plant(adapter / peft_io.WEIGHTS_FILE, "link_to_fifo")
  line = _error_line(_cli("stabledrl_jax.evaluate", "--checkpoint", adapter, "--task", "sudoku",
                          "--data", "sudoku=synthetic", "--limit", 2, "--tokenizer", "char",
                          "--gen_lengths", 32, "--output_dir", tmp_path / "out"))
  assert line.startswith(f"error: adapter weights {weights}: a FIFO, not a regular file (a "
                         "symbolic link to "), line
