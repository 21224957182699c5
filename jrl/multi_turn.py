"""Multi-turn rollout: decoding with tool turns inside the one jitted step.

A row decodes as in `jrl.rollout`, but each row has its own write offset `length[b]`: its next
model token goes to response slot `length[b]` (cache slot P + length[b], position id
first_position + length[b]). When a row samples one of the host's stop ids (the end of a tool
call, or EOS) it waits; in a step where any row waits, a host callback gets the responses so far
and returns a block of up to K token ids per waiting row (a rendered tool result), and one K-token
forward writes every waiting row's block into its KV cache and response at the row's own offset
(rows with nothing to append are left unchanged). Decoding then goes on from the block's last
token. A row ends when the host says so, or when the response budget R is full (a block that
does not fit is cut on the right). Turn counts are data: the loop compiles once, and a step
without a waiting row does not call the host (`lax.cond`).

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
through the loop carry.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jrl import partitioning, rollout
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
    pause a row and call the host (EOS among them). `stat_names`: the S columns of
    `TurnResult.stats`. The call gets the responses so far, `response_ids` [B, R] int32 (pad
    after `length`), `length` [B] int32, `turn_start` [B] int32 (the response slot where the
    row's current model turn began: the turn is response_ids[b, turn_start[b]:length[b]], its
    last token a stop id), `waiting` [B] bool (the rows to answer) and `turns` [B] int32 (the
    row's model turns so far, the one just ended included)."""

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
    num_turns: jax.Array  # [B] int32: model turns (stretches of model tokens) of the row
    stats: jax.Array  # [B, S] float32: the host's stats, summed over the row's calls


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


def generate(
    model_cfg: transformer.ModelConfig,
    params,
    prompt_ids_BP,
    prompt_mask_BP,
    key,
    *,
    host: Host,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    samples: int = 1,
    force_ids=None,
) -> MultiTurnRollout:
    """Samples up to `max_new_tokens` response slots per row, model and tool tokens together,
    calling `host` whenever rows stop at one of `host.stop_ids`; see the module docstring.

    Prompts, `samples` and the sampling options are `jrl.rollout.generate`'s; model token t of
    row b is drawn with the same uniform as there (the one of response slot t). `force_ids`
    ([B, R] int32 or None, for scripted tests): where >= 0, the model token at that response
    slot is this id instead of a draw; its log-prob is still the policy's."""
    stop_ids = tuple(int(i) for i in host.stop_ids)
    k, s = int(host.block_size), len(tuple(host.stat_names))
    if eos_id not in stop_ids:
        raise ValueError(f"multi-turn host: stop_ids {stop_ids} lack eos_id {eos_id}; add it.")
    if k < 1:
        raise ValueError(f"multi-turn host: block_size is {k}; it must be at least 1.")
    model = transformer.Transformer(model_cfg)
    params = transformer.unstack_layers(model_cfg, params)  # once, outside the decode loop
    variables = transformer.variables(params)
    prompts, p = prompt_ids_BP.shape
    b, r = prompts * samples, max_new_tokens
    slots = jnp.arange(p + r)
    rows = jnp.arange(b)
    pin = lambda c: partitioning.constrain(c, partitioning.CACHE_AXES)
    pre = transformer.prefill(model, variables, prompt_ids_BP, prompt_mask_BP, samples, r)
    last_logits = transformer.lm_logits(model_cfg, pre.last.hidden[:, -1], pre.last.head)
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

    def decode(carry):
        """One model token for every live row, at its own slot, and its forward."""
        logits, cache, length, done, turn_start, turns, ids, mask, logps, reward, stats = carry
        live = ~done
        slot = jnp.minimum(length, r - 1)[:, None]
        u = jnp.take_along_axis(uniforms_BR, slot, 1)[:, 0]
        token, logp = rollout.sample_token(
            u, logits, temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy
        )
        if force_ids is not None:
            forced = jnp.take_along_axis(jnp.asarray(force_ids, jnp.int32), slot, 1)[:, 0]
            token = jnp.where(forced >= 0, forced, token)
            logp = jnp.take_along_axis(jax.nn.log_softmax(logits / temperature), token[:, None], 1)
            logp = logp[:, 0]
        one = live.astype(jnp.int32)
        ids = put(ids, length, token[:, None], one)
        mask = put(mask, length, jnp.ones((b, 1), jnp.int32), one)
        logps = put(logps, length, logp[:, None], one)
        out = forward(token[:, None], length, live, cache)
        logits = transformer.lm_logits(model_cfg, out.hidden[:, -1], out.head)
        length = length + one
        full = length >= r
        waiting = live & ~full & jnp.isin(token, jnp.asarray(stop_ids, jnp.int32))
        carry = (logits, pin(out.cache), length, done | full, turn_start, turns)
        carry += (ids, mask, logps, reward, stats)
        return carry, waiting

    def turn(carry, waiting):
        """The host answers the waiting rows; their blocks are appended in one forward."""
        logits, cache, length, done, turn_start, turns, ids, mask, logps, reward, stats = carry
        res = io_callback(call_host, result_shapes, ids, length, turn_start, waiting, turns)
        n = jnp.where(waiting, jnp.clip(res.block_len, 0, jnp.minimum(k, r - length)), 0)
        block = jnp.asarray(res.block_ids, jnp.int32)

        def append(logits, cache):
            out = forward(block, length, n > 0, cache)
            last = jnp.take_along_axis(out.hidden, jnp.maximum(n - 1, 0)[:, None, None], 1)
            new = transformer.lm_logits(model_cfg, last[:, 0], out.head)
            return jnp.where((n > 0)[:, None], new, logits), pin(out.cache)

        logits, cache = _when(jnp.any(n > 0), lambda c: append(*c), (logits, cache))
        ids = put(ids, length, block, n)
        finished = waiting & res.finished
        length = length + n
        done = done | finished | (length >= r)
        next_turn = (n > 0) & ~done  # a new model turn starts after the block
        turn_start = jnp.where(next_turn, length, turn_start)
        turns = turns + next_turn.astype(jnp.int32)
        reward = reward + jnp.where(waiting, res.reward, 0.0)
        stats = stats + jnp.where(waiting[:, None], res.stats, 0.0)
        return logits, cache, length, done, turn_start, turns, ids, mask, logps, reward, stats

    def body(carry):
        carry, waiting = decode(carry)
        return _when(jnp.any(waiting), lambda c: turn(c, waiting), carry)

    zeros_b = jnp.zeros((b,), jnp.int32)
    carry = (last_logits, pin(pre.cache), zeros_b, jnp.zeros((b,), bool), zeros_b, zeros_b + 1)
    carry += (
        jnp.full((b, r), pad_id, jnp.int32),
        jnp.zeros((b, r), jnp.int32),
        jnp.zeros((b, r), jnp.float32),
        jnp.zeros((b,), jnp.float32),
        jnp.zeros((b, s), jnp.float32),
    )
    carry = jax.lax.while_loop(lambda c: ~jnp.all(c[3]), body, carry)
    _, _, length, _, _, turns, ids, mask, logps, reward, stats = carry
    valid = (jnp.arange(r)[None] < length[:, None]).astype(jnp.int32)
    return MultiTurnRollout(ids, mask, logps, valid, reward, turns, stats)
