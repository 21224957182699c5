"""Rollout: jitted prefill + KV-cache decode with temperature / top-k / top-p and per-row EOS stop.

Layout (docs/design.md#padding-and-cache-slots): prompts are left-padded to P, responses
right-padded to R. The cache has P + R slots; prompt token j sits in slot j, response token t in
slot P + t. Position ids skip the left padding, so a row's tokens are numbered 0, 1, 2, ...
whatever its padding.

`response_mask[:, t]` is 1 up to and including the first EOS (or `stop_ids` token, or the token
whose bytes complete one of `stop_strings`) and 0 after it; `log_probs[:, t]` is
log pi(y_t | prompt, y_<t) under the temperature-scaled (but not top-k / top-p filtered) policy,
the same quantity the update recomputes.

With `record_experts` (routing replay R3, `jrl.router_replay`) a mixture-of-experts model's
rollout also returns each token's experts in every sparse layer: the prefill's for the prompt,
each decode step's forward for the token it feeds (`Carry.experts`, at the original rows, so
compaction leaves them in place); -1 where no forward ran (the last slot's token).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from jrl import partitioning
from jrl import router_replay
from jrl.models import attention, transformer
from jrl.sampling import filter_logits, sample_token  # noqa: F401 (rollout.sample_token)


class Rollout(NamedTuple):
    response_ids: jax.Array  # [B, R] int32, pad after EOS
    response_mask: jax.Array  # [B, R] int32, 1 up to and including EOS
    log_probs: jax.Array  # [B, R] float32, 0 where masked
    # with record_experts: `Recorded` (the experts of every token, `jrl.router_replay`); else None
    experts: Recorded | None = None


class Recorded(NamedTuple):
    """Each token's experts in the S sparse layers (top k, `jrl.router_replay`'s layout)."""

    prompt: jax.Array  # [B, P, S, k]: the prefill's, each prompt's copied to its rows
    response: jax.Array  # [B, R, S, k]: each decode step's for the token it forwards; -1: none


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


class Options(NamedTuple):
    """What a decode fixes at trace time: the prompt and response lengths, the token ids and
    stop strings that end (or, with `per_row`, pause) a row, and the sampler's settings
    (`sample_token`'s). `per_row`: each row writes at its own response slot (`_Rows.length`), as
    the multi-turn rollout's rows do; else every live row writes at slot t."""

    p: int  # P, prompt slots
    r: int  # R, response slots
    eos_id: int
    pad_id: int
    stop_ids: tuple[int, ...] = ()
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    per_row: bool = False
    # `jrl.stop_strings.StopStrings`: a row stops at the token whose bytes complete one of its
    # strings in the text of the row's current turn (a byte tail per row, `_Rows.tail`); None: off
    stop_strings: Any = None
    record_experts: bool = False  # record each token's experts (`Carry.experts`; R3 replay)
    # with samples > 1, read each prompt's keys / values once per group (`start`); see
    # `shares_prompt` for the default
    shared_prompt: bool = True


def shares_prompt(model_cfg, p: int, r: int, backend: str | None = None) -> bool:
    """Whether a decode of P prompt slots and R response slots reads each prompt once per group
    (`Options.shared_prompt`): always off XLA:CPU (it reads fewer bytes); on XLA:CPU only when
    the P + R slots exceed what `decode_attention` reads in one materialised pass (a quarter
    attention block, `attention.one_pass_slots`). Within it the second segment costs more
    operations than the reads it saves: W2's rollout (R = 64) took 1.7x as long shared at
    P + R = 128; past it the rows' cache is read in a loop and sharing won: 0.78x / 0.70x /
    0.76x at P + R = 160 / 192 / 320 (docs/performance.md, "Rollout time")."""
    if (backend or jax.default_backend()) != "cpu":
        return True
    return p + r > attention.one_pass_slots(model_cfg.attention_block_size)


class Draws(NamedTuple):
    """What sampling reads besides the logits: each (row, response slot)'s uniform, drawn once
    before the loop, and the forcing options of the benchmark and the tests."""

    uniforms_RB: jax.Array  # [R, B] float32: the uniform of response slot t of row b
    forced_length: jax.Array | None = None  # [B] int32: `generate`'s forced_length
    force_ids: jax.Array | None = None  # [B, R] int32: where >= 0, the token at that slot


class _Rows(NamedTuple):
    """The rows a decode stage runs, with everything it reads of them."""

    index: jax.Array | None  # [S] int32: each row's original row (None: all B rows, in order)
    logits: jax.Array  # [S, V]: the logits of each row's next token
    cache: tuple  # the KV cache of the S rows (`start`: with the shared prompt until compacted)
    done: jax.Array  # [S] bool: the row has ended
    key_valid: jax.Array  # [S, P + R] bool: real prompt slots, then every response slot
    first_position: jax.Array  # [S] int32: the position id of response token 0
    length: jax.Array  # [S] int32: response slots filled (the next token's slot)
    tail: jax.Array | None = None  # [S, W] uint8: the turn's last bytes (Options.stop_strings)


class Carry(NamedTuple):
    """The decode loop's carry."""

    t: jax.Array  # [] int32: decode steps taken (without per_row: every live row's next slot)
    rows: _Rows
    ids: jax.Array  # [B, R] int32: the responses so far, at the original rows
    mask: jax.Array  # [B, R] int32: 1 on sampled tokens
    logps: jax.Array  # [B, R] float32
    turn: Any = None  # the turn hook's state (multi-turn); None without one
    experts: Recorded | None = None  # with Options.record_experts: at the original rows


def when(pred, fn, operand):
    """fn(operand) if pred else operand, as a `while_loop` of 0 or 1 trips: XLA updates a loop's
    carry in place, where `lax.cond` copied every operand it passes through (the whole KV
    cache)."""
    return jax.lax.while_loop(lambda c: c[0], lambda c: (False, fn(c[1])), (pred, operand))[1]


def _compact(rows: _Rows, size: int) -> _Rows:
    """The `size` rows the next stage runs: every live row (at most `size` of them), then
    finished rows to fill the static size, each with its original row index."""
    keep = jnp.argsort(rows.done.astype(jnp.int32), stable=True)[:size]  # live rows first
    index = keep if rows.index is None else rows.index[keep]
    # the rows leave their groups' order: each reads its prompt from its own cache from now on
    cache = transformer.cache_rows(rows.cache, keep)
    rows = rows._replace(index=None, cache=None)
    return jax.tree.map(lambda x: x[keep], rows)._replace(index=index, cache=cache)


def pin(cache):
    """Under a mesh (jax.set_mesh), the cache's rows follow the batch and its kv heads the tensor
    axis, as the attention weights do; the decode loops keep that layout. (A stacked cache's
    layers, `scan_cached_layers`, are not split.)"""
    axes = partitioning.CACHE_AXES
    if isinstance(cache, dict):
        return partitioning.constrain(cache, P(None, *axes))
    return partitioning.constrain(cache, axes)


def prepare(model_cfg, params):
    """The variables every decode step reads, made ready once before the loop: the stacked
    layers split, the matrices cast to the compute dtype (`transformer.unstack_layers`), the
    experts' LoRA adapters folded into their weights (`transformer.fold_expert_adapters`)."""
    params = transformer.fold_expert_adapters(model_cfg, params)
    split = not model_cfg.scan_cached_layers  # a scan over the layers reads the stack
    return transformer.variables(transformer.unstack_layers(model_cfg, params, split=split))


def start(model_cfg, variables, prompt_ids_BP, prompt_mask_BP, samples: int, opts: Options):
    """The carry before token 0: the prompts prefilled once each (`transformer.prefill`, their
    keys / values copied into their `samples` rows' cache), every row live. With samples > 1
    and `opts.shared_prompt` the decode attention reads each prompt's keys / values once for
    its rows (`transformer.with_shared_prompt`) until the rows are compacted."""
    model = transformer.Transformer(model_cfg, decode=True)
    pre = transformer.prefill(model, variables, prompt_ids_BP, prompt_mask_BP, samples, opts.r)
    b = prompt_ids_BP.shape[0] * samples
    cache = pre.cache
    if samples > 1 and opts.shared_prompt:
        cache = transformer.with_shared_prompt(cache, pre.prompt_cache)
    rows = _Rows(
        None,
        transformer.lm_logits(model_cfg, pre.last.hidden[:, -1], pre.last.head, decode=True),
        pin(cache),
        jnp.zeros((b,), bool),
        pre.key_valid,
        pre.first_position,
        jnp.zeros((b,), jnp.int32),
        None if opts.stop_strings is None else opts.stop_strings.init(b),
    )
    experts = None
    if opts.record_experts:  # the prompts' experts per row; no response token forwarded yet
        prompt = router_replay.rows_first(pre.routing.experts, model_cfg.num_experts)
        response = router_replay.unrecorded(b, opts.r, model_cfg)
        experts = Recorded(jnp.repeat(prompt, samples, axis=0), response)
    return Carry(
        jnp.int32(0),
        rows,
        jnp.full((b, opts.r), opts.pad_id, jnp.int32),
        jnp.zeros((b, opts.r), jnp.int32),
        jnp.zeros((b, opts.r), jnp.float32),
        experts=experts,
    )


def _slot(opts: Options, carry: Carry):
    """The response slot of each row's next token: [S] with per_row, else t."""
    return carry.rows.length if opts.per_row else carry.t


def record(opts: Options, draws: Draws, carry: Carry):
    """Samples the next token of every live row (pad for a finished one) at its response slot
    into the [B, R] arrays, at the rows' original rows; nothing else moves. Returns (tokens [S],
    stopped [S]: live rows whose token is EOS or a stop id, carry)."""
    rows = carry.rows
    slot = _slot(opts, carry)
    rows_b = jnp.arange(rows.done.shape[0]) if rows.index is None else rows.index
    logits_BV = rows.logits
    if draws.forced_length is not None:
        early = (slot < draws.forced_length[rows_b] - 1)[:, None]
        eos = jnp.arange(logits_BV.shape[-1]) == opts.eos_id
        logits_BV = jnp.where(early & eos, jnp.finfo(logits_BV.dtype).min, logits_BV)
    token, logp = sample_token(
        draws.uniforms_RB[jnp.minimum(slot, opts.r - 1), rows_b],
        logits_BV,
        temperature=opts.temperature,
        top_k=opts.top_k,
        top_p=opts.top_p,
        greedy=opts.greedy,
    )
    forced = None
    if draws.forced_length is not None:  # EOS written at the row's length
        forced = jnp.where(slot == draws.forced_length[rows_b] - 1, opts.eos_id, -1)
    if draws.force_ids is not None:
        forced = draws.force_ids[rows_b, jnp.minimum(slot, opts.r - 1)]
    if forced is not None:  # the policy's own log-prob of the forced token
        token = jnp.where(forced >= 0, forced, token).astype(jnp.int32)
        logp_BV = jax.nn.log_softmax(rows.logits / opts.temperature, -1)
        logp = jnp.take_along_axis(logp_BV, token[:, None], -1)[:, 0]
    live = ~rows.done
    token = jnp.where(live, token, opts.pad_id)
    at = (rows_b, jnp.where(live, slot, opts.r))  # a finished row writes nothing (dropped)
    put = lambda arr, x: arr.at[at].set(x.astype(arr.dtype), mode="drop")
    carry = carry._replace(
        ids=put(carry.ids, token),
        mask=put(carry.mask, jnp.ones_like(token)),
        logps=put(carry.logps, logp),
    )
    stop = token == opts.eos_id
    for stop_id in opts.stop_ids:  # a few static ids (rollout.stop, the host's stop ids)
        stop = stop | (token == stop_id)
    return token, live & stop, carry


def forward(model_cfg, variables, opts: Options, rows: _Rows, ids_SL, start, write):
    """`ids_SL` [S, L] at response slots start + l of each row (`start` a scalar or [S]): their
    keys / values written into the cache where `write` (a scalar True, or [S] bool: a row's
    write is dropped where False), their attention over the real prompt slots and the response
    slots up to their own, blockwise up to the last one (`transformer._masked_attention`).
    Returns the model's `Output`."""
    p, r = opts.p, opts.r
    l = ids_SL.shape[1]
    positions = (rows.first_position + start)[..., None] + jnp.arange(l)
    positions = jnp.broadcast_to(positions, ids_SL.shape)
    index = p + start if jnp.ndim(write) == 0 else jnp.where(write, p + start, p + r)
    model = transformer.Transformer(model_cfg, decode=True)
    return model.apply(variables, ids_SL, positions, rows.key_valid, rows.cache, index)


def decode_step(model_cfg, variables, draws: Draws, opts: Options, carry: Carry):
    """One decode step: the next token of every live row sampled and recorded (`record`), its
    bytes added to the row's tail (`opts.stop_strings`), then its forward, which writes its keys
    / values into the cache and gives the logits of the token after it. Returns (carry, stopped
    [S]: the live rows whose token is EOS or a stop id or completes a stop string; what ends or
    pauses them is the caller's: `end_stopped` or a turn hook)."""
    token, stopped, carry = record(opts, draws, carry)
    rows = carry.rows
    live = ~rows.done
    if opts.stop_strings is not None:  # here, not in `record`: a stage's last token is redrawn
        tail, hit = opts.stop_strings.step(rows.tail, token)
        stopped = stopped | (live & hit)
        rows = rows._replace(tail=jnp.where(live[:, None], tail, rows.tail))
    slot = _slot(opts, carry)
    out = forward(
        model_cfg, variables, opts, rows, token[:, None], slot, live if opts.per_row else True
    )
    if opts.record_experts:  # the forwarded token's experts, at its row and slot
        rows_b = jnp.arange(live.shape[0]) if rows.index is None else rows.index
        response = router_replay.write_experts(
            carry.experts.response, rows_b, slot, out.routing.experts, live.astype(jnp.int32)
        )
        carry = carry._replace(experts=carry.experts._replace(response=response))
    length = rows.length + live.astype(jnp.int32)
    rows = rows._replace(
        logits=transformer.lm_logits(model_cfg, out.hidden[:, -1], out.head, decode=True),
        cache=pin(out.cache),
        length=length,
        done=rows.done | (length >= opts.r),
    )
    return carry._replace(t=carry.t + 1, rows=rows), stopped


def end_stopped(carry: Carry, stopped) -> Carry:
    """The one-turn rollout's turn hook: a row ends at EOS, a stop id or a stop string."""
    return carry._replace(rows=carry.rows._replace(done=carry.rows.done | stopped))


def decode_body(model_cfg, variables, draws, opts, carry, hook=end_stopped) -> Carry:
    """The decode loop's body: `decode_step`, then `hook(carry, stopped)` (`end_stopped`; the
    multi-turn rollout's turn)."""
    return hook(*decode_step(model_cfg, variables, draws, opts, carry))


def decode_loop(model_cfg, variables, draws, opts, carry, hook=end_stopped, next_size: int = 0):
    """Decodes the carry's rows until no live row has a response slot before the last one, or
    (next_size > 0) no more rows are live than the next stage holds. The last slot's token needs
    no forward: `record` samples it after the loop."""

    def cond(carry):
        live = ~carry.rows.done
        going = jnp.any(live & (_slot(opts, carry) < opts.r - 1))
        return going & (jnp.sum(live) > next_size) if next_size else going

    body = lambda carry: decode_body(model_cfg, variables, draws, opts, carry, hook)
    return jax.lax.while_loop(cond, body, carry)


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
    stop_strings=None,
    forced_length=None,
    force_ids=None,
    compact_min_rows: int = 0,
    record_experts: bool = False,
    shared_prompt: bool | None = None,
) -> Rollout:
    """Samples up to `max_new_tokens` tokens for every prompt row; stops once every row hit EOS.
    `stop_ids` are more tokens that end a row as EOS does (kept in the response and its mask).
    `stop_strings` (`jrl.stop_strings.StopStrings`, rollout.stop's strings): a row ends at the
    token whose bytes complete one of them in the row's response text, however the tokens spell
    it (kept, with any text after the string in the same token).

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
    (unmasked) log-probs of the tokens written. None: plain sampling. `force_ids` ([B, R] int32
    or None, for scripted tests): where >= 0, the token at that response slot is this id instead
    of a draw; its log-prob is still the policy's.

    `record_experts` (a model with experts; routing replay R3): `Rollout.experts` holds every
    token's experts (see the module docstring)."""
    prompts, p = prompt_ids_BP.shape
    b, r = prompts * samples, max_new_tokens
    opts = Options(p, r, eos_id, pad_id, tuple(stop_ids), temperature, top_k, top_p, greedy)
    opts = opts._replace(
        stop_strings=stop_strings,
        record_experts=record_experts,
        shared_prompt=shares_prompt(model_cfg, p, r) if shared_prompt is None else shared_prompt,
    )
    variables = prepare(model_cfg, params)  # once, outside the decode loop
    forced = None if forced_length is None else jnp.asarray(forced_length, jnp.int32)
    force = None if force_ids is None else jnp.asarray(force_ids, jnp.int32)
    draws = Draws(jax.random.uniform(key, (r, b)), forced, force)  # every step's, before the loop
    shards = partitioning.context_shards("batch")
    stages = decode_stages(b, shards, compact_min_rows) if compact_min_rows > 0 else (b,)

    def run_from(i: int, carry: Carry) -> Carry:
        """Stage i and the ones after it; the carry's rows are stage i's."""
        next_size = stages[i + 1] if i + 1 < len(stages) else 0
        with jax.named_scope("decode"):
            carry = decode_loop(model_cfg, variables, draws, opts, carry, next_size=next_size)
        # Token t of the stage's rows: the last token when t = R - 1 (a stage that stops there
        # may hold more live rows than the next one), nothing when every row has ended. When
        # a next stage goes on, it samples token t again, the same way.
        carry = record(opts, draws, carry)[2]
        if not next_size:
            return carry

        def rest(c: Carry) -> Carry:  # the live rows move into a batch of `size` rows
            rows = _compact(c.rows, next_size)
            out = run_from(i + 1, c._replace(rows=rows._replace(cache=pin(rows.cache))))
            return c._replace(
                t=out.t, ids=out.ids, mask=out.mask, logps=out.logps, experts=out.experts
            )

        # none live (every row ended in this stage): no gather of the caches, no later stage
        return when(jnp.any(~carry.rows.done), rest, carry)

    carry = run_from(0, start(model_cfg, variables, prompt_ids_BP, prompt_mask_BP, samples, opts))
    return Rollout(carry.ids, carry.mask, carry.logps, carry.experts)
