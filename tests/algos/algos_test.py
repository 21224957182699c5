"""Tests for jrl.algos: worked vectors of docs/algorithms.md, hand-computed cases, masking and
registries.

Expected numbers are written out by hand or computed here with small numpy loops written from the
formulas in docs/algorithms.md / the docstrings, never by calling the code under test.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import algos
from jrl.algos import advantages as adv_lib
from jrl.algos import kl as kl_lib
from jrl.algos import losses as loss_lib

from helpers import algos_fixtures as fx

ATOL = 1e-5


algo_cfg, actor_cfg = fx.algo_cfg, fx.actor_cfg
# the rollout-correction settings bypass_mode runs with here
LOSS_RC = dict(rollout_is="token", rollout_is_threshold="2.0", rollout_rs="", loss_type="ppo_clip")


def close(actual, expected, atol=ATOL):
    np.testing.assert_allclose(
        np.asarray(actual), np.asarray(expected, np.float64), rtol=0, atol=atol
    )


def last_token_rewards(scores, mask):
    """[B] scores placed on the last valid token of each row."""
    mask = np.asarray(mask, np.float32)
    out = np.zeros_like(mask)
    out[np.arange(len(scores)), mask.sum(1).astype(int) - 1] = scores
    return out


def np_whiten(x, m):
    """Whole-batch whitening with the unbiased variance, as docs/algorithms.md defines it."""
    n = m.sum()
    mean = (x * m).sum() / n
    var = (((x - mean) ** 2) * m).sum() / (n - 1)
    return (x - mean) / np.sqrt(var + 1e-8)


# ----------------------------------------------------------------------------- helpers


def test_masked_mean_and_unbiased_var():
    x = jnp.array([[1.0, 0.0, 1.0, 100.0]])
    m = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    close(algos.masked_mean(x, m), 2 / 3)
    close(jnp.sqrt(algos.masked_var(x, m)), 0.5774, atol=1e-4)  # torch.std([1, 0, 1]), not 0.4714
    close(algos.masked_whiten(x, m)[0, :3], (np.array([1, 0, 1]) - 2 / 3) / np.sqrt(1 / 3 + 1e-8))
    close(algos.masked_mean(x, m, axis=-1), [2 / 3])


def test_masked_var_small_n_is_zero_not_nan_under_jit():
    x = jnp.array([3.0, 7.0, -2.0])
    var = jax.jit(algos.masked_var)
    whiten = jax.jit(algos.masked_whiten)
    one = jnp.array([0.0, 1.0, 0.0])
    none = jnp.zeros(3)
    close(var(x, one), 0.0)
    close(var(x, none), 0.0)
    assert np.isfinite(np.asarray(whiten(x, one))).all()
    close(whiten(x, one)[1], 0.0)  # the single valid entry equals its mean


# ----------------------------------------------------------------------------- worked vectors


def test_worked_vector_1_gae():
    values = jnp.array([[0.3, 0.4, 0.5, 0.7, 0.8]])
    rewards = jnp.array([[0.0, 0.0, 0.0, 0.0, 1.0]])
    adv, ret = fx.compute(
        "gae",
        token_level_rewards=rewards,
        response_mask=jnp.ones((1, 5)),
        values=values,
        config=algo_cfg(),
    )
    close(ret, [[1, 1, 1, 1, 1]])
    close(ret - values, [[0.7, 0.6, 0.5, 0.3, 0.2]])
    close(adv, [[1.1574, 0.6751, 0.1929, -0.7716, -1.2538]], atol=1e-4)


def test_worked_vector_2_kl_in_reward_then_gae():
    scores = jnp.array([[0, 0, 0, 0, 0, 1.0]])
    old = jnp.array([[-0.40, -0.30, -0.60, -0.80, -0.20, -0.25]])
    ref = jnp.array([[-0.50, -0.35, -0.55, -0.90, -0.40, -0.30]])
    mask = jnp.ones((1, 6))
    rewards, metrics = kl_lib.apply_kl_penalty(scores, old, ref, mask, 0.1, "k1")
    close(rewards, [[-0.01, -0.005, 0.005, -0.01, -0.02, 0.995]])
    close(metrics["actor/reward_kl_penalty"], (0.1 + 0.05 - 0.05 + 0.1 + 0.2 + 0.05) / 6)
    close(metrics["actor/reward_kl_penalty_coeff"], 0.1)
    values = jnp.array([[0.20, 0.25, 0.30, 0.35, 0.45, 0.60]])
    _, ret = fx.compute(
        "gae",
        token_level_rewards=rewards,
        response_mask=mask,
        values=values,
        config=algo_cfg(gamma=1.0, lam=0.95),
    )
    close(ret - values, [[0.6211, 0.6117, 0.5965, 0.5700, 0.5052, 0.3950]], atol=1e-4)
    close(ret, [[0.8211, 0.8617, 0.8965, 0.9200, 0.9552, 0.9950]], atol=1e-4)


def test_worked_vector_3_grpo_two_prompts():
    mask = np.array([[1, 1, 0, 0]] * 3 + [[1, 1, 1, 0]] * 3, np.float32)
    rewards = last_token_rewards([1, 0, 1, 1, 0, 1], mask)
    adv, ret = fx.compute(
        "grpo",
        token_level_rewards=rewards,
        response_mask=mask,
        index=jnp.array([0, 0, 0, 1, 1, 1]),
        config=algo_cfg(),
    )
    per_row = np.array([0.5773, -1.1547, 0.5773, 0.5773, -1.1547, 0.5773])
    close(adv, per_row[:, None] * mask, atol=1e-4)
    close(ret, adv)


def test_worked_vector_4_grpo_unbiased_std():
    mask = np.ones((5, 3), np.float32)
    rewards = last_token_rewards([1, 0, 1, 0, 1], mask)
    adv, _ = fx.compute(
        "grpo",
        token_level_rewards=rewards,
        response_mask=mask,
        index=jnp.zeros(5, jnp.int32),
        config=algo_cfg(),
    )
    close(adv[:, 0], [0.7303, -1.0954, 0.7303, -1.0954, 0.7303], atol=1e-4)


# ----------------------------------------------------------------------------- estimators


def np_gae(r, v, m, gamma, lam):
    """Per-row loop of docs/algorithms.md's GAE: carries only replaced on valid tokens."""
    out = np.zeros_like(r)
    for b in range(r.shape[0]):
        next_v, next_a = 0.0, 0.0
        for t in reversed(range(r.shape[1])):
            if m[b, t]:
                next_a = r[b, t] + gamma * next_v - v[b, t] + gamma * lam * next_a
                next_v = v[b, t]
            out[b, t] = next_a
    return out


