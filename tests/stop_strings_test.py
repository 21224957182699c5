"""Stop strings matched inside the jitted decode (jrl/stop_strings.py), against a reference that
decodes the tokens so far with the tokenizer itself and searches the text.

Tokenizers: a byte-level BPE trained here whose merges cross tags and characters, a hand-made
SentencePiece-style one with byte fallback (tests/helpers/text_tokenizers.py), the tiny Qwen-style
one of tests/helpers/tools_fixtures.py (a token per byte) and, where installed, Gemma 3's own."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import stop_strings
from jrl.stop_strings import StopStrings, StopStringError
from jrl.tokenizer import char_tokenizer
from helpers.text_tokenizers import byte_bpe, real_gemma_tokenizer, sentencepiece_bpe
from helpers.tools_fixtures import qwen_style_tokenizer

STOPS = ("</calc>", "\n")


def decoded(tok, ids) -> str:
    """The reference text: the tokenizer's own decoding, special tokens as their text."""
    return tok.backend_tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def _occurrences(text: str, s: str) -> int:
    """Occurrences of `s` in `text`, overlapping ones counted."""
    return len(re.findall(f"(?={re.escape(s)})", text))


def reference_flags(tok, ids, strings, resets=()) -> list[bool]:
    """Per token k: does the decoded text of the tokens since the last reset (a reset at k: the
    text starts anew at token k) hold more occurrences of a stop string than it did before k
    (an occurrence that takes in a byte of token k)?"""
    out, start = [], 0
    for k in range(len(ids)):
        if k in resets:
            start = k
        before, now = decoded(tok, ids[start:k]), decoded(tok, ids[start : k + 1])
        out.append(any(_occurrences(now, s) > _occurrences(before, s) for s in strings))
    return out


def reference_stop(tok, ids, strings) -> int:
    """The first token at which the decoded text holds a stop string, or -1."""
    return next(
        (k for k in range(len(ids)) if any(s in decoded(tok, ids[: k + 1]) for s in strings)), -1
    )


@functools.lru_cache(maxsize=None)
def _scan(stops: StopStrings):
    """A jitted decode-like loop: the stop flags [T, B] of tokens [T, B], with the rows' text
    emptied before the tokens where resets [T, B]."""

    @jax.jit
    def run(tokens_TB, resets_TB):
        def body(tail, x):
            token, reset = x
            tail, stopped = stops.step(stops.reset(tail, reset), token)
            return tail, stopped

        return jax.lax.scan(body, stops.init(tokens_TB.shape[1]), (tokens_TB, resets_TB))[1]

    return run


def flags(stops, seqs, resets=None) -> np.ndarray:
    """[B, T] bool: the jitted loop's stop flags of rows `seqs` [B, T]."""
    seqs = np.asarray(seqs, np.int32)
    resets = np.zeros(seqs.shape, bool) if resets is None else np.asarray(resets, bool)
    return np.asarray(_scan(stops)(jnp.asarray(seqs.T), jnp.asarray(resets.T))).T


def first_stops(stops, seqs) -> list[int]:
    """The token of each row at which the jitted loop stops it, or -1."""
    return [int(np.argmax(f)) if f.any() else -1 for f in flags(stops, seqs)]


def ids_of(tok, *pieces) -> list[int]:
    vocab = tok.get_vocab()
    return [vocab[p] for p in pieces]


# -------------------------------------------------------------------------- token bytes


BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")
RUNS = "→é\n<"  # characters whose byte-fallback tokens are put in as whole runs


def units(tok, ids) -> list[list[int]]:
    """`ids` as units to draw rows from: one token each, but no lone byte-fallback token, plus
    the byte tokens of each of `RUNS`' characters as a whole run, closed by `*`. The tokenizer
    decodes an invalid run of byte tokens as one U+FFFD per token (so a prefix that ends inside
    a run loses the run's earlier characters too: test_invalid_byte_runs_are_matched_as_bytes);
    with runs apart, only the last, unfinished character is lost."""
    vocab = tok.get_vocab()
    byte_ids = {i for t, i in vocab.items() if BYTE_TOKEN.fullmatch(t)}
    out = [[int(i)] for i in ids if int(i) not in byte_ids]
    if byte_ids:  # each run closed by a token that is not a byte token (`*`)
        star = tok.encode("*", add_special_tokens=False)
        out += [[vocab[f"<0x{b:02X}>"] for b in ch.encode()] + star for ch in RUNS]
    return out


