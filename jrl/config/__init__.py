"""The run config. For now one module, `schema.py`: the schema (`base_config()`), its validation
(`validate`), the switched-off rules and the config files; the names callers use are here:
`from jrl import config as config_lib; config_lib.validate(cfg)`.
"""

from jrl.config.schema import (
    GROUP_ESTIMATORS,
    MODEL_DTYPES,
    RESUME_SAFE_FIELDS,
    RESUME_SAFE_SECTIONS,
    ConfigError,
    SwitchedOffError,
    base_config,
    config_file_error,
    config_files,
    config_path_error,
    flat_keys,
    load_file,
    override_keys,
    reset_switched_off,
    resume_safe_fields,
    unknown_override,
    unused_override,
    validate,
)

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