def test_gae_with_holes_and_discount():
    rng = np.random.default_rng(0)
    m = np.array([[1, 1, 0, 1, 1, 0], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]], np.float32)
    r = (rng.normal(size=m.shape) * m).astype(np.float32)
    v = rng.normal(size=m.shape).astype(np.float32)
    adv, ret = fx.compute(
        "gae", token_level_rewards=r, response_mask=m, values=v, config=algo_cfg(gamma=0.9, lam=0.8)
    )
    raw = np_gae(r, v, m, 0.9, 0.8)
    close(ret, (raw + v) * m)
    close(adv, np_whiten(raw, m) * m)


def test_grpo_dr_grpo_and_singleton_group():
    mask = np.ones((4, 2), np.float32)
    rewards = last_token_rewards([2.0, 0.0, 1.0, 0.5], mask)
    index = jnp.array([0, 0, 0, 3])  # group 3 has one sample
    adv, _ = fx.compute(
        "grpo",
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        config=algo_cfg(norm_adv_by_std_in_grpo=False),
    )
    close(adv[:, 0], [1.0, -1.0, 0.0, 0.5])  # s - mean; singleton: mean 0
    adv, _ = fx.compute(
        "grpo", token_level_rewards=rewards, response_mask=mask, index=index, config=algo_cfg()
    )
    close(
        adv[:, 0], [1.0 / (1 + 1e-6), -1.0 / (1 + 1e-6), 0.0, 0.5 / (1 + 1e-6)]
    )  # std of [2,0,1] = 1


def test_grpo_passk():
    mask = np.ones((7, 2), np.float32)
    scores = [0.2, 0.9, 0.5, 1.0, 1.0, 0.0, 0.3]
    index = jnp.array([0, 0, 0, 1, 1, 1, 2])  # group 1 ties at the top; group 2 is a singleton
    rewards = last_token_rewards(scores, mask)
    adv, ret = fx.compute(
        "grpo_passk",
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        config=algo_cfg(),
    )
    std0 = np.std([0.2, 0.9, 0.5], ddof=1)
    close(adv[:, 0], [0, 0.4 / (std0 + 1e-6), 0, 0, 0, 0, 0])
    close(ret, adv)
    adv, _ = fx.compute(
        "grpo_passk",
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        config=algo_cfg(norm_adv_by_std_in_grpo=False),
    )
    close(adv[:, 1], [0, 0.4, 0, 0, 0, 0, 0])


def test_rloo():
    mask = np.array([[1, 1, 0]] * 3 + [[1, 0, 0]], np.float32)
    rewards = last_token_rewards([1.0, 0.0, 1.0, 0.7], mask)
    adv, ret = fx.compute(
        "rloo",
        token_level_rewards=rewards,
        response_mask=mask,
        index=jnp.array([1, 1, 1, 0]),
        config=algo_cfg(),
    )
    # leave-one-out: 1 - (0+1)/2, 0 - (1+1)/2, ...; a group of one keeps its score
    close(adv, np.array([0.5, -1.0, 0.5, 0.7])[:, None] * mask)
    close(ret, adv)