def draw(rng, pool: list[list[int]], rows: int, length: int) -> np.ndarray:
    """[rows, length] ids: units drawn from `pool`, joined, cut to `length`."""
    out = np.zeros((rows, length), np.int32)
    for r in range(rows):
        row = []
        while len(row) < length:
            row += pool[rng.integers(len(pool))]
        out[r] = row[:length]
    return out


@pytest.mark.parametrize(
    "make", [byte_bpe, sentencepiece_bpe, qwen_style_tokenizer, char_tokenizer]
)
def test_token_bytes_joined_are_the_decoded_text(make):
    tok = make()
    pieces = stop_strings.token_bytes(tok)
    assert len(pieces) == len(tok)
    rng = np.random.default_rng(0)
    pool = units(tok, range(len(tok)))
    for _ in range(200):
        ids = [i for k in rng.integers(0, len(pool), 6) for i in pool[k]]  # whole units
        assert b"".join(pieces[i] for i in ids).decode("utf-8", "replace") == decoded(tok, ids)


def test_invalid_byte_runs_are_matched_as_bytes():
    """A newline byte token after a stray lead byte: the tokenizer decodes the run as two
    U+FFFD, the bytes still hold the newline and the row stops there."""
    tok = sentencepiece_bpe()
    ids = ids_of(tok, "<0xE2>", "<0x0A>")
    assert decoded(tok, ids) == "\ufffd\ufffd"
    assert first_stops(StopStrings.build(tok, STOPS), [ids]) == [1]


def test_token_bytes_by_hand():
    sp = sentencepiece_bpe()
    pieces = stop_strings.token_bytes(sp)
    v = sp.get_vocab()
    assert pieces[v["<0x0A>"]] == b"\n"
    assert pieces[v["<0xE2>"]] == b"\xe2"
    assert pieces[v["▁answer"]] == b" answer"
    assert pieces[v["é"]] == "é".encode()
    assert pieces[v["<eos>"]] == b"<eos>"  # special tokens: their text
    bpe = byte_bpe()
    assert stop_strings.token_bytes(bpe)[bpe.get_vocab()["5</calc>Ġ=Ġ"]] == b"5</calc> = "


def test_a_decoder_read_only_as_a_whole_is_refused():
    from tokenizers import decoders

    tok = qwen_style_tokenizer()
    tok.backend_tokenizer.decoder = decoders.WordPiece()
    with pytest.raises(StopStringError, match="WordPiece step"):
        StopStrings.build(tok, STOPS)


@pytest.mark.parametrize(
    "strings, message",
    [(("",), "non-empty"), (("a\0b",), "NUL"), ((), "no stop strings"), ("</calc>", "tuple")],
)
def test_bad_stop_strings_are_one_line_errors(strings, message):
    with pytest.raises(StopStringError, match=message):
        StopStrings.build(sentencepiece_bpe(), strings)


# -------------------------------------------------------------------------- hand cases


def test_tables_by_hand():
    """W = 6 for `</calc>`; a 9-byte token keeps its first and last 6 bytes."""
    stops = StopStrings.from_token_bytes([b"", b"ab", b"a</calc>b", b"</"], ("</calc>", "\n"))
    assert stops.width == 6
    assert stops.head[1].tobytes() == b"ab\0\0\0\0" and stops.last[1].tobytes() == b"\0\0\0\0ab"
    assert stops.head[2].tobytes() == b"a</cal" and stops.last[2].tobytes() == b"calc>b"
    assert stops.size.tolist() == [0, 2, 6, 2]
    assert stops.inner.tolist() == [False, False, True, False]


