"""Rewards picked by name: `fn(batch, response_ids, response_mask, *, eos_id) -> scores [B]`.

`batch` is the prompt batch repeated per response row (e.g. `answer_ids`, `answer_len`, or
`row_id` / `split`); `response_ids` / `response_mask` are [B, R]; scores are float32
sequence-level rewards. Every reward can be called inside `jax.jit`.

Two kinds, one call: `get_reward(name, task=None, tokenizer=None, **options)`; a run's options come
from its config's `task` section (`reward_options`).
  - JAX rewards (`REWARDS`) run in-graph on token ids and need no task:
      "arithmetic_exact_match"  exact answer + eos for the arithmetic task.
      "arithmetic_final_answer" the same for the answer after the last tool block (tool_arith).
  - Python rewards (`HOST_REWARDS`) decode the responses and score the text on the host through
    `jax.pure_callback` (jrl/rewards/python.py); they need the task (for the ground truths) and
    its tokenizer (default `task.tokenizer`):
      "gsm8k"   final number vs the `####` answer; options: fallback ("last_number" | "none"),
                format_score (score of a stated but wrong answer, default 0.0).
      "math"    last boxed answer vs the reference, by normalisation / math_verify / sympy with a
                time limit; options: format_score, backend ("auto" | "math_verify" | "sympy"),
                timeout_s (per answer, default 5.0), num_workers (default 2).
      "format"  1.0 when the response states a final answer in the task's form (`####` for
                gsm8k, boxed for math); option: style ("gsm8k" | "boxed").
      "first_line" the response's text up to its first newline equals the ground truth
                (the few_shot_arithmetic task).
      "package.module:function" (or "user:package.module:function"; the module imported from
                the current directory or PYTHONPATH) or "path/to/file.py:function" (the file
                loaded from its path): a user score function
                `(responses: list[str], ground_truths: list[str]) -> list[float]`, run in a
                worker process of its own (`jrl.rewards.worker.ProcessScore`, each call within
                `reward_timeout_s`): whatever it does (raise, exit, hang, return garbage), the
                trainer stops with one line naming the sample. jrl's own Python rewards above
                run in the trainer's process (they do not exit or hang: the math reward's
                symbolic checks have worker processes and a time limit of their own).

Failures of Python rewards: inside `jax.jit` an error raises (an XLA runtime error ending with the
message) unless `defer_failures(reward_fn)` was called, as the trainer does: the callback then
records the first error and returns zeros, and `check(reward_fn)` raises `RewardFailed` with its
one-line message after the step (`RewardInterrupted` when a stop request abandoned the reward).
"""

from collections.abc import Callable
from typing import NamedTuple

from jrl.registry import Registry, UnknownName
from jrl.rewards import math as math_rewards
from jrl.rewards.arithmetic import (
    arithmetic_exact_match,
    arithmetic_final_answer,
    exact_match,
    final_answer_match,
    first_line,
)
from jrl.rewards import worker
from jrl.rewards.python import RewardError, make_python_reward
from jrl.rewards.worker import clear_stop, request_stop

# name -> JAX reward fn(batch, response_ids, response_mask, *, eos_id) -> scores [B]
REWARDS = Registry(
    "reward",
    {
        "arithmetic_exact_match": arithmetic_exact_match,
        "arithmetic_final_answer": arithmetic_final_answer,
    },
)


def _format_score(task, **options):
    style = options.pop("style", None) or getattr(task, "answer_format", None)
    if style is None:
        raise ValueError(
            f"reward 'format' cannot tell the answer form of a {type(task).__name__}: pass "
            "style='gsm8k' or style='boxed'."
        )
    return math_rewards.FormatScore(style=style, **options)


class HostReward(NamedTuple):
    """A Python reward's registry entry: its score function and its options from a run's config."""

    make: Callable  # (task, **options) -> score_fn(responses, ground_truths) -> list[float]
    options: Callable  # the config's `task` section -> the reward's keyword options


def _gsm8k_options(t) -> dict:
    return dict(fallback=t.gsm8k_fallback, format_score=t.format_score)


def _math_options(t) -> dict:
    return dict(
        format_score=t.format_score,
        backend=t.math_backend,
        timeout_s=t.math_timeout_s,
        num_workers=t.math_workers,
    )


