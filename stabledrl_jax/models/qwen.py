"""The Qwen-style decoder that Dream (Qwen2's layout) and SDAR (Qwen3's) share
(docs/models.md): the parameters of the model (``embed_tokens``, ``layers``, ``norm``,
``lm_head``) and of a pre-norm layer (two RMSNorms, the family's attention, a SwiGLU MLP), and the
checkpoint tensor names and config.json fields of the Qwen2/Qwen3 layout. Each family keeps its
own attention and forward pass (Dream: full attention, shifted logits; SDAR: block-causal, a KV
cache).
"""

from __future__ import annotations

import math
from typing import Any

from flax import nnx

from stabledrl_jax.models import family as family_lib, hf_io, layers


class QwenLayer(nnx.Module):
  """A pre-norm residual layer's parameters: ``input_layernorm``, ``self_attn`` (an
  ``attention_cls(config, out_std=, rngs=)``), ``post_attention_layernorm`` and a SwiGLU
  ``mlp``. Random init (tests, benchmarks): std 1/sqrt(fan_in), the output projections also
  / sqrt(2(i+1)) for layer i. The family's subclass defines ``__call__``."""

  def __init__(self, config: Any, layer_index: int, attention_cls: type, *, rngs: nnx.Rngs):
    kw = dict(dtype=config.dtype, param_dtype=config.param_dtype)
    d = config.hidden_size
    depth_scale = 1.0 / math.sqrt(2.0 * (layer_index + 1))
    q_width = config.num_attention_heads * config.head_dim
    self.input_layernorm = layers.RMSNorm(d, eps=config.rms_norm_eps, **kw)
    self.self_attn = attention_cls(config, out_std=q_width**-0.5 * depth_scale, rngs=rngs)
    self.post_attention_layernorm = layers.RMSNorm(d, eps=config.rms_norm_eps, **kw)
    self.mlp = layers.MLP(d, config.intermediate_size,
                          out_std=config.intermediate_size**-0.5 * depth_scale, rngs=rngs, **kw)


class QwenModel(nnx.Module):
  """A Qwen-style model's parameters: ``embed_tokens``, ``layers`` (``layer_cls(config, i,
  rngs=)`` each, the subclass's), ``norm`` and an untied ``lm_head``.

  Args:
    config: shapes, special tokens and dtypes.
    rngs: parameter initialization keys (``nnx.Rngs(seed)``).
  """

  layer_cls: type = QwenLayer

  def __init__(self, config: Any, *, rngs: nnx.Rngs):
    self.config = config
    kw = dict(dtype=config.dtype, param_dtype=config.param_dtype)
    d = config.hidden_size
    self.embed_tokens = layers.Embed(config.vocab_size, d, std=d**-0.5, rngs=rngs, **kw)
    self.layers = nnx.List([self.layer_cls(config, i, rngs=rngs)
                            for i in range(config.num_hidden_layers)])
    self.norm = layers.RMSNorm(d, eps=config.rms_norm_eps, **kw)
    self.lm_head = layers.Linear(d, config.vocab_size, axes=(layers.AX_EMBED, layers.AX_VOCAB),
                                 std=d**-0.5, rngs=rngs, **kw)


def param_names(num_layers: int, *, tied: bool, attention_bias: bool, qk_norm: bool
                ) -> family_lib.ParamNames:
  """(HF tensor name, JAX state path, transpose?) of a Qwen2/Qwen3-layout checkpoint (Dream's,
  SDAR's): ``attention_bias`` q/k/v biases (Qwen2), ``qk_norm`` q_norm and k_norm (Qwen3);
  ``tied``: the head reads model.embed_tokens.weight."""
  names = [("model.embed_tokens.weight", ("embed_tokens", "embedding"), False)]
  for i in range(num_layers):
    layer = f"model.layers.{i}."
    names += [(layer + f"{norm}.weight", ("layers", i, norm, "weight"), False)
              for norm in ("input_layernorm", "post_attention_layernorm")]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
      names.append((layer + f"self_attn.{proj}.weight", ("layers", i, "self_attn", proj, "kernel"),
                    True))
      if attention_bias and proj != "o_proj":
        names.append((layer + f"self_attn.{proj}.bias", ("layers", i, "self_attn", proj, "bias"),
                      False))
    if qk_norm:
      names += [(layer + f"self_attn.{norm}.weight", ("layers", i, "self_attn", norm, "weight"),
                 False) for norm in ("q_norm", "k_norm")]
    names += [(layer + f"mlp.{hf}.weight", ("layers", i, "mlp", ours, "kernel"), True)
              for hf, ours in (("gate_proj", "ff_proj"), ("up_proj", "up_proj"),
                               ("down_proj", "ff_out"))]
  names.append(("model.norm.weight", ("norm", "weight"), False))
  names.append(("model.embed_tokens.weight" if tied else "lm_head.weight", ("lm_head", "kernel"),
                True))
  return names


def config_fields(hf: dict[str, Any], fixed: dict[str, Any], required: tuple[str, ...]
                  ) -> dict[str, Any]:
  """The shape fields of a Qwen2/Qwen3-layout config.json dict (Dream's, SDAR's config field
  names), after refusing what the model does not implement: a ``fixed`` key (its only value
  supported here) set otherwise, rope_scaling, or a missing ``required`` key."""
  for key, supported in fixed.items():
    if key in hf and hf[key] != supported:
      raise NotImplementedError(f"config.json: {key}={hf[key]!r} is not supported "
                                f"(this model implements {key}={supported!r})")
  if hf.get("rope_scaling"):
    raise NotImplementedError(f"config.json: rope_scaling={hf['rope_scaling']!r} is not supported")
  for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
              "vocab_size", "mask_token_id") + required:
    if hf.get(key) is None:
      raise hf_io.CheckpointError(f"config.json has no {key!r}")
  return dict(
      hidden_size=hf["hidden_size"], num_hidden_layers=hf["num_hidden_layers"],
      num_attention_heads=hf["num_attention_heads"],
      num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
      intermediate_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      rope_theta=float(hf.get("rope_theta", 10000.0)), mask_token_id=hf["mask_token_id"])
