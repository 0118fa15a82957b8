"""The plan command (``python -m stabledrl_jax.plan``): TPU-compiled memory rows, out-of-memory
rows, the settings ladder, the topology names, the analytic step FLOPs and the CPU fallback."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from stabledrl_jax import plan, profiling, tpu_compile
from stabledrl_jax.training.config import config_lib, specs

REPO = pathlib.Path(__file__).resolve().parents[1]
needs_libtpu = pytest.mark.skipif(not tpu_compile.libtpu_available(),
                                  reason="needs libtpu (the test extra)")

ROW_FIELDS = {"what", "config", "overrides", "topology", "topology_name", "compiler", "chips",
              "devices", "settings", "per_chip_bytes", "memory", "chip_bytes", "fits", "error",
              "compile_seconds", "ladder"}


def run_plan(*args, code=None, check=True):
  path = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
  env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
  env["PYTHONPATH"] = path
  command = ["-m", "stabledrl_jax.plan"] if code is None else ["-c", code]
  return subprocess.run([sys.executable, *command, *args], capture_output=True, text=True,
                        cwd=REPO, check=check, timeout=900, env=env)


def test_topology_names():
  assert plan.topology_name("v5litepod-4") == "v5e:2x2"
  assert plan.topology_name("v5litepod-64") == "v5e:8x8"
  assert plan.topology_name("v5litepod-256") == "v5e:16x16"
  assert plan.topology_name("v5p-8") == "v5p:2x2x1"  # 8 TensorCores = 4 chips.
  assert plan.topology_name("v5p-256") == "v5p:4x4x8"
  assert plan.topology_name("v4-8") == "v4:2x2x1"
  assert plan.topology_name("v6e-64") == "v6e:8x8"
  assert plan.topology_name("v5e:4x8") == "v5e:4x8"
  assert plan.topology_name("cpu:8") == "cpu:8"
  for bad, says in [("v5litepod-3", "sizes"), ("v5p-6", "sizes"), ("v7x-8", "accelerator"),
                    ("v9:2x2", "generation")]:
    with pytest.raises(ValueError, match=says) as error:
      plan.topology_name(bad)
    assert "--topology" in str(error.value) and "\n" not in str(error.value)


@needs_libtpu
def test_libtpu_accepts_the_mapped_names():
  for accelerator, devices, kind in [("v5litepod-4", 4, "TPU v5 lite"), ("v5litepod-256", 256,
                                      "TPU v5 lite"), ("v5p-8", 4, "TPU v5"),
                                     ("v5p-256", 128, "TPU v5"), ("v6e-64", 64, "TPU v6 lite"),
                                     ("v4-8", 8, "TPU v4")]:  # libtpu lists v4's 2 cores a chip.
    got = tpu_compile.topology_devices(plan.topology_name(accelerator))
    assert len(got) == devices and got[0].device_kind == kind, accelerator


def test_out_of_memory_messages_are_parsed():
  one = plan.parse_out_of_memory(
      "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
      "temporaries (266.17G) exceeds available HBM (15.75G).")
  assert one["needed_bytes"] == int(266.17 * 2**30)
  assert one["available_bytes"] == int(15.75 * 2**30)
  two = plan.parse_out_of_memory("blah\nRESOURCE_EXHAUSTED: XLA:TPU compile permanent error. "
                                 "Ran out of memory in memory space hbm. Used 20.50G of 15.75G "
                                 "hbm. Exceeded hbm capacity by 4.75G.\nmore")
  assert two["needed_bytes"] == int(20.5 * 2**30) and two["error"].startswith("RESOURCE")
  assert plan.parse_out_of_memory("INVALID_ARGUMENT: something else") is None


@needs_libtpu
def test_tiny_config_on_a_v5litepod_4(tmp_path):
  out, md = tmp_path / "plan.json", tmp_path / "plan.md"
  args = ["--config", "quickstart", "--topology", "v5litepod-4", "--what",
          "train,sampler,evaluate", "--caches", "dual", "--remasking", "low_confidence",
          f"--output={out}", f"--markdown={md}"]
  done = run_plan(*args)
  assert done.stderr == ""  # libtpu's warnings about the missing TPU environment kept away.
  data = json.loads(out.read_text())
  rows = data["rows"]
  assert data["pending"] == []
  # One cache setting: each cache's own memory is test_sampler_memory_compares_each_cache_...'s
  # (tests/test_experiments.py).
  assert [(r["what"], r["settings"].get("rollout.cache")) for r in rows] == [
      ("train", None), ("sampler", "dual"), ("evaluate", None)]
  for row in rows:
    assert ROW_FIELDS <= set(row), ROW_FIELDS - set(row)
    assert row["topology"] == "v5litepod-4" and row["topology_name"] == "v5e:2x2"
    assert row["compiler"] == "tpu" and row["chips"] == row["devices"] == 4
    assert row["chip_bytes"] == 16 * 2**30 and row["fits"] is True and row["error"] is None
    m = row["memory"]
    assert row["per_chip_bytes"] == m["total"] == m["argument"] + m["output"] - m["alias"] + m[
        "temp"]
    assert 0 < m["argument"] and 0 < m["temp"] < row["chip_bytes"]
    assert row["compile_seconds"] > 0 and row["config"] == "quickstart"
    assert row["parameters_bytes"] > 0
  train, dual, evaluate = rows
  assert train["settings"] == {"train.microbatch_groups": 16, "model.remat": False}
  assert evaluate["settings"] == {"eval.batch_size": 128}
  assert dual["settings"]["rollout.microbatch_groups"] == 16
  assert dual["kv_cache_bytes"] > 0
  # Adam's two moments (float32, as the parameters), and its step counts.
  assert 0 <= train["optimizer_bytes"] - 2 * train["parameters_bytes"] <= 64
  table = md.read_text()
  assert table.count("| quickstart | v5litepod-4 (`v5e:2x2`, 4 chips) |") == 3
  assert "Projected time" in table and data["projections"][0]["mfu"] == 0.4
  # --resume compiles nothing and keeps the rows.
  again = run_plan(*args, "--resume")
  assert "compiling" not in again.stdout
  assert json.loads(out.read_text())["rows"] == rows


def _planner(config, store, **kwargs):
  return plan.Planner(config, config_label="quickstart", overrides=[], compiler="tpu",
                      store=store, say=lambda s: None, **kwargs)


@needs_libtpu
def test_out_of_memory_row_and_the_ladder(tmp_path):
  """An evaluation batch of 2^20 rows needs ~266 GB of temporaries a v5e chip (16 GiB) lacks: a
  row (not a crash) with the compiler's figure, and the ladder finds a batch that fits."""
  config = config_lib.get("quickstart")
  config.eval.batch_size = 2**20
  store = plan.Store(str(tmp_path / "plan.json"), resume=False)
  planner = _planner(config, store, max_ladder=2)
  given, *ladder = planner.plan("evaluate", "v5litepod-4")
  assert given["fits"] is False and given["memory"] is None
  assert "RESOURCE_EXHAUSTED" in given["error"] and "\n" not in given["error"]
  assert given["per_chip_bytes"] > given["chip_bytes"]
  rec = given["recommended"]
  assert rec is not None and rec["eval.batch_size"] < 2**20
  rows = json.loads((tmp_path / "plan.json").read_text())["rows"]
  assert len(rows) == 3  # The given row and max_ladder = 2 rungs, each written.
  rungs = {r["settings"]["eval.batch_size"]: r for r in rows if r["ladder"]}
  assert rungs[rec["eval.batch_size"]]["fits"] is True
  assert min(rungs) == 4  # The smallest first (one row per chip of the 4).
  assert all(r["fits"] is False for b, r in rungs.items() if b > rec["eval.batch_size"])


