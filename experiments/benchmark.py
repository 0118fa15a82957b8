"""Throughput, model FLOP utilization (MFU) and memory of the forward pass, the train step and the
sampler, against this machine's measured matmul peak.

    python experiments/benchmark.py --output bench.json            # tiny + small, ~3 min on 2 CPUs
    python experiments/benchmark.py --output b.json --configs tiny --repeats 1 --no_scaling

What is measured (random weights and tokens; P prompts x G completions of length L = prompt +
gen; K Monte Carlo samples; the paper's StableDRL setting: block_random masks, SPG sandwich):

  peak        [n, n] x [n, n] matmuls (`jnp.dot`) in the benchmark dtype, 2 n^3 FLOPs each, n the
              fastest of `--peak_sizes` (on CPU a large n spills out of the caches and is
              slower), chained to last about `--peak_seconds` per call. Its calls are
              interleaved with the rows' calls, so that both see the same load.
  forward     jitted model(tokens), logits of every position: N * K rows of length L.
  train_core  jit(value_and_grad) of `rl_loss.objective_loss`: mask sampling, one forward pass of
              the N * K noised rows (logits of the completion positions only, as the trainer
              computes them), the objective, the backward pass (docs/training.md).
  train_step  `train_step.make_update_fn`: the train core plus gradient clipping, AdamW and the
              non-finite check, state donated (what the trainer runs per inner iteration).
  train_step_lora<r>  (``--lora_rank r``) the same with rank-r LoRA adapters on every projection
              and the base frozen in bfloat16: only the adapters are differentiated and held by
              AdamW (docs/training.md, "LoRA"). Its FLOPs are counted as the full step's.
  sampler     `models/llada/sampler.generate` on the N rollout rows (temperature 0.9, low-confidence
              remasking, `--steps` model calls).

Per row: seconds (median of `--repeats` warm calls), tokens/s (sequence positions through the
model: N * K * L for forward and training, N * gen for the sampler), FLOPs (matmul FLOPs counted
from the config by `models.llada.flops`, whose docstring has the formula: 2 per multiply-add of
every kernel but the embedding, plus 4 L D per token per layer for attention; forward + backward = 3x
the forward; training counts the last block's queries and the head on the gen completion
positions; the sampler counts `steps` passes with the last block and the head on one block),
FLOP/s, MFU and peak memory. MFU is the median over repeats of the row's FLOP/s over the mean
peak FLOP/s of the matmul calls just before and after it (on a shared machine the load drifts
during a run; neighbouring calls see about the same load); `peak_flops` is the median of all
peak calls. Peak
memory is XLA's compiled memory analysis (arguments + outputs - donated + temporaries, per
device; `profiling.compiled_memory`), the same measure on every backend; on GPU and TPU the JSON
also holds the allocator's process-wide peak (`device_peak_memory_bytes`).

Scaling rows (`--scaling_config`): the train core at several group sizes G and MC sample counts K,
and the sampler at several generation lengths (steps = gen_length / 2 there too, so its FLOPs grow
about quadratically); each with `relative_cost` = (seconds / FLOPs) / (the same at the smallest
value): 1.0 everywhere means time proportional to the work, i.e. linear in G and K.

JSON (`--output`):

    {"peak_flops": float, "dtype": str, "memory_source": str, "machine": {...}, "settings": {...},
     "peak": {"size", "chain", "flops_per_call", "calibration_flops_per_s": {size: FLOP/s}},
     "rows": [{"config", "what", "seconds", "tokens", "tokens_per_s", "flops", "flops_per_s",
               "mfu", "peak_memory_bytes", "shape": {...}, "samples_s",
               "nearby_peak_flops_per_s"}],
     "scaling": [{"vary": "group_size" | "num_samples" | "gen_length", "value", "relative_cost",
                  and every field of a row}]}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stabledrl_jax import models, profiling
from stabledrl_jax.models.llada import flops as flops_lib, sampler as llada_sampler
from stabledrl_jax.training.config import config_lib, specs
from stabledrl_jax.training.parallel import mesh as mesh_lib
from stabledrl_jax.training.step import build, rl_loss


@dataclasses.dataclass
class Case:
  """One timed computation: `call()` runs it once; `flops` and `tokens` are per call."""

  config: str
  what: str
  call: Callable[[], Any]
  flops: int
  tokens: int
  memory: int
  shape: dict[str, int]
  vary: str | None = None
  value: int | None = None


@dataclasses.dataclass(frozen=True)
class Workload:
  """The shapes of one measurement."""

  prompts: int
  group_size: int
  num_samples: int
  prompt_length: int
  gen_length: int
  steps: int
  block_length: int
  microbatch_groups: int = 0  # train.microbatch_groups: 0 the whole batch at once, 1 the paper's

  @property
  def sequences(self) -> int:
    return self.prompts * self.group_size

  @property
  def length(self) -> int:
    return self.prompt_length + self.gen_length


def rl_config(w: Workload):
  """The trainer's config for a workload: the paper's StableDRL setting at these sizes."""
  c = config_lib.base_config()
  c.rollout.update(num_prompts=w.prompts, group_size=w.group_size,
                   prompt_length=w.prompt_length, gen_length=w.gen_length, steps=w.steps,
                   block_length=w.block_length)
  c.estimator.update(num_samples=w.num_samples, block_length=w.block_length)
  c.train.update(microbatch_groups=w.microbatch_groups)
  c.mesh.update(data=1, fsdp=1, tensor=1)
  specs.validate(c)
  return c


def rollout_batch(model_config: models.ModelConfig, w: Workload, seed: int = 0
                  ) -> rl_loss.RolloutBatch:
  """Random rollouts: N sequences [prompt; completion], no padding, no EOS."""
  rng = np.random.default_rng(seed)
  n, length = w.sequences, w.length
  tokens = rng.integers(0, model_config.vocab_size - 2, (n, length)).astype(np.int32)
  prompt = np.zeros((n, length), bool)
  prompt[:, :w.prompt_length] = True
  return rl_loss.RolloutBatch(
      tokens=jnp.asarray(tokens), prompt_mask=jnp.asarray(prompt),
      completion_mask=jnp.asarray(~prompt), attention_mask=jnp.ones((n, length), bool),
      advantages=jnp.asarray(rng.standard_normal(n), jnp.float32),
      old_logp=jnp.zeros((n,), jnp.float32), ref_logp=jnp.zeros((n,), jnp.float32))


def _compiled(jitted, *args) -> tuple[jax.stages.Compiled, int]:
  """Compiles ahead of time (the calls then never retrace) and reads XLA's memory analysis."""
  compiled = jitted.lower(*args).compile()
  return compiled, profiling.compiled_memory(compiled)["total"]


