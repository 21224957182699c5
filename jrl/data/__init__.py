"""Tasks: prompt batches and reference answers, picked by name from the config.

Every task has `train_batch(step, batch_size, stream=0, rows=slice(None)) -> dict of numpy` (a
pure function of the seed, stream and step; `rows` picks a host's share of the batch),
`eval_batch()`, and the attributes `prompt_length`, `max_response_length`,
`eos_id`, `pad_id`, `bos_id`. `make_task(name, tokenizer, **kwargs)` builds one, and
`task_options(cfg)` binds a run's config to its keyword options:

  "arithmetic"  built-in synthetic arithmetic (jrl/data/arithmetic.py); kwargs: num_digits, ops,
                eval_size, seed, max_prompt_length, max_response_length. Batches carry
                `answer_ids` / `answer_len` for the JAX reward "arithmetic_exact_match".
  "few_shot_arithmetic"  the same problems after worked examples, `12+7=19\n...\n37+48=`, for a
                pretrained model (FewShotArithmeticTask); kwargs: those of "arithmetic" and prefix.
                Batches carry `row_id` / `split` for the host reward "first_line".
  "gsm8k"       GSM8K-style records from local files (jrl/data/math_data.py), "question" ->
                prompt, "answer" (ending in "#### <number>") -> ground truth.
  "math"        MATH-style records, "problem" -> prompt, "solution" (with a \\boxed{} answer)
                -> ground truth.
  "custom"      a user's own records, "question" -> prompt as written (template "{question}",
                no instruction added), "answer" -> ground truth (for a user reward function).
    gsm8k / math / custom kwargs (`MathTask`): train_files, eval_files, question_field,
    answer_field, template, prompt_format ("plain" | "chat"), system_prompt, max_prompt_length,
    max_response_length, overlong_prompts ("drop" | "truncate" | "error"), eval_size, seed,
    answer_format, add_bos. Batches carry `row_id` / `split` for the host rewards "gsm8k",
    "math", "format" and user reward functions.
"""

from collections.abc import Callable
from typing import NamedTuple

from jrl.data.arithmetic import ArithmeticTask, FewShotArithmeticTask
from jrl.data.math_data import MathTask, custom_task, gsm8k_task, math_task
from jrl.registry import Registry


class Entry(NamedTuple):
    """A task's registry entry: how to build it and its options from a run's `task` section."""

    build: Callable  # (tokenizer, **options) -> task
    options: Callable  # the config's `task` section -> the task's own keyword options


def _arithmetic_options(t) -> dict:
    return dict(num_digits=t.num_digits, ops=tuple(t.ops))


def _few_shot_options(t) -> dict:
    """few_shot_arithmetic: the arithmetic options and the worked examples ("": the built-in)."""
    return dict(_arithmetic_options(t), **({"prefix": t.few_shot} if t.few_shot else {}))


def _file_options(t) -> dict:
    """gsm8k / math / custom: the files and the prompt's form; empty fields keep the task's
    defaults."""
    given = dict(question_field=t.question_field, answer_field=t.answer_field, template=t.template)
    return dict(
        train_files=t.train_files,
        eval_files=t.eval_files,
        prompt_format=t.prompt_format,
        system_prompt=t.system_prompt or None,
        overlong_prompts=t.overlong_prompts,
        **{k: v for k, v in given.items() if v},
    )


TASKS = Registry(
    "task",
    {
        "arithmetic": Entry(ArithmeticTask, _arithmetic_options),
        "few_shot_arithmetic": Entry(FewShotArithmeticTask, _few_shot_options),
        "gsm8k": Entry(gsm8k_task, _file_options),
        "math": Entry(math_task, _file_options),
        "custom": Entry(custom_task, _file_options),
    },
)


def make_task(name: str, tokenizer, **kwargs):
    """Builds the task registered as `name` with `tokenizer` and the task's keyword options; an
    unknown name raises `jrl.registry.UnknownName` (a ValueError) naming the valid ones."""
    return TASKS.get(name).build(tokenizer, **kwargs)


def task_options(cfg) -> dict:
    """The keyword options of a run's task (`task.name`), bound from its config: the seed, the
    eval split's size and the length limits every task takes, and the task's own (`Entry`)."""
    t = cfg.task
    return dict(
        seed=cfg.seed,
        eval_size=t.eval_size,
        max_prompt_length=cfg.data.max_prompt_length or None,
        max_response_length=cfg.data.max_response_length or None,
        **TASKS.get(t.name).options(t),
    )


__all__ = [
    "TASKS",
    "ArithmeticTask",
    "FewShotArithmeticTask",
    "MathTask",
    "custom_task",
    "gsm8k_task",
    "make_task",
    "math_task",
    "task_options",
]