def test_the_search_runs_over_an_injected_compile_function(monkeypatch):
  """No compiler: a stand-in whose memory grows with the sampler's groups per call, and whose
  out-of-memory is libtpu's message. The given setting is a row that names the bytes asked for;
  the ladder tries the smallest first, then bisects to the largest that fits, in at most
  max_ladder compiles."""
  config = config_lib.get("llada8b_gsm8k")  # 32 prompts x 16 rows; 8 chips take 1 group a call.
  calls = []

  def compile_fn(what, config, devices):
    groups = config.rollout.microbatch_groups
    calls.append(groups)
    needed = groups * 2**30
    if needed > 6 * 2**30:
      raise RuntimeError(f"RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used "
                         f"{needed / 2**30:.1f}G of 15.75G hbm.")
    return tpu_compile.Result(what, 0.0, dict(argument=needed, output=0, alias=0, temp=0,
                                              generated_code=0, total=needed), None, None)

  monkeypatch.setattr(plan.catalog, "devices_for", lambda name, compiler: [None] * 8)
  store = plan.Store("", resume=False)
  planner = _planner(config, store, max_ladder=4, compile_fn=compile_fn, chip_gb=6 * 2**30 / 1e9,
                     state_bytes=lambda what, config, devices: {})
  planner.caches, planner.remasking = ["none"], [config.rollout.remasking]
  (given,) = planner.plan("sampler", "v5litepod-8")
  assert given["fits"] is False and given["per_chip_bytes"] == 32 * 2**30
  assert given["recommended"] == {"rollout.cache": "none",
                                  "rollout.remasking": config.rollout.remasking,
                                  "rollout.microbatch_groups": 4}
  assert calls[:2] == [32, 1] and len(calls) <= 1 + 4 and calls[-1] in (4, 8)


