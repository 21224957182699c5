"""Stop strings inside the jitted decode: a row stops when its text comes to hold one of a few
strings, whatever tokens spelled it.

A stop string (`</calc>`, `"\\n"`) is text, and a BPE tokenizer may spell it with any tokens: one
token, several (`</` `calc` `>`), or inside a longer token together with other text (`>\\n`,
`.</`). Matching token ids cannot see that; matching the text can. `StopStrings.build` turns a
tokenizer and the strings into small tables on the host, and `step` runs in the decode loop:

    stops = StopStrings.build(tokenizer, ("</calc>", "\\n"))   # host, once
    tail = stops.init(batch)                                  # [B, W] uint8: no text yet
    tail, stopped = stops.step(tail, token_B)                 # after each sampled token
    tail = stops.reset(tail, rows_B)                          # rows whose text starts anew

**The rule** (vLLM's): after token k of a row, the row stops when a stop string occurs in the
row's text at a place that takes in at least one byte of token k. The text is the bytes of the
row's tokens since its last `reset` (the model's current turn; the prompt is not part of it), so
an occurrence is found once, at the token that completes it. A token holding a stop string in
its middle (`a</calc>b` in one token) stops the row at that token; its text after the stop string
stays in the row (a token is not cut), and whoever reads the text (a tool host parsing a call)
finds the stop string before its end. The text is matched as bytes, so multi-byte UTF-8 stop
strings match whatever token boundaries split their characters.

**Tables** (`build`, host, once): each token id's bytes as the tokenizer's decoder gives them
(byte-level BPE: its byte alphabet undone; SentencePiece: `▁` is a space, a byte-fallback token
`<0x0A>` is its byte; added tokens, special ones included: their text, as
`decode(..., skip_special_tokens=False)` writes it). Of those bytes only what the matching needs
is kept, with W the longest stop string's length in bytes minus one (at least 1):
  - `head` [V, W] uint8: the token's first W bytes (0 after its end);
  - `last` [V, W] uint8: its last W bytes, right-aligned (0 before its start);
  - `size` [V] uint8: its length, capped at W;
  - `inner` [V] bool: a stop string lies wholly inside the token.
A stop string never holds a NUL byte (refused), so the zero padding never matches.

**Per step** (`step`, in the jitted loop): for each row, the window `tail + head[token]` (2W
bytes) is searched for each stop string at the places that end inside the new token, and
`inner[token]` covers stop strings wholly inside it; the new tail is the last W bytes of the
text. That is B x (2W + 2) bytes gathered from the tables and B x 2W x (stop bytes) byte
comparisons a step: nothing of the vocabulary's size. The tables take V x (2W + 2) bytes (Gemma
3's 262k tokens with `</calc>`: 3.7 MB), and are constants of the compiled program.
"""

from __future__ import annotations

import dataclasses
import json
import re
import weakref
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# Decoders that act on the whole text rather than on each token: Strip drops characters at the
# start / end of the decoded text, and Metaspace's prepend scheme drops the space of the first
# word; a stop string is matched against the tokens' own bytes, before either.
_WHOLE_TEXT = ("Strip",)
# tokenizer -> its token_bytes: a run builds tables more than once (its checks, its rollouts, the
# tool host), and a 262k-token vocabulary takes seconds to read
_TOKEN_BYTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class StopStringError(ValueError):
    """Stop strings or a tokenizer that cannot be matched (a one-line reason)."""


def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's printable stand-ins for the 256 bytes) undone."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {ch: b for b, ch in bytes_to_unicode().items()}


def _decoder_steps(spec) -> list[dict]:
    """The tokenizer's decoder as a flat list of steps (a Sequence unrolled)."""
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        return [s for d in spec["decoders"] for s in _decoder_steps(d)]
    return [spec]


