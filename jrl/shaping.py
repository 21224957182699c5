"""From responses to the rewards the estimators read: what a reward reads of a response, DAPO's
overlong penalty and dynamic sampling, and where a row's score lands on its tokens.

- `final_turn_mask`: the tokens a reward reads, the model's final turn (never a tool's answer).
- `overlong_penalty`: DAPO's soft punishment of responses near the budget
  (reward.overlong_buffer).
- `dynamic_sampling`: DAPO's filter (algorithm.filter_groups): rounds of fresh prompts until
  enough groups whose scores differ (`group_has_signal`) are found.
- `last_token_scores`: each row's score on its last model token (verl's token_level_scores).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def final_turn_mask(response_mask_BR, valid_BR):
    """[B, R] int32: what a reward reads of a multi-turn response, the model's final turn: its
    model tokens (`response_mask` 1) after the last tool token (`valid` 1, `response_mask` 0);
    the whole response of a row that called no tool (`response_mask` itself in a one-turn
    rollout, where valid = response_mask). A tool's answer is never read as the
    model's words (a policy would learn to let the tool state its answer)."""
    r = response_mask_BR.shape[1]
    tool = (valid_BR > 0) & (response_mask_BR == 0)
    last_tool = jnp.max(jnp.where(tool, jnp.arange(r)[None], -1), axis=-1, keepdims=True)
    return ((response_mask_BR > 0) & (jnp.arange(r)[None] > last_tool)).astype(jnp.int32)


def overlong_penalty(length_B, max_new_tokens: int, buffer_len: int, penalty_factor: float):
    """DAPO's soft overlong punishment: 0 up to R - buffer_len tokens, then falling linearly to
    -penalty_factor at R: min(-(len - (R - buffer_len)) / buffer_len * factor, 0)."""
    exceed = length_B.astype(jnp.float32) - (max_new_tokens - buffer_len)
    return jnp.minimum(-exceed / buffer_len * penalty_factor, 0.0)


def group_has_signal(scores_B, n: int):
    """[B / n] bool: the group's scores are not all equal (DAPO dynamic sampling keeps these)."""
    g = scores_B.reshape(-1, n)
    return jnp.max(g, -1) > jnp.min(g, -1)


def dynamic_sampling(sample: Callable, pool, key, n: int, filter_groups, batch_prompts: int):
    """DAPO: keep groups whose scores differ; draw fresh prompts from the pool until
    `batch_prompts` (B_p) such groups are found or the pool's
    `filter_groups.max_num_gen_batches` rounds are used (`lax.while_loop`). Slots still empty at
    the end hold groups without signal from the first round (advantages 0).

    `sample(prompts, key)` -> the scored experience of n samples of each prompt (rows of a
    group consecutive), with `acc` and `scores`; `pool` holds rounds x B_p prompts. Returns
    (experience of B_p groups, metrics)."""
    b_p, rounds = batch_prompts, filter_groups.max_num_gen_batches
    chunks = jax.tree_util.tree_map(lambda x: x.reshape(rounds, b_p, *x.shape[1:]), pool)
    take = lambda i: jax.tree_util.tree_map(lambda x: x[i], chunks)
    metric = {"acc": "acc", "score": "scores"}[filter_groups.metric]  # verl's names -> exp's keys
    signal = lambda e: group_has_signal(e[metric], n)

    first = sample(take(0), jax.random.fold_in(key, 0))
    keep = signal(first)
    order = jnp.argsort(~keep, stable=True)  # groups with signal first
    rows = (order[:, None] * n + jnp.arange(n)).reshape(-1)
    buf = jax.tree_util.tree_map(lambda x: x[rows], first)

    def cond(carry):
        i, filled, _ = carry
        return (i < rounds) & (filled < b_p)

    def body(carry):
        i, filled, buf = carry
        new = sample(take(i), jax.random.fold_in(key, i))
        keep = signal(new)
        dest = jnp.where(keep, filled + jnp.cumsum(keep) - 1, b_p)  # b_p: dropped
        dest_rows = (dest[:, None] * n + jnp.arange(n)).reshape(-1)
        buf = jax.tree_util.tree_map(lambda b, x: b.at[dest_rows].set(x, mode="drop"), buf, new)
        return i + 1, jnp.minimum(filled + jnp.sum(keep), b_p), buf

    i, filled, buf = jax.lax.while_loop(cond, body, (jnp.int32(1), jnp.sum(keep), buf))
    return buf, {"training/num_gen_batches": i, "training/filled_groups_ratio": filled / b_p}


def last_token_scores(scores_B, response_mask_BR):
    """token_level_scores [B, R]: the sequence score placed on the last response token whose mask
    is 1 (the last model token of a multi-turn row, whose mask has holes at tool tokens; the
    last valid token of a one-turn row). A row without one gets none."""
    r = response_mask_BR.shape[1]
    last = r - 1 - jnp.argmax(response_mask_BR[:, ::-1] > 0, axis=-1)
    last = jnp.where(jnp.any(response_mask_BR > 0, -1), last, -1)  # one_hot(-1): all zeros
    return jax.nn.one_hot(last, r, dtype=jnp.float32) * scores_B[:, None]
