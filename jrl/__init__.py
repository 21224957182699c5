"""jrl: RL fine-tuning of language models with the whole RL iteration compiled as one jitted step."""

__version__ = "0.1.0"