SP_CASES = [
    # (pieces, the index of the token that stops the row, -1: none)
    (("</", "calc", ">"), 2),  # across 3 tokens
    (("<", "/", "c", "a", "l", "c", ">"), 6),  # across 7 one-byte tokens
    (("a</calc>b",), 0),  # inside one token, text on both sides
    (("</", "calc", ">\n"), 2),  # the close and the newline in one token: both strings end there
    (("<", "/", "calc", "c>"), -1),  # `</calcc>`: no stop
    (("</", "calc", "a", ">"), -1),
    (("<0x3C>", "<0x2F>", "calc", ">"), 3),  # byte-fallback bytes of `</`
    (("▁", "=", "<0x0A>"), 2),  # a newline as a byte-fallback token
    (("1", "2", "\n\n"), 2),
    (("</", "calc", "<eos>", ">"), -1),  # a special token's text breaks the string
]


@pytest.mark.parametrize("pieces, want", SP_CASES)
def test_sentencepiece_cases_by_hand(pieces, want):
    tok = sentencepiece_bpe()
    ids = ids_of(tok, *pieces)
    assert reference_stop(tok, ids, STOPS) == want  # the reference agrees with the hand answer
    stops = StopStrings.build(tok, STOPS)
    assert first_stops(stops, [ids]) == [want]


def test_overlapping_prefixes_and_several_strings():
    """`aab` in `aaab` (a false start that shares a prefix), `abcd` found through a shorter
    string's prefix `ab`, the earliest of several strings, multi-byte UTF-8 split over
    byte tokens."""
    pieces = [b"a", b"b", b"c", b"d", b"\xe2", b"\x86", b"\x92", b"x\xe2\x86", b"\x92y", b"aa"]
    stops = StopStrings.from_token_bytes(pieces, ("aab", "abcd", "→", "dd"))
    rows = [
        [0, 0, 0, 1, 2],  # a a a b: `aab` at token 3
        [0, 1, 2, 3, 3],  # a b c d: `abcd` at 3
        [9, 1, 3, 3, 0],  # aa b: `aab` at 1 (the token `aa` holds its start)
        [4, 5, 6, 0, 0],  # → in three byte tokens: at 2
        [7, 8, 0, 0, 0],  # → split inside two tokens: at 1
        [4, 5, 0, 6, 0],  # the bytes of → with `a` between: none
        [3, 0, 3, 2, 2],  # d a d c c: none
    ]
    assert first_stops(stops, rows) == [3, 3, 1, 2, 1, -1, -1]


def test_a_stop_is_found_once_and_a_reset_starts_the_text_anew():
    pieces = [b"", b"</", b"calc", b">", b"x", b"</calc>"]
    stops = StopStrings.from_token_bytes(pieces, ("</calc>",))
    seqs = [[1, 2, 3, 4, 4, 4], [1, 2, 3, 4, 4, 4], [1, 2, 3, 5, 1, 1]]
    flags = np.zeros((3, 6), bool)
    run = _scan(stops)
    flags[0] = np.asarray(run(jnp.asarray([seqs[0]], jnp.int32).T, jnp.zeros((6, 1), bool)))[:, 0]
    assert flags[0].tolist() == [False, False, True, False, False, False]  # found at `>` only
    resets = np.zeros((6, 3), bool)
    resets[2, 1] = True  # row 1: its text starts anew at `>`: `</calc` is gone
    resets[3, 2] = True  # row 2: a reset before a whole `</calc>` token: still found
    got = np.asarray(run(jnp.asarray(np.array(seqs, np.int32).T), jnp.asarray(resets))).T
    assert got[1].tolist() == [False] * 6
    assert got[2].tolist() == [False, False, True, True, False, False]


