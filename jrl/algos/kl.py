"""KL estimators, the KL penalty inside the reward, and the fixed / adaptive KL controllers.

Estimators of KL(pi || ref) per token, from log pi(a_t) and log ref(a_t) of the sampled action
(Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html); position t is
action t as everywhere in jrl:
  kl  / k1:          logp - ref
  abs:               |logp - ref|
  mse / k2:          0.5 * (logp - ref)^2
  low_var_kl / k3:   d = clip(ref - logp, -20, 20);  clip(exp(d) - d - 1, -10, 10)
  <kind>+ (k1+, k3+, low_var_kl+, ...): the value of <kind> with the gradient of k2 (straight
                     through; verl 0.9.1), for an unbiased KL-loss gradient
`kl_penalty(logp, ref, kind)` is used both for KL-in-reward (`algorithm.kl_penalty`) and for the
KL loss (`actor.kl_loss_type`, aggregated with `losses.agg_loss`).

The KL controller updates a float32 scalar `beta` that lives in the train state:
`beta = kl_ctrl_init(algorithm)` (= kl_ctrl.kl_coef), then each step `beta = update(beta,
current_kl, n_steps)` with `update = make_kl_controller(algorithm)`, `current_kl` from
`apply_kl_penalty`'s metrics and n_steps = the batch size (rows), as verl does. `algorithm` is the
config section; `kl_ctrl.type` picks the controller (KL_CONTROLLERS: fixed | adaptive), whose
parameters (`kl_ctrl.target_kl`, `kl_ctrl.horizon`) are bound once; defaults in jrl.config.schema.
"""

import functools
from typing import Callable

import chex
import jax
import jax.numpy as jnp

from jrl.algos import check_positive, masked_mean, zero_masked
from jrl.registry import Registry

KL_ESTIMATORS = Registry("KL kind")  # name -> fn(logprob, ref_logprob) -> per-token estimate
_register = KL_ESTIMATORS.register


def kl_kinds() -> list[str]:
    """Sorted names accepted by `kl_penalty` (aliases included)."""
    return KL_ESTIMATORS.names()


@_register("kl", "k1")
def _k1(logprob, ref_logprob):
    return logprob - ref_logprob


@_register("abs")
def _abs(logprob, ref_logprob):
    return jnp.abs(logprob - ref_logprob)


@_register("mse", "k2")
def _k2(logprob, ref_logprob):
    return 0.5 * jnp.square(logprob - ref_logprob)


@_register("low_var_kl", "k3")
def _k3(logprob, ref_logprob):
    log_ratio = jnp.clip(ref_logprob - logprob, -20.0, 20.0)
    return jnp.clip(jnp.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)


def _straight_through(forward):
    """`kind+`: the value of `forward`, the gradient of k2 = 0.5 (logp - ref)^2 (verl 0.9.1: k1 and
    k3 are unbiased for the KL's value but not its gradient; k2's gradient is the right one)."""

    def estimator(logprob, ref_logprob):
        backward = _k2(logprob, ref_logprob)
        value = forward(logprob, ref_logprob)
        return backward - jax.lax.stop_gradient(backward) + jax.lax.stop_gradient(value)

    return estimator


for _name, _fn in list(KL_ESTIMATORS.items()):
    KL_ESTIMATORS.add(_name + "+", _fn if _fn is _k2 else _straight_through(_fn))


def kl_penalty(logprob: jax.Array, ref_logprob: jax.Array, kind: str) -> jax.Array:
    """Per-token estimate of KL(pi || ref), same shape as the inputs; `kind` is static."""
    estimator = KL_ESTIMATORS.get(kind)
    chex.assert_equal_shape([logprob, ref_logprob])
    return estimator(jnp.asarray(logprob, jnp.float32), jnp.asarray(ref_logprob, jnp.float32))


def apply_kl_penalty(token_level_scores, old_log_prob, ref_log_prob, response_mask, beta, kind):
    """KL in the reward: r_t = score_t - beta * kl(old_t, ref_t) * mask_t, all [B, T].

    Returns (token_level_rewards, metrics). Rewards are 0 where mask == 0 (inputs there are
    ignored). metrics: `actor/reward_kl_penalty` = mean over rows of the row's masked-mean KL
    (verl's current_kl, to feed the KL controller), `actor/reward_kl_penalty_coeff` = the beta used.
    """
    mask = jnp.asarray(response_mask, jnp.float32)
    chex.assert_equal_shape([token_level_scores, old_log_prob, ref_log_prob, mask])
    kld = zero_masked(
        kl_penalty(zero_masked(old_log_prob, mask), zero_masked(ref_log_prob, mask), kind), mask
    )
    beta = jnp.asarray(beta, jnp.float32)
    rewards = zero_masked(jnp.asarray(token_level_scores, jnp.float32), mask) - beta * kld
    current_kl = jnp.mean(masked_mean(kld, mask, axis=-1))
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return rewards, metrics


# ----------------------------------------------------------------------------- controllers

# name -> (fn(beta, current_kl, n_steps, **params) -> next beta, params(kl_ctrl) -> dict)
KL_CONTROLLERS = Registry("KL controller")


def _fixed_update(beta, current_kl, n_steps):
    """Fixed controller: beta never changes."""
    del current_kl, n_steps
    return beta


def _adaptive_update(beta, current_kl, n_steps, *, target_kl, horizon):
    """Adaptive controller (Ziegler et al. 2019, arXiv:1909.08593):
    e = clip(current_kl / target_kl - 1, -0.2, 0.2);  beta <- beta * (1 + e * n_steps / horizon)."""
    error = jnp.clip(current_kl / target_kl - 1.0, -0.2, 0.2)
    return beta * (1.0 + error * n_steps / horizon)


KL_CONTROLLERS.add("fixed", (_fixed_update, lambda ctrl: {}))
KL_CONTROLLERS.add(
    "adaptive",
    (
        _adaptive_update,
        lambda ctrl: {
            "target_kl": check_positive("kl_ctrl.target_kl", ctrl.target_kl),
            "horizon": check_positive("kl_ctrl.horizon", ctrl.horizon),
        },
    ),
)


def make_kl_controller(algorithm) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """`update(kl_coef, current_kl, n_steps) -> next kl_coef` (float32, jittable) of the controller
    `algorithm.kl_ctrl.type`, its parameters bound (and validated) from `algorithm.kl_ctrl`."""
    ctrl = algorithm.kl_ctrl
    update, bind = KL_CONTROLLERS.get(ctrl.type)
    step = functools.partial(update, **bind(ctrl))

    def controller(kl_coef, current_kl, n_steps):
        return jnp.asarray(
            step(jnp.asarray(kl_coef, jnp.float32), current_kl, n_steps), jnp.float32
        )

    return controller


def kl_ctrl_init(algorithm) -> jax.Array:
    """Initial beta = algorithm.kl_ctrl.kl_coef as a float32 scalar; validates kl_ctrl."""
    make_kl_controller(algorithm)
    return jnp.asarray(algorithm.kl_ctrl.kl_coef, jnp.float32)
