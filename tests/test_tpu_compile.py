"""Judged by the TPU compiler: the train step and the samplers compile for TPU v5e slices.

libtpu (in the test extra) compiles on this CPU host for compile-only devices of a topology
(`stabledrl_jax.tpu_compile`): v5e 2x2 (4 chips, one host) and v5e 4x4 (16 chips, 4 hosts).
Tiny configs (the quickstarts at 2 x 2 rollouts); each compile takes seconds. Every result must
fit a v5e chip (16 GiB) with positive bytes, and the splash kernel must be in the compiled program
exactly where the attention is splash ('auto' on TPU, but for narrow-head calls over a KV cache).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("libtpu", reason="libtpu is not installed (pip install 'jax[tpu]', in the "
                                     "test extra): no TPU compiler to compile for a topology")

# pylint: disable=g-import-not-at-top,wrong-import-position
from stabledrl_jax import libtpu_env, tpu_compile
from stabledrl_jax.training.config import config_lib, run_spec

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = {"llada": "quickstart", "sdar": "sdar_tiny_quickstart"}
SPLASH_CALL = "tpu_custom_call"  # A Pallas kernel's custom call in the compiled HLO.
# conftest.py's persistent compilation cache must stay out of these compiles (their executables
# cannot be read back: tpu_compile.no_persistent_cache).
pytestmark = pytest.mark.filterwarnings(
    "error:Error (reading|writing) persistent compilation cache entry:UserWarning")


@pytest.fixture(scope="module")
def v5e_2x2():
  devices = tpu_compile.topology_devices("v5e:2x2")
  assert len(devices) == 4 and {d.process_index for d in devices} == {0}
  return devices


def tiny(family, *, attention="", mesh=None, rollouts=(2, 2)):
  config = config_lib.from_file(REPO / "configs" / f"{CONFIGS[family]}.py")
  config.rollout.update(num_prompts=rollouts[0], group_size=rollouts[1])
  config.eval.batch_size = 4
  config.model.attention = attention
  config.mesh.update(**(mesh or dict(data=1, fsdp=-1, tensor=1)))
  return config


def check(result, *, splash):
  memory = result.memory
  assert result.hbm_bytes == 16 * 2**30  # v5e
  assert 0 < memory["temp"] and 0 < memory["total"] <= result.hbm_bytes, memory
  assert result.fits
  assert (SPLASH_CALL in result.compiled.as_text()) == splash, result.what


@pytest.mark.parametrize("family,attention,mesh", [
    ("llada", "xla", None),
    ("llada", "", None),  # auto: splash on TPU
    ("sdar", "splash", dict(data=1, fsdp=2, tensor=2)),  # kv heads split over 'tensor'
])
def test_train_step(v5e_2x2, family, attention, mesh):
  result = tpu_compile.compile_train_step(tiny(family, attention=attention, mesh=mesh), v5e_2x2)
  check(result, splash=attention != "xla")


def test_train_step_on_a_multi_host_slice():
  """v5e 4x4: 16 chips on 4 hosts, FSDP over all of them."""
  devices = tpu_compile.topology_devices("v5e:4x4")
  assert len(devices) == 16 and len({d.process_index for d in devices}) == 4
  result = tpu_compile.compile_train_step(tiny("llada", rollouts=(4, 4)), devices)
  check(result, splash=True)


@pytest.mark.parametrize("family,cache,remasking", [
    # Every cache and every remasking rule of each family at least once.
    ("llada", "none", "low_confidence"),
    ("llada", "prefix", "threshold"),
    ("llada", "dual", "random"),
    ("sdar", "none", "low_confidence_static"),
    ("sdar", "none", "low_confidence_dynamic"),
])
def test_rollout_sampler(v5e_2x2, family, cache, remasking):
  config = tiny(family)
  settings = tpu_compile.rollout_decoding(config, cache=cache, remasking=remasking)
  # 'auto' at the tiny head dimension: SDAR's sampler runs every call over its KV cache, with
  # xla (measured to need less: test_auto_leaves_the_cached_calls_of_a_narrow_head_to_xla).
  check(tpu_compile.compile_decode(config, v5e_2x2, settings, what=f"{cache} {remasking}"),
        splash=family == "llada")


@pytest.mark.parametrize("family,cache", [("llada", "prefix"), ("sdar", "none")])
def test_auto_leaves_the_cached_calls_of_a_narrow_head_to_xla(v5e_2x2, family, cache):
  """'auto' at a head dimension under 128 lanes (the tiny configs' 16;
  experiments/attention_choice.py): splash for the full passes, xla for the calls over a KV
  cache, so its program has fewer splash kernels than
  model.attention='splash''s: LLaDA's prefix-cache sampler keeps splash for each block's first
  (full) pass; every call of SDAR's sampler, the prompt's included, goes over its cache."""
  counts = {}
  for attention in ("", "splash"):
    config = tiny(family, attention=attention)
    result = tpu_compile.compile_decode(config, v5e_2x2,
                                        tpu_compile.rollout_decoding(config, cache=cache))
    counts[attention or "auto"] = result.compiled.as_text().count(SPLASH_CALL)
  assert counts["auto"] < counts["splash"], counts
  assert (counts["auto"] > 0) == (family == "llada"), counts


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_evaluation_decode(v5e_2x2, family):
  config = tiny(family)
  result = tpu_compile.compile_decode(config, v5e_2x2, run_spec.Decoding.of_eval(config),
                                      rows=config.eval.batch_size, what="eval")
  check(result, splash=family == "llada")


def test_an_unknown_topology_is_one_line():
  with pytest.raises(ValueError, match=r"^TPU topology 'v5e:3x7': ") as error:
    tpu_compile.topology_devices("v5e:3x7")
  assert "\n" not in str(error.value)


def _fresh_env():
  """This environment without what importing stabledrl_jax set, nor a platform choice."""
  return {k: v for k, v in os.environ.items()
          if k not in libtpu_env.QUIET_ENV and k != "JAX_PLATFORMS"}


@pytest.mark.skipif(libtpu_env.tpu_attached(), reason="a TPU host: libtpu's variables are its own")
def test_libtpu_is_quiet_where_there_is_no_tpu():
  """With libtpu installed, a JAX process prints libtpu's warnings about TPU_WORKER_HOSTNAMES
  etc.; one that imports stabledrl_jax first prints nothing and takes no lock file."""
  def stderr(code):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=_fresh_env(), check=True)
    return done.stderr

  assert "TPU_WORKER_HOSTNAMES" in stderr("import jax; jax.devices()")
  assert stderr("import stabledrl_jax, jax; jax.devices()") == ""
  # Two processes at once (the first holds libtpu while the second compiles for a topology).
  holder = subprocess.Popen(
      [sys.executable, "-c", "import stabledrl_jax, jax, time; jax.devices(); time.sleep(5)"],
      env=_fresh_env())
  try:
    assert stderr("import stabledrl_jax.tpu_compile as t; print(len(t.topology_devices()))"
                  ) == ""
  finally:
    holder.wait(timeout=60)


def test_the_attention_choice_script_prints_its_table(tmp_path):
  """experiments/attention_choice.py at a tiny shape (the exact sampler, the cheapest program):
  each kernel's bytes, the smaller one, and auto's, which are splash's program (full passes)."""
  out = tmp_path / "choice.json"
  tiny_shape = ["--override", "d_model=64", "--override", "n_heads=4", "--override",
                "n_kv_heads=2", "--override", "n_layers=2", "--override", "mlp_hidden_size=128"]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
  result = subprocess.run(
      [sys.executable, str(REPO / "experiments" / "attention_choice.py"), "--families", "llada",
       "--dtypes", "float32", "--programs", "none", *tiny_shape, f"--output={out}"],
      capture_output=True, text=True, cwd=REPO, timeout=600, env=env, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "| llada | 16 | float32 | none |" in result.stdout
  (row,) = json.loads(out.read_text())
  assert row["head_dim"] == 16 and row["program"] == "none"
  assert row["smaller"] == ("splash" if row["splash"] < row["xla"] else "xla")
  assert 0 < row["xla"] != row["splash"] > 0
  assert row["auto"] == row["splash"]  # No call over a cache: auto is splash on TPU.
