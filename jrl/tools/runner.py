"""Runs tool calls on host threads, at most `num_workers` at once, each with a time limit.

A call's clock starts when it starts running. A call still running at its limit is answered as
timed out and its thread is abandoned (Python cannot stop a thread): it frees its worker slot at
once, runs on as a daemon thread, and whatever it returns later is dropped. Tools that may hang
for good (network, subprocesses) should enforce their own limits too.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, NamedTuple, Sequence


class Outcome(NamedTuple):
    """What became of one call: status "ok" (value is its return), "error" (value is the
    exception) or "timeout" (value None); seconds it ran (the limit for a time-out)."""

    status: str
    value: Any
    seconds: float


def run_calls(
    calls: Sequence[Callable[[], Any]], *, num_workers: int, timeout: float
) -> list[Outcome]:
    """Runs every zero-argument callable of `calls`; returns their outcomes in order."""
    outcomes: list[Outcome | None] = [None] * len(calls)
    started: dict[int, float] = {}  # running call -> start time
    done = threading.Condition()
    pending = list(range(len(calls)))[::-1]

    def work(i: int) -> None:
        t0 = time.perf_counter()
        try:
            result = Outcome("ok", calls[i](), 0.0)
        except BaseException as e:  # noqa: BLE001 - any failure is the model's answer
            result = Outcome("error", e, 0.0)
        with done:
            if i in started:  # not timed out meanwhile
                del started[i]
                outcomes[i] = result._replace(seconds=time.perf_counter() - t0)
                done.notify()

    with done:
        while pending or started:
            while pending and len(started) < num_workers:
                i = pending.pop()
                started[i] = time.perf_counter()
                threading.Thread(target=work, args=(i,), daemon=True, name=f"tool-{i}").start()
            now = time.perf_counter()
            for i, t0 in list(started.items()):
                if now - t0 >= timeout:
                    del started[i]
                    outcomes[i] = Outcome("timeout", None, timeout)
            if started and (not pending or len(started) >= num_workers):
                first_deadline = min(started.values()) + timeout
                done.wait(max(0.0, first_deadline - time.perf_counter()))
    return outcomes  # type: ignore[return-value]
