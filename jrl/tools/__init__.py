"""Tools for multi-turn rollouts: the registry, the built-in tools and the call formats.

    TOOLS        name -> Tool (built-in: "calc", exact arithmetic, jrl/tools/calc.py; "python",
                 a program run in a bubblewrap sandbox with limits, jrl/tools/python_tool.py and
                 jrl/tools/sandbox.py)
    FORMATS      name -> call format ("hermes" for HF chat templates, "compact" for the
                 character tokenizer; jrl/tools/formats.py)
    resolve_tools("calc,package.module:function") -> [Tool]

The host object the step calls between turns is `jrl.tools.host.make_tool_host` (it needs the
config package, whose validation imports this package for the names above); its metrics are
`jrl.tools.metrics.multi_turn_metrics`. docs/multi_turn.md has the whole picture.
"""

from jrl.tools import calc as _calc
from jrl.tools import python_tool as _python_tool
from jrl.tools.base import (
    TOOLS,
    Tool,
    check_arguments,
    normalize_result,
    resolve_tools,
    schema_from_signature,
    split_names,
    tool,
)
from jrl.tools.formats import FORMATS, SIDES, Call, FormatError, truncate_tokens

TOOLS.add("calc", Tool(name="calc", fn=_calc.calc, schema=_calc.CALC_SCHEMA))
TOOLS.add("python", _python_tool.PYTHON_TOOL)


def names() -> list[str]:
    """The registered tool names (user tools are given as "package.module:function")."""
    return TOOLS.names()


__all__ = [
    "FORMATS",
    "SIDES",
    "TOOLS",
    "Call",
    "FormatError",
    "Tool",
    "check_arguments",
    "names",
    "normalize_result",
    "resolve_tools",
    "schema_from_signature",
    "split_names",
    "tool",
    "truncate_tokens",
]
