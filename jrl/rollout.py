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


class Rollout(NamedTuple):
    response_ids: jax.Array  # [B, R] int32, pad after EOS
    response_mask: jax.Array  # [B, R] int32, 1 up to and including EOS
    log_probs: jax.Array  # [B, R] float32, 0 where masked


def filter_logits(logits_BV, top_k: int = 0, top_p: float = 1.0):
    """Sets logits outside the top-k / nucleus (top-p) support to -inf. 0 / 1.0 switch a filter off.

    Top-p keeps the smallest set of most likely tokens whose probability reaches p (ties with the
    last kept token are kept too); the most likely token is always kept.
    """
    neg_inf = jnp.finfo(logits_BV.dtype).min
    if top_k and top_k < logits_BV.shape[-1]:
        kth = jax.lax.top_k(logits_BV, top_k)[0][..., -1:]
        logits_BV = jnp.where(logits_BV < kth, neg_inf, logits_BV)
    if top_p < 1.0:
        sorted_desc = jnp.sort(logits_BV, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        n_keep = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)  # >= 1
        threshold = jnp.take_along_axis(sorted_desc, n_keep - 1, axis=-1)
        logits_BV = jnp.where(logits_BV < threshold, neg_inf, logits_BV)
    return logits_BV


def sample_token(
    u_B, logits_BV, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, greedy=False
):
    """Draws one token per row by inverse-CDF sampling: row b takes the first token whose
    cumulative probability (of the filtered, temperature-scaled softmax) exceeds its uniform
    u_B[b] in [0, 1). Returns (token [B] int32, log-prob [B] under softmax(logits / T)).

    One uniform per row instead of a Gumbel draw per logit: on XLA:CPU drawing B x V threefry bits
    every decode step cost more than the rest of a small model's step. Tokens outside the
    top-k / top-p support have probability 0 and are never drawn: a float32 prefix sum need not
    be monotone (a token adding 0 can sit one ulp below the one before it, the total one ulp
    above the last token with mass), so only tokens of positive probability are candidates, and
    the last of them is taken when rounding leaves none whose cumulative sum reaches the
    threshold."""
    logits_BV = logits_BV / temperature
    if greedy:
        token = jnp.argmax(logits_BV, axis=-1)
    else:
        kept = filter_logits(logits_BV, top_k, top_p)
        probs = jnp.exp(kept - jnp.max(kept, axis=-1, keepdims=True))  # unnormalised
        cdf = jax.lax.associative_scan(jnp.add, probs, axis=-1)
        threshold = (1.0 - u_B) * cdf[:, -1]  # in (0, total]
        positive = probs > 0
        reached = positive & (cdf >= threshold[:, None])
        last = probs.shape[-1] - 1 - jnp.argmax(positive[:, ::-1], axis=-1)
        token = jnp.where(jnp.any(reached, axis=-1), jnp.argmax(reached, axis=-1), last)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits_BV, -1), token[:, None], -1)[:, 0]
    return token.astype(jnp.int32), logp


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


class Options(NamedTuple):
    """What a decode fixes at trace time: the prompt and response lengths, the token ids that
    end a row, and the sampler's settings (`sample_token`'s)."""

    p: int  # P, prompt slots
    r: int  # R, response slots
    eos_id: int
    pad_id: int
    stop_ids: tuple[int, ...] = ()
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False


class Carry(NamedTuple):
    """The decode loop's carry: token t of the rows is the next to sample."""

    t: jax.Array  # [] int32
    rows: _Rows
    ids: jax.Array  # [B, R] int32: the responses so far, at the original rows
    mask: jax.Array  # [B, R] int32
    logps: jax.Array  # [B, R] float32


def prepare(model_cfg, params):
    """The variables every decode step reads, made ready once before the loop."""
    return transformer.variables(transformer.unstack_layers(model_cfg, params))


def start(model_cfg, variables, prompt_ids_BP, prompt_mask_BP, samples: int, opts: Options):
    """The carry before token 0: the prompts prefilled (`transformer.prefill`), every row live."""
    model = transformer.Transformer(model_cfg)
    pre = transformer.prefill(model, variables, prompt_ids_BP, prompt_mask_BP, samples, opts.r)
    b = prompt_ids_BP.shape[0] * samples
    rows = _Rows(
        None,
        transformer.lm_logits(model_cfg, pre.last.hidden[:, -1], pre.last.head),
        pin(pre.cache),
        jnp.zeros((b,), bool),
        pre.key_valid,
        pre.first_position,
    )
    return Carry(
        jnp.int32(0),
        rows,
        jnp.full((b, opts.r), opts.pad_id, jnp.int32),
        jnp.zeros((b, opts.r), jnp.int32),
        jnp.zeros((b, opts.r), jnp.float32),
    )


