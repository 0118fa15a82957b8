"""Parameter count and weight memory of each named model config, as a markdown table.

    python experiments/model_sizes.py

Counts come from the module itself (`models.count_params` traces `LLaDA(config)` abstractly with
`nnx.eval_shape`, so nothing is allocated, even for the 8B config).
"""

from stabledrl_jax import models


def main():
  print("| config | layers | d_model | heads (q / kv) | MLP | vocab | parameters | bf16 weights "
        "| fp32 weights |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
  for name in models.CONFIG_NAMES:
    c = models.get_config(name)
    n = models.count_params(c)
    bf16 = models.param_bytes(c, "bfloat16")
    fp32 = models.param_bytes(c, "float32")
    print(f"| `{name}` | {c.n_layers} | {c.d_model} | {c.n_heads} / {c.n_kv_heads} | "
          f"{c.mlp_hidden_size} | {c.vocab_size} | {n:,} | {_human(bf16)} | {_human(fp32)} |")


def _human(num_bytes):
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if num_bytes >= size:
      return f"{num_bytes / size:.2f} {unit}"
  return f"{num_bytes} B"


if __name__ == "__main__":
  main()
