"""Response log-probs: one forward over prompt + response gives, at each response position, the
log-probability of the token taken (and the entropy, the values, sum_v pi_v^2 when asked), with
the logits taken a chunk of positions at a time.

Alignment (docs/design.md#token-alignment, verl's convention): response position t is action
y_t; `log_prob[:, t]` is read from the logits at the position before y_t (the last prompt token
for t = 0), and so is `values[:, t]` = V(prompt, y_<t).

With `group` = n (`jrl.batching.prompt_groups` says where: model.shared_prompt_forward) the n
rows of a GRPO group run their shared prompt once (`transformer.grouped_response_forward`).

A mixture-of-experts policy's forward can replay recorded experts (`routing`, routing replay:
`jrl.router_replay`) and report its own (`with_experts`) and its router's load-balancing loss
(`with_aux_loss`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jrl import router_replay, sharding
from jrl.models import attention as attention_lib
from jrl.models import moe, transformer


def token_log_probs(
    model_cfg,
    hidden_BLH,
    head,
    targets_BL,
    temperature: float = 1.0,
    with_entropy=False,
    entropy_grad=True,
    with_sum_pi_squared=False,
):
    """(log softmax(logits / T)[target] [B, L], entropy of softmax(logits / T) [B, L] or None),
    plus sum_v softmax(logits / T)_v^2 [B, L] (no gradient) when `with_sum_pi_squared`,
    float32, with logits = `transformer.lm_logits(hidden, head)`. `entropy_grad=False`: the
    entropy is a value only (a metric), no gradient flows through it, so the backward skips its
    [B, L, V] work. With `logits_chunk_size` c set,
    the [B, L, V] logits never exist: positions go c at a time through a `lax.map` whose body is
    rematerialised, so the forward holds one chunk's [B, c, V] logits and the backward recomputes
    them chunk by chunk (the head's gradient accumulates over chunks)."""

    def chunk(h_BCH, t_BC):
        # Written around one [B, c, V] array, the logits: the log-partition and the entropy are
        # reductions over it (log_softmax would materialise a second one, its entropy a third).
        h_BCH = sharding.constrain(h_BCH, PartitionSpec("batch"))  # rows stay split (a mesh)
        logits = transformer.lm_logits(model_cfg, h_BCH, head) / temperature
        log_z = jax.nn.logsumexp(logits, axis=-1)
        logp = jnp.take_along_axis(logits, t_BC[..., None], -1)[..., 0] - log_z
        extra = ()
        if with_sum_pi_squared:
            p = jax.lax.stop_gradient(jnp.exp(logits - log_z[..., None]))
            extra = (jnp.sum(p * p, axis=-1),)
        if not with_entropy:
            return (logp, None, *extra)
        if not entropy_grad:
            logits, log_z = jax.lax.stop_gradient((logits, log_z))
        p = jnp.exp(logits - log_z[..., None])  # H = log Z - sum_v p_v logit_v (finite logits)
        return (logp, log_z - jnp.sum(p * logits, axis=-1), *extra)

    b, l, _ = hidden_BLH.shape
    c = model_cfg.logits_chunk_size
    if not c or c >= l:
        return chunk(hidden_BLH, targets_BL)
    pad = -l % c  # the last chunk is padded (its extra positions are dropped)
    hidden_BLH = jnp.pad(hidden_BLH, ((0, 0), (0, pad), (0, 0)))
    targets_BL = jnp.pad(targets_BL, ((0, 0), (0, pad)))
    to_chunks = lambda x: jnp.moveaxis(x.reshape(b, -1, c, *x.shape[2:]), 1, 0)
    from_chunks = lambda x: None if x is None else jnp.moveaxis(x, 0, 1).reshape(b, -1)[:, :l]
    out = jax.lax.map(
        lambda xs: jax.checkpoint(chunk)(*xs), (to_chunks(hidden_BLH), to_chunks(targets_BL))
    )
    return tuple(from_chunks(x) for x in out)


def response_outputs(
    model_cfg,
    params,
    prompt_ids_BP,
    prompt_mask_BP,
    response_ids_BR,
    response_mask_BR,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    with_sum_pi_squared: bool = False,
    group: int = 1,
    routing=None,
    with_experts: bool = False,
    with_aux_loss: bool = False,
) -> dict[str, jax.Array]:
    """One forward over prompt + response. Returns, for response positions [B, R] (verl alignment):
    `log_prob` = log pi(y_t | prompt, y_<t) under softmax(logits / T) (with an lm head),
    `entropy` of that distribution (if asked; without a gradient unless `entropy_grad`),
    `values` = V(prompt, y_<t) (with a value head), `sum_pi_squared` = sum_v pi(v)^2 (if asked).
    Logits are taken `model_cfg.logits_chunk_size` positions at a time (`token_log_probs`).
    `group` = n > 1: every n consecutive rows share their prompt (a GRPO group); where
    `grouped_forward_suits`, each prompt then runs once (`transformer.grouped_response_forward`;
    responses padded only after their last real token, as the rollout writes them).

    A model with experts: `routing` = (prompt [B, P, S, k], response [B, R, S, k]) experts to
    replay (`jrl.router_replay`'s layout; -1: the router's own) or None; `with_experts` adds the
    forward's own, `router_replay.PROMPT` / `RESPONSE` in the same layout; `with_aux_loss` adds
    `router_aux_loss`, the load-balancing loss of the forward's real tokens (a scalar)."""
    p, length = prompt_ids_BP.shape[1], prompt_ids_BP.shape[1] + response_ids_BR.shape[1]
    if group > 1 and grouped_forward_suits(model_cfg, length):
        prompts = slice(None, None, group)  # the first row of each group
        replay = None
        if routing is not None:  # the group's prompt once, every row's response
            replay = tuple(router_replay.layers_first(r) for r in routing)
            replay = (replay[0][:, prompts], replay[1])
        out = transformer.grouped_response_forward(
            model_cfg,
            params,
            prompt_ids_BP[prompts],
            prompt_mask_BP[prompts],
            response_ids_BR,
            replay,
            response_mask_BR,
        )
        hidden, values = out.hidden, out.values
    else:
        ids = jnp.concatenate([prompt_ids_BP, response_ids_BR], axis=1)
        mask = jnp.concatenate([prompt_mask_BP, response_mask_BR], axis=1)
        replay = None
        if routing is not None:
            replay = router_replay.layers_first(jnp.concatenate(routing, axis=1))
        out = transformer.full_forward(model_cfg, params, ids, mask, replay)
        hidden = out.hidden[:, p - 1 : -1]
        values = None if out.values is None else out.values[:, p - 1 : -1]
    head = out.head
    result = {}
    if head is not None:
        log_prob, entropy, *extra = token_log_probs(
            model_cfg,
            hidden,
            head,
            response_ids_BR,
            temperature,
            with_entropy,
            entropy_grad,
            with_sum_pi_squared,
        )
        result["log_prob"] = log_prob
        if with_entropy:
            result["entropy"] = entropy
        if with_sum_pi_squared:
            result["sum_pi_squared"] = extra[0]
    if values is not None:
        result["values"] = values
    if with_experts:  # [S, B, P + R, k] -> the prompt's and the response's, rows first
        own = router_replay.rows_first(out.routing.experts, model_cfg.num_experts)
        result[router_replay.PROMPT], result[router_replay.RESPONSE] = own[:, :p], own[:, p:]
    if with_aux_loss:
        result["router_aux_loss"] = moe.load_balancing_loss(out.routing)
    return result


def grouped_forward_suits(model_cfg, length: int) -> bool:
    """Whether a forward of `length` tokens per row may run each group's prompt once: without
    remat (the grouped forward runs the layers one by one, as the rollout does) and where the
    full forward's attention would be the materialised "xla" one (short rows: the grouped
    forward attends through a [rows, R, P + R] mask, no more memory than that)."""
    impl = attention_lib.resolve_implementation(
        model_cfg.attention,
        seq_len=length,
        head_dim=model_cfg.head_size,
        dtype=model_cfg.dtype,
        softcap=model_cfg.attn_logit_softcapping,
        block_size=model_cfg.attention_block_size,
    )
    return model_cfg.remat == "none" and impl == "xla"