def test_reinforce_plus_plus():
    m = np.array([[1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 1, 1]], np.float32)
    r = np.array([[0.5, 0, 1, 0], [0.2, 0, -1, 2], [0, 0.3, 0, 1]], np.float32)
    gamma = 0.9
    expected_ret = np.zeros_like(r)
    for b in range(3):  # G_t = r_t + gamma * carry; a masked position passes the carry through
        carry = 0.0
        for t in reversed(range(4)):
            expected_ret[b, t] = r[b, t] + gamma * carry
            carry = expected_ret[b, t] if m[b, t] else carry
    adv, ret = fx.compute(
        "reinforce_plus_plus", token_level_rewards=r, response_mask=m, config=algo_cfg(gamma=gamma)
    )
    close(ret, expected_ret * m)
    close(adv, np_whiten(expected_ret, m) * m)
    close(ret[1, 0], 0.2 + 0.9 * (-1 + 0.9 * 2))  # the hole at t=1 is skipped (verl 0.9.1)


def test_reinforce_plus_plus_baseline():
    m = np.array([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], np.float32)
    s = np.array([1.0, 0.0, 3.0, 2.0])
    index = jnp.array([0, 0, 2, 3])
    centered = s - np.array(
        [0.5, 0.5, 0.0, 0.0]
    )  # group {0, 1} has mean 0.5; singletons use mean 0
    adv, ret = fx.compute(
        "reinforce_plus_plus_baseline",
        token_level_rewards=last_token_rewards(s, m),
        response_mask=m,
        index=index,
        config=algo_cfg(),
    )
    close(adv, np_whiten(centered[:, None] * m, m) * m)
    close(ret, adv)


def test_remax():
    m = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)
    r = np.array([[0, 1, 0, 0], [0.5, 2, 0, 0]], np.float32)
    adv, ret = fx.compute(
        "remax",
        token_level_rewards=r,
        response_mask=m,
        reward_baselines=jnp.array([0.4, 1.0]),
        config=algo_cfg(),
    )
    close(ret, [[1, 1, 0, 0], [2.5, 2, 0, 0]])
    close(adv, [[0.6, 0.6, -0.4, 0], [1.5, 1.0, 0, 0]])


def test_opo():
    m = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], np.float32)
    adv, _ = fx.compute(
        "opo",
        token_level_rewards=last_token_rewards([1.0, 0.0, 0.6], m),
        response_mask=m,
        index=jnp.array([0, 0, 2]),
        config=algo_cfg(),
    )
    baseline = (2 * 1.0 + 4 * 0.0) / 6  # length-weighted mean of the group
    close(adv, np.array([1 - baseline, -baseline, 0.6])[:, None] * m)


def test_gpg():
    m = np.ones((4, 2), np.float32)
    rewards = last_token_rewards([1.0, 0.0, 0.0, 2.0], m)
    index = jnp.array([0, 0, 1, 1])
    # alpha = B / #nonzero = 4 / 2; group means 0.5 and 1.0
    adv, _ = fx.compute(
        "gpg", token_level_rewards=rewards, response_mask=m, index=index, config=algo_cfg()
    )
    close(adv[:, 0], [1.0, -1.0, -2.0, 2.0])
    adv, _ = fx.compute(
        "gpg",
        token_level_rewards=rewards,
        response_mask=m,
        index=index,
        config=algo_cfg(f_norm=2.0),
    )
    close(adv[:, 1], [0.5, -0.5, -1.0, 1.0])


def test_registry_has_every_estimator():
    assert set(adv_lib.names()) >= {
        "gae",
        "grpo",
        "grpo_passk",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "opo",
        "gpg",
    }
    assert adv_lib.names() == sorted(adv_lib.names())


# ----------------------------------------------------------------------------- policy losses

# vanilla hand case, tokens (A, log_ratio): (1, .5) clip high; (-1, -.5) clip low; (-1, 1.5) dual
# clip; (2, 0) untouched. Row 0 = first two, row 1 = last two; column 2 is padding.
V_ADV = np.array([[1.0, -1.0, 0.0], [-1.0, 2.0, 0.0]], np.float32)
V_LOG_RATIO = np.array([[0.5, -0.5, 0.0], [1.5, 0.0, 0.0]], np.float32)
V_OLD = np.array([[-1.0, -2.0, 0.0], [-0.7, -1.2, 0.0]], np.float32)
V_MASK = np.array([[1, 1, 0], [1, 1, 0]], np.float32)


def run_loss(name, old, new, adv, mask, mode="token-mean", key=None, **cfg):
    cfg = {"dro_beta": 0.1, **cfg}
    return fx.run_loss(name, old, new, adv, mask, mode, key=key, rollout_correction=LOSS_RC, **cfg)


