"""Exact-match reward for the arithmetic task, in JAX on token ids (runs inside the jitted step)."""

import chex
import jax.numpy as jnp


def exact_match(response_ids, response_mask, answer_ids, answer_len, *, eos_id: int):
    """1.0 where the response is exactly the answer followed by eos, else 0.0.

    Row b scores 1 iff, with L = answer_len[b]: response_ids[b, :L] == answer_ids[b, :L],
    response_ids[b, L] == eos_id, and response_mask[b, :L+1] is all 1 (so L < R). Tokens after
    position L are ignored (garbage after eos does not matter); a row without eos at L scores 0.

    Args:
      response_ids: [B, R] int, sampled tokens.
      response_mask: [B, R], 1 up to and including the first eos, 0 after.
      answer_ids: [B, R_a] int, answer tokens from position 0 (R_a may differ from R).
      answer_len: [B] int, number of answer tokens, eos excluded.
      eos_id: the eos token id (static).

    Returns:
      scores: [B] float32.
    """
    chex.assert_rank([response_ids, response_mask, answer_ids, answer_len], [2, 2, 2, 1])
    chex.assert_equal_shape([response_ids, response_mask])
    chex.assert_equal_shape_prefix([response_ids, answer_ids, answer_len], 1)
    r, r_a = response_ids.shape[1], answer_ids.shape[1]
    answer_ids = jnp.asarray(answer_ids)
    if r_a > r:
        answer_ids = answer_ids[:, :r]  # an answer this long cannot fit anyway: L >= R scores 0
    elif r_a < r:
        answer_ids = jnp.pad(answer_ids, ((0, 0), (0, r - r_a)), constant_values=-1)
    t = jnp.arange(r)[None, :]  # [1, R]
    n = jnp.asarray(answer_len)[:, None]  # [B, 1]
    expected = jnp.where(t < n, answer_ids, eos_id)  # [B, R]
    ok = (response_ids == expected) & (jnp.asarray(response_mask) > 0)
    match = jnp.all(ok | (t > n), axis=1) & (n[:, 0] < r)
    return match.astype(jnp.float32)


def arithmetic_exact_match(batch, response_ids, response_mask, *, eos_id: int):
    """Registry form of `exact_match`: `batch` has `answer_ids` [B, R_a] and `answer_len` [B]."""
    return exact_match(
        response_ids, response_mask, batch["answer_ids"], batch["answer_len"], eos_id=eos_id
    )


def first_line(responses, ground_truths) -> list[float]:
    """Host reward "first_line": 1.0 when a response's text before its first newline (all of
    it when it has none) equals the ground truth exactly, else 0.0."""
    return [float(r.split("\n", 1)[0] == g) for r, g in zip(responses, ground_truths)]


def final_answer_match(response_ids, response_mask, answer_ids, answer_len, *, eos_id: int):
    """`exact_match` of the tokens `response_mask` marks, moved to the front: the reward of the
    `tool_arith` task, which the step hands the model's final turn of a multi-turn response (its
    tokens after the last tool block: `jrl.shaping.final_turn_mask`), so `<37*48>=1776;1776<eos>`
    scores 1 for 1776 on the model's `1776<eos>`, never on the tool's `=1776;`. A response
    without a tool block is scored as by `exact_match`. Arguments as there."""
    chex.assert_rank([response_ids, response_mask], [2, 2])
    chex.assert_equal_shape([response_ids, response_mask])
    ids, mask = jnp.asarray(response_ids), jnp.asarray(response_mask) > 0
    r = ids.shape[1]
    t = jnp.arange(r)[None, :]  # [1, R]
    start = jnp.argmax(mask, axis=1)[:, None]  # the final turn's first token (0 if none)
    src = jnp.minimum(start + t, r - 1)  # [B, R]: the final turn moved to position 0
    shifted_ids = jnp.take_along_axis(ids, src, axis=1)
    shifted_mask = jnp.take_along_axis(mask, src, axis=1) & (start + t < r)
    return exact_match(
        shifted_ids, shifted_mask.astype(jnp.int32), answer_ids, answer_len, eos_id=eos_id
    )


def arithmetic_final_answer(batch, response_ids, response_mask, *, eos_id: int):
    """Registry form of `final_answer_match` (the `tool_arith` task's reward): `batch` has
    `answer_ids` and `answer_len`."""
    return final_answer_match(
        response_ids, response_mask, batch["answer_ids"], batch["answer_len"], eos_id=eos_id
    )
