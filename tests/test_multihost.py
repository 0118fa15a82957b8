"""Several processes on one machine, as a TPU pod or GPU cluster runs them (docs/pods.md).

Each process is a `python -m stabledrl_jax.train` (or `.evaluate`) with its own fake CPU devices,
joined by `--coordinator_address --num_processes --process_id` over gloo. The reference is the
same run as one process on 8 devices.
"""

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from stabledrl_jax import tasks
from stabledrl_jax.rewards import math_equivalence
from stabledrl_jax.training.config import config_lib, specs
from stabledrl_jax.training.inputs import reward_pool
from stabledrl_jax.training.loop import metrics_writer
from stabledrl_jax.training.parallel import multihost
from stabledrl_jax.training.state import checkpointing
from shared_runs import shared_start

REPO = pathlib.Path(__file__).resolve().parents[1]
NUM_STEPS = 6
# The quickstart at toy size: 4 prompts x 4 completions over a mesh whose fsdp axis crosses the
# two processes (parameters and optimizer state split between them) and whose tensor axis
# pairs devices of one process.
FLAGS = ("--config.data.train_size=64", "--config.data.eval_size=8",
         "--config.rollout.num_prompts=4", "--config.rollout.group_size=4",
         "--config.rollout.steps=10", "--config.rollout.temperature=1.3",
         "--config.sft.num_steps=40", "--config.sft.batch_size=16",
         "--config.eval.every_steps=3", "--config.eval.batch_size=8",
         "--config.checkpoint.every_steps=1", f"--config.train.num_steps={NUM_STEPS}",
         "--config.mesh.data=1", "--config.mesh.fsdp=4", "--config.mesh.tensor=2")
# Metrics that differ between runs by nature.
_TIMING = ("time/", "throughput/", "perf/")  # Wall-clock dependent.


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(module, args, *, processes, devices, log_dir):
  """`python -m module args` (`module` None: `python args`) as `processes` processes of
  `devices` fake devices each."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu",  # Keeps conftest.py's fast-compile flag.
         "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                      f"--xla_force_host_platform_device_count={devices}"}
  port = _free_port()
  running = []
  for i in range(processes):
    joined = ([f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={processes}",
               f"--process_id={i}"] if processes > 1 else [])
    name = module.rsplit(".", 1)[-1] if module else "script"
    log = open(pathlib.Path(log_dir) / f"{name}_{i}_{time.time_ns()}.log", "w")
    command = ["-m", module] if module else []
    running.append(subprocess.Popen([sys.executable, *command, *args, *joined], env=env,
                                    cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
  return running


def wait(running, timeout=400):
  """The exit codes; processes still running after `timeout` seconds (a hang) are killed."""
  deadline = time.time() + timeout
  try:
    return [p.wait(timeout=max(deadline - time.time(), 1)) for p in running]
  except subprocess.TimeoutExpired:
    for p in running:
      p.kill()
    pytest.fail(f"processes still running after {timeout} s (a hang?)")


def train(workdir, *extra, processes, devices, log_dir):
  return launch("stabledrl_jax.train", [f"--config={REPO / 'configs/quickstart.py'}",
                                        f"--workdir={workdir}", *FLAGS, *extra],
                processes=processes, devices=devices, log_dir=log_dir)


def _logs(log_dir):
  return "\n".join(p.read_text()[-3000:] for p in sorted(pathlib.Path(log_dir).glob("*.log")))


def _records(workdir):
  return metrics_writer.read_metrics(pathlib.Path(workdir) / "metrics.jsonl")


def _comparable(records):
  return [{k: v for k, v in r.items() if not k.startswith(_TIMING)} for r in records]


def _assert_same_metrics(got, want, atol=1e-5):
  assert [r["step"] for r in got] == [r["step"] for r in want]
  for a, b in zip(_comparable(got), _comparable(want)):
    assert a.keys() == b.keys(), (a.keys() ^ b.keys())
    for name in a:
      np.testing.assert_allclose(a[name], b[name], atol=atol, rtol=0, err_msg=name)


def _final_params(workdir):
  ckpt = checkpointing.Checkpointer(workdir, read_only=True)
  step = ckpt.latest_step()
  path = pathlib.Path(ckpt.directory) / str(step) / "state"
  ckpt.close()
  checkpointer = ocp.PyTreeCheckpointer()
  tree = checkpointer.metadata(path).item_metadata.tree
  # As numpy: the checkpoint's shardings name 8 devices that this process does not have.
  as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  return step, checkpointer.restore(path, restore_args=as_numpy)["params"]


def _wait_for_step(workdir, step, running, timeout=300):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if any(p.poll() is not None for p in running):
      return False
    steps = [r["step"] for r in _records(workdir)]
    if steps and max(steps) >= step:
      return True
    time.sleep(0.02)
  return False


@pytest.fixture(scope="session")
def reference(tmp_path_factory, worker_id):
  """One process on 8 devices: the run every multi-process run must reproduce (run once for
  all xdist workers, ``shared_runs.shared_start``; read it, never write into it)."""
  logs = tmp_path_factory.mktemp("logs")

  def run(workdir):
    workdir.mkdir(parents=True)
    assert wait(train(workdir, processes=1, devices=8, log_dir=logs)) == [0], _logs(logs)
    return workdir

  return shared_start(tmp_path_factory, worker_id, "multihost_reference", run)


def with_start(path, reference):
  """A fresh workdir holding the reference's supervised start."""
  path.mkdir(parents=True)
  shutil.copytree(reference / "sft_model", path / "sft_model")
  return path