def test_settings_this_slice_cannot_take_are_a_row(tmp_path):
  """The paper's microbatch of 1 prompt x 16 rows does not split over 64 chips: a row naming the
  field, and the ladder's candidates are the valid ones (no compile needed to see this)."""
  config = config_lib.get("llada8b_gsm8k")
  store = plan.Store("", resume=False)
  planner = _planner(config, store, max_ladder=0)
  paper = {"train.microbatch_groups": 1, "model.remat": True}
  if tpu_compile.libtpu_available():
    row = planner.row("train", "v5litepod-64", paper, variant={})
    assert row["fits"] is False and row["per_chip_bytes"] is None
    assert row["error"].startswith("config.train.microbatch_groups")
  # Every valid microbatch (16 rows a group, 64 chips: 4 groups or more) is a candidate, ...
  candidates = planner._candidates("train", "v5litepod-64", paper)
  assert [c["train.microbatch_groups"] for c in candidates] == [4, 8, 16, 32]
  # ... and below a valid one only the smaller ones, with remat on.
  candidates = planner._candidates("train", "v5litepod-64", {"train.microbatch_groups": 8,
                                                              "model.remat": False})
  assert candidates == [{"train.microbatch_groups": g, "model.remat": True} for g in (4, 8)]


def test_the_train_microbatch_never_refuses_a_sampler_or_evaluate_row(monkeypatch):
  """The paper's train.microbatch_groups=1 cannot split over 64 chips, but the sampler and the
  evaluation do not use it: their rows compile (here a stand-in records what it was given)."""
  given = []

  def compile_decode(config, devices, settings, *, rows, what, model=None):
    given.append((what, rows, config.train.microbatch_groups))
    memory = dict(argument=1, output=0, alias=0, temp=1, generated_code=0, total=2)
    return tpu_compile.Result(what, 0.0, memory, None, None)

  monkeypatch.setattr(tpu_compile, "compile_decode", compile_decode)
  monkeypatch.setattr(plan.catalog, "devices_for", lambda name, compiler: [None] * 64)
  monkeypatch.setattr(plan.search, "_ways", lambda config, devices: 64)
  planner = _planner(config_lib.get("llada8b_gsm8k"), plan.Store("", resume=False), max_ladder=0,
                     state_bytes=lambda what, config, devices: {})
  for what, settings in (("sampler", {"rollout.microbatch_groups": 32}),
                         ("evaluate", {"eval.batch_size": 64})):
    row = planner.row(what, "v5litepod-64", settings, variant={})
    assert row["error"] is None and row["fits"] is True, row
  assert [(w, r) for w, r, _ in given] == [("sampler", 512), ("evaluate", 64)]
  assert all(groups in (4, 8, 16, 32) for _, _, groups in given)


