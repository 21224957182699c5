"""RL maths: advantage estimators, policy/value losses, KL penalties, and shared masked helpers.

Submodules (import them explicitly; this package does not import them itself):
  advantages.py  registry of advantage estimators (gae, grpo, rloo, ...): `advantages.compute(name, ...)`
  losses.py      registry of policy losses, loss aggregation, value loss, entropy
  kl.py          KL estimators, KL-in-reward, fixed/adaptive KL controllers

The masked reductions below are the ones every other module uses; `registrar` / `lookup` /
`positive_field` are the small registry and config helpers the submodules share. Arrays are batch-major
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
    """masked_mean(x, m) = sum(x*m) / (sum(m) + 1e-8) over `axis` (None = all); 0 for an empty mask."""
    return masked_sum(x, mask, axis) / (jnp.sum(mask, axis=axis) + EPS_MEAN)


def masked_var(x, mask):
    """Unbiased variance over the whole array: masked_mean((x - mu)^2, m) * n / (n - 1), n = sum(m).

    Decision (verl raises on n <= 1, which cannot happen inside jit): for n <= 1 the variance is
    defined as 0. With n == 1 the single valid entry equals the mean, so `masked_whiten` maps it to 0;
    with n == 0 everything is masked. No NaN is produced either way.
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


def registrar(registry: dict, what: str):
    """Returns `register(*names)`, a decorator adding a function to `registry` under each name."""

    def register(*names):
        def decorator(fn):
            for name in names:
                if name in registry:
                    raise ValueError(f"{what} {name!r} is already registered.")
                registry[name] = fn
            return fn

        return decorator

    return register


def lookup(registry: dict, name: str, what: str):
    """registry[name]; an unknown name raises ValueError listing the valid (sorted) names."""
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}: valid names are {', '.join(sorted(registry))}.")
    return registry[name]


def positive_field(config, field: str, default):
    """config.get(field, default), which must be > 0 (ValueError otherwise; checked at trace time)."""
    value = config.get(field, default)
    if not value > 0:
        raise ValueError(f"{field} must be > 0, got {value}.")
    return value