def test_vanilla_asymmetric_and_dual_clip():
    new = V_OLD + V_LOG_RATIO
    loss, metrics = run_loss(
        "vanilla", V_OLD, new, V_ADV, V_MASK, clip_ratio_low=0.2, clip_ratio_high=0.28
    )
    # token losses: -1.28 (clip at 1.28), 0.8 (clip at 0.8), 3 (dual clip), -2
    close(loss, (-1.28 + 0.8 + 3.0 - 2.0) / 4)
    close(metrics["actor/pg_clipfrac"], 2 / 4)
    close(metrics["actor/pg_clipfrac_lower"], 1 / 4)
    close(metrics["actor/ppo_kl"], -(0.5 - 0.5 + 1.5 + 0.0) / 4)
    loss, _ = run_loss(
        "vanilla",
        V_OLD,
        new,
        V_ADV,
        V_MASK,
        "seq-mean-token-sum",
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
    )
    close(loss, ((-1.28 + 0.8) + (3.0 - 2.0)) / 2)


def test_vanilla_gradient_only_through_unclipped_tokens():
    grad = jax.grad(lambda lp: run_loss("vanilla", V_OLD, lp, V_ADV, V_MASK)[0])(
        jnp.asarray(V_OLD + V_LOG_RATIO)
    )
    close(
        grad, [[0, 0, 0], [0, -2.0 / 4, 0]]
    )  # d(-A ratio)/dlogp = -A ratio = -2, token-mean over 4


def random_case(seed, shape=(3, 5), scale=0.3):
    rng = np.random.default_rng(seed)
    mask = np.ones(shape, np.float32)
    mask[0, 3:] = 0
    mask[1, 1] = 0  # a hole
    old = rng.normal(-1.0, 0.5, shape).astype(np.float32)
    new = (old + rng.normal(0, scale, shape)).astype(np.float32)
    adv = rng.normal(0, 1, shape).astype(np.float32)
    return old, new, adv, mask


def np_seq_mean_token_mean(losses, m):
    return np.mean((losses * m).sum(1) / m.sum(1))


def test_gspo_value_and_gradient():
    old, new, adv, m = random_case(1, scale=0.05)
    seq = ((new - old) * m).sum(1) / m.sum(1)
    r = np.exp(seq)[:, None]
    l1, l2 = -adv * r, -adv * np.clip(r, 0.8, 1.2)
    # verl 0.9.1 aggregates with the caller's loss_agg_mode (older verl forced seq-mean-token-mean)
    loss, metrics = run_loss("gspo", old, new, adv, m, "token-mean")
    close(loss, (np.maximum(l1, l2) * m).sum() / m.sum())
    loss_seq, _ = run_loss("gspo", old, new, adv, m, "seq-mean-token-mean")
    close(loss_seq, np_seq_mean_token_mean(np.maximum(l1, l2), m))
    close(metrics["actor/pg_clipfrac"], ((l2 > l1) * m).sum() / m.sum())
    close(metrics["actor/ppo_kl"], ((old - new) * m).sum() / m.sum())
    assert np.all(np.abs(seq) < np.log(1.2))  # nothing clipped: the gradient below is the full one
    grad = jax.grad(lambda lp: run_loss("gspo", old, lp, adv, m)[0])(jnp.asarray(new))
    close(grad, -adv * r * m / m.sum())
    grad = jax.grad(lambda lp: run_loss("gspo", old, lp, adv, m, "seq-mean-token-mean")[0])(
        jnp.asarray(new)
    )
    close(grad, -adv * r * m / m.sum(1, keepdims=True) / 3)


def test_gspo_clips_on_the_sequence_ratio():
    old = np.zeros((1, 2), np.float32)
    new = np.array([[0.6, 0.0]], np.float32)  # sequence log-ratio 0.3 -> ratio 1.3499 > 1.2
    adv = np.array([[1.0, -1.0]], np.float32)
    loss, metrics = run_loss("gspo", old, new, adv, np.ones((1, 2), np.float32))
    close(loss, (-1.2 + np.exp(0.3)) / 2)  # A>0 clipped at 1.2; A<0 keeps the unclipped ratio
    close(metrics["actor/pg_clipfrac"], 0.5)


def test_geo_mean():
    old, new, adv, m = random_case(2)
    low, high = 0.2, 0.28
    lr = new - old
    c = np.clip(lr, -low, high)
    sgn = np.sign(adv)
    k = sgn * np.minimum(sgn * lr, sgn * c)
    n = m.sum(1)
    expected = np.mean(-((adv * m).sum(1) / n) * np.exp((k * m).sum(1) / n))
    loss, metrics = run_loss(
        "geo_mean", old, new, adv, m, "seq-mean-token-sum", clip_ratio_low=low, clip_ratio_high=high
    )
    close(loss, expected)
    clipped = lr != c
    assert clipped[m > 0].any()
    close(metrics["actor/pg_clipfrac"], (clipped * (adv > 0) * m).sum() / m.sum())
    close(metrics["actor/pg_clipfrac_lower"], (clipped * (adv < 0) * m).sum() / m.sum())


