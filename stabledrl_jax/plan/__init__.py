r"""Plan before you rent: does a config fit a TPU slice? ``python -m stabledrl_jax.plan``.

    python -m stabledrl_jax.plan --config llada8b_gsm8k --topology v5p-8,v5litepod-64 \
        --what train,sampler,evaluate --output plan.json --markdown plan.md

For each slice (``--topology``: a Cloud TPU accelerator type, v4-8, v5litepod-4 ... v5litepod-256,
v5p-8 ... v5p-256, v6e-4 ... v6e-256, or a topology name, v5e:8x8) it compiles, with libtpu's
real TPU compiler on this host (no TPU needed; ``stabledrl_jax.tpu_compile``), from abstract
inputs (nothing is allocated or run):

  train     the configured train step (``rl_step.abstract_programs``: update, scoring)
  sampler   the rollout sampler (``decoding.generate``), once per cache setting of the family
            (``--caches``; LLaDA: none / prefix / dual, SDAR: its own KV cache only) and
            remasking rule (``--remasking``: the configured rule, and the static / dynamic
            counterpart, whose program differs)
  evaluate  the evaluation decode (greedy, exact, ``eval.batch_size`` rows)

and reads the compiler's memory analysis: the bytes each chip needs (arguments, outputs less
donated, temporaries) against its HBM. A program that does not fit comes back as the compiler's
out-of-memory (RESOURCE_EXHAUSTED), recorded as a row with the bytes it reports, never a crash.
Where the given settings do not fit, a small ladder of settings is compiled (at most
``--max_ladder`` compiles a row): train: ``model.remat`` on, then smaller
``train.microbatch_groups``; sampler: rollout chunks (``rollout.microbatch_groups``: the groups
per sampler call); evaluate: smaller ``eval.batch_size``. The smallest setting is tried first;
if it fits, the largest fitting one is searched between it and the given one; it is the row's
``recommended``.

Without libtpu (``pip install 'jax[tpu]'``, or the test extra) or with ``--compiler=cpu`` it falls
back to XLA:CPU on as many fake CPU devices as the slice has (set before JAX starts its CPU
backend; the command does it): an upper bound (XLA:CPU upcasts bf16 products to f32 and keeps
more alive), marked ``"compiler": "cpu"``.

Times are projections, not measurements: ``rl_step_flops`` counts one RL
step's matmul FLOPs (rollout, scoring, updates), and the step time is that over the slice's chips
x bf16 peak x ``--mfu``. (XLA's ``cost_analysis()`` counts a loop body once, so its FLOPs of
these programs, whose layers and steps are loops, are not used.)

Output: ``--output plan.json`` holds {"rows": [...], "pending": [...], "projections": [...]};
it is rewritten after every compile, so a cut run keeps what it has, and rows already in it are
kept. ``--resume`` reuses the rows of the same (config, overrides, what, topology, compiler,
settings) instead of compiling them again. ``--dry_run`` lists what would be compiled as
pending rows. ``--markdown PATH`` (``-``: stdout) renders every row of the file as the table of
docs/pods.md ("Plan before you rent"); ``--render`` renders an existing file without compiling.

Row: {"what", "config", "overrides", "topology" (the name given), "topology_name" (libtpu's),
"compiler", "chips", "devices", "settings" ({field: value} compiled), "per_chip_bytes" (total,
or the out-of-memory's figure, or null), "memory" (argument, output, alias, temp, total per
chip), "chip_bytes" (one chip's HBM), "fits", "error" (out-of-memory or config error, one line),
"compile_seconds", "ladder" (whether the row is a rung of the search), "recommended" (the given
row's fitting settings, or null)}.
"""

from stabledrl_jax.plan.catalog import chip_bytes, devices_for, prepare_cpu_devices, topology_name
from stabledrl_jax.plan.estimates import projection, rl_step_flops, state_bytes
from stabledrl_jax.plan.report import Store, WHATS, load, markdown
from stabledrl_jax.plan.search import Planner, apply_settings, compile_program, parse_out_of_memory


def run() -> None:
  """The console script ``stabledrl-plan`` (``plan.cli``: its flags are defined on first use)."""
  from stabledrl_jax.plan import cli  # pylint: disable=g-import-not-at-top
  cli.run()


__all__ = ["Planner", "Store", "WHATS", "apply_settings", "chip_bytes", "compile_program",
           "devices_for", "load", "markdown", "parse_out_of_memory", "prepare_cpu_devices",
           "projection", "rl_step_flops", "run", "state_bytes", "topology_name"]
