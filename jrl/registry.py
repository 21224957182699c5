"""The one registry helper: every set of named variants (estimators, losses, aggregation modes, KL
controllers, tasks, rewards, model families, activations, RoPE scalings, presets) is a `Registry`.

    ESTIMATORS = Registry("advantage estimator")

    @ESTIMATORS.register("grpo")
    def grpo(...): ...

    ESTIMATORS.get("grpo")   # the function; an unknown name raises UnknownName (a ValueError):
                             # "unknown advantage estimator 'grpp' (did you mean 'grpo'?): valid
                             #  names are gae, grpo, ..."

Config validation reads `names()` from the registries, so a new entry is valid everywhere at once.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from typing import Any


class UnknownName(ValueError):
    """A name that no entry of a registry carries."""


def suggest(value: Any, valid: Iterable[str]) -> str:
    """ " (did you mean 'x'?)" for the closest of `valid` to `value`, or ""."""
    close = difflib.get_close_matches(str(value), list(valid), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


class Registry(dict):
    """name -> entry, for one kind of variant (`what`, used in error messages)."""

    def __init__(self, what: str, entries: dict | None = None):
        super().__init__()
        self.what = what
        for name, entry in (entries or {}).items():
            self.add(name, entry)

    def add(self, name: str, entry: Any) -> Any:
        """Registers `entry` under `name`; a name registered twice raises ValueError."""
        if name in self:
            raise ValueError(f"{self.what} {name!r} is already registered.")
        self[name] = entry
        return entry

    def register(self, *names: str) -> Callable:
        """A decorator registering the decorated object under each of `names`."""

        def decorator(entry):
            for name in names:
                self.add(name, entry)
            return entry

        return decorator

    def get(self, name: str, *default) -> Any:
        """The entry of `name`; an unknown name raises UnknownName naming the valid ones (or,
        given a default as `dict.get`, returns it)."""
        if name in self:
            return self[name]
        if default:
            return default[0]
        raise UnknownName(
            f"unknown {self.what} {name!r}{suggest(name, self)}: valid names are "
            f"{', '.join(self.names())}."
        )

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self)
