"""Parameter count and weight memory of each named model config, as a markdown table.

    python experiments/model_sizes.py

Counts come from the module itself (`models.count_params` traces `LLaDA(config)`, `SDAR(config)`
or `Dream(config)` abstractly with `nnx.eval_shape`, so nothing is allocated, even for the 8B
configs).
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
  print()
  print("SDAR (block diffusion; head_dim can differ from hidden / heads):")
  print()
  print("| config | layers | hidden | heads (q / kv) x head_dim | MLP | vocab | block | parameters "
        "| bf16 weights | fp32 weights | bf16 KV cache / 1k tokens |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for name in models.SDAR_CONFIG_NAMES:
    c = models.get_sdar_config(name)
    n = models.count_params(c)
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * 1024
    print(f"| `{name}` | {c.num_hidden_layers} | {c.hidden_size} | {c.num_attention_heads} / "
          f"{c.num_key_value_heads} x {c.head_dim} | {c.intermediate_size} | {c.vocab_size} | "
          f"{c.block_size} | {n:,} | {_human(models.param_bytes(c, 'bfloat16'))} | "
          f"{_human(models.param_bytes(c, 'float32'))} | {_human(kv)} |")


  print()
  print("Dream (Qwen2 layers, biased q / k / v; docs/models.md, \"Dream\"):")
  print()
  print("| config | layers | hidden | heads (q / kv) | MLP | vocab | parameters | bf16 weights "
        "| fp32 weights |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
  for name in models.DREAM_CONFIG_NAMES:
    c = models.get_dream_config(name)
    print(f"| `{name}` | {c.num_hidden_layers} | {c.hidden_size} | {c.num_attention_heads} / "
          f"{c.num_key_value_heads} | {c.intermediate_size} | {c.vocab_size} | "
          f"{models.count_params(c):,} | {_human(models.param_bytes(c, 'bfloat16'))} | "
          f"{_human(models.param_bytes(c, 'float32'))} |")


def _human(num_bytes):
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if num_bytes >= size:
      return f"{num_bytes / size:.2f} {unit}"
  return f"{num_bytes} B"


if __name__ == "__main__":
  main()
