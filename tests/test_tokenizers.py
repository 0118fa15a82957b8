"""Tokenizers: the character-level one, batch padding, and the LLaDA chat wrapper on a tiny
tokenizer.json built here with the `tokenizers` library (special tokens at LLaDA's ids)."""

import numpy as np
import pytest
import tokenizers as hf_tokenizers

from stabledrl_jax import tokenizers

LLADA_SPECIAL_IDS = {
    "<|startoftext|>": 126080, "<|endoftext|>": 126081, "<|mdm_mask|>": 126336,
    "<|start_header_id|>": 126346, "<|end_header_id|>": 126347, "<|eot_id|>": 126348,
}


# ---------------------------------------------------------------------------
# Character tokenizer.
# ---------------------------------------------------------------------------


def test_char_tokenizer_ids_and_round_trip():
  tokenizer = tokenizers.CharTokenizer()
  assert (tokenizer.pad_id, tokenizer.mask_id, tokenizer.eos_id, tokenizer.unk_id) == (0, 1, 2, 3)
  assert tokenizer.vocab_size == 101
  text = "<answer>\n(25 - 4) * 3\n</answer>\tSudoku puzzle: 1034000000000000"
  ids = tokenizer.encode(text)
  assert len(ids) == len(text) and min(ids) >= 4
  assert tokenizer.decode(ids) == text
  assert tokenizer.encode("ab", add_eos=True)[-1] == tokenizer.eos_id


def test_char_tokenizer_special_tokens_on_decode():
  tokenizer = tokenizers.CharTokenizer("ab")
  ids = tokenizer.encode("ab") + [tokenizer.mask_id, tokenizer.eos_id] + tokenizer.encode("ba")
  assert tokenizer.decode(ids) == "ab"
  assert tokenizer.decode(ids, stop_at_eos=False) == "abba"
  assert tokenizer.decode(ids, stop_at_eos=False, skip_special_tokens=False) == (
      "ab<mask><eos>ba")
  assert tokenizer.encode("abc") == [4, 5, tokenizer.unk_id]
  with pytest.raises(ValueError):
    tokenizer.decode([99])
  with pytest.raises(ValueError):
    tokenizers.CharTokenizer("aa")


def test_batches_pad_on_the_requested_side():
  tokenizer = tokenizers.CharTokenizer()
  ids, valid = tokenizer.encode_batch(["ab", "abcd"], padding_side="right")
  assert ids.dtype == np.int32 and valid.dtype == bool and ids.shape == (2, 4)
  np.testing.assert_array_equal(valid, [[1, 1, 0, 0], [1, 1, 1, 1]])
  assert list(ids[0, 2:]) == [tokenizer.pad_id] * 2
  left, left_valid = tokenizer.encode_batch(["ab", "abcd"], length=6, padding_side="left",
                                            add_eos=True)
  assert left.shape == (2, 6)
  np.testing.assert_array_equal(left_valid[0], [0, 0, 0, 1, 1, 1])
  assert left[0, -1] == tokenizer.eos_id and left[0, 0] == tokenizer.pad_id
  assert tokenizer.decode_batch(left) == ["ab", "abcd"]
  with pytest.raises(ValueError, match="more than length"):
    tokenizer.encode_batch(["abcdef"], length=3)
  with pytest.raises(ValueError, match="padding_side"):
    tokenizer.encode_batch(["a"], padding_side="middle")


# ---------------------------------------------------------------------------
# Hugging Face tokenizer with the LLaDA chat template.
# ---------------------------------------------------------------------------


def _tiny_llada_tokenizer_json(path, special_ids=None):
  """A byte-level BPE over the 256 byte symbols plus two merges, with LLaDA's special tokens
  placed at their real ids (the vocabulary may be sparse)."""
  special_ids = LLADA_SPECIAL_IDS if special_ids is None else special_ids
  alphabet = sorted(hf_tokenizers.pre_tokenizers.ByteLevel.alphabet())
  vocab = {symbol: index for index, symbol in enumerate(alphabet)}
  vocab.update({"he": 256, "ll": 257}, **special_ids)
  tokenizer = hf_tokenizers.Tokenizer(
      hf_tokenizers.models.BPE(vocab=vocab, merges=[("h", "e"), ("l", "l")]))
  tokenizer.pre_tokenizer = hf_tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = hf_tokenizers.decoders.ByteLevel()
  tokenizer.add_special_tokens([hf_tokenizers.AddedToken(token, special=True, normalized=False)
                                for token in special_ids])
  tokenizer.save(str(path))
  return path


@pytest.fixture(name="llada")
def _llada(tmp_path):
  return tokenizers.HFTokenizer.llada(_tiny_llada_tokenizer_json(tmp_path / "tokenizer.json"))


