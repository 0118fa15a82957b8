"""SDAR's Hugging Face checkpoint layout: the tensor names (Qwen3's) and config.json keys of the
official modeling code (JetAstra/SDAR). Linear weights are [out, in] there and [in, out] kernels
here.

    HF name                                          JAX path                           transpose
    model.embed_tokens.weight                        embed_tokens.embedding             no
    model.layers.{i}.input_layernorm.weight          layers.{i}.input_layernorm.weight  no
    model.layers.{i}.post_attention_layernorm.weight layers.{i}.post_attention_layernorm no
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight layers.{i}.self_attn.{q,k,v,o}_proj yes
    model.layers.{i}.self_attn.{q,k}_norm.weight     layers.{i}.self_attn.{q,k}_norm    no
    model.layers.{i}.mlp.gate_proj.weight            layers.{i}.mlp.ff_proj             yes
    model.layers.{i}.mlp.up_proj.weight              layers.{i}.mlp.up_proj             yes
    model.layers.{i}.mlp.down_proj.weight            layers.{i}.mlp.ff_out              yes
    model.norm.weight                                norm.weight                        no
    lm_head.weight                                   lm_head.kernel                     yes

A checkpoint with `tie_word_embeddings: true` loads its embedding into lm_head as well (a stored
lm_head.weight is not read, as transformers re-ties it); the two are then separate parameters,
and `save_pretrained` writes them untied.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from stabledrl_jax.models import hf_io, qwen
from stabledrl_jax.models.sdar.config import SDARConfig

# SDAR: config.json keys that select Qwen3 variants this model does not implement, with the only
# value supported here (an absent key takes that value).
_FIXED_KEYS = {
    "attention_bias": False,
    "hidden_act": "silu",
    "use_sliding_window": False,
}


def param_names(config: SDARConfig, *, tied: bool = False
                     ) -> list[tuple[str, tuple[Any, ...], bool]]:
  """(HF tensor name, JAX state path, transpose?) for every parameter of `SDAR(config)`.

  tied: the checkpoint ties the output head to the embedding (lm_head reads
  model.embed_tokens.weight).
  """
  return qwen.param_names(config.num_hidden_layers, tied=tied, attention_bias=False,
                                qk_norm=True)


def config_from_hf(hf: dict[str, Any], **overrides) -> SDARConfig:
  """SDARConfig from an SDAR config.json dict; `overrides` set SDARConfig fields (dtypes...)."""
  if hf.get("num_experts") or hf.get("num_local_experts"):
    raise NotImplementedError("config.json describes a mixture-of-experts model; only dense SDAR "
                              "is implemented")
  fields = qwen.config_fields(hf, _FIXED_KEYS, required=("block_size",))
  fields.update(head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
                block_size=hf["block_size"])
  if hf.get("eos_token_id") is not None:
    fields["eos_token_id"] = hf_io.first_id(hf["eos_token_id"])
    fields["stop_token_ids"] = tuple(hf_io.as_ids(hf["eos_token_id"]))
  if hf.get("max_position_embeddings") is not None:
    fields["max_position_embeddings"] = hf["max_position_embeddings"]
  fields.update(overrides)
  return SDARConfig(**fields)


def config_to_hf(config: SDARConfig) -> dict[str, Any]:
  """An SDAR config.json dict describing `config` (variant keys at their fixed values)."""
  hf = dict(
      architectures=["SDARForCausalLM"], model_type="sdar",
      hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
      num_attention_heads=config.num_attention_heads,
      num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
      intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
      rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
      block_size=config.block_size, mask_token_id=config.mask_token_id,
      eos_token_id=config.eos_token_id, max_position_embeddings=config.max_position_embeddings,
      max_window_layers=config.num_hidden_layers, sliding_window=None, rope_scaling=None,
      tie_word_embeddings=False, attention_dropout=0.0,
      torch_dtype=jnp.dtype(config.param_dtype).name,
  )
  hf.update(_FIXED_KEYS)
  return hf
