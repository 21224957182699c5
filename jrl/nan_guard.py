"""The NaN guard (nan_guard.enable): a step whose reward, advantages, losses or gradients are not
finite applies nothing of what they touch (docs/design.md#the-nan-guard).

- Before the update: `all_finite` of the scored batch's metrics decides whether any update runs.
- Inside the update: `apply_grads` applies a mini-batch's update only while it and every update
  before it are finite, as a select fused into the optimizer's elementwise update (no second
  copy of the state).
- At the step's end: `settle` keeps a skipped step's KL coefficient and GROUP-PPO threshold,
  counts it, and reports which quantity was not finite (`training/finite/*`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

# Quantities whose non-finite value makes the NaN guard skip a step (in this order of blame).
GUARDED_METRICS = (
    "critic/score/mean",
    "critic/advantages/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "critic/vf_loss",
    "critic/grad_norm",
)


def all_finite(metrics: dict) -> jax.Array:
    """Whether every quantity of GUARDED_METRICS present in `metrics` is finite (bool scalar)."""
    return jnp.all(jnp.stack([jnp.isfinite(metrics[k]) for k in GUARDED_METRICS if k in metrics]))


def select(pred, on_true, on_false):
    """on_true where the bool scalar `pred`, else on_false, leaf by leaf."""
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def apply_grads(tx, grads, params, opt_state, apply):
    """(params, opt_state) after one optimizer update with `grads`, or unchanged where `apply`
    (a bool scalar, or None: always) is False: a select fused into the elementwise update, so
    no second copy of the state."""
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new = (optax.apply_updates(params, updates), new_opt_state)
    return new if apply is None else select(apply, new, (params, opt_state))


def settle(cfg, state, new_state, metrics: dict):
    """(new_state, metrics) at the end of a step from `state`: with the guard on, a step with a
    guarded quantity not finite keeps its old KL coefficient and GROUP-PPO threshold; every
    step reports `training/finite/*`, `training/step_skipped` and the running
    `training/skipped_steps` (also counted in the state)."""
    finite = {k: jnp.isfinite(metrics[k]) for k in GUARDED_METRICS if k in metrics}
    ok = jnp.all(jnp.stack(list(finite.values())))
    if cfg.nan_guard.enable:  # a skipped step keeps its KL coefficient and GROUP-PPO tau
        new_state = new_state.replace(
            kl_coef=jnp.where(ok, new_state.kl_coef, state.kl_coef),
            group_threshold=jnp.where(ok, new_state.group_threshold, state.group_threshold),
        )
    metrics = dict(metrics)
    metrics.update({f"training/finite/{k}": v.astype(jnp.int32) for k, v in finite.items()})
    metrics["training/step_skipped"] = (~ok).astype(jnp.int32)
    skipped = state.skipped_steps + (~ok).astype(jnp.int32)
    metrics["training/skipped_steps"] = skipped
    return new_state.replace(skipped_steps=skipped), metrics