def _safetensors(directory):
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  return load_file(str(pathlib.Path(directory) / "model.safetensors"))


@pytest.mark.slow
def test_two_processes_fit_the_supervised_start_of_one_process(tmp_path, reference):
  """The supervised start fitted by 2 processes x 4 devices (written by process 0) is the one
  1 process x 8 devices fits, up to float reassociation over 40 Adam steps."""
  logs = tmp_path / "logs"
  logs.mkdir()
  workdir = tmp_path / "two"
  assert wait(train(workdir, "--config.train.num_steps=0", processes=2, devices=4,
                    log_dir=logs)) == [0, 0], _logs(logs)
  got, want = _safetensors(workdir / "sft_model"), _safetensors(reference / "sft_model")
  assert got.keys() == want.keys()
  for name in want:
    np.testing.assert_allclose(got[name], want[name], atol=1e-4, rtol=0, err_msg=name)
  assert not list(workdir.glob("sft_model.tmp*"))


@pytest.mark.slow
def test_two_processes_train_what_one_process_trains(tmp_path, reference):
  """2 processes x 4 devices = 1 process x 8 devices from the same supervised start: every
  step's loss, gradient norm, rewards and evaluation, and the final parameters; and only
  process 0 writes metrics.jsonl, one line per step.

  (Each run fitting its own start would differ by float reassociation, which a sampled token
  at temperature 1.3 can turn into a different rollout.)"""
  logs = tmp_path / "logs"
  logs.mkdir()
  workdir = with_start(tmp_path / "two", reference)
  assert wait(train(workdir, processes=2, devices=4, log_dir=logs)) == [0, 0], _logs(logs)
  got, want = _records(workdir), _records(reference)
  assert [r["step"] for r in got] == list(range(NUM_STEPS + 1))
  _assert_same_metrics(got, want)
  assert any(r.get("grad_norm", 0) > 0.1 for r in want)  # Not a run of zero updates.
  step_a, params_a = _final_params(reference)
  step_b, params_b = _final_params(workdir)
  assert step_a == step_b == NUM_STEPS
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0), params_a,
               params_b)
  # Process 1 draws no progress bar and writes nothing of its own.
  process_1 = [p for p in logs.glob("train_1_*.log")][0].read_text()
  assert "RL:" not in process_1


@pytest.mark.slow
def test_preempted_then_killed_processes_resume_exactly(tmp_path, reference):
  """SIGTERM to both processes: they save at the next step boundary and exit 0. Rerun, then
  SIGKILL both after a later checkpoint; the third run finishes with the metrics and parameters
  of the uninterrupted run."""
  logs = tmp_path / "logs"
  logs.mkdir()
  workdir = with_start(tmp_path / "interrupted", reference)

  running = train(workdir, processes=2, devices=4, log_dir=logs)
  assert _wait_for_step(workdir, 1, running), _logs(logs)
  for p in running:
    p.send_signal(signal.SIGTERM)
  assert wait(running) == [0, 0], _logs(logs)
  stopped = checkpointing.Checkpointer(workdir, read_only=True).latest_step()
  assert 1 <= stopped < NUM_STEPS, "the run finished before SIGTERM arrived"
  assert max(r["step"] for r in _records(workdir)) == stopped

  running = train(workdir, processes=2, devices=4, log_dir=logs)
  assert _wait_for_step(workdir, stopped + 1, running), _logs(logs)
  for p in running:
    p.send_signal(signal.SIGKILL)
  wait(running)

  assert wait(train(workdir, processes=2, devices=4, log_dir=logs)) == [0, 0], _logs(logs)
  _assert_same_metrics(_records(workdir), _records(reference))
  step_a, params_a = _final_params(reference)
  step_b, params_b = _final_params(workdir)
  assert step_a == step_b == NUM_STEPS
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0), params_a,
               params_b)


