"""Every file the trainer, evaluate and export write stays inside their directory
(docs/reliability.md, "Files in the workdir"): a planted symbolic link is replaced, never
followed; a linked directory is refused; nothing is staged outside a local workdir; a full disk
is one line, releases LOCK, leaves nothing half-written, and the rerun resumes; signals stop a
run inside a long jitted call."""

import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from stabledrl_jax import libtpu_env, workdir_files
from stabledrl_jax.training.loop import metrics_writer, spikes, trainer
from stabledrl_jax.training.state import checkpointing, supervised

from test_training import tiny_config

TESTS = os.path.dirname(os.path.abspath(__file__))


def _outside(tmp_path, name="precious.txt"):
  target = tmp_path / "outside" / name
  target.parent.mkdir(exist_ok=True)
  target.write_text("precious")
  return target


def _untouched(target):
  return target.read_text() == "precious"


# ---------------------------------------------------------------------------
# The functions every writer uses.
# ---------------------------------------------------------------------------


def test_a_file_written_over_a_link_replaces_the_link_and_leaves_its_target(tmp_path):
  target = _outside(tmp_path)
  path = tmp_path / "w" / "config.json"
  path.parent.mkdir()
  path.symlink_to(target)
  workdir_files.write_text(path, "mine")
  assert not path.is_symlink() and path.read_text() == "mine" and _untouched(target)
  assert sorted(p.name for p in path.parent.iterdir()) == ["config.json"]  # Nothing staged left.
  # A new file's usual mode (mkstemp alone makes 0600).
  assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~workdir_files._umask())


def test_a_failed_write_names_the_file_and_leaves_the_old_one(tmp_path, monkeypatch):
  path = tmp_path / "metrics.jsonl"
  path.write_text("old")
  real_replace = os.replace

  def full(*args):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(os, "replace", full)
  with pytest.raises(workdir_files.WorkdirError,
                     match=rf"^cannot write {path}: no space left on the device$"):
    workdir_files.write_text(path, "new")
  monkeypatch.setattr(os, "replace", real_replace)
  assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == [
      "metrics.jsonl"]


def test_append_and_directories_never_follow_links(tmp_path):
  target = _outside(tmp_path)
  link = tmp_path / "samples.jsonl"
  link.symlink_to(target)
  with pytest.raises(workdir_files.WorkdirError, match=rf"cannot write {link}"):
    workdir_files.open_append(link)
  directory = tmp_path / "spikes"
  directory.symlink_to(target.parent)
  with pytest.raises(workdir_files.WorkdirError,
                     match=rf"^{directory} is a symbolic link \(to {target.parent}\)"):
    workdir_files.make_dir(directory)
  assert _untouched(target) and sorted(p.name for p in target.parent.iterdir()) == [
      target.name]