def test_geo_mean_clips_one_side_by_sign_of_advantage():
    old = np.zeros((2, 3), np.float32)
    new = np.array([[0.5, -0.5, 0.0], [0.5, -0.5, 9.0]], np.float32)
    adv = np.array([[1.0, 1.0, 0.0], [-2.0, -2.0, 0.0]], np.float32)
    m = np.array([[1, 1, 0], [1, 1, 0]], np.float32)
    loss, metrics = run_loss("geo_mean", old, new, adv, m, clip_ratio_low=0.2, clip_ratio_high=0.28)
    # A > 0: log-ratios clipped above only -> [0.28, -0.5]; A < 0: below only -> [0.5, -0.2]
    close(loss, (-1.0 * np.exp((0.28 - 0.5) / 2) + 2.0 * np.exp((0.5 - 0.2) / 2)) / 2)
    close(metrics["actor/pg_clipfrac"], 0.5)
    close(metrics["actor/pg_clipfrac_lower"], 0.5)


def test_sapo():
    old, new, adv, m = random_case(3)
    ratio = np.exp(new - old)
    tau = np.where(adv > 0, 1.5, 2.0)
    gate = 4.0 / tau / (1.0 + np.exp(-tau * (ratio - 1.0)))
    loss, metrics = run_loss("sapo", old, new, adv, m, "token-mean", tau_pos=1.5, tau_neg=2.0)
    close(loss, np_seq_mean_token_mean(-gate * adv, m))
    close(metrics["actor/pg_clipfrac"], 0.0)
    close(metrics["actor/ppo_kl"], ((old - new) * m).sum() / m.sum())


def test_sapo_gate_at_ratio_one_is_plain_policy_gradient_scale():
    # sigmoid(0) * 4 / tau = 2 / tau: with tau_pos = 1 the loss of A=1 at ratio 1 is -2
    loss, _ = run_loss("sapo", np.zeros((1, 1)), np.zeros((1, 1)), np.ones((1, 1)), np.ones((1, 1)))
    close(loss, -2.0)


def test_cispo_value_and_gradient():
    old, new, adv, m = random_case(4)
    ratio = np.exp(new - old)
    w = np.clip(ratio, 0.8, 1.2)
    loss, metrics = run_loss("cispo", old, new, adv, m)
    close(loss, (-w * adv * new * m).sum() / m.sum())
    close(metrics["actor/pg_clipfrac"], ((ratio != w) * m).sum() / m.sum())
    grad = jax.grad(lambda lp: run_loss("cispo", old, lp, adv, m)[0])(jnp.asarray(new))
    close(grad, -w * adv * m / m.sum())  # the clipped weight is a constant


def test_gpg_loss():
    old = np.zeros((2, 2), np.float32)
    new = np.array([[-1.0, -2.0], [-0.5, 9.0]], np.float32)
    adv = np.array([[1.0, 1.0], [-2.0, 5.0]], np.float32)
    m = np.array([[1, 1], [1, 0]], np.float32)
    loss, metrics = run_loss("gpg", old, new, adv, m)
    close(loss, (1.0 + 2.0 - 1.0) / 3)
    close(metrics["actor/ppo_kl"], (1.0 + 2.0 + 0.5) / 3)
    close(metrics["actor/pg_clipfrac"], 0.0)


def clip_cov_case():
    rng = np.random.default_rng(5)
    shape = (4, 6)
    m = np.ones(shape, np.float32)
    m[0, 4:] = 0
    m[2, 5] = 0
    old = rng.normal(-1.0, 0.4, shape).astype(np.float32)
    new = (old + rng.normal(0, 0.3, shape)).astype(np.float32)
    adv = rng.normal(0, 1.5, shape).astype(np.float32)
    return old, new, adv, m


def np_clip_cov_parts(old, new, adv, m, lb, ub):
    ratio = np.exp(new - old)
    l1, l2 = -adv * ratio, -adv * np.clip(ratio, 0.8, 1.2)
    mean = lambda x: (x * m).sum() / m.sum()
    cov = (adv - mean(adv)) * (new - mean(new))
    candidate = (m > 0) & ~(l2 > l1) & (cov > lb) & (cov < ub)
    return np.maximum(l1, l2), cov, candidate


