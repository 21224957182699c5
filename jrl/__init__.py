"""jrl: RL fine-tuning of language models with the whole RL iteration compiled as one jitted
step."""

__version__ = "0.1.0"

from jrl import console as _console

_console.hide_library_notices()  # before transformers is imported: no "PyTorch was not found"
