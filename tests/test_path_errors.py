"""Every data, model and tokenizer path a run reads is named with its field and reason
(docs/reliability.md): missing, empty, not a regular file (a FIFO is never opened), unreadable,
wrong columns with the expected ones. Scoring names the file of every skip; the planner names
its flag; a one-line error is not followed by a library's thread traceback."""

import csv
import json
import os
import re
import subprocess
import sys
import threading

import ml_collections
import pytest

from stabledrl_jax import input_files, scoring, tasks, workdir_files
from stabledrl_jax.training.inputs import data
from stabledrl_jax.training.state import checkpointing


def _fifo(path):
  os.mkfifo(path)
  return path


def _csv(path, rows):
  with path.open("w", newline="") as file:
    csv.writer(file).writerows(rows)
  return path


def _returns_promptly(function, *args):
  """``function(*args)``'s exception, run in a thread that must not block (a FIFO opened for
  reading would wait for a writer forever)."""
  outcome = {}

  def target():
    try:
      function(*args)
    except Exception as error:  # pylint: disable=broad-except
      outcome["error"] = error

  thread = threading.Thread(target=target, daemon=True)
  thread.start()
  thread.join(60)
  assert not thread.is_alive(), f"{function.__name__} blocked on {args}"
  return outcome.get("error")


def test_each_problem_of_a_path_is_said_in_words(tmp_path, monkeypatch):
  regular = tmp_path / "a.jsonl"
  regular.write_text("{}\n")
  (tmp_path / "empty.jsonl").write_text("")
  (tmp_path / "dangling").symlink_to(tmp_path / "gone")
  expected = {
      "a.jsonl": None,
      "missing.jsonl": "no such file or directory",
      "dangling": "a symbolic link to a missing path",
      "empty.jsonl": "empty",
      ".": "a directory, not a file",
      "fifo": "a FIFO, not a file",
  }
  _fifo(tmp_path / "fifo")
  for name, reason in expected.items():
    assert input_files.problem(tmp_path / name) == reason, name
  assert input_files.problem(tmp_path / "empty.jsonl", allow_empty=True) is None
  assert input_files.problem(tmp_path, "directory") is None
  assert input_files.problem(regular, "directory") == "a regular file, not a directory"
  assert input_files.problem("/dev/null") == "a character device, not a file"
  # Unreadable, as a permission bit answers a user who is not root.
  monkeypatch.setattr(os, "access", lambda path, mode: False)
  assert input_files.problem(regular) == "not readable (permission denied)"
  monkeypatch.undo()
  with pytest.raises(input_files.InputError, match=f"^checkpoint {tmp_path}/fifo: a FIFO, not "
                     "a directory$"):
    input_files.check(tmp_path / "fifo", "directory", what="checkpoint")
  with pytest.raises(ValueError, match="kind="):
    input_files.problem(regular, "socket")


def test_named_prefixes_the_field_once():
  with pytest.raises(input_files.InputError, match=r"^config\.data\.train: /x: empty$"):
    with input_files.named("config.data.train"):
      raise input_files.InputError("/x: empty")
  with pytest.raises(input_files.InputError,
                     match=r"^config\.tokenizer\.path: /t: No such file or directory$"):
    with input_files.named("config.tokenizer.path"):
      raise FileNotFoundError(2, "No such file or directory", "/t")
  with pytest.raises(ValueError, match=r"^config\.a: already named$") as error:
    with input_files.named("config.a"):
      raise ValueError("config.a: already named")
  assert type(error.value) is ValueError  # pylint: disable=unidiomatic-typecheck
  with pytest.raises(ValueError, match=r"^config\.model\.attention: x$"):
    with input_files.named("config.model.checkpoint"):  # Another field's error: as it is.
      raise ValueError("config.model.attention: x")
  with pytest.raises(KeyError):  # Not a path's problem: unchanged.
    with input_files.named("config.a"):
      raise KeyError("b")


