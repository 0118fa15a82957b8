"""What a run logs: TRL-style metric names re-derived from the step's rollouts, sample
completions, MFU, and optional W&B (a fake module stands in for wandb)."""

import importlib.util
import json
import subprocess
import sys
import types

import numpy as np
import pytest

from stabledrl_jax import profiling
from stabledrl_jax.training.config import optimizer as optimizer_lib, specs
from stabledrl_jax.training.loop import metrics_writer, trainer

from test_training import tiny_config, workdir_with_start


class _FakeWandb(types.ModuleType):
  """Records what the writer sends to W&B."""

  def __init__(self):
    super().__init__("wandb")
    self.inits, self.logs, self.finished = [], [], 0
    self.util = types.SimpleNamespace(generate_id=lambda: "run123")

  def init(self, **kwargs):
    self.inits.append(kwargs)
    fake = self

    class Run:
      def log(self, metrics, step):
        fake.logs.append((step, dict(metrics)))

      def finish(self):
        fake.finished += 1

    return Run()


def test_a_step_logs_trl_names_samples_and_wandb(tmp_path, sft_start, monkeypatch):
  fake = _FakeWandb()
  monkeypatch.setitem(sys.modules, "wandb", fake)
  config = tiny_config(**{"train.num_steps": 2, "train.num_iterations": 2,
                          "logging.samples_every_steps": 2, "logging.num_samples": 3,
                          "logging.peak_tflops_per_device": 1.0,
                          "logging.wandb.project": "stabledrl-test"})
  workdir = workdir_with_start(tmp_path / "run", sft_start)
  history = trainer.train(config, str(workdir))
  for record in history:
    for name in ("rewards/mean", "rewards/std", "rewards/correctness", "frac_reward_zero_std",
                 "completions/mean_length", "completions/min_length", "completions/max_length",
                 "completions/clipped_ratio", "learning_rate", "perf/tflops_per_s", "perf/mfu",
                 "snis/ess", "clip/frac_upper", "log_ratio/max"):
      assert np.isfinite(record[name]), name
    assert 0 <= record["frac_reward_zero_std"] <= 1 and 0 <= record["completions/clipped_ratio"] <= 1
    assert (record["completions/min_length"] <= record["completions/mean_length"]
            <= record["completions/max_length"] <= config.rollout.gen_length)
    assert record["perf/mfu"] == pytest.approx(record["perf/tflops_per_s"] / 1.0, rel=1e-6)
    # The step's time split: each part measured apart, together within the step's time.
    split = [record[f"time/{part}_s"] for part in ("rollout", "reward", "likelihood", "update")]
    assert all(s > 0 for s in split) and sum(split) <= record["time/step_s"], record
    assert record["rollout/tokens_per_call"] == pytest.approx(
        config.rollout.gen_length / record["rollout/calls_per_completion"])
    assert record["rollout/calls_per_completion"] == config.rollout.steps  # Exact: one a step.
  schedule = optimizer_lib.learning_rate_schedule(config.optimizer, 4)
  assert [h["learning_rate"] for h in history] == pytest.approx(
      [float(schedule(1)), float(schedule(3))])
  # Samples: step 2 only, num_samples of them, with the reward the rollout got.
  samples = metrics_writer.read_metrics(workdir / "samples.jsonl")
  assert [s["step"] for s in samples] == [2, 2, 2]
  assert all(set(s) == {"step", "prompt", "completion", "reward"} for s in samples)
  assert all(isinstance(s["completion"], str) and s["prompt"] for s in samples)
  # W&B: one run, named after the workdir, every scalar of every step.
  assert len(fake.inits) == 1 and fake.inits[0]["project"] == "stabledrl-test"
  assert fake.inits[0]["id"] == "run123" and fake.inits[0]["name"] == "run"
  assert (workdir / "wandb_run_id").read_text() == "run123"
  assert [step for step, _ in fake.logs] == [1, 2]
  assert fake.logs[1][1]["rewards/mean"] == pytest.approx(history[1]["rewards/mean"])
  assert fake.finished == 1


