"""A non-editable install: the wheel carries every package (the trainer included), the configs,
the task data and the console scripts, and works from a fresh virtual environment.

The fresh environment has the wheel installed and borrows the third-party dependencies of the
test environment (no network, no downloads) through a directory of links to its site-packages
entries, less this project's editable install (the ``__editable__`` finder and .pth, the
dist-info): a module missing from the wheel then fails to import, as on a user's machine, instead
of being served from the source tree by the editable finder.
"""

import ast
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

from stabledrl_jax import cli_flags
from stabledrl_jax.training.config import config_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "stabledrl_jax"


def _python_dirs(root: pathlib.Path) -> list[pathlib.Path]:
  """The directories under ``root`` (itself included) that hold .py files."""
  return sorted({p.parent for p in root.rglob("*.py") if "__pycache__" not in p.parts})


def _source_modules() -> set[str]:
  """The wheel's module files as the source tree gives them (stabledrl_jax/... and configs/ as
  stabledrl_jax/configs/...), the reference the wheel is checked against."""
  files = {str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
  files |= {f"stabledrl_jax/configs/{p.name}" for p in (REPO / "configs").glob("*.py")}
  return files


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
  """The package built as a wheel."""
  root = tmp_path_factory.mktemp("wheel")
  # Built from a copy: setuptools writes build/ into the source tree, and a stale build/ there
  # could carry removed modules into the wheel.
  source = root / "source"
  shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
      ".git", ".ci-venv", ".venv", "build", "dist", "runs", "*.egg-info", "__pycache__",
      ".pytest_cache"))
  subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                  "--no-build-isolation", "-w", str(root / "dist"), str(source)],
                 check=True, capture_output=True, timeout=600)
  return next((root / "dist").glob("stabledrl_jax-*.whl"))


def _is_this_project(entry: pathlib.Path) -> bool:
  """An entry of site-packages that installs this project (editable or not)."""
  name = entry.name
  if name.startswith(("__editable__", "stabledrl_jax")) or name.endswith(".egg-link"):
    return True
  if name.endswith(".pth"):
    text = entry.read_text(errors="replace")
    return "__editable__" in text or str(REPO) in text
  return False


def _parent_site_dirs() -> list[pathlib.Path]:
  return [pathlib.Path(p) for p in dict.fromkeys(sys.path)
          if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> dict[str, pathlib.Path]:
  """A fresh virtual environment with the wheel installed: {python, site, bin}."""
  root = tmp_path_factory.mktemp("venv")
  env_dir = root / "env"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True,
                 capture_output=True, timeout=120)
  python = env_dir / "bin" / "python"
  site = pathlib.Path(subprocess.run(
      [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
      check=True, capture_output=True, text=True, timeout=60).stdout.strip())
  # The dependencies: links to the test environment's site-packages entries, less this project.
  deps = root / "deps"
  deps.mkdir()
  for site_dir in _parent_site_dirs():
    for entry in site_dir.iterdir():
      if entry.name != "__pycache__" and not _is_this_project(entry) and not (
          deps / entry.name).exists():
        (deps / entry.name).symlink_to(entry)
  # After the environment's own site-packages (so the wheel comes first), with their .pth files.
  (site / "zz_test_dependencies.pth").write_text(f"import site; site.addsitedir({str(deps)!r})\n")
  subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                  "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True,
                 timeout=600)
  return {"python": python, "site": site, "bin": env_dir / "bin"}


def _env() -> dict[str, str]:
  """The environment of a user's shell: nothing of the checkout on the path, CPU only."""
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
  return {**env, "JAX_PLATFORMS": "cpu", "PYTHONNOUSERSITE": "1", "HF_HUB_OFFLINE": "1"}


