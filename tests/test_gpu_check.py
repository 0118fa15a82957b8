"""experiments/gpu_check.py at toy size on CPU (--smoke): every row type that runs on a CPU, the
JSON and Markdown it writes after every row, a run killed part way, and the peers' logits check
when torch and the peers' code are here (else skipped, with the reason).

The peers test looks for the peers' folder in $GPU_CHECK_PEERS_DIR, else third_party/ (the
layout is in gpu_check.py's docstring), and runs them with $GPU_CHECK_PEER_PYTHON, else this
interpreter.
"""

import argparse
import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "gpu_check.py"
sys.path.insert(0, str(REPO / "experiments"))

import gpu_check  # pylint: disable=wrong-import-position

# --smoke's shapes, restated here so that the expected counts do not come from the script.
TRAIN_TOKENS = 2 * 2 * 2 * (16 + 16)  # P x G x K rows of prompt + completion
SAMPLER_ROWS, GEN, STEPS, BLOCK = 2, 16, 8, 8


def _env():
  path = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
  return {**os.environ, "PYTHONPATH": path}


def run_check(*args, timeout=600):
  return subprocess.run([sys.executable, str(SCRIPT), "--smoke", *args], capture_output=True,
                        text=True, cwd=REPO, env=_env(), timeout=timeout)


def table_rows(markdown: str) -> dict:
  """row name -> its cells, from the Markdown table."""
  rows = {}
  for line in markdown.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if line.startswith("| ") and cells[0] not in ("row",) and not cells[0].startswith("-"):
      rows[cells[0]] = cells
  return rows


@pytest.mark.slow
def test_smoke_runs_every_cpu_row_and_writes_json_and_table(tmp_path):
  out = tmp_path / "check.json"
  result = run_check(f"--output={out}", f"--peers_dir={tmp_path / 'no_peers'}")
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
  data = json.loads(out.read_text())
  assert data["complete"] is True
  rows = {r["row"]: r for r in data["rows"]}
  assert [r["row"] for r in data["rows"]] == list(gpu_check.ROW_NAMES)
  assert rows["env"]["backend"] == "cpu" and rows["env"]["jax"]

  train = rows["train_xla"]
  assert train["status"] == "ok", train
  assert train["tokens"] == TRAIN_TOKENS
  assert train["tokens_per_s"] == pytest.approx(TRAIN_TOKENS / train["seconds"])
  assert train["peak_memory_bytes"] is None and train["xla_memory_bytes"] > 0
  assert train["mfu_spec"] is None and 0 < train["mfu_measured"]  # no vendor peak for a CPU
  assert rows["train_cudnn"]["status"] == "skipped"
  assert "cpu" in rows["train_cudnn"]["reason"]

  for cache in ("none", "prefix", "dual"):
    for remasking in ("low_confidence", "threshold"):
      row = rows[f"sampler_{cache}_{remasking}"]
      assert row["status"] == "ok", row
      assert row["tokens"] == SAMPLER_ROWS * GEN
      if remasking == "low_confidence":  # a fixed schedule: exactly `steps` calls
        assert row["calls_per_sequence"] == STEPS
      else:  # 1 to block_length calls per block
        assert GEN // BLOCK <= row["calls_per_sequence"] <= GEN
      assert row["flops"] > 0
  # A block's later calls cost less with a cache: FLOPs per call, none > prefix > dual.
  per_call = {c: rows[f"sampler_{c}_low_confidence"]["flops"] for c in ("none", "prefix", "dual")}
  assert per_call["none"] > per_call["prefix"] > per_call["dual"]

  for name in gpu_check.GROUPS["peers"]:  # no peers folder here: skipped, saying why
    assert rows[name]["status"] == "skipped" and rows[name]["reason"], rows[name]

  markdown = out.with_suffix(".md").read_text()
  assert "(complete)" in markdown
  table = table_rows(markdown)
  assert set(table) == set(gpu_check.ROW_NAMES) - {"env"}
  assert table["train_xla"][1] == "ok" and table["train_xla"][7] == "-"  # memory: "-" on CPU
  assert table["train_cudnn"][1] == "skipped"


