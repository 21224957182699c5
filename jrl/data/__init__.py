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
  "tool_arith"  arithmetic with a calculator (jrl/data/tool_arith.py): the arithmetic task whose
                warm-up batches show, on a `tool_demos` share of rows, a tool call in the compact
                format (`<37*48>=1776;1776`, the tool's `=1776;` not trained); kwargs: those of
                "arithmetic", tool_demos and tool_call_share (the share of demonstrations
                whose opening `<` is trained). Reward "arithmetic_final_answer".
  "calc_products" few-shot 3-digit x 2-digit products for a pretrained model with a calculator
                in the `tags` format (jrl/data/calc_products.py): worked examples that call
                `<calc>...</calc>` (with tools) or answer directly (without), then
                `Q: 729*52\nA:`; kwargs: tools (rollout.multi_turn.enable), num_digits, prefix,
                eval_size, seed, max_prompt_length, max_response_length. Batches carry `row_id` /
                `split` for its host reward "jrl.data.calc_products:final_answer" (the last
                number on the first line of the model's final turn). No warm-up answers.
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
from jrl.data.calc_products import CalcProductsTask
from jrl.data.math_data import MathTask, custom_task, gsm8k_task, math_task
from jrl.data.tool_arith import ToolArithTask
from jrl.registry import Registry


class Entry(NamedTuple):
    """A task's registry entry: how to build it and its options from a run's `task` section."""

    build: Callable  # (tokenizer, **options) -> task
    options: Callable  # a run's config -> the task's own keyword options


def _arithmetic_options(cfg) -> dict:
    return dict(num_digits=cfg.task.num_digits, ops=tuple(cfg.task.ops))


def _few_shot_options(cfg) -> dict:
    """few_shot_arithmetic: the arithmetic options and the worked examples ("": the built-in)."""
    few_shot = cfg.task.few_shot
    return dict(_arithmetic_options(cfg), **({"prefix": few_shot} if few_shot else {}))


def _tool_arith_options(cfg) -> dict:
    """Demonstrations only where the model has tools: a run without them warms up on answers."""
    demos = cfg.task.tool_demos if cfg.rollout.multi_turn.enable else 0.0
    return dict(
        **_arithmetic_options(cfg), tool_demos=demos, tool_call_share=cfg.task.tool_call_share
    )


def _calc_products_options(cfg) -> dict:
    """calc_products: worked examples that call the calculator only where the run has tools;
    task.few_shot ("": the built-in examples) replaces them."""
    return dict(
        tools=cfg.rollout.multi_turn.enable,
        num_digits=cfg.task.num_digits,
        prefix=cfg.task.few_shot or None,
    )


def _file_options(cfg) -> dict:
    """gsm8k / math / custom: the files and the prompt's form; empty fields keep the task's
    defaults."""
    t = cfg.task
    given = dict(question_field=t.question_field, answer_field=t.answer_field, template=t.template)
    return dict(
        train_files=t.train_files,
        eval_files=t.eval_files,
        prompt_format=t.prompt_format,
        system_prompt=t.system_prompt or None,
        overlong_prompts=t.overlong_prompts,
        **{k: v for k, v in given.items() if v},
    )


# The built-in tasks: synthetic problems (no files); all but calc_products have the reference
# answers the supervised warm-up trains on.
ARITHMETIC_TASKS = ("arithmetic", "few_shot_arithmetic", "tool_arith", "calc_products")

TASKS = Registry(
    "task",
    {
        "arithmetic": Entry(ArithmeticTask, _arithmetic_options),
        "few_shot_arithmetic": Entry(FewShotArithmeticTask, _few_shot_options),
        "tool_arith": Entry(ToolArithTask, _tool_arith_options),
        "calc_products": Entry(CalcProductsTask, _calc_products_options),
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
        **TASKS.get(t.name).options(cfg),
    )


__all__ = [
    "ARITHMETIC_TASKS",
    "TASKS",
    "ArithmeticTask",
    "CalcProductsTask",
    "FewShotArithmeticTask",
    "MathTask",
    "ToolArithTask",
    "custom_task",
    "gsm8k_task",
    "make_task",
    "math_task",
    "task_options",
]
