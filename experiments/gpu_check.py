"""One command for a lent GPU: our train step and sampler at the paper's shapes, and the PyTorch
peers on the same GPU and the same weights, written row by row to one JSON and one Markdown table.

    python experiments/gpu_check.py --output gpu_check.json --peers_dir third_party   # the GPU run
    python experiments/gpu_check.py --smoke --output /tmp/smoke.json                  # CPU, tiny

Rows, in this order (`--rows` selects; names or groups: train, sampler, peers, all):
  env                  the device, jax / jaxlib / flax / torch / transformers versions.
  peak                 the measured matmul peak (`benchmark.peak_call`: chained square products
                       in the compute dtype); MFU is given against it and against the vendor's
                       dense bf16 figure (`profiling.PEAK_FLOPS`; H200: 989 TFLOP/s).
  train_xla            the bf16 train step (float32 master weights and AdamW moments, remat,
  train_cudnn          scanned layers; `benchmark.train_step_case` = `build.make_update`) at
                       the paper's sequence shape: P x G rows of 256 prompt + 256 completion
                       tokens, K = 2, one group (G x K rows) per microbatch, for
                       `model.attention` = "xla" and "cudnn". FLOPs: `models.llada.flops`.
  sampler_<cache>_<remasking>   `models/llada/sampler.generate` at the paper's decoding shape
                       (256 tokens, 128 steps, blocks of 32, 64 rows, T = 0.9) for the caches
                       none / prefix / dual, each with low_confidence (the three first) and threshold (tau 0.9)
                       remasking (one compiled call timed, `--sampler_repeats`): tokens/s,
                       model calls per sequence, FLOPs (`benchmark_sampler.call_flops`). Random
                       weights are never confident, so threshold decoding degenerates to one token
                       per call there (32 calls a block): its rows time the caches, not the
                       threshold's saving.
  peer_logits_<peer>   the peer's logits against ours on the same weights (float32 both, every
                       position of 2 rows of 512 tokens); the peer's timing rows run only if they
                       agree (relative L2 error under --logits_tol).
  peer_train_official  StableDRL's / LLaDA's official modeling code: forward + backward of one
                       microbatch (G x K rows of 512, float32 weights under bf16 autocast, full
                       logits, no remat, no optimizer: a lower bound on its train step).
  peer_sampler_official   ML-GSAI/LLaDA's generate() (low_confidence, no cache) on --peer_rows
                       rows, bf16 weights.
  peer_sampler_fast_dllm  NVlabs/Fast-dLLM's generate_with_dual_cache(threshold=0.9) on
                       --fast_dllm_rows rows, one row per call (its samplers build a batch of one).

The model: LLaDA's architecture at about 1B non-embedding parameters, d_model 2048, 22 layers,
16 heads (head_dim 128, no GQA), SwiGLU 5632, vocab 126464 (1.65B with the embedding and head),
random weights (seed 0). `--smoke` shrinks everything to the `tiny` config and toy shapes (CPU,
seconds).

After EVERY row the JSON (`--output`) and the Markdown table (`--output` with .md) are rewritten
(atomically), so a run cut short by the device's time limit still reports every row it finished;
`"complete": true` marks a run that reached its end. `--budget_s` skips the rows that would start
after that many seconds (each skipped row says so). Memory: `peak_memory` is the device
allocator's process-wide peak after the row (jax rows; it only grows within a run) or
torch.cuda.max_memory_allocated over the row (peer rows), "-" on CPU; jax rows also carry XLA's
compiled memory analysis (`xla_memory_bytes`, per call). `--profile DIR` writes a jax profiler
trace of one call of the first train row and of the first sampler row.

Preparing the device machine (it has no network; jax, flax, optax, orbax, chex, torch and
transformers are in its image):

  1. The peers' code, into an ignored folder (third_party/ is in .gitignore), on a machine with
     network access: clone the three repositories, then copy the few files read at run time
     (`gpu_check_peers.PEER_FILES`, a few hundred KB; the run tool carries 64 MiB at most):
       for r in ML-GSAI/LLaDA NVlabs/Fast-dLLM JianyuanZhong/StableDRL; do
         git clone --depth 1 <GitHub>/$r /tmp/clones/${r#*/}; done
       python experiments/gpu_check_peers.py --collect /tmp/clones --peers_dir third_party
     (From the bare mirrors a session's fetch tool makes, `git --git-dir=MIRROR show HEAD:PATH`
     writes each of those files.)
  2. The wheels the image lacks, for Python 3.12:
       pip download -d third_party/wheels --only-binary=:all: --python-version 3.12 \
           --platform manylinux2014_x86_64 ml_collections einops
     (einops: Fast-dLLM's modeling imports it; this script imports nothing else the image
     lacks.)
  3. On the device, from the repository root (carry third_party):
       pip install --no-index --find-links third_party/wheels ml_collections einops
       PYTHONPATH=. python experiments/gpu_check.py --output $OUT/gpu_check.json \
           --peers_dir third_party

Without torch, or without the peers folder, the peer rows are skipped with the reason.
"""

