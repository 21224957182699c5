"""Routing replay for mixture-of-experts policies (verl's `router_replay.mode`, the config's
`actor.router_replay.mode`; docs/algorithms.md#routing-replay).

A sparse layer sends each token to the top k of its router's softmax. The rollout's forwards
(KV-cache decode, their own rounding) and the trainer's (full forward) compute nearly the same
router logits, and where two experts are close a token goes to other experts in each: its
log-prob then differs by far more than rounding. Replay makes the trainer's forwards use the
experts another forward chose:

  * "R3": the rollout records each token's experts in every sparse layer (the prefill the
    prompt's, each decode step the token it forwards; a multi-turn rollout's tool tokens too,
    from the forward that writes them into the cache) and the old-log-prob forward and the
    update's forwards replay them;
  * "R2": the old-log-prob forward routes on its own and records its experts; the update's
    forwards replay them;
  * "disabled": every forward routes on its own.
The reference policy's forward always routes on its own (verl: `compute_ref_log_prob` runs with
replay off), as does a separate critic.

Recorded experts travel with the experience as two arrays, rows first like the others:
`prompt_routed_experts` [B, P, S, k] and `response_routed_experts` [B, R, S, k] (S sparse layers,
k experts per token; verl's `routed_experts` [B, P + R, layers, k] cut at the prompt's end, so
that response buckets trim the response part like every [B, R] array). Integers of the smallest
signed type that holds an expert's index (`experts_dtype`); -1 where no forward ran: the last
sampled token of a row that reached slot R - 1 (as verl's rollout records none for it), and
slots after a row's end. A replaying forward routes such a token on its own (`transformer.MoE`),
as verl's R3 replay mask leaves the final token to the router.

Here: the mode's predicates, the layouts (`rows_first`, `layers_first`, `replayed`), the
rollout's writes (`write_experts`), the metrics (`mismatch_counts`, `metrics`) and the check
that the policy has experts (`check_experts`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jrl.config.errors import ConfigError
from jrl.registry import Registry

# verl's modes (its EngineRouterReplayConfig.mode); see the module docstring.
MODES = Registry(
    "router replay mode (actor.router_replay.mode)", dict.fromkeys(("disabled", "R2", "R3"))
)
PROMPT, RESPONSE = "prompt_routed_experts", "response_routed_experts"  # the experience's keys
KEYS = (PROMPT, RESPONSE)


def mode(cfg) -> str:
    return cfg.actor.router_replay.mode


def records_rollout(cfg) -> bool:
    """R3: the rollout records its experts."""
    return mode(cfg) == "R3"


def records_old(cfg) -> bool:
    """R2: the old-log-prob forward records its own experts for the update."""
    return mode(cfg) == "R2"


def check_experts(cfg, has_experts: bool) -> None:
    """ConfigError (one line) when routing replay or the router's aux loss is on for a policy
    without experts (`has_experts` False): it would have no effect."""
    if not has_experts and mode(cfg) != "disabled":
        raise ConfigError(
            f"actor.router_replay.mode='{mode(cfg)}' replays the experts of a mixture-of-experts "
            "model, but the policy is dense (no experts); set actor.router_replay.mode=disabled."
        )
    if not has_experts and cfg.actor.router_aux_loss_coef:
        raise ConfigError(
            f"actor.router_aux_loss_coef={cfg.actor.router_aux_loss_coef} weighs the router's "
            "load-balancing loss of a mixture-of-experts model, but the policy is dense (no "
            "experts); set actor.router_aux_loss_coef=0."
        )


def experts_dtype(num_experts: int):
    """The smallest signed integer type holding every expert index and -1 (int8 up to 127
    experts): a recorded token costs S x k of them."""
    for dtype in (jnp.int8, jnp.int16):
        if num_experts <= np.iinfo(dtype).max:
            return dtype
    return jnp.int32


def rows_first(experts_SBLK, num_experts: int):
    """A forward's experts [S, B, L, k] as the experience holds them: [B, L, S, k]."""
    return jnp.moveaxis(experts_SBLK, 0, 2).astype(experts_dtype(num_experts))


def layers_first(experts_BLSK):
    """[B, L, S, k] -> [S, B, L, k], the layout a forward replays (`transformer.Transformer`)."""
    return jnp.moveaxis(experts_BLSK, 2, 0)


