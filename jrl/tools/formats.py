"""Tool-call formats: how calls are read from a turn's tokens and how answers become tokens.

A format is built once per run, `FORMATS.get(name)(tokenizer, tools)`, and gives
  - `stop_ids`: the token ids at which decoding pauses a row for the host;
  - `stop_strings`: strings at which decoding pauses a row too, whatever tokens spell them
    (matched on the decoded text inside the decode loop: `jrl.stop_strings`; empty for the
    formats whose calls end at a token of their own);
  - `parse(ids) -> [Call]`: the calls in one assistant turn (empty: the turn ends the episode);
  - `call_text(name) -> str`: a call of tool `name` with no arguments, as the model writes it
    (the host refuses a rollout.stop that would end a turn inside a call);
  - `render(texts) -> [int]`: the block of tokens appended after the turn for its answers;
  - `overhead(n)`: the tokens `render` adds around n answers (its block without the answers);
  - `encode` / `decode` of an answer's text, `marker`, the text marking a truncated answer, and
    `max_calls`, the most calls a turn can hold (None: any number).

An answer is text: the special-token strings in it (`<|im_end|>`, `<eos>`) are tokenized as the
characters they are, never as the special tokens, so a tool cannot end a turn or open one.
Parsing reads a turn once (linear in its length) and turns any failure into an error call.

Two formats:
  - `hermes` (HF chat models): the model writes `<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>` (one or more) and ends its turn (EOS / end-of-turn token); the answers are
    role `tool` messages rendered by the tokenizer's chat template. The block of a turn is the
    rendering of a fixed conversation plus the tool messages, with the generation prompt of the
    next assistant turn, minus the rendering of the conversation through the end-of-turn token
    of its assistant message. A template that cannot render tool messages or the tool list, or
    whose rendering with the messages does not start with the rendering without them, is
    refused (`FormatError`) when the run is built.
  - `compact` (the built-in character tokenizer): the model writes `<12*34>` (`<name:arg>` for a
    tool other than the first) and decoding pauses at `>`; the block is `=408;` (`=` + answer +
    `;`). The argument is the tool's first required parameter.
  - `tags` (BPE models whose chat template has no tools, few-shot prompts): the model writes
    `<calc>12*34</calc>` in its text and decoding pauses at the stop string `</calc>` (several
    tokens, or part of one); the block is ` = 408`, tokenized as text, and the model goes on.
    The tag is the tool's name, the text between the tags its first required parameter.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple, Sequence

from tokenizers import Tokenizer

from jrl import tokenizer as tokenizers
from jrl.registry import Registry


class FormatError(ValueError):
    """A format that the tokenizer (or its chat template) cannot render."""


class Call(NamedTuple):
    """One tool call read from a turn: a tool name and its arguments, or `error` (a one-line
    reason, e.g. malformed JSON) when the call could not be read."""

    name: str | None
    arguments: Any
    error: str | None = None


# name -> format class, built as cls(tokenizer, tools)
FORMATS = Registry("tool call format")
SIDES = ("left", "middle", "right")  # where truncate_tokens cuts an answer


def truncate_tokens(ids: Sequence[int], limit: int, side: str, marker: Sequence[int] = ()) -> list:
    """`ids` cut to at most `limit` tokens, `marker` standing where tokens were dropped.

    side "left" drops the start (keeps the end), "right" drops the end, "middle" keeps the first
    ceil(k/2) and the last floor(k/2) of the k = limit - len(marker) tokens kept. When the marker
    does not fit with at least one kept token, no marker is used.
    """
    ids, marker = list(ids), list(marker)
    if len(ids) <= limit:
        return ids
    if limit - len(marker) < 1:
        marker = []
    keep = max(0, limit - len(marker))
    if side == "left":
        return marker + ids[len(ids) - keep :]
    if side == "right":
        return ids[:keep] + marker
    if side == "middle":
        head = (keep + 1) // 2
        tail = keep - head
        return ids[:head] + marker + (ids[len(ids) - tail :] if tail else [])
    raise ValueError(f"truncation side {side!r}: use left, middle or right.")


class _TokenizerText:
    """Text <-> ids with the run's tokenizer (no special tokens added).

    `encode` is for answers: special-token strings in the text stay text (a copy of the
    tokenizer's backend with `encode_special_tokens` on; the run's tokenizer is left as it is,
    as other threads may encode with it). Added tokens that are not special (Qwen's
    `<tool_call>`) are one token each, as a chat template's rendering would give them.
    `encode_markup` is for the format's own text (a chat template's rendering): its special
    tokens are the special tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = True
        self._as_text = backend

    def encode(self, text: str) -> list[int]:
        return self._as_text.encode(text, add_special_tokens=False).ids

    def encode_markup(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def _json_error(e: Exception) -> str:
    """A one-line reason for a body that json.loads refused (bad JSON, nesting past Python's
    recursion limit, an integer past its digit limit)."""
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at char {e.pos}"
    if isinstance(e, RecursionError):
        return "nested too deep"
    return str(e).split(":")[0] or type(e).__name__


def _loads(text: str) -> tuple[Any, str | None]:
    """(value, None), or (None, reason) when `text` is not JSON that Python can read."""
    try:
        return json.loads(text), None
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        return None, _json_error(e)


def _between(text: str, opening: str, closing: str) -> list[str]:
    """The texts between each `opening` and the first `closing` after it, left to right: one
    pass over `text` (a regex with a lazy group rescans the rest of the text from every opening
    that has no closing: quadratic)."""
    out, i = [], 0
    while (start := text.find(opening, i)) >= 0:
        end = text.find(closing, start + len(opening))
        if end < 0:
            break  # no later opening has a closing either
        out.append(text[start + len(opening) : end])
        i = end + len(closing)
    return out


@FORMATS.register("hermes")
class HermesFormat(_TokenizerText):
    marker = "...(truncated)..."
    max_calls = None  # any number of calls per turn
    stop_strings = ()  # a turn ends at the template's end-of-turn token
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _SENTINEL = "TOOL_ANSWER_3f9a"

    def __init__(self, tokenizer, tools):
        super().__init__(tokenizer)
        self.schemas = [t.schema for t in tools]
        if not getattr(tokenizer, "chat_template", None):
            raise FormatError(
                "the tokenizer has no chat template to render tool messages with: use a chat "
                "model's tokenizer (tokenizer_config.json with a chat_template), or format=compact "
                "with the character tokenizer."
            )
        first = tools[0].name
        self._conversation = [
            {"role": "user", "content": "Use a tool."},
            {
                "role": "assistant",
                "content": "",
                # Templates of thinking models (Qwen3) render an assistant's reasoning when the
                # message is last or has reasoning of its own: with some, the rendering does not
                # change once tool messages follow, as the model's own turn (which thought) does.
                "reasoning_content": "I will use the tool.",
                "tool_calls": [
                    {
                        "id": "call_0",
                        "type": "function",
                        "function": {"name": first, "arguments": {}},
                    }
                ],
            },
        ]
        base = self.encode_markup(self._text(self._conversation, generation_prompt=False))
        special = set(tokenizer.all_special_ids)
        ends = [i for i, t in enumerate(base) if t in special and t != tokenizer.pad_token_id]
        if not ends:
            raise FormatError(
                "the chat template ends an assistant message with no special token, so a turn's "
                "end cannot be told: use a chat template with an end-of-turn token."
            )
        self.turn_end_id = base[ends[-1]]
        self.prefix = base[: ends[-1] + 1]
        eos = tokenizer.eos_token_id
        self.stop_ids = tuple(dict.fromkeys(t for t in (self.turn_end_id, eos) if t is not None))
        prompt = self._text(self._conversation[:1], generation_prompt=True)
        if first not in prompt:
            raise FormatError(
                f"the chat template does not render the tool list (tools=[...{first}...] leaves "
                "no trace in the prompt): use a chat template with tool support."
            )
        self._segments_of: dict[int, list[list[int]]] = {}
        for n in (1, 2):
            self._segments(n)

    def _segments(self, n: int) -> list[list[int]]:
        """The block of n answers around them: the rendering of the conversation plus n tool
        messages with the generation prompt, minus the conversation's own rendering (`prefix`),
        in tokens, split where the answers go ([before the first, between, ..., after the
        last]). Rendered once per n, with a sentinel for each answer."""
        if n in self._segments_of:
            return self._segments_of[n]
        pieces = self._text(self._messages(n), generation_prompt=True).split(self._SENTINEL)
        if len(pieces) != n + 1:
            raise FormatError(
                "the chat template does not render role 'tool' messages (the tool's answer is "
                "missing from the rendering): use a chat template with tool support."
            )
        head, k = self.encode_markup(pieces[0]), len(self.prefix)
        if head[:k] != self.prefix:
            at = next(i for i in range(k) if i >= len(head) or head[i] != self.prefix[i])
            raise FormatError(
                f"the chat template's rendering with the tool messages does not start with its "
                f"rendering without them (at token {at}, {self.decode(self.prefix[at : at + 8])!r} "
                f"became {self.decode(head[at : at + 8])!r}): tool tokens cannot be appended to "
                "the model's own; use a chat template that renders earlier messages the same way "
                "whatever follows them."
            )
        self._segments_of[n] = [head[k:], *(self.encode_markup(p) for p in pieces[1:])]
        return self._segments_of[n]

    def _text(self, messages, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=self.schemas,
                tokenize=False,
                add_generation_prompt=generation_prompt,
            )
        except Exception as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise FormatError(
                f"the chat template cannot render a conversation with tool calls and tool "
                f"messages ({reason}): use a chat template with tool support."
            ) from None

    def _messages(self, texts) -> list[dict]:
        if isinstance(texts, int):
            texts = [self._SENTINEL] * texts
        tool = [{"role": "tool", "content": t, "tool_call_id": "call_0"} for t in texts]
        return self._conversation + tool

    def render(self, texts: Sequence[str]) -> list[int]:
        """The template's tokens around the answers, each answer tokenized as text."""
        segments = self._segments(len(texts))
        out = list(segments[0])
        for text, after in zip(texts, segments[1:]):
            out += self.encode(text)
            out += after
        return out

    def overhead(self, n: int) -> int:
        return len(self.render([""] * n))

    def call_text(self, name: str) -> str:
        return f"{self.OPEN}\n{json.dumps({'name': name, 'arguments': {}})}\n{self.CLOSE}"

    def parse(self, ids: Sequence[int]) -> list[Call]:
        calls = []
        for body in _between(self.decode(ids), self.OPEN, self.CLOSE):
            call, reason = _loads(body)
            if reason is not None:
                calls.append(Call(None, None, f"invalid JSON in tool call: {reason}"))
                continue
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                calls.append(Call(None, None, 'a tool call is {"name": ..., "arguments": {...}}'))
                continue
            name, arguments = call["name"], call.get("arguments", {})
            if isinstance(arguments, str):  # some models write the arguments as a JSON string
                arguments, reason = _loads(arguments)
                if reason is not None:
                    calls.append(Call(name, None, f"invalid JSON in arguments of {name}: {reason}"))
                    continue
            calls.append(Call(name, arguments))
        return calls


@FORMATS.register("compact")
class CompactFormat(_TokenizerText):
    """`<arg>` / `<name:arg>` calls, `=answer;` blocks, for the character tokenizer."""

    OPEN, CLOSE, ANSWER, END = "<", ">", "=", ";"
    marker = ".."
    max_calls = 1  # a turn ends at its call's ">"
    stop_strings = ()  # ">" is one token of the character tokenizer: a stop id

    def __init__(self, tokenizer, tools):
        super().__init__(tokenizer)
        vocab = tokenizer.get_vocab()
        if any(vocab.get(ch) != i for i, ch in enumerate(tokenizers.CHAR_VOCAB)):
            raise FormatError(
                "format=compact is made for the built-in character tokenizer (one token per "
                "character): use tokenizer=char, or format=hermes with a chat model's tokenizer."
            )
        self.tools = {t.name: t for t in tools}
        self.default = tools[0]
        self.close_id = vocab[self.CLOSE]
        self.stop_ids = (tokenizer.eos_token_id, self.close_id)
        self._chars = set(tokenizers.CHAR_VOCAB[len(tokenizers.SPECIAL_TOKENS) :])

    def _clean(self, text: str) -> str:
        """Characters outside the vocabulary become '?' (never <unk>); separators become ','."""
        text = text.replace("\n", " ").replace(self.END, ",")
        return "".join(ch if ch in self._chars else "?" for ch in text)

    def render(self, texts: Sequence[str]) -> list[int]:
        return self.encode("".join(f"{self.ANSWER}{self._clean(t)}{self.END}" for t in texts))

    def overhead(self, n: int) -> int:
        return 2 * n

    def call_text(self, name: str) -> str:
        return f"{self.OPEN}{name}:{self.CLOSE}"

    def parse(self, ids: Sequence[int]) -> list[Call]:
        ids = list(ids)
        if not ids or ids[-1] != self.close_id:
            return []
        text = self.decode(ids[:-1])
        start = text.rfind(self.OPEN)
        if start < 0:
            return [Call(None, None, f"'{self.CLOSE}' closes no call: write <expression>")]
        body = text[start + 1 :]
        name, sep, rest = body.partition(":")
        t = self.tools[name] if sep and name in self.tools else self.default
        arg = rest if sep and name in self.tools else body
        return [_first_parameter_call(t, arg)]


def _first_parameter_call(tool, arg: str) -> Call:
    """A call of `tool` with `arg` as its first required parameter (its first parameter when
    none is required; no arguments when it has none)."""
    params = tool.parameters
    keys = list(params.get("required") or []) or list(params.get("properties") or {})
    return Call(tool.name, {keys[0]: arg} if keys else {})


_TAG = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")  # a tool name usable as a tag


@FORMATS.register("tags")
class TagsFormat(_TokenizerText):
    """`<calc>37*48</calc>` calls written in the text, ` = 1776` answers, for BPE models whose
    chat template has no tool support (a base model prompted with worked examples).

    The model writes `<name>argument</name>` for one of its tools; `</name>` is a stop string
    (`stop_strings`), so decoding pauses the row at the token that completes it, however the
    tokenizer spells it (`</` `calc` `>`, or inside a token that holds more text: that text
    stays in the turn, before the answer). The argument (stripped of surrounding whitespace) is
    the tool's first required parameter. The turn's call is the one its first closing tag
    closes, opened by the nearest opening tag of the same tool before it; a closing tag with no
    opening is answered with an error. The block is ` = ` and the answer, tokenized as text
    (newlines in it become spaces, so the block stays on the call's line); the model then goes
    on, e.g. to restate the answer as its own. A turn without a closing tag (it ended at EOS, or
    at another stop string of the host) has no call: the row's episode ends.

    Why this form: a tag pair in angle brackets is what code and markup on the web look like
    (the `</...>` closing is common in BPE vocabularies: `</` is one token of Gemma 3's and
    Qwen's), a small model copies it from two or three worked examples, and the answer after
    ` = ` reads as the arithmetic it is."""

    ANSWER = " = "
    marker = "..."
    max_calls = 1  # a turn ends at its call's closing tag

    def __init__(self, tokenizer, tools):
        super().__init__(tokenizer)
        for t in tools:
            if not _TAG.fullmatch(t.name):
                raise FormatError(
                    f"format=tags writes a tool's name as a tag (<name>...</name>): {t.name!r} "
                    "is not one (letters, digits, '_', '.', '-', starting with a letter or '_'); "
                    "rename the tool."
                )
        self.tools = {t.name: t for t in tools}
        eos = tokenizer.eos_token_id
        self.stop_ids = () if eos is None else (eos,)
        self.stop_strings = tuple(f"</{name}>" for name in self.tools)

    def _clean(self, text: str) -> str:
        return " ".join(str(text).splitlines())

    def render(self, texts: Sequence[str]) -> list[int]:
        return self.encode("".join(self.ANSWER + self._clean(t) for t in texts))

    def overhead(self, n: int) -> int:
        return len(self.render([""] * n))

    def call_text(self, name: str) -> str:
        return f"<{name}></{name}>"

    def parse(self, ids: Sequence[int]) -> list[Call]:
        text = self.decode(ids)
        ends = [(i, name) for name in self.tools if (i := text.find(f"</{name}>")) >= 0]
        if not ends:
            return []
        end, name = min(ends)
        opening = f"<{name}>"
        start = text.rfind(opening, 0, end)
        if start < 0:
            return [Call(None, None, f"'</{name}>' closes no call: write {opening}...</{name}>")]
        return [_first_parameter_call(self.tools[name], text[start + len(opening) : end].strip())]