HOST_REWARDS = Registry(
    "host reward",
    {
        "gsm8k": HostReward(lambda task, **o: math_rewards.Gsm8kScore(**o), _gsm8k_options),
        "math": HostReward(lambda task, **o: math_rewards.MathScore(**o), _math_options),
        "format": HostReward(_format_score, lambda t: {}),
        "first_line": HostReward(lambda task, **o: first_line, lambda t: {}),
    },
)


def reward_options(task_cfg) -> dict:
    """The keyword options of the reward `task_cfg.reward`, bound from the config's `task`
    section (none for JAX rewards and user functions)."""
    entry = HOST_REWARDS.get(task_cfg.reward, None)
    return {} if entry is None else entry.options(task_cfg)


def names() -> list[str]:
    """Every registered reward name (user functions are given as "package.module:function" or
    "path/to/file.py:function")."""
    return sorted({**REWARDS, **HOST_REWARDS})


def _lookup(name: str):
    """The entry of `name` in REWARDS or HOST_REWARDS; UnknownName naming both tables' names."""
    try:
        return Registry("reward", {**HOST_REWARDS, **REWARDS}).get(name)
    except UnknownName as e:
        raise UnknownName(
            f"{e} A user function is given as 'package.module:function' or "
            "'path/to/file.py:function'."
        ) from None


def get_reward(
    name: str, task=None, tokenizer=None, *, reward_timeout_s: float | None = None, **options
):
    """The ready reward function `name`: a JAX reward, a Python reward or a user function path.

    `task` and `tokenizer` (default `task.tokenizer`) are needed by the Python rewards; `options`
    go to the Python reward's score function (see the module docstring). A user function runs
    in a worker process, each call within `reward_timeout_s` seconds (None: no limit).
    """
    if ":" in name:
        if options:
            raise ValueError(f"user reward {name!r} takes no options; got {', '.join(options)}.")
        score_fn = worker.ProcessScore(
            name, name=name, timeout_s=reward_timeout_s, error=RewardError
        )
    else:
        entry = _lookup(name)
        if name in REWARDS:
            if options:
                raise ValueError(f"reward {name!r} takes no options; got {', '.join(options)}.")
            return entry
        if task is None:
            raise ValueError(
                f"reward {name!r} scores decoded text on the host and needs the task and "
                f"tokenizer: get_reward({name!r}, task, tokenizer)."
            )
        score_fn = entry.make(task, **options)
    if tokenizer is None:
        tokenizer = getattr(task, "tokenizer", None)
    return make_python_reward(score_fn, task, tokenizer, name=name)


class RewardFailed(RuntimeError):
    """A Python reward failed during a step (the message names the sample and the problem): the
    step's result must not be kept."""


class RewardInterrupted(RewardFailed):
    """A stop was requested while a user reward ran, and it was abandoned (`request_stop`)."""


def defer_failures(reward_fn) -> None:
    """A failure of `reward_fn` inside a jitted step is recorded (the step goes on with zero
    scores) for `check` to raise, instead of raising inside the step. No-op for JAX rewards."""
    outcome = getattr(reward_fn, "outcome", None)
    if outcome is not None:
        outcome.defer()


def check(reward_fn) -> None:
    """Raises RewardFailed (one line) when `reward_fn` failed since the last check, or
    RewardInterrupted when a stop request abandoned it; clears the record."""
    outcome = getattr(reward_fn, "outcome", None)
    error, interrupted = outcome.take() if outcome is not None else (None, False)
    if error is None:
        return
    if isinstance(error, (RewardError, worker.Stopped)):
        message = str(error)
    else:  # raised by the callback around the score function (decoding, ground truths)
        name = reward_fn.__name__.removeprefix("python_reward_")
        message = f"reward {name!r} failed: {type(error).__name__}: {error}"
    message = " | ".join(line for line in message.splitlines() if line.strip())
    raise (RewardInterrupted if interrupted else RewardFailed)(message)


__all__ = [
    "HOST_REWARDS",
    "REWARDS",
    "RewardError",
    "RewardFailed",
    "RewardInterrupted",
    "arithmetic_exact_match",
    "arithmetic_final_answer",
    "check",
    "clear_stop",
    "defer_failures",
    "exact_match",
    "final_answer_match",
    "get_reward",
    "make_python_reward",
    "names",
    "request_stop",
    "reward_options",
]
