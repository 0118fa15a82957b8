"""LLaDA's Hugging Face checkpoint layout: tensor names and config.json keys of the official
modeling code (GSAI-ML/LLaDA-8B-Instruct). Linear weights are [out, in] there and [in, out]
kernels here.

    HF name (prefix model.transformer.)     JAX path                       transpose
    wte.weight                              wte.embedding                  no
    blocks.{i}.attn_norm.weight             blocks.{i}.attn_norm.weight    no
    blocks.{i}.ff_norm.weight               blocks.{i}.ff_norm.weight      no
    blocks.{i}.{q,k,v}_proj.weight          blocks.{i}.attn.{q,k,v}_proj   yes
    blocks.{i}.attn_out.weight              blocks.{i}.attn.attn_out       yes
    blocks.{i}.{ff_proj,up_proj,ff_out}     blocks.{i}.mlp.{...}           yes
    ln_f.weight                             ln_f.weight                    no
    ff_out.weight                           lm_head.kernel                 yes
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from stabledrl_jax.models import hf_io
from stabledrl_jax.models.llada.config import ModelConfig

_PREFIX = "model.transformer."

# config.json keys LLaDA's code reads that select architecture variants this model does not
# implement, with the only value supported here. A key that is absent takes LLaDA's default.
_FIXED_KEYS = {
    "activation_type": "silu",
    "alibi": False,
    "attention_layer_norm": False,
    "bias_for_layer_norm": False,
    "block_group_size": 1,
    "block_type": "llama",
    "include_bias": False,
    "include_qkv_bias": False,
    "input_emb_norm": False,
    "layer_norm_type": "rms",
    "layer_norm_with_affine": True,
    "rope": True,
    "scale_logits": False,
    "weight_tying": False,
}
_OPTIONAL_NONE_KEYS = ("bias_for_layer_norm",)


def param_names(config: ModelConfig) -> list[tuple[str, tuple[Any, ...], bool]]:
  """(HF tensor name, JAX state path, transpose?) for every parameter of `LLaDA(config)`."""
  names = [(_PREFIX + "wte.weight", ("wte", "embedding"), False)]
  for i in range(config.n_layers):
    block = f"{_PREFIX}blocks.{i}."
    names += [
        (block + "attn_norm.weight", ("blocks", i, "attn_norm", "weight"), False),
        (block + "ff_norm.weight", ("blocks", i, "ff_norm", "weight"), False),
    ]
    names += [(block + f"{proj}.weight", ("blocks", i, "attn", proj, "kernel"), True)
              for proj in ("q_proj", "k_proj", "v_proj", "attn_out")]
    names += [(block + f"{proj}.weight", ("blocks", i, "mlp", proj, "kernel"), True)
              for proj in ("ff_proj", "up_proj", "ff_out")]
  names += [
      (_PREFIX + "ln_f.weight", ("ln_f", "weight"), False),
      (_PREFIX + "ff_out.weight", ("lm_head", "kernel"), True),
  ]
  return names


def config_from_hf(hf: dict[str, Any], **overrides) -> ModelConfig:
  """ModelConfig from a LLaDA config.json dict; `overrides` set ModelConfig fields (dtypes...)."""
  for key, supported in _FIXED_KEYS.items():
    if key in hf and hf[key] != supported:
      if key in _OPTIONAL_NONE_KEYS and hf[key] is None:
        continue
      raise NotImplementedError(f"config.json: {key}={hf[key]!r} is not supported "
                                f"(this model implements {key}={supported!r})")
  if hf.get("rope_scaling"):
    raise NotImplementedError(f"config.json: rope_scaling={hf['rope_scaling']!r} is not supported")
  for key in ("d_model", "n_heads", "n_layers", "vocab_size"):
    if key not in hf:
      raise hf_io.CheckpointError(f"config.json has no {key!r}")
  n_kv_heads = hf.get("n_kv_heads")
  if n_kv_heads is None:
    n_kv_heads = 1 if hf.get("multi_query_attention") else hf["n_heads"]
  mlp_hidden = hf.get("mlp_hidden_size") or hf.get("mlp_ratio", 4) * hf["d_model"]
  fields = dict(
      d_model=hf["d_model"], n_heads=hf["n_heads"], n_kv_heads=n_kv_heads,
      n_layers=hf["n_layers"], mlp_hidden_size=mlp_hidden, vocab_size=hf["vocab_size"],
      embedding_size=hf.get("embedding_size") or hf["vocab_size"],
      rope_theta=float(hf.get("rope_theta", 10000.0)),
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
  )
  for key in ("mask_token_id", "eos_token_id", "max_sequence_length"):
    if hf.get(key) is not None:
      fields[key] = hf_io.first_id(hf[key])
  fields.update(overrides)
  return ModelConfig(**fields)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
  """A LLaDA config.json dict describing `config` (architecture keys at their fixed values)."""
  hf = dict(
      architectures=["LLaDAModelLM"], model_type="llada",
      d_model=config.d_model, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads,
      n_layers=config.n_layers, mlp_hidden_size=config.mlp_hidden_size,
      vocab_size=config.vocab_size, embedding_size=config.embedding_size,
      rope_theta=config.rope_theta, rms_norm_eps=config.rms_norm_eps,
      mask_token_id=config.mask_token_id, eos_token_id=config.eos_token_id,
      pad_token_id=config.eos_token_id, max_sequence_length=config.max_sequence_length,
      multi_query_attention=None, rope_full_precision=True, rope_scaling=None,
      torch_dtype=jnp.dtype(config.param_dtype).name,
  )
  hf.update(_FIXED_KEYS)
  return hf