def test_a_staged_directory_replaces_only_what_it_may(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  (out / "theirs.txt").write_text("theirs")
  with pytest.raises(workdir_files.WorkdirError, match="is a directory that is not empty"):
    with workdir_files.staged_dir(out) as staging:
      (staging / "a.txt").write_text("a")
  assert [p.name for p in out.iterdir()] == ["theirs.txt"]
  with workdir_files.staged_dir(out, overwrite=True) as staging:
    (staging / "a.txt").write_text("a")
  assert [p.name for p in out.iterdir()] == ["a.txt"]
  # A link in its place is replaced (overwrite), its target left alone.
  target = _outside(tmp_path)
  link = tmp_path / "linked"
  link.symlink_to(target.parent, target_is_directory=True)
  with workdir_files.staged_dir(link, overwrite=True) as staging:
    (staging / "b.txt").write_text("b")
  assert not link.is_symlink() and [p.name for p in link.iterdir()] == ["b.txt"]
  assert _untouched(target) and [p.name for p in target.parent.iterdir()] == [target.name]
  # A failure inside names the file where it was going, and removes the staging.
  with pytest.raises(workdir_files.WorkdirError, match=rf"^cannot write {out}/c.txt: "):
    with workdir_files.staged_dir(out, overwrite=True) as staging:
      with workdir_files.writing(staging / "c.txt"):
        raise OSError(errno.EACCES, "Permission denied")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["linked", "out", "outside"]


def test_tensorstore_errors_in_words_are_the_file_systems():
  error = ValueError("RESOURCE_EXHAUSTED: Error writing local file \"/x/_sharding\": Failed to "
                     "write 10079 bytes to file 17: No space left on device [os_error_code='28']")
  assert workdir_files.os_error_of(error).errno == errno.ENOSPC
  with pytest.raises(workdir_files.WorkdirError, match="^cannot write /x: no space left"):
    with workdir_files.writing("/x"):
      raise error
  with pytest.raises(ValueError, match="^a bug$"):  # Not a file system's: unchanged.
    with workdir_files.writing("/x"):
      raise ValueError("a bug")


def test_metrics_samples_and_spikes_never_follow_links(tmp_path):
  targets = {name: _outside(tmp_path, name) for name in ("m", "s", "spike")}
  (tmp_path / "metrics.jsonl").symlink_to(targets["m"])
  (tmp_path / "samples.jsonl").symlink_to(targets["s"])
  (tmp_path / spikes.SPIKES_DIR).mkdir()
  os.symlink(targets["spike"], spikes.spike_path(tmp_path, 3))
  writer = metrics_writer.MetricsWriter(tmp_path, tensorboard=False)
  writer.write(1, {"loss": 1.0})
  writer.write_samples(1, [{"prompt": "p", "completion": "c", "reward": 1.0}])
  writer.close()
  spikes.write_spike(tmp_path, 3, {"step": 3})
  assert all(_untouched(t) for t in targets.values())
  assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 1.0
  assert spikes.read_spike(spikes.spike_path(tmp_path, 3))["step"] == 3


# ---------------------------------------------------------------------------
# The trainer, end to end.
# ---------------------------------------------------------------------------


def _short(**updates):
  return tiny_config(**{"sft.num_steps": 2, "train.num_steps": 1, "train.num_iterations": 1,
                        "logging.samples_every_steps": 1, **updates})


def test_every_file_the_trainer_writes_replaces_a_planted_link(tmp_path):
  workdir = tmp_path / "w"
  workdir.mkdir()
  files = ("LOCK", "config.json", "metrics.jsonl", "samples.jsonl")
  targets = {name: _outside(tmp_path, name) for name in files}
  for name, target in targets.items():
    (workdir / name).symlink_to(target)
  start = tmp_path / "outside" / "start"
  start.mkdir()
  (start / "config.json").write_text("precious")
  (workdir / supervised.SFT_DIR).symlink_to(start, target_is_directory=True)
  # The supervised start's link is to a directory without a model: fitted and written anew.
  (start / "config.json").unlink()
  (start / "keep.txt").write_text("precious")
  trainer.train(_short(), str(workdir))
  assert all(_untouched(t) for t in targets.values()), {n: t.read_text() for n, t in
                                                        targets.items()}
  assert [p.name for p in start.iterdir()] == ["keep.txt"] and _untouched(start / "keep.txt")
  for name in ("config.json", "metrics.jsonl", "samples.jsonl"):
    assert (workdir / name).is_file() and not (workdir / name).is_symlink(), name
  assert (workdir / supervised.SFT_DIR / "config.json").is_file()
  assert not (workdir / supervised.SFT_DIR).is_symlink()
  assert not [p for p in workdir.iterdir() if p.name.startswith(workdir_files.STAGING_PREFIX)]


@pytest.mark.parametrize("name", ["tensorboard", checkpointing.CHECKPOINT_DIR])
def test_a_linked_directory_in_the_workdir_is_refused_naming_it(tmp_path, name):
  workdir = tmp_path / "w"
  workdir.mkdir()
  target = _outside(tmp_path)
  (workdir / name).symlink_to(target.parent, target_is_directory=True)
  with pytest.raises(workdir_files.WorkdirError,
                     match=rf"^{workdir / name} is a symbolic link"):
    trainer.train(_short(**{"sft.num_steps": 0}), str(workdir))
  assert sorted(p.name for p in target.parent.iterdir()) == [target.name]
  assert not (workdir / checkpointing.WorkdirLock.NAME).exists()


def test_nothing_is_staged_outside_a_local_workdir(tmp_path, monkeypatch):
  """The system's temporary directory unusable (a file in its place): the supervised start,
  checkpoints and logs are all written inside the workdir."""
  blocked = tmp_path / "no-tmp"
  blocked.write_text("not a directory")
  monkeypatch.setenv("TMPDIR", str(blocked))
  monkeypatch.setattr(tempfile, "tempdir", str(blocked))
  with pytest.raises(OSError):  # It is unusable.
    tempfile.mkstemp()
  workdir = tmp_path / "w"
  history = trainer.train(_short(), str(workdir))
  assert len(history) == 1 and (workdir / supervised.SFT_DIR / "config.json").exists()


def test_a_failed_build_stops_orbax_and_the_reward_pool_before_its_one_line(tmp_path):
  """A config.json that is a JSON list: the error, and none of orbax's thread traceback
  ('cannot schedule new futures after interpreter shutdown') after it."""
  checkpoint = tmp_path / "ckpt"
  checkpoint.mkdir()
  (checkpoint / "config.json").write_text("[1, 2]")
  out = subprocess.run(
      [sys.executable, "-m", "stabledrl_jax.train", "--config", "quickstart", "--workdir",
       str(tmp_path / "w"), f"--config.model.checkpoint={checkpoint}"],
      capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 1
  assert out.stderr.strip().splitlines() == [
      f"error: config.model.checkpoint: {checkpoint}/config.json holds a JSON list, not an object (a config.json maps "
      "names to values) (--verbose shows the traceback)"], out.stderr[-3000:]
  assert not (tmp_path / "w" / checkpointing.WorkdirLock.NAME).exists()


def test_without_a_tpu_libtpu_writes_no_log_directory(tmp_path):
  code = ("import os, stabledrl_jax, jax; jax.devices(); "
          "print(os.environ['TPU_LOG_DIR'], os.getpid())")
  temporary = tmp_path / "tmp"  # Where glog would write libtpu's driver logs (tpu_driver.*).
  temporary.mkdir()
  env = {k: v for k, v in os.environ.items() if k not in ("TPU_LOG_DIR", "TPU_MIN_LOG_LEVEL")}
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env=dict(env, TMPDIR=str(temporary)))
  assert out.returncode == 0, out.stderr[-2000:]
  value, pid = out.stdout.split()
  assert value == "disabled" and not libtpu_env.tpu_attached()
  assert list(tmp_path.iterdir()) == [temporary] and list(temporary.iterdir()) == []
  logs = "/tmp/tpu_logs"
  assert not os.path.isdir(logs) or not [n for n in os.listdir(logs) if n.endswith(f".{pid}")]


# ---------------------------------------------------------------------------
# A full disk (a real small tmpfs where the test may mount one).
# ---------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
  mount = tmp_path / "disk"
  mount.mkdir()
  done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=700k", "tmpfs", str(mount)],
                        capture_output=True, text=True, check=False)
  if done.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()[:100]}); the injected full "
                "disk of test_reliability.py covers the same paths")
  yield mount
  subprocess.run(["umount", "-l", str(mount)], check=False)