@pytest.mark.parametrize("name,content,reason", [
    ("missing.jsonl", None, "no such file or directory"),
    ("empty.jsonl", "", "empty"),
    ("blank.jsonl", "\n\n  \n", "no records"),
    ("list.json", "[1, 2]", "a record is a int, not an object of named fields"),
    ("latin.csv", b"Puzzle,Solution\n\xe9\xe9\n", "not UTF-8 text"),
    ("bad.jsonl", '{"a": 1}\nnot json\n', "bad.jsonl:2: not JSON"),
    ("notes.txt", "x", "unsupported extension"),
])
def test_a_bad_data_file_is_one_line_naming_it_and_the_reason(tmp_path, name, content, reason):
  path = tmp_path / name
  if isinstance(content, bytes):
    path.write_bytes(content)
  elif content is not None:
    path.write_text(content)
  with pytest.raises(input_files.InputError) as error:
    tasks.read_records(path)
  message = str(error.value)
  assert message.startswith(str(path)) and reason in message and "\n" not in message, message


def test_a_fifo_or_a_directory_named_as_data_is_never_opened(tmp_path):
  error = _returns_promptly(tasks.read_records, _fifo(tmp_path / "fifo.jsonl"))
  assert str(error) == f"{tmp_path}/fifo.jsonl: a FIFO, not a file"
  (tmp_path / "dir.jsonl").mkdir()
  error = _returns_promptly(tasks.read_records, tmp_path / "dir.jsonl")
  assert str(error) == f"{tmp_path}/dir.jsonl: a directory, not a file"


@pytest.mark.parametrize("task,label,expected", [
    ("sudoku", "sudoku", "Puzzle and Solution, or question and ground_truth"),
    ("countdown", "countdown", "input and output, nums (or numbers) and target, or ground_truth"),
    ("gsm8k", "GSM8K", "question and answer, or question and ground_truth"),
    ("math500", "MATH", "problem (or question) and answer, solution or ground_truth"),
])
def test_wrong_columns_name_the_file_the_record_and_the_expected_columns(tmp_path, task, label,
                                                                           expected):
  path = _csv(tmp_path / "other.csv", [["a", "b"], ["1", "2"]])
  with pytest.raises(input_files.InputError) as error:
    tasks.load_examples(task, path)
  assert str(error.value) == (f"{path}: record 1: not a {label} record: its columns are "
                              f"['a', 'b']; expected {expected}")


@pytest.mark.parametrize("puzzle,solution,says", [
    ("12341234123412341", "1234341221434321", "expected two 16-digit grids"),
    ("1234", "12", "is not a complete valid 4x4 grid"),  # Read as numbers: zeros restored.
    ("0034000000000000", "1234341221434312", "not a complete valid 4x4 grid"),
    ("0035000000000000", "1234341221434321", "not 0 (blank) or 1-4"),
    ("0043000000000000", "1234341221434321", "does not keep the givens"),
])
def test_a_sudoku_row_that_is_no_puzzle_is_refused_naming_its_record(tmp_path, puzzle, solution,
                                                                     says):
  path = _csv(tmp_path / "puzzles.csv", [["Puzzle", "Solution"],
                                         ["0034000000000000", "1234341221434321"],
                                         [puzzle, solution]])
  with pytest.raises(input_files.InputError, match=f"^{path}: record 2: .*{re.escape(says)}"):
    tasks.load_examples("sudoku", path)


def test_a_directory_that_is_no_dataset_names_itself(tmp_path):
  (tmp_path / "plain").mkdir()
  with pytest.raises(input_files.InputError) as error:
    tasks.load_examples("sudoku", tmp_path / "plain", split="test")
  message = str(error.value)
  assert message.startswith(f"'{tmp_path}/plain': a local directory, read as a Hugging Face "
                            "dataset repository, could not be loaded (") and "\n" not in message


def _data_config(**data_fields):
  return ml_collections.ConfigDict(dict(
      seed=0, task=dict(name="sudoku"),
      data=dict(dict(train="synthetic", eval="synthetic", train_size=4, eval_size=4,
                     generator={}), **data_fields)))


def test_the_trainer_names_the_config_field_of_a_bad_path(tmp_path):
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  for split, field in (("train", "config.data.train"), ("eval", "config.data.eval")):
    config = _data_config(**{split: str(empty)})
    with pytest.raises(input_files.InputError, match=f"^{field}: {empty}: empty$"):
      data._make_examples(config, split)  # pylint: disable=protected-access
  fifo = _fifo(tmp_path / "tokenizer.json")
  for kind in ("llada", "sdar"):
    error = _returns_promptly(data.make_tokenizer, ml_collections.ConfigDict(
        dict(kind=kind, path=str(fifo), alphabet="")))
    assert str(error) == (f"config.tokenizer.path: no tokenizer file at {fifo} (a FIFO, not a "
                          "file)")


