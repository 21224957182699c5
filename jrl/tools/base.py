"""Tools: a name, a Python function and the JSON schema the model is shown.

A tool is a `Tool(name, fn, schema)`. `fn(**arguments)` runs on the host with the arguments the
model wrote (a JSON object checked against the schema's `parameters` first) and returns its answer:
a string, or `(text, reward)` to also give the row a reward (`TurnResult.reward`, for the step
to add to the row's score), or any other value (written with `json.dumps`). An exception is an
answer too: the model is told `error: <reason>` and the call counts in `tool_calls/errors`.

Built-in tools are entries of `TOOLS`; a user tool is named in the config as
"package.module:function" (as a user reward is) and may be
  - a `Tool`,
  - a function decorated with `@tool(schema)` (or carrying a `tool_schema` attribute), or
  - a plain function with annotated parameters: its schema is made from its signature (str, int,
    float, bool, list, dict; a parameter without a default is required) and its docstring.
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from jrl.registry import Registry
from jrl.rewards.math import import_path


@dataclass(frozen=True)
class Tool:
    """A named host function, its OpenAI-style function schema
    (`{"type": "function", "function": {"name", "description", "parameters"}}`) and an optional
    `check()` run when the run is built (e.g. that a sandbox is available)."""

    name: str
    fn: Callable[..., Any]
    schema: dict
    check: Callable[[], None] | None = None  # raises ValueError when the tool cannot run here

    @property
    def parameters(self) -> dict:
        return self.schema["function"].get("parameters") or {"type": "object", "properties": {}}

    def __call__(self, **arguments):
        """`fn(**arguments)` (a Tool is named in a config as a function is)."""
        return self.fn(**arguments)


# name -> Tool
TOOLS = Registry("tool")

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}
_JSON_TYPES.update({list: "array", dict: "object"})
_PY_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool}
_PY_TYPES.update({"array": list, "object": dict, "null": type(None)})


def tool(schema: dict | None = None, *, name: str | None = None):
    """Decorator: marks `fn` as a tool with `schema` (made from its signature when omitted)."""

    def decorator(fn):
        fn.tool_schema = schema or schema_from_signature(fn, name=name)
        return fn

    return decorator


def schema_from_signature(fn: Callable, *, name: str | None = None) -> dict:
    """The function schema of a plain function: its annotated parameters and its docstring."""
    properties, required = {}, []
    for pname, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        spec = {}
        if p.annotation in _JSON_TYPES:
            spec["type"] = _JSON_TYPES[p.annotation]
        elif isinstance(p.annotation, str) and p.annotation in {t.__name__ for t in _JSON_TYPES}:
            spec["type"] = _JSON_TYPES[{t.__name__: t for t in _JSON_TYPES}[p.annotation]]
        properties[pname] = spec
        if p.default is p.empty:
            required.append(pname)
    doc = inspect.getdoc(fn) or ""
    return {
        "type": "function",
        "function": {
            "name": name or fn.__name__,
            "description": doc.strip().split("\n\n")[0].replace("\n", " "),
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _as_tool(obj: Any, path: str) -> Tool:
    if isinstance(obj, Tool):
        return obj
    schema = getattr(obj, "tool_schema", None) or schema_from_signature(obj)
    if not (isinstance(schema, dict) and isinstance(schema.get("function"), dict)):
        raise ValueError(
            f"tool {path!r} has a tool_schema that is not a function schema: give "
            '{"type": "function", "function": {"name": ..., "parameters": {...}}}.'
        )
    name = schema["function"].get("name") or getattr(obj, "__name__", path)
    return Tool(name=name, fn=obj, schema=schema)


def resolve_tools(names: str | Sequence[str]) -> list[Tool]:
    """The tools named by `names` (a comma-separated string or a sequence): registered names or
    "package.module:function" paths. ValueError (one line) for an unknown name, a path that does
    not import, or two tools with the same name."""
    out: list[Tool] = []
    for entry in split_names(names):
        if ":" in entry:
            out.append(_as_tool(import_path(entry, "tool"), entry))
        else:
            out.append(TOOLS.get(entry))
    seen = [t.name for t in out]
    dup = sorted({n for n in seen if seen.count(n) > 1})
    if dup:
        raise ValueError(f"two tools are named {dup[0]!r}: give each tool once.")
    return out


def split_names(names: str | Sequence[str]) -> list[str]:
    """ "calc, pkg.mod:fn" or ("calc", "pkg.mod:fn") -> ["calc", "pkg.mod:fn"]."""
    items = names.split(",") if isinstance(names, str) else list(names)
    return [str(n).strip() for n in items if str(n).strip()]


def check_arguments(t: Tool, arguments: Any) -> str | None:
    """None when `arguments` fit the tool's parameter schema (an object with the required keys,
    no unknown keys, values of the declared JSON types), else a one-line reason."""
    if not isinstance(arguments, dict):
        return f"arguments of {t.name} must be a JSON object, got {type(arguments).__name__}"
    params = t.parameters
    properties = params.get("properties") or {}
    missing = [k for k in params.get("required") or [] if k not in arguments]
    if missing:
        return f"{t.name} is missing argument(s) {', '.join(missing)}"
    unknown = [k for k in arguments if properties and k not in properties]
    if unknown:
        return (
            f"{t.name} has no argument(s) {', '.join(unknown)} "
            f"(valid: {', '.join(properties) or 'none'})"
        )
    for key, value in arguments.items():
        kind = (properties.get(key) or {}).get("type")
        kinds = kind if isinstance(kind, list) else [kind] if kind else []
        types = tuple(_PY_TYPES[k] for k in kinds if k in _PY_TYPES)
        wrong_bool = isinstance(value, bool) and not any(k == "boolean" for k in kinds)
        if types and (not isinstance(value, types) or wrong_bool):
            return f"argument {key} of {t.name} must be of type {kind}, got {json.dumps(value)}"
    return None


def normalize_result(value: Any) -> tuple[str, float]:
    """A tool's return value as (text, reward): str, (text, reward), or JSON of anything else."""
    reward = 0.0
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], (int, float)):
        value, reward = value
        if not math.isfinite(reward):
            raise ValueError(f"the tool's reward {reward} is not finite")
    if not isinstance(value, str):
        try:
            value = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            value = str(value)
    return value, float(reward)
