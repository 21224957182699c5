"""jrl: RL fine-tuning of language models with the whole RL iteration compiled as one jitted
step."""

import os

__version__ = "0.1.0"

# transformers says "PyTorch was not found ..." on import; jrl uses only its tokenizers. Hide that
# advisory notice (warnings and errors stay) unless the environment already sets the variable.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