def _cli(workdir, *flags, timeout=600):
  return subprocess.run(
      [sys.executable, "-m", "stabledrl_jax.train", "--config", "quickstart", "--workdir",
       str(workdir), "--config.sft.num_steps=0", "--config.eval.every_steps=0",
       "--config.checkpoint.every_steps=1", *flags],
      capture_output=True, text=True, timeout=timeout,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_the_rerun_resumes_from_the_last_good_step(small_disk):
  """700 KiB hold one checkpoint of the quickstart model (about 390 KiB) but not two: the save
  of step 2 fails. One error line naming the write that met the full disk (the save of step 2,
  or step 3's metrics line when the asynchronous save filled the disk first); LOCK released; no
  orbax tmp left; step 1 stays the latest; with room again, the rerun resumes from it."""
  workdir = small_disk / "w"
  out = _cli(workdir, "--config.train.num_steps=3")
  lines = [line for line in out.stderr.replace("\r", "\n").splitlines()
           if line.strip() and not line.startswith("RL:")]
  culprits = [f"{workdir}/checkpoints/2", f"{workdir}/metrics.jsonl"]
  assert out.returncode == 1 and lines in [[
      f"error: cannot write {culprit}: no space left on the device "
      "(--verbose shows the traceback)"] for culprit in culprits], out.stderr[-3000:]
  assert not (workdir / checkpointing.WorkdirLock.NAME).exists()
  assert sorted(p.name for p in (workdir / checkpointing.CHECKPOINT_DIR).iterdir()) == ["1"]
  subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
  again = _cli(workdir, "--config.train.num_steps=3")
  assert again.returncode == 0, again.stderr[-3000:]
  steps = [r["step"] for r in metrics_writer.read_metrics(workdir / "metrics.jsonl")]
  assert steps == [1, 2, 3]
  assert checkpointing.Checkpointer(workdir, read_only=True).latest_step() == 3


@pytest.mark.slow
def test_a_full_disk_at_the_first_rl_checkpoint_is_one_line_not_a_hang(small_disk):
  """The supervised start fills most of 700 KiB, so the first RL checkpoint cannot be written
  (the hostile run's case: tensorboardX's writer thread died on the full disk and the loop
  hung for good on its queue). One error line naming the file that met the full disk, LOCK
  released, no orbax staging directory left, within a hang guard."""
  workdir = small_disk / "w"
  try:
    out = _cli(workdir, "--config.sft.num_steps=2", "--config.train.num_steps=3",
               timeout=400)
  except subprocess.TimeoutExpired:
    raise AssertionError("the run hung on the full disk") from None
  assert (workdir / "sft_model").is_dir(), out.stderr[-3000:]
  lines = [line for line in out.stderr.replace("\r", "\n").splitlines()
           if line.strip() and not line.startswith(("RL:", "sft step"))]
  assert out.returncode == 1 and len(lines) == 1, out.stderr[-3000:]
  assert lines[0].startswith(f"error: cannot write {workdir}/") and lines[0].endswith(
      ": no space left on the device (--verbose shows the traceback)"), lines
  assert not (workdir / checkpointing.WorkdirLock.NAME).exists()
  left = [p.name for p in (workdir / checkpointing.CHECKPOINT_DIR).iterdir()]
  assert not [name for name in left if "tmp" in name], left


_FAILED_SAVE_AFTER_THE_ERROR = textwrap.dedent("""
    import asyncio, atexit, gc, sys
    from stabledrl_jax import train
    from stabledrl_jax.training.loop import trainer

    def failing_train(config, workdir, **kwargs):
      # As when the disk fills under metrics.jsonl with a save in flight: orbax's write fails
      # too, and its future, never retrieved, is collected at exit.
      loop = asyncio.new_event_loop()
      future = loop.create_future()
      future.set_exception(ValueError("RESOURCE_EXHAUSTED: Failed writing ocdbt.process_0"))
      held = [future]
      atexit.register(lambda: (held.clear(), gc.collect()))
      raise ValueError("cannot write {workdir}/metrics.jsonl: no space left on the device")

    trainer.train = failing_train
    sys.argv = ["train", "--config", "quickstart", "--workdir", {workdir!r}]
    train.run()
""")


def test_a_save_that_fails_after_the_error_adds_no_line(tmp_path):
  """The full-disk run's second failure (asyncio's ``Future exception was never retrieved``
  for the save in flight, logged at exit) stays out of the one-line error."""
  out = subprocess.run(
      [sys.executable, "-c", _FAILED_SAVE_AFTER_THE_ERROR.format(workdir=str(tmp_path))],
      capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 1 and out.stderr.splitlines() == [
      f"error: cannot write {tmp_path}/metrics.jsonl: no space left on the device "
      "(--verbose shows the traceback)"], out.stderr

# ---------------------------------------------------------------------------
# Signals inside a long jitted call.
# ---------------------------------------------------------------------------

_SLOW_RUN = textwrap.dedent("""
    import sys, time
    import jax, numpy as np
    sys.path.insert(0, {tests!r})
    from test_training import tiny_config
    from stabledrl_jax.training.loop import trainer

    real = trainer.Trainer.rl_step

    def rl_step(self, step):
      if step == 0:
        return real(self, step)
      print("SLOW", flush=True)  # Step 1 waits 600 s inside one jitted call.
      wait = lambda x: jax.pure_callback(lambda y: (time.sleep(600), y)[1],
                                         jax.ShapeDtypeStruct((), np.float32), x)
      jax.block_until_ready(jax.jit(wait)(np.float32(0)))
      return real(self, step)

    trainer.Trainer.rl_step = rl_step
    trainer.train(tiny_config(**{{"sft.num_steps": 0, "train.num_steps": 3,
                                  "train.num_iterations": 1, "train.stop_grace_s": 2.0}}),
                  {workdir!r}, hard_stop=True)
""")


def _slow_run(workdir):
  process = subprocess.Popen(
      [sys.executable, "-c", _SLOW_RUN.format(tests=TESTS, workdir=str(workdir))],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  deadline = time.monotonic() + 400
  while time.monotonic() < deadline:
    line = process.stdout.readline()
    if line.strip() == "SLOW":
      time.sleep(1.0)  # Inside the call.
      return process
    if not line and process.poll() is not None:
      break
  process.kill()
  raise AssertionError(f"the slow step never began: {process.stderr.read()[-3000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("signals,status,why", [
    ((signal.SIGINT, signal.SIGINT), 130, "Interrupted again: stopping now, without saving"),
    ((signal.SIGTERM,), 143, "SIGTERM: the run did not reach a step boundary and save within "
                             "train.stop_grace_s=2 s; stopping now"),
])
def test_signals_end_a_run_inside_a_long_jitted_call(tmp_path, signals, status, why):
  workdir = tmp_path / "w"
  process = _slow_run(workdir)
  for signum in signals:
    process.send_signal(signum)
    time.sleep(0.5)
  # A hang guard, not a timing: the jitted call would hold the run for 600 s.
  try:
    _, err = process.communicate(timeout=200)
  except subprocess.TimeoutExpired:
    process.kill()
    raise AssertionError("the run did not stop within 200 s of the signals (the call takes 600)")
  assert process.returncode == status, err[-3000:]
  assert (f"{why}; the last checkpoint is step 1 in {workdir}/checkpoints; rerun to continue "
          "from it.") in err, err[-3000:]
  assert not (workdir / checkpointing.WorkdirLock.NAME).exists()