def forward_case(name: str, model: nnx.Module, w: Workload) -> Case:
  graphdef, state = nnx.split(model)
  rows = w.sequences * w.num_samples
  tokens = rollout_batch(model.config, dataclasses.replace(w, prompts=rows, group_size=1)).tokens
  compiled, memory = _compiled(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)), state, tokens)
  return Case(name, "forward", lambda: compiled(state, tokens),
              flops=flops_lib.forward_flops(model.config, rows, w.length),
              tokens=rows * w.length, memory=memory, shape=dict(rows=rows, length=w.length))


def train_core_case(name: str, model: nnx.Module, w: Workload) -> Case:
  c = rl_config(w)
  spec = specs.likelihood_spec(c, model.config)
  hparams = specs.objective_params(c)
  graphdef, params = nnx.split(model, nnx.Param)
  batch = rollout_batch(model.config, w)
  key = jax.random.key(0)

  def loss_fn(params, batch, key):
    logits_fn = rl_loss.model_logits_fn(nnx.merge(graphdef, params), batch.attention_mask)
    return rl_loss.objective_loss(logits_fn, batch, key, spec=spec, objective=c.objective.name,
                                  hparams=hparams, group_size=w.group_size,
                                  gen_length=w.gen_length, use_reference=False)

  compiled, memory = _compiled(jax.jit(jax.value_and_grad(loss_fn, has_aux=True)), params, batch,
                               key)
  rows = w.sequences * w.num_samples
  return Case(name, "train_core", lambda: compiled(params, batch, key),
              flops=flops_lib.train_flops(model.config, rows, w.length, span=spec.scored_suffix),
              tokens=rows * w.length, memory=memory,
              shape=dict(sequences=w.sequences, num_samples=w.num_samples, length=w.length))


# A LoRA train step's adapters (--lora_rank): every projection of LLaDA, alpha = 2 r.
LORA_TARGETS = "q_proj,k_proj,v_proj,attn_out,ff_proj,up_proj,ff_out"


