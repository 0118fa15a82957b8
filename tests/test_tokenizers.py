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
