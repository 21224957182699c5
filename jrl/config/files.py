"""Where a config comes from: the files of `--config=FILE[:preset]` and the command line's
`--config.a.b=v` overrides.

`load_file` runs a config file (or `configs/common.py`) read by path; `config_path_error`,
`config_files` and `config_file_error` give the one-line errors of a config file that is missing
(with the closest file by name and the list of them) or raises while building its config (with
the line and the file's presets). `override_keys` reads the fields an argv overrides, and
`unknown_override` gives the error for one that names no field.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import sys
import traceback

import ml_collections

from jrl.config.errors import ConfigError
from jrl.config.schema import flat_keys
from jrl.registry import suggest


def load_file(path: str, next_to: str | None = None):
    """The module of the Python file at `path` (relative to the directory of the file `next_to`
    when given), executed afresh: a config file, or what config files share (configs/common.py),
    which they read by path since configs/ is no package and a config may be given from any
    working directory. It stays in sys.modules even when it raises, so `config_file_error` can
    list the presets of a failing file."""
    if next_to is not None:
        path = os.path.join(os.path.dirname(os.path.abspath(next_to)), path)
    path = os.path.abspath(path)
    name = "_jrl_file_" + "".join(ch if ch.isalnum() else "_" for ch in path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def config_file_error(spec: str, error: BaseException) -> str:
    """The one-line error for `--config=spec` whose file raised `error` while building the config:
    its own message for a ConfigError (an unknown preset names the valid ones), else the
    exception, where in the file it was raised and the file's presets (a `PRESETS` dict)."""
    if isinstance(error, ConfigError):
        return str(error) if spec in str(error) else f"--config={spec}: {error}"
    path = os.path.abspath(spec.partition(":")[0])
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == path]
    where = f" (line {frames[-1].lineno} of {spec.partition(':')[0]})" if frames else ""
    reason = str(error).splitlines()[0] if str(error) else ""
    module = next(
        (
            m
            for m in list(sys.modules.values())
            if os.path.abspath(getattr(m, "__file__", None) or "/") == path
        ),
        None,
    )
    presets = getattr(module, "PRESETS", None)
    listed = f"; valid presets: {', '.join(presets)}" if isinstance(presets, dict) else ""
    return f"--config={spec}: {type(error).__name__}: {reason}{where}{listed}."


def config_files(near: str) -> list[str]:
    """The config files (.py files with a `get_config`) beside the path `near` and in configs/
    (of the working directory and of this repository), as relative paths where under the working
    directory."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    repo_configs = os.path.join(repo, "configs")  # jrl/config/files.py -> configs/
    found = {}
    for folder in (os.path.dirname(near) or ".", "configs", repo_configs):
        if not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            path = os.path.abspath(os.path.join(folder, name))
            if name.endswith(".py") and path not in found and os.path.isfile(path):
                with open(path, errors="replace") as f:
                    if "def get_config" in f.read():
                        relative = os.path.relpath(path)
                        found[path] = path if relative.startswith("..") else relative
    return sorted(found.values())


def config_path_error(spec: str, problem: str = "") -> str | None:
    """The one-line error for `--config=spec` whose file does not exist (or has `problem`): the
    closest config file by name, if one is close, and the list of them; None for a file that
    exists."""
    path = spec.partition(":")[0]
    if not problem and os.path.isfile(path):
        return None
    problem = problem or ("is a directory" if os.path.isdir(path) else "does not exist")
    files = [f for f in config_files(path) if os.path.abspath(f) != os.path.abspath(path)]
    # the closest by file name (a whole path would match on a shared folder alone)
    names = {os.path.basename(f): f for f in reversed(files)}
    close = difflib.get_close_matches(os.path.basename(path), list(names), n=1)
    hint = f" (did you mean '{names[close[0]]}'?)" if close else ""
    listed = f"; the config files: {', '.join(files)}" if files else ""
    return f"--config={spec}: config file '{path}' {problem}{hint}{listed}."


def override_keys(argv) -> list[str]:
    """The fields `--config.a.b=v` (and a boolean's `--config.a.b` / `--noconfig.a.b`) of argv set,
    as dotted paths ("a.b"), in order."""
    keys = []
    for arg in argv:
        for prefix in ("--config.", "--noconfig."):
            if arg.startswith(prefix) and len(arg) > len(prefix):
                keys.append(arg[len(prefix) :].split("=", 1)[0])
    return keys


def unknown_override(cfg: ml_collections.ConfigDict, argv) -> str | None:
    """The one-line error for the first `--config.a.b=v` in argv that names no field, else None."""
    keys = flat_keys(cfg)
    for key in override_keys(argv):
        if key not in keys:
            return (
                f"unknown config field '{key}'{suggest(key, keys)}; the fields are listed "
                f"(with a comment each) in jrl/config/schema.py and the config file."
            )
    return None