def train_step_case(name: str, model: nnx.Module, w: Workload, lora_rank: int = 0) -> Case:
  c = rl_config(w)
  if lora_rank:  # A fresh copy with adapters, the base frozen in bfloat16 (build.with_lora).
    c.model.lora.update(rank=lora_rank, alpha=2.0 * lora_rank, targets=LORA_TARGETS)
    model = build.with_lora(c, models.init_model(model.config, seed=0))
  mesh = mesh_lib.make_mesh(c.mesh, jax.devices()[:1])
  graphdef, params = nnx.split(model, nnx.Param)
  # The trainer's build path: the config resolved once, the parts built of the record.
  parts = build.parts(specs.resolve(c, 1, model=model.config), mesh, graphdef, params)
  state = build.initial_state(parts, params, seed=0)
  spec = parts.run.likelihood
  update = build.make_update(parts)
  batch = rollout_batch(model.config, w)
  key = jax.random.key(0)
  compiled, memory = _compiled(update, state, batch, key)
  holder = [state]

  def call():
    holder[0], metrics = compiled(holder[0], batch, key)  # The state is donated: thread it.
    return metrics

  rows = w.sequences * w.num_samples
  return Case(name, f"train_step_lora{lora_rank}" if lora_rank else "train_step", call,
              flops=flops_lib.train_flops(model.config, rows, w.length, span=spec.scored_suffix),
              tokens=rows * w.length, memory=memory,
              shape=dict(sequences=w.sequences, num_samples=w.num_samples, length=w.length))


def sampler_case(name: str, model: nnx.Module, w: Workload, temperature: float) -> Case:
  graphdef, state = nnx.split(model)
  prompt = rollout_batch(model.config, w).tokens[:, :w.prompt_length]
  key = jax.random.key(1)

  def sample(state, prompt, key):
    return llada_sampler.generate(nnx.merge(graphdef, state), prompt, key=key,
                                  gen_length=w.gen_length, steps=w.steps,
                                  block_length=w.block_length, temperature=temperature)

  compiled, memory = _compiled(jax.jit(sample), state, prompt, key)
  per_step = flops_lib.forward_flops(model.config, w.sequences, w.length, span=w.block_length)
  return Case(name, "sampler", lambda: compiled(state, prompt, key), flops=w.steps * per_step,
              tokens=w.sequences * w.gen_length, memory=memory,
              shape=dict(batch=w.sequences, prompt_length=w.prompt_length,
                         gen_length=w.gen_length, steps=w.steps, block_length=w.block_length))


@dataclasses.dataclass(frozen=True)
class Peak:
  """The peak matmul call: `chain` products [n, n] @ [n, n] in a row, 2 n^3 FLOPs each."""

  call: Callable[[], Any]
  size: int
  chain: int
  calibration: dict[int, float]

  @property
  def flops(self) -> int:
    return 2 * self.size**3 * self.chain


def peak_call(sizes: list[int], dtype, min_seconds: float, calibration_repeats: int = 3
              ) -> Peak:
  """The fastest square matmul among `sizes` (FLOP/s, median of a few calls each).

  On CPU the largest size is not the fastest (its operands spill out of the caches), so the peak
  is the best of several. Each size's product is chained (x <- x @ Q, Q orthogonal so that the
  values stay bounded; each product needs the previous one, so XLA can neither hoist nor merge
  them) to last about `min_seconds` per call: short calls would see only a moment of a shared
  machine's varying load.
  """
  chains, rates = {}, {}
  for size in sizes:
    x = jax.random.normal(jax.random.key(0), (size, size), dtype)
    q = jnp.linalg.qr(jax.random.normal(jax.random.key(1), (size, size)))[0].astype(dtype)
    single = profiling.time_interleaved({0: _chained(x, q, 1)}, 1).median[0]
    chain = max(1, round(min_seconds / max(single, 1e-9)))
    call = _chained(x, q, chain)
    rates[size] = 2 * size**3 * chain / profiling.time_interleaved(
        {0: call}, calibration_repeats).median[0]
    chains[size] = (call, chain)
  size = max(rates, key=rates.get)
  call, chain = chains[size]
  return Peak(call=call, size=size, chain=chain, calibration=rates)


