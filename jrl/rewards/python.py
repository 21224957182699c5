"""Python rewards inside the jitted step, through `jax.pure_callback`.

A score function works on text: `score_fn(responses: list[str], ground_truths: list[str]) ->
sequence of B floats` (the built-in ones are in `jrl.rewards.math`; users give their own as
"package.module:function" or "path/to/file.py:function"). `make_python_reward` turns one into a
reward with the signature of the JAX rewards, `reward_fn(batch, response_ids, response_mask, *,
eos_id) -> [B] float32`, that can be called inside `jax.jit`: the callback copies `row_id`,
`split`, `response_ids` and `response_mask` to the host, decodes the masked response tokens
(special tokens skipped), looks up the ground truths with `task.ground_truths_for(split,
row_id)`, calls the score function and checks its result (B finite numbers). The call blocks
the step until the scores are back.

Errors name the sample: an exception inside the score function, a wrong number of scores, or a
score that is not a finite number raises `RewardError` naming the reward, the sample index, its
split and row and the start of its response; inside `jax.jit` it reaches the caller as a
`jax.errors.JaxRuntimeError` whose message ends with that line. To name the sample that made a
batch-level function raise, the function is called again on one sample at a time. The trainer
defers failures instead (`reward_fn.outcome`, a `jrl.rewards.worker.Outcome`): the callback
records the error, returns zeros, and the trainer stops before it keeps anything of the step.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jrl.rewards import worker
from jrl.rewards.math import import_path

ScoreFn = Callable[[Sequence[str], Sequence[str]], Sequence[float]]
SPLIT_NAMES = ("train", "eval")  # batch["split"] values 0, 1


class RewardError(ValueError):
    """A score function failed or returned something other than one finite float per response."""


def load_score_fn(path: str) -> ScoreFn:
    """The user score function at "package.module:function" or "path/to/file.py:function" (a
    "user:" prefix is allowed)."""
    path = path.removeprefix("user:")
    return import_path(path, "reward function")


def _where(i: int, splits, rows, responses) -> str:
    split = SPLIT_NAMES[splits[i]] if 0 <= splits[i] < len(SPLIT_NAMES) else str(splits[i])
    text = responses[i]
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"sample {i} (split {split}, row_id {rows[i]}, response {text!r})"


def checked_scores(
    score_fn: ScoreFn,
    responses: Sequence[str],
    ground_truths: Sequence[str],
    *,
    name: str = "reward",
    splits: Sequence[int] = (),
    rows: Sequence[int] = (),
) -> np.ndarray:
    """`score_fn(responses, ground_truths)` as a float32 [B] array, or a `RewardError` naming the
    first bad sample (`splits` / `rows` [B] say where each sample came from, for the message)."""
    b = len(responses)
    splits = list(splits) or [-1] * b
    rows = list(rows) or [-1] * b
    try:
        scores = score_fn(list(responses), list(ground_truths))
    except (RewardError, worker.Stopped):
        raise  # named already (a worker's timeout or end), or a stop: no sample to search
    except Exception as e:
        i = _failing_sample(score_fn, responses, ground_truths)
        where = _where(i, splits, rows, responses) if i is not None else f"a batch of {b}"
        raise RewardError(
            f"reward {name!r} failed on {where}: {type(e).__name__}: {e}; fix the reward function."
        ) from e
    try:
        count = len(scores)
    except TypeError:
        raise RewardError(
            f"reward {name!r} returned a {type(scores).__name__}, not a sequence: return one float "
            f"per response ({b})."
        ) from None
    if count != b:
        raise RewardError(
            f"reward {name!r} returned {count} scores for {b} responses: return one float per "
            "response."
        )
    out = np.zeros(b, np.float32)
    for i, s in enumerate(scores):
        if isinstance(s, np.ndarray) and s.shape == ():
            s = s.item()
        if not isinstance(s, numbers.Real):
            raise RewardError(
                f"reward {name!r} returned {s!r} ({type(s).__name__}) for "
                f"{_where(i, splits, rows, responses)}: return a float."
            )
        if not math.isfinite(float(s)):
            raise RewardError(
                f"reward {name!r} returned {float(s)} for {_where(i, splits, rows, responses)}: "
                "return a finite float."
            )
        out[i] = float(s)
    return out


def _failing_sample(score_fn, responses, ground_truths):
    """The first index whose one-sample call raises, or None."""
    for i, (r, g) in enumerate(zip(responses, ground_truths)):
        try:
            score_fn([r], [g])
        except Exception:
            return i
    return None


def make_python_reward(score_fn: ScoreFn, task, tokenizer, *, name: str = "python"):
    """A JAX-signature reward that runs `score_fn` on the host through `jax.pure_callback`.

    Args:
      score_fn: `(responses: list[str], ground_truths: list[str]) -> B floats`.
      task: has `ground_truths_for(split [N] int, row_id [N] int) -> list[str]` (the gsm8k and
        math tasks); its batches carry `row_id` and `split` [B_p] int32.
      tokenizer: decodes response ids (`batch_decode(..., skip_special_tokens=True)`).
      name: the reward's name, for error messages.

    Returns:
      `reward_fn(batch, response_ids [B, R], response_mask [B, R], *, eos_id) -> [B] float32`,
      traceable under `jax.jit` and `jax.vmap`; `reward_fn.score_fn` is `score_fn`.
    """
    if not callable(score_fn):
        raise TypeError(f"reward {name!r}: score_fn is a {type(score_fn).__name__}, not callable.")
    if task is None or not hasattr(task, "ground_truths_for"):
        raise ValueError(
            f"reward {name!r} runs on the host and needs a task with ground truths (gsm8k, math): "
            f"got {type(task).__name__}; use get_reward({name!r}, task, tokenizer)."
        )
    if tokenizer is None:
        raise ValueError(f"reward {name!r} needs the tokenizer to decode responses.")

    def host(split, row_id, response_ids, response_mask):
        """numpy [..., R] ids / mask, [...] split / row_id -> [...] float32 (any leading dims)."""
        lead = np.shape(row_id)
        ids = np.asarray(response_ids).reshape(-1, np.shape(response_ids)[-1])
        mask = np.asarray(response_mask).reshape(ids.shape)
        splits = np.asarray(split).reshape(-1).tolist()
        rows = np.asarray(row_id).reshape(-1).tolist()
        tokens = [row[m > 0].tolist() for row, m in zip(ids, mask)]
        responses = tokenizer.batch_decode(tokens, skip_special_tokens=True)
        truths = task.ground_truths_for(splits, rows)
        scores = checked_scores(score_fn, responses, truths, name=name, splits=splits, rows=rows)
        return scores.reshape(lead)

    def reward_fn(batch, response_ids, response_mask, *, eos_id: int):
        del eos_id  # the mask already ends at eos
        for key in ("row_id", "split"):
            if key not in batch:
                raise KeyError(
                    f"reward {name!r} needs batch[{key!r}] to find the ground truths: use a task "
                    "whose batches carry row_id and split (gsm8k, math)."
                )
        row_id = jnp.asarray(batch["row_id"], jnp.int32)
        out = jax.ShapeDtypeStruct(row_id.shape, jnp.float32)
        return jax.pure_callback(
            lambda *args: outcome.call(host, args, np.zeros(np.shape(args[1]), np.float32)),
            out,
            jnp.asarray(batch["split"], jnp.int32),
            row_id,
            jnp.asarray(response_ids, jnp.int32),
            jnp.asarray(response_mask, jnp.int32),
            vmap_method="broadcast_all",
        )

    outcome = worker.Outcome()  # `host` through it: failures recorded once the trainer defers
    reward_fn.outcome = outcome
    reward_fn.score_fn = score_fn
    reward_fn.__name__ = f"python_reward_{name}"
    return reward_fn
