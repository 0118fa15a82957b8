"""Dream's Hugging Face checkpoint layout: the tensor names (Qwen2's) and config.json keys of the
official modeling code (``modeling_dream.py``; docs/models.md, "Dream"). Linear weights are
[out, in] there and [in, out] kernels here.

    HF name                                          JAX path                           transpose
    model.embed_tokens.weight                        embed_tokens.embedding             no
    model.layers.{i}.input_layernorm.weight          layers.{i}.input_layernorm.weight  no
    model.layers.{i}.post_attention_layernorm.weight layers.{i}.post_attention_layernorm no
    model.layers.{i}.self_attn.{q,k,v}_proj.weight   layers.{i}.self_attn.{q,k,v}_proj  yes
    model.layers.{i}.self_attn.{q,k,v}_proj.bias     layers.{i}.self_attn.{q,k,v}_proj.bias no
    model.layers.{i}.self_attn.o_proj.weight         layers.{i}.self_attn.o_proj        yes
    model.layers.{i}.mlp.gate_proj.weight            layers.{i}.mlp.ff_proj             yes
    model.layers.{i}.mlp.up_proj.weight              layers.{i}.mlp.up_proj             yes
    model.layers.{i}.mlp.down_proj.weight            layers.{i}.mlp.ff_out              yes
    model.norm.weight                                norm.weight                        no
    lm_head.weight                                   lm_head.kernel                     yes

A checkpoint with ``tie_word_embeddings: true`` loads its embedding into lm_head as well (as
transformers re-ties it; a stored lm_head.weight is not read); ``save_pretrained`` writes the two
untied.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from stabledrl_jax.models import hf_io, qwen
from stabledrl_jax.models.dream.config import DreamConfig

MODEL_TYPE = "Dream"  # config.json's model_type (capitalized, as released)

# config.json keys that select variants this model does not implement, with the only value
# supported here (an absent key takes that value).
_FIXED_KEYS = {
    "hidden_act": "silu",
    "use_sliding_window": False,
    "use_mrope": False,
}


def param_names(config: DreamConfig, *, tied: bool = False
                ) -> list[tuple[str, tuple[Any, ...], bool]]:
  """(HF tensor name, JAX state path, transpose?) for every parameter of ``Dream(config)``.

  tied: the checkpoint ties the output head to the embedding (lm_head reads
  model.embed_tokens.weight).
  """
  return qwen.param_names(config.num_hidden_layers, tied=tied, attention_bias=True,
                                qk_norm=False)


def config_from_hf(hf: dict[str, Any], **overrides) -> DreamConfig:
  """DreamConfig from a Dream config.json dict; ``overrides`` set DreamConfig fields (dtypes...)."""
  if hf.get("sliding_window") and hf.get("use_sliding_window"):
    raise NotImplementedError("config.json: sliding-window attention is not supported")
  fields = qwen.config_fields(hf, _FIXED_KEYS, required=())
  if hf.get("eos_token_id") is not None:
    fields["eos_token_id"] = hf_io.first_id(hf["eos_token_id"])
  if hf.get("max_position_embeddings") is not None:
    fields["max_position_embeddings"] = hf["max_position_embeddings"]
  fields.update(overrides)
  return DreamConfig(**fields)


def config_to_hf(config: DreamConfig) -> dict[str, Any]:
  """A Dream config.json dict describing ``config`` (variant keys at their fixed values)."""
  hf = dict(
      architectures=["DreamModel"], model_type=MODEL_TYPE,
      auto_map={"AutoConfig": "configuration_dream.DreamConfig",
                "AutoModel": "modeling_dream.DreamModel"},
      hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
      num_attention_heads=config.num_attention_heads,
      num_key_value_heads=config.num_key_value_heads,
      intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
      rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
      mask_token_id=config.mask_token_id, bos_token_id=config.eos_token_id,
      eos_token_id=config.eos_token_id, pad_token_id=config.eos_token_id,
      max_position_embeddings=config.max_position_embeddings,
      max_window_layers=config.num_hidden_layers, sliding_window=None, rope_scaling=None,
      tie_word_embeddings=False, attention_dropout=0.0,
      torch_dtype=jnp.dtype(config.param_dtype).name)
  hf.update(_FIXED_KEYS)
  return hf