from __future__ import annotations

import os

# The torch peers run in subprocesses on the same GPU: jax must not take 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import benchmark
import benchmark_sampler
import gpu_check_peers
from stabledrl_jax import models, profiling
from stabledrl_jax.models.llada import flops as flops_lib, sampler as llada_sampler
from stabledrl_jax.plan import report as plan_report

HERE = os.path.dirname(os.path.abspath(__file__))

# LLaDA's architecture at ~1B non-embedding parameters (LLaDA-8B's vocabulary and special tokens).
MODEL_1B = dict(d_model=2048, n_heads=16, n_kv_heads=16, n_layers=22, mlp_hidden_size=5632,
                vocab_size=126464, embedding_size=126464, rope_theta=500000.0,
                mask_token_id=126336, eos_token_id=126081, max_sequence_length=4096)

# The paper's shapes (docs/training.md, "Configs") and --smoke's toy ones.
SHAPES = {
    "full": dict(
        model=MODEL_1B,
        train=dict(prompts=8, group_size=16, num_samples=2, prompt_length=256, gen_length=256,
                   block_length=32),
        sampler=dict(rows=64, prompt_length=256, gen_length=256, steps=128, block_length=32,
                     temperature=0.9, threshold=0.9),
        peak_sizes=[4096, 8192], peak_seconds=0.3, logits_rows=2),
    "smoke": dict(
        model=dict(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=128,
                   vocab_size=128, mask_token_id=127, eos_token_id=126, rope_theta=10000.0,
                   max_sequence_length=512),
        train=dict(prompts=2, group_size=2, num_samples=2, prompt_length=16, gen_length=16,
                   block_length=8),
        sampler=dict(rows=2, prompt_length=8, gen_length=16, steps=8, block_length=8,
                     temperature=0.9, threshold=0.9),
        peak_sizes=[128], peak_seconds=0.02, logits_rows=2),
}

CACHES = llada_sampler.CACHES
REMASKINGS = ("low_confidence", "threshold")
PEERS = ("official", "fast_dllm")
ROW_NAMES = (["env", "peak", "train_xla", "train_cudnn"]
             + [f"sampler_{c}_{r}" for r in REMASKINGS for c in CACHES]
             + ["peer_logits_official", "peer_train_official", "peer_sampler_official",
                "peer_logits_fast_dllm", "peer_sampler_fast_dllm"])
GROUPS = {"all": ROW_NAMES, "train": ["train_xla", "train_cudnn"],
          "sampler": [n for n in ROW_NAMES if n.startswith("sampler_")],
          "peers": [n for n in ROW_NAMES if n.startswith("peer_")]}


def parse_rows(text: str) -> list[str]:
  """--rows: comma-separated row names or groups, in the script's order; env always first."""
  chosen = set()
  for item in (t.strip() for t in text.split(",") if t.strip()):
    if item in GROUPS:
      chosen.update(GROUPS[item])
    elif item in ROW_NAMES:
      chosen.add(item)
    else:
      raise argparse.ArgumentTypeError(
          f"--rows: unknown row {item!r} (rows: {', '.join(ROW_NAMES)}; groups: "
          f"{', '.join(GROUPS)})")
  return [n for n in ROW_NAMES if n in chosen or n == "env"]


def has_attention_field() -> bool:
  """Whether this checkout's ModelConfig has the ``attention`` field (model.attention)."""
  return "attention" in {f.name for f in dataclasses.fields(models.ModelConfig)}


def model_config(shape: dict, *, smoke: bool, attention: str | None,
                 train: bool = True) -> models.ModelConfig:
  """The check's model: bf16 compute on float32 weights, remat (train rows) and scanned layers
  as the paper configs; ``attention`` when the config has the field. --smoke: float32 compute,
  neither remat nor scan (they slow the toy's CPU compile; the values are the same).

  The sampler's model has no remat: it takes no gradient, and at this writing
  ``llada_sampler.generate(cache="none")`` of a remat model fails with flax's TraceContextError
  (the remat'd last block of ``encode(span=...)`` inside the sampler's loops)."""
  dtype = jnp.float32 if smoke else jnp.bfloat16
  fields = dict(shape["model"], param_dtype=jnp.float32, dtype=dtype, logits_dtype=jnp.float32,
                remat=train and not smoke, scan_layers=not smoke)
  if attention is not None and has_attention_field():
    fields["attention"] = attention
  return models.ModelConfig(**fields)


