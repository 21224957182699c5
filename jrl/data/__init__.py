"""Tasks: prompt batches and reference answers, picked by name from the config."""

from jrl.data.arithmetic import ArithmeticTask

TASKS = {"arithmetic": ArithmeticTask}


def make_task(name: str, tokenizer, **kwargs):
    """Builds the task registered as `name` with `tokenizer` and the task's keyword options."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: valid names are {', '.join(sorted(TASKS))}.")
    return TASKS[name](tokenizer, **kwargs)
