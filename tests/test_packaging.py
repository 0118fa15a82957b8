"""A non-editable install: the wheel carries the configs, the task data and the console scripts,
and `--config NAME` finds a shipped config from anywhere."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

from stabledrl_jax.training import config_lib

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  """The package built as a wheel and installed (without dependencies) into its own folder."""
  root = tmp_path_factory.mktemp("wheel")
  # Built from a copy: setuptools writes build/ into the source tree, and a stale build/ there
  # could carry removed modules into the wheel.
  source = root / "source"
  shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
      ".git", ".ci-venv", ".venv", "build", "dist", "runs", "*.egg-info", "__pycache__"))
  subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                  "--no-build-isolation", "-w", str(root / "dist"), str(source)],
                 check=True, capture_output=True, timeout=600)
  wheel = next((root / "dist").glob("stabledrl_jax-*.whl"))
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                  str(root / "site"), str(wheel)], check=True, capture_output=True, timeout=600)
  return root / "site"


def test_the_wheel_has_the_configs_data_and_console_scripts(installed, tmp_path):
  script = textwrap.dedent("""
      import json, sys
      import stabledrl_jax
      from stabledrl_jax import tasks
      from stabledrl_jax.training import config_lib
      argv = config_lib.resolve_config_flag(["train", "--config", "quickstart",
                                             "--config.seed=3"])
      config = config_lib.get("llada8b_gsm8k")
      print(json.dumps(dict(package=stabledrl_jax.__file__, names=config_lib.config_names(),
                            argv=argv, checkpoint=config.model.checkpoint,
                            data=[str(tasks.PACKAGED_DATA / p) for p in tasks.packaged_files()],
                            heavy="jax" in sys.modules)))
  """)
  env = dict(os.environ, PYTHONPATH=str(installed))
  out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, check=True,
                       capture_output=True, text=True, timeout=300)
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert got["package"].startswith(str(installed))
  assert {"quickstart", "llada8b_gsm8k", "sdar8b_math", "stress_test"} <= set(got["names"])
  assert got["argv"][2].startswith(str(installed)) and got["argv"][2].endswith("quickstart.py")
  assert got["argv"][3] == "--config.seed=3"
  assert got["checkpoint"] == "GSAI-ML/LLaDA-8B-Instruct"
  assert len(got["data"]) == 2 and all(p.startswith(str(installed)) for p in got["data"])
  assert not got["heavy"], "the configs and config_lib must not import jax"
  entry_points = next(installed.glob("stabledrl_jax-*.dist-info")) / "entry_points.txt"
  text = entry_points.read_text()
  for name in ("stabledrl-train", "stabledrl-evaluate", "stabledrl-score", "stabledrl-export"):
    assert name in text


def test_config_flag_names_and_paths():
  assert config_lib.config_path("configs/quickstart.py") == "configs/quickstart.py"
  assert config_lib.config_path("quickstart").endswith(os.path.join("configs", "quickstart.py"))
  assert config_lib.config_path("stress_test:grpo").endswith("stress_test.py:grpo")
  argv = config_lib.resolve_config_flag(["x", "--config=quickstart", "--config.seed=1"])
  assert argv[1].startswith("--config=") and argv[1].endswith("quickstart.py")
  with pytest.raises(FileNotFoundError, match="'quikstart' is neither a file nor a shipped"):
    config_lib.config_path("quikstart")


def test_train_takes_a_config_name(tmp_path):
  """`python -m stabledrl_jax.train --config NAME` runs (validation of a bad override included)."""
  out = subprocess.run(
      [sys.executable, "-m", "stabledrl_jax.train", "--config", "quickstart", "--workdir",
       str(tmp_path / "run"), "--config.rollout.gen_length=7"],
      capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode != 0 and "config.rollout.gen_length" in out.stderr
  missing = subprocess.run(
      [sys.executable, "-m", "stabledrl_jax.train", "--config", "nope", "--workdir",
       str(tmp_path / "run")], capture_output=True, text=True, timeout=300)
  assert missing.returncode != 0 and "'nope' is neither a file nor a shipped config" in (
      missing.stderr)
