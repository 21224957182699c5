"""Multi-turn metrics from the host's per-row counts, with verl's names where verl has them.

`multi_turn_metrics` takes the step's sums over turns of `TurnResult.stats` and works on numpy or
JAX arrays alike (inside the jitted step, or on the host).
"""

from __future__ import annotations

import jax.numpy as jnp

from jrl.tools.host import STAT_NAMES


def multi_turn_metrics(stats, assistant_turns, response_length) -> dict:
    """The multi-turn metrics of one batch.

    Args:
      stats: [B, S] the per-row stats of every pause, summed (columns `STAT_NAMES`).
      assistant_turns: [B] assistant turns of each row (the one that ended it included).
      response_length: [B] tokens in each row's response, model and tool tokens.

    Returns (verl's names first):
      num_turns/{mean,min,max}: messages per row after the prompt, as verl counts them:
        1 (the prompt) + assistant turns + tool turns.
      tool_call_counts/{mean,min,max}: tool calls per row.
      agent_loop/tool_calls/{mean,min,max}: seconds per row spent in tool calls.
      tool_calls/{errors,timeouts,truncated,budget_truncated}: counts over the batch.
      tool_calls/reward_mean: tools' rewards per row.
      tool_calls/response_token_share: tool tokens / response tokens.
      timing_s/tool_host: wall seconds of the host callbacks.
    """
    stats = jnp.asarray(stats, jnp.float32)
    col = {name: stats[:, i] for i, name in enumerate(STAT_NAMES)}
    turns = 1.0 + jnp.asarray(assistant_turns, jnp.float32) + col["tool_turns"]
    tokens = jnp.asarray(response_length, jnp.float32).sum()
    out = {}
    for name, x in (
        ("num_turns", turns),
        ("tool_call_counts", col["tool_calls"]),
        ("agent_loop/tool_calls", col["tool_seconds"]),
    ):
        out[f"{name}/mean"], out[f"{name}/min"], out[f"{name}/max"] = x.mean(), x.min(), x.max()
    out["tool_calls/errors"] = col["tool_errors"].sum()
    out["tool_calls/timeouts"] = col["tool_timeouts"].sum()
    out["tool_calls/truncated"] = col["tool_truncated"].sum()
    out["tool_calls/budget_truncated"] = col["budget_truncated"].sum()
    out["tool_calls/reward_mean"] = col["tool_reward"].mean()
    out["tool_calls/response_token_share"] = col["tool_tokens"].sum() / jnp.maximum(tokens, 1.0)
    out["timing_s/tool_host"] = col["host_seconds"].sum()
    return out