def test_clip_cov_deterministic_without_key():
    old, new, adv, m = clip_cov_case()
    lb, ub = -0.2, 0.9
    token_loss, cov, candidate = np_clip_cov_parts(old, new, adv, m, lb, ub)
    # the case exercises every exclusion rule: above ub, below lb, already clipped by PPO
    in_band = (m > 0) & (cov > lb) & (cov < ub)
    assert candidate.sum() >= 4 and ((cov >= ub) & (m > 0)).any() and ((cov <= lb) & (m > 0)).any()
    assert (in_band & ~candidate).any() and cov[in_band & ~candidate].max() > np.sort(
        cov[candidate]
    )[-2]
    n_clip = int(0.1 * m.sum())  # 22 valid tokens -> 2
    assert n_clip == 2
    top = np.argsort(-np.where(candidate, cov, -np.inf), axis=None, kind="stable")[:n_clip]
    detached = np.zeros(m.size, bool)
    detached[top] = True
    detached = detached.reshape(m.shape)
    loss, metrics = run_loss(
        "clip_cov", old, new, adv, m, clip_cov_ratio=0.1, clip_cov_lb=lb, clip_cov_ub=ub
    )
    close(loss, (token_loss * m * ~detached).sum() / m.sum())
    close(metrics["actor/pg_clipfrac"], n_clip / m.sum())


def test_clip_cov_random_with_key_detaches_n_clip_candidates():
    old, new, adv, m = clip_cov_case()
    token_loss, _, candidate = np_clip_cov_parts(old, new, adv, m, -0.2, 0.9)
    total = (token_loss * m).sum()
    # n_clip = max(floor(0.01 * 22), 1) = 1: the loss drops exactly one candidate token
    possible = [(total - token_loss[i]) / m.sum() for i in zip(*np.nonzero(candidate))]
    seen = set()
    for seed in range(6):
        loss, metrics = run_loss(
            "clip_cov",
            old,
            new,
            adv,
            m,
            key=jax.random.PRNGKey(seed),
            clip_cov_ratio=0.01,
            clip_cov_lb=-0.2,
            clip_cov_ub=0.9,
        )
        dist = np.abs(np.array(possible) - float(loss))
        assert dist.min() < ATOL
        seen.add(int(dist.argmin()))
        close(metrics["actor/pg_clipfrac"], 1 / m.sum())
    assert len(seen) > 1  # the choice does depend on the key


def test_kl_cov():
    old, new, adv, m = clip_cov_case()
    lr = new - old
    valid = m > 0
    cov = (adv - adv[valid].mean()) * (new - new[valid].mean())
    k = int(0.2 * m.sum())  # 22 valid -> 4
    top = np.argsort(-np.where(valid, cov, -np.inf), axis=None, kind="stable")[:k]
    token_loss = -adv * np.exp(lr)
    token_loss.reshape(-1)[top] += 0.5 * np.abs(lr).reshape(-1)[top]
    loss, metrics = run_loss(
        "kl_cov", old, new, adv, m, "seq-mean-token-sum", kl_cov_ratio=0.2, ppo_kl_coef=0.5
    )
    close(loss, (token_loss * m).sum(1).mean())
    close(metrics["actor/ppo_kl"], (np.abs(lr) * m).sum() / m.sum())


def test_every_loss_reports_the_same_metric_keys():
    old, new, adv, m = random_case(6)
    for name in loss_lib.policy_loss_names():
        _, metrics = run_loss(name, old, new, adv, m)
        extra = (
            [k for k in metrics if k.startswith("rollout_corr/")] if name == "bypass_mode" else []
        )
        assert sorted(metrics) == sorted(
            ["actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"] + extra
        ), name


def test_policy_loss_registry():
    assert set(loss_lib.policy_loss_names()) >= {
        "vanilla",
        "gspo",
        "geo_mean",
        "sapo",
        "cispo",
        "gpg",
        "clip_cov",
        "kl_cov",
    }


# ---------------------------------------------------------------------- aggregation, value, entropy

AGG_LOSS = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], np.float32)
AGG_MASK = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], np.float32)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("seq-mean-token-sum", (3 + 4) / 2),  # the all-padding row is not counted
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("token-sum", 1 + 2 + 4),
        ("seq-mean-token-sum-norm", (3 + 4) / 2 / 3),  # mean over 2 rows, default factor T = 3
    ],
)
def test_agg_modes(mode, expected):
    close(loss_lib.agg_loss(AGG_LOSS, AGG_MASK, mode), expected)


def test_agg_sum_norm_with_scale_factor():
    close(
        loss_lib.agg_loss(AGG_LOSS, AGG_MASK, "seq-mean-token-sum-norm", loss_scale_factor=10), 0.35
    )


def test_agg_empty_mask_is_zero():
    for mode in loss_lib.loss_agg_modes():
        close(loss_lib.agg_loss(AGG_LOSS, np.zeros_like(AGG_MASK), mode), 0.0)


