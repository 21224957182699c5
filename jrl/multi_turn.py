"""Multi-turn rollout: decoding with tool turns inside the one jitted step.

A row decodes as in `jrl.rollout`, but each row has its own write offset `length[b]`: its next
model token goes to response slot `length[b]` (cache slot P + length[b], position id
first_position + length[b]). When a row samples one of the host's stop ids (the end of a tool
call, or EOS), or a token whose bytes complete one of the host's stop strings in the text of
the row's current turn (`</calc>` however the tokens spell it: `host.stop_tables`, a byte tail
per row in the loop's carry, emptied where a block is appended), it waits; in a step where any
row waits, a host callback gets the responses so far and returns a block of up to K token ids
per waiting row (a rendered tool result), and one K-token forward writes every waiting row's
block into its KV cache and response at the row's own offset (rows with nothing to append are
left unchanged). Decoding then goes on from the block's last token. A row ends when the host
says so, or when the response budget R is full (a block that does not fit is cut on the right;
a row whose last slot holds a stop id ends without a call). Turn counts are data: the loop
compiles once. A step without a waiting row neither calls the host nor runs the block forward:
both sit in `while_loop`s of 0 or 1 trips (`rollout.when`), which, unlike `lax.cond`, leave the
KV cache in place.

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

With `record_experts` (routing replay R3, `jrl.router_replay`) every token's experts are
recorded as `rollout.generate` records them, tool tokens included: the block forward that
writes a tool answer into the cache routes its tokens, and those experts are the ones the
training forwards replay (the tool tokens are context for every later model token, so their
routing shapes the later log-probs as the model's own tokens' does).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jrl import rollout, router_replay
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
    pause a row and call the host (EOS among them). `stop_tables` (optional, default None): a
    `jrl.stop_strings.StopStrings` whose strings pause a row too, at the token that completes
    one in the text of the row's current turn. `stat_names` (optional, default none): the
    S columns of `TurnResult.stats`. The call gets the responses so far, `response_ids`
    [B, R] int32 (pad after `length`), `length` [B] int32, `turn_start` [B] int32 (the response
    slot where the row's current model turn began: the turn is
    response_ids[b, turn_start[b]:length[b]], its last token a stop id or the one that
    completed a stop string), `waiting` [B] bool
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
    # with record_experts: `rollout.Recorded` (model and tool tokens' experts); else None
    experts: rollout.Recorded | None = None


class _Turns(NamedTuple):
    """The turn hook's state in the decode loop's carry (`rollout.Carry.turn`), per row."""

    turn_start: jax.Array  # [B] int32: the slot where the row's current model turn began
    turns: jax.Array  # [B] int32: model turns so far, the current one included
    blocks: jax.Array  # [B] int32: tool blocks appended
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


def generate(model_cfg, params, prompt_ids_BP, prompt_mask_BP, key, *, host: Host, **options):
    """Samples up to `max_new_tokens` response slots per row, model and tool tokens together,
    calling `host` whenever rows stop at one of `host.stop_ids` or `host.stop_tables`' strings;
    see the module docstring.
    Returns a `MultiTurnRollout`.

    The arguments and `options` are `jrl.rollout.generate`'s: max_new_tokens, eos_id and pad_id
    (required), samples (1) and the sampling options (temperature, top_k, top_p, greedy:
    `rollout.sample_token`'s); model token t of row b is drawn with the same uniform as there
    (the one of response slot t). One more option, `force_ids` ([B, R] int32 or None, for
    scripted tests): where >= 0, the model token at that response slot is this id instead of a
    draw; its log-prob is still the policy's. `record_experts` (a model with experts): the
    result's `experts` (see the module docstring).

    The decode is `rollout.generate`'s loop (`rollout.decode_loop`, each row at its own
    response slot) with the turn below as its hook."""
    max_new_tokens, eos_id, pad_id = (
        options.pop(k) for k in ("max_new_tokens", "eos_id", "pad_id")
    )
    samples, force_ids = options.pop("samples", 1), options.pop("force_ids", None)
    sampling = options  # temperature, top_k, top_p, greedy, record_experts
    stop_ids = tuple(int(i) for i in host.stop_ids)
    k, s = int(host.block_size), len(tuple(getattr(host, "stat_names", ())))
    if eos_id not in stop_ids:
        raise ValueError(f"multi-turn host: stop_ids {stop_ids} lack eos_id {eos_id}; add it.")
    if k < 1:
        raise ValueError(f"multi-turn host: block_size is {k}; it must be at least 1.")
    prompts, p = prompt_ids_BP.shape
    b, r = prompts * samples, max_new_tokens
    stop_strings = getattr(host, "stop_tables", None)
    opts = rollout.Options(p, r, eos_id, pad_id, stop_ids, **sampling, per_row=True)
    opts = opts._replace(
        stop_strings=stop_strings, shared_prompt=rollout.shares_prompt(model_cfg, p, r)
    )
    variables = rollout.prepare(model_cfg, params)  # once, outside the decode loop
    force = None if force_ids is None else jnp.asarray(force_ids, jnp.int32)
    draws = rollout.Draws(jax.random.uniform(key, (r, b)), force_ids=force)
    rows_b = jnp.arange(b)
    call_host, result_shapes = _host_call(host, b, k, s)

    def put(arr_BR, start_B, values_BL, n_B):
        """arr_BR with values_BL[b, :n_B[b]] written at slots start_B[b] ..; the rest dropped."""
        l = values_BL.shape[1]
        at = start_B[:, None] + jnp.arange(l)[None]
        at = jnp.where(jnp.arange(l)[None] < n_B[:, None], at, r)
        return arr_BR.at[rows_b[:, None], at].set(values_BL.astype(arr_BR.dtype), mode="drop")

    def turn(c: rollout.Carry, waiting) -> rollout.Carry:
        """The host answers the waiting rows; their blocks are appended in one forward."""
        rows, state = c.rows, c.turn
        res = io_callback(
            call_host, result_shapes, c.ids, rows.length, state.turn_start, waiting, state.turns
        )
        n = jnp.where(waiting, jnp.clip(res.block_len, 0, jnp.minimum(k, r - rows.length)), 0)
        block = jnp.asarray(res.block_ids, jnp.int32)

        def append(logits, cache, experts):
            at = rows._replace(cache=cache)
            out = rollout.forward(model_cfg, variables, opts, at, block, rows.length, n > 0)
            last = jnp.take_along_axis(out.hidden, jnp.maximum(n - 1, 0)[:, None, None], 1)
            new = transformer.lm_logits(model_cfg, last[:, 0], out.head, decode=True)
            if experts is not None:  # the block's tokens' experts, at their slots
                experts = router_replay.write_experts(
                    experts, rows_b, rows.length, out.routing.experts, n
                )
            return jnp.where((n > 0)[:, None], new, logits), rollout.pin(out.cache), experts

        grow = lambda lce: append(*lce)
        recorded = None if c.experts is None else c.experts.response
        logits, cache, recorded = rollout.when(
            jnp.any(n > 0), grow, (rows.logits, rows.cache, recorded)
        )
        if recorded is not None:
            c = c._replace(experts=c.experts._replace(response=recorded))
        start, length = rows.length, rows.length + n
        done = rows.done | (waiting & res.finished) | (length >= r)
        next_turn = (n > 0) & ~done  # a new model turn starts after the block
        state = state._replace(
            turn_start=jnp.where(next_turn, length, state.turn_start),
            turns=state.turns + next_turn.astype(jnp.int32),
            blocks=state.blocks + (n > 0).astype(jnp.int32),
            reward=state.reward + jnp.where(waiting, res.reward, 0.0),
            stats=state.stats + jnp.where(waiting[:, None], res.stats, 0.0),
        )
        rows = rows._replace(logits=logits, cache=cache, length=length, done=done)
        if stop_strings is not None:  # the next turn's text starts after the tool's answer
            rows = rows._replace(tail=stop_strings.reset(rows.tail, n > 0))
        return c._replace(rows=rows, ids=put(c.ids, start, block, n), turn=state)

    def hook(c: rollout.Carry, stopped) -> rollout.Carry:
        """A live row that wrote a stop id or completed a stop string before its last slot
        waits for the host (a step with none runs no callback and no block forward)."""
        waiting = stopped & (c.rows.length < r)
        return rollout.when(jnp.any(waiting), lambda c: turn(c, waiting), c)

    zeros_b = jnp.zeros((b,), jnp.int32)
    carry = rollout.start(model_cfg, variables, prompt_ids_BP, prompt_mask_BP, samples, opts)
    carry = carry._replace(
        turn=_Turns(zeros_b, zeros_b + 1, zeros_b, jnp.zeros((b,), jnp.float32), jnp.zeros((b, s)))
    )
    with jax.named_scope("decode"):
        carry = rollout.decode_loop(model_cfg, variables, draws, opts, carry, hook)
    live = ~carry.rows.done  # rows at their last slot: its token needs no forward
    c = rollout.record(opts, draws, carry)[2]
    length = carry.rows.length + live.astype(jnp.int32)
    valid = (jnp.arange(r)[None] < length[:, None]).astype(jnp.int32)
    state = c.turn
    return MultiTurnRollout(
        c.ids,
        c.mask,
        c.logps,
        valid,
        state.reward,
        state.turns,
        state.turns + state.blocks + 1,
        state.stats,
        c.experts,
    )