def _independent_count(config):
  """2 x (matmul parameters of the blocks) per position through the blocks + 2 x d x V per
  position through the head, attention and the last block's savings left out."""
  m = specs.model_config(config)
  d, f, qw, kw = m.d_model, m.mlp_hidden_size, m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
  blocks = m.n_layers * (2 * d * qw + 2 * d * kw + 3 * d * f)
  head = d * m.embedding_size
  r = config.rollout
  rows, length = r.num_prompts * r.group_size, r.prompt_length + r.gen_length
  k = config.estimator.num_samples or 2  # StableDRL's official K.
  rollout = r.steps * rows * (2 * blocks * length + 2 * head * r.block_length)
  scored = rows * k * (2 * blocks * length + 2 * head * r.gen_length)
  return rollout, scored, 3 * config.train.num_iterations * scored


def test_rl_step_flops_against_an_independent_count():
  config = config_lib.get("llada8b_gsm8k")
  got = plan.rl_step_flops(config)
  rollout, scoring, updates = _independent_count(config)
  # StableDRL: l_old once per step (independent ratio), no reference; K = 2, mu = 2.
  assert got["scoring_passes"] == 1 and got["num_samples"] == 2 and got["sampler_calls"] == 128
  # Attention (4 L D a layer per position, L = 512, D = 4096: ~1.6% of 2 N) counted there, not
  # here; the last block's queries on the block only (-1/32 of the blocks) counted there.
  for part, want in [("rollout", rollout), ("scoring", scoring), ("updates", updates)]:
    assert abs(got[part] / want - 1) < 0.05, (part, got[part] / want)
  assert got["total"] == got["rollout"] + got["scoring"] + got["updates"]
  # The dual cache: every block's later calls run only the block's 32 positions.
  dual = plan.rl_step_flops(config, cache="dual")
  assert dual["rollout"] < got["rollout"] / 4 and dual["updates"] == got["updates"]
  # A 1000-step run on 64 v5e chips at 40% MFU.
  seconds = profiling.projected_step_time(got["total"], 64, 197e12, 0.4)
  assert seconds == pytest.approx(got["total"] / (64 * 197e12 * 0.4))
  with pytest.raises(ValueError, match="mfu"):
    profiling.projected_step_time(1.0, 1, 1.0, 0.0)


def test_sdar_step_flops_count_the_staircase_and_the_cached_sampler():
  config = config_lib.get("sdar8b_math")
  got = plan.rl_step_flops(config)
  m = specs.model_config(config)
  n = m.num_hidden_layers * (2 * m.hidden_size * m.num_attention_heads * m.head_dim
                             + 2 * m.hidden_size * m.num_key_value_heads * m.head_dim
                             + 3 * m.hidden_size * m.intermediate_size)
  r = config.rollout
  rows, length = r.num_prompts * r.group_size, r.prompt_length + r.gen_length
  # Staircase: (K + 1) x L positions through the blocks, K x G through the head.
  scored = rows * (2 * n * 3 * length + 2 * m.hidden_size * m.vocab_size * 2 * r.gen_length)
  assert abs(got["scoring"] / scored - 1) < 0.05
  # Sampler: the prompt once, then every completion position 4 times (steps) + 1 (commit),
  # the head on the 4 steps' block positions only.
  sampled = rows * (2 * n * (r.prompt_length + 5 * r.gen_length)
                    + 2 * m.hidden_size * m.vocab_size * 4 * r.gen_length)
  assert abs(got["rollout"] / sampled - 1) < 0.05


