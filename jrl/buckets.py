"""Response buckets: the scoring and update forwards cost what their longest response needs, not
the padded R (`model.response_buckets`; a role's `jrl.batching.Batching.buckets`).

Rows are ordered by the end of their response (last real position + 1; blocks of `group` rows,
a GRPO group sharing its prompt, move together), so that each micro-batch holds responses of
like length; the longest response of a micro-batch picks the smallest of a few static lengths
(`model.response_buckets`, then R) that holds it, and `lax.switch` runs the forward on the rows
with every response-axis array trimmed to that length; outputs with a response axis are padded
back to R with zeros and put back in row order. Causal attention: positions before the cut never
see those after it, and the positions cut hold no real token (mask 0), so every masked quantity
is the padded path's (float rounding of other shapes and of another summation order apart).

Compiles: each bucket is a branch of one `lax.switch` inside the step's one jit, so a step with
k lengths compiles each wrapped forward (scoring, policy update, critic update) k times: compile
time grows about k-fold for those forwards, still one compile per run; at run time only the
chosen branch runs. Memory is that of the R branch, the largest.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jrl import router_replay

# [rows, P, ...]: never trimmed, nor padded back (inputs, and outputs by these names)
PROMPT_KEYS = ("input_ids", "attention_mask", router_replay.PROMPT)


def bucket_sizes(buckets, r: int) -> tuple[int, ...]:
    """The static response lengths of the switch: the configured ones below R, then R."""
    return tuple(sorted({int(b) for b in buckets if 0 < int(b) < r})) + (r,)


def row_ends(rows) -> jax.Array:
    """[rows] int32: last position holding a response token (`response_mask`, or a multi-turn
    row's `response_valid`) + 1; 0 for an empty response."""
    held = rows["response_mask"] != 0
    if "response_valid" in rows:
        held = held | (rows["response_valid"] != 0)
    return jnp.max(jnp.where(held, jnp.arange(1, held.shape[1] + 1), 0), axis=1)


def trimmed(fn: Callable, rows, sizes: tuple[int, ...]):
    """fn(rows) with the response axis cut to the smallest of `sizes` holding every row's
    response (`lax.switch`); outputs with that axis padded back to R with zeros (but those
    named in PROMPT_KEYS, when fn returns a dict)."""
    r = rows["response_mask"].shape[1]
    if len(sizes) <= 1:
        return fn(rows)

    def branch(width):
        def run(rows):
            cut = {
                k: v if k in PROMPT_KEYS or v.ndim < 2 or v.shape[1] != r else v[:, :width]
                for k, v in rows.items()
            }
            pad = lambda x: (
                jnp.pad(x, [(0, 0), (0, r - width)] + [(0, 0)] * (x.ndim - 2))
                if x.ndim >= 2 and x.shape[1] == width
                else x
            )
            out = fn(cut)
            if isinstance(out, dict):
                return {k: v if k in PROMPT_KEYS else jax.tree.map(pad, v) for k, v in out.items()}
            return jax.tree.map(pad, out)

        return run

    index = jnp.searchsorted(jnp.asarray(sizes), jnp.max(row_ends(rows)))
    return jax.lax.switch(index, [branch(w) for w in sizes], rows)


def length_order(rows, k: int, group: int = 1) -> jax.Array:
    """A row order under which `batching.split_rows(rows[order], k, group)` gives micro-batch i
    the i-th k-quantile of row blocks by response end (blocks of `group` rows move together)."""
    blocks = rows["response_mask"].shape[0] // group
    per_mb = blocks // k
    block_end = jnp.max(row_ends(rows).reshape(blocks, group), axis=1)
    by_end = jnp.argsort(block_end, stable=True)
    slot = jnp.arange(blocks)  # split_rows puts slot j in micro-batch j % k, place j // k
    block_order = by_end[(slot % k) * per_mb + slot // k]
    return (block_order[:, None] * group + jnp.arange(group)).reshape(-1)