@pytest.mark.slow
def test_a_killed_run_leaves_a_valid_partial_report(tmp_path):
  out = tmp_path / "cut.json"
  proc = subprocess.Popen([sys.executable, str(SCRIPT), "--smoke", f"--output={out}",
                           "--rows=train,sampler"], cwd=REPO, env=_env(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
      if out.exists() and len(json.loads(out.read_text())["rows"]) >= 2:  # env, peak
        break
      time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be cut"
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  data = json.loads(out.read_text())  # written atomically: valid whenever the run is cut
  assert data["complete"] is False
  names = [r["row"] for r in data["rows"]]
  assert names[:2] == ["env", "peak"] and "sampler_dual_threshold" not in names
  assert "(partial)" in out.with_suffix(".md").read_text()


def test_budget_skips_the_rows_left_and_says_so(tmp_path):
  out = tmp_path / "budget.json"
  result = run_check(f"--output={out}", "--budget_s=0", "--rows=sampler_dual_threshold,peers")
  assert result.returncode == 0, result.stderr[-2000:]
  data = json.loads(out.read_text())
  assert data["complete"] is True
  rows = {r["row"]: r for r in data["rows"]}
  assert list(rows) == ["env", "peak", "sampler_dual_threshold"] + gpu_check.GROUPS["peers"]
  assert rows["env"]["status"] == "ok"
  for name in ["peak", "sampler_dual_threshold"]:
    assert rows[name]["status"] == "skipped" and "budget" in rows[name]["reason"]
  for name in gpu_check.GROUPS["peers"]:
    assert rows[name]["status"] == "skipped" and rows[name]["reason"]


def test_unknown_row_is_a_one_line_error(tmp_path):
  result = run_check(f"--output={tmp_path / 'x.json'}", "--rows=train,sampler_fast")
  assert result.returncode == 2
  assert "--rows: unknown row 'sampler_fast'" in result.stderr
  assert "Traceback" not in result.stderr
  assert not (tmp_path / "x.json").exists()


def test_parse_rows_keeps_the_script_order():
  assert gpu_check.parse_rows("peers,train_xla") == (
      ["env", "train_xla"] + gpu_check.GROUPS["peers"])
  assert gpu_check.parse_rows("all") == list(gpu_check.ROW_NAMES)
  with pytest.raises(argparse.ArgumentTypeError, match="unknown row 'x'"):
    gpu_check.parse_rows("train,x")


def test_logits_agreement_against_hand_computed_errors():
  ours = np.array([[[3.0, 4.0], [0.0, 1.0]]])
  theirs = ours + np.array([[[0.0, 0.0], [0.0, -2.0]]])
  agree = gpu_check.logits_agreement(ours, theirs)
  assert agree["max_abs_diff"] == pytest.approx(2.0)
  assert agree["relative_l2"] == pytest.approx(2.0 / np.sqrt(9 + 16 + 1))
  assert agree["argmax_agreement"] == pytest.approx(0.5)  # [1, 1] against [1, 0]


def _peer_setup():
  peers_dir = os.environ.get("GPU_CHECK_PEERS_DIR") or str(REPO / "third_party")
  python = os.environ.get("GPU_CHECK_PEER_PYTHON") or sys.executable
  if python == sys.executable and importlib.util.find_spec("torch") is None:
    pytest.skip("torch is not importable here (set GPU_CHECK_PEER_PYTHON to an interpreter "
                "that has it)")
  import gpu_check_peers  # pylint: disable=g-import-not-at-top
  missing = [f for p in gpu_check_peers.PEER_FILES
             for f in gpu_check_peers.missing_files(p, peers_dir)]
  if not os.path.isdir(peers_dir) or missing:
    pytest.skip(f"the peers' code is not in {peers_dir} (set GPU_CHECK_PEERS_DIR): "
                f"{', '.join(missing)}")
  return peers_dir, python


@pytest.mark.slow
def test_peers_logits_agree_with_ours_on_the_same_weights(tmp_path):
  peers_dir, python = _peer_setup()
  out = tmp_path / "peers.json"
  result = run_check(f"--output={out}", f"--peers_dir={peers_dir}", f"--peer_python={python}",
                     "--rows=peer_logits_official,peer_logits_fast_dllm")
  assert result.returncode == 0, result.stdout[-3000:]
  rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
  for peer in ("official", "fast_dllm"):
    row = rows[f"peer_logits_{peer}"]
    assert row["status"] == "ok", row
    assert row["relative_l2"] < 1e-5 and row["argmax_agreement"] == 1.0
    assert row["shape"] == [2, 8 + GEN, 128]


def test_collect_copies_only_the_peers_files(tmp_path):
  import gpu_check_peers  # pylint: disable=g-import-not-at-top
  clones, dest = tmp_path / "clones", tmp_path / "third_party"
  files = [f for p in gpu_check_peers.PEER_FILES for f in gpu_check_peers.PEER_FILES[p]]
  for f in files + ["LLaDA/imgs/big.gif"]:
    (clones / f).parent.mkdir(parents=True, exist_ok=True)
    (clones / f).write_text(f"# {f}\n")
  gpu_check_peers.collect(str(clones), str(dest))
  copied = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
  assert copied == sorted(files)
  assert all((dest / f).read_text() == f"# {f}\n" for f in files)
  for peer in gpu_check_peers.PEER_FILES:
    assert gpu_check_peers.missing_files(peer, str(dest)) == []
  (clones / files[0]).unlink()
  with pytest.raises(FileNotFoundError, match=files[0]):
    gpu_check_peers.collect(str(clones), str(tmp_path / "other"))


def test_unwritable_output_is_a_one_line_error(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("")
  result = run_check(f"--output={blocker / 'sub' / 'x.json'}", "--rows=env")
  assert result.returncode == 2
  assert "--output" in result.stderr.splitlines()[-1] and "Traceback" not in result.stderr


@pytest.mark.slow
def test_peer_timing_rows_are_skipped_when_the_logits_disagree(tmp_path):
  peers_dir, python = _peer_setup()
  out = tmp_path / "peers.json"
  # A tolerance of 0 fails any float32 comparison: the stand-in for a peer computing otherwise.
  result = run_check(f"--output={out}", f"--peers_dir={peers_dir}", f"--peer_python={python}",
                     "--rows=peer_logits_official,peer_sampler_official", "--logits_tol=0")
  assert result.returncode == 1  # a failed row
  rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
  assert rows["peer_logits_official"]["status"] == "failed"
  assert "logits disagree" in rows["peer_logits_official"]["reason"]
  assert rows["peer_sampler_official"]["status"] == "skipped"
  assert "the logits check failed" in rows["peer_sampler_official"]["reason"]
