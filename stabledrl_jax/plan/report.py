"""The plan file and its tables: ``Store`` (the rows by key, rewritten atomically after every
change) and the Markdown of docs/pods.md; ``write_report`` and ``table`` are shared with
``experiments/gpu_check.py``'s report."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Sequence

from stabledrl_jax import workdir_files
from stabledrl_jax.plan import catalog

WHATS = ("train", "sampler", "evaluate")


def table(header: Sequence[str], align: str, rows: Sequence[Sequence[Any]]) -> list[str]:
  """A Markdown table: ``align`` one letter per column (l: left, r: right); cells as text, a
  '|' inside one written '/'."""
  cell = lambda x: str(x).replace("|", "/")
  return (["| " + " | ".join(header) + " |",
           "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
          + ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows])


def write_report(path: str, text: str, *, flag: str = "--output") -> None:
  """``path`` holds ``text`` (written whole or not at all), its directory made; a failure is
  one line naming ``flag``."""
  try:
    with workdir_files.writing(path):
      os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    workdir_files.write_text(path, text)
  except workdir_files.WorkdirError as error:
    raise workdir_files.WorkdirError(f"{flag}: {error}") from None


def _gib(n: int | None) -> str:
  return "?" if n is None else f"{n / 2**30:.3g}"


def describe(row: dict[str, Any]) -> str:
  if row.get("memory"):
    m = row["memory"]
    fit = "fits" if row["fits"] else "does NOT fit"
    return (f"{_gib(m['total'])} GiB per chip ({_gib(m['argument'])} arguments + "
            f"{_gib(m['temp'])} temporaries) of {_gib(row['chip_bytes'])}: {fit}, "
            f"{row['compile_seconds']} s")
  return f"does NOT fit: {row['error']} ({row['compile_seconds']} s)"


class Store:
  """The plan JSON: rows by key, written (atomically) after every change."""

  def __init__(self, path: str, resume: bool):
    self.path, self.resume = path, resume
    self.rows: dict[str, dict] = {}
    self.pending: dict[str, dict] = {}
    self.projections: dict[str, dict] = {}
    # A FIFO or a device at --output is one line naming it, never opened (``workdir_files``).
    text = workdir_files.read_bytes(path, "--output", error=ValueError,
                                    missing_ok=True) if path else None
    if text is not None:
      try:
        data = json.loads(text)
        for row in data["rows"]:
          self.rows[self.key(row)] = row
        for row in data.get("pending", []):
          self.pending[self.key(row)] = row
        for p in data.get("projections", []):
          self.projections[self._pkey(p)] = p
      except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"--output {path}: not a plan file ({type(error).__name__}: "
                         f"{error}); move it away or choose another --output") from None

  @staticmethod
  def key(row: dict[str, Any]) -> str:
    return json.dumps([row["config"], row["overrides"], row["what"], row["topology"],
                       row["compiler"], row["settings"]], sort_keys=True)

  @staticmethod
  def _pkey(p: dict[str, Any]) -> str:
    return json.dumps([p["config"], p["overrides"], p["topology"], p["mfu"]], sort_keys=True)

  def put(self, row: dict[str, Any]) -> None:
    key = self.key(row)
    self.rows[key] = row
    self.pending.pop(key, None)
    self.write()

  def pend(self, row: dict[str, Any]) -> None:
    key = self.key(row)
    if key not in self.rows:
      self.pending[key] = dict(row, pending=True)
    self.write()

  def project(self, p: dict[str, Any]) -> None:
    self.projections[self._pkey(p)] = p
    self.write()

  def write(self) -> None:
    if not self.path:
      return
    data = dict(rows=list(self.rows.values()), pending=list(self.pending.values()),
                projections=list(self.projections.values()))
    write_report(self.path, json.dumps(data, indent=1) + "\n")


def load(path: str) -> dict[str, Any]:
  """A plan file's rows, pending rows and projections."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"--output {path}: no such plan file")
  store = Store(path, resume=True)
  return dict(rows=list(store.rows.values()), pending=list(store.pending.values()),
              projections=list(store.projections.values()))


def _settings_text(settings: dict[str, Any] | None) -> str:
  if not settings:
    return ""
  return ", ".join(f"`{k}={v}`" for k, v in settings.items())


