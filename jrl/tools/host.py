"""The host side of a multi-turn rollout: the object the step calls between turns.

Inside the jitted step, decoding pauses a row when it emits one of `ToolHost.stop_ids`, or when
its turn's text comes to hold one of `ToolHost.stop_strings` (matched in the decode loop with the
tables `ToolHost.stop_tables`, `jrl.stop_strings`); the step then calls the host (through
`jax.pure_callback` / `io_callback`) with the rows written so far. For each waiting row the host
reads the calls of the turn that just ended, runs them on host threads with a time limit,
renders their answers as one block of tokens and returns the blocks; the step appends each block
to its row (response mask 0) and decoding goes on. A row is finished when its turn has no call,
when it has used `max_assistant_turns`, or when its response is full.

    host = make_tool_host(cfg, tokenizer, max_response_length=R)
    result = host(response_ids, length, turn_start, waiting, turns)   # numpy in, TurnResult out

Every array of a `TurnResult` has a fixed shape (block width `host.block_size`), so the step's
callback has static result shapes (`host.result_shapes(B)`).
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import numpy as np

from jrl.config import ConfigError
from jrl.multi_turn import TurnResult
from jrl.stop_strings import StopStrings
from jrl.tools import base, formats, runner

# Columns of TurnResult.stats: per-row counts of one turn (summed over turns by the step).
STAT_NAMES: tuple[str, ...] = (
    "tool_turns",  # 1 when a block of answers was appended this turn
    "tool_calls",  # calls read from the turn (malformed ones included; at most max_parallel_calls)
    "tool_errors",  # calls answered with an error: bad JSON / unknown tool / bad arguments / raised
    "tool_timeouts",  # calls still running at rollout.multi_turn.tool_timeout
    "tool_truncated",  # answers cut to max_tool_response_length tokens
    "budget_truncated",  # blocks cut to fit the rest of the response (data.max_response_length)
    "tool_tokens",  # tokens appended (= block_len)
    "tool_reward",  # rewards returned by the tools (= reward)
    "tool_seconds",  # seconds the row's calls ran (a time-out counts as the limit)
    "host_seconds",  # the row's share of the callback's wall time (sums to the host time)
)
_COL = {name: i for i, name in enumerate(STAT_NAMES)}
# Room per answer on top of max_tool_response_length, for tokens that merge differently at the
# answer's edges once it is inside the template; a block that still exceeds the width is cut more.
_EDGE_SLACK = 2


def error_text(reason: str) -> str:
    """The answer the model gets for a call that failed: one line."""
    return "error: " + " ".join(str(reason).split())


def failure(e: BaseException) -> str:
    """The reason of an exception, as the model is told it: a ValueError's message (calc's are
    written for the model), else `Type: message`. Never raises (a message that cannot be made
    into text is left out)."""
    try:
        message = str(e)
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails
        message = ""
    if type(e) is ValueError and message:
        return message
    return f"{type(e).__name__}: {message}" if message else type(e).__name__


class ToolHost:
    """Parses, runs and renders tool calls for the rows that paused (see the module docstring).

    Attributes:
      block_size: K, the width of `TurnResult.block_ids`.
      stop_ids: token ids at which decoding pauses a row and calls the host.
      stop_strings: strings at which decoding pauses a row and calls the host too, whatever
        tokens spell them: the format's (`</calc>` of format=tags) and `extra_stop_strings`.
      stop_tables: the `jrl.stop_strings.StopStrings` of `stop_strings` for the decode loop
        (None without stop strings). The loop keeps a byte tail per row (`stop_tables.init`),
        steps it with each sampled token (`step`: a row whose turn's text now holds a stop
        string waits, as at a stop id) and empties it where a block was appended (`reset`: the
        next turn's text starts after the tool's answer).
      stat_names: the columns of `TurnResult.stats` (`STAT_NAMES`).
      pad_id: the id after each block's end.
      schemas: the tools' function schemas (for prompts that list them, e.g. a chat template's
        `tools=`).
    """

    def __init__(
        self,
        fmt,
        tools: Sequence[base.Tool],
        *,
        pad_id: int,
        max_response_length: int,
        max_assistant_turns: int,
        max_parallel_calls: int,
        max_tool_response_length: int,
        truncate_side: str,
        tool_timeout: float,
        num_workers: int,
        extra_stop_ids: Sequence[int] = (),
        extra_stop_strings: Sequence[str] = (),
    ):
        self.format = fmt
        self.tools = {t.name: t for t in tools}
        self.schemas = [t.schema for t in tools]
        self.pad_id = int(pad_id)
        self.stop_ids = tuple(dict.fromkeys(int(i) for i in (*fmt.stop_ids, *extra_stop_ids)))
        self.stop_strings = tuple(
            dict.fromkeys((*getattr(fmt, "stop_strings", ()), *extra_stop_strings))
        )
        self.stop_tables = (
            StopStrings.build(fmt.tokenizer, self.stop_strings) if self.stop_strings else None
        )
        self.stat_names = STAT_NAMES  # the columns of TurnResult.stats
        self.max_response_length = max_response_length
        self.max_assistant_turns = max_assistant_turns
        self.max_parallel_calls = min(max_parallel_calls, fmt.max_calls or max_parallel_calls)
        self.max_tool_response_length = max_tool_response_length
        self.truncate_side = truncate_side
        self.tool_timeout = tool_timeout
        self.num_workers = num_workers
        self._marker = fmt.encode(fmt.marker)
        n = self.max_parallel_calls
        overheads = [fmt.overhead(k) for k in range(1, n + 1)]  # every count rendered once, now
        self.block_size = max(overheads) + n * (max_tool_response_length + _EDGE_SLACK)

    def result_shapes(self, batch_size: int) -> TurnResult:
        """The `jax.ShapeDtypeStruct`s of a TurnResult for `batch_size` rows."""
        b, k, s = batch_size, self.block_size, len(STAT_NAMES)
        sds = jax.ShapeDtypeStruct
        return TurnResult(
            sds((b, k), np.int32),
            sds((b,), np.int32),
            sds((b,), np.bool_),
            sds((b,), np.float32),
            sds((b, s), np.float32),
        )

    # ------------------------------------------------------------------------------ one pause

    def __call__(self, response_ids, length, turn_start, waiting, turns) -> TurnResult:
        t0 = time.perf_counter()
        response_ids = np.asarray(response_ids)
        length, turn_start = np.asarray(length), np.asarray(turn_start)
        waiting, turns = np.asarray(waiting).astype(bool), np.asarray(turns)
        b, r = response_ids.shape
        out = TurnResult(
            np.full((b, self.block_size), self.pad_id, np.int32),
            np.zeros((b,), np.int32),
            np.zeros((b,), np.bool_),
            np.zeros((b,), np.float32),
            np.zeros((b, len(STAT_NAMES)), np.float32),
        )
        answers: dict[int, list] = {}  # row -> [text or None (pending job)] per call
        jobs: list[tuple[int, int, base.Tool, dict]] = []  # (row, call, tool, arguments)
        rows = [int(i) for i in np.flatnonzero(waiting)]
        for i in rows:
            full = int(length[i]) >= r
            last_turn = self.max_assistant_turns and int(turns[i]) >= self.max_assistant_turns
            ids = response_ids[i, int(turn_start[i]) : int(length[i])].tolist()
            calls = [] if full or last_turn else self._parse(ids)
            if not calls:
                out.finished[i] = True
                continue
            calls = calls[: self.max_parallel_calls]
            answers[i] = [None] * len(calls)
            out.stats[i, _COL["tool_calls"]] = len(calls)
            for j, call in enumerate(calls):
                reason = self._refusal(call)
                if reason is None:
                    jobs.append((i, j, self.tools[call.name], call.arguments))
                else:
                    answers[i][j] = error_text(reason)
                    out.stats[i, _COL["tool_errors"]] += 1

        outcomes = runner.run_calls(
            [lambda t=t, a=a: t.fn(**a) for _, _, t, a in jobs],
            num_workers=self.num_workers,
            timeout=self.tool_timeout,
        )
        for (i, j, t, _), outcome in zip(jobs, outcomes):
            out.stats[i, _COL["tool_seconds"]] += outcome.seconds
            if outcome.status == "ok":
                try:
                    answers[i][j], reward = base.normalize_result(outcome.value)
                    out.reward[i] += reward
                    continue
                except Exception as e:  # noqa: BLE001 - e.g. a reward that is not a number
                    outcome = runner.Outcome("error", e, outcome.seconds)
            if outcome.status == "timeout":
                answers[i][j] = error_text(f"{t.name} timed out after {self.tool_timeout:g} s")
                out.stats[i, _COL["tool_timeouts"]] += 1
            else:
                answers[i][j] = error_text(failure(outcome.value))
                out.stats[i, _COL["tool_errors"]] += 1

        for i, texts in answers.items():
            try:
                block, cut, budget_cut = self._block(texts, room=r - int(length[i]))
            except Exception as e:  # noqa: BLE001 - an answer the tokenizer cannot take
                reason = error_text(f"the answer could not be tokenized ({failure(e)})")
                out.stats[i, _COL["tool_errors"]] = len(texts)
                try:
                    block, cut, budget_cut = self._block([reason] * len(texts), r - int(length[i]))
                except Exception:  # noqa: BLE001 - not even an error renders: the row ends
                    out.finished[i] = True
                    continue
            out.block_ids[i, : len(block)] = block
            out.block_len[i] = len(block)
            out.stats[i, _COL["tool_turns"]] = 1
            out.stats[i, _COL["tool_truncated"]] = cut
            out.stats[i, _COL["budget_truncated"]] = budget_cut
            out.stats[i, _COL["tool_tokens"]] = len(block)
        out.stats[:, _COL["tool_reward"]] = out.reward
        if rows:
            out.stats[rows, _COL["host_seconds"]] = (time.perf_counter() - t0) / len(rows)
        return out

    def _parse(self, ids: list[int]) -> list[formats.Call]:
        """The format's calls of one turn; a format that raises is one malformed call."""
        try:
            return list(self.format.parse(ids))
        except Exception as e:  # noqa: BLE001 - the model's text is never the host's failure
            return [formats.Call(None, None, f"unreadable tool call ({failure(e)})")]

    def _refusal(self, call: formats.Call) -> str | None:
        """Why `call` cannot run (malformed, unknown tool, bad arguments), or None."""
        try:
            if call.error is not None:
                return str(call.error)
            if not isinstance(call.name, str) or call.name not in self.tools:
                name = str(call.name)[:64]
                return f"unknown tool {name!r}; the tools are {', '.join(self.tools)}"
            return base.check_arguments(self.tools[call.name], call.arguments)
        except Exception as e:  # noqa: BLE001 - e.g. arguments that cannot be written back
            return f"unreadable tool call ({failure(e)})"

    def _truncated(self, texts: Sequence[str], limit: int) -> tuple[list[str], int]:
        """Each answer cut to `limit` tokens (on the configured side); how many were cut."""
        out, cut = [], 0
        for text in texts:
            ids = self.format.encode(text)
            if len(ids) > limit:
                cut += 1
                kept = formats.truncate_tokens(ids, limit, self.truncate_side, self._marker)
                text = self.format.decode(kept)
            out.append(text)
        return out, cut

    def _block(self, texts: Sequence[str], room: int) -> tuple[list[int], int, int]:
        """The block of a turn's answers, at most `block_size` and `room` tokens; the number of
        answers cut to max_tool_response_length, and 1 if the block was cut to fit `room`."""
        limit = self.max_tool_response_length
        kept, cut = self._truncated(texts, limit)
        block = self.format.render(kept)
        while len(block) > self.block_size and limit > 0:  # edges merged into extra tokens
            limit = max(0, limit - max(1, (len(block) - self.block_size) // len(texts)))
            kept, _ = self._truncated(texts, limit)
            block = self.format.render(kept)
        if len(block) <= room:
            return block, cut, 0
        # The rest of the response cannot hold it: cut the answers further, then the block.
        while len(block) > room and limit > 0:
            limit = max(0, limit - max(1, -(-(len(block) - room) // len(texts))))
            kept, _ = self._truncated(texts, limit)
            block = self.format.render(kept)
        return block[: max(0, room)], cut, 1


def make_tool_host(cfg, tokenizer, *, max_response_length: int) -> ToolHost:
    """The ToolHost of `cfg.rollout.multi_turn` for `tokenizer`; ConfigError (one line) when a
    tool cannot be loaded, the format cannot be rendered with this tokenizer, its stop strings
    cannot be matched on this tokenizer's text, or a block of tool answers would not leave room
    for the model in `max_response_length` tokens.

    `cfg.rollout.stop` (token ids, strings) joins the host's stop ids and strings: a turn that
    ends there has no call (or its call, when the same token also closed one), so it ends the
    row's episode, as it ends a one-turn response. A stop whose text lies inside a call before
    its end (`"\\n"` with format=hermes) would end every turn before its call closes: refused
    (ConfigError, one line)."""
    mt = cfg.rollout.multi_turn
    stop = tuple(cfg.rollout.stop)
    stop_ids = [s for s in stop if isinstance(s, int) and not isinstance(s, bool)]
    stop_strings = [s for s in stop if isinstance(s, str)]
    try:
        tools = base.resolve_tools(mt.tools)
    except ValueError as e:
        raise ConfigError(f"rollout.multi_turn.tools: {e}") from None
    if not tools:
        raise ConfigError("rollout.multi_turn.tools is empty: name at least one, e.g. calc.")
    for t in tools:
        try:
            t.check and t.check()
        except ValueError as e:
            raise ConfigError(f"rollout.multi_turn.tools: {t.name}: {e}") from None
    try:
        fmt = formats.FORMATS.get(mt.format)(tokenizer, tools)
    except ValueError as e:  # FormatError, or an unknown format name
        raise ConfigError(f"rollout.multi_turn.format='{mt.format}': {e}") from None
    try:
        host = ToolHost(
            fmt,
            tools,
            pad_id=tokenizer.pad_token_id,
            max_response_length=max_response_length,
            max_assistant_turns=mt.max_assistant_turns,
            max_parallel_calls=mt.max_parallel_calls,
            max_tool_response_length=mt.max_tool_response_length,
            truncate_side=mt.tool_response_truncate_side,
            tool_timeout=mt.tool_timeout,
            num_workers=mt.num_workers,
            extra_stop_ids=stop_ids,
            extra_stop_strings=stop_strings,
        )
    except ValueError as e:  # FormatError / StopStringError: the template, or stop strings
        raise ConfigError(f"rollout.multi_turn.format='{mt.format}': {e}") from None
    _check_stops(fmt, mt.format, tools, stop)
    if host.block_size >= max_response_length:
        raise ConfigError(
            f"rollout.multi_turn: a block of tool answers takes up to {host.block_size} tokens "
            f"(max_parallel_calls={mt.max_parallel_calls} x max_tool_response_length="
            f"{mt.max_tool_response_length} plus the format's tokens), not less than the "
            f"response budget data.max_response_length={max_response_length}: lower "
            f"max_tool_response_length or raise data.max_response_length."
        )
    return host


def _check_stops(fmt, name: str, tools, stop) -> None:
    """ConfigError when an entry of rollout.stop (a string, or a token id's text) occurs in a
    call of one of `tools` (`fmt.call_text`) at a place that ends before the call's end."""
    for s in stop:
        text = s if isinstance(s, str) else fmt.decode([s])
        for t in tools:
            call = fmt.call_text(t.name)
            if text and text in call[:-1]:
                what = repr(s) if isinstance(s, str) else f"{s} ({text!r})"
                raise ConfigError(
                    f"rollout.stop {what} occurs inside a call of format='{name}' ({call!r}): "
                    "every turn would end before its call closes; leave it out of rollout.stop."
                )