def test_llada_ids(llada):
  assert (llada.mask_id, llada.eos_id, llada.eot_id, llada.bos_id) == (126336, 126081, 126348,
                                                                        126080)
  assert llada.pad_id == llada.eos_id
  assert llada.vocab_size == tokenizers.LLADA_VOCAB_SIZE == 126464


def test_llada_chat_template_string():
  prompt = tokenizers.llada_chat_prompt("What is 2+2?", assistant_prefix="<reasoning>")
  assert prompt == ("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?"
                    "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n<reasoning>")
  # LLaDA-8B-Instruct's template trims the message (``message['content'] | trim``).
  assert tokenizers.llada_chat_prompt(" \n What is 2+2?\n\n", assistant_prefix="<reasoning>") == (
      prompt)


def test_llada_chat_encoding(llada):
  ids = llada.encode_chat("hello wörld 🙂")
  newline_pair = llada.encode("\n\n")
  assert ids[:2] == [126080, 126346]  # BOS, start header
  assert ids.count(126348) == 1 and ids.count(126347) == 2 and ids.count(126346) == 2
  assert ids[-len(newline_pair):] == newline_pair  # ready for the assistant's first token
  assert ids[ids.index(126347) + 1 + len(newline_pair):ids.index(126348)] == llada.encode(
      "hello wörld 🙂")
  assert llada.decode(ids, skip_special_tokens=False, stop_at_eos=False) == llada.chat_prompt(
      "hello wörld 🙂")


def test_llada_decode_stops_at_end_of_turn_and_text(llada):
  answer = llada.encode("<answer>4</answer>")
  generated = answer + [126348, 126081, 126081]
  assert llada.decode(generated) == "<answer>4</answer>"
  assert llada.decode(answer + [126081, *llada.encode("junk")]) == "<answer>4</answer>"
  assert "junk" in llada.decode(answer + [126081, *llada.encode("junk")], stop_at_eos=False)
  masked = answer + [llada.mask_id]
  assert llada.decode(masked, skip_special_tokens=False).endswith("<|mdm_mask|>")


def test_llada_prompt_batches_are_left_padded_with_eos(llada):
  ids, valid = llada.encode_chat_batch(["hi", "hello there"], length=40)
  assert ids.shape == (2, 40) and ids.dtype == np.int32
  assert valid[:, -1].all() and not valid[0, 0]
  assert ids[0, 0] == llada.eos_id  # LLaDA pads with EOS ...
  # ... which decoding skips in front (and then stops at the prompt's end of turn).
  assert llada.decode_batch(ids) == ["user\n\nhi", "user\n\nhello there"]


def test_llada_refuses_a_tokenizer_with_other_ids(tmp_path):
  shifted = dict(LLADA_SPECIAL_IDS, **{"<|mdm_mask|>": 300})
  path = _tiny_llada_tokenizer_json(tmp_path / "tokenizer.json", shifted)
  with pytest.raises(ValueError, match="Not LLaDA"):
    tokenizers.HFTokenizer.llada(tmp_path)  # a directory holding tokenizer.json also works
  assert tokenizers.HFTokenizer.llada(path, check_ids=False).mask_id == 300
  with pytest.raises(ValueError, match="no token"):
    tokenizers.HFTokenizer.from_file(path, mask_token="<mask>", eos_token="<|endoftext|>")


# ---------------------------------------------------------------------------
# SDAR-Chat: Qwen3's tokenizer plus <|MASK|>, Qwen's chat format.
# ---------------------------------------------------------------------------

SDAR_SPECIAL_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                    "<|MASK|>": 151669}


def test_sdar_ids_chat_format_and_decoding(tmp_path):
  sdar = tokenizers.HFTokenizer.sdar(_tiny_llada_tokenizer_json(tmp_path / "tokenizer.json",
                                                                SDAR_SPECIAL_IDS))
  assert (sdar.mask_id, sdar.eos_id, sdar.eot_id, sdar.pad_id) == (151669, 151643, 151645,
                                                                   151643)
  assert sdar.vocab_size == tokenizers.SDAR_VOCAB_SIZE == 151936
  assert sdar.chat_prompt("2+2?") == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
  ids = sdar.encode_chat("hello")
  assert ids[0] == 151644 and ids.count(151645) == 1 and ids[-1] != 151645
  answer = sdar.encode("<answer>4</answer>")
  assert sdar.decode(answer + [151645, 151643, 151643]) == "<answer>4</answer>"
  shifted = dict(SDAR_SPECIAL_IDS, **{"<|MASK|>": 300})
  with pytest.raises(ValueError, match="Not SDAR"):
    tokenizers.HFTokenizer.sdar(_tiny_llada_tokenizer_json(tmp_path / "other.json", shifted))