def test_value_loss():
    vpreds = np.array([[1.0, 2.0, 0.0]], np.float32)
    values = np.array([[0.5, 2.1, 0.0]], np.float32)
    returns = np.array([[2.0, 1.0, 5.0]], np.float32)
    mask = np.array([[1, 1, 0]], np.float32)
    loss, clipfrac = loss_lib.value_loss(vpreds, returns, values, mask, 0.2, "token-mean")
    # token 0: vpred clipped to 0.7 -> max(1, 1.69); token 1: clip is a no-op -> 1
    close(loss, 0.5 * (1.69 + 1.0) / 2)
    close(clipfrac, 0.5)


def test_entropy_from_logits():
    p_entropy = -(0.25 * np.log(0.25) + 0.75 * np.log(0.75))
    logits = jnp.array([[0.0, np.log(3.0), -jnp.inf], [1e4, 1e4 + np.log(3.0), -jnp.inf]])
    close(loss_lib.entropy_from_logits(logits), [p_entropy, p_entropy])
    close(loss_lib.entropy_from_logits(jnp.zeros((2, 3, 7))), np.full((2, 3), np.log(7)))
    grad = jax.grad(lambda x: loss_lib.entropy_from_logits(x).sum())(logits)
    assert np.isfinite(np.asarray(grad)).all()
    # dH/dz_i = -p_i (log p_i + H)
    p = np.array([0.25, 0.75])
    close(grad[0, :2], -p * (np.log(p) + p_entropy))


# ----------------------------------------------------------------------------- KL


def test_kl_kinds():
    logp = jnp.array([-1.0, -2.0, 0.0])
    ref = jnp.array([-1.5, -1.0, -30.0])
    expected = {
        "kl": [0.5, -1.0, 30.0],
        "abs": [0.5, 1.0, 30.0],
        "mse": [0.125, 0.5, 450.0],
        # d = ref - logp clipped to [-20, 20]: exp(d) - d - 1, clipped to [-10, 10]
        "low_var_kl": [np.exp(-0.5) - 0.5, np.e - 2.0, 10.0],
    }
    for aliases, kind in [
        (("kl", "k1"), "kl"),
        (("abs",), "abs"),
        (("mse", "k2"), "mse"),
        (("low_var_kl", "k3"), "low_var_kl"),
    ]:
        for alias in aliases:
            close(kl_lib.kl_penalty(logp, ref, alias), expected[kind], atol=1e-4)


def test_apply_kl_penalty_metric_is_mean_of_row_means():
    scores = np.array([[0, 0, 1.0], [0, 2.0, 0]], np.float32)
    old = np.array([[-1.0, -1.0, -1.0], [-1.0, -1.0, 7.0]], np.float32)
    ref = np.array([[-1.5, -1.5, -1.5], [-2.0, -1.5, 0.0]], np.float32)
    mask = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
    rewards, metrics = kl_lib.apply_kl_penalty(scores, old, ref, mask, 0.5, "kl")
    close(rewards, [[-0.25, -0.25, 0.75], [-0.5, 1.75, 0.0]])
    close(metrics["actor/reward_kl_penalty"], (0.5 + (1.0 + 0.5) / 2) / 2)


def kl_algo_cfg(**ctrl):
    return fx.algo_cfg(kl_ctrl=ctrl)


def test_kl_controllers():
    adaptive = kl_algo_cfg(type="adaptive", kl_coef=0.1, target_kl=0.1, horizon=1000)
    beta = kl_lib.kl_ctrl_init(adaptive)
    close(beta, 0.1)
    update = kl_lib.make_kl_controller(adaptive)
    close(update(beta, 0.11, 100), 0.1 * (1 + 0.1 * 100 / 1000))
    close(update(beta, 0.5, 100), 0.1 * (1 + 0.2 * 100 / 1000))  # error capped at 0.2
    close(update(beta, 0.0, 100), 0.1 * (1 - 0.2 * 100 / 1000))
    jitted = jax.jit(lambda b, kl: update(b, kl, 64))
    close(jitted(beta, jnp.float32(0.09)), 0.1 * (1 - 0.1 * 64 / 1000))
    fixed = kl_algo_cfg(type="fixed", kl_coef=0.05)
    close(kl_lib.make_kl_controller(fixed)(kl_lib.kl_ctrl_init(fixed), 3.0, 100), 0.05)
    close(kl_lib.kl_ctrl_init(fx.algo_cfg()), 0.001)  # base_config's (verl's) kl_coef
    with pytest.raises(ValueError, match="horizon"):
        kl_lib.kl_ctrl_init(kl_algo_cfg(type="adaptive", horizon=0))


# ----------------------------------------------------------------------------- masking, names, jit