@pytest.mark.slow
def test_two_processes_evaluate_what_one_process_evaluates(tmp_path, reference):
  """`stabledrl_jax.evaluate` on the reference's checkpoint: the same files and scored table."""
  logs = tmp_path / "logs"
  logs.mkdir()
  args = [f"--checkpoint={reference}", "--task=sudoku", "--data=sudoku=synthetic",
          "--limit=8", "--gen_lengths=40", "--block_length=40", "--steps=20", "--batch_size=2",
          "--shard_size=2", "--mesh=-1,1,1"]
  out = {}
  for name, processes, devices in (("one", 1, 4), ("two", 2, 2)):
    out[name] = tmp_path / name
    running = launch("stabledrl_jax.evaluate", [*args, f"--output_dir={out[name]}"],
                     processes=processes, devices=devices, log_dir=logs)
    assert wait(running) == [0] * processes, _logs(logs)
  files = sorted(p.name for p in out["one"].glob("*_generations.json"))
  assert len(files) == 4 and files == sorted(p.name for p in out["two"].glob("*_generations.json"))
  for name in files:
    one = json.loads((out["one"] / name).read_text())
    two = json.loads((out["two"] / name).read_text())
    assert one["generations"] == two["generations"]
  one = json.loads((out["one"] / "results.json").read_text())
  two = json.loads((out["two"] / "results.json").read_text())
  assert one == two


@pytest.mark.slow
def test_one_process_saves_on_a_signal_and_fills_the_compilation_cache(tmp_path, reference):
  """One process alone: SIGTERM (preemption), then in the rerun SIGINT (Ctrl-C), each saves the
  step it is on and exits 0; the third run finishes with the uninterrupted run's metrics.
  ``train.compilation_cache_dir`` receives the compiled steps."""
  logs = tmp_path / "logs"
  logs.mkdir()
  workdir = with_start(tmp_path / "one", reference)
  cache = tmp_path / "cache"
  extra = (f"--config.train.compilation_cache_dir={cache}",)
  stopped = 0
  for signum in (signal.SIGTERM, signal.SIGINT):
    running = train(workdir, *extra, processes=1, devices=8, log_dir=logs)
    assert _wait_for_step(workdir, stopped + 1, running), _logs(logs)
    running[0].send_signal(signum)
    assert wait(running) == [0], _logs(logs)
    saved = checkpointing.Checkpointer(workdir, read_only=True).latest_step()
    assert stopped < saved < NUM_STEPS, f"{signum!r}: the run finished before the signal arrived"
    assert max(r["step"] for r in _records(workdir)) == saved
    stopped = saved
  assert any(cache.iterdir())
  assert wait(train(workdir, *extra, processes=1, devices=8, log_dir=logs)) == [0], _logs(logs)
  _assert_same_metrics(_records(workdir), _records(reference), atol=0)