@pytest.mark.parametrize("content", [b"\x00\x01 garbage", b"", b"[1, 2]", b'{"version": "1.0"}'])
def test_a_garbage_tokenizer_json_is_one_line_naming_the_file(tmp_path, content):
  path = tmp_path / "tokenizer.json"
  path.write_bytes(content)
  for load in (tokenizers.HFTokenizer.llada, tokenizers.HFTokenizer.sdar):
    for where in (path, tmp_path):  # The file, or the directory that holds it.
      with pytest.raises(tokenizers.TokenizerError) as error:
        load(where)
      message = str(error.value)
      assert message.startswith(f"{path} is not a Hugging Face tokenizer.json: "), message
      assert "\n" not in message
  assert issubclass(tokenizers.TokenizerError, ValueError)  # The CLIs' one-line errors.


def test_a_missing_tokenizer_json_is_named(tmp_path):
  with pytest.raises(FileNotFoundError) as error:
    tokenizers.HFTokenizer.llada(tmp_path)
  assert str(error.value) == (f"no tokenizer file at {tmp_path / 'tokenizer.json'} "
                              "(no such file or directory)")


def test_a_tokenizer_without_the_mask_token_names_the_file(tmp_path):
  path = _tiny_llada_tokenizer_json(tmp_path / "tokenizer.json",
                                    special_ids={"<|startoftext|>": 126080})
  with pytest.raises(tokenizers.TokenizerError, match=rf"{path} has no token '<\|mdm_mask\|>'"):
    tokenizers.HFTokenizer.llada(path)


def test_a_repeated_alphabet_names_the_character():
  with pytest.raises(ValueError, match="the alphabet repeats 'ab'"):
    tokenizers.CharTokenizer("abcab")


# ---------------------------------------------------------------------------
# Qwen2's slow tokenizer files (vocab.json, merges.txt, added_tokens.json): the Dream release.
# ---------------------------------------------------------------------------

# Dream's added tokens at their release ids (tokenizer_config.json's added_tokens_decoder).
DREAM_ADDED = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
               "<|mask|>": 151666}
_CORPUS = ["Hello world! It's a test of the tokenizer's merges.",
           "Numbers 12345 and 3.14 don't split alike.", "  leading spaces\n\nnew lines\ttabs",
           "unicode: café, naïve, 日本語, emoji 🙂", "x = f(y) + 2*z; // code"]
_TEXTS = ["Hello world! It's a test.", "Numbers 12345 and 3.14 DON'T split alike.",
          "  leading spaces\n\n\nnew lines\ttabs  \n ", "unicode: café, naïve, 日本語, 🙂",
          "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n<|mask|><|mask|>",
          "x = f(y) + 2*z; // code", "e\u0301 composed (NFC)", "I'LL we'VE they'd", "a\r\nb",
          "!!!???...", "", "<|mask|>x<|endoftext|>"]


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to 256 + n."""
  keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
  extra = [b for b in range(256) if b not in keep]
  return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def _release_files(directory, added=None):
  """A small byte-level BPE in the Dream release's layout: vocab.json and merges.txt (a BPE
  trained here), added_tokens.json and tokenizer_config.json (Dream's added tokens at their
  ids, unless ``added`` says otherwise); no tokenizer.json."""
  import json  # pylint: disable=g-import-not-at-top
  directory.mkdir(parents=True, exist_ok=True)
  tok = hf_tokenizers.Tokenizer(hf_tokenizers.models.BPE())
  tok.pre_tokenizer = hf_tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.train_from_iterator(_CORPUS * 20, hf_tokenizers.trainers.BpeTrainer(
      vocab_size=400, show_progress=False,
      initial_alphabet=hf_tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  tok.model.save(str(directory))
  added = DREAM_ADDED if added is None else added
  (directory / "added_tokens.json").write_text(json.dumps(added))
  (directory / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|endoftext|>",
      "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None,
      "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False,
                                        "rstrip": False, "single_word": False, "special": True}
                               for t, i in added.items()}}))
  return directory


def _reference_ids(directory, text: str) -> list[int]:
  """Qwen2's slow tokenizer, re-derived: added tokens split out whole, NFC, the pre-tokenizer's
  pattern, bytes to GPT-2's alphabet, then the lowest-ranked merge first until none applies."""
  import json  # pylint: disable=g-import-not-at-top
  import unicodedata  # pylint: disable=g-import-not-at-top
  import regex  # pylint: disable=g-import-not-at-top
  vocab = json.loads((directory / "vocab.json").read_text())
  added = json.loads((directory / "added_tokens.json").read_text())
  lines = (directory / "merges.txt").read_text().splitlines()
  ranks = {tuple(line.split(" ")): r for r, line in enumerate(l for l in lines[1:] if l)}
  alphabet = _bytes_to_unicode()
  ids = []
  special = "(" + "|".join(regex.escape(t) for t in sorted(added, key=len, reverse=True)) + ")"
  for piece in regex.split(special, text):
    if piece in added:
      ids.append(added[piece])
      continue
    for word in regex.findall(tokenizers.QWEN2_SPLIT, unicodedata.normalize("NFC", piece)):
      symbols = [alphabet[b] for b in word.encode("utf-8")]
      while len(symbols) > 1:
        pairs = [(ranks.get(p, float("inf")), i) for i, p in enumerate(zip(symbols, symbols[1:]))]
        rank, i = min(pairs)
        if rank == float("inf"):
          break
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
      ids.extend(vocab[s] for s in symbols)
  return ids