def test_cpu_fallback_without_libtpu(tmp_path):
  out = tmp_path / "plan.json"
  code = ("import sys; from stabledrl_jax import tpu_compile; "
          "tpu_compile.libtpu_available = lambda: False; "
          "from stabledrl_jax import plan; sys.argv[0] = 'plan'; plan.run()")
  done = run_plan("--config", "quickstart", "--topology", "v5litepod-4", "--what", "evaluate",
                  f"--output={out}", code=code)
  assert done.stderr == ""
  row, = json.loads(out.read_text())["rows"]
  assert row["compiler"] == "cpu" and row["devices"] == 4 and row["fits"] is True
  assert row["chip_bytes"] == 16 * 2**30 and row["per_chip_bytes"] == row["memory"]["total"] > 0
  refused = run_plan("--config", "quickstart", "--compiler=tpu", "--what", "evaluate",
                     code=code, check=False)
  assert refused.returncode != 0 and "needs libtpu" in refused.stderr
  assert len(refused.stderr.strip().splitlines()) == 1


def test_bad_flags_are_one_line_errors():
  for args, says in [(["--topology", "v5litepod-3"], "--topology"),
                     (["--what", "training"], "--what"),
                     (["--config.rollout.temprature=1"], "rollout.temprature")]:
    done = run_plan("--config", "quickstart", *args, check=False)
    assert done.returncode != 0 and says in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_render_marks_rows_not_compiled_yet(tmp_path):
  out, md = tmp_path / "plan.json", tmp_path / "plan.md"
  config = config_lib.get("llada8b_gsm8k")
  store = plan.Store(str(out), resume=False)
  _planner(config, store, dry_run=True).plan("train", "v5p-8")  # --dry_run: compiles nothing.
  store.project(plan.projection(config, config_label="llada8b_gsm8k", overrides=[],
                                topology="v5p-8", mfu=0.4))
  pending, = json.loads(out.read_text())["pending"]
  assert pending["settings"] == {"train.microbatch_groups": 1, "model.remat": True}
  run_plan("--render", f"--output={out}", f"--markdown={md}")
  table = md.read_text()
  assert "| quickstart | v5p-8 (`v5p:2x2x1`, 4 chips) | train |" in table
  assert "not compiled yet" in table and "Projected time" in table


def test_render_shows_what_the_attention_kernel_saves():
  """A row planned again with --config.model.attention=xla is paired with the default's row of
  the same program: the table gives both sizes and the difference."""
  def row(overrides, total, **extra):
    memory = dict(argument=2**30, output=0, alias=0, temp=total - 2**30, total=total)
    return dict(what="sampler", config="llada8b_gsm8k", overrides=overrides, topology="v5p-8",
                topology_name="v5p:2x2x1", compiler="tpu", settings={"rollout.cache": "none"},
                chip_bytes=95 * 2**30, per_chip_bytes=total, memory=memory, fits=True,
                compile_seconds=1.0, ladder=False, **extra)

  table = plan.markdown(dict(rows=[row([], 20 * 2**30),
                                   row(["config.model.attention=xla"], 31 * 2**30),
                                   row(["config.model.attention=xla"], 7 * 2**30) | dict(
                                       what="evaluate")]))
  assert "Attention kernel" in table
  assert "| llada8b_gsm8k | v5p-8 | sampler | `rollout.cache=none` | 20 | 31 | 11 |" in table
  assert "GiB per chip, default |" in table
  assert plan.markdown(dict(rows=[row([], 20 * 2**30)])).count("Attention kernel") == 0


def test_the_pods_doc_table_is_the_plan_file_rendered():
  """docs/pods.md's table is docs/pods_plan.json rendered by the command, not typed by hand:
  after a sweep, rerun `python -m stabledrl_jax.plan --render --output docs/pods_plan.json
  --markdown -` and paste its output."""
  docs = REPO / "docs"
  rendered = plan.markdown(plan.load(str(docs / "pods_plan.json")))
  assert rendered.strip() in (docs / "pods.md").read_text()