def version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


class Report:
  """The rows so far, rewritten to the JSON and the Markdown table after every row."""

  def __init__(self, output: str, settings: dict):
    self.output = output
    self.markdown = os.path.splitext(output)[0] + ".md" if output else ""
    self.data = dict(complete=False, settings=settings, environment={}, rows=[])
    self.start = time.perf_counter()

  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  def add(self, row: dict) -> None:
    row.setdefault("elapsed_s", round(self.elapsed(), 1))
    self.data["rows"].append(row)
    self._print(row)
    self.write()

  def write(self) -> None:
    if not self.output:
      return
    # The plan command's writer: each file whole or not at all, a failure one line.
    plan_report.write_report(self.output, json.dumps(self.data, indent=2, default=str) + "\n")
    plan_report.write_report(self.markdown, self.table() + "\n")

  @staticmethod
  def _print(row: dict) -> None:
    extra = row.get("reason") or row.get("note") or ""
    print(f"[{row.get('elapsed_s', 0):7.1f}s] {row['row']}: {row['status']}"
          + (f" {row['tokens_per_s']:,.1f} tokens/s" if row.get("tokens_per_s") else "")
          + (f" ({extra})" if extra else ""), flush=True)

  def table(self) -> str:
    env = self.data["environment"]
    lines = [f"# gpu_check ({'complete' if self.data['complete'] else 'partial'})", ""]
    if env:
      lines += [f"device {env.get('device_kind')} ({env.get('backend')}), jax {env.get('jax')}, "
                f"torch {env.get('torch') or '-'}, transformers {env.get('transformers') or '-'}"
                f"; model {env.get('model')}", ""]
    lines += plan_report.table(
        ["row", "status", "seconds", "tokens/s", "MFU (spec)", "MFU (measured)", "calls/seq",
         "peak memory GiB", "note"], "llrrrrrrl",
        [[r["row"], r["status"], _fmt(r.get("seconds"), "{:.3f}"),
          _fmt(r.get("tokens_per_s"), "{:,.0f}"), _fmt(r.get("mfu_spec"), "{:.1%}"),
          _fmt(r.get("mfu_measured"), "{:.1%}"), _fmt(r.get("calls_per_sequence"), "{:.1f}"),
          _fmt(r.get("peak_memory_bytes"), "{:.2f}", scale=2**-30),
          r.get("reason") or r.get("note") or ""]
         for r in self.data["rows"] if r["row"] != "env"])
    return "\n".join(lines)


def _fmt(value, spec: str, scale: float = 1.0) -> str:
  return "-" if value is None else spec.format(value * scale)


class Skip(Exception):
  """A row that cannot run here; its message is the stated reason."""


@dataclasses.dataclass
class Context:
  args: argparse.Namespace
  shape: dict
  report: Report
  peak_measured: float | None = None
  profiled: set = dataclasses.field(default_factory=set)
  tmp: str = ""  # the peers' exchange folder: x.npy (the logits check's tokens), hf/, jobs


def spec_peak() -> float | None:
  return profiling.peak_flops_per_device()


def mfu_fields(ctx: Context, flops: float, seconds: float) -> dict:
  rate = flops / seconds
  spec = spec_peak()
  return dict(flops=flops, flops_per_s=rate, mfu_spec=rate / spec if spec else None,
              mfu_measured=rate / ctx.peak_measured if ctx.peak_measured else None)


def maybe_profile(ctx: Context, kind: str, name: str, call: Callable[[], Any]) -> str | None:
  """One traced call of the first row of ``kind`` when --profile is given; the trace's folder."""
  if not ctx.args.profile or kind in ctx.profiled:
    return None
  trace = getattr(jax.profiler, "trace", None)
  if trace is None:  # guarded: the profiler API moved between jax versions
    return None
  ctx.profiled.add(kind)
  folder = os.path.join(ctx.args.profile, name)
  try:
    with trace(folder):
      jax.block_until_ready(call())
  except Exception as e:  # pylint: disable=broad-except
    return f"profiling failed: {_one_line(e)}"  # the row's timing stands
  return folder


