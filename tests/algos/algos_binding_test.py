"""Parameters reach the maths from the config: `losses.make_policy_loss`,
`advantages.make_estimator` and `kl.make_kl_controller` bind them once from complete config
sections (jrl.config.schema.base_config), with verl's rules for unset fields."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import config as config_lib
from jrl.algos import advantages as adv_lib
from jrl.algos import kl as kl_lib
from jrl.algos import losses as loss_lib

# Two tokens, one row: A = +1 with ratio 1.15 and A = -1 with ratio 0.85. With eps = 0.1 both are
# clipped (to 1.1 and 0.9): token losses -1.1 and +0.9, token-mean -0.1, clip fraction 1. With
# eps = 0.2 neither is: -1.15 and +0.85, token-mean -0.15, clip fraction 0.
ADV = np.array([[1.0, -1.0]], np.float32)
OLD = np.array([[-1.0, -1.0]], np.float32)
NEW = OLD + np.log(np.array([[1.15, 0.85]], np.float32))
MASK = np.ones((1, 2), np.float32)


def vanilla_loss(cfg):
    fn = loss_lib.make_policy_loss(cfg.actor, cfg.algorithm.rollout_correction)
    return fn(OLD, NEW, ADV, MASK)


def test_clip_ratio_alone_sets_both_clip_bounds():
    """--config.actor.clip_ratio=0.1 with clip_ratio_low / clip_ratio_high unset clips at 0.1
    (verl: low = clip_ratio_low if not None else clip_ratio; the same for high)."""
    cfg = config_lib.base_config()
    assert cfg.actor.clip_ratio_low is None and cfg.actor.clip_ratio_high is None
    loss, metrics = vanilla_loss(cfg)
    np.testing.assert_allclose(loss, -0.15, atol=1e-5)  # the default 0.2 clips neither token
    np.testing.assert_allclose(metrics["actor/pg_clipfrac"], 0.0, atol=1e-6)
    cfg.actor.clip_ratio = 0.1
    config_lib.validate(cfg)
    loss, metrics = vanilla_loss(cfg)
    np.testing.assert_allclose(loss, -0.1, atol=1e-5)
    np.testing.assert_allclose(metrics["actor/pg_clipfrac"], 1.0, atol=1e-6)


def test_clip_ratio_low_and_high_override_clip_ratio_one_side_each():
    cfg = config_lib.base_config()
    cfg.actor.clip_ratio = 0.1
    cfg.actor.clip_ratio_high = 0.2  # the A > 0 token (ratio 1.15) is no longer clipped
    config_lib.validate(cfg)
    loss, metrics = vanilla_loss(cfg)
    np.testing.assert_allclose(loss, (-1.15 + 0.9) / 2, atol=1e-5)
    np.testing.assert_allclose(metrics["actor/pg_clipfrac"], 0.5, atol=1e-6)
    cfg.actor.clip_ratio_low = 0.2
    np.testing.assert_allclose(vanilla_loss(cfg)[0], -0.15, atol=1e-5)


@pytest.mark.parametrize("field", ["clip_ratio_low", "clip_ratio_high"])
def test_clip_ratio_bounds_are_validated_when_set(field):
    cfg = config_lib.base_config()
    cfg.actor[field] = 1.5
    with pytest.raises(config_lib.ConfigError, match=f"actor.{field}=1.5 must be in"):
        config_lib.validate(cfg)
    cfg.actor[field] = None  # unset again: valid
    config_lib.validate(cfg)


def clip_cov_fn(**actor):
    cfg = config_lib.base_config()
    cfg.actor.policy_loss = "clip_cov"
    cfg.actor.update(actor)
    return loss_lib.make_policy_loss(cfg.actor, cfg.algorithm.rollout_correction)


def detached_tokens(fn, old, new, adv, mask, key):
    """The tokens clip_cov detached: valid tokens whose gradient is exactly 0 (A != 0 elsewhere)."""
    grad = jax.grad(lambda lp: fn(old, lp, adv, mask, key=key)[0])(jnp.asarray(new))
    return (np.asarray(grad) == 0) & (mask > 0)


def test_clip_cov_key_picks_random_tokens_of_the_right_count():
    """verl picks clip_cov_ratio of the eligible tokens at random: with every valid token
    eligible (ratio 1, covariance bounds wide) the key decides which, never how many."""
    rng = np.random.default_rng(0)
    mask = np.ones((4, 8), np.float32)
    mask[1, 6:] = 0  # 30 valid tokens
    old = rng.uniform(-2.0, -0.5, mask.shape).astype(np.float32)
    adv = (rng.choice([-1.0, 1.0], mask.shape) * rng.uniform(0.5, 1.5, mask.shape)).astype(
        np.float32
    )
    fn = clip_cov_fn(clip_cov_ratio=0.25, clip_cov_lb=-100.0, clip_cov_ub=100.0)
    n_clip = int(0.25 * 30)  # 7
    picks = []
    for seed in range(4):
        key = jax.random.key(seed)
        detached = detached_tokens(fn, old, old, adv, mask, key)
        assert detached.sum() == n_clip, seed
        _, metrics = fn(old, old, adv, mask, key=key)
        np.testing.assert_allclose(metrics["actor/pg_clipfrac"], n_clip / 30, atol=1e-6)
        np.testing.assert_array_equal(detached, detached_tokens(fn, old, old, adv, mask, key))
        picks.append(detached)
    assert len({p.tobytes() for p in picks}) == len(picks)  # different keys, different tokens
    deterministic = detached_tokens(fn, old, old, adv, mask, None)
    assert deterministic.sum() == n_clip


def test_make_estimator_binds_the_algorithm_section():
    cfg = config_lib.base_config()
    cfg.algorithm.adv_estimator = "gpg"
    assert cfg.algorithm.f_norm == 1.0  # verl's default
    rewards = jnp.array([[0.0, 1.0], [0.0, 0.0], [0.0, 3.0], [0.0, 1.0]])
    mask = jnp.ones((4, 2))
    index = jnp.array([0, 0, 1, 1])
    base = adv_lib.make_estimator(cfg.algorithm)(
        token_level_rewards=rewards, response_mask=mask, index=index
    )
    assert sorted(base) == ["advantages", "critic_mask", "metrics", "next_threshold", "returns"]
    cfg.algorithm.f_norm = 2.0
    halved = adv_lib.make_estimator(cfg.algorithm)(
        token_level_rewards=rewards, response_mask=mask, index=index
    )
    np.testing.assert_allclose(halved["advantages"], base["advantages"] / 2, atol=1e-6)


def test_make_kl_controller_binds_kl_ctrl():
    cfg = config_lib.base_config()
    fixed = kl_lib.make_kl_controller(cfg.algorithm)
    np.testing.assert_allclose(fixed(0.3, 5.0, 100), 0.3)
    cfg.algorithm.kl_ctrl.type = "adaptive"
    cfg.algorithm.kl_ctrl.horizon = 1000
    update = kl_lib.make_kl_controller(cfg.algorithm)
    np.testing.assert_allclose(update(0.1, 0.11, 100), 0.1 * (1 + 0.1 * 100 / 1000), atol=1e-7)
    cfg.algorithm.kl_ctrl.horizon = 0
    with pytest.raises(config_lib.ConfigError, match="kl_ctrl.horizon must be > 0"):
        config_lib.validate(cfg)
