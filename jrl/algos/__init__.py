"""RL maths: advantage estimators, policy/value losses, KL penalties, and shared masked helpers.

Submodules (import them explicitly; this package does not import them itself):
  advantages.py   registry of advantage estimators (gae, grpo, rloo, ...):
                  `make_estimator(algorithm)`
  losses.py       registry of policy losses, loss aggregation, value loss, entropy:
                  `make_policy_loss(actor, rollout_correction)`
  kl.py           KL estimators, KL-in-reward, fixed/adaptive KL controllers: `make_kl_controller`
  group_ppo.py    GROUP-PPO's segment-level advantages (registered by advantages.py)
  recurrences.py  the reverse scans shared by the estimators (GAE, discounted returns)
  rollout_corr.py rollout-correction IS weights and rejection masks

Imports go one way: advantages -> group_ppo -> recurrences; every module may use this package.
The maths take explicit keyword arguments; each `make_*` binds them once from a config section
(jrl.config.schema.base_config holds every default). Every registry is a `jrl.registry.Registry`.

The masked reductions below are the ones every other module uses; `check_positive` validates a
bound parameter. Arrays are batch-major
([B, T] for token quantities); `mask` is the response mask (1 = a real response token, 0 = padding
or an observation token). All of them are jittable and NaN-safe with respect to masked entries:
values where mask == 0 are selected away with `jnp.where` before any arithmetic, so garbage (even
inf/NaN) at padded positions never reaches the result or its gradient.
"""

import jax
import jax.numpy as jnp

EPS_MEAN = 1e-8  # verl's denominator guard in masked_mean
EPS_WHITEN = 1e-8  # verl's variance guard in masked_whiten


def masked_sum(x, mask, axis=None):
    """sum(x * mask) over `axis` (None = all), with entries where mask == 0 treated as exactly 0."""
    return jnp.sum(jnp.where(mask != 0, x * mask, 0.0), axis=axis)


def masked_mean(x, mask, axis=None):
    """masked_mean(x, m) = sum(x*m) / (sum(m) + 1e-8) over `axis` (None = all); 0 for an empty
    mask."""
    return masked_sum(x, mask, axis) / (jnp.sum(mask, axis=axis) + EPS_MEAN)


def masked_var(x, mask):
    """Unbiased variance over the whole array: masked_mean((x - mu)^2, m) * n / (n - 1), n = sum(m).

    Decision (verl raises on n <= 1, which cannot happen inside jit): for n <= 1 the variance is
    defined as 0. With n == 1 the single valid entry equals the mean, so `masked_whiten` maps it to
    0; with n == 0 everything is masked. No NaN is produced either way.
    """
    n = jnp.sum(mask)
    centered = x - masked_mean(x, mask)
    biased = masked_mean(centered * centered, mask)
    safe_dof = jnp.where(n > 1, n - 1.0, 1.0)
    return jnp.where(n > 1, biased * n / safe_dof, 0.0)


def masked_whiten(x, mask):
    """(x - masked_mean(x, m)) * rsqrt(masked_var(x, m) + 1e-8), statistics over the whole batch.

    Entries where mask == 0 are transformed too (as in verl); callers multiply by the mask when
    they need zeros there.
    """
    return (x - masked_mean(x, mask)) * jax.lax.rsqrt(masked_var(x, mask) + EPS_WHITEN)


def zero_masked(x, mask):
    """x where mask != 0, else exactly 0 (removes garbage/NaN from padded positions)."""
    return jnp.where(mask != 0, x, 0.0)


def check_positive(name: str, value):
    """`value`, which must be > 0 (ValueError naming `name` otherwise; checked at trace time)."""
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}.")
    return value