def replayed(rows):
    """The experts `rows` carry to replay, (prompt [B, P, S, k], response [B, R, S, k]), or None
    when they carry none."""
    return (rows[PROMPT], rows[RESPONSE]) if PROMPT in rows else None


def unrecorded(rows: int, length: int, model_cfg):
    """[rows, length, S, k] of -1: no forward ran yet."""
    shape = (rows, length, len(model_cfg.sparse_layers()), model_cfg.num_experts_per_tok)
    return jnp.full(shape, -1, experts_dtype(model_cfg.num_experts))


def write_experts(recorded_BRSK, rows_b, start, experts_SBLK, count):
    """`recorded_BRSK` with the experts of a forward of L tokens per row (`experts_SBLK`, rows
    `rows_b` [b] of the B) written at response slots start .. start + L - 1 of each row (`start`
    a scalar or [b]); only a row's first `count` [b] tokens (0: nothing), slots past R dropped."""
    l, r = experts_SBLK.shape[2], recorded_BRSK.shape[1]
    slots = jnp.reshape(start, (-1, 1)) + jnp.arange(l)[None]
    slots = jnp.where(jnp.arange(l)[None] < count[:, None], slots, r)
    new = jnp.moveaxis(experts_SBLK, 0, 2).astype(recorded_BRSK.dtype)
    return recorded_BRSK.at[rows_b[:, None], slots].set(new, mode="drop")


def _counted(rows):
    """[B, P + R] bool: the real tokens of `rows` (attention mask, then `response_valid` or the
    response mask) whose experts were recorded."""
    response = rows.get("response_valid", rows["response_mask"])
    real = jnp.concatenate([rows["attention_mask"], response], axis=1) != 0
    return real & (jnp.concatenate(replayed(rows), axis=1)[..., 0, 0] >= 0)


def recorded_tokens(rows):
    """The real tokens of `rows` with recorded experts: a float32 scalar."""
    return jnp.sum(_counted(rows)).astype(jnp.float32)


def mismatch_counts(rows, own):
    """Per row [B] of `rows` (prompt + response, with their recorded experts): the real tokens
    (attention mask, `response_valid` or the response mask) with recorded experts, those whose
    own experts (`own` = (prompt, response), a forward's top k in the same layout) differ as a
    set from the recorded ones in at least one sparse layer, and the (token, layer) pairs that
    differ. float32, no gradient."""
    recorded = jnp.concatenate(replayed(rows), axis=1)  # [B, P + R, S, k]
    own = jnp.concatenate(own, axis=1).astype(recorded.dtype)
    counted = _counted(rows)
    differs = jnp.any(jnp.sort(recorded, -1) != jnp.sort(own, -1), -1)  # [B, P + R, S]
    layers = jnp.sum(differs, -1) * counted
    count = lambda x: jnp.sum(x, -1).astype(jnp.float32)
    counts = {"tokens": count(counted), "mismatched_tokens": count((layers > 0) & counted)}
    return jax.lax.stop_gradient({**counts, "mismatched_pairs": count(layers)})


def metrics(counts, num_sparse_layers: int, log_prob, rollout_log_prob, mask, tokens=None):
    """The `router_replay/*` metrics: `mismatch_token_frac` and `mismatch_layer_frac` of the
    rows' `mismatch_counts` (None: neither), over `tokens` recorded real tokens (None: those
    of `counts`; a whole mini-batch's for a micro-batch's share), and
    `rollout_log_probs_diff_max`, the largest |log pi - log pi_rollout| over the response
    tokens (`mask` 1) of `log_prob` (the old-log-prob forward's, or the on-policy update's)."""
    out = {}
    if counts is not None:
        tokens = jnp.sum(counts["tokens"]) if tokens is None else tokens
        tokens = jnp.maximum(tokens, 1.0)
        out["router_replay/mismatch_token_frac"] = jnp.sum(counts["mismatched_tokens"]) / tokens
        pairs = tokens * num_sparse_layers
        out["router_replay/mismatch_layer_frac"] = jnp.sum(counts["mismatched_pairs"]) / pairs
    gap = jnp.abs(log_prob - rollout_log_prob) * (mask != 0)
    out["router_replay/rollout_log_probs_diff_max"] = jnp.max(gap)
    return jax.lax.stop_gradient(out)