def _run_python(venv, script: str, cwd: pathlib.Path, timeout: int = 300) -> dict:
  out = subprocess.run([str(venv["python"]), "-c", textwrap.dedent(script)], cwd=cwd, env=_env(),
                       capture_output=True, text=True, timeout=timeout)
  assert out.returncode == 0, out.stderr[-4000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------
# The source tree and the wheel.
# ---------------------------------------------------------------------------


def test_every_package_directory_is_a_regular_package():
  """find_packages (setup.py) skips a directory without __init__.py: its modules would be missing
  from every non-editable install."""
  for directory in _python_dirs(PACKAGE):
    init = directory / "__init__.py"
    assert init.is_file(), f"{directory.relative_to(REPO)} has no __init__.py"
    assert ast.get_docstring(ast.parse(init.read_text())), f"{init} has no docstring"



# training/'s rooms, lowest first (docs/training.md): each imports only the rooms before it.
TRAINING_ROOMS = ("inputs", "parallel", "config", "step", "state", "loop")


def test_the_training_rooms_import_one_way():
  """Every module of training/ sits in a room, and its imports (deferred ones included) reach
  only its own room and the rooms before it; the rooms' __init__ files import nothing, so that
  ``config_lib`` loads without jax."""
  training = PACKAGE / "training"
  assert sorted(p.name for p in training.glob("*.py")) == ["__init__.py"]
  assert sorted(p.name for p in training.iterdir() if p.is_dir() and p.name != "__pycache__") \
      == sorted(TRAINING_ROOMS)
  wrong = []
  for rank, room in enumerate(TRAINING_ROOMS):
    for path in sorted((training / room).glob("*.py")):
      tree = ast.parse(path.read_text())
      if path.name == "__init__.py":
        assert not [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], path
        continue
      for node in ast.walk(tree):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        for name in names:
          parts = name.split(".")
          if parts[:2] == ["stabledrl_jax", "training"] and len(parts) > 2 \
              and TRAINING_ROOMS.index(parts[2]) > rank:
            wrong.append(f"{room}/{path.name} imports {name}")
  assert not wrong, wrong
  # The old flat names point at their rooms (a config file importing one is told the new path).
  import stabledrl_jax.training as training_package  # pylint: disable=g-import-not-at-top
  layout = {path.stem: path.parent.name for room in TRAINING_ROOMS
            for path in (training / room).glob("*.py") if path.stem != "__init__"}
  moved = training_package._ROOM_OF  # pylint: disable=protected-access
  assert {name: layout.get(name) for name in moved} == moved
  with pytest.raises(ImportError, match=r"stabledrl_jax\.training\.config_lib is now "
                     r"stabledrl_jax\.training\.config\.config_lib: import it as 'from "
                     r"stabledrl_jax\.training\.config import config_lib'"):
    from stabledrl_jax.training import config_lib  # pylint: disable=g-import-not-at-top,unused-import,reimported

def test_the_wheel_holds_every_module_of_the_source_tree(wheel):
  names = set(zipfile.ZipFile(wheel).namelist())
  directories = {str(d.relative_to(REPO)) for d in _python_dirs(PACKAGE)} | {
      "stabledrl_jax/configs"}
  missing_dirs = sorted(d for d in directories if f"{d}/__init__.py" not in names)
  assert not missing_dirs, f"package directories missing from the wheel: {missing_dirs}"
  missing = sorted(_source_modules() - names)
  assert not missing, f"modules missing from the wheel: {missing}"
  assert "stabledrl_jax/tasks/data/4x4_test_sudoku.csv" in names


def test_the_fresh_environment_has_no_editable_install(venv, tmp_path):
  """The wheel is what imports: not the checkout, not the editable finder."""
  got = _run_python(venv, f"""
      import importlib.metadata, json, os, sys
      import stabledrl_jax
      dist = importlib.metadata.distribution("stabledrl_jax")
      repo = {str(REPO)!r}
      print(json.dumps(dict(
          package=stabledrl_jax.__file__,
          dist=str(dist.locate_file("")),
          direct_url=json.loads(dist.read_text("direct_url.json") or "{{}}"),
          finders=[type(f).__module__ for f in sys.meta_path],
          editable_modules=[m for m in sys.modules if "__editable__" in m],
          repo_on_path=[p for p in sys.path if os.path.realpath(p or ".") == repo
                        or os.path.realpath(p or ".").startswith(repo + os.sep)])))
  """, tmp_path)
  site = str(venv["site"])
  assert got["package"].startswith(site + os.sep), got["package"]
  assert got["dist"].startswith(site), got["dist"]
  assert not got["direct_url"].get("dir_info", {}).get("editable"), got["direct_url"]
  assert not any("__editable__" in name for name in got["finders"]), got["finders"]
  assert not got["editable_modules"] and not got["repo_on_path"], got


def test_the_wheel_has_the_configs_data_and_console_scripts(venv, tmp_path):
  got = _run_python(venv, """
      import json, sys
      import stabledrl_jax
      from stabledrl_jax import cli_flags, tasks
      from stabledrl_jax.training.config import config_lib
      argv = cli_flags.resolve_config_flag(["train", "--config", "quickstart",
                                            "--config.seed=3"])
      config = config_lib.get("llada8b_gsm8k")
      print(json.dumps(dict(package=stabledrl_jax.__file__, names=config_lib.config_names(),
                            argv=argv, checkpoint=config.model.checkpoint,
                            data=[str(tasks.PACKAGED_DATA / p) for p in tasks.packaged_files()],
                            heavy="jax" in sys.modules)))
  """, tmp_path)
  site = str(venv["site"])
  assert got["package"].startswith(site)
  assert {"quickstart", "llada8b_gsm8k", "sdar8b_math", "stress_test"} <= set(got["names"])
  assert got["argv"][2].startswith(site) and got["argv"][2].endswith("quickstart.py")
  assert got["argv"][3] == "--config.seed=3"
  assert got["checkpoint"] == "GSAI-ML/LLaDA-8B-Instruct"
  assert len(got["data"]) == 2 and all(p.startswith(site) for p in got["data"])
  assert not got["heavy"], "the configs and config_lib must not import jax"
  entry_points = next(venv["site"].glob("stabledrl_jax-*.dist-info")) / "entry_points.txt"
  text = entry_points.read_text()
  for name in ("stabledrl-train", "stabledrl-evaluate", "stabledrl-score", "stabledrl-export",
               "stabledrl-plan"):
    assert name in text and (venv["bin"] / name).is_file()


def test_every_module_of_the_installed_package_imports(venv, tmp_path):
  """pkgutil's walk of the installed package, from outside the checkout: each module imports,
  and the walk finds every module of the source tree."""
  got = _run_python(venv, """
      import importlib, json, pkgutil, traceback
      import stabledrl_jax
      found, failed = [], {}
      def onerror(name):
        failed[name] = traceback.format_exc(limit=1)
      for info in pkgutil.walk_packages(stabledrl_jax.__path__, "stabledrl_jax.",
                                        onerror=onerror):
        found.append(info.name)
        try:
          importlib.import_module(info.name)
        except Exception:  # pylint: disable=broad-except
          failed[info.name] = traceback.format_exc(limit=2)
      print(json.dumps(dict(found=found, failed=failed)))
  """, tmp_path, timeout=600)
  assert not got["failed"], got["failed"]
  expected = {path[:-len(".py")].replace("/", ".").removesuffix(".__init__")
              for path in _source_modules()} - {"stabledrl_jax"}
  missing = sorted(expected - set(got["found"]))
  assert not missing, f"modules the installed package lacks: {missing}"


@pytest.mark.slow
def test_one_rl_step_of_the_quickstart_runs_from_the_wheel(venv, tmp_path):
  """`python -m stabledrl_jax.train --config quickstart` in the fresh environment, cwd outside
  the checkout: a short supervised start, then one RL step with its checkpoint."""
  workdir = tmp_path / "run"
  overrides = {"sft.num_steps": 5, "sft.batch_size": 8, "data.train_size": 32,
               "data.eval_size": 4, "rollout.num_prompts": 2, "rollout.group_size": 4,
               "rollout.steps": 10, "train.num_steps": 1, "train.num_iterations": 1,
               "eval.every_steps": 0, "checkpoint.every_steps": 1}
  out = subprocess.run(
      [str(venv["python"]), "-m", "stabledrl_jax.train", "--config", "quickstart", "--workdir",
       str(workdir), *(f"--config.{k}={v}" for k, v in overrides.items())],
      cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-4000:]
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  rl_steps = [r for r in records if "rewards/mean" in r]
  assert [r["step"] for r in rl_steps] == [1], records
  assert math.isfinite(rl_steps[0]["rewards/mean"])
  assert (workdir / "checkpoints" / "1").is_dir() and (workdir / "sft_model").is_dir()
  assert json.loads((workdir / "config.json").read_text())["train"]["num_steps"] == 1


def test_config_flag_names_and_paths():
  assert config_lib.config_path("configs/quickstart.py") == "configs/quickstart.py"
  assert config_lib.config_path("quickstart").endswith(os.path.join("configs", "quickstart.py"))
  assert config_lib.config_path("stress_test:grpo").endswith("stress_test.py:grpo")
  argv = cli_flags.resolve_config_flag(["x", "--config=quickstart", "--config.seed=1"])
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
