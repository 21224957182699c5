"""A user tool for the multi-turn step tests (named in a config as `helpers.faulty_tools:flaky`):
its calls take turns to answer, raise and sleep past the time limit, and it counts each kind
itself, so a test can compare the step's metrics with the tool's own tally."""

import threading
import time

COUNTS = {"calls": 0, "answered": 0, "raised": 0, "slept": 0}
SLEEP_S = 1.0  # past the tests' rollout.multi_turn.tool_timeout
_LOCK = threading.Lock()


def reset() -> None:
    with _LOCK:
        COUNTS.update(dict.fromkeys(COUNTS, 0))


def flaky(x: str) -> str:
    """Answers 7, raises, or sleeps past its time limit, call by call in turn."""
    with _LOCK:
        i = COUNTS["calls"]
        COUNTS["calls"] += 1
        kind = ("answered", "raised", "slept")[i % 3]
        COUNTS[kind] += 1
    if kind == "raised":
        raise RuntimeError("boom")
    if kind == "slept":
        time.sleep(SLEEP_S)
        return "late"
    return "7"
