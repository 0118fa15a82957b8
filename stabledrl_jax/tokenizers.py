"""Tokenizers: a character-level one for synthetic tasks, and a wrapper over Hugging Face
`tokenizers` files that applies the chat template of LLaDA-Instruct or of SDAR-Chat (Qwen3's).

Both expose the ids a masked diffusion model needs (`mask_id`, `pad_id`, `eos_id`, `vocab_size`),
`encode` / `decode`, and batch helpers that return numpy int32 arrays:

    ids, valid = tokenizer.encode_batch(texts, length=64, padding_side="left")

`ids` is [B, L] int32 filled with `pad_id` where `valid` ([B, L] bool) is False. Prompts are
usually left-padded (their ends line up where the completion starts); targets right-padded.
"""

from __future__ import annotations

import json
import pathlib
import string
from typing import Sequence

import numpy as np

from stabledrl_jax import hub, input_files, workdir_files

# ---------------------------------------------------------------------------
# Batching shared by both tokenizers.
# ---------------------------------------------------------------------------


def pad_sequences(sequences: Sequence[Sequence[int]], *, pad_id: int, length: int | None = None,
                  padding_side: str = "right") -> tuple[np.ndarray, np.ndarray]:
  """Stacks token lists into a padded batch.

  Args:
    sequences: B lists of token ids.
    pad_id: the filler id.
    length: L; defaults to the longest sequence. Longer sequences raise ValueError (truncating
      silently would cut prompts or answers).
    padding_side: "right" (tokens first, then padding) or "left" (padding first).

  Returns:
    (ids int32 [B, L], valid bool [B, L]).
  """
  if padding_side not in ("left", "right"):
    raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}.")
  longest = max((len(sequence) for sequence in sequences), default=0)
  length = longest if length is None else length
  if longest > length:
    raise ValueError(f"A sequence has {longest} tokens, more than length={length}.")
  ids = np.full((len(sequences), length), pad_id, dtype=np.int32)
  valid = np.zeros((len(sequences), length), dtype=bool)
  for row, sequence in enumerate(sequences):
    start = 0 if padding_side == "right" else length - len(sequence)
    ids[row, start:start + len(sequence)] = sequence
    valid[row, start:start + len(sequence)] = True
  return ids, valid


