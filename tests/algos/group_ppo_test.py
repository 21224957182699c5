"""Tests for jrl.algos.group_ppo: a hand-worked batch, limiting cases, a plain-Python reference,
the adaptive threshold, masking, the registry entry points and jit.

Expected numbers are worked out by hand in the comments or computed here with plain loops written
from the definition (docs/algorithms.md, GROUP-PPO), never by calling the code under test.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.algos import advantages as adv_lib
from jrl.algos import group_ppo as gp

from helpers import algos_fixtures as fx

ATOL = 1e-5
W1 = -30.0  # old_log_prob with p = exp(-30) ~ 1e-13, so w = (1 - p)^2 = 1 in float32
W4 = math.log(0.5)  # p = 1/2, w = 1/4


def cfg(gamma=1.0, lam=1.0, **group):
    """The complete algorithm section (base_config) with gamma, lam and group_params overrides."""
    return fx.algo_cfg(gamma=gamma, lam=lam, group_params=group)


def close(actual, expected, atol=ATOL):
    np.testing.assert_allclose(
        np.asarray(actual), np.asarray(expected, np.float64), rtol=0, atol=atol
    )


def np_whiten(x, m):
    """Whole-batch whitening with the unbiased variance (0 on masked positions)."""
    n = m.sum()
    mean = (x * m).sum() / n
    var = (((x - mean) ** 2) * m).sum() / (n - 1)
    return (x - mean) / np.sqrt(var + 1e-8) * m


def run(r, m, v, logp, tau, config):
    return gp.group_ppo(
        token_level_rewards=jnp.asarray(r, jnp.float32),
        response_mask=jnp.asarray(m, jnp.float32),
        values=jnp.asarray(v, jnp.float32),
        old_log_prob=jnp.asarray(logp, jnp.float32),
        threshold=jnp.float32(tau),
        gamma=config.gamma,
        lam=config.lam,
        params=gp.group_params(config),
    )


def reference(r, m, v, logp, tau, max_size, eps, gamma, lam):
    """GROUP-PPO by plain loops over each row's valid positions, in float64.

    Returns (segment advantages before whitening, returns, critic mask, rho, token returns).
    """
    shape = np.shape(m)
    seg_adv, rets, crit, rho, tok_ret = (np.zeros(shape) for _ in range(5))
    for b in range(shape[0]):
        idx = [t for t in range(shape[1]) if m[b][t]]
        a_tok, next_v, next_a = {}, 0.0, 0.0  # per-token GAE, skipping masked positions
        for t in reversed(idx):
            a_tok[t] = r[b][t] + gamma * next_v - v[b][t] + gamma * lam * next_a
            next_v, next_a = v[b][t], a_tok[t]
            tok_ret[b, t] = a_tok[t] + v[b][t]
        segments, w_sum, q_sum = [], 0.0, 0.0
        for t in idx:
            w = (1.0 - math.exp(logp[b][t])) ** 2
            if segments:
                seg = segments[-1]
                w_sum, q_sum = w_sum + w, q_sum + w * a_tok[t] ** 2
                rho[b, t] = (w_sum * a_tok[seg[0]] ** 2 + eps) / (q_sum + eps)
                if rho[b, t] <= tau and len(seg) + 1 <= max_size:
                    seg.append(t)
                    continue
            segments.append([t])
            w_sum, q_sum = w, w * a_tok[t] ** 2
        next_v, next_a = 0.0, 0.0
        for seg in reversed(segments):
            ret = sum(gamma**i * r[b][t] for i, t in enumerate(seg))
            n = len(seg)
            adv = ret + gamma**n * next_v - v[b][seg[0]] + (gamma * lam) ** n * next_a
            seg_adv[b, seg] = adv
            rets[b, seg] = adv + v[b][seg[0]]
            crit[b, seg[0]] = 1.0
            next_v, next_a = v[b][seg[0]], adv
    return seg_adv, rets, crit, rho, tok_ret


def random_batch(seed, shape=(4, 7)):
    """Rows of 7, 5 and 3 right-padded valid tokens, and a row [1, 0, 1, 1, 1, 0, 0] with a hole
    (a multi-turn observation token); normal rewards and values, old log-probs in (-3, 0]."""
    rng = np.random.default_rng(seed)
    m = np.zeros(shape, np.float32)
    m[0, :] = 1
    m[1, :5] = 1
    m[2, :3] = 1
    m[3, [0, 2, 3, 4]] = 1  # a hole at t = 1 (multi-turn observation token)
    r = (rng.normal(size=shape) * m).astype(np.float32)
    v = (rng.normal(size=shape) * m).astype(np.float32)
    logp = (-3.0 * rng.uniform(size=shape) * m).astype(np.float32)
    return r, m, v, logp


# ----------------------------------------------------------------------------- a worked batch

# gamma = 1, lam = 1/2, tau = 2, L = 3, eps = 1e-12 (below float32 resolution of these sums, so
# rho = r_grpo / r_ppo). Row 0 has 6 valid tokens, row 1 has 4 and two padded positions.
#
# Row 0: r = [3/4, 1/8, 5/8, -3/16, -1/8, 3/4], V = [1/2, 1/2, 3/4, 1/2, 1/2, 1/4]
#   A_tok[t] = r_t + V_{t+1} - V_t + A_tok[t+1] / 2  (V_6 = A_tok[6] = 0), from the end:
#     A5 = 3/4 - 1/4 = 1/2;             A4 = -1/8 + 1/4 - 1/2 + 1/4 = -1/8;
#     A3 = -3/16 + 0 - 1/16 = -1/4;     A2 = 5/8 - 1/4 - 1/8 = 1/4;
#     A1 = 1/8 + 1/4 + 1/8 = 1/2;       A0 = 3/4 + 0 + 1/4 = 1
#   w = [1, 1, 1, 1/4, 1, 1]
#   a = 0, W = 1, Q = 1
#   t=1: W' = 2,   Q' = 1 + 1/4 = 5/4,          rho = 2 * 1 / (5/4) = 8/5          keep
#   t=2: W' = 3,   Q' = 5/4 + 1/16 = 21/16,     rho = 3 / (21/16) = 16/7 > 2       cut
#        segment [0, 1] ends; a = 2, A_tok[a] = 1/4, W = 1, Q = 1/16
#   t=3: W' = 5/4, Q' = 1/16 + 1/64 = 5/64,     rho = (5/4)(1/16) / (5/64) = 1     keep
#   t=4: W' = 9/4, Q' = 5/64 + 1/64 = 3/32,     rho = (9/4)(1/16) / (3/32) = 3/2   keep
#   t=5: W' = 13/4, Q' = 3/32 + 1/4 = 11/32,    rho = (13/64) / (11/32) = 13/22 <= 2, but the
#        segment would hold 4 > L = 3 tokens: cut; segment [2, 4] ends; a = 5
#   t=5 is the last valid token: segment [5, 5].
#   Segments [0,1], [2,4], [5]; backward:
#     [5]:   R = 3/4;                     A = 3/4 + 0 - 1/4 = 1/2
#     [2,4]: R = 5/8 - 3/16 - 1/8 = 5/16; A = 5/16 + 1^3 * V5 - V2 + (1/2)^3 * 1/2
#                                            = 5/16 + 1/4 - 3/4 + 1/16 = -1/8
#     [0,1]: R = 3/4 + 1/8 = 7/8;         A = 7/8 + V2 - V0 + (1/2)^2 * (-1/8)
#                                            = 7/8 + 3/4 - 1/2 - 1/32 = 35/32
#   returns A_k + V[a_k]: 35/32 + 1/2 = 51/32; -1/8 + 3/4 = 5/8; 1/2 + 1/4 = 3/4
#
# Row 1: r = [5/8, 0, 3/8, 1/2], V = [1/4, 1/2, 1/2, 3/4], w = [1/4, 1, 1, 1/4]
#   A3 = 1/2 - 3/4 = -1/4;  A2 = 3/8 + 3/4 - 1/2 - 1/8 = 1/2;
#   A1 = 0 + 1/2 - 1/2 + 1/4 = 1/4;  A0 = 5/8 + 1/2 - 1/4 + 1/8 = 1
#   a = 0, W = 1/4, Q = 1/4
#   t=1: W' = 5/4, Q' = 1/4 + 1/16 = 5/16,      rho = (5/4) * 1 / (5/16) = 4 > 2   cut
#        segment [0, 0] ends; a = 1, A_tok[a] = 1/4, W = 1, Q = 1/16
#   t=2: W' = 2,   Q' = 1/16 + 1/4 = 5/16,      rho = 2 (1/16) / (5/16) = 2/5      keep
#   t=3: W' = 9/4, Q' = 5/16 + 1/64 = 21/64,    rho = (9/64) / (21/64) = 3/7       keep
#   Segments [0], [1,3]; backward:
#     [1,3]: R = 0 + 3/8 + 1/2 = 7/8;     A = 7/8 + 0 - 1/2 = 3/8
#     [0]:   R = 5/8;                     A = 5/8 + V1 - V0 + (1/2) * 3/8 = 7/8 + 3/16 = 17/16
#   returns: 17/16 + 1/4 = 21/16; 3/8 + 1/2 = 7/8
#
# Metrics: K = 3 + 2 = 5 segments over 10 valid tokens: compression 1 - 5/10 = 1/2, mean segment
# length 2; rho_mean = (8/5 + 16/7 + 1 + 3/2 + 13/22 + 4 + 2/5 + 3/7) / 8.
HAND_R = np.array(
    [[3 / 4, 1 / 8, 5 / 8, -3 / 16, -1 / 8, 3 / 4], [5 / 8, 0, 3 / 8, 1 / 2, 0, 0]], np.float32
)
HAND_V = np.array(
    [[1 / 2, 1 / 2, 3 / 4, 1 / 2, 1 / 2, 1 / 4], [1 / 4, 1 / 2, 1 / 2, 3 / 4, 0, 0]], np.float32
)
HAND_LOGP = np.array([[W1, W1, W1, W4, W1, W1], [W4, W1, W1, W4, 0, 0]], np.float32)
HAND_M = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], np.float32)
HAND_CFG = {"gamma": 1.0, "lam": 0.5, "group_max_size": 3, "group_epsilon": 1e-12}


def test_hand_worked_batch():
    out = run(HAND_R, HAND_M, HAND_V, HAND_LOGP, 2.0, cfg(**HAND_CFG))
    seg_adv = np.array(
        [[35 / 32, 35 / 32, -1 / 8, -1 / 8, -1 / 8, 1 / 2], [17 / 16, 3 / 8, 3 / 8, 3 / 8, 0, 0]]
    )
    close(out.segment_advantages, seg_adv)
    close(
        out.returns,
        [[51 / 32, 51 / 32, 5 / 8, 5 / 8, 5 / 8, 3 / 4], [21 / 16, 7 / 8, 7 / 8, 7 / 8, 0, 0]],
    )
    np.testing.assert_array_equal(out.critic_mask, [[1, 0, 1, 0, 0, 1], [1, 1, 0, 0, 0, 0]])
    close(out.advantages, np_whiten(seg_adv, HAND_M))
    close(out.rho, [[0, 8 / 5, 16 / 7, 1, 3 / 2, 13 / 22], [0, 4, 2 / 5, 3 / 7, 0, 0]], atol=1e-5)
    a_tok = np.array([[1, 1 / 2, 1 / 4, -1 / 4, -1 / 8, 1 / 2], [1, 1 / 4, 1 / 2, -1 / 4, 0, 0]])
    close(out.token_returns, (a_tok + HAND_V) * HAND_M)
    rho_mean = (8 / 5 + 16 / 7 + 1 + 3 / 2 + 13 / 22 + 4 + 2 / 5 + 3 / 7) / 8
    close(out.metrics["group/total_endpoints"], 5)
    close(out.metrics["group/compression_ratio"], 0.5)
    close(out.metrics["group/mean_segment_len"], 2.0)
    close(out.metrics["group/threshold"], 2.0)
    close(out.metrics["group/rho_mean"], rho_mean)


def test_hand_worked_batch_threshold_moves_the_cuts():
    # tau = 4.5, same inputs as above:
    # row 0: t=1 rho = 8/5, t=2 rho = 16/7: keep; t=3: W' = 3 + 1/4 = 13/4,
    #        Q' = 21/16 + 1/64 = 85/64, rho = (13/4) / (85/64) = 208/85 <= 4.5, but 4 > L tokens:
    #        cut (a = 3, W = 1/4, Q = 1/64); t=4: W' = 5/4, Q' = 1/32,
    #        rho = (5/4)(1/16) / (1/32) = 5/2 keep; t=5: W' = 9/4, Q' = 9/32,
    #        rho = (9/64) / (9/32) = 1/2 keep                              -> [0,2], [3,5]
    # row 1: t=1 rho = 4 keep (W = 5/4, Q = 5/16); t=2: W' = 9/4, Q' = 9/16, rho = 4 keep;
    #        t=3: W' = 5/2, Q' = 37/64, rho = 160/37 <= 4.5, but 4 > L tokens: cut  -> [0,2], [3]
    out = run(HAND_R, HAND_M, HAND_V, HAND_LOGP, 4.5, cfg(**HAND_CFG))
    np.testing.assert_array_equal(out.critic_mask, [[1, 0, 0, 1, 0, 0], [1, 0, 0, 1, 0, 0]])
    close(out.rho, [[0, 8 / 5, 16 / 7, 208 / 85, 5 / 2, 1 / 2], [0, 4, 4, 160 / 37, 0, 0]])
    # A lower tau cuts more: tau = 1/2 against the plain-loop reference.
    low = run(HAND_R, HAND_M, HAND_V, HAND_LOGP, 0.5, cfg(**HAND_CFG))
    ref = reference(HAND_R, HAND_M, HAND_V, HAND_LOGP, 0.5, 3, 1e-12, 1.0, 0.5)
    np.testing.assert_array_equal(low.critic_mask, ref[2])
    assert low.critic_mask.sum() > 5


# ----------------------------------------------------------------------------- limiting cases


def test_max_size_one_is_gae():
    r, m, v, logp = random_batch(0)
    config = cfg(gamma=0.9, lam=0.8, group_max_size=1)
    full = fx.compute_full(
        "group_ppo",
        token_level_rewards=r,
        response_mask=m,
        values=v,
        old_log_prob=logp,
        threshold=jnp.float32(1.0),
        config=config,
    )
    gae_adv, gae_ret = fx.compute(
        "gae", token_level_rewards=r, response_mask=m, values=v, config=config
    )
    # equal up to float32 rounding: the two scans are compiled separately (max difference seen:
    # one ulp, 6e-8)
    np.testing.assert_allclose(full["advantages"], gae_adv, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(full["returns"], gae_ret, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(full["critic_mask"], m)
    close(full["metrics"]["group/compression_ratio"], 0.0)
    close(full["metrics"]["group/mean_segment_len"], 1.0)


def test_infinite_threshold_gives_one_segment_per_response():
    r, m, v, logp = random_batch(1)
    m[3] = [1, 1, 1, 1, 0, 0, 0]  # right padding only, so each row's first valid token is t = 0
    r, v, logp = r * m, v * m, logp * m
    gamma = 0.9
    out = run(r, m, v, logp, np.inf, cfg(gamma=gamma, lam=0.7, group_max_size=7))
    # A = sum_t gamma^t r_t - V[0] on every valid token (lam plays no part with one segment)
    per_row = (r * gamma ** np.arange(7)).sum(1) - v[:, 0]
    close(out.segment_advantages, per_row[:, None] * m)
    close(out.advantages, np_whiten(per_row[:, None] * m, m))
    close(out.returns, (per_row + v[:, 0])[:, None] * m)
    expected_mask = np.zeros_like(m)
    expected_mask[:, 0] = 1
    np.testing.assert_array_equal(out.critic_mask, expected_mask)
    close(out.metrics["group/total_endpoints"], 4)


def test_gamma_lam_one_gives_return_minus_value_at_segment_start():
    r, m, v, logp = random_batch(2)
    out = run(r, m, v, logp, 1.2, cfg(gamma=1.0, lam=1.0, group_max_size=3))
    crit = np.asarray(out.critic_mask)
    assert crit.sum() > 6, "the case needs several segments per row to mean anything"
    for b in range(m.shape[0]):
        start = None
        for t in range(m.shape[1]):
            if not m[b, t]:
                continue
            start = t if crit[b, t] else start
            g_start = sum(r[b, s] for s in range(start, m.shape[1]) if m[b, s])  # G(a_k)
            close(out.segment_advantages[b, t], g_start - v[b, start])


# ----------------------------------------------------------------------------- reference


@pytest.mark.parametrize(
    "tau,max_size,gamma,lam",
    [(0.5, 16, 0.9, 0.95), (1.0, 3, 1.0, 0.9), (2.0, 2, 0.95, 1.0), (1.5, 4, 0.8, 0.5)],
)
def test_matches_plain_loop_reference(tau, max_size, gamma, lam):
    r, m, v, logp = random_batch(3 + max_size)
    out = run(r, m, v, logp, tau, cfg(gamma=gamma, lam=lam, group_max_size=max_size))
    seg_adv, rets, crit, rho, tok_ret = reference(r, m, v, logp, tau, max_size, 1e-6, gamma, lam)
    np.testing.assert_array_equal(out.critic_mask, crit)
    assert 4 < crit.sum() < m.sum(), "want real segments, neither one per row nor per token"
    close(out.segment_advantages, seg_adv)
    close(out.advantages, np_whiten(seg_adv, m))
    close(out.returns, rets)
    close(out.rho, rho, atol=1e-4)
    close(out.token_returns, tok_ret)
    tried = (m.sum(1) - 1).sum()  # every valid token but each row's first
    close(out.metrics["group/rho_mean"], rho.sum() / tried, atol=1e-4)
    close(out.metrics["group/total_endpoints"], crit.sum())
    close(out.metrics["group/compression_ratio"], 1 - crit.sum() / m.sum())


# ----------------------------------------------------------------------------- threshold


def np_explained_variance(ret, v, m):
    keep = m.astype(bool)
    return 1 - np.var(ret[keep] - v[keep], ddof=1) / (np.var(ret[keep], ddof=1) + 1e-5)


def test_explained_variance_matches_verl_formula():
    r, m, v, _ = random_batch(4)
    close(gp.explained_variance(r, v, m), np_explained_variance(r, v, m))


def test_threshold_moves_down_for_a_good_critic_and_up_for_a_bad_one():
    _, m, _, _ = random_batch(5)
    rng = np.random.default_rng(5)
    ret = (rng.normal(size=m.shape) * m).astype(np.float32)
    good = ret + 0.1 * rng.normal(size=m.shape).astype(np.float32)  # EV close to 1
    bad = -2.0 * ret  # Var(3 ret) = 9 Var(ret): EV = 1 - 9 < 0
    config = cfg(threshold_lr=0.05)
    for values, sign in ((good, 1), (bad, -1)):
        ev = np_explained_variance(ret, values, m)
        assert np.sign(ev) == sign
        new = gp.update_threshold(jnp.float32(2.0), ret, values, m, params=gp.group_params(config))
        close(new, 2.0 * math.exp(-0.05 * ev), atol=1e-5)
        assert (new < 2.0) if sign > 0 else (new > 2.0)
    # clipped to [min_threshold, max_threshold] in log space
    big = cfg(threshold_lr=100.0, min_threshold=0.5, max_threshold=3.0)
    big = gp.group_params(big)
    close(gp.update_threshold(jnp.float32(2.0), ret, good, m, params=big), 0.5)
    close(gp.update_threshold(jnp.float32(2.0), ret, bad, m, params=big), 3.0)
    close(gp.update_threshold(jnp.float32(np.inf), ret, bad, m, params=big), 3.0)
    # not adaptive: unchanged
    fixed = gp.group_params(cfg(adaptive_threshold=False))
    close(gp.update_threshold(jnp.float32(2.0), ret, bad, m, params=fixed), 2.0)


def test_init_threshold_and_config_checks():
    assert gp.init_threshold(cfg(group_variance_threshold=0.7)).dtype == jnp.float32
    close(gp.init_threshold(cfg(group_variance_threshold=0.7)), 0.7)
    close(gp.init_threshold(fx.algo_cfg()), 1.0)  # base_config's default
    for bad in (
        {"group_max_size": 0},
        {"group_max_size": 2.5},
        {"min_threshold": 2.0, "max_threshold": 1.0},
        {"group_epsilon": 0.0},
    ):
        with pytest.raises(ValueError, match="group_params"):
            gp.init_threshold(cfg(**bad))


# ------------------------------------------------------------------------- registry, masking, jit


def inputs(r, m, v, logp, tau, config):
    """Every input an estimator may need (groups of two rows, zero reward baselines)."""
    return {
        "token_level_rewards": r,
        "response_mask": m,
        "index": jnp.array([0, 0, 1, 1]),
        "values": v,
        "reward_baselines": jnp.zeros(4),
        "old_log_prob": logp,
        "sum_pi_squared": jnp.exp(2 * logp),  # sum_v pi(v)^2 >= pi(y)^2, any positive array will do
        "threshold": tau,
        "config": config,
    }


def full(name, *args):
    return fx.compute_full(name, **inputs(*args))


def test_compute_full_for_every_estimator():
    r, m, v, logp = random_batch(6)
    config = cfg(gamma=0.9, lam=0.9, threshold_lr=0.1)
    tau = jnp.float32(1.5)
    assert "group_ppo" in adv_lib.names()
    for name in adv_lib.names():
        out = full(name, r, m, v, logp, tau, config)
        adv, ret = fx.compute(name, **inputs(r, m, v, logp, tau, config))
        chex.assert_trees_all_close((out["advantages"], out["returns"]), (adv, ret))
        if name != "group_ppo":
            np.testing.assert_array_equal(out["critic_mask"], m)
            assert out["metrics"] == {}
            close(out["next_threshold"], 1.5)
    out = full("group_ppo", r, m, v, logp, tau, config)
    ev = np_explained_variance(np.asarray(out["token_returns"]), v, m)
    close(out["next_threshold"], 1.5 * math.exp(-0.1 * ev))
    close(out["metrics"]["group/threshold"], 1.5)
    with pytest.raises(ValueError, match="unknown inputs"):
        adv_lib.register("nope", needs=("old_logprob",))
    assert adv_lib.needs("group_ppo") == ("values", "old_log_prob", "threshold")
    with pytest.raises(ValueError, match="old_log_prob, threshold"):
        fx.compute("group_ppo", token_level_rewards=r, response_mask=m, values=v, config=config)


def test_masked_garbage_does_not_leak():
    r, m, v, logp = random_batch(7)
    rng = np.random.default_rng(7)
    junk = np.array([np.nan, np.inf, -np.inf, 1e6, -3e4], np.float32)
    dirty = []
    for x in (r, v, logp):
        x = x.copy()
        x[m == 0] = rng.choice(junk, size=int((m == 0).sum()))
        dirty.append(x)
    config = cfg(gamma=0.95, lam=0.9, group_max_size=3)
    clean_out = full("group_ppo", r, m, v, logp, jnp.float32(1.0), config)
    dirty_out = full("group_ppo", dirty[0], m, dirty[1], dirty[2], jnp.float32(1.0), config)
    chex.assert_trees_all_close(dirty_out, clean_out, atol=1e-6)
    for key in ("advantages", "returns", "critic_mask", "token_returns"):
        assert np.isfinite(dirty_out[key]).all(), key
        assert not np.asarray(dirty_out[key])[m == 0].any(), key
    direct = run(dirty[0], m, dirty[1], dirty[2], 1.0, config)
    for arr in (direct.segment_advantages, direct.rho):
        assert not np.asarray(arr)[m == 0].any()


def test_jits_once_and_matches_eager():
    config = cfg(gamma=0.95, lam=0.9, group_max_size=4)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(r, m, v, logp, tau):
        return full("group_ppo", r, m, v, logp, tau, config)

    for seed, tau in ((8, 0.8), (9, 1.7)):
        args = random_batch(seed) + (jnp.float32(tau),)
        chex.assert_trees_all_close(step(*args), full("group_ppo", *args, config), atol=1e-5)