def markdown(data: dict[str, Any]) -> str:
  """The plan file's rows (given settings; ladder rungs as their recommendation) and time
  projections as Markdown tables (docs/pods.md)."""
  lines = ["| config | slice | what | settings | GiB per chip (arguments + temporaries) | "
           "HBM GiB | fits | recommended | compiler | compile s |",
           "|---|---|---|---|---|---:|---|---|---|---:|"]
  rows = [r for r in data.get("rows", []) if not r.get("ladder")]
  rows += [dict(r, pending=True) for r in data.get("pending", [])]
  order = {}  # Slices in the order they first appear; within one, train, sampler, evaluate.
  for r in rows:
    order.setdefault((r["config"], r["topology"]), len(order))
  rows.sort(key=lambda r: (order[r["config"], r["topology"]], WHATS.index(r["what"])))
  for r in rows:
    name = r.get("topology_name") or catalog.topology_name(r["topology"])
    unit = "devices" if name.startswith("cpu:") else "chips"
    slice_text = (f"{r['topology']} ({catalog.chips(name)} {unit})" if name == r["topology"] else
                  f"{r['topology']} (`{name}`, {catalog.chips(name)} {unit})")
    config = r["config"] + "".join(f" `{o}`" for o in r.get("overrides", []))
    if r.get("pending"):
      lines.append(f"| {config} | {slice_text} | {r['what']} | {_settings_text(r['settings'])} "
                   f"| not compiled yet | {_gib(catalog.chip_bytes(name))} | | | {r['compiler']} | |")
      continue
    if r.get("memory"):
      m = r["memory"]
      size = f"{_gib(m['total'])} ({_gib(m['argument'])} + {_gib(m['temp'])})"
    elif r.get("per_chip_bytes"):
      size = f"out of memory: needs {_gib(r['per_chip_bytes'])}"
    else:
      size = f"not compiled: {r.get('error', '')}"
    fits = {True: "yes", False: "**no**", None: "?"}[r.get("fits")]
    rec = ""
    if r.get("fits") is False:
      rec = _settings_text(r["recommended"]) if r.get("recommended") else "none found"
    lines.append(f"| {config} | {slice_text} | {r['what']} | {_settings_text(r['settings'])} | "
                 f"{size} | {_gib(r['chip_bytes'])} | {fits} | {rec} | {r['compiler']} | "
                 f"{r['compile_seconds']:.0f} |")
  lines += _attention_savings(rows)
  projections = data.get("projections", [])
  if projections:
    lines += ["", "Projected time (analytic FLOPs at the stated MFU, not measured; "
              "`plan.rl_step_flops`):", "",
              "| config | slice | step PFLOP (rollout + scoring + updates) | MFU | "
              "step s | hours for the run's steps |", "|---|---|---|---:|---:|---:|"]
    for p in projections:
      f = p["step_flops"]
      name = p["topology_name"]
      config = p["config"] + "".join(f" `{o}`" for o in p.get("overrides", []))
      lines.append(f"| {config} | {p['topology']} ({catalog.chips(name)} chips, "
                   f"{p['peak_flops_per_chip'] / 1e12:.0f} TFLOP/s each) | "
                   f"{f['total'] / 1e15:.1f} ({f['rollout'] / 1e15:.1f} + "
                   f"{f['scoring'] / 1e15:.1f} + {f['updates'] / 1e15:.1f}; cache "
                   f"{p['cache']}) | {p['mfu']:.2f} | {p['step_seconds']:.1f} | "
                   f"{p['run_hours']:.1f} ({p['num_steps']} steps) |")
  return "\n".join(lines) + "\n"


_XLA_ATTENTION = "config.model.attention=xla"


def _attention_savings(rows: list[dict[str, Any]]) -> list[str]:
  """A table of what the kernel attention saves: each compiled row planned again with
  ``--config.model.attention=xla`` (softmax attention that materializes the [B, H, L, L]
  scores) beside the row without that override (``auto``: ``layers.attention_impl``'s choice,
  splash on TPU for the paper configs' bfloat16)."""
  def key(r, drop=()):
    overrides = tuple(o for o in r.get("overrides", []) if o not in drop)
    return (r["config"], overrides, r["topology"], r["what"], r["compiler"],
            json.dumps(r["settings"], sort_keys=True))

  compiled = [r for r in rows if not r.get("pending") and r.get("per_chip_bytes")]
  kernel = {key(r): r for r in compiled if _XLA_ATTENTION not in r.get("overrides", [])}
  pairs = [(kernel[key(r, (_XLA_ATTENTION,))], r) for r in compiled
           if _XLA_ATTENTION in r.get("overrides", []) and key(r, (_XLA_ATTENTION,)) in kernel]
  if not pairs:
    return []
  lines = ["", "Attention kernel: the same programs with `--config.model.attention=xla` (softmax "
           "attention over materialized [B, H, L, L] scores) against the default (`auto`: "
           "splash attention with the tpu compiler at bfloat16, the same xla attention with "
           "the cpu one; "
           "a row that ran out of memory gives the bytes the compiler asked for):", "",
           "| config | slice | what | settings | GiB per chip, default | GiB per chip, xla | "
           "saved GiB |", "|---|---|---|---|---:|---:|---:|"]
  for auto, xla in pairs:
    config = auto["config"] + "".join(f" `{o}`" for o in auto.get("overrides", []))
    a, x = auto["per_chip_bytes"], xla["per_chip_bytes"]
    out_of_memory = "" if xla.get("memory") else " (out of memory)"
    lines.append(f"| {config} | {auto['topology']} | {auto['what']} | "
                 f"{_settings_text(auto['settings'])} | {_gib(a)} | {_gib(x)}{out_of_memory} | "
                 f"{_gib(x - a)} |")
  return lines


def write_markdown(path: str, data: dict[str, Any]) -> None:
  text = markdown(data)
  if path == "-":
    sys.stdout.write(text)
  else:
    write_report(path, text, flag="--markdown")