class _BatchMixin:
  """`encode_batch` / `decode_batch` on top of a class's `encode` / `decode` and `pad_id`."""

  pad_id: int

  def encode_batch(self, texts: Sequence[str], *, length: int | None = None,
                   padding_side: str = "right", add_eos: bool = False
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Encodes and pads texts: (ids int32 [B, L], valid bool [B, L]); see `pad_sequences`."""
    encoded = [self.encode(text, add_eos=add_eos) for text in texts]
    return pad_sequences(encoded, pad_id=self.pad_id, length=length, padding_side=padding_side)

  def decode_batch(self, ids: np.ndarray | Sequence[Sequence[int]], **decode_options) -> list[str]:
    """Decodes each row of a [B, L] array (padding and special tokens skipped by default)."""
    return [self.decode([int(token) for token in row], **decode_options) for row in ids]


# ---------------------------------------------------------------------------
# Character-level tokenizer.
# ---------------------------------------------------------------------------

# Printable ASCII plus tab and newline: enough for every synthetic prompt and answer.
DEFAULT_ALPHABET = "".join(char for char in string.printable if char not in "\x0b\x0c\r")
CHAR_SPECIAL_TOKENS = ("<pad>", "<mask>", "<eos>", "<unk>")


class CharTokenizer(_BatchMixin):
  """One token per character, after four special tokens.

  Ids: 0 pad, 1 mask, 2 eos, 3 unk (characters outside the alphabet), then the alphabet in
  order. With the default alphabet the vocabulary has 101 entries.

  Args:
    alphabet: the characters, each once.
  """

  def __init__(self, alphabet: str = DEFAULT_ALPHABET):
    if len(set(alphabet)) != len(alphabet):
      repeated = sorted({char for char in alphabet if alphabet.count(char) > 1})
      raise ValueError(f"the alphabet repeats {''.join(repeated)!r}; list each character once")
    self.alphabet = alphabet
    self.pad_id, self.mask_id, self.eos_id, self.unk_id = range(len(CHAR_SPECIAL_TOKENS))
    offset = len(CHAR_SPECIAL_TOKENS)
    self._char_to_id = {char: offset + index for index, char in enumerate(alphabet)}
    self._id_to_text = list(CHAR_SPECIAL_TOKENS) + list(alphabet)

  @property
  def vocab_size(self) -> int:
    return len(self._id_to_text)

  @property
  def special_ids(self) -> frozenset[int]:
    return frozenset((self.pad_id, self.mask_id, self.eos_id, self.unk_id))

  def encode(self, text: str, *, add_eos: bool = False) -> list[int]:
    """Token ids of `text` (unknown characters become `unk_id`), optionally + eos."""
    ids = [self._char_to_id.get(char, self.unk_id) for char in text]
    return ids + [self.eos_id] if add_eos else ids

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True,
             stop_at_eos: bool = True) -> str:
    """Text of token ids.

    Args:
      ids: token ids.
      skip_special_tokens: drop pad / mask / eos / unk; else render them as "<pad>" etc.
      stop_at_eos: ignore everything from the first eos on.
    """
    pieces = []
    for token in ids:
      token = int(token)
      if stop_at_eos and token == self.eos_id:
        break
      if not 0 <= token < self.vocab_size:
        raise ValueError(f"Token id {token} outside the vocabulary of {self.vocab_size}.")
      if skip_special_tokens and token in self.special_ids:
        continue
      pieces.append(self._id_to_text[token])
    return "".join(pieces)


# ---------------------------------------------------------------------------
# Hugging Face tokenizer.json with the LLaDA-Instruct chat template.
# ---------------------------------------------------------------------------

LLADA_BOS = "<|startoftext|>"
LLADA_EOS = "<|endoftext|>"
LLADA_MASK = "<|mdm_mask|>"
LLADA_EOT = "<|eot_id|>"
LLADA_START_HEADER = "<|start_header_id|>"
LLADA_END_HEADER = "<|end_header_id|>"

LLADA_BOS_ID = 126080
LLADA_EOS_ID = 126081
LLADA_MASK_ID = 126336
LLADA_EOT_ID = 126348
LLADA_VOCAB_SIZE = 126464  # the embedding table size of LLaDA-8B


def llada_chat_prompt(user_message: str, *, assistant_prefix: str = "") -> str:
  """The LLaDA-8B-Instruct chat template for one user turn, ready for the assistant.

  Args:
    user_message: the user's content (task instruction and question).
    assistant_prefix: text the assistant turn starts with (d1's evaluation prompts end with
      "<reasoning>").
  """
  # The template trims the message (``message['content'] | trim``: Python's str.strip).
  return (f"{LLADA_BOS}{LLADA_START_HEADER}user{LLADA_END_HEADER}\n\n{user_message.strip()}"
          f"{LLADA_EOT}"
          f"{LLADA_START_HEADER}assistant{LLADA_END_HEADER}\n\n{assistant_prefix}")


# SDAR-Chat (JetAstra/SDAR): Qwen3's tokenizer plus a mask token; Qwen's chat format.
SDAR_MASK = "<|MASK|>"
SDAR_EOS = "<|endoftext|>"
SDAR_EOT = "<|im_end|>"
SDAR_MASK_ID = 151669
SDAR_EOS_ID = 151643
SDAR_EOT_ID = 151645
SDAR_VOCAB_SIZE = 151936  # the embedding table size of the SDAR models


def qwen_chat_prompt(user_message: str, *, assistant_prefix: str = "") -> str:
  """The Qwen chat format (SDAR-Chat's) for one user turn, ready for the assistant."""
  return (f"<|im_start|>user\n{user_message}{SDAR_EOT}\n<|im_start|>assistant\n"
          f"{assistant_prefix}")


class TokenizerError(ValueError):
  """A tokenizer file that cannot be read, or lacks a token the model needs (names the file)."""


# Qwen2's slow tokenizer (vocab.json, merges.txt, and added_tokens.json for the special tokens),
# as the Dream release ships it without a tokenizer.json.
BPE_FILES = ("vocab.json", "merges.txt")
# Qwen2's pre-tokenization: the text is split by this pattern, then each piece mapped to
# byte-level symbols (GPT-2's byte-to-unicode table) before the merges.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _read_json(path: pathlib.Path) -> dict:
  text = workdir_files.read_bytes(path, "tokenizer file", error=TokenizerError)
  try:
    value = json.loads(text)
  except ValueError as error:
    raise TokenizerError(f"{path} is not JSON: {error}") from None
  if not isinstance(value, dict):
    raise TokenizerError(f"{path} is not a JSON object")
  return value


def _added_tokens(directory: pathlib.Path, vocab: dict[str, int]
                  ) -> tuple[dict[str, int], dict[str, bool]]:
  """The added tokens of ``directory`` (added_tokens.json, and tokenizer_config.json's
  ``added_tokens_decoder``): token -> id, and token -> special (True unless the config says
  otherwise); each id checked against vocab.json's and the other added tokens'."""
  added = _read_json(directory / "added_tokens.json") if (
      directory / "added_tokens.json").exists() else {}
  special = {}
  if (directory / "tokenizer_config.json").exists():
    for token_id, entry in _read_json(directory / "tokenizer_config.json").get(
        "added_tokens_decoder", {}).items():
      if isinstance(entry, dict) and "content" in entry and str(token_id).isdigit():
        added.setdefault(entry["content"], int(token_id))
        special[entry["content"]] = bool(entry.get("special", True))
  holders = {token_id: f"vocab.json's {token!r}" for token, token_id in vocab.items()}
  for token, token_id in added.items():
    if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
      raise TokenizerError(f"{directory}: added token {token!r} has no valid id ({token_id!r})")
    holder = holders.get(token_id)
    if token in vocab and vocab[token] != token_id:
      holder = f"vocab.json's id {vocab[token]} for it; id {token_id}"
    if holder is not None and holder != f"vocab.json's {token!r}":
      raise TokenizerError(f"{directory}: added token {token!r} at id {token_id}, which "
                           f"{holder} already holds")
    holders[token_id] = repr(token)
  return added, {token: special.get(token, True) for token in added}


def byte_level_bpe_json(directory: str | pathlib.Path) -> str:
  """The tokenizer.json of Qwen2's slow tokenizer files in ``directory``: NFC normalization,
  ``QWEN2_SPLIT`` then byte-level pre-tokenization, the BPE of vocab.json and merges.txt, and the
  added tokens at the ids added_tokens.json gives them (special unless tokenizer_config.json's
  ``added_tokens_decoder`` says otherwise), matched whole before any splitting.

  Raises:
    TokenizerError: naming the file that cannot be read or makes no sense.
  """
  import tokenizers  # pylint: disable=g-import-not-at-top
  directory = pathlib.Path(directory)
  vocab = _read_json(directory / "vocab.json")
  if not all(isinstance(v, int) and not isinstance(v, bool) for v in vocab.values()):
    raise TokenizerError(f"{directory / 'vocab.json'}: not a map of tokens to integer ids")
  merges_file = directory / "merges.txt"
  lines = workdir_files.read_bytes(merges_file, "tokenizer file", error=TokenizerError)
  merges = []
  for number, line in enumerate(lines.decode("utf-8", errors="replace").splitlines(), start=1):
    if not line.strip() or (number == 1 and line.startswith("#version")):
      continue
    pair = tuple(line.split(" "))
    if len(pair) != 2 or not all(pair):
      raise TokenizerError(f"{merges_file}:{number}: not a merge of two symbols: {line[:80]!r}")
    merges.append(pair)
  added, special = _added_tokens(directory, vocab)
  try:  # The added tokens in the model's vocabulary too, so that they keep their ids.
    bpe = tokenizers.models.BPE(vocab={**vocab, **added}, merges=merges, fuse_unk=False,
                                byte_fallback=False)
  except Exception as error:  # pylint: disable=broad-except  (the Rust side's plain Exception)
    raise TokenizerError(f"{merges_file}: {str(error).splitlines()[0]}") from None
  tokenizer = tokenizers.Tokenizer(bpe)
  tokenizer.normalizer = tokenizers.normalizers.NFC()
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
      tokenizers.pre_tokenizers.Split(tokenizers.Regex(QWEN2_SPLIT), behavior="isolated"),
      tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tokenizer.decoder = tokenizers.decoders.ByteLevel()
  spec = json.loads(tokenizer.to_str())
  spec["added_tokens"] = [
      {"id": token_id, "content": token, "single_word": False, "lstrip": False,
       "rstrip": False, "normalized": False, "special": special[token]}
      for token, token_id in sorted(added.items(), key=lambda item: item[1])]
  return json.dumps(spec)


class HFTokenizer(_BatchMixin):
  """A `tokenizers.Tokenizer` (tokenizer.json) with the ids a diffusion model needs.

  Text is encoded without automatic special tokens: chat prompts carry their own BOS.

  Args:
    tokenizer: the loaded `tokenizers.Tokenizer`.
    mask_id, eos_id: required ids.
    pad_id: defaults to eos_id (as LLaDA does).
    bos_id, eot_id: optional; eot (end of turn) also ends decoding with `stop_at_eos`.
    vocab_size: the model's vocabulary (embedding) size; defaults to the largest id + 1.
    chat_template: (user_message, *, assistant_prefix) -> prompt text (`chat_prompt`).
  """

  def __init__(self, tokenizer, *, mask_id: int, eos_id: int, pad_id: int | None = None,
               bos_id: int | None = None, eot_id: int | None = None,
               vocab_size: int | None = None, chat_template=llada_chat_prompt):
    self.tokenizer = tokenizer
    self.chat_template = chat_template
    self.mask_id = mask_id
    self.eos_id = eos_id
    self.pad_id = eos_id if pad_id is None else pad_id
    self.bos_id = bos_id
    self.eot_id = eot_id
    largest = max(tokenizer.get_vocab(with_added_tokens=True).values())
    self.vocab_size = max(largest + 1, vocab_size or 0)
    self._stop_ids = frozenset(token for token in (eos_id, eot_id) if token is not None)

  @classmethod
  def from_file(cls, path: str | pathlib.Path, *, mask_token: str, eos_token: str,
                pad_token: str | None = None, bos_token: str | None = None,
                eot_token: str | None = None, vocab_size: int | None = None,
                byte_level: bool = False, **kwargs) -> "HFTokenizer":
    """Loads tokenizer.json (a file, a directory holding it, or a Hub id) and looks the special
    tokens up.

    ``byte_level``: a Qwen2-style tokenizer (Dream, SDAR), which a directory may also hold as
    the slow tokenizer's files alone (``BPE_FILES``; ``byte_level_bpe_json``).
    ``kwargs`` go to the constructor (``chat_template``).
    """
    import tokenizers  # pylint: disable=g-import-not-at-top
    path = pathlib.Path(hub.local_path(str(path), files=hub.TOKENIZER_FILES))
    if path.is_dir() and byte_level and not (path / "tokenizer.json").exists() and all(
        (path / name).exists() for name in BPE_FILES):
      text = byte_level_bpe_json(path).encode()  # A release with the slow tokenizer's files.
    else:
      if path.is_dir():
        path = path / "tokenizer.json"
      reason = input_files.problem(path, allow_empty=True)
      if reason is not None:  # Missing, a FIFO (never opened), unreadable.
        raise FileNotFoundError(f"no tokenizer file at {path} ({reason})")
      # Read here, only as the regular file just checked (a FIFO put there since is never
      # opened: ``workdir_files.open_regular``), and parsed from the text.
      text = workdir_files.read_bytes(path, "tokenizer file", error=TokenizerError)
    if not text:
      raise TokenizerError(f"{path} is not a Hugging Face tokenizer.json: empty")
    try:
      tokenizer = tokenizers.Tokenizer.from_str(text.decode("utf-8"))
    except Exception as error:  # pylint: disable=broad-except  (the Rust parser's plain Exception)
      raise TokenizerError(f"{path} is not a Hugging Face tokenizer.json: "
                           f"{str(error).splitlines()[0] if str(error) else type(error).__name__}"
                           ) from None

    def id_of(token: str | None) -> int | None:
      if token is None:
        return None
      token_id = tokenizer.token_to_id(token)
      if token_id is None:
        raise TokenizerError(f"{path} has no token {token!r}.")
      return token_id

    return cls(tokenizer, mask_id=id_of(mask_token), eos_id=id_of(eos_token),
               pad_id=id_of(pad_token), bos_id=id_of(bos_token), eot_id=id_of(eot_token),
               vocab_size=vocab_size, **kwargs)

  @classmethod
  def llada(cls, path: str | pathlib.Path, *, check_ids: bool = True) -> "HFTokenizer":
    """LLaDA-8B-Instruct's tokenizer, with its mask / EOS / end-of-turn / BOS tokens.

    Args:
      path: tokenizer.json or the checkpoint directory.
      check_ids: require the published ids (mask 126336, EOS 126081, EOT 126348, BOS 126080);
        a mismatch means a different tokenizer and would silently corrupt training.
    """
    tokenizer = cls.from_file(path, mask_token=LLADA_MASK, eos_token=LLADA_EOS,
                              bos_token=LLADA_BOS, eot_token=LLADA_EOT,
                              vocab_size=LLADA_VOCAB_SIZE)
    if check_ids:
      expected = {"mask": LLADA_MASK_ID, "eos": LLADA_EOS_ID, "eot": LLADA_EOT_ID,
                  "bos": LLADA_BOS_ID}
      found = {"mask": tokenizer.mask_id, "eos": tokenizer.eos_id, "eot": tokenizer.eot_id,
               "bos": tokenizer.bos_id}
      if found != expected:
        raise TokenizerError(f"Not LLaDA's special-token ids in {path}: found {found}, "
                             f"expected {expected}.")
    return tokenizer

  @classmethod
  def sdar(cls, path: str | pathlib.Path, *, check_ids: bool = True) -> "HFTokenizer":
    """SDAR-Chat's tokenizer (Qwen3's plus <|MASK|>), with Qwen's chat format.

    Args:
      path: tokenizer.json or the checkpoint directory.
      check_ids: require the published ids (mask 151669, EOS 151643, end of turn 151645).
    """
    tokenizer = cls.from_file(path, mask_token=SDAR_MASK, eos_token=SDAR_EOS,
                              eot_token=SDAR_EOT, vocab_size=SDAR_VOCAB_SIZE,
                              chat_template=qwen_chat_prompt, byte_level=True)
    if check_ids:
      expected = {"mask": SDAR_MASK_ID, "eos": SDAR_EOS_ID, "eot": SDAR_EOT_ID}
      found = {"mask": tokenizer.mask_id, "eos": tokenizer.eos_id, "eot": tokenizer.eot_id}
      if found != expected:
        raise TokenizerError(f"Not SDAR's special-token ids in {path}: found {found}, "
                             f"expected {expected}.")
    return tokenizer

  def encode(self, text: str, *, add_eos: bool = False) -> list[int]:
    """Token ids; special-token strings in the text (e.g. "<|eot_id|>") map to their ids."""
    ids = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
    return ids + [self.eos_id] if add_eos else ids

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True,
             stop_at_eos: bool = True) -> str:
    """Text of token ids; with stop_at_eos, everything from the first EOS / end-of-turn on is
    dropped (what rewards should see)."""
    ids = [int(token) for token in ids]
    if stop_at_eos:
      # LLaDA pads with EOS: leading padding (left-padded prompts) is not an end of text.
      start = 0
      while start < len(ids) and ids[start] == self.pad_id:
        start += 1
      ids = ids[start:]
      for index, token in enumerate(ids):
        if token in self._stop_ids:
          ids = ids[:index]
          break
    return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

  def chat_prompt(self, user_message: str, *, assistant_prefix: str = "") -> str:
    """The chat template around one user message (`llada_chat_prompt` unless set)."""
    return self.chat_template(user_message, assistant_prefix=assistant_prefix)

  def encode_chat(self, user_message: str, *, assistant_prefix: str = "") -> list[int]:
    """Token ids of `chat_prompt`: starts with BOS, ends ready for the assistant's reply."""
    return self.encode(self.chat_prompt(user_message, assistant_prefix=assistant_prefix))

  def encode_chat_batch(self, user_messages: Sequence[str], *, length: int | None = None,
                        assistant_prefix: str = "", padding_side: str = "left"
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Chat prompts as a batch, left-padded by default so every prompt ends at column L-1."""
    encoded = [self.encode_chat(message, assistant_prefix=assistant_prefix)
               for message in user_messages]
    return pad_sequences(encoded, pad_id=self.pad_id, length=length, padding_side=padding_side)
