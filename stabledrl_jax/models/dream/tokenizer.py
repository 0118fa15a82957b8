"""Dream's tokenizer: Qwen2's byte-level BPE plus <|mask|>, with its chat template.

The release's tokenizer_config.json (Dream-org/Dream-v0-Instruct-7B): mask <|mask|> 151666,
EOS and padding <|endoftext|> 151643, end of turn <|im_end|> 151645, no BOS added; its chat
template opens with Qwen2's default system turn when the conversation has none.
"""

from __future__ import annotations

import pathlib

from stabledrl_jax import tokenizers

MASK, EOS, EOT = "<|mask|>", "<|endoftext|>", "<|im_end|>"
MASK_ID, EOS_ID, EOT_ID = 151666, 151643, 151645
VOCAB_SIZE = 152064  # the embedding table size of Dream-7B
DEFAULT_SYSTEM = "You are a helpful assistant."


def chat_prompt(user_message: str, *, assistant_prefix: str = "") -> str:
  """Dream-Instruct's chat template for one user turn, ready for the assistant (the template's
  default system turn first)."""
  return (f"<|im_start|>system\n{DEFAULT_SYSTEM}{EOT}\n<|im_start|>user\n{user_message}{EOT}\n"
          f"<|im_start|>assistant\n{assistant_prefix}")


def load(path: str | pathlib.Path, *, check_ids: bool = True) -> tokenizers.HFTokenizer:
  """Dream's tokenizer (a tokenizer.json, a checkpoint directory or a Hub id). The release
  ships Qwen2's slow tokenizer files (vocab.json, merges.txt, added_tokens.json) and no
  tokenizer.json; a directory holding only those is read as Qwen2's tokenizer would read them
  (``tokenizers.byte_level_bpe_json``).

  check_ids: require the published ids (mask 151666, EOS 151643, end of turn 151645): another
  tokenizer would silently corrupt training.
  """
  tokenizer = tokenizers.HFTokenizer.from_file(path, mask_token=MASK, eos_token=EOS,
                                               eot_token=EOT, vocab_size=VOCAB_SIZE,
                                               chat_template=chat_prompt, byte_level=True)
  if check_ids:
    expected = {"mask": MASK_ID, "eos": EOS_ID, "eot": EOT_ID}
    found = {"mask": tokenizer.mask_id, "eos": tokenizer.eos_id, "eot": tokenizer.eot_id}
    if found != expected:
      raise tokenizers.TokenizerError(f"Not Dream's special-token ids in {path}: found {found}, "
                                      f"expected {expected}.")
  return tokenizer