def test_frac_reward_zero_std_by_hand(tmp_path, sft_start):
  """Re-derived from the rollouts themselves: a one-step run's samples.jsonl holds every rollout
  (num_samples = the batch, groups contiguous), from which the statistics are recomputed."""
  config = tiny_config(**{"train.num_steps": 1, "train.num_iterations": 1,
                          "logging.samples_every_steps": 1, "logging.num_samples": 64})
  workdir = workdir_with_start(tmp_path / "run", sft_start)
  record = trainer.train(config, str(workdir))[0]
  samples = metrics_writer.read_metrics(workdir / "samples.jsonl")
  rows = config.rollout.num_prompts * config.rollout.group_size
  assert len(samples) == rows
  rewards = np.array([s["reward"] for s in samples]).reshape(-1, config.rollout.group_size)
  assert record["frac_reward_zero_std"] == pytest.approx(np.mean(rewards.std(-1) < 1e-6))
  assert record["rewards/mean"] == pytest.approx(rewards.mean(), abs=1e-6)
  assert record["rewards/std"] == pytest.approx(rewards.std(), abs=1e-6)


def test_wandb_missing_is_a_config_error(monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # As if not installed: find_spec is None.
  with pytest.raises(ValueError, match=r"config\.logging\.wandb\.project: .*pip install wandb"):
    specs.validate(tiny_config(**{"logging.wandb.project": "p"}))


def test_step_flops_and_peak_table():
  n = 1000
  flops = profiling.rl_step_flops(n, rollout_positions=10, scored_positions=4, num_updates=2,
                                  num_scorings=1)
  assert flops == 2 * n * (10 + 4) + 6 * n * 2 * 4
  fake = types.SimpleNamespace(device_kind="TPU v5 lite")
  assert profiling.peak_flops_per_device(fake) == 197e12
  assert profiling.peak_flops_per_device(types.SimpleNamespace(device_kind="TPU v5p")) == 459e12
  assert profiling.peak_flops_per_device(types.SimpleNamespace(device_kind="cpu")) is None
  json.dumps(profiling.PEAK_FLOPS)


_WRITE_EVENTS = """
import importlib.util, sys
from stabledrl_jax.training.loop import metrics_writer
writer = metrics_writer.MetricsWriter(sys.argv[1])
writer.write(3, {"loss": 0.25})
writer.write_samples(3, [{"reward": 1.0, "prompt": "p", "completion": "c"}])
writer.close()
print("torch loaded:", "torch" in sys.modules)
if importlib.util.find_spec("torch") is not None:
  import torch  # Hidden only while tensorboardX loaded.
  print("torch after:", torch.ones(2).sum().item())
"""


def test_tensorboard_events_are_written_without_loading_torch(tmp_path):
  """The writer loads tensorboardX without torch (1.8 s of every run's start where the peft
  extra installed it); torch still imports after, and the events file holds the scalar and
  the samples' text, read back through TFRecord framing and tensorboardX's protos."""
  out = subprocess.run([sys.executable, "-c", _WRITE_EVENTS, str(tmp_path)], check=True,
                       capture_output=True, text=True).stdout
  assert "torch loaded: False" in out, out
  if importlib.util.find_spec("torch") is not None:
    assert "torch after: 2.0" in out, out
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  (path,) = (tmp_path / "tensorboard").iterdir()
  data, events = path.read_bytes(), []
  while data:  # TFRecord: u64 length, u32 crc, payload, u32 crc.
    length = int.from_bytes(data[:8], "little")
    events.append(event_pb2.Event.FromString(data[12:12 + length]))
    data = data[16 + length:]
  values = [(e.step, v.tag, v.simple_value) for e in events for v in e.summary.value]
  assert (3, "loss", 0.25) in values, values
  assert any(tag.startswith("samples") for _, tag, _ in values), values