def test_ids_past_the_tokenizer_are_empty_text():
    tok = sentencepiece_bpe()
    stops = StopStrings.build(tok, STOPS, vocab_size=len(tok) + 8)
    assert stops.vocab_size == len(tok) + 8
    lt, ca, gt = ids_of(tok, "</", "calc", ">")
    # A padded id (no text) between `</calc` and `>` does not break the string; an id past even
    # the tables is empty too.
    assert first_stops(stops, [[lt, ca, len(tok) + 3, gt], [lt, ca, 10**6, gt]]) == [3, 3]


# -------------------------------------------------------------------------- against the reference


def _hostile_rows(tok, parts, rng, rows=64, length=24) -> np.ndarray:
    """Random rows drawn mostly from `parts` (texts with stop strings, whole or token by token)
    and the tokens that hold pieces of the stop strings, the rest from the whole vocabulary
    (`units`)."""
    pool = {i for p in parts for i in tok.encode(p, add_special_tokens=False)}
    marks = ("</", "c>", "\n", "Ċ", "calc")
    pool |= {i for t, i in tok.get_vocab().items() if any(s in t for s in marks)}
    whole = [tok.encode(p, add_special_tokens=False) for p in parts]  # stop strings in them
    mostly = draw(rng, units(tok, sorted(pool)) + whole * 32, rows, length)
    anywhere = draw(rng, units(tok, rng.integers(0, len(tok), 4096)), rows, length)
    return np.where(rng.random((rows, 1)) < 0.8, mostly, anywhere)


@pytest.mark.parametrize("make", [byte_bpe, sentencepiece_bpe, qwen_style_tokenizer])
def test_random_rows_stop_where_the_decoded_text_first_holds_a_stop_string(make):
    tok = make()
    strings = ("</calc>", "\n", "é →", "answer is")
    stops = StopStrings.build(tok, strings)
    rng = np.random.default_rng(1)
    parts = ["<calc>1*2</calc>", "x</calc>y café → naïve </calc>\n\n", " answer is é →", "\n"]
    rows = _hostile_rows(tok, parts, rng)
    byte_ids = [i for t, i in tok.get_vocab().items() if BYTE_TOKEN.fullmatch(t)]
    # Text starts anew at random tokens, but not inside a run of byte tokens (a character cut
    # in two is an invalid run: test_invalid_byte_runs_are_matched_as_bytes).
    resets = (rng.random(rows.shape) < 0.1) & ~np.isin(rows, byte_ids)
    want = [
        reference_flags(tok, r.tolist(), strings, set(np.flatnonzero(z).tolist()))
        for r, z in zip(rows, resets)
    ]
    got = flags(stops, rows, resets)
    assert got.tolist() == want  # every token of every row, not only the first stop
    assert 60 < got.sum() < got.size - 400  # both kinds met often


def test_the_trained_bpe_has_the_hostile_tokens():
    """What the random test above relies on: the tokenizer spells `</calc>` inside tokens."""
    pieces = stop_strings.token_bytes(byte_bpe())
    assert any(p.startswith(b"5</calc>") and len(p) > 8 for p in pieces)
    assert any(b"</calc>" in p and p.endswith(b"\xe2\x86") for p in pieces)  # half of →
    assert any(p.endswith(b"</calc>\n\n") for p in pieces)


@functools.lru_cache(maxsize=None)
def _gemma():
    return real_gemma_tokenizer()


def test_gemma_tokenizer_against_the_reference():
    tok = _gemma()
    strings = ("</calc>", "\n", "answer is")
    stops = StopStrings.build(tok, strings)
    assert stops.head.shape == (262144, 8) and stops.head.nbytes + stops.last.nbytes < 5e6
    rng = np.random.default_rng(2)
    rows = _hostile_rows(tok, ["<calc>37*48</calc> = 1776\n", " The answer is 5.\n\n"], rng)
    want = [reference_flags(tok, r.tolist(), strings) for r in rows]
    got = flags(stops, rows)
    assert got.tolist() == want
    assert 100 < got.sum() < got.size - 400
    ids = tok.encode("<calc>37*48</calc> = 1776", add_special_tokens=False)
    assert first_stops(stops, [ids]) == [tok.convert_ids_to_tokens(ids).index(">", 4)]
