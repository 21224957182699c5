"""Shared helpers of the jrl.algos tests: complete config sections (from
jrl.config.schema.base_config, the one home of every default) with overrides, and thin callers of
the bound maths."""

import ml_collections

from jrl import config as config_lib
from jrl.algos import advantages as adv_lib
from jrl.algos import losses as loss_lib


def _section(section: ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
    """A copy of `section` with `overrides` applied (any type: tests also pass invalid values);
    a dict value updates the sub-section of that name."""
    section = ml_collections.ConfigDict(section.to_dict(), type_safe=False)
    return _apply(section, overrides)


def _apply(section, overrides):
    for name, value in overrides.items():
        assert name in section, (
            f"{name!r} is not a field of the section (jrl.config.schema.base_config)"
        )
        if isinstance(value, dict):
            _apply(section[name], value)
        else:
            section[name] = value
    return section


def algo_cfg(**overrides) -> ml_collections.ConfigDict:
    """The complete `algorithm` section of base_config() with `overrides` (e.g. gamma=0.9,
    kl_ctrl=dict(type="adaptive"), group_params=dict(group_max_size=4))."""
    return _section(config_lib.base_config().algorithm, overrides)


def actor_cfg(**overrides) -> ml_collections.ConfigDict:
    """The complete `actor` section of base_config() with `overrides`."""
    return _section(config_lib.base_config().actor, overrides)


def rc_cfg(**overrides) -> ml_collections.ConfigDict:
    """The complete `algorithm.rollout_correction` section of base_config() with `overrides`."""
    return _section(config_lib.base_config().algorithm.rollout_correction, overrides)


def run_loss(
    name,
    old,
    new,
    adv,
    mask,
    mode="token-mean",
    weights=None,
    key=None,
    counts=None,
    rollout_correction=None,
    **actor,
):
    """(loss, metrics) of the policy loss `name` aggregated with `mode`, through
    `losses.make_policy_loss`; `actor` overrides fields of the actor section, `rollout_correction`
    (a dict) those of an enabled rollout-correction section (None: the disabled default)."""
    actor_section = actor_cfg(policy_loss=name, loss_agg_mode=mode, **actor)
    rc = rc_cfg() if rollout_correction is None else rc_cfg(enable=True, **rollout_correction)
    fn = loss_lib.make_policy_loss(actor_section, rc)
    return fn(old, new, adv, mask, counts=counts, rollout_is_weights=weights, key=key)


def compute_full(name, *, config, index=None, **inputs):
    """The dict of `advantages.make_estimator` for estimator `name` with the (complete)
    algorithm section `config`."""
    section = config.copy_and_resolve_references()
    section.adv_estimator = name
    return adv_lib.make_estimator(section)(index=index, **inputs)


def compute(name, *, config, **inputs):
    """(advantages, returns) of `compute_full`."""
    out = compute_full(name, config=config, **inputs)
    return out["advantages"], out["returns"]