# ---------------------------------------------------------------------------
# jax rows.
# ---------------------------------------------------------------------------


def env_row(ctx: Context) -> dict:
  device = jax.devices()[0]
  config = model_config(ctx.shape, smoke=ctx.args.smoke, attention=None)
  env = dict(backend=jax.default_backend(), device_kind=device.device_kind,
             device_count=jax.device_count(), python=platform.python_version(),
             jax=jax.__version__, jaxlib=version("jaxlib"), flax=version("flax"),
             torch=version("torch"), transformers=version("transformers"),
             spec_peak_flops=spec_peak(), attention_field=has_attention_field(),
             model=(f"d_model {config.d_model}, {config.n_layers} layers, {config.n_heads} heads, "
                    f"SwiGLU {config.mlp_hidden_size}, vocab {config.vocab_size}: "
                    f"{models.count_params(config) / 1e6:,.1f}M parameters"),
             xla_python_client_preallocate=os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"))
  ctx.report.data["environment"] = env
  return dict(row="env", status="ok", **env)


def peak_row(ctx: Context) -> dict:
  dtype = jnp.float32 if ctx.args.smoke else jnp.bfloat16
  peak = benchmark.peak_call(ctx.shape["peak_sizes"], dtype, ctx.shape["peak_seconds"])
  timings = profiling.time_interleaved({0: peak.call}, 3)
  ctx.peak_measured = peak.flops / timings.median[0]
  spec = spec_peak()
  return dict(row="peak", status="ok", seconds=timings.median[0], flops=peak.flops,
              flops_per_s=ctx.peak_measured, size=peak.size, chain=peak.chain,
              dtype=jnp.dtype(dtype).name,
              mfu_spec=ctx.peak_measured / spec if spec else None,
              note=f"{ctx.peak_measured / 1e12:.2f} TFLOP/s, [{peak.size}]^2 "
                   f"{jnp.dtype(dtype).name} products")


def train_row(ctx: Context, attention: str) -> dict:
  note = ""
  if attention == "cudnn":
    if not has_attention_field():
      raise Skip("ModelConfig has no `attention` field in this checkout")
    if jax.default_backend() != "gpu":
      raise Skip(f"cudnn attention needs a CUDA GPU (backend {jax.default_backend()})")
  elif not has_attention_field():
    note = "ModelConfig has no `attention` field: its only attention (XLA)"
  config = model_config(ctx.shape, smoke=ctx.args.smoke, attention=attention)
  t = ctx.shape["train"]
  w = benchmark.Workload(prompts=t["prompts"], group_size=t["group_size"],
                         num_samples=t["num_samples"], prompt_length=t["prompt_length"],
                         gen_length=t["gen_length"], steps=t["gen_length"] // 2,
                         block_length=t["block_length"], microbatch_groups=1)
  model = models.LLaDA(config, rngs=nnx.Rngs(0))
  case = benchmark.train_step_case(f"llada_1b_{attention}", model, w)
  del model
  timings = profiling.time_interleaved({0: case.call}, ctx.args.train_repeats)
  seconds = timings.median[0]
  trace = maybe_profile(ctx, "train", f"train_{attention}", case.call)
  return dict(row=f"train_{attention}", status="ok", seconds=seconds, samples_s=timings.samples[0],
              first_call_s=timings.first_call[0], tokens=case.tokens,
              tokens_per_s=case.tokens / seconds, **mfu_fields(ctx, case.flops, seconds),
              xla_memory_bytes=case.memory, peak_memory_bytes=profiling.device_peak_memory(),
              shape=dict(case.shape, microbatch_rows=w.group_size * w.num_samples),
              attention=getattr(config, "attention", None), trace=trace, note=note)


def sampler_row(ctx: Context, cache: str, remasking: str, model, prompt) -> dict:
  s = ctx.shape["sampler"]
  config = model.config
  graphdef, state = nnx.split(model)
  key = jax.random.key(2)

  def sample(state, prompt, key):
    return llada_sampler.generate(nnx.merge(graphdef, state), prompt, key=key,
                                  gen_length=s["gen_length"], steps=s["steps"],
                                  block_length=s["block_length"], temperature=s["temperature"],
                                  remasking=remasking, threshold=s["threshold"], cache=cache,
                                  return_reveal_step=True, return_stats=True)

  compiled, memory = benchmark._compiled(jax.jit(sample), state, prompt, key)  # pylint: disable=protected-access
  call = lambda: compiled(state, prompt, key)
  if ctx.args.sampler_repeats:
    timings = profiling.time_interleaved({0: call}, ctx.args.sampler_repeats)
    seconds, samples, first = timings.median[0], timings.samples[0], timings.first_call[0]
    outputs = timings.outputs[0]
  else:  # one call of the compiled program, no warm-up (a random model's threshold rows are slow)
    start = time.perf_counter()
    outputs = jax.block_until_ready(call())
    seconds = first = time.perf_counter() - start
    samples = [seconds]
  _, reveal_step, stats = outputs
  blocks = s["gen_length"] // s["block_length"]
  per_block = benchmark_sampler.block_calls(
      np.asarray(reveal_step), block_length=s["block_length"],
      steps_per_block=s["block_length"] if remasking == "threshold" else s["steps"] // blocks)
  flops = benchmark_sampler.call_flops(config, batch=s["rows"], prompt_length=s["prompt_length"],
                                       gen_length=s["gen_length"], block_length=s["block_length"],
                                       cache=cache, block_calls=per_block)
  tokens = s["rows"] * s["gen_length"]
  trace = maybe_profile(ctx, "sampler", f"sampler_{cache}_{remasking}", call)
  return dict(row=f"sampler_{cache}_{remasking}", status="ok", seconds=seconds,
              samples_s=samples, first_call_s=first, tokens=tokens,
              tokens_per_s=tokens / seconds, **mfu_fields(ctx, flops, seconds),
              calls_per_sequence=float(np.mean(stats["model_calls"])),
              forward_passes=int(stats["forward_passes"]), xla_memory_bytes=memory,
              peak_memory_bytes=profiling.device_peak_memory(), shape=dict(s),
              attention=getattr(config, "attention", None), trace=trace)


def sampler_model(ctx: Context):
  """The sampler rows' model (seed 0, as the train rows') and random prompts [rows, P]."""
  config = model_config(ctx.shape, smoke=ctx.args.smoke, attention=ctx.args.sampler_attention,
                        train=False)
  model = models.LLaDA(config, rngs=nnx.Rngs(0))
  s = ctx.shape["sampler"]
  prompt = jax.random.randint(jax.random.key(1), (s["rows"], s["prompt_length"]), 0,
                              config.vocab_size - 2, jnp.int32)
  return model, prompt


# ---------------------------------------------------------------------------
# Peer rows: gpu_check_peers.py in a subprocess per peer.
# ---------------------------------------------------------------------------


def peers_available(args) -> str | None:
  """None when the peers can run, else the reason they cannot."""
  if not args.peers_dir:
    return "no --peers_dir given"
  if not os.path.isdir(args.peers_dir):
    return f"--peers_dir {args.peers_dir} is not a folder"
  if args.peer_python == sys.executable and importlib.util.find_spec("torch") is None:
    return "torch is not importable here (--peer_python names another interpreter)"
  return None


def our_logits(model, tokens: np.ndarray) -> np.ndarray:
  """Float32 logits of ``model``'s weights (a float32-compute copy) on every position."""
  config32 = model.config.replace(dtype=jnp.float32, logits_dtype=jnp.float32)
  graphdef32 = nnx.graphdef(nnx.eval_shape(lambda: models.LLaDA(config32, rngs=nnx.Rngs(0))))
  state = nnx.state(model)  # an argument of the jitted forward, not constants baked into it
  forward = jax.jit(lambda state, t: nnx.merge(graphdef32, state)(t))
  precision = getattr(jax, "default_matmul_precision", None)  # guarded across jax versions
  with precision("highest") if precision is not None else contextlib.nullcontext():
    return np.asarray(forward(state, jnp.asarray(tokens)))


def logits_agreement(ours: np.ndarray, theirs: np.ndarray) -> dict:
  diff = ours.astype(np.float64) - theirs.astype(np.float64)
  return dict(max_abs_diff=float(np.abs(diff).max()),
              relative_l2=float(np.linalg.norm(diff) / max(np.linalg.norm(ours), 1e-30)),
              argmax_agreement=float((ours.argmax(-1) == theirs.argmax(-1)).mean()))


def peer_jobs(ctx: Context, peer: str, wanted: list[str], tmp: str, prompt: np.ndarray) -> list:
  s, t = ctx.shape["sampler"], ctx.shape["train"]
  jobs = []
  if f"peer_logits_{peer}" in wanted:
    jobs.append(dict(kind="logits", name=f"peer_logits_{peer}", tokens=os.path.join(tmp, "x.npy"),
                     out=os.path.join(tmp, f"logits_{peer}.npy")))
  if f"peer_train_{peer}" in wanted:
    jobs.append(dict(kind="train", name=f"peer_train_{peer}",
                     rows=t["group_size"] * t["num_samples"],
                     length=t["prompt_length"] + t["gen_length"], repeats=ctx.args.train_repeats))
  if f"peer_sampler_{peer}" in wanted:
    rows = ctx.args.peer_rows if peer == "official" else ctx.args.fast_dllm_rows
    np.save(os.path.join(tmp, f"prompt_{peer}.npy"), prompt[:rows])
    jobs.append(dict(kind="sampler", name=f"peer_sampler_{peer}",
                     prompt=os.path.join(tmp, f"prompt_{peer}.npy"), rows=rows,
                     gen_length=s["gen_length"], steps=s["steps"],
                     block_length=s["block_length"], temperature=s["temperature"],
                     threshold=s["threshold"], repeats=1))
  return jobs


def peer_reason(args, peer: str) -> str | None:
  """None when ``peer`` can run, else why not."""
  reason = peers_available(args)
  missing = gpu_check_peers.missing_files(peer, args.peers_dir) if not reason else []
  return reason or (f"--peers_dir {args.peers_dir} has no {', '.join(missing)}" if missing
                    else None)


def peer_rows(ctx: Context, peer: str, wanted: list[str], model, prompt) -> None:
  """Runs one peer's jobs in a subprocess, turning each finished job into a row as it lands."""
  names = [n for n in wanted if n.startswith("peer_") and n.endswith(peer)]
  if not names:
    return
  tmp = ctx.tmp
  reason = peer_reason(ctx.args, peer)
  if reason:
    for n in names:
      ctx.report.add(dict(row=n, status="skipped", reason=reason))
    return
  left = ctx.args.budget_s - ctx.report.elapsed()
  if left <= 0:
    for n in names:
      ctx.report.add(dict(row=n, status="skipped", reason=budget_reason(ctx)))
    return
  tokens = np.asarray(prompt)[:ctx.shape["logits_rows"]]
  tokens = np.concatenate([tokens, np.full((tokens.shape[0], ctx.shape["sampler"]["gen_length"]),
                                           model.config.mask_token_id, np.int32)], axis=1)
  rng = np.random.default_rng(3)  # the completion half-masked, half random tokens
  filled = rng.integers(0, model.config.vocab_size - 2, tokens.shape)
  keep = rng.random(tokens.shape) < 0.5
  tokens[:, prompt.shape[1]:] = np.where(keep, filled, tokens)[:, prompt.shape[1]:]
  np.save(os.path.join(tmp, "x.npy"), tokens)
  jobs = peer_jobs(ctx, peer, names, tmp, np.asarray(prompt))
  with open(os.path.join(tmp, f"jobs_{peer}.json"), "w") as f:
    json.dump(jobs, f)
  out_path = os.path.join(tmp, f"out_{peer}.json")
  command = [ctx.args.peer_python, os.path.join(HERE, "gpu_check_peers.py"), "--peer", peer,
             "--peers_dir", ctx.args.peers_dir, "--model_dir", os.path.join(tmp, "hf"),
             "--jobs", os.path.join(tmp, f"jobs_{peer}.json"), "--output", out_path]
  log = open(os.path.join(tmp, f"log_{peer}.txt"), "w")
  proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
  done, deadline, failed_check = 0, time.perf_counter() + left, None
  while True:
    finished = proc.poll() is not None
    data = _read_json(out_path)
    if data and done == 0 and (data.get("error") or data.get("skip")):
      for n in names:
        ctx.report.add(dict(row=n, status="skipped" if data.get("skip") else "failed",
                            reason=f"{peer}: {data.get('skip') or data['error']}",
                            peer_traceback=data.get("traceback")))
      done = len(names)
    for job in (data or {}).get("jobs", [])[done:]:
      row = peer_row(ctx, peer, job, model)
      row.update(torch=data.get("torch"), transformers=data.get("transformers"),
                 peer_device=data.get("device"))
      if job["kind"] == "logits" and row["status"] != "ok":
        failed_check = row.get("reason")
      ctx.report.add(row)
      done += 1
      if failed_check and not finished:
        _kill(proc)  # the timing rows of a model that computes something else mean nothing
        finished = True
    if finished or done >= len(names):
      break
    if time.perf_counter() > deadline:
      _kill(proc)
      break
    time.sleep(0.5)
  proc.wait()
  log.close()
  for job in jobs[done:]:
    reason = (f"the logits check failed ({failed_check})" if failed_check else
              budget_reason(ctx) if time.perf_counter() > deadline else
              f"the peer process exited (rc {proc.returncode}); its log: "
              + _tail(os.path.join(tmp, f"log_{peer}.txt")))
    ctx.report.add(dict(row=job["name"], status="skipped", reason=reason))


def _kill(proc: subprocess.Popen) -> None:
  """Ends the peer process and anything it started (its own session)."""
  with contextlib.suppress(ProcessLookupError):
    os.killpg(proc.pid, signal.SIGKILL)


def _read_json(path: str) -> dict | None:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _tail(path: str) -> str:
  try:
    with open(path) as f:
      lines = [l.strip() for l in f.read().splitlines() if l.strip()]
    return lines[-1][:300] if lines else "(empty)"
  except OSError:
    return "(none)"


def peer_row(ctx: Context, peer: str, job: dict, model) -> dict:
  """The row of one finished peer job (the logits job: compared with ours here)."""
  name = job["name"]
  base = dict(row=name, peer=peer, dtype=job.get("dtype"))
  if job["status"] != "ok":
    return dict(base, status="failed", reason=job.get("reason"),
                peer_traceback=job.get("traceback"))
  if job["kind"] == "logits":
    tokens = np.load(os.path.join(ctx.tmp, "x.npy"))
    theirs = np.load(os.path.join(ctx.tmp, f"logits_{peer}.npy"))
    ours = our_logits(model, tokens)
    if ours.shape != theirs.shape:
      return dict(base, status="failed", reason=f"logits shapes differ: ours {ours.shape}, "
                                                f"{peer}'s {theirs.shape}")
    agree = logits_agreement(ours, theirs)
    ok = agree["relative_l2"] < ctx.args.logits_tol
    return dict(base, status="ok" if ok else "failed", **agree, tolerance=ctx.args.logits_tol,
                shape=list(ours.shape),
                note=f"relative L2 {agree['relative_l2']:.2e}, max |diff| "
                     f"{agree['max_abs_diff']:.2e}, argmax agree {agree['argmax_agreement']:.1%}",
                reason=None if ok else f"logits disagree: relative L2 {agree['relative_l2']:.2e}"
                                       f" >= {ctx.args.logits_tol}")
  seconds = job["seconds"]
  row = dict(base, status="ok", seconds=seconds, samples_s=job.get("samples_s"),
             tokens=job["tokens"], tokens_per_s=job["tokens"] / seconds,
             peak_memory_bytes=job.get("peak_memory_bytes"))
  if job["kind"] == "train":
    config = model.config
    flops = 3 * flops_lib.forward_flops(config, job["rows"], job["length"])
    row.update(mfu_fields(ctx, flops, seconds), rows=job["rows"], length=job["length"],
               note="forward + backward only, full logits, no remat")
  else:
    row.update(calls_per_sequence=job["calls_per_sequence"], rows=job["rows"],
               mask_tokens_left=job.get("masks_left"),
               note=("generate(), low_confidence, no cache" if peer == "official" else
                     "generate_with_dual_cache(threshold), one row per call")
               + f", {job['rows']} rows")
  return row


def budget_reason(ctx: Context) -> str:
  return f"time budget spent ({ctx.report.elapsed():.0f} s of --budget_s {ctx.args.budget_s:g})"


# ---------------------------------------------------------------------------


def run(args) -> dict:
  shape = SHAPES["smoke" if args.smoke else "full"]
  if args.sampler_rows:
    shape = dict(shape, sampler=dict(shape["sampler"], rows=args.sampler_rows))
  if args.train_prompts:
    shape = dict(shape, train=dict(shape["train"], prompts=args.train_prompts))
  settings = dict(vars(args), shapes=shape)
  report = Report(args.output, settings)
  ctx = Context(args=args, shape=shape, report=report)
  rows = args.rows
  guarded = lambda name, fn: _guarded(ctx, name, fn)
  guarded("env", lambda: env_row(ctx))
  needs_peak = any(n.startswith(("train", "sampler", "peer_train")) for n in rows)
  if "peak" in rows or needs_peak:
    guarded("peak", lambda: peak_row(ctx))
  for attention in ("xla", "cudnn"):
    if f"train_{attention}" in rows:
      guarded(f"train_{attention}", lambda a=attention: train_row(ctx, a))
  model = prompt = None
  if any(n.startswith(("sampler_", "peer_")) for n in rows):
    model, prompt = sampler_model(ctx)
  for remasking in REMASKINGS:  # the fixed schedule's rows first: a random model's threshold
    for cache in CACHES:       # rows are the slowest (one token per call)
      if f"sampler_{cache}_{remasking}" in rows:
        guarded(f"sampler_{cache}_{remasking}",
                lambda c=cache, r=remasking: sampler_row(ctx, c, r, model, prompt))
  if any(n.startswith("peer_") for n in rows):
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
      ctx.tmp = tmp
      runnable = [p for p in PEERS if not peer_reason(args, p)]
      try:
        if runnable:  # the same weights for every peer, by their Hugging Face names
          models.save_pretrained(model, os.path.join(tmp, "hf"))
      except Exception as e:  # pylint: disable=broad-except
        for n in (n for n in rows if n.startswith("peer_")):
          report.add(dict(row=n, status="failed",
                          reason=f"exporting the weights failed: {_one_line(e)}"))
      else:
        for peer in PEERS:
          peer_rows(ctx, peer, rows, model, prompt)
  report.data["complete"] = True
  report.data["total_s"] = round(report.elapsed(), 1)
  report.write()
  return report.data


def _one_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0] if text else ''}"[:400]


