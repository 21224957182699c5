"""Multi-turn rollout: decoding with tool turns inside the one jitted step.

A row decodes as in `jrl.rollout`, but each row has its own write offset `length[b]`: its next
model token goes to response slot `length[b]` (cache slot P + length[b], position id
first_position + length[b]). When a row samples one of the host's stop ids (the end of a tool
call, or EOS) it waits; in a step where any row waits, a host callback gets the responses so far
and returns a block of up to K token ids per waiting row (a rendered tool result), and one K-token
forward writes every waiting row's block into its KV cache and response at the row's own offset
(rows with nothing to append are left unchanged). Decoding then goes on from the block's last
token. A row ends when the host says so, or when the response budget R is full (a block that
does not fit is cut on the right; a row whose last slot holds a stop id ends without a call).
Turn counts are data: the loop compiles once. A step without a waiting row neither calls the
host nor runs the block forward: both sit in `while_loop`s of 0 or 1 trips (`_when`), which,
unlike `lax.cond`, leave the KV cache in place.

Arrays follow verl's agent-loop contract (docs/design.md#token-alignment for the alignment):
response slot t holds a model token (`response_mask` 1, `log_probs` the sampler's log-prob) or
a tool token (`response_mask` 0, `log_probs` 0); `valid` is 1 on both up to the row's end (the
response part of verl's attention_mask: the training forward attends to tool tokens), and
position ids run on through tool tokens. With a host that never appends, the result is
`jrl.rollout.generate`'s.

The host (see `Host`) is called through `jax.experimental.io_callback`, unordered: it has side
effects (it runs tools, keeps time limits and counts) and must run exactly once per call site
execution, which `pure_callback` does not promise (a pure call may be dropped or repeated); the
calls need no ordering token, since each one's inputs depend on the previous one's outputs
through the loop carry. Under a mesh the host gets whole [B] arrays (the callback runs on one
device's host); with asynchronous dispatch its own counts are complete only once the outputs
are ready.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jrl import rollout
from jrl.models import transformer


class TurnResult(NamedTuple):
    """What the host returns for one call (numpy arrays; entries of rows not waiting are
    ignored)."""

    block_ids: np.ndarray  # [B, K] int32: the tokens to append (pad after block_len)
    block_len: np.ndarray  # [B] int32: how many of block_ids to append, 0 = nothing
    finished: np.ndarray  # [B] bool: the row's episode ends now (after its block, if any)
    reward: np.ndarray  # [B] float32: a reward the tools give (summed into `tool_reward`)
    stats: np.ndarray  # [B, S] float32: per-row counts for metrics (summed into `stats`)


class Host(Protocol):
    """The host side of the turn loop (tool calls parsed, run and rendered on the CPU).

    `block_size`: K, the most tokens one call appends to a row. `stop_ids`: the token ids that
    pause a row and call the host (EOS among them). `stat_names` (optional, default none): the
    S columns of `TurnResult.stats`. The call gets the responses so far, `response_ids`
    [B, R] int32 (pad after `length`), `length` [B] int32, `turn_start` [B] int32 (the response
    slot where the row's current model turn began: the turn is
    response_ids[b, turn_start[b]:length[b]], its last token a stop id), `waiting` [B] bool
    (the rows to answer) and `turns` [B] int32 (the row's model turns so far, the one just
    ended included; a call that appends nothing to a row that goes on keeps its turn open)."""

    block_size: int
    stop_ids: Sequence[int]
    stat_names: Sequence[str]

    def __call__(self, response_ids, length, turn_start, waiting, turns) -> TurnResult: ...


class MultiTurnRollout(NamedTuple):
    response_ids: jax.Array  # [B, R] int32: model and tool tokens, pad after the row's end
    response_mask: jax.Array  # [B, R] int32: 1 on model tokens only
    log_probs: jax.Array  # [B, R] float32: the sampler's log-probs, 0 on tool tokens and padding
    valid: jax.Array  # [B, R] int32: 1 on model and tool tokens up to the row's end
    tool_reward: jax.Array  # [B] float32: the host's rewards, summed over the row's calls
    assistant_turns: jax.Array  # [B] int32: model turns (stretches of model tokens) of the row
    num_turns: jax.Array  # [B] int32: verl's count, model turns + tool blocks appended + 1
    stats: jax.Array  # [B, S] float32: the host's stats, summed over the row's calls


class _Loop(NamedTuple):
    """The decode loop's carry."""

    logits: jax.Array  # [B, V] float32: each row's next-token logits
    cache: tuple  # the KV cache, per layer {"k", "v"} [B, K, P + R, D]
    length: jax.Array  # [B] int32: response slots filled (the next token's slot)
    done: jax.Array  # [B] bool: the row has ended
    turn_start: jax.Array  # [B] int32: the slot where the row's current model turn began
    turns: jax.Array  # [B] int32: model turns so far, the current one included
    blocks: jax.Array  # [B] int32: tool blocks appended
    ids: jax.Array  # [B, R] int32
    mask: jax.Array  # [B, R] int32: 1 on model tokens
    logps: jax.Array  # [B, R] float32
    reward: jax.Array  # [B] float32
    stats: jax.Array  # [B, S] float32