def _chained(x: jax.Array, q: jax.Array, chain: int) -> Callable[[], Any]:
  """A call computing x @ q @ q ... (`chain` products), compiled ahead of time."""
  fn = jax.jit(lambda x, q: jax.lax.fori_loop(0, chain, lambda _, y: jnp.dot(y, q), x))
  compiled = fn.lower(x, q).compile()
  return lambda: compiled(x, q)


def build_cases(args, dtype) -> list[Case]:
  base = Workload(prompts=args.prompts, group_size=args.group_size, num_samples=args.num_samples,
                  prompt_length=args.prompt_length, gen_length=args.gen_length,
                  steps=args.steps or args.gen_length // 2, block_length=args.block_length)
  cases = []
  for name in args.configs:
    config = models.get_config(name, dtype=dtype, param_dtype=dtype)
    model = models.LLaDA(config, rngs=nnx.Rngs(0))
    print(f"compiling {name} ({models.count_params(config) / 1e6:.2f}M parameters) ...",
          flush=True)
    cases += [forward_case(name, model, base), train_core_case(name, model, base),
              train_step_case(name, model, base),
              *([train_step_case(name, model, base, args.lora_rank)] if args.lora_rank else []),
              sampler_case(name, model, base, args.temperature)]
    if name != args.scaling_config or args.no_scaling:
      continue
    for g in args.scale_group_sizes:
      case = train_core_case(name, model, dataclasses.replace(base, group_size=g))
      cases.append(dataclasses.replace(case, vary="group_size", value=g))
    for k in args.scale_num_samples:
      case = train_core_case(name, model, dataclasses.replace(base, num_samples=k))
      cases.append(dataclasses.replace(case, vary="num_samples", value=k))
    for gen in args.scale_gen_lengths:
      w = dataclasses.replace(base, gen_length=gen, steps=gen * base.steps // base.gen_length)
      case = sampler_case(name, model, w, args.temperature)
      cases.append(dataclasses.replace(case, vary="gen_length", value=gen))
  return cases


def measure(cases: list[Case], peak: Peak, repeats: int) -> profiling.Timings:
  """Times the cases in turn with a peak call before each and after the last (`("peak", i)`)."""
  fns = {}
  for i, case in enumerate(cases):
    fns[("peak", i)] = peak.call
    fns[i] = case.call
  fns[("peak", len(cases))] = peak.call
  return profiling.time_interleaved(fns, repeats)


def results(cases: list[Case], timings: profiling.Timings, peak: Peak
            ) -> tuple[float, list[dict], list[dict]]:
  """Peak FLOP/s (median of every peak call) and the rows.

  A row's MFU is the median over repeats of its FLOP/s over the mean peak FLOP/s of the peak
  calls just before and just after it: on a shared machine the load drifts during a run, and
  neighbouring calls see about the same load.
  """
  peak_samples = [s for name, samples in timings.samples.items() if isinstance(name, tuple)
                  for s in samples]
  peak_flops = peak.flops / statistics.median(peak_samples)
  rows, scaling = [], []
  for i, case in enumerate(cases):
    seconds = timings.median[i]
    around = zip(timings.samples[("peak", i)], timings.samples[("peak", i + 1)])
    nearby = [peak.flops * (1 / before + 1 / after) / 2 for before, after in around]
    paired = [case.flops / t / p for t, p in zip(timings.samples[i], nearby)]
    entry = dict(config=case.config, what=case.what, seconds=seconds, tokens=case.tokens,
                 tokens_per_s=case.tokens / seconds, flops=case.flops,
                 flops_per_s=case.flops / seconds, mfu=statistics.median(paired),
                 peak_memory_bytes=case.memory, shape=case.shape,
                 samples_s=timings.samples[i], nearby_peak_flops_per_s=nearby)
    if case.vary is None:
      rows.append(entry)
    else:
      scaling.append(dict(vary=case.vary, value=case.value, **entry))
  for vary in {s["vary"] for s in scaling}:
    group = sorted((s for s in scaling if s["vary"] == vary), key=lambda s: s["value"])
    for s in group:
      s["relative_cost"] = (s["seconds"] / s["flops"]) / (group[0]["seconds"] / group[0]["flops"])
  return peak_flops, rows, scaling


def print_tables(out: dict) -> None:
  p = out["peak"]
  print(f"\npeak: {out['peak_flops'] / 1e9:.1f} GFLOP/s ({out['dtype']} [{p['size']}]^2 matmul, "
        f"{p['chain']} chained per call, median of every call)\n")
  print("| config | what | seconds | tokens/s | GFLOP/call | GFLOP/s | MFU | peak memory MiB |")
  print("|---|---|---:|---:|---:|---:|---:|---:|")
  for r in out["rows"]:
    print(f"| {r['config']} | {r['what']} | {r['seconds']:.4f} | {r['tokens_per_s']:,.0f} | "
          f"{r['flops'] / 1e9:.3f} | {r['flops_per_s'] / 1e9:.2f} | {100 * r['mfu']:.1f}% | "
          f"{r['peak_memory_bytes'] / 2**20:.1f} |")
  if out["scaling"]:
    print("\n| config | what | vary | value | seconds | GFLOP/call | relative cost per FLOP "
          "| MFU |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for s in out["scaling"]:
      print(f"| {s['config']} | {s['what']} | {s['vary']} | {s['value']} | {s['seconds']:.3f} | "
            f"{s['flops'] / 1e9:.2f} | {s['relative_cost']:.2f} | {100 * s['mfu']:.1f}% |")


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  accelerator = jax.default_backend() != "cpu"
  parser.add_argument("--output", default="", help="JSON file to write")
  parser.add_argument("--configs", default="tiny,small", type=lambda s: s.split(","))
  parser.add_argument("--dtype", default="bfloat16" if accelerator else "float32")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--prompts", type=int, default=1, help="P")
  parser.add_argument("--group_size", type=int, default=4, help="G")
  parser.add_argument("--num_samples", type=int, default=2, help="K")
  parser.add_argument("--prompt_length", type=int, default=64)
  parser.add_argument("--gen_length", type=int, default=64)
  parser.add_argument("--block_length", type=int, default=32)
  parser.add_argument("--steps", type=int, default=0, help="sampler steps (0: gen_length / 2)")
  parser.add_argument("--temperature", type=float, default=0.9)
  parser.add_argument("--peak_sizes", type=_ints,
                      default=[2048, 4096, 8192] if accelerator else [512, 1024, 2048],
                      help="square matmul sizes; the fastest is the peak")
  parser.add_argument("--peak_seconds", type=float, default=0.5,
                      help="chain the peak matmul to last about this long per call")
  parser.add_argument("--lora_rank", type=int, default=0,
                      help="also a LoRA train step (adapters of this rank on every projection, "
                      "the base frozen in bfloat16): train_step_lora<r>")
  parser.add_argument("--scaling_config", default="small")
  parser.add_argument("--scale_group_sizes", type=_ints, default=[2, 4, 8])
  parser.add_argument("--scale_num_samples", type=_ints, default=[1, 2, 4])
  parser.add_argument("--scale_gen_lengths", type=_ints, default=[32, 64, 128])
  parser.add_argument("--no_scaling", action="store_true")
  args = parser.parse_args()
  dtype = jnp.dtype(args.dtype)

  machine = dict(backend=jax.default_backend(), device_kind=jax.devices()[0].device_kind,
                 cpu_count=os.cpu_count(), load_average=list(os.getloadavg()),
                 python=platform.python_version(), jax=jax.__version__)
  print(f"backend={machine['backend']} ({machine['device_kind']}) dtype={dtype.name} "
        f"load={machine['load_average'][0]:.2f}", flush=True)
  cases = build_cases(args, dtype)
  peak = peak_call(args.peak_sizes, dtype, args.peak_seconds)
  print(f"timing {len(cases)} computations, {args.repeats} repeats ...", flush=True)
  timings = measure(cases, peak, args.repeats)
  peak_flops, rows, scaling = results(cases, timings, peak)
  machine["load_average_after"] = list(os.getloadavg())
  out = dict(peak_flops=peak_flops, dtype=dtype.name,
             peak=dict(size=peak.size, chain=peak.chain, flops_per_call=peak.flops,
                       calibration_flops_per_s=peak.calibration),
             memory_source="xla_compiled_memory_analysis (argument + output - alias + temp, "
                           "per device)",
             device_peak_memory_bytes=profiling.device_peak_memory(),
             machine=machine, settings=vars(args), rows=rows, scaling=scaling)
  print_tables(out)
  if args.output:
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
      json.dump(out, f, indent=2)
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
  main()