def masked_inputs(seed=7):
    rng = np.random.default_rng(seed)
    mask = np.array(
        [[1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], np.float32
    )
    clean = {
        k: (rng.normal(size=mask.shape) * mask).astype(np.float32)
        for k in ("rewards", "values", "old", "new", "adv", "ref")
    }
    clean["old"] -= 1.0 * mask
    garbage = {}
    junk = np.array([np.nan, np.inf, -np.inf, 1e6, -3e4], np.float32)
    for k, v in clean.items():
        g = v.copy()
        g[mask == 0] = rng.choice(junk, size=int((mask == 0).sum()))
        garbage[k] = g
    return mask, clean, garbage


INDEX = jnp.array([0, 0, 2, 2])


def all_outputs(x, mask):
    """Every public output for inputs `x` (advantages, losses, their gradients, value loss, KL)."""
    out = {}
    cfg = algo_cfg(gamma=0.95, lam=0.9)
    for name in adv_lib.names():
        out[name] = fx.compute(
            name,
            token_level_rewards=x["rewards"],
            response_mask=mask,
            index=INDEX,
            values=x["values"],
            reward_baselines=jnp.array([0.1, 0.2, 0.3, 0.4]),
            old_log_prob=x["old"],
            threshold=1.0,
            sum_pi_squared=jnp.abs(x["values"]),
            rollout_is_weights=jnp.abs(x["adv"]),
            config=cfg,
        )
    for name in loss_lib.policy_loss_names():
        fn = lambda lp, name=name: run_loss(
            name,
            x["old"],
            lp,
            x["adv"],
            mask,
            clip_cov_ratio=0.2,
            clip_cov_lb=-1.0,
            kl_cov_ratio=0.2,
        )
        out["loss/" + name] = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(x["new"]))
    out["value_loss"] = loss_lib.value_loss(
        x["new"], x["rewards"], x["values"], mask, 0.2, "seq-mean-token-mean"
    )
    out["kl_reward"] = kl_lib.apply_kl_penalty(x["rewards"], x["old"], x["ref"], mask, 0.3, "k3")
    return out


def test_garbage_in_masked_positions_changes_nothing():
    mask, clean, garbage = masked_inputs()
    expected, actual = all_outputs(clean, mask), all_outputs(garbage, mask)
    for key in expected:
        chex.assert_trees_all_close(actual[key], expected[key], atol=1e-6)
        assert all(
            np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree_util.tree_leaves(actual[key])
        ), key
    for name in adv_lib.names():  # advantages and returns are exactly 0 off the mask
        for arr in expected[name]:
            assert not np.asarray(arr)[mask == 0].any(), name
    for name in loss_lib.policy_loss_names():  # no gradient reaches padded positions
        assert not np.asarray(actual["loss/" + name][1])[mask == 0].any(), name
    assert not np.asarray(actual["kl_reward"][0])[mask == 0].any()


def test_unknown_names_raise_and_list_valid_names():
    x = jnp.zeros((2, 3))
    cases = [  # (call, the bad name, the names the message must list)
        (
            lambda: fx.compute("nope", token_level_rewards=x, response_mask=x, config=algo_cfg()),
            "nope",
            adv_lib.names(),
        ),
        (lambda: run_loss("nope", x, x, x, x), "nope", loss_lib.policy_loss_names()),
        (
            lambda: run_loss("vanilla", x, x, x, x, mode="seq-sum"),
            "seq-sum",
            loss_lib.loss_agg_modes(),
        ),
        (lambda: loss_lib.agg_loss(x, x, "token_mean"), "token_mean", loss_lib.loss_agg_modes()),
        (
            lambda: kl_lib.kl_penalty(x, x, "k4"),
            "k4",
            kl_lib.kl_kinds(),
        ),
        (lambda: kl_lib.kl_ctrl_init(kl_algo_cfg(type="pid")), "pid", ["adaptive", "fixed"]),
    ]
    for call, bad, valid in cases:
        with pytest.raises(ValueError) as err:
            call()
        assert repr(bad) in str(err.value)
        for name in valid:
            assert name in str(err.value), (bad, name)


def test_missing_inputs_raise():
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="index"):
        fx.compute("grpo", token_level_rewards=x, response_mask=x, config=algo_cfg())
    with pytest.raises(ValueError, match="values"):
        fx.compute("gae", token_level_rewards=x, response_mask=x, config=algo_cfg())
    with pytest.raises(ValueError, match="reward_baselines"):
        fx.compute("remax", token_level_rewards=x, response_mask=x, config=algo_cfg())
    with pytest.raises(ValueError, match="clip_ratio_c"):
        run_loss("vanilla", x, x, x, x, clip_ratio_c=1.0)


def test_everything_jits_once_and_matches_eager():
    mask, clean, _ = masked_inputs(seed=8)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(x):
        return all_outputs(x, mask)

    _, other, _ = masked_inputs(seed=9)
    for x in (clean, other):
        jx = {k: jnp.asarray(v) for k, v in x.items()}
        chex.assert_trees_all_close(step(jx), all_outputs(x, mask), atol=1e-5)
