"""The PyTorch side of `experiments/gpu_check.py`: the peers' code on the same weights.

Run by gpu_check.py in a subprocess (one per peer, so that the torch process's GPU memory and
the peers' `transformers` registrations of the "llada" model type stay apart), never committed
with the peers' code: it imports the peers' files from ``--peers_dir`` at run time.

    python experiments/gpu_check_peers.py --peer official --peers_dir third_party \
        --model_dir /tmp/hf --jobs jobs.json --output out.json

    # The peers' folder from clones of the three repositories in CLONES/{LLaDA,Fast-dLLM,
    # StableDRL}: copies only the files read here (PEER_FILES), a few hundred KB.
    python experiments/gpu_check_peers.py --collect CLONES --peers_dir third_party

Peers (the folder layout under --peers_dir is in gpu_check.py's docstring):
  official    StableDRL's `networks/modeling_llada.py` (LLaDAModelLM, the official LLaDA modeling
              code) with ML-GSAI/LLaDA's `generate.py` (generate(model, prompt, steps, gen_length,
              block_length, temperature, remasking, mask_id)).
  fast_dllm   NVlabs/Fast-dLLM's `llada/model/modeling_llada.py` with its `llada/generate.py`
              (generate_with_dual_cache(..., threshold) -> (tokens, nfe); one row per call).

Jobs (a JSON list, run in order; the output JSON is rewritten after each, so a cut run keeps
what finished):
  {"kind": "logits", "tokens": "x.npy", "out": "logits.npy"}    float32 logits [B, L, V]
  {"kind": "sampler", "prompt": "p.npy", "gen_length", "steps", "block_length", "temperature",
   "threshold" (fast_dllm), "rows" (fast_dllm: rows decoded one by one), "repeats"}
  {"kind": "train", "rows", "length", "repeats"}     forward + backward of a masked-token loss

The model runs in float32 for the logits job and in bfloat16 afterwards on a GPU (float32 on
CPU); the train job keeps float32 weights under bfloat16 autocast (GPU) as our train step does.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import shutil
import sys
import time
import traceback

import numpy as np

# The files each peer needs under --peers_dir.
PEER_FILES = {
    "official": ("StableDRL/networks/modeling_llada.py",
                 "StableDRL/networks/configuration_llada.py", "LLaDA/generate.py"),
    "fast_dllm": ("Fast-dLLM/llada/model/__init__.py", "Fast-dLLM/llada/model/modeling_llada.py",
                  "Fast-dLLM/llada/model/configuration_llada.py", "Fast-dLLM/llada/generate.py"),
}


def collect(clones: str, peers_dir: str) -> list[str]:
  """Copies every peer's files from ``clones`` (the repositories' checkouts) to ``peers_dir``;
  returns the files copied. A file absent from ``clones`` is an error naming it."""
  files = [f for peer in sorted(PEER_FILES) for f in PEER_FILES[peer]]
  missing = [f for f in files if not os.path.isfile(os.path.join(clones, f))]
  if missing:
    raise FileNotFoundError(f"--collect {clones} has no {', '.join(missing)}")
  for f in files:
    os.makedirs(os.path.dirname(os.path.join(peers_dir, f)), exist_ok=True)
    shutil.copyfile(os.path.join(clones, f), os.path.join(peers_dir, f))
  return files


def missing_files(peer: str, peers_dir: str) -> list[str]:
  """The files of ``peer`` absent from ``peers_dir``."""
  return [f for f in PEER_FILES[peer] if not os.path.isfile(os.path.join(peers_dir, f))]


def _load_file(name: str, path: str):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


def load_peer(peer: str, peers_dir: str):
  """(modeling module, configuration module, generate module) of ``peer``."""
  if peer == "official":
    sys.path.insert(0, os.path.join(peers_dir, "StableDRL"))
    modeling = importlib.import_module("networks.modeling_llada")
    configuration = importlib.import_module("networks.configuration_llada")
    generate = _load_file("llada_generate", os.path.join(peers_dir, "LLaDA", "generate.py"))
  else:
    sys.path.insert(0, os.path.join(peers_dir, "Fast-dLLM", "llada"))
    modeling = importlib.import_module("model.modeling_llada")
    configuration = importlib.import_module("model.configuration_llada")
    generate = _load_file("fast_dllm_generate",
                          os.path.join(peers_dir, "Fast-dLLM", "llada", "generate.py"))
  return modeling, configuration, generate


def load_model(modeling, configuration, model_dir: str, device):
  """The peer's LLaDAModelLM built from ``model_dir``'s config.json, its weights loaded by their
  Hugging Face names (strict: a missing or unexpected tensor is an error naming it)."""
  import torch  # pylint: disable=g-import-not-at-top
  from safetensors.torch import load_file  # pylint: disable=g-import-not-at-top

  with open(os.path.join(model_dir, "config.json")) as f:
    hf = json.load(f)
  config = configuration.LLaDAConfig(**hf)
  # transformers 5 keeps use_cache out of a config's attributes (a generation setting there);
  # the peers' forward() reads config.use_cache when the caller passes none.
  if "use_cache" not in vars(config):
    config.use_cache = False
  model = modeling.LLaDAModelLM(config, init_params=False)
  index = os.path.join(model_dir, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  else:
    files = ["model.safetensors"]
  state = {}
  for name in files:
    state.update(load_file(os.path.join(model_dir, name)))
  result = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
  if result.missing_keys or result.unexpected_keys:
    raise RuntimeError(f"{model_dir}: tensors missing {result.missing_keys[:3]}, unexpected "
                       f"{result.unexpected_keys[:3]}")
  return model.to(device=device, dtype=torch.float32).eval()


class Clock:
  """Wall seconds of a block, the device synchronized on both ends; resets the peak memory."""

  def __init__(self, device):
    import torch  # pylint: disable=g-import-not-at-top
    self.torch, self.cuda = torch, device.type == "cuda"

  @contextlib.contextmanager
  def __call__(self, out: list):
    if self.cuda:
      self.torch.cuda.synchronize()
    start = time.perf_counter()
    yield
    if self.cuda:
      self.torch.cuda.synchronize()
    out.append(time.perf_counter() - start)

  def reset_peak(self):
    if self.cuda:
      self.torch.cuda.reset_peak_memory_stats()

  def peak(self) -> int | None:
    return int(self.torch.cuda.max_memory_allocated()) if self.cuda else None


def run_logits(model, job, device):
  import torch  # pylint: disable=g-import-not-at-top
  tokens = torch.as_tensor(np.load(job["tokens"]), dtype=torch.long, device=device)
  with torch.no_grad():
    logits = model(tokens).logits.float()
  np.save(job["out"], logits.cpu().numpy())
  return dict(shape=list(logits.shape))


def run_sampler(peer, model, generate, job, device, clock, mask_id):
  """Times the peer's sampler on ``job["prompt"]`` (after one warm-up call on one row)."""
  import torch  # pylint: disable=g-import-not-at-top
  prompt = torch.as_tensor(np.load(job["prompt"]), dtype=torch.long, device=device)
  shape = dict(steps=job["steps"], gen_length=job["gen_length"],
               block_length=job["block_length"], temperature=job["temperature"],
               remasking="low_confidence", mask_id=mask_id)
  if peer == "official":
    decode = lambda p: (generate.generate(model, p, **shape), shape["steps"])
  else:
    def decode(p):
      # Fast-dLLM's samplers build a batch of one (torch.full((1, ...))): rows one by one.
      outs, calls = [], []
      for row in range(p.shape[0]):
        x, nfe = generate.generate_with_dual_cache(model, p[row:row + 1], threshold=job["threshold"],
                                                   **shape)
        outs.append(x)
        calls.append(nfe)
      return torch.cat(outs), float(np.mean(calls))
    prompt = prompt[:job["rows"]]
  warm = dict(shape, gen_length=shape["block_length"],
              steps=shape["steps"] * shape["block_length"] // shape["gen_length"])
  if peer == "official":
    generate.generate(model, prompt[:1], **warm)
  else:
    generate.generate_with_dual_cache(model, prompt[:1], threshold=job["threshold"], **warm)
  clock.reset_peak()
  seconds = []
  torch.manual_seed(0)
  for _ in range(job["repeats"]):
    with clock(seconds):
      tokens, calls = decode(prompt)
  mask_left = int((tokens[:, prompt.shape[1]:] == mask_id).sum())
  return dict(seconds=min(seconds), samples_s=seconds, rows=int(prompt.shape[0]),
              tokens=int(prompt.shape[0]) * job["gen_length"], calls_per_sequence=calls,
              masks_left=mask_left, peak_memory_bytes=clock.peak())


def run_train(model, job, device, clock, mask_id, vocab_size):
  """Forward + backward of the masked-token cross-entropy on random rows (float32 weights,
  bfloat16 autocast on a GPU), the work of one microbatch of an RL or SFT step."""
  import torch  # pylint: disable=g-import-not-at-top
  gen = torch.Generator(device="cpu").manual_seed(0)
  x = torch.randint(0, vocab_size - 2, (job["rows"], job["length"]), generator=gen).to(device)
  masked = (torch.rand(x.shape, generator=gen) < 0.5).to(device)
  noisy = torch.where(masked, torch.full_like(x, mask_id), x)
  model.train()
  autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
              else contextlib.nullcontext())

  def step():
    model.zero_grad(set_to_none=True)
    with autocast:
      logits = model(noisy).logits
    loss = torch.nn.functional.cross_entropy(logits[masked].float(), x[masked])
    loss.backward()
    return loss

  step()
  clock.reset_peak()
  seconds = []
  for _ in range(job["repeats"]):
    with clock(seconds):
      step()
  model.zero_grad(set_to_none=True)
  model.eval()
  return dict(seconds=min(seconds), samples_s=seconds, rows=job["rows"], length=job["length"],
              tokens=job["rows"] * job["length"], peak_memory_bytes=clock.peak())


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--peer", choices=sorted(PEER_FILES))
  parser.add_argument("--peers_dir", required=True)
  parser.add_argument("--model_dir")
  parser.add_argument("--jobs")
  parser.add_argument("--output")
  parser.add_argument("--collect", default="",
                      help="copy the peers' files from this folder of clones to --peers_dir")
  args = parser.parse_args(argv)
  if args.collect:
    try:
      files = collect(args.collect, args.peers_dir)
    except FileNotFoundError as e:
      parser.error(str(e))
    print(f"copied {len(files)} files to {args.peers_dir}")
    return 0
  for name in ("peer", "model_dir", "jobs", "output"):
    if not getattr(args, name):
      parser.error(f"--{name} is required (unless --collect)")
  out = dict(peer=args.peer, jobs=[])

  def write():
    with open(args.output + ".tmp", "w") as f:
      json.dump(out, f, indent=2)
    os.replace(args.output + ".tmp", args.output)

  # "skip": the peer cannot run here (stated reason); "error": it failed to start.
  missing = missing_files(args.peer, args.peers_dir)
  if missing:
    out["skip"] = f"--peers_dir {args.peers_dir} has no {', '.join(missing)}"
    write()
    return 0
  for package in ("torch", "transformers", "safetensors"):
    if importlib.util.find_spec(package) is None:
      out["skip"] = f"{package} is not importable by {sys.executable}"
      write()
      return 0
  try:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    torch.backends.cuda.matmul.allow_tf32 = False  # the logits check is in float32
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out.update(torch=torch.__version__, transformers=transformers.__version__,
               device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    modeling, configuration, generate = load_peer(args.peer, args.peers_dir)
    model = load_model(modeling, configuration, args.model_dir, device)
  except Exception as e:  # pylint: disable=broad-except
    out["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
    out["traceback"] = traceback.format_exc()[-3000:]
    write()
    return 0
  write()
  with open(args.jobs) as f:
    jobs = json.load(f)
  mask_id, vocab_size = model.config.mask_token_id, model.config.vocab_size
  clock = Clock(device)
  for job in jobs:
    entry = dict(kind=job["kind"], name=job.get("name", job["kind"]))
    try:
      # bfloat16 weights for the sampler on a GPU; float32 otherwise (the train job autocasts).
      want = torch.bfloat16 if job["kind"] == "sampler" and device.type == "cuda" else (
          torch.float32)
      have = next(model.parameters()).dtype
      if have != want:
        model = (model.to(want) if want == torch.bfloat16 else
                 load_model(modeling, configuration, args.model_dir, device))  # not rounded
      if job["kind"] == "logits":
        entry.update(run_logits(model, job, device))
      elif job["kind"] == "sampler":
        entry.update(run_sampler(args.peer, model, generate, job, device, clock, mask_id))
      elif job["kind"] == "train":
        entry.update(run_train(model, job, device, clock, mask_id, vocab_size))
      else:
        raise ValueError(f"unknown job kind {job['kind']!r}")
      entry["status"] = "ok"
    except Exception as e:  # pylint: disable=broad-except
      entry.update(status="failed", reason=f"{type(e).__name__}: {e}".splitlines()[0],
                   traceback=traceback.format_exc()[-3000:])
    entry["dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")
    out["jobs"].append(entry)
    write()
  return 0


if __name__ == "__main__":
  sys.exit(main())
