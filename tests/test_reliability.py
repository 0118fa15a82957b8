"""Faults a user can cause, and what happens (docs/reliability.md has the table): poisoned
updates, torn metrics, resumes of another run, a second trainer, damaged checkpoints, bad files
for the scoring CLI and the loaders."""

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import save_file

from stabledrl_jax import models, objectives, scoring
from stabledrl_jax.training.config import run_spec, specs
from stabledrl_jax.training.loop import metrics_writer, run_build, trainer
from stabledrl_jax.training.state import checkpointing, supervised
from stabledrl_jax.training.step import build

from test_training import _toy_update, tiny_config


def _quick(**updates):
  """One or two RL steps from random weights (no supervised start), a checkpoint each step."""
  return tiny_config(**{"sft.num_steps": 0, "train.num_steps": 2, "train.num_iterations": 1,
                        **updates})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A finished two-step run (checkpoints 1 and 2), copied by each test that changes it."""
  workdir = tmp_path_factory.mktemp("run")
  trainer.train(_quick(), str(workdir))
  return workdir


def _copy(run, tmp_path):
  target = tmp_path / "run"
  shutil.copytree(run, target)
  return target


# ---------------------------------------------------------------------------
# 1. No poisoned state.
# ---------------------------------------------------------------------------


def test_an_update_with_non_finite_parameters_is_skipped():
  """An infinite learning rate: finite loss and gradient, non-finite update -> not kept."""
  state, new_state, metrics = _toy_update(jnp.array([1.0, -1.0, 0.5, -0.5]),
                                          tx=optax.adamw(jnp.inf))
  assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
  assert not np.isfinite(float(metrics["update_norm"]))
  assert int(metrics["skipped"]) == 1 and int(new_state.consecutive_skips) == 1
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(new_state.params)):
    np.testing.assert_array_equal(a, b)
  assert not checkpointing.nonfinite_leaves(new_state)


@pytest.mark.parametrize("field,value", [
    ("optimizer.learning_rate", float("inf")), ("optimizer.learning_rate", 1e30),
    ("optimizer.learning_rate", float("nan")), ("optimizer.learning_rate", 0.0),
    ("sft.learning_rate", -1.0), ("optimizer.weight_decay", float("nan")),
    ("rollout.group_size", 1), ("eval.batch_size", 0), ("data.train_size", 0),
    ("data.train_size", 1),  # fewer than one batch of prompts (2)
])
def test_values_that_poison_or_void_a_run_name_their_field(field, value):
  with pytest.raises(ValueError, match=rf"^config\.{field.replace('.', r'[.]')}: "):
    specs.validate(tiny_config(**{field: value}))


@objectives.register_objective("nan_test", estimator=dict(method="elbo"))
def _nan_objective(inputs, hparams, group_size):
  del hparams, group_size
  return jnp.nan * jnp.mean(inputs.logp), {}


def test_too_many_skips_says_that_no_checkpoint_exists(tmp_path):
  config = _quick(**{"objective.name": "nan_test", "train.max_consecutive_skips": 1})
  with pytest.raises(trainer.TooManySkipsError, match="No checkpoint was written"):
    trainer.train(config, str(tmp_path))
  assert checkpointing.Checkpointer(tmp_path, read_only=True).all_steps() == []


# ---------------------------------------------------------------------------
# 3. History is append-only.
# ---------------------------------------------------------------------------


def _metrics_file(tmp_path, lines):
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(lines))
  return path


def test_a_cut_metrics_line_is_skipped_and_never_hides_what_follows(tmp_path):
  lines = [json.dumps({"step": i, "loss": float(i)}) + "\n" for i in range(1, 6)]
  lines[2] = lines[2][:9] + "\n"  # Step 3 cut in the middle.
  path = _metrics_file(tmp_path, lines)
  assert [r["step"] for r in metrics_writer.read_metrics(path)] == [1, 2, 4, 5]
  writer = metrics_writer.MetricsWriter(tmp_path, resume_step=4, tensorboard=False)
  writer.write(5, {"loss": 50.0})
  writer.close()
  records = metrics_writer.read_metrics(path)
  assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (2, 2.0), (4, 4.0), (5, 50.0)]


def test_a_torn_last_line_is_dropped_and_the_rest_kept(tmp_path):
  lines = [json.dumps({"step": i}) + "\n" for i in range(1, 4)] + ['{"step": 4, "lo']
  path = _metrics_file(tmp_path, lines)
  writer = metrics_writer.MetricsWriter(tmp_path, resume_step=3, tensorboard=False)
  writer.write(4, {"loss": 4.0})
  writer.close()
  assert [r["step"] for r in metrics_writer.read_metrics(path)] == [1, 2, 3, 4]


# ---------------------------------------------------------------------------
# 4. Resume checks before anything is written; one trainer per workdir.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("model.overrides.d_model", 48), ("objective.name", "spg"),
    ("tokenizer.alphabet", " /0123456789:<>Sadeklnoprsuwzx"),  # The quickstart's, plus 'x'.
])
def test_a_resume_with_another_run_config_fails_and_writes_nothing(run, tmp_path, field, value):
  workdir = _copy(run, tmp_path)
  before = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file() and p.name != "LOCK"}
  with pytest.raises(ValueError, match=rf"config does not match .*{field.split('.')[0]}.*"
                                       r"start a new --workdir"):
    trainer.train(_quick(**{field: value, "train.num_steps": 3}), str(workdir))
  after = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
  assert after == before  # config.json, metrics and checkpoints untouched; no lock left.


def test_a_second_trainer_on_a_workdir_is_refused_and_a_stale_lock_taken_over(run, tmp_path):
  workdir = _copy(run, tmp_path)
  lock = workdir / checkpointing.WorkdirLock.NAME
  owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": owner.pid,
                                "started": time.time()}))
    with pytest.raises(RuntimeError, match=rf"in use by process {owner.pid}"):
      trainer.train(_quick(**{"train.num_steps": 3}), str(workdir))
    assert json.loads(lock.read_text())["pid"] == owner.pid  # The owner's lock stays.
  finally:
    owner.kill()
    owner.wait()
  # The owner died without removing its lock: taken over.
  history = trainer.train(_quick(**{"train.num_steps": 3}), str(workdir))
  assert [h["step"] for h in history] == [3] and not lock.exists()
  # Another host's fresh lock is live; an hour-old one is stale.
  lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": 0}))
  with pytest.raises(RuntimeError, match="on host 'elsewhere'"):
    checkpointing.WorkdirLock(workdir)
  os.utime(lock, (time.time() - 7200, time.time() - 7200))
  checkpointing.WorkdirLock(workdir).release()


# ---------------------------------------------------------------------------
# 5. Damaged checkpoints.
# ---------------------------------------------------------------------------


def _damaged_then_resumed(workdir):
  history = trainer.train(_quick(**{"train.num_steps": 3}), str(workdir))
  assert [h["step"] for h in history] == [2, 3]  # Resumed from step 1.
  assert (workdir / checkpointing.DAMAGED_DIR / "2").is_dir()
  assert checkpointing.Checkpointer(workdir, read_only=True).all_steps()[-1] == 3


def test_a_truncated_latest_checkpoint_falls_back_to_the_previous_one(run, tmp_path, capsys):
  workdir = _copy(run, tmp_path)
  state_dir = workdir / "checkpoints" / "2" / "state"
  files = sorted((p for p in state_dir.rglob("*") if p.is_file() and p.stat().st_size > 64),
                 key=lambda p: -p.stat().st_size)
  for path in files:  # Every data file cut to half: the save a full disk would leave.
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
  _damaged_then_resumed(workdir)
  assert "checkpoint step 2 is damaged" in capsys.readouterr().err


def test_a_checkpoint_missing_an_item_falls_back(run, tmp_path):
  workdir = _copy(run, tmp_path)
  shutil.rmtree(workdir / "checkpoints" / "2" / "meta")
  _damaged_then_resumed(workdir)


def test_non_finite_parameters_in_a_checkpoint_fall_back_naming_them(run, tmp_path, capsys):
  """Step 2 rewritten with one parameter NaN (as bit rot or a bad save could leave it)."""
  workdir = _copy(run, tmp_path)
  _, abstract, _, _ = build.abstract_update(_quick())
  checkpointer = checkpointing.Checkpointer(workdir, async_save=False)
  state, meta = checkpointer.restore(2, abstract)
  shutil.rmtree(workdir / "checkpoints" / "2")
  checkpointer.close()
  checkpointer = checkpointing.Checkpointer(workdir, async_save=False)
  leaves, treedef = jax.tree.flatten(state.params)
  leaves[0] = jnp.full_like(leaves[0], jnp.nan)
  checkpointer.save(2, state.replace(params=jax.tree.unflatten(treedef, leaves)), meta)
  checkpointer.close()
  _damaged_then_resumed(workdir)
  assert "parameters are not finite" in capsys.readouterr().err


def test_damaged_safetensors_name_the_file_and_tensor(tmp_path):
  config = models.get_config("tiny", n_layers=1)
  models.save_pretrained(models.init_model(config), str(tmp_path / "ok"))
  cut = tmp_path / "cut"
  shutil.copytree(tmp_path / "ok", cut)
  data = (cut / "model.safetensors").read_bytes()
  (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
  with pytest.raises(models.CheckpointError, match=r"model\.safetensors"):
    models.from_pretrained(str(cut))
  nan = tmp_path / "nan"
  shutil.copytree(tmp_path / "ok", nan)
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  tensors = load_file(str(nan / "model.safetensors"))
  name = "model.transformer.ln_f.weight"
  tensors[name] = np.full_like(tensors[name], np.nan)
  save_file(tensors, str(nan / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(models.CheckpointError, match=rf"{name}.*model\.safetensors.*non-finite"):
    models.from_pretrained(str(nan))


# ---------------------------------------------------------------------------
# 6. Clear errors.
# ---------------------------------------------------------------------------


def _generations(path, payload):
  path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
  return path


def test_the_scoring_cli_skips_and_names_bad_files(tmp_path, capsys):
  good = {"generations": [{"question": "q", "generations": "<answer>6</answer>",
                           "ground_truth": 6}]}
  _generations(tmp_path / "countdown_m_8_4_0_generations.json", good)
  bad = {
      "countdown_m_8_4_1_generations.json": [1, 2, 3],
      "countdown_m_8_4_2_generations.json": {"generations": 5},
      "countdown_m_8_4_3_generations.json": "{not json",
      "countdown_m_8_4_4_generations.json": {"generations": [{"generations": ["a", "b"]}]},
      "chess_m_8_4_0_generations.json": good,
  }
  for name, payload in bad.items():
    _generations(tmp_path / name, payload)
  assert scoring.main([str(tmp_path)]) == 0
  out = capsys.readouterr()
  assert "countdown_m_8_4" in out.out and "chess" not in out.out
  for name in bad:
    assert f"skipped {tmp_path / name}" in out.err, name
  assert "Unknown task 'chess'" in out.err
  with pytest.raises(SystemExit):
    scoring.main([str(tmp_path / "countdown_m_8_4_2_generations.json")])
  assert "countdown_m_8_4_2_generations.json" in capsys.readouterr().err


def test_a_config_error_is_one_line_without_a_traceback(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "stabledrl_jax.train", "--config", "quickstart", "--workdir",
       str(tmp_path), "--config.rollout.group_size=1"], capture_output=True, text=True,
      timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 1
  assert "error: config.rollout.group_size: 1" in out.stderr and "Traceback" not in out.stderr
  assert not (tmp_path / "config.json").exists()


def test_evaluate_checks_its_output_directory_before_decoding(run, tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  out = subprocess.run(
      [sys.executable, "-m", "stabledrl_jax.evaluate", "--checkpoint", str(run), "--task",
       "sudoku", "--output_dir", str(blocker / "out")], capture_output=True, text=True,
      timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 1 and "--output_dir" in out.stderr and "not writable" in out.stderr


# ---------------------------------------------------------------------------
# 7. Files in the workdir: never followed out of it, never half-written, every failed write
#    one line naming its file; a run that trained nothing says so.
# ---------------------------------------------------------------------------


def test_a_symlinked_lock_is_replaced_and_what_it_points_to_left_alone(tmp_path):
  outside = tmp_path / "outside.txt"
  outside.write_text("precious")
  workdir = tmp_path / "workdir"
  workdir.mkdir()
  lock_path = workdir / checkpointing.WorkdirLock.NAME
  lock_path.symlink_to(outside)
  lock = checkpointing.WorkdirLock(workdir)
  assert not lock_path.is_symlink() and json.loads(lock_path.read_text())["pid"] == os.getpid()
  lock.touch()
  lock.release()
  assert not lock_path.exists() and outside.read_text() == "precious"
  # A link to a live owner's lock elsewhere is not that owner's lock either: never read.
  outside.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(),
                                 "started": 0}))
  lock_path.symlink_to(outside)
  checkpointing.WorkdirLock(workdir).release()
  assert json.loads(outside.read_text())["pid"] == os.getppid()
  assert sorted(p.name for p in workdir.iterdir()) == []  # No staging file left.


def _train_cli(workdir, *flags):
  return subprocess.run(
      [sys.executable, "-m", "stabledrl_jax.train", "--config", "quickstart", "--workdir",
       str(workdir), *flags], capture_output=True, text=True, timeout=300,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_a_lock_that_is_a_directory_is_one_line_naming_it(tmp_path):
  (tmp_path / checkpointing.WorkdirLock.NAME).mkdir()
  out = _train_cli(tmp_path)
  assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
  lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
  assert len(lines) == 1 and f"{tmp_path / 'LOCK'} is a directory" in lines[0], out.stderr
  assert (tmp_path / "LOCK").is_dir() and not (tmp_path / "config.json").exists()


def test_a_read_only_workdir_names_the_file(tmp_path, monkeypatch):
  """As a read-only mount answers (the tests may run as root, whom chmod does not stop)."""
  import errno  # pylint: disable=g-import-not-at-top
  real_open = os.open

  def read_only(path, flags, *args, **kwargs):
    if str(path).startswith(str(tmp_path)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
      raise PermissionError(errno.EROFS, "Read-only file system", str(path))
    return real_open(path, flags, *args, **kwargs)

  monkeypatch.setattr(os, "open", read_only)
  with pytest.raises(checkpointing.WorkdirError,
                     match=rf"^cannot write {tmp_path / 'LOCK'}: Read-only file system$"):
    trainer.Trainer(_quick(), str(tmp_path))
  assert list(tmp_path.iterdir()) == []


def _full_disk_after(monkeypatch, cls, name, where):
  """``cls.name`` (a write) writes half of what it is given under ``where``, then fails as a
  full disk does."""
  import errno  # pylint: disable=g-import-not-at-top
  real = getattr(cls, name)

  def full(self, data, *args, **kwargs):
    if str(where) in str(self):
      real(self, data[: len(data) // 2], *args, **kwargs)
      raise OSError(errno.ENOSPC, "No space left on device")
    return real(self, data, *args, **kwargs)

  monkeypatch.setattr(cls, name, full)


def test_a_full_disk_while_the_supervised_start_is_written_leaves_no_half_start(tmp_path,
                                                                                 monkeypatch):
  from stabledrl_jax.models import hf_io  # pylint: disable=g-import-not-at-top
  real_save = hf_io.save_file

  def full(tensors, path, **kwargs):  # Half a file, then the disk is full.
    real_save(dict(list(tensors.items())[: len(tensors) // 2]), path, **kwargs)
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(hf_io, "save_file", full)
  config = tiny_config(**{"sft.num_steps": 2, "train.num_steps": 0})
  with pytest.raises(checkpointing.WorkdirError,
                     match=rf"^cannot write {tmp_path / supervised.SFT_DIR}/model.safetensors: no "
                           "space left"):
    trainer.train(config, str(tmp_path))
  # Nothing staged is left (the start was staged inside the workdir, beside sft_model), and the
  # empty directories this start made are removed.
  assert sorted(p.name for p in tmp_path.iterdir()) == []
  monkeypatch.undo()  # Space again: the rerun fits and writes the start.
  trainer.train(config, str(tmp_path))
  assert (tmp_path / supervised.SFT_DIR / "config.json").exists()
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      "checkpoints", "config.json", "metrics.jsonl", "samples.jsonl", supervised.SFT_DIR,
      "tensorboard"]


def test_a_full_disk_while_a_checkpoint_is_written_names_it(tmp_path, monkeypatch):
  from etils import epath  # pylint: disable=g-import-not-at-top
  _full_disk_after(monkeypatch, type(epath.Path(tmp_path)), "write_text",
                   tmp_path / checkpointing.CHECKPOINT_DIR)
  with pytest.raises(checkpointing.WorkdirError,
                     match=rf"^cannot write {tmp_path / checkpointing.CHECKPOINT_DIR}\S*: no "
                           "space left"):
    trainer.train(_quick(), str(tmp_path))
  assert not (tmp_path / checkpointing.WorkdirLock.NAME).exists()
  assert checkpointing.Checkpointer(tmp_path, read_only=True).all_steps() == []
  # No orbax temporary directory is left behind.
  assert list((tmp_path / checkpointing.CHECKPOINT_DIR).iterdir()) == []


def test_a_failed_saves_late_writes_are_removed_when_the_checkpointer_closes(tmp_path,
                                                                             monkeypatch):
  """orbax writes a save's items in several threads: when one fails, another may still write
  into ``<step>.orbax-checkpoint-tmp*`` after the failure is raised, so what it leaves goes at
  ``close`` (CI once found such a directory after the full-disk test above)."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  directory = tmp_path / checkpointing.CHECKPOINT_DIR
  _full_disk_after(monkeypatch, type(epath.Path(tmp_path)), "write_text", directory)
  checkpointer = checkpointing.Checkpointer(str(tmp_path))
  with pytest.raises(checkpointing.WorkdirError, match="no space left"):
    checkpointer.save(1, {"w": jnp.ones(3)}, {"step": 1})
    checkpointer.wait()
  late = directory / "1.orbax-checkpoint-tmp-42" / "state"
  late.mkdir(parents=True)  # What a thread still running wrote after the failure was raised.
  checkpointer.close()
  assert list(directory.iterdir()) == []


