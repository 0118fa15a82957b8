"""Hub ids wherever a path is taken, tested offline on a directory laid out as the Hub cache.

The cache layout is huggingface_hub's: ``models--OWNER--NAME/refs/main`` holds the commit,
``snapshots/<commit>/`` the files. With ``HF_HUB_OFFLINE=1`` ``snapshot_download`` resolves an id
from the cache alone, as it would on a machine that fetched it before.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from stabledrl_jax import hub, models
from stabledrl_jax.training.config import specs

from test_tokenizers import _tiny_llada_tokenizer_json
from test_training import tiny_config

REPO_ID = "test-org/tiny-llada"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(root: pathlib.Path) -> pathlib.Path:
  """A Hub cache holding REPO_ID: a tiny LLaDA checkpoint and a LLaDA-conventions tokenizer."""
  repo = root / ("models--" + REPO_ID.replace("/", "--"))
  snapshot = repo / "snapshots" / COMMIT
  snapshot.mkdir(parents=True)
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(COMMIT)
  config = models.get_config("tiny", n_layers=1, vocab_size=126464, embedding_size=126464,
                             d_model=16, n_heads=2, n_kv_heads=2, mlp_hidden_size=32,
                             mask_token_id=126336, eos_token_id=126081)  # LLaDA's ids.
  models.save_pretrained(models.init_model(config, seed=7), str(snapshot))
  _tiny_llada_tokenizer_json(snapshot / "tokenizer.json")
  return root


def test_hub_ids_and_local_paths():
  assert hub.is_hub_id("GSAI-ML/LLaDA-8B-Instruct") and hub.is_hub_id("JetLM/SDAR-8B-Chat")
  for local in ("/abs/path", "runs/x/y", "gs://bucket/run", "./a", "model", ""):
    assert not hub.is_hub_id(local), local
    assert hub.local_path(local) == local
  with pytest.raises(ValueError, match="download='everywhere'"):
    hub.local_path(REPO_ID, download="everywhere")


def test_a_hub_id_loads_offline_from_the_cache(tmp_path):
  """In a fresh process with HF_HUB_OFFLINE=1: the model, its tokenizer and an evaluation
  source by id, bit for bit the saved parameters; an id not in the cache is a clear error."""
  cache = _hub_cache(tmp_path / "cache")
  script = textwrap.dedent(f"""
      import json, numpy as np
      from flax import nnx
      import jax
      from stabledrl_jax import hub, models, tokenizers
      from stabledrl_jax.training.state import checkpoint_source
      model = models.from_pretrained({REPO_ID!r})
      direct = models.from_pretrained(hub.local_path({REPO_ID!r}))
      same = all(np.array_equal(a, b) for a, b in zip(
          jax.tree.leaves(nnx.state(model, nnx.Param)),
          jax.tree.leaves(nnx.state(direct, nnx.Param))))
      tok = tokenizers.HFTokenizer.llada({REPO_ID!r})
      source = checkpoint_source.resolve({REPO_ID!r})
      try:
        models.load_config("test-org/not-in-cache")
        missing = ""
      except FileNotFoundError as error:
        missing = str(error)
      print(json.dumps(dict(same=same, layers=model.config.n_layers, mask=tok.mask_id,
                            kind=source.kind, snapshot=source.path, missing=missing)))
  """)
  env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), JAX_PLATFORMS="cpu")
  env.pop("HF_HOME", None)
  out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=300, check=True)
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert got["same"] and got["layers"] == 1 and got["mask"] == 126336
  assert got["kind"] == "huggingface"
  assert got["snapshot"].endswith(os.path.join("snapshots", COMMIT))
  assert "test-org/not-in-cache" in got["missing"] and "huggingface-cli download" in got["missing"]


def test_a_run_starts_from_a_hub_id(tmp_path, monkeypatch):
  """--config.model.checkpoint=OWNER/NAME and --config.tokenizer.path=OWNER/NAME: the trainer
  builds the model and tokenizer from the cache (validation passes; one rollout is decoded)."""
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.inputs import data  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.step import build
  cache = _hub_cache(tmp_path / "cache")
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  config = tiny_config(**{"model.checkpoint": REPO_ID, "tokenizer.kind": "llada",
                          "tokenizer.path": REPO_ID, "sft.num_steps": 0})
  specs.validate(config, num_devices=1)
  tokenizer = data.make_tokenizer(config.tokenizer)
  assert tokenizer.mask_id == 126336
  model = build.build_model(config, tokenizer, mesh=None)
  assert model.config.n_layers == 1 and model.config.d_model == 16


@pytest.mark.parametrize("field", ["model.checkpoint", "tokenizer.path"])
def test_placeholders_fail_in_validation_with_what_to_pass(field):
  config = tiny_config(**{field: "/path/to/LLaDA-8B-Instruct"})
  with pytest.raises(ValueError, match=rf"config\.{field}: .*placeholder.*Hub id"):
    specs.validate(config)


def test_the_paper_configs_name_the_released_models_by_hub_id():
  from stabledrl_jax.training.config import config_lib  # pylint: disable=g-import-not-at-top
  for name, repo in (("llada8b_gsm8k", "GSAI-ML/LLaDA-8B-Instruct"),
                     ("sdar8b_math", "JetLM/SDAR-8B-Chat")):
    config = config_lib.get(name)
    assert config.model.checkpoint == repo and config.tokenizer.path == repo
    assert hub.is_hub_id(config.model.checkpoint)
  bad = config_lib.get("llada8b_gsm8k")
  bad.model.download = "sometimes"
  with pytest.raises(ValueError, match=r"config\.model\.download"):
    specs.validate(bad)


def test_process_0_fetches_and_the_others_read_the_shared_cache(monkeypatch):
  """download='process_0' with several processes: process 0 fetches, every process waits at one
  barrier, the others then read the cache only; 'each_host' fetches everywhere."""
  import huggingface_hub  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  calls, barriers = [], []
  monkeypatch.setattr(huggingface_hub, "snapshot_download",
                      lambda **kw: calls.append(kw["local_files_only"]) or "/cache/snapshot")
  monkeypatch.setattr(multihost_utils, "sync_global_devices", barriers.append)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  for index, local_only in ((0, [False]), (1, [True])):
    calls.clear()
    barriers.clear()
    monkeypatch.setattr(jax, "process_index", lambda index=index: index)
    assert hub.local_path(REPO_ID, download="process_0") == "/cache/snapshot"
    assert calls == local_only and barriers == [f"hub download {REPO_ID}"]
  calls.clear()
  barriers.clear()
  assert hub.local_path(REPO_ID, download="each_host") == "/cache/snapshot"
  assert calls == [False] and barriers == []


def test_evaluate_refuses_bad_settings_from_a_hub_ids_config_alone(tmp_path, monkeypatch):
  """`stabledrl-evaluate --checkpoint=OWNER/NAME`: the settings are judged by the family its
  config.json names before any weight is fetched (here the cache holds no weights at all)."""
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
  from stabledrl_jax import evaluate  # pylint: disable=g-import-not-at-top
  cache = _hub_cache(tmp_path / "cache")
  snapshot = cache / ("models--" + REPO_ID.replace("/", "--")) / "snapshots" / COMMIT
  for weights in snapshot.glob("*.safetensors*"):
    weights.unlink()
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  options = evaluate.Options(checkpoint=REPO_ID, task=["sudoku"], output_dir=str(tmp_path / "out"),
                             remasking="low_confidence_dynamic")
  with pytest.raises(ValueError, match=rf"^{REPO_ID} \(a llada checkpoint\): remasking must be"):
    evaluate.run(options)
  assert not (tmp_path / "out").exists()


def test_a_peft_adapter_loads_by_hub_id_on_the_base_it_names(tmp_path, monkeypatch):
  """A released adapter (d1's, ESPO's) by Hub id: its adapter_config.json names the base, itself
  a Hub id, and both come from the cache."""
  import jax  # pylint: disable=g-import-not-at-top
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.models import lora, peft_io  # pylint: disable=g-import-not-at-top
  from stabledrl_jax.training.state import checkpoint_source  # pylint: disable=g-import-not-at-top
  cache = _hub_cache(tmp_path / "cache")
  adapter_id = REPO_ID + "-lora"
  repo = cache / ("models--" + adapter_id.replace("/", "--"))
  (repo / "refs").mkdir(parents=True)
  (repo / "refs" / "main").write_text(COMMIT)
  base = models.from_pretrained(str(cache / ("models--" + REPO_ID.replace("/", "--"))
                                    / "snapshots" / COMMIT))
  lora.add_adapters(base, lora.LoRASpec(2, 4.0, ("q_proj", "v_proj")), seed=0)
  for i, adapter in enumerate(lora.adapters_of(base).values()):
    adapter.b[...] = jax.random.normal(jax.random.key(i), adapter.b.shape)
  peft_io.save_adapter(base, str(repo / "snapshots" / COMMIT), base=REPO_ID)
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  loaded = models.from_pretrained(adapter_id)
  tokens = (np.arange(12).reshape(1, 12) * 977) % loaded.config.vocab_size
  np.testing.assert_array_equal(np.asarray(loaded(tokens)), np.asarray(base(tokens)))
  assert checkpoint_source.resolve(adapter_id).kind == checkpoint_source.PEFT