def _host_call(host, b: int, k: int, s: int):
    """`host` wrapped for `io_callback`: numpy in, a `TurnResult` of checked shapes and dtypes
    out (a wrong shape is an error naming the field)."""
    want = {"block_ids": (b, k), "block_len": (b,), "finished": (b,), "reward": (b,)}
    want["stats"] = (b, s)
    dtypes = {"block_ids": np.int32, "block_len": np.int32, "finished": np.bool_}

    def call(ids, length, turn_start, waiting, turns):
        out = host(*(np.asarray(x) for x in (ids, length, turn_start, waiting, turns)))
        fields = {}
        for name, shape in want.items():
            x = np.asarray(getattr(out, name), dtypes.get(name, np.float32))
            if x.shape != shape:
                raise ValueError(
                    f"multi-turn host: {name} has shape {x.shape}, expected {shape} "
                    f"(B={b} rows, K={k} block_size, S={s} stat_names)."
                )
            fields[name] = x
        return TurnResult(**fields)

    shapes = TurnResult(
        *(jax.ShapeDtypeStruct(want[f], dtypes.get(f, np.float32)) for f in TurnResult._fields)
    )
    return call, shapes


def _when(pred, fn, operand):
    """fn(operand) if pred else operand, as a `while_loop` of 0 or 1 trips: XLA updates a loop's
    carry in place, where `lax.cond` copied every operand it passes through (the whole KV
    cache, at every decode step)."""
    return jax.lax.while_loop(lambda c: c[0], lambda c: (False, fn(c[1])), (pred, operand))[1]