def _wait_for_line(log_dir, prefix, running, timeout=300):
  """Whether a process's log (process 0's) shows a line starting with ``prefix`` in time."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    if any(p.poll() is not None for p in running):
      return False
    for log in pathlib.Path(log_dir).glob("train_0_*.log"):
      if any(line.startswith(prefix) for line in log.read_text().splitlines()):
        return True
    time.sleep(0.02)
  return False


@pytest.mark.slow
def test_preempted_processes_save_the_supervised_start_and_continue_it(tmp_path, reference):
  """SIGTERM to both processes during the supervised start: they agree on a step, save its
  progress (parameters, optimizer state, step) and exit 0 with the workdir released; the rerun
  continues from that step and fits the uninterrupted start (the reference's, up to float
  reassociation between 2 x 4 and 1 x 8 devices)."""
  logs = tmp_path / "logs"
  logs.mkdir()
  workdir = tmp_path / "sft"
  extra = ("--config.train.num_steps=0",)
  running = train(workdir, *extra, processes=2, devices=4, log_dir=logs)
  assert _wait_for_line(logs, "sft step 0", running), _logs(logs)
  for p in running:
    p.send_signal(signal.SIGTERM)
  assert wait(running) == [0, 0], _logs(logs)
  progress = checkpointing.Checkpointer(workdir, read_only=True, subdir="sft_progress")
  steps = progress.all_steps()
  progress.close()
  assert len(steps) == 1 and 1 <= steps[0] < 40, (steps, _logs(logs))
  assert not (workdir / "sft_model").exists() and not (workdir / "LOCK").exists()

  for log in logs.glob("*.log"):
    log.unlink()
  assert wait(train(workdir, *extra, processes=2, devices=4, log_dir=logs)) == [0, 0], (
      _logs(logs))
  assert f"continuing the supervised start from step {steps[0]}" in _logs(logs)
  assert not (workdir / "sft_progress").exists()
  got, want = _safetensors(workdir / "sft_model"), _safetensors(reference / "sft_model")
  for name in want:
    np.testing.assert_allclose(got[name], want[name], atol=1e-4, rtol=0, err_msg=name)


_LAYOUT_SCRIPT = """
import sys
import ml_collections, numpy as np
from absl import flags
from stabledrl_jax.training.parallel import mesh as mesh_lib, multihost
multihost.define_flags()
flags.FLAGS(sys.argv)
multihost.initialize_from_flags()
import jax
me = jax.process_index()
# Two slices (a process each), the data axis across them: every slice is one process's devices.
sliced = mesh_lib.make_mesh(ml_collections.ConfigDict(dict(data=2, fsdp=2, tensor=1, dcn_data=2)))
assert {d.process_index for d in sliced.devices[me].flat} == {me}, sliced.devices
# Rows interleaved between the processes: this process holds rows 2-3 and 6-7 (process 0) or
# 0-1 and 4-5 (process 1) of 8.
devices = jax.devices()
order = [devices[i] for i in (2, 0, 3, 1)]  # process 1, 0, 1, 0
mesh = jax.sharding.Mesh(np.asarray(order).reshape(4, 1, 1), mesh_lib.MESH_AXES)
rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
split = multihost.row_split(rows, 8)
assert split.rows.tolist() == ([2, 3, 6, 7] if me == 0 else [0, 1, 4, 5]), split
values = np.stack([split.rows * 10.0, split.rows + 0.5], axis=1)
array = multihost.to_global(values, rows, 8)
total = float(jax.jit(lambda x: x[:, 0].sum())(array))
assert total == 10.0 * sum(range(8)), total
np.testing.assert_array_equal(multihost.local_rows(array, split), values)
everything = multihost.gather_rows(values, split)
np.testing.assert_array_equal(everything[:, 0], np.arange(8) * 10.0)
assert multihost.sum_over_rows([1.0], split).tolist() == [2.0]
assert split.groups(2).tolist() == ([1, 3] if me == 0 else [0, 2])
print("OK")
"""


@pytest.mark.slow
def test_two_processes_lay_out_slices_and_interleaved_rows(tmp_path):
  """A hybrid mesh puts each slice (process) on its own part of the data axis; rows that
  interleave between processes are assembled, read back and gathered in order."""
  running = launch(None, ["-c", _LAYOUT_SCRIPT], processes=2, devices=2, log_dir=tmp_path)
  assert wait(running) == [0, 0], _logs(tmp_path)


# ---------------------------------------------------------------------------
# Pieces, in this process.
# ---------------------------------------------------------------------------


def test_one_process_holds_every_row_and_gathers_are_identities():
  mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
  split = multihost.row_split(sharding, 12)
  np.testing.assert_array_equal(split.rows, np.arange(12))
  np.testing.assert_array_equal(split.groups(4), [0, 1, 2])
  values = np.arange(24, dtype=np.float32).reshape(12, 2)
  np.testing.assert_array_equal(multihost.gather_rows(values, split), values)
  np.testing.assert_array_equal(multihost.sum_over_rows([1.0, 2.0], split), [1.0, 2.0])
  array = multihost.to_global(values, sharding, 12)
  np.testing.assert_array_equal(multihost.local_rows(array, split), values)


def test_a_mesh_says_which_microbatches_fit_it():
  config = config_lib.from_file(REPO / "configs" / "llada8b_math.py")
  specs.validate(config, num_devices=8)
  with pytest.raises(ValueError, match=r"train.microbatch_groups.*one of \[16, 32\]"):
    specs.validate(config, num_devices=256)
  config.train.microbatch_groups = 16
  specs.validate(config, num_devices=256)
  assert specs.microbatch_groups_for(config, 64) == [4, 8, 16, 32]


def test_a_slice_count_must_divide_the_data_axis():
  config = config_lib.base_config()
  config.mesh.update(data=2, fsdp=-1, dcn_data=4)
  with pytest.raises(ValueError, match="mesh.dcn_data"):
    specs.validate(config, num_devices=8)


def test_a_group_split_between_processes_is_refused():
  split = multihost.RowSplit(rows=np.arange(6, 12), num_rows=12, primary=False)
  with pytest.raises(ValueError, match="splits a group of 4"):
    split.groups(4)
  np.testing.assert_array_equal(split.groups(3), [2, 3])


@pytest.mark.parametrize("given", [
    dict(coordinator_address="127.0.0.1:1234"),
    dict(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=2),
])
def test_start_up_flags_are_checked(given):
  with pytest.raises(ValueError, match="process"):
    multihost.initialize(**given)


def test_one_process_or_no_cluster_initializes_nothing(monkeypatch):
  for name in ("TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS", "SLURM_STEP_NUM_TASKS",
               "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(name, raising=False)
  assert multihost.detected_cluster() is None
  assert not multihost.initialize()
  assert not multihost.initialize("127.0.0.1:1234", 1, 0)
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "10.0.0.1")  # One host: nothing to join.
  assert multihost.detected_cluster() is None
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "10.0.0.1,10.0.0.2")
  assert multihost.detected_cluster() == "TPU_WORKER_HOSTNAMES"


def test_a_cloud_tpu_vm_is_detected_the_way_jax_detects_it(monkeypatch):
  """On a pod worker reached by ssh no launcher variable is set; JAX's TPU detection (its
  metadata server) decides."""
  from jax._src.clusters import cloud_tpu_cluster  # pylint: disable=g-import-not-at-top
  for name in ("TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS", "SLURM_STEP_NUM_TASKS",
               "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(name, raising=False)
  assert multihost.detected_cluster() is None
  monkeypatch.setattr(cloud_tpu_cluster.GceTpuCluster, "is_env_present",
                      classmethod(lambda cls: True))
  assert multihost.detected_cluster() == "GceTpuCluster"


def test_the_reward_pool_scores_what_this_process_scores():
  task = tasks.get_task("countdown")
  examples = list(tasks.CountdownGenerator(6, seed=0))
  texts = [f"<reasoning>.</reasoning><answer>{ex.reference}</answer>" if i % 2 else "no answer"
           for i, ex in enumerate(examples)]
  serial = reward_pool.RewardScorer(task, "d1")
  pooled = reward_pool.RewardScorer(task, "d1", workers=2)
  try:
    # Each worker warmed math-verify up when it started, before any answer.
    assert pooled._get_pool().apply(math_equivalence.is_warm)  # pylint: disable=protected-access
    np.testing.assert_array_equal(pooled(texts, examples), serial(texts, examples))
  finally:
    pooled.close()
  values = serial(texts, examples)
  assert values.shape == (6, len(task.reward_terms("d1")))
  assert values[1::2].sum() > values[::2].sum()  # Right answers score, "no answer" does not.


def test_the_launchers_start_the_trainer_with_the_right_process_flags():
  """The Slurm task and the TPU pod launcher, dry runs: the commands they would start."""
  slurm = subprocess.run(
      ["bash", str(REPO / "scripts/launch_slurm.sh"), "--task", "configs/llada8b_math.py",
       "/shared/run", "--config.mesh.data=2"],
      env={**os.environ, "DRY_RUN": "1", "COORDINATOR_ADDRESS": "node1:12355",
           "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}, capture_output=True, text=True, check=True)
  assert slurm.stdout.split() == [
      "python", "-m", "stabledrl_jax.train", "--config=configs/llada8b_math.py",
      "--workdir=/shared/run", "--coordinator_address=node1:12355", "--num_processes=2",
      "--process_id=1", "--config.mesh.data=2"]
  pod = subprocess.run(
      ["bash", str(REPO / "scripts/launch_tpu_pod.sh"), "train", "pod", "us-east5-a",
       "configs/llada8b_math.py", "gs://bucket/run", "--config.train.microbatch_groups=4"],
      env={**os.environ, "DRY_RUN": "1"}, capture_output=True, text=True, check=True)
  assert "tpu-vm ssh pod --zone us-east5-a --worker=all" in pod.stdout
  assert ("stabledrl_jax.train\\ --config=configs/llada8b_math.py\\ "
          "--workdir=gs://bucket/run\\ --config.train.microbatch_groups=4") in pod.stdout
  for script in ("launch_slurm.sh", "launch_tpu_pod.sh"):
    subprocess.run(["bash", "-n", str(REPO / "scripts" / script)], check=True)