def token_bytes(tokenizer) -> tuple[bytes, ...]:
    """The bytes of each token id of `tokenizer` (a `transformers` fast tokenizer), such that the
    bytes of a sequence of ids joined are its decoded text (skip_special_tokens=False) in UTF-8
    (before decoders that act on the whole text: `Strip`, Metaspace's first space). Read once
    per tokenizer object.

    Understood decoders: byte-level BPE (`ByteLevel`), and SentencePiece's `Replace`,
    `ByteFallback`, `Fuse`, `Strip`, `Metaspace`. StopStringError for others."""
    if tokenizer in _TOKEN_BYTES:
        return _TOKEN_BYTES[tokenizer]
    out = _TOKEN_BYTES[tokenizer] = tuple(_read_token_bytes(tokenizer))
    return out


def _read_token_bytes(tokenizer) -> list[bytes]:
    backend = tokenizer.backend_tokenizer
    spec = json.loads(backend.to_str()).get("decoder")
    steps = _decoder_steps(spec)
    if not steps:
        raise StopStringError(
            "the tokenizer has no decoder, so its tokens' text cannot be told: stop strings need "
            "a byte-level BPE or SentencePiece tokenizer (a tokenizer.json with a decoder)."
        )
    byte_level, replaces, byte_fallback, metaspace = False, [], False, None
    for s in steps:
        kind = s.get("type")
        if kind == "ByteLevel":
            byte_level = True
        elif kind == "Replace":
            pattern = s["pattern"]
            if "String" in pattern:
                replaces.append((re.compile(re.escape(pattern["String"])), s["content"]))
            else:
                replaces.append((re.compile(pattern["Regex"]), s["content"]))
        elif kind == "ByteFallback":
            byte_fallback = True
        elif kind == "Metaspace":
            metaspace = s.get("replacement", "\u2581")
        elif kind in ("Fuse", *_WHOLE_TEXT):
            pass
        else:
            raise StopStringError(
                f"the tokenizer's decoder has a {kind} step, which stop strings cannot read per "
                "token: use a byte-level BPE or SentencePiece tokenizer, or stop on token ids."
            )
    vocab_size = len(tokenizer)
    pieces = backend.get_vocab(with_added_tokens=True)
    by_id: list[str | None] = [None] * vocab_size
    for piece, i in pieces.items():
        if 0 <= i < vocab_size:
            by_id[i] = piece
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    to_byte = _byte_decoder() if byte_level else {}
    out = []
    for i, piece in enumerate(by_id):
        if i in added:
            out.append(added[i].encode("utf-8"))
            continue
        if piece is None:
            out.append(b"")
            continue
        if byte_level:
            out.append(bytes(to_byte[ch] for ch in piece if ch in to_byte))
            continue
        m = _BYTE_FALLBACK.fullmatch(piece) if byte_fallback else None
        if m:
            out.append(bytes([int(m.group(1), 16)]))
            continue
        for pattern, content in replaces:
            piece = pattern.sub(content, piece)
        if metaspace is not None:
            piece = piece.replace(metaspace, " ")
        out.append(piece.encode("utf-8"))
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class StopStrings:
    """Host tables for `step` (module docstring); build with `StopStrings.build`. Hashed by
    identity, so it can sit in a jitted function's static spec."""

    strings: tuple[bytes, ...]  # the stop strings in UTF-8
    width: int  # W: bytes of text kept per row
    head: np.ndarray  # [V, W] uint8: each token's first W bytes
    last: np.ndarray  # [V, W] uint8: each token's last W bytes, right-aligned
    size: np.ndarray  # [V] uint8: each token's length in bytes, capped at W
    inner: np.ndarray  # [V] bool: a stop string lies wholly inside the token

    @classmethod
    def build(cls, tokenizer, strings: Sequence[str], vocab_size: int | None = None):
        """The tables of `strings` for `tokenizer`'s tokens; ids from len(tokenizer) up to
        `vocab_size` (a model's padded vocabulary) are empty text. StopStringError (one line)
        for an empty string, one with a NUL character, or a tokenizer whose decoder is not
        understood (`token_bytes`)."""
        return cls.from_token_bytes(token_bytes(tokenizer), strings, vocab_size)

    @classmethod
    def from_token_bytes(
        cls, pieces: Sequence[bytes], strings: Sequence[str], vocab_size: int | None = None
    ):
        """`build` from each token id's bytes (`token_bytes`)."""
        if isinstance(strings, str):
            raise StopStringError(f"stop strings {strings!r}: give a tuple of strings, e.g. (s,).")
        encoded = []
        for s in strings:
            if not isinstance(s, str) or not s:
                raise StopStringError(f"stop string {s!r}: give a non-empty string.")
            if "\0" in s:
                raise StopStringError(f"stop string {s!r} holds a NUL character: leave it out.")
            encoded.append(s.encode("utf-8"))
        encoded = tuple(dict.fromkeys(encoded))
        if not encoded:
            raise StopStringError("no stop strings: give at least one, e.g. ('\\n',).")
        v = max(len(pieces), vocab_size or 0)
        w = max(1, max(map(len, encoded)) - 1)
        lengths = np.zeros((v,), np.int64)
        lengths[: len(pieces)] = [len(p) for p in pieces]
        flat = np.frombuffer(b"".join(pieces) + b"\0", np.uint8)  # every token's bytes in a row
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        head = np.zeros((v, w), np.uint8)
        last = np.zeros((v, w), np.uint8)
        for j in range(w):
            head[:, j] = np.where(j < lengths, flat[np.minimum(starts + j, len(flat) - 1)], 0)
            at = lengths - w + j  # byte j of the last W, counted from the token's start
            last[:, j] = np.where(at >= 0, flat[np.clip(starts + at, 0, len(flat) - 1)], 0)
        size = np.minimum(lengths, w).astype(np.uint8)
        inner = np.zeros((v,), bool)
        inner[: len(pieces)] = [any(s in p for s in encoded) for p in pieces]
        return cls(encoded, w, head, last, size, inner)

    @property
    def vocab_size(self) -> int:
        return self.head.shape[0]

    def init(self, batch: int) -> jax.Array:
        """[batch, W] uint8: the tails of rows with no text yet."""
        return jnp.zeros((batch, self.width), jnp.uint8)

    def reset(self, tail_BW: jax.Array, rows_B: jax.Array) -> jax.Array:
        """`tail_BW` with the rows where `rows_B` (bool [B]) emptied: their text starts anew (a
        new model turn after a tool's answer, whose text is not the model's)."""
        return jnp.where(rows_B[:, None], jnp.zeros_like(tail_BW), tail_BW)

    def step(self, tail_BW: jax.Array, token_B: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(tail, stopped [B] bool) after each row's text takes `token_B` (int [B]): stopped
        where a stop string occurs in the text at a place that takes in a byte of the token.
        Ids outside the tables are empty text. Jittable; static shapes."""
        w = self.width
        token = jnp.asarray(token_B, jnp.int32)
        take = lambda table: jnp.take(jnp.asarray(table), token, axis=0, mode="fill", fill_value=0)
        head, last, size = take(self.head), take(self.last), take(self.size).astype(jnp.int32)
        inner = take(self.inner).astype(bool)
        window = jnp.concatenate([tail_BW, head], axis=1)  # [B, 2W]: old text, then the token's
        stopped = inner
        for s in self.strings:
            m = len(s)  # at most W + 1
            # Places i whose occurrence ends in the token's bytes: i + m - 1 >= W; they begin at
            # or after W - m + 1 (in the tail) and end before 2W (the head's zeros past the
            # token's end never match).
            starts = range(max(0, w - m + 1), 2 * w - m + 1)
            pattern = jnp.asarray(np.frombuffer(s, np.uint8))
            for i in starts:
                stopped = stopped | jnp.all(window[:, i : i + m] == pattern, axis=1)
        # The last W bytes of old text + token: the token's own when it has W or more bytes,
        # else the window's W bytes ending at the token's end.
        shifted = jnp.take_along_axis(window, size[:, None] + jnp.arange(w)[None], axis=1)
        tail = jnp.where((size >= w)[:, None], last, shifted)
        return tail, stopped
