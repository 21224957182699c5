"""The run config: its schema, its validation and where it is read from.

    schema.py        `base_config()`, every field a run reads with its default and a comment (one
                     function a section); `flat_keys`; what a resume may change
                     (`RESUME_SAFE_SECTIONS`, `RESUME_SAFE_FIELDS`, `resume_safe_fields`)
    validation.py    `validate(cfg)`: one validator a section, run before anything compiles;
                     `MODEL_DTYPES`, `GROUP_ESTIMATORS`
    switched_off.py  the on/off sections: a field set while its feature is off is refused
                     (`unused_override`), or put back (`reset_switched_off`)
    files.py         config files read by path (`load_file`) and the errors of a bad `--config=`
                     (`config_path_error`, `config_files`, `config_file_error`); the command
                     line's overrides (`override_keys`, `unknown_override`)
    errors.py        `ConfigError`, `SwitchedOffError`

Callers use the names below: `from jrl import config as config_lib; config_lib.validate(cfg)`.
"""

from jrl.config.errors import ConfigError, SwitchedOffError
from jrl.config.files import (
    config_file_error,
    config_files,
    config_path_error,
    load_file,
    override_keys,
    unknown_override,
)
from jrl.config.schema import (
    RESUME_SAFE_FIELDS,
    RESUME_SAFE_SECTIONS,
    base_config,
    flat_keys,
    resume_safe_fields,
)
from jrl.config.switched_off import reset_switched_off, unused_override
from jrl.config.validation import GROUP_ESTIMATORS, MODEL_DTYPES, validate

__all__ = [
    "GROUP_ESTIMATORS",
    "MODEL_DTYPES",
    "RESUME_SAFE_FIELDS",
    "RESUME_SAFE_SECTIONS",
    "ConfigError",
    "SwitchedOffError",
    "base_config",
    "config_file_error",
    "config_files",
    "config_path_error",
    "flat_keys",
    "load_file",
    "override_keys",
    "reset_switched_off",
    "resume_safe_fields",
    "unknown_override",
    "unused_override",
    "validate",
]