def test_a_failed_save_whose_other_threads_write_late_leaves_nothing_after_close(tmp_path,
                                                                               monkeypatch):
  """The race CI once hit (``1.orbax-checkpoint-tmp`` found after ``close``): the checkpoint
  metadata's write fails while an executor thread of the save (``asyncio_N``, which the
  manager's close does not wait for) still has a write to make, 1 s later, creating its
  directories again as tensorstore does. ``close`` waits for that thread before it removes the
  staging directory, so nothing comes back after it."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  directory = tmp_path / checkpointing.CHECKPOINT_DIR
  cls = type(epath.Path(tmp_path))
  real = cls.write_text
  late = []

  def late_write():
    time.sleep(1.0)
    target = directory / "1.orbax-checkpoint-tmp" / "state.orbax-checkpoint-tmp" / "ocdbt"
    target.mkdir(parents=True, exist_ok=True)
    (target / "manifest").write_bytes(b"late")

  def write_text(self, data, *args, **kwargs):
    if str(directory) in str(self) and self.name == "_CHECKPOINT_METADATA":
      if not late:
        late.append(threading.Thread(target=late_write, name="asyncio_99"))
        late[0].start()
      raise OSError(errno.ENOSPC, "No space left on device")
    return real(self, data, *args, **kwargs)

  monkeypatch.setattr(cls, "write_text", write_text)
  checkpointer = checkpointing.Checkpointer(str(tmp_path))
  with pytest.raises(checkpointing.WorkdirError, match="no space left"):
    checkpointer.save(1, {"w": jnp.ones(3)}, {"step": 1})
    checkpointer.wait()
  checkpointer.close()
  assert late and not late[0].is_alive()  # close waited for it
  assert list(directory.iterdir()) == []


def test_a_run_whose_every_step_skipped_fails_under_max_consecutive_skips(tmp_path):
  """Every update non-finite, fewer in a row than the limit: no checkpoint, an error."""
  config = _quick(**{"objective.name": "nan_test", "train.max_consecutive_skips": 100})
  with pytest.raises(trainer.TooManySkipsError,
                     match=r"all 2 steps of this run skipped every update.*No checkpoint"):
    trainer.train(config, str(tmp_path))
  assert checkpointing.Checkpointer(tmp_path, read_only=True).all_steps() == []
  assert not (tmp_path / checkpointing.WorkdirLock.NAME).exists()


@pytest.mark.slow
def test_two_damaged_checkpoints_in_a_row_fall_back_without_orbax_noise(run, tmp_path):
  """Step 3 truncated, step 2 missing an item: both set aside, one line each, the run resumes
  from step 1, and stderr has no orbax noise (asyncio's 'Event loop is closed')."""
  workdir = _copy(run, tmp_path)
  trainer.train(_quick(**{"train.num_steps": 3, "checkpoint.max_to_keep": 3}), str(workdir))
  assert checkpointing.Checkpointer(workdir, read_only=True).all_steps() == [1, 2, 3]
  for path in (workdir / "checkpoints" / "3" / "state").rglob("*"):
    if path.is_file() and path.stat().st_size > 64:
      path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
  shutil.rmtree(workdir / "checkpoints" / "2" / "meta")
  out = _train_cli(workdir, "--config.sft.num_steps=0", "--config.train.num_steps=4",
                   "--config.train.num_iterations=1", "--config.data.train_size=64",
                   "--config.data.eval_size=8", "--config.rollout.num_prompts=2",
                   "--config.rollout.group_size=4", "--config.rollout.steps=10",
                   "--config.eval.every_steps=0", "--config.checkpoint.every_steps=1",
                   "--config.checkpoint.max_to_keep=3")
  assert out.returncode == 0, out.stderr[-3000:]
  warnings = [line for line in out.stderr.splitlines() if line.startswith("warning:")]
  assert [w.split(" is damaged")[0] for w in warnings] == [
      "warning: checkpoint step 3", "warning: checkpoint step 2"], out.stderr[-3000:]
  assert all(w.endswith("resuming from step 1") for w in warnings), warnings
  assert "Event loop is closed" not in out.stderr and "Traceback" not in out.stderr
  assert sorted(p.name for p in (workdir / checkpointing.DAMAGED_DIR).iterdir()) == ["2", "3"]
  assert [r["step"] for r in metrics_writer.read_metrics(workdir / "metrics.jsonl")][-3:] == [
      2, 3, 4]


# ---------------------------------------------------------------------------
# The scoring CLI never stops on one file (issue #27).
# ---------------------------------------------------------------------------


def _hostile_generation_files(directory):
  """A good countdown file and, named like generation files, every kind of bad one.

  Returns (the good file's setup, {path: a phrase its skip reason must hold}).
  """
  record = {"question": "q", "generations": "\\boxed{2 * 3}", "ground_truth": [[2, 3], 6]}
  _generations(directory / "countdown_m_8_4_0_generations.json", {"generations": [record]})
  _generations(directory / "countdown_m_8_4_1_generations.json",
               {"generations": [dict(record, generations="\\boxed{2 + 3}")]})
  bad = {}
  deep = directory / "countdown_m_8_4_2_generations.json"
  _generations(deep, '{"generations": ' + "[" * 100_000 + "]" * 100_000 + "}")
  bad[deep] = "nested too deeply"
  wrong_type = directory / "countdown_m_8_4_3_generations.json"
  _generations(wrong_type, {"generations": [dict(record, question=7)]})
  bad[wrong_type] = "generations[0].question is an int, not text"
  unscorable = directory / "countdown_m_8_4_4_generations.json"
  _generations(unscorable, {"generations": [record, dict(record, ground_truth=[["a"], "b"])]})
  bad[unscorable] = "generations[1] cannot be scored as countdown"
  fifo = directory / "countdown_m_8_4_5_generations.json"
  os.mkfifo(fifo)
  bad[fifo] = "a FIFO, not a regular file"
  device = directory / "countdown_m_8_4_6_generations.json"
  device.symlink_to("/dev/null")
  bad[device] = "a character device, not a regular file"
  folder = directory / "countdown_m_8_4_7_generations.json"
  folder.mkdir()
  bad[folder] = "a directory, not a regular file"
  dangling = directory / "countdown_m_8_4_8_generations.json"
  dangling.symlink_to(directory / "nowhere")
  bad[dangling] = "does not exist (a symbolic link to "
  binary = directory / "countdown_m_8_4_9_generations.json"
  binary.write_bytes(b"\xff\xfe\x00{")
  bad[binary] = "not UTF-8"
  return "countdown_m_8_4", bad


def _scoring_cli(*args, timeout=120):
  """The CLI in a subprocess: a read that blocks (a FIFO) fails the test instead of hanging it."""
  return subprocess.run([sys.executable, "-m", "stabledrl_jax.scoring", *map(str, args)],
                        capture_output=True, text=True, timeout=timeout,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_the_scoring_cli_scores_every_good_file_past_hostile_ones(tmp_path):
  setup, bad = _hostile_generation_files(tmp_path)
  output = tmp_path / "results.json"
  out = _scoring_cli(tmp_path, "--output", output)
  assert out.returncode == 0, out.stderr
  assert "Traceback" not in out.stderr
  # Both good shards pooled: one right, one wrong.
  assert json.loads(output.read_text()) == {setup: {"accuracy": 50.0, "n": 2}}
  lines = out.stderr.splitlines()
  for path, reason in bad.items():
    named = [line for line in lines if line.startswith(f"skipped {path}: ")]
    assert len(named) == 1 and reason in named[0], (path, out.stderr)
  assert f"skipped {len(bad)} paths; scored 2 items of 1 setup" in out.stderr


def test_the_scoring_cli_never_opens_a_fifo_named_on_the_command_line(tmp_path):
  fifo = tmp_path / "gsm8k_m_8_4_0_generations.json"
  os.mkfifo(fifo)
  good = _generations(tmp_path / "gsm8k_m_8_4_1_generations.json", {"generations": [
      {"question": "q", "generations": "\\boxed{18}", "ground_truth": 18.0}]})
  (tmp_path / "results.txt").write_text("not a generation file")
  out = _scoring_cli(fifo, good, tmp_path / "missing_0_generations.json",
                     tmp_path / "results.txt")
  assert out.returncode == 0, out.stderr
  assert f"skipped {fifo}: a FIFO, not a regular file" in out.stderr
  assert f"skipped {tmp_path / 'missing_0_generations.json'}: no such file" in out.stderr
  assert f"skipped {tmp_path / 'results.txt'}: not named TASK_" in out.stderr
  assert "gsm8k_m_8_4" in out.stdout and "100.00" in out.stdout
  # Nothing scorable at all: one line naming the FIFO, exit status 2 (argparse's).
  alone = _scoring_cli(fifo)
  assert alone.returncode == 2 and "Traceback" not in alone.stderr
  assert f"skipped {fifo}: a FIFO" in alone.stderr and "no scorable" in alone.stderr


def test_an_unreadable_generation_file_is_skipped_and_named(tmp_path, monkeypatch, capsys):
  """Permission denied (simulated: the suite may run as root, which reads any file)."""
  _generations(tmp_path / "gsm8k_m_8_4_0_generations.json", {"generations": [
      {"question": "q", "generations": "\\boxed{18}", "ground_truth": 18.0}]})
  locked = _generations(tmp_path / "gsm8k_m_8_4_1_generations.json", {"generations": []})
  real_open = os.open

  def guarded_open(path, flags, *args, **kwargs):
    if os.fspath(path) == str(locked):
      raise PermissionError(13, "Permission denied", str(path))
    return real_open(path, flags, *args, **kwargs)

  monkeypatch.setattr(os, "open", guarded_open)
  assert scoring.main([str(tmp_path)]) == 0
  out = capsys.readouterr()
  assert f"skipped {locked}: cannot be read (Permission denied)" in out.err
  assert "skipped 1 path; scored 1 items of 1 setup" in out.err and "100.00" in out.out


def test_orbax_closed_loop_noise_is_dropped_and_nothing_else(tmp_path, monkeypatch):
  """The unraisable "Event loop is closed" of a callback that reaches a closed loop (what the
  futures of a failed orbax save or restore leave behind) is not printed; other unraisable
  errors still are."""
  import asyncio  # pylint: disable=g-import-not-at-top
  import gc  # pylint: disable=g-import-not-at-top
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)
  checkpointing.Checkpointer(tmp_path, read_only=True).close()  # Installs the filter.
  loop = asyncio.new_event_loop()
  loop.close()

  class Late:
    def __init__(self, action):
      self.action = action

    def __del__(self):
      self.action()

  def other():
    raise RuntimeError("something else")

  Late(lambda: loop.call_soon_threadsafe(print))
  gc.collect()
  assert seen == []
  Late(other)
  gc.collect()
  assert [str(u.exc_value) for u in seen] == ["something else"]


# ---------------------------------------------------------------------------
# The collapse guard (train.collapse_guard; training/loop/collapse.py).
# ---------------------------------------------------------------------------


def test_the_collapse_rule_is_the_studys():
  from stabledrl_jax.training.loop import collapse  # pylint: disable=g-import-not-at-top
  rules = run_spec.Rules(eval_margin=2.0, reward_margin=0.02, window=2, max_skipped=3)
  rising_then_falling = [{"step": 0, "eval/accuracy": 10.0}] + [
      {"step": s, "rewards/correctness": 0.5, "skipped_steps": 0} for s in range(1, 6)] + [
      {"step": 2, "eval/accuracy": 13.0}, {"step": 4, "eval/accuracy": 7.5}]
  assert collapse.first_collapse(rising_then_falling, rules)["step"] == 4
  never_rose = [{"step": 0, "eval/accuracy": 10.0}, {"step": 2, "eval/accuracy": 5.0}]
  assert collapse.first_collapse(never_rose, rules) is None  # Degraded, not collapsed.
  skips = [{"step": s, "rewards/correctness": 0.5, "skipped_steps": s // 2} for s in range(8)]
  assert collapse.first_collapse(skips, rules)["step"] == 6  # The third skipped update.
  reward = [{"step": s, "rewards/correctness": r} for s, r in
            enumerate([0.1, 0.1, 0.2, 0.2, 0.05, 0.05], start=1)]
  assert "reward" in collapse.first_collapse(reward, rules)["why"]
  # The earliest sign, whichever rule gives it: the reward falls at step 6, the eval at step 7
  # (as in ESPO's seed-0 run at mu = 4, docs/reliability.md, which the guard caught at the
  # reward's step while the whole trajectory's eval rule fires later).
  both = reward + [{"step": 0, "eval/accuracy": 10.0}, {"step": 3, "eval/accuracy": 13.0},
                   {"step": 7, "eval/accuracy": 7.0}]
  assert collapse.first_collapse(both, rules) == {
      "step": 6, "why": "reward 0.050 < first 0.100 after rising"}
  late = [dict(r, step=r["step"] + 10) if "rewards/correctness" in r else r for r in both]
  assert collapse.first_collapse(late, rules)["step"] == 7  # The eval's step, now the earlier.
  # A step run again after a restore replaces the first; the guard's own records are not steps.
  trajectory = collapse.Trajectory([{"step": 1, "eval/accuracy": 1.0}, {"step": 2, "x": 1},
                                    {"step": 2, "collapse_guard/lr_scale": 0.5},
                                    {"step": 2, "x": 2}, {"step": 3, "x": 3}], upto=2)
  assert trajectory.records() == [{"step": 1, "eval/accuracy": 1.0}, {"step": 2, "x": 2}]
  from stabledrl_jax.training.config import config_lib  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.loop import sweep
  for field, value, says in (("action", "pause", "action: 'pause' is not one of"),
                             ("lr_factor", 0.0, "lr_factor"), ("window", 0, "window")):
    config = sweep.with_overrides(config_lib.get("quickstart"),
                                  {f"train.collapse_guard.{field}": value})
    with pytest.raises(ValueError, match=f"^config.train.collapse_guard.{says}"):
      specs.validate(config)


def test_the_collapse_guard_restores_the_best_eval_at_a_lower_learning_rate_then_stops(tmp_path):
  """A rule that fires on any run (a one-step reward window, no margin: the second reward is
  'below the first after rising'): the guard restores the best eval's state (the start's),
  halves the learning rate, runs the steps again from there (the first rerun step is the first
  run's: the same parameters, key and data), records the event, and once its restores are spent
  stops the run normally; the metrics continue the same file."""
  from stabledrl_jax.training.loop import collapse  # pylint: disable=g-import-not-at-top
  config = _quick(**{"train.num_steps": 4, "eval.every_steps": 1,
                     "train.collapse_guard.enabled": True, "train.collapse_guard.window": 1,
                     "train.collapse_guard.reward_margin": 0.0,
                     "train.collapse_guard.max_restores": 1})
  history = trainer.train(config, str(tmp_path))
  assert [h["step"] for h in history] == [1, 2, 1, 2]
  first, rerun = history[0], history[2]
  assert rerun["rewards/mean"] == first["rewards/mean"]  # The state and data of step 0 again.
  assert rerun["learning_rate"] == pytest.approx(0.5 * first["learning_rate"])
  saved = json.loads((tmp_path / collapse.EVENTS_FILE).read_text())
  assert saved["lr_scale"] == 0.5
  assert [e["action"] for e in saved["events"]] == ["restore", "stop"]
  assert saved["events"][0]["restored_step"] == 0 and saved["events"][0]["step"] == 1
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if "rewards/mean" in r] == [1, 2, 1, 2]
  assert [r["collapse_guard/restored_to"] for r in records
          if "collapse_guard/restored_to" in r] == [0, -1]
  # The run stopped at step 2 (saved, the stop in its meta): a rerun says so in one line and
  # trains nothing; told to go on, it trains on with the scale and the events read back.
  more = sweep_overrides(config, {"train.num_steps": 5})
  before = (tmp_path / "metrics.jsonl").read_text()
  again = trainer.Trainer(more, str(tmp_path))
  assert again.stopped.startswith("the collapse guard stopped this run after step 2 (reward")
  assert "\n" not in again.stopped and "collapse_guard.go_on=True" in again.stopped
  assert again.run() == [] and (tmp_path / "metrics.jsonl").read_text() == before
  resumed = trainer.Trainer(sweep_overrides(more, {"train.collapse_guard.go_on": True}),
                            str(tmp_path))
  try:
    assert resumed.start_step == 2 and resumed.guard.lr_scale == 0.5
    assert [e["action"] for e in resumed.guard.events] == ["restore", "stop", "go_on"]
    assert float(resumed.parts.optimizer.lr_schedule(0)) == pytest.approx(
        0.5 * float(more.optimizer.learning_rate))
    assert resumed.guard.trajectory.records() == []  # The rules judge the run from step 2 on.
  finally:
    resumed.close()
  assert [e["action"] for e in json.loads((tmp_path / collapse.EVENTS_FILE).read_text())[
      "events"]] == ["restore", "stop", "go_on"]
  (tmp_path / collapse.EVENTS_FILE).write_text("{not json")
  with pytest.raises(ValueError, match="is not the collapse guard's events file"):
    trainer.Trainer(more, str(tmp_path))


_GUARDED = {"train.num_steps": 4, "eval.every_steps": 1, "train.collapse_guard.enabled": True,
            "train.collapse_guard.window": 1, "train.collapse_guard.reward_margin": 0.0,
            "train.collapse_guard.max_restores": 2}

_GUARDED_RUN = """
import json, sys
sys.path.insert(0, {tests!r})
from test_reliability import _quick
from stabledrl_jax.training.loop import trainer
trainer.train(_quick(**json.loads({updates!r})), {workdir!r}, hard_stop=True)
"""


def _records_without_timing(workdir):
  timing = ("time/", "_s", "elapsed", "per_s", "perf/")
  return [{k: v for k, v in r.items() if not any(t in k for t in timing)}
          for r in metrics_writer.read_metrics(workdir / "metrics.jsonl")]


def _killed_after_a_restore(workdir, signum):
  """The guarded run in a process, sent ``signum`` once metrics.jsonl has a restore's record
  and a step run again after it; returns the process's stderr."""
  process = subprocess.Popen(
      [sys.executable, "-c", _GUARDED_RUN.format(tests=os.path.dirname(__file__),
                                                 updates=json.dumps(_GUARDED),
                                                 workdir=str(workdir))],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  deadline = time.monotonic() + 400  # A hang guard, not a timing.
  try:
    while time.monotonic() < deadline and process.poll() is None:
      records = metrics_writer.read_metrics(workdir / "metrics.jsonl")
      restored = [i for i, r in enumerate(records) if "collapse_guard/restored_to" in r]
      if restored and any("rewards/mean" in r for r in records[restored[0]:]):
        process.send_signal(signum)
        break
      time.sleep(0.02)
    _, err = process.communicate(timeout=300)
  finally:
    process.kill()
  assert restored, f"the run ended before its first restore: {err[-3000:]}"
  return process.returncode, err


@pytest.mark.slow
def test_a_kill_after_a_restore_resumes_the_restored_run_exactly(tmp_path):
  """After a restore the collapsed trajectory's checkpoints are moved aside and the restored
  step saved again as the latest, with the event and the records logged so far in its meta: a
  SIGKILL or SIGTERM there resumes the restored run (never the collapsed checkpoint), and the
  rerun's metrics.jsonl equals the uninterrupted run's, record for record."""
  from stabledrl_jax.training.loop import collapse  # pylint: disable=g-import-not-at-top
  config = _quick(**_GUARDED)
  trainer.train(config, str(tmp_path / "whole"))
  whole = _records_without_timing(tmp_path / "whole")
  assert [r["collapse_guard/restored_to"] for r in whole
          if "collapse_guard/restored_to" in r] == [0, 0, -1]
  for signum in (signal.SIGKILL, signal.SIGTERM):
    workdir = tmp_path / signum.name
    status, err = _killed_after_a_restore(workdir, signum)
    if signum == signal.SIGTERM:
      assert status == 0 and "Stopped by a signal: saved step" in err, err[-3000:]
    else:
      assert status == -signal.SIGKILL
    # The latest checkpoint is the restored state, the restore and its scale in its meta.
    resumed = trainer.Trainer(config, str(workdir))
    try:
      assert resumed.guard.lr_scale in (0.5, 0.25)
      assert resumed.guard.events[0]["action"] == "restore"
      assert resumed.start_step <= 1
    finally:
      resumed.close()
    assert (workdir / checkpointing.COLLAPSED_DIR).is_dir()  # The collapsed steps, kept aside.
    trainer.train(config, str(workdir))
    assert _records_without_timing(workdir) == whole, signum.name
    events = json.loads((workdir / collapse.EVENTS_FILE).read_text())["events"]
    assert [e["action"] for e in events] == ["restore", "restore", "stop"], signum.name


def test_a_kill_between_the_staged_restore_and_its_promotion_is_finished_by_the_rerun(
    tmp_path, monkeypatch):
  """The restored state is saved whole in checkpoints_restore/ before anything in checkpoints/
  moves; a kill right after (here: the promotion raises the first time) leaves it there, the
  next start promotes it (the collapsed steps moved aside), and the run ends as the
  uninterrupted one, record for record. A guard stop on a step never saved (no checkpoint yet)
  still refuses the rerun."""
  from stabledrl_jax.training.loop import collapse  # pylint: disable=g-import-not-at-top
  config = _quick(**_GUARDED)
  trainer.train(config, str(tmp_path / "whole"))
  real = run_build.promote_restore
  calls = []

  class Killed(Exception):
    pass

  def killed_once(workdir, checkpointer):
    calls.append(1)
    if len(calls) == 2:  # The first is the build's (nothing staged); the second the restore's.
      raise Killed
    return real(workdir, checkpointer)

  monkeypatch.setattr(run_build, "promote_restore", killed_once)
  with pytest.raises(Killed):
    trainer.train(config, str(tmp_path / "killed"))
  monkeypatch.undo()
  killed = tmp_path / "killed"
  assert sorted(p.name for p in (killed / checkpointing.RESTORE_DIR).iterdir()) == ["0"]
  resumed = trainer.Trainer(config, str(killed))
  try:
    assert resumed.start_step == 0 and resumed.guard.lr_scale == 0.5
    assert not (killed / checkpointing.RESTORE_DIR).exists()
    assert (killed / checkpointing.COLLAPSED_DIR / "1").is_dir()
  finally:
    resumed.close()
  trainer.train(config, str(killed))
  assert _records_without_timing(killed) == _records_without_timing(tmp_path / "whole")
  # A stop the guard wrote before any checkpoint: the rerun trains nothing.
  fresh = tmp_path / "fresh"
  fresh.mkdir()
  (fresh / collapse.EVENTS_FILE).write_text(json.dumps({"lr_scale": 1.0, "events": [
      {"step": 1, "why": "a non-finite update was skipped", "action": "stop",
       "detected_at": 1}]}))
  assert trainer.Trainer(config, str(fresh)).stopped.startswith(
      "the collapse guard stopped this run after step 1")


def test_a_sweep_reads_back_a_run_recorded_before_a_config_field_was_added():
  """A sweep's run is known by its config; fields added to the base config since, at their
  defaults (or unset), do not make it another run (an upgrade would retrain the sweep)."""
  from stabledrl_jax.training.config import config_lib  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.loop import sweep
  current = config_lib.get("quickstart").to_json_best_effort(sort_keys=True)
  older = json.loads(current)
  del older["train"]["collapse_guard"]["go_on"]
  assert sweep.same_config(json.dumps(older), current)
  older["train"]["num_steps"] += 1
  assert not sweep.same_config(json.dumps(older), current)
  changed = json.loads(current)
  del changed["train"]["collapse_guard"]["go_on"]
  assert not sweep.same_config(json.dumps(changed), current.replace('"go_on": false',
                                                                    '"go_on": true'))
  assert not sweep.same_config(None, current) and not sweep.same_config("{", current)


def test_a_collapse_guard_that_never_fires_leaves_the_run_as_it_was(tmp_path):
  """Its best-eval checkpoints and checks draw no key and touch no state: the same losses,
  rewards and evals as the unguarded run, record for record (the guard's own fields aside)."""
  config = _quick(**{"train.num_steps": 3, "eval.every_steps": 1,
                     "train.collapse_guard.eval_margin": 100.0,
                     "train.collapse_guard.reward_margin": 100.0})
  plain = trainer.train(config, str(tmp_path / "plain"))
  guarded = trainer.train(sweep_overrides(config, {"train.collapse_guard.enabled": True}),
                          str(tmp_path / "guarded"))
  assert not (tmp_path / "plain" / "best_eval_checkpoint").exists()
  assert (tmp_path / "guarded" / "best_eval_checkpoint").exists()
  assert len(plain) == len(guarded) == 3
  timing = ("time", "_s", "elapsed", "per_s", "collapse_guard")
  for a, b in zip(plain, guarded):
    same = {k for k in a if not any(t in k for t in timing)}
    assert {k: a[k] for k in same} == {k: b[k] for k in same}, a["step"]


def sweep_overrides(config, updates):
  from stabledrl_jax.training.loop import sweep  # pylint: disable=g-import-not-at-top
  return sweep.with_overrides(config, updates)


def test_a_sweep_reads_a_guarded_run_as_it_stands_and_names_the_guards_stop(tmp_path):
  """The sweeps (the ratio-noise study) read a guarded run's steps as they now stand (a step
  run again after a restore replaces its first record) and its stop as the guard's, not a
  signal's."""
  from stabledrl_jax.training.loop import collapse, sweep  # pylint: disable=g-import-not-at-top
  plain = [{"step": 1, "rewards/mean": 1.0}, {"step": 2, "rewards/mean": 0.0}]
  (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in plain))
  assert sweep._trajectory(str(tmp_path)) == plain and sweep._guard_stop(str(tmp_path)) == ""
  records = plain + [
      {"step": 2, "collapse_guard/restored_to": 1, "collapse_guard/lr_scale": 0.5},
      {"step": 2, "rewards/mean": 0.5}]
  (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
  (tmp_path / collapse.EVENTS_FILE).write_text(json.dumps({"lr_scale": 0.5, "events": [
      {"step": 2, "why": "reward fell", "action": "restore"},
      {"step": 3, "why": "eval fell", "action": "stop"}]}))
  assert [r["rewards/mean"] for r in sweep._trajectory(str(tmp_path))] == [1.0, 0.5]
  assert sweep._guard_stop(str(tmp_path)) == (
      "the collapse guard stopped it: eval fell at step 3")