def _train_cli(tmp_path, *flags):
  return subprocess.run(
      [sys.executable, "-m", "stabledrl_jax.train", "--config", "quickstart", "--workdir",
       str(tmp_path / "workdir"), "--config.sft.num_steps=0", *flags], capture_output=True,
      text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_a_bad_checkpoint_or_data_path_is_one_line_on_the_command_line(tmp_path):
  """The original probes: a FIFO as data (it never opened), and a checkpoint whose config.json
  is a JSON list (one line, then no orbax thread traceback)."""
  checkpoint = tmp_path / "checkpoint"
  checkpoint.mkdir()
  (checkpoint / "config.json").write_text("[1, 2]")
  fifo = _fifo(tmp_path / "train.jsonl")
  for flag, says in ((f"--config.data.train={fifo}",
                      f"error: config.data.train: {fifo}: a FIFO, not a file"),
                     (f"--config.model.checkpoint={checkpoint}",
                      f"error: config.model.checkpoint: {checkpoint}/config.json holds a JSON "
                      "list, not an object")):
    out = _train_cli(tmp_path, flag)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith(says), lines[0]
    assert not (tmp_path / "workdir" / "LOCK").exists()


def test_leftover_unfinished_saves_are_removed_when_a_checkpointer_opens(tmp_path):
  """A killed run's ``<step>.orbax-checkpoint-tmp*`` goes before orbax starts (orbax's own
  clean-up thread would print a traceback after a one-line error that exits at once)."""
  directory = tmp_path / "checkpoints"
  (directory / "3.orbax-checkpoint-tmp-1234").mkdir(parents=True)
  (directory / "notes-tmp").mkdir()
  checkpointer = checkpointing.Checkpointer(str(tmp_path))
  checkpointer.close()
  assert sorted(p.name for p in directory.iterdir()) == ["notes-tmp"]


def test_scoring_names_the_file_of_a_ground_truth_past_the_digit_limit(tmp_path):
  path = tmp_path / "gsm8k_m_8_4_0_generations.json"
  path.write_text('{"generations": [{"question": "q", "generations": "x", "ground_truth": '
                  + "1" * 5000 + "}]}")
  skipped = []
  assert scoring.score_generation_files([tmp_path], skipped) == {}
  assert len(skipped) == 1 and skipped[0].startswith(f"{path}: not a readable JSON file ("), skipped


def test_scoring_writes_replace_a_planted_link_and_leave_its_target(tmp_path):
  outside = tmp_path / "outside.txt"
  outside.write_text("precious")
  directory = tmp_path / "out"
  directory.mkdir()
  generations = directory / "sudoku_m_8_4_0_generations.json"
  results = directory / "results.json"
  for link in (generations, results):
    link.symlink_to(outside)
  example = tasks.sudoku.make_example("0034000000000000", "1234341221434321")
  scoring.write_generations(generations, [example], ["<answer>1234341221434321</answer>"])
  scoring.report([directory], results)
  assert outside.read_text() == "precious"
  assert not generations.is_symlink() and not results.is_symlink()
  assert json.loads(results.read_text())["sudoku_m_8_4"]["accuracy"] == 100.0


def test_the_planner_names_its_flag_before_compiling(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  with pytest.raises(ValueError, match=f"^--output '{blocker}/plans' is not writable: "
                     f"{blocker} is not a directory$"):
    workdir_files.check_writable(str(blocker / "plans"), "--output")
  with pytest.raises(ValueError, match=r"^--markdown '/proc/plans' is not writable: /proc: "):
    workdir_files.check_writable("/proc/plans", "--markdown")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # The probe is gone.
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  for flags, says in ((["--output", "/proc/plan.json"], "error: --output '/proc' is not "
                       "writable: /proc: "),
                      (["--max_ladder", "-3"], "flag --max_ladder=-3: -3 is not an integer in the "
                       "range [0, 64]")):
    out = subprocess.run([sys.executable, "-m", "stabledrl_jax.plan", "--config", "quickstart",
                          "--topology", "cpu:1", *flags], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode != 0 and says in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
