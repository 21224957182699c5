"""Rollout: jitted prefill + KV-cache decode with temperature / top-k / top-p and per-row EOS stop.

Layout (docs/design.md#padding-and-cache-slots): prompts are left-padded to P, responses
right-padded to R. The cache has P + R slots; prompt token j sits in slot j, response token t in
slot P + t. Position ids skip the left padding, so a row's tokens are numbered 0, 1, 2, ...
whatever its padding.

`response_mask[:, t]` is 1 up to and including the first EOS (or `stop_ids` token) and 0 after
it; `log_probs[:, t]` is log pi(y_t | prompt, y_<t) under the temperature-scaled (but not top-k /
top-p filtered) policy, the same quantity the update recomputes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrl import partitioning
from jrl.models import transformer
from jrl.sampling import filter_logits, sample_token  # noqa: F401 (rollout.sample_token)


class Rollout(NamedTuple):
    response_ids: jax.Array  # [B, R] int32, pad after EOS
    response_mask: jax.Array  # [B, R] int32, 1 up to and including EOS
    log_probs: jax.Array  # [B, R] float32, 0 where masked


class _ForcedEos(NamedTuple):
    """`generate`'s `forced_length`: EOS masked out before a row's length, written at it."""

    length_B: jax.Array  # [B] int32
    eos_id: int
    temperature: float

    def mask_eos(self, t, logits_BV):
        early = (t < self.length_B - 1)[:, None] & (jnp.arange(logits_BV.shape[-1]) == self.eos_id)
        return jnp.where(early, jnp.finfo(logits_BV.dtype).min, logits_BV)

    def write_eos(self, t, token_B, logits_BV):
        token_B = jnp.where(t == self.length_B - 1, self.eos_id, token_B).astype(jnp.int32)
        logp_BV = jax.nn.log_softmax(logits_BV / self.temperature, -1)
        return token_B, jnp.take_along_axis(logp_BV, token_B[:, None], -1)[:, 0]


MAX_DECODE_STAGES = 4  # each stage compiles the decode step once more


def decode_stages(rows: int, shards: int = 1, min_rows: int = 16) -> tuple[int, ...]:
    """The static batch sizes of a compacted decode's stages: `rows`, then halvings while the half
    is at least `min_rows` and a multiple of `shards` (the mesh's batch shards, so that every
    stage's rows still split evenly over them); at most `MAX_DECODE_STAGES` sizes. (rows,) when
    `rows` is too small to halve: one stage, the plain decode."""
    sizes = [rows]
    while len(sizes) < MAX_DECODE_STAGES and sizes[-1] % 2 == 0:
        half = sizes[-1] // 2
        if half < max(min_rows, 1) or half % shards:
            break
        sizes.append(half)
    return tuple(sizes)


class _Rows(NamedTuple):
    """The rows a decode stage runs, with everything it reads of them."""

    index: jax.Array | None  # [S] int32: each row's original row (None: all B rows, in order)
    logits: jax.Array  # [S, V]: the logits of each row's next token
    cache: tuple  # the KV cache of the S rows (transformer.init_cache's layout)
    done: jax.Array  # [S] bool: the row has ended (EOS or a stop id)
    key_valid: jax.Array  # [S, P + R] bool: real prompt slots, then every response slot
    first_position: jax.Array  # [S] int32: the position id of response token 0


def _compact(rows: _Rows, size: int) -> _Rows:
    """The `size` rows the next stage runs: every live row (at most `size` of them), then
    finished rows to fill the static size, each with its original row index."""
    keep = jnp.argsort(rows.done.astype(jnp.int32), stable=True)[:size]  # live rows first
    take = lambda x: x[keep]
    return _Rows(
        keep if rows.index is None else rows.index[keep],
        take(rows.logits),
        jax.tree.map(take, rows.cache),
        take(rows.done),
        take(rows.key_valid),
        take(rows.first_position),
    )


def pin(cache):
    """Under a mesh (jax.set_mesh), the cache's rows follow the batch and its kv heads the tensor
    axis, as the attention weights do; the decode loops keep that layout."""
    return partitioning.constrain(cache, partitioning.CACHE_AXES)


def prefilled(model_cfg, params, prompt_ids_BP, prompt_mask_BP, samples: int, r: int):
    """A decode's start: (model, variables, prefill, logits of each row's first response token).
    The prefill computes the keys / values of every prompt token once per prompt and copies them
    into its `samples` rows' cache with the `r` response slots appended."""
    model = transformer.Transformer(model_cfg)
    params = transformer.unstack_layers(model_cfg, params)  # once, outside the decode loop
    variables = transformer.variables(params)
    pre = transformer.prefill(model, variables, prompt_ids_BP, prompt_mask_BP, samples, r)
    last_logits = transformer.lm_logits(model_cfg, pre.last.hidden[:, -1], pre.last.head)
    return model, variables, pre, last_logits


