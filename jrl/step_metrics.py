"""The scored batch's metrics, with verl's names (docs/design.md#where-metrics-come-from):
scores, rewards, advantages, returns, values, lengths, and a multi-turn batch's turns and tool
calls. Each is a scalar built on the device; the host reads them once per step."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl.algos import group_ppo as group_lib
from jrl.tools.metrics import multi_turn_metrics


def stats(name, x, mask=None):
    """verl-style mean / max / min of x over valid entries."""
    if mask is None:
        mask = jnp.ones_like(x)
    mask = mask.astype(bool)
    big = jnp.finfo(jnp.float32).max
    return {
        f"{name}/mean": jnp.sum(jnp.where(mask, x, 0)) / jnp.maximum(jnp.sum(mask), 1),
        f"{name}/max": jnp.max(jnp.where(mask, x, -big)),
        f"{name}/min": jnp.min(jnp.where(mask, x, big)),
    }


def experience_metrics(exp: dict, max_new_tokens: int) -> dict[str, jax.Array]:
    """verl's data metrics of a scored batch: scores, rewards, advantages, returns, values,
    lengths; and a multi-turn batch's turns and tool calls (`multi_turn_metrics`). Lengths count
    every response token, tool tokens included (verl's, from the attention mask); rewards are
    each row's sum; advantages, returns and values are over model tokens left after rollout
    correction's rejection (`policy_mask`; verl's response_mask at that point)."""
    mask = exp["response_mask"]
    kept = exp.get("policy_mask", mask)
    length = jnp.sum(exp.get("response_valid", mask), -1)
    prompt_length = jnp.sum(exp["attention_mask"], -1)
    metrics = {}
    metrics.update(stats("critic/score", exp["scores"]))
    metrics.update(stats("critic/rewards", jnp.sum(exp["token_level_rewards"] * mask, -1)))
    metrics.update(stats("critic/advantages", exp["advantages"], kept))
    metrics.update(stats("critic/returns", exp["returns"], kept))
    if "values" in exp:
        metrics.update(stats("critic/values", exp["values"], kept))
        metrics["critic/vf_explained_var"] = group_lib.explained_variance(
            exp["returns"], exp["values"], kept
        )
    metrics.update(stats("response_length", length.astype(jnp.float32)))
    metrics.update(stats("prompt_length", prompt_length.astype(jnp.float32)))
    metrics["response_length/clip_ratio"] = jnp.mean(length >= max_new_tokens)
    metrics["perf/total_num_tokens"] = jnp.sum(length) + jnp.sum(prompt_length)
    if "tool_stats" in exp:
        metrics.update(multi_turn_metrics(exp["tool_stats"], exp["assistant_turns"], length))
    return metrics
