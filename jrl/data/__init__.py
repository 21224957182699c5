"""Tasks: prompt batches and reference answers, picked by name from the config.

Every task has `train_batch(step, batch_size, stream=0, rows=slice(None)) -> dict of numpy` (a
pure function of the seed, stream and step; `rows` picks a host's share of the batch),
`eval_batch()`, and the attributes `prompt_length`, `max_response_length`,
`eos_id`, `pad_id`, `bos_id`. `make_task(name, tokenizer, **kwargs)` builds one:

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
    gsm8k / math kwargs (`MathTask`): train_files, eval_files, question_field, answer_field,
    template, prompt_format ("plain" | "chat"), system_prompt, max_prompt_length,
    max_response_length, overlong_prompts ("drop" | "truncate" | "error"), eval_size, seed,
    answer_format, add_bos. Batches carry `row_id` / `split` for the host rewards "gsm8k",
    "math", "format" and user reward functions.
"""

from jrl.data.arithmetic import ArithmeticTask, FewShotArithmeticTask
from jrl.data.math_data import MathTask, gsm8k_task, math_task
from jrl.registry import Registry

# name -> (tokenizer, **kwargs) -> task
TASKS = Registry(
    "task",
    {
        "arithmetic": ArithmeticTask,
        "few_shot_arithmetic": FewShotArithmeticTask,
        "gsm8k": gsm8k_task,
        "math": math_task,
    },
)


def make_task(name: str, tokenizer, **kwargs):
    """Builds the task registered as `name` with `tokenizer` and the task's keyword options; an
    unknown name raises `jrl.registry.UnknownName` (a ValueError) naming the valid ones."""
    return TASKS.get(name)(tokenizer, **kwargs)


__all__ = [
    "TASKS",
    "ArithmeticTask",
    "FewShotArithmeticTask",
    "MathTask",
    "gsm8k_task",
    "make_task",
    "math_task",
]
