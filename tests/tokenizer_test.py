"""Tests for jrl.tokenizer: the character tokenizer and local HF tokenizer loading."""

import json

import pytest

from jrl import tokenizer as tok_lib

ALL_CHARS = "".join(tok_lib.CHAR_VOCAB[len(tok_lib.SPECIAL_TOKENS) :])


@pytest.fixture(scope="module")
def tok():
    return tok_lib.char_tokenizer()


def test_special_token_ids_are_fixed(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert tok.convert_ids_to_tokens([4, 13]) == ["0", "9"]  # digits come right after specials


def test_vocab_size(tok):
    assert len(tok_lib.CHAR_VOCAB) == len(set(tok_lib.CHAR_VOCAB)) == 88
    assert len(tok) == tok.vocab_size == 88
    assert tok.get_vocab() == {t: i for i, t in enumerate(tok_lib.CHAR_VOCAB)}


def test_round_trip_every_char(tok):
    ids = tok.encode(ALL_CHARS)
    assert ids == list(range(4, 88))  # one token per char, in vocabulary order
    assert tok.decode(ids) == ALL_CHARS
    text = '  What is 37 + 48? It\'s 85, "exactly" (100%)!  '
    assert tok.decode(tok.encode(text)) == text


def test_no_implicit_special_tokens(tok):
    assert tok.encode("12") == [5, 6]
    assert tok("12")["input_ids"] == [5, 6]
    assert tok(["12", "3"])["input_ids"] == [[5, 6], [7]]
    assert tok.encode("<bos>1<eos>") == [1, 5, 2]  # explicit special tokens are recognised
    assert tok.decode([1, 5, 6, 2], skip_special_tokens=True) == "12"


def test_unknown_chars_map_to_unk_one_per_char(tok):
    assert tok.encode("a\n\né~b") == [
        tok.convert_tokens_to_ids("a"),
        3,
        3,
        3,
        3,
        tok.convert_tokens_to_ids("b"),
    ]


def test_load_hf_tokenizer_missing_dir(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match="does not exist.*'char'") as e:
        tok_lib.load_hf_tokenizer(missing)
    assert missing in str(e.value) and "\n" not in str(e.value)


def test_load_hf_tokenizer_dir_without_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no tokenizer files.*save_pretrained"):
        tok_lib.load_hf_tokenizer(str(tmp_path))


def test_save_and_load_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = tok_lib.get_tokenizer(str(tmp_path))
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    assert loaded.encode(ALL_CHARS) == tok.encode(ALL_CHARS)
    assert loaded.decode(loaded.encode(ALL_CHARS)) == ALL_CHARS
    assert loaded.encode("12") == [5, 6]


def test_load_sets_pad_to_eos(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("pad_token")
    cfg_path.write_text(json.dumps(cfg))
    loaded = tok_lib.load_hf_tokenizer(tmp_path)
    assert loaded.pad_token == "<eos>" and loaded.pad_token_id == 2


def test_get_tokenizer_char():
    assert tok_lib.get_tokenizer("char").get_vocab() == tok_lib.char_tokenizer().get_vocab()


def test_stop_ids_and_stop_strings_of_rollout_stop():
    """rollout.stop: its ints are token ids, its strings stop strings of any number of tokens
    (matched on the text: tests/stop_strings_test.py)."""
    tok = tok_lib.char_tokenizer()
    assert tok_lib.stop_token_ids(tok, ("=", 2, "12", 5)) == (2, 5)
    tables = tok_lib.stop_strings(tok, ("=", 2, "12"))
    assert tables.strings == (b"=", b"12")
    assert tok_lib.stop_strings(tok, (2,)) is None
    with pytest.raises(ValueError, match="token id 88 is outside the tokenizer's 88 ids"):
        tok_lib.stop_token_ids(tok, (88,))
    with pytest.raises(ValueError, match="non-empty"):
        tok_lib.stop_strings(tok, ("",))
