"""What the model-family tests share: a checkpoint in the Hugging Face layout, its save-and-reload
check, and a random rollout batch with padding."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file


def write_checkpoint(path, tensors, hf, shards=1):
  """``tensors`` and the config.json ``hf`` in ``path``, in one file or ``shards`` of them."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f)
  if shards == 1:
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path
  names = sorted(tensors)
  weight_map = {}
  for k in range(shards):
    file_name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
    part = {n: tensors[n] for n in names[k::shards]}
    save_file(part, os.path.join(path, file_name), metadata={"format": "pt"})
    weight_map.update({n: file_name for n in part})
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
  return path


def assert_saves_and_reloads(model, out, tensors, hf, keys):
  """``models.save_pretrained(model, out)`` writes exactly ``tensors`` and the ``keys`` of the
  config.json ``hf``; ``models.from_pretrained(out)`` gives the same config and parameters."""
  from stabledrl_jax import models  # pylint: disable=g-import-not-at-top
  models.save_pretrained(model, out)
  written = load_file(os.path.join(out, "model.safetensors"))
  assert set(written) == set(tensors)
  for name, value in tensors.items():
    np.testing.assert_array_equal(written[name], value, err_msg=name)
  with open(os.path.join(out, "config.json")) as f:
    saved = json.load(f)
  for key in keys:
    assert saved[key] == hf[key], key
  reloaded = models.from_pretrained(out)
  assert reloaded.config == model.config
  for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(reloaded))):
    np.testing.assert_array_equal(a, b)


def random_batch(eos_id, *, n, prompt, gen, seed, num_tokens, min_prompt, min_completion,
                 pad_prompt, stressed=False):
  """A ``rl_loss.RolloutBatch`` of ``n`` rows: tokens from ids 4 .. 4 + num_tokens - 1, prompts
  of at least ``min_prompt`` tokens right-aligned in ``prompt`` (the left padding EOS where
  ``pad_prompt``), completions of at least ``min_completion`` tokens then EOS padding, group-
  centred advantages over two groups, and (``stressed``) every other row stressed."""
  from stabledrl_jax.training.step import rl_loss  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  length = prompt + gen
  tokens = rng.integers(4, 4 + num_tokens, size=(n, length)).astype(np.int32)
  prompt_mask = np.zeros((n, length), bool)
  completion_mask = np.zeros((n, length), bool)
  for row in range(n):
    start = prompt - rng.integers(min_prompt, prompt + 1)
    end = prompt + rng.integers(min_completion, gen + 1)
    prompt_mask[row, start:prompt] = True
    if pad_prompt:
      tokens[row, :start] = eos_id
    tokens[row, end:] = eos_id
    completion_mask[row, prompt:min(end + 1, length)] = True
  attention_mask = prompt_mask.copy()
  attention_mask[:, prompt:] = True
  advantages = rng.normal(size=n).astype(np.float32)
  advantages -= advantages.reshape(2, -1).mean(1).repeat(n // 2)
  return rl_loss.RolloutBatch(
      tokens=jnp.asarray(tokens), prompt_mask=jnp.asarray(prompt_mask),
      completion_mask=jnp.asarray(completion_mask), attention_mask=jnp.asarray(attention_mask),
      advantages=jnp.asarray(advantages), old_logp=jnp.zeros(n), ref_logp=jnp.zeros(n),
      **({"stressed": jnp.asarray(np.arange(n) % 2 == 0)} if stressed else {}))