def _guarded(ctx: Context, name: str, fn: Callable[[], dict]) -> None:
  """Runs one row: its failure or skip becomes the row (with the reason), never the run's end."""
  if name != "env" and ctx.report.elapsed() > ctx.args.budget_s:
    ctx.report.add(dict(row=name, status="skipped", reason=budget_reason(ctx)))
    return
  try:
    row = fn()
  except Skip as e:
    row = dict(row=name, status="skipped", reason=str(e))
  except Exception as e:  # pylint: disable=broad-except
    row = dict(row=name, status="failed", reason=_one_line(e),
               traceback=traceback.format_exc()[-3000:])
  ctx.report.add(row)


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--output", default="gpu_check.json",
                      help="the JSON to write (the Markdown table goes beside it, .md)")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, seconds)")
  parser.add_argument("--rows", type=parse_rows, default=parse_rows("all"),
                      help=f"comma-separated rows or groups ({', '.join(GROUPS)}); default all")
  parser.add_argument("--peers_dir", default="",
                      help="folder with LLaDA/, Fast-dLLM/ and StableDRL/ (see the docstring)")
  parser.add_argument("--peer_python", default=sys.executable,
                      help="the interpreter that runs the torch peers (default: this one)")
  parser.add_argument("--peer_rows", type=int, default=16,
                      help="rows of the official sampler's batch")
  parser.add_argument("--fast_dllm_rows", type=int, default=4,
                      help="rows Fast-dLLM decodes (one per call)")
  parser.add_argument("--sampler_rows", type=int, default=0,
                      help="rows of our sampler (0: the shape's, 64 at full size)")
  parser.add_argument("--train_prompts", type=int, default=0,
                      help="P of the train rows (0: the shape's, 8; G = 16 and K = 2 fixed)")
  parser.add_argument("--sampler_attention", default="xla",
                      help="model.attention of the sampler rows (when the config has it)")
  parser.add_argument("--train_repeats", type=int, default=2)
  parser.add_argument("--sampler_repeats", type=int, default=0,
                      help="0: time one call of the compiled sampler; n: a warm-up call, then "
                           "the median of n")
  parser.add_argument("--logits_tol", type=float, default=1e-3,
                      help="largest relative L2 error of the peers' float32 logits")
  parser.add_argument("--budget_s", type=float, default=540.0,
                      help="rows that would start after this many seconds are skipped")
  parser.add_argument("--profile", default="",
                      help="folder for jax profiler traces of one train and one sampler call")
  args = parser.parse_args(argv)
  for name in ("peer_rows", "fast_dllm_rows", "train_repeats"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  for name in ("sampler_rows", "train_prompts", "sampler_repeats"):
    if getattr(args, name) < 0:
      parser.error(f"--{name} must be >= 0, got {getattr(args, name)}")
  if args.output:  # an unwritable --output is found now, not after the first row's minutes
    try:
      os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
      with open(args.output + ".tmp", "w"):
        pass
      os.remove(args.output + ".tmp")
    except OSError as e:
      parser.error(f"--output {args.output}: {e.strerror or e}")
  if not args.smoke and jax.default_backend() == "cpu":
    print("warning: the full shapes on a CPU take hours; --smoke is the CPU check", flush=True)
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  data = run(args)
  failed = [r["row"] for r in data["rows"] if r["status"] == "failed"]
  print(f"\nwrote {args.output} and {os.path.splitext(args.output)[0]}.md"
        + (f"; failed rows: {', '.join(failed)}" if failed else ""))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