def generate(model_cfg, params, prompt_ids_BP, prompt_mask_BP, key, *, host: Host, **options):
    """Samples up to `max_new_tokens` response slots per row, model and tool tokens together,
    calling `host` whenever rows stop at one of `host.stop_ids`; see the module docstring.
    Returns a `MultiTurnRollout`.

    The arguments and `options` are `jrl.rollout.generate`'s: max_new_tokens, eos_id and pad_id
    (required), samples (1) and the sampling options (temperature, top_k, top_p, greedy:
    `rollout.sample_token`'s); model token t of row b is drawn with the same uniform as there
    (the one of response slot t). One more option, `force_ids` ([B, R] int32 or None, for
    scripted tests): where >= 0, the model token at that response slot is this id instead of a
    draw; its log-prob is still the policy's."""
    max_new_tokens, eos_id, pad_id = (
        options.pop(k) for k in ("max_new_tokens", "eos_id", "pad_id")
    )
    samples, force_ids = options.pop("samples", 1), options.pop("force_ids", None)
    sampling = options  # temperature, top_k, top_p, greedy
    stop_ids = tuple(int(i) for i in host.stop_ids)
    k, s = int(host.block_size), len(tuple(getattr(host, "stat_names", ())))
    if eos_id not in stop_ids:
        raise ValueError(f"multi-turn host: stop_ids {stop_ids} lack eos_id {eos_id}; add it.")
    if k < 1:
        raise ValueError(f"multi-turn host: block_size is {k}; it must be at least 1.")
    model, variables, pre, last_logits = rollout.prefilled(
        model_cfg, params, prompt_ids_BP, prompt_mask_BP, samples, max_new_tokens
    )
    prompts, p = prompt_ids_BP.shape
    b, r = prompts * samples, max_new_tokens
    slots = jnp.arange(p + r)
    rows = jnp.arange(b)
    first_pos_B = pre.first_position
    uniforms_BR = jax.random.uniform(key, (r, b)).T  # rollout.generate's draws, per row
    call_host, result_shapes = _host_call(host, b, k, s)

    def forward(ids_BL, start_B, write_B, cache):
        """`ids_BL` at response slots start_B[b] + l of every row, attending over the prompt and
        the row's slots up to each token; cache writes only where `write_B` (others dropped)."""
        l = ids_BL.shape[1]
        slot_BL = p + start_B[:, None] + jnp.arange(l)[None]
        mask = pre.key_valid[:, None, :] & (slots[None, None, :] <= slot_BL[..., None])
        positions = first_pos_B[:, None] + start_B[:, None] + jnp.arange(l)[None]
        index = jnp.where(write_B, p + start_B, p + r)  # past the cache: the write is dropped
        return model.apply(variables, ids_BL, positions, mask, cache, index)

    def put(arr_BR, start_B, values_BL, n_B):
        """arr_BR with values_BL[b, :n_B[b]] written at slots start_B[b] ..; the rest dropped."""
        l = values_BL.shape[1]
        at = start_B[:, None] + jnp.arange(l)[None]
        at = jnp.where(jnp.arange(l)[None] < n_B[:, None], at, r)
        return arr_BR.at[rows[:, None], at].set(values_BL.astype(arr_BR.dtype), mode="drop")

    def decode(c: _Loop):
        """One model token for every live row, at its own slot, and its forward."""
        live = ~c.done
        slot = jnp.minimum(c.length, r - 1)[:, None]
        u = jnp.take_along_axis(uniforms_BR, slot, 1)[:, 0]
        token, logp = rollout.sample_token(u, c.logits, **sampling)
        if force_ids is not None:
            forced = jnp.take_along_axis(jnp.asarray(force_ids, jnp.int32), slot, 1)[:, 0]
            token = jnp.where(forced >= 0, forced, token)
            logp = jax.nn.log_softmax(c.logits / sampling.get("temperature", 1.0))
            logp = jnp.take_along_axis(logp, token[:, None], 1)[:, 0]
        one = live.astype(jnp.int32)
        out = forward(token[:, None], c.length, live, c.cache)
        length = c.length + one
        full = length >= r
        waiting = live & ~full & jnp.isin(token, jnp.asarray(stop_ids, jnp.int32))
        c = c._replace(
            logits=transformer.lm_logits(model_cfg, out.hidden[:, -1], out.head),
            cache=rollout.pin(out.cache),
            length=length,
            done=c.done | full,
            ids=put(c.ids, c.length, token[:, None], one),
            mask=put(c.mask, c.length, jnp.ones((b, 1), jnp.int32), one),
            logps=put(c.logps, c.length, logp[:, None], one),
        )
        return c, waiting

    def turn(c: _Loop, waiting):
        """The host answers the waiting rows; their blocks are appended in one forward."""
        res = io_callback(call_host, result_shapes, c.ids, c.length, c.turn_start, waiting, c.turns)
        n = jnp.where(waiting, jnp.clip(res.block_len, 0, jnp.minimum(k, r - c.length)), 0)
        block = jnp.asarray(res.block_ids, jnp.int32)

        def append(logits, cache):
            out = forward(block, c.length, n > 0, cache)
            last = jnp.take_along_axis(out.hidden, jnp.maximum(n - 1, 0)[:, None, None], 1)
            new = transformer.lm_logits(model_cfg, last[:, 0], out.head)
            return jnp.where((n > 0)[:, None], new, logits), rollout.pin(out.cache)

        logits, cache = _when(jnp.any(n > 0), lambda lc: append(*lc), (c.logits, c.cache))
        length = c.length + n
        done = c.done | (waiting & res.finished) | (length >= r)
        next_turn = (n > 0) & ~done  # a new model turn starts after the block
        return c._replace(
            logits=logits,
            cache=cache,
            length=length,
            done=done,
            turn_start=jnp.where(next_turn, length, c.turn_start),
            turns=c.turns + next_turn.astype(jnp.int32),
            blocks=c.blocks + (n > 0).astype(jnp.int32),
            ids=put(c.ids, c.length, block, n),
            reward=c.reward + jnp.where(waiting, res.reward, 0.0),
            stats=c.stats + jnp.where(waiting[:, None], res.stats, 0.0),
        )

    def body(c: _Loop):
        c, waiting = decode(c)
        return _when(jnp.any(waiting), lambda c: turn(c, waiting), c)

    zeros_b = jnp.zeros((b,), jnp.int32)
    start = _Loop(
        logits=last_logits,
        cache=rollout.pin(pre.cache),
        length=zeros_b,
        done=jnp.zeros((b,), bool),
        turn_start=zeros_b,
        turns=zeros_b + 1,
        blocks=zeros_b,
        ids=jnp.full((b, r), pad_id, jnp.int32),
        mask=jnp.zeros((b, r), jnp.int32),
        logps=jnp.zeros((b, r), jnp.float32),
        reward=jnp.zeros((b,), jnp.float32),
        stats=jnp.zeros((b, s), jnp.float32),
    )
    c = jax.lax.while_loop(lambda c: ~jnp.all(c.done), body, start)
    valid = (jnp.arange(r)[None] < c.length[:, None]).astype(jnp.int32)
    return MultiTurnRollout(
        c.ids, c.mask, c.logps, valid, c.reward, c.turns, c.turns + c.blocks + 1, c.stats
    )
