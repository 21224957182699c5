"""The errors of the config: `ConfigError` (a value that cannot run, one line naming the field and
the fix) and `SwitchedOffError` (a field set for a feature that is off). Their own module, so
that every module of the package, and a caller such as `jrl.tools.host`, can raise them."""


class ConfigError(ValueError):
    """A config value that cannot run; the message names the field and the fix."""


class SwitchedOffError(ConfigError):
    """A field set for a feature that is switched off (it would have no effect)."""