def record(opts: Options, uniforms_RB, forced_length_B, carry: Carry):
    """Samples response token t of every live row (pad for a finished one) into the [B, R]
    arrays, at the rows' original rows. Returns (tokens [S], done [S], ids, mask, logps)."""
    t, rows, ids, mask, logps = carry
    of_rows = lambda x_B: x_B if rows.index is None else x_B[rows.index]
    logits_BV = rows.logits
    forced = None
    if forced_length_B is not None:
        forced = _ForcedEos(of_rows(forced_length_B), opts.eos_id, opts.temperature)
        logits_BV = forced.mask_eos(t, logits_BV)
    token, logp = sample_token(
        of_rows(uniforms_RB[t]),
        logits_BV,
        temperature=opts.temperature,
        top_k=opts.top_k,
        top_p=opts.top_p,
        greedy=opts.greedy,
    )
    if forced is not None:
        token, logp = forced.write_eos(t, token, rows.logits)
    live = ~rows.done
    token = jnp.where(live, token, opts.pad_id)
    at = (slice(None) if rows.index is None else rows.index, t)
    ids = ids.at[at].set(token)
    mask = mask.at[at].set(live.astype(jnp.int32))
    logps = logps.at[at].set(jnp.where(live, logp, 0.0))
    stop = token == opts.eos_id
    for stop_id in opts.stop_ids:  # a few static ids (rollout.stop)
        stop = stop | (token == stop_id)
    return token, rows.done | stop, ids, mask, logps


def decode_step(model_cfg, variables, uniforms_RB, forced_length_B, opts: Options, carry: Carry):
    """One decode step, the body of the decode loop: token t of every row sampled and recorded
    (`record`), then its forward, which writes its keys / values into the cache and gives the
    logits of token t + 1."""
    p = opts.p
    token, done, ids, mask, logps = record(opts, uniforms_RB, forced_length_B, carry)
    t, rows = carry.t, carry.rows
    slots = jnp.arange(p + opts.r)
    # the real prompt slots and the response slots written so far (this token's included)
    step_mask = rows.key_valid[:, None, :] & (slots <= p + t)[None, None, :]
    pos = (rows.first_position + t)[:, None]
    model = transformer.Transformer(model_cfg)
    out = model.apply(variables, token[:, None], pos, step_mask, rows.cache, p + t)
    logits = transformer.lm_logits(model_cfg, out.hidden[:, -1], out.head)
    rows = rows._replace(logits=logits, cache=pin(out.cache), done=done)
    return Carry(t + 1, rows, ids, mask, logps)


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
    prompts, p = prompt_ids_BP.shape
    b, r = prompts * samples, max_new_tokens
    opts = Options(p, r, eos_id, pad_id, tuple(stop_ids), temperature, top_k, top_p, greedy)
    variables = prepare(model_cfg, params)  # once, outside the decode loop
    uniforms_RB = jax.random.uniform(key, (r, b))  # every step's draws at once, before the loop
    forced = None if forced_length is None else jnp.asarray(forced_length, jnp.int32)
    step = lambda carry: decode_step(model_cfg, variables, uniforms_RB, forced, opts, carry)

    # The loops sample tokens 0 .. R-2, each followed by its forward (the next token's logits);
    # the last token needs no forward, so it is sampled after the loop (after each stage's loop).
    def decode_stage(carry: Carry, next_size: int) -> Carry:
        """Decodes the carry's rows until every row has ended, t = R - 1, or (next_size > 0) no
        more rows are live than the next stage holds."""

        def cond(carry):
            live = jnp.sum(~carry.rows.done)
            return (carry.t < r - 1) & (live > next_size if next_size else live > 0)

        return jax.lax.while_loop(cond, step, carry)

    shards = partitioning.context_shards("batch")
    stages = decode_stages(b, shards, compact_min_rows) if compact_min_rows > 0 else (b,)
    carry = start(model_cfg, variables, prompt_ids_BP, prompt_mask_BP, samples, opts)
    for i, size in enumerate(stages):
        if i:  # the live rows move into a batch of `size` rows
            rows = _compact(carry.rows, size)
            carry = carry._replace(rows=rows._replace(cache=pin(rows.cache)))
        next_size = stages[i + 1] if i + 1 < len(stages) else 0
        carry = decode_stage(carry, next_size)
        # Token t of the stage's rows: the last token when t = R - 1 (a stage that stops there
        # may hold more live rows than the next one), pads over pads when every row has ended.
        # When a next stage goes on, it samples token t again, the same way.
        _, _, ids, mask, logps = record(opts, uniforms_RB, forced, carry)
        carry = carry._replace(ids=ids, mask=mask, logps=logps)
    return Rollout(carry.ids, carry.mask, carry.logps)