def generate(
    model_cfg: transformer.ModelConfig,
    params,
    prompt_ids_BP,
    prompt_mask_BP,
    key,
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    samples: int = 1,
    stop_ids: tuple[int, ...] = (),
    forced_length=None,
    compact_min_rows: int = 0,
) -> Rollout:
    """Samples up to `max_new_tokens` tokens for every prompt row; stops once every row hit EOS.
    `stop_ids` are more tokens that end a row as EOS does (kept in the response and its mask).

    With `samples` = n > 1 the prompt arrays hold each prompt once and every prompt gets n
    consecutive rows (`jnp.repeat` order, B = n x the prompts): a prompt's keys and values are
    computed once and copied into its n rows' cache (a group's samples share the prompt).

    `compact_min_rows` > 0 (rollout.compact_decode): the decode runs in stages of B, B/2, B/4, ...
    rows (`decode_stages`, none smaller than `compact_min_rows`); a stage runs while more rows are
    live than the next one holds, then the live rows move into the next, smaller batch (their
    caches gathered), so the decode's cost follows the rows still running instead of B rows until
    the longest ends. The same tokens and log-probs as without (each row draws its own uniforms,
    written at its original row). 0: B rows throughout.

    `forced_length` ([B] int, 1..R; the benchmark's fixed response lengths, `jrl.run.benchmark`):
    row b never samples EOS before token `forced_length[b] - 1` and emits EOS there, so its
    response is exactly that long whatever the model samples. Its `log_probs` are the policy's
    (unmasked) log-probs of the tokens written. None: plain sampling."""
    model, variables, pre, last_logits = prefilled(
        model_cfg, params, prompt_ids_BP, prompt_mask_BP, samples, max_new_tokens
    )
    prompts, p = prompt_ids_BP.shape
    b, r = prompts * samples, max_new_tokens
    slots = jnp.arange(p + r)

    uniforms_RB = jax.random.uniform(key, (r, b))  # every step's draws at once, before the loop
    if forced_length is not None:
        forced = _ForcedEos(jnp.asarray(forced_length, jnp.int32), eos_id, temperature)

    def record(t, rows: _Rows, ids, mask, logps):
        """Samples response token t of every live row (pad for a finished one) into the [B, R]
        arrays, at the rows' original rows. Returns (tokens [S], done [S], ids, mask, logps)."""
        of_rows = lambda x_B: x_B if rows.index is None else x_B[rows.index]
        logits_BV = rows.logits
        if forced_length is not None:
            row_forced = forced._replace(length_B=of_rows(forced.length_B))
        sample_logits = logits_BV if forced_length is None else row_forced.mask_eos(t, logits_BV)
        token, logp = sample_token(
            of_rows(uniforms_RB[t]),
            sample_logits,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            greedy=greedy,
        )
        if forced_length is not None:
            token, logp = row_forced.write_eos(t, token, logits_BV)
        live = ~rows.done
        token = jnp.where(live, token, pad_id)
        at = (slice(None) if rows.index is None else rows.index, t)
        ids = ids.at[at].set(token)
        mask = mask.at[at].set(live.astype(jnp.int32))
        logps = logps.at[at].set(jnp.where(live, logp, 0.0))
        stop = token == eos_id
        for stop_id in stop_ids:  # a few static ids (rollout.stop)
            stop = stop | (token == stop_id)
        return token, rows.done | stop, ids, mask, logps

    # The loops sample tokens 0 .. R-2, each followed by its forward (the next token's logits);
    # the last token needs no forward, so it is sampled after the loop (after each stage's loop).
    def decode_stage(carry, next_size: int):
        """Decodes the carry's rows until every row has ended, t = R - 1, or (next_size > 0) no
        more rows are live than the next stage holds."""

        def cond(carry):
            t, rows, *_ = carry
            live = jnp.sum(~rows.done)
            return (t < r - 1) & (live > next_size if next_size else live > 0)

        def body(carry):
            t, rows, ids, mask, logps = carry
            token, done, ids, mask, logps = record(t, rows, ids, mask, logps)
            # the real prompt slots and the response slots written so far (this token's included)
            step_mask = rows.key_valid[:, None, :] & (slots <= p + t)[None, None, :]
            pos = (rows.first_position + t)[:, None]
            out = model.apply(variables, token[:, None], pos, step_mask, rows.cache, p + t)
            logits = transformer.lm_logits(model_cfg, out.hidden[:, -1], out.head)
            rows = rows._replace(logits=logits, cache=pin(out.cache), done=done)
            return t + 1, rows, ids, mask, logps

        return jax.lax.while_loop(cond, body, carry)

    shards = partitioning.context_shards("batch")
    stages = decode_stages(b, shards, compact_min_rows) if compact_min_rows > 0 else (b,)
    rows = _Rows(
        None,
        last_logits,
        pin(pre.cache),
        jnp.zeros((b,), bool),
        pre.key_valid,
        pre.first_position,
    )
    carry = (
        jnp.int32(0),
        rows,
        jnp.full((b, r), pad_id, jnp.int32),
        jnp.zeros((b, r), jnp.int32),
        jnp.zeros((b, r), jnp.float32),
    )
    for i, size in enumerate(stages):
        t, rows, *outputs = carry
        if i:  # the live rows move into a batch of `size` rows
            rows = _compact(rows, size)
            rows = rows._replace(cache=pin(rows.cache))
        next_size = stages[i + 1] if i + 1 < len(stages) else 0
        t, rows, *outputs = decode_stage((t, rows, *outputs), next_size)
        # Token t of the stage's rows: the last token when t = R - 1 (a stage that stops there
        # may hold more live rows than the next one), pads over pads when every row has ended.
        # When a next stage goes on, it samples token t again, the same way.
        *_, ids, mask, logps = record(t, rows, *outputs)
        carry = (t, rows, ids, mask, logps)
    return Rollout(ids, mask, logps)
