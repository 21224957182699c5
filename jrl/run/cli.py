"""What the command-line entrypoints (`python -m jrl.train | jrl.eval | jrl.export | jrl.bench`)
share: the `--config` / `--workdir` flags and flag parsing with one-line errors.

Only entrypoints import this module (it registers absl flags); nothing imports an entrypoint.
"""

from __future__ import annotations

import sys

from absl import flags
from ml_collections import config_flags

from jrl import config as config_lib


def define_config(help_suffix: str = "") -> flags.FlagHolder:
    """`--config=configs/X.py[:presets]` with `--config.a.b=v` overrides."""
    return config_flags.DEFINE_config_file(
        "config",
        None,
        f"Config file (configs/*.py), optionally with ':presets'.{help_suffix}",
        lock_config=True,
    )


def define_workdir(help_text: str) -> flags.FlagHolder:
    return flags.DEFINE_string("workdir", None, help_text)


def config_filename() -> str:
    """The path of the file given as --config (without its presets)."""
    return config_flags.get_config_filename(flags.FLAGS["config"])


def _load_config_file(spec: str):
    """The ConfigDict of `--config=path.py[:arg]` (to explain a bad override)."""
    path, _, arg = spec.partition(":")
    return config_lib.load_file(path).get_config(arg or None)


def parse_flags(argv):
    """absl flag parsing, with a one-line error (exit 2) for an override of an unknown field or a
    config file that raises (the reason, not absl's 'Error whilst parsing config file')."""
    try:
        return flags.FLAGS(argv)
    except (flags.Error, AttributeError, KeyError) as e:
        spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
        message = None
        if spec:
            try:
                message = config_lib.unknown_override(_load_config_file(spec), argv)
            except Exception as file_error:  # a bad preset, or an error inside the config file
                message = config_lib.config_file_error(spec, file_error)
        print(f"error: {message or str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)


def fail(message: str, code: int = 2):
    """Prints `error: message` on stderr and exits with `code`."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)