def test_the_slow_tokenizer_files_encode_as_qwen2_does(tmp_path):
  """A release with vocab.json + merges.txt + added_tokens.json and no tokenizer.json (Dream's)
  loads through Dream's loader at the published ids, and encodes as the slow tokenizer's
  algorithm, re-derived here, does; decoding gives the text back."""
  from stabledrl_jax.models.dream import tokenizer as dream_tokenizer  # pylint: disable=g-import-not-at-top
  release = _release_files(tmp_path / "release")
  tok = dream_tokenizer.load(release)  # The published ids are checked.
  assert (tok.mask_id, tok.eos_id, tok.eot_id) == (151666, 151643, 151645)
  for text in _TEXTS:
    ids = tok.encode(text)
    assert ids == _reference_ids(release, text), text
    assert tok.decode(ids, skip_special_tokens=False, stop_at_eos=False) == (
        __import__("unicodedata").normalize("NFC", text)), text


def test_the_slow_tokenizer_files_give_transformers_ids(tmp_path):
  """Release files as transformers loads them (AutoTokenizer: Qwen2Tokenizer from vocab.json,
  merges.txt and the added tokens), where transformers is installed."""
  transformers = pytest.importorskip("transformers")
  import json  # pylint: disable=g-import-not-at-top
  # The added tokens right after the BPE's vocabulary, as in the release (Qwen2's 151643 tokens,
  # then <|endoftext|> at 151643 ... <|mask|> at 151666): transformers numbers them in order.
  size = len(json.loads(_release_files(tmp_path / "bpe").joinpath("vocab.json").read_text()))
  release = _release_files(tmp_path / "release",
                           added={t: size + i for i, t in enumerate(DREAM_ADDED)})
  reference = transformers.AutoTokenizer.from_pretrained(str(release))
  ours = tokenizers.HFTokenizer.from_file(release, mask_token="<|mask|>",
                                          eos_token="<|endoftext|>", eot_token="<|im_end|>",
                                          byte_level=True)
  for text in _TEXTS:
    assert ours.encode(text) == reference.encode(text, add_special_tokens=False), text


@pytest.mark.parametrize("added, match", [
    ({"<|endoftext|>": 5}, r"added token '<\|endoftext\|>' at id 5, which vocab.json's '&'"),
    ({"<|a|>": 500, "<|b|>": 500}, r"added token '<\|b\|>' at id 500, which '<\|a\|>' already"),
    ({"<|a|>": "x"}, r"added token '<\|a\|>' has no valid id"),
])
def test_bad_slow_tokenizer_files_are_one_line_naming_the_file(tmp_path, added, match):
  release = _release_files(tmp_path / "release", added=added)
  (release / "tokenizer_config.json").unlink()  # added_tokens.json alone says the ids.
  with pytest.raises(tokenizers.TokenizerError, match=match):
    tokenizers.HFTokenizer.from_file(release, mask_token="<|a|>", eos_token="<|a|>",
                                     byte_level=True)
  (release / "merges.txt").write_text("#version: 0.2\nonly-one-symbol\n")
  with pytest.raises(tokenizers.TokenizerError, match=r"merges.txt:2: not a merge of two"):
    tokenizers.byte_level_bpe_json(release)


def test_without_byte_level_a_directory_needs_its_tokenizer_json(tmp_path):
  """LLaDA's loader reads tokenizer.json only: the slow files of another family are not
  guessed at."""
  release = _release_files(tmp_path / "release")
  with pytest.raises(FileNotFoundError, match="no tokenizer file at .*tokenizer.json"):
    tokenizers.HFTokenizer.llada(release)
