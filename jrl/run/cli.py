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
    """The ConfigDict of `--config=path.py[:arg]` without the overrides."""
    path, _, arg = spec.partition(":")
    module = config_lib.load_file(path)
    if not callable(getattr(module, "get_config", None)):
        raise config_lib.ConfigError(
            config_lib.config_path_error(spec, "defines no get_config(arg=None) returning a config")
        )
    return module.get_config(arg or None)


def _config_spec(argv) -> str | None:
    """The value of `--config=X` / `--config X` in argv (the last one given), else None."""
    spec = None
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            spec = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            spec = argv[i + 1]
    return spec


def parse_flags(argv):
    """absl flag parsing, with a one-line error (exit 2) for a config file that does not exist,
    has no get_config or raises (the reason, not absl's 'Error whilst parsing config file'), an
    override of an unknown field, one of a switched-off feature (`config.unused_override`), or a
    positional argument (none of the command lines takes one).
    Fields the config file set for a feature that the command line turns off go back to their
    defaults (`config.reset_switched_off`): they have no effect, and validate would refuse them."""
    spec = _config_spec(argv)
    missing = spec and config_lib.config_path_error(spec)
    if missing:
        fail(missing)
    try:
        rest = flags.FLAGS(argv)
    except (flags.Error, AttributeError, KeyError) as e:
        message = None
        if spec:
            try:
                message = config_lib.unknown_override(_load_config_file(spec), argv)
            except Exception as file_error:  # a bad preset, or an error inside the config file
                message = config_lib.config_file_error(spec, file_error)
        fail(message or str(e).splitlines()[0])
    if len(rest) > 1:  # absl would print its whole usage text and exit 1
        fail(
            f"unexpected argument {rest[1]!r}: every setting is a flag, --name=value (a config "
            f"field: --config.section.field=value); --help lists the flags."
        )
    cfg = flags.FLAGS["config"].value if spec and "config" in flags.FLAGS else None
    if cfg is not None:
        config_lib.reset_switched_off(cfg, _load_config_file(spec), argv)
        unused = config_lib.unused_override(cfg, argv)
        if unused:
            try:  # an invalid value is named as such first, whether its feature is on or off
                config_lib.validate(cfg)
            except config_lib.SwitchedOffError:
                pass  # the command line's own setting is named below
            except config_lib.ConfigError as e:
                fail(str(e))
            fail(unused)
    return rest


def fail(message: str, code: int = 2):
    """Prints `error: message` on stderr and exits with `code`."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)
