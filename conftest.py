"""pytest setup shared by tests/ and notebooks/: compile once, compile fast.

Most of the suite's time is XLA compiling tiny models on CPU, not running them:

* One JAX compilation cache for the whole run. Many tests compile the same computations (the
  trainer's step in-process, in `python -m stabledrl_jax.train` subprocesses, in each xdist
  worker and in the notebooks' kernels); JAX's persistent cache keys an executable by its HLO and
  options, so each compiles once per run. It lives in .pytest_cache/ (git-ignored); set
  JAX_COMPILATION_CACHE_DIR to move it, or to '' to turn it off.
* Unoptimized machine code (`--xla_backend_optimization_level=0`: LLVM's -O0; XLA's own graph
  optimizations still run) for the tests and the processes they start, which compile in about
  two thirds of the time and run toy shapes as fast. Set XLA_FLAGS with any backend level to
  override.
* The notebooks run every cell at toy size (STABLEDRL_NOTEBOOK_TOY=1,
  ``sweep.notebook_size``): what they test is that each cell runs; the README's quickstart guard
  (tests/test_experiments.py) trains at full size. Set STABLEDRL_NOTEBOOK_TOY=0 to run them at
  their own size, with XLA's default optimization.

Subprocesses and notebook kernels inherit these settings through the environment.
"""

import os
import pathlib

import hypothesis

_CACHE = pathlib.Path(__file__).resolve().parent / ".pytest_cache" / "jax-compilation-cache"
_FAST_COMPILE = "--xla_backend_optimization_level=0"
_USER_XLA_FLAGS = os.environ.get("XLA_FLAGS")
_NOTEBOOK_TOY = "STABLEDRL_NOTEBOOK_TOY"  # = sweep.TOY_ENV (read without importing the package)
_USER_NOTEBOOK_TOY = os.environ.get(_NOTEBOOK_TOY)

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))
# Small programs compile faster than they load from disk.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
if "xla_backend_optimization_level" not in (_USER_XLA_FLAGS or ""):
  os.environ["XLA_FLAGS"] = f"{_USER_XLA_FLAGS or ''} {_FAST_COMPILE}".strip()
_TEST_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")

# Hypothesis: tests/examples.py scales each test's example count by the profile ('ci' by
# default, a quarter; 'full': --hypothesis-profile=full or HYPOTHESIS_PROFILE=full).
hypothesis.settings.register_profile("full", max_examples=100, deadline=None)
hypothesis.settings.register_profile("ci", max_examples=25, deadline=None)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

if os.environ["JAX_COMPILATION_CACHE_DIR"]:
  pathlib.Path(os.environ["JAX_COMPILATION_CACHE_DIR"]).mkdir(parents=True, exist_ok=True)
  import jax  # pylint: disable=g-import-not-at-top

  # In case a plugin imported JAX before the variables above were set.
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


def _is_notebook(item) -> bool:
  return pathlib.Path(str(item.path)).suffix == ".ipynb"


def pytest_runtest_setup(item):
  """A notebook's kernel (started by nbmake during the test) runs at toy size unless the user
  says otherwise; at its own size it gets the user's XLA_FLAGS."""
  if _is_notebook(item):
    if _USER_NOTEBOOK_TOY is None:
      os.environ[_NOTEBOOK_TOY] = "1"
    if os.environ[_NOTEBOOK_TOY] == "1":
      return
    if _USER_XLA_FLAGS is None:
      os.environ.pop("XLA_FLAGS", None)
    else:
      os.environ["XLA_FLAGS"] = _USER_XLA_FLAGS


def pytest_runtest_teardown(item):
  if _is_notebook(item):
    os.environ["XLA_FLAGS"] = _TEST_XLA_FLAGS
    if _USER_NOTEBOOK_TOY is None:
      os.environ.pop(_NOTEBOOK_TOY, None)


def pytest_collection_modifyitems(items):
  """The end-to-end tests first (``slow``), the README's quickstart guard (a third of the
  suite's time on its own) before them all: xdist hands the first quarter of the items out
  round robin, so the longest run beside the rest rather than after them."""
  first = "test_quickstart_gains_ten_points_for_seed_0"
  items.sort(key=lambda item: (item.name != first, item.get_closest_marker("slow") is None))
