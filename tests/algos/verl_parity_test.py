"""Hand-computed cases for the names jrl shares with verl 0.9.1 that arrived later: the
optimal-token-baseline estimators, gdpo, the *_vectorized names, dppo_tv / dppo_kl / dro /
bypass_mode, rollout correction (IS weights, rejection sampling, metrics) and the '+' KL kinds.

Expected numbers are written out by hand or computed here with numpy loops written from verl
0.9.1's formulas (docs/algorithms.md), never by calling the code under test.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.algos import kl as kl_lib
from jrl.algos import rollout_corr

from helpers import algos_fixtures as fx

ATOL = 1e-5


def close(actual, expected, atol=ATOL):
    np.testing.assert_allclose(
        np.asarray(actual), np.asarray(expected, np.float64), rtol=0, atol=atol
    )


run_loss = fx.run_loss


# ----------------------------------------------------------------------------- aggregation


def test_seq_mean_token_sum_norm_is_a_mean_over_rows_divided_by_t():
    # vanilla token losses (see algos_test): rows [-1.28, 0.8] and [3, -2], padding in column 2
    adv = np.array([[1.0, -1.0, 0.0], [-1.0, 2.0, 0.0]], np.float32)
    old = np.array([[-1.0, -2.0, 0.0], [-0.7, -1.2, 0.0]], np.float32)
    new = old + np.array([[0.5, -0.5, 0.0], [1.5, 0.0, 0.0]], np.float32)
    m = np.array([[1, 1, 0], [1, 1, 0]], np.float32)
    loss, _ = run_loss("vanilla", old, new, adv, m, "seq-mean-token-sum-norm", clip_ratio_high=0.28)
    close(loss, ((-1.28 + 0.8) + (3.0 - 2.0)) / 2 / 3)  # mean over 2 rows, then / T = 3
    loss, _ = run_loss(
        "vanilla",
        old,
        new,
        adv,
        m,
        "seq-mean-token-sum-norm",
        clip_ratio_high=0.28,
        loss_scale_factor=4.0,
    )
    close(loss, 0.26 / 4)
    loss, _ = run_loss("vanilla", old, new, adv, m, "token-sum", clip_ratio_high=0.28)
    close(loss, -1.28 + 0.8 + 3.0 - 2.0)


def test_is_weights_multiply_every_token_loss():
    adv = np.array([[1.0, -1.0, 0.5]], np.float32)
    old = np.array([[-1.0, -1.0, -1.0]], np.float32)
    new = old  # ratio 1: vanilla's token loss is -A
    m = np.array([[1, 1, 0]], np.float32)
    w = np.array([[0.5, 2.0, 9.0]], np.float32)
    loss, _ = run_loss("vanilla", old, new, adv, m, weights=w)
    close(loss, (-1.0 * 0.5 + 1.0 * 2.0) / 2)
    # geo_mean: the row's loss -mean(A) * 1 times the geometric mean of its weights
    loss, _ = run_loss("geo_mean", old, new, adv, m, weights=w)
    close(loss, -(1.0 - 1.0) / 2 * 1.0)
    adv2 = np.array([[1.0, 1.0, 0.0]], np.float32)
    loss, _ = run_loss("geo_mean", old, new, adv2, m, weights=w)
    close(loss, -1.0 * np.sqrt(0.5 * 2.0), atol=1e-4)


# ----------------------------------------------------------------------------- estimators

# Two groups: rows 0-2 (lengths 3, 2, 4: row 2 is the unique longest), rows 3-4 (lengths 2, 2).
OTB_MASK = np.array(
    [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]], np.float32
)
OTB_INDEX = np.array([0, 0, 0, 1, 1])


def otb_case(seed=0):
    rng = np.random.default_rng(seed)
    r = (rng.normal(0, 1, OTB_MASK.shape) * OTB_MASK).astype(np.float32)
    old = rng.uniform(-2.0, -0.1, OTB_MASK.shape).astype(np.float32)
    spsq = rng.uniform(0.2, 0.9, OTB_MASK.shape).astype(np.float32)
    return r, old, spsq


def np_otb(r, old, spsq, m, index, rho=None):
    """verl 0.9.1's compute_optimal_token_baseline_advantage, as a plain loop."""
    b, t = m.shape
    g = np.zeros_like(r)
    for i in range(b):
        acc = 0.0
        for j in reversed(range(t)):
            acc += r[i, j] * m[i, j]
            g[i, j] = acc
    w = 1 - 2 * np.exp(old) + spsq
    if rho is not None:
        w = w * rho**2
    wc = np.cumsum(w * m, axis=1)
    base = np.zeros_like(r)
    for gid in np.unique(index):
        rows = np.where(index == gid)[0]
        if len(rows) == 1:
            continue
        num = (g[rows] * wc[rows] * m[rows]).sum(0)
        den = (wc[rows] * m[rows]).sum(0) + 1e-8
        base[rows] = num / den
        lens = m[rows].sum(1)
        srt = np.sort(lens)
        if (lens == srt[-1]).sum() == 1 and srt[-1] > srt[-2]:
            base[rows[np.argmax(lens)], int(srt[-2]) :] = 0.0
    return (g - base) * m, g


def otb(name, r, old, spsq, mask=OTB_MASK, rho=None):
    return fx.compute(
        name,
        token_level_rewards=r,
        response_mask=mask,
        index=OTB_INDEX,
        old_log_prob=old,
        sum_pi_squared=spsq,
        rollout_is_weights=rho,
        config=fx.algo_cfg(),
    )


def test_optimal_token_baseline():
    r, old, spsq = otb_case()
    expected_adv, expected_ret = np_otb(r, old, spsq, OTB_MASK, OTB_INDEX)
    adv, ret = otb("optimal_token_baseline", r, old, spsq)
    close(adv, expected_adv)
    close(ret, expected_ret * OTB_MASK)
    close(adv[2, 3:], expected_ret[2, 3:])  # the zero tail: no baseline past length 3 (row 0)
    rho = np.random.default_rng(3).uniform(0.5, 1.5, OTB_MASK.shape).astype(np.float32)
    adv, _ = otb("optimal_token_baseline", r, old, spsq, rho=rho)
    close(adv, np_otb(r, old, spsq, OTB_MASK, OTB_INDEX, rho)[0])


def test_tir_optimal_token_baseline_packs_holes():
    r, old, spsq = otb_case(1)
    # without holes it is optimal_token_baseline
    a1, _ = otb("tir_optimal_token_baseline", r, old, spsq)
    close(a1, np_otb(r, old, spsq, OTB_MASK, OTB_INDEX)[0])
    # a hole at column 1 of row 0: its tokens sit at columns 0, 2, 3 and take baseline slots 0, 1, 2
    m = OTB_MASK.copy()
    m[0] = [1, 0, 1, 1]
    r = r * m
    g = np.flip(np.cumsum(np.flip(r * m, 1), 1), 1)
    wc = np.cumsum((1 - 2 * np.exp(old) + spsq) * m, axis=1)
    packed_g = np.zeros_like(g)
    packed_w = np.zeros_like(g)
    packed_m = np.zeros_like(g)
    for i in range(5):
        cols = np.where(m[i] > 0)[0]
        packed_g[i, : len(cols)] = g[i, cols]
        packed_w[i, : len(cols)] = wc[i, cols]
        packed_m[i, : len(cols)] = 1
    expected = np.zeros_like(g)
    for rows in ([0, 1, 2], [3, 4]):
        base = (packed_g[rows] * packed_w[rows]).sum(0) / (packed_w[rows].sum(0) + 1e-8)
        pa = packed_g[rows] - base
        lens = packed_m[rows].sum(1)
        srt = np.sort(lens)
        if (lens == srt[-1]).sum() == 1 and srt[-1] > srt[-2]:
            k = int(np.argmax(lens))
            pa[k, int(srt[-2]) :] = packed_g[rows][k, int(srt[-2]) :]
        for row, i in enumerate(rows):
            cols = np.where(m[i] > 0)[0]
            expected[i, cols] = pa[row, : len(cols)]
    adv, _ = otb("tir_optimal_token_baseline", r, old, spsq, mask=m)
    close(adv, expected)


def test_gdpo_is_whitened_grpo_and_vectorized_names():
    m = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], np.float32)
    s = np.array([1.0, 0.0, 3.0, 2.0], np.float32)
    r = np.zeros_like(m)
    r[np.arange(4), m.sum(1).astype(int) - 1] = s
    index = np.array([0, 0, 1, 1])
    cfg = fx.algo_cfg(norm_adv_by_std_in_grpo=True)
    # GRPO: groups {1, 0} and {3, 2}: mean 0.5 / 2.5, unbiased std 0.7071 -> +-0.70711
    g = np.array([1, -1, 1, -1], np.float32) * 0.5 / (np.sqrt(0.5) + 1e-6)
    x = g[:, None] * m
    n = m.sum()
    mu = x.sum() / n
    var = (((x - mu) ** 2) * m).sum() / (n - 1)
    expected = (x - mu) / np.sqrt(var + 1e-8) * m
    adv, ret = fx.compute("gdpo", token_level_rewards=r, response_mask=m, index=index, config=cfg)
    close(adv, expected)
    close(ret, expected)
    a, _ = fx.compute(
        "grpo_vectorized", token_level_rewards=r, response_mask=m, index=index, config=cfg
    )
    close(a, x)
    # rloo_vectorized: like rloo, but a group of one gets 0 (rloo keeps the score)
    index = np.array([0, 0, 0, 3])
    a, _ = fx.compute(
        "rloo_vectorized", token_level_rewards=r, response_mask=m, index=index, config=cfg
    )
    b, _ = fx.compute("rloo", token_level_rewards=r, response_mask=m, index=index, config=cfg)
    # group {1, 0, 3}: 1 - 1.5, 0 - 2, 3 - 0.5
    close(a[:3, 0], [-0.5, -2.0, 2.5])
    close(b[:3, 0], [-0.5, -2.0, 2.5])
    close(a[3], 0.0)
    close(b[3], 2.0 * m[3])


# ----------------------------------------------------------------------------- policy losses


def loss_case(seed):
    rng = np.random.default_rng(seed)
    shape = (3, 5)
    m = np.ones(shape, np.float32)
    m[0, 3:] = 0
    m[1, 1] = 0
    old = rng.uniform(-2.0, -0.05, shape).astype(np.float32)
    new = np.minimum(old + rng.normal(0, 0.5, shape), -0.01).astype(np.float32)
    adv = rng.normal(0, 1, shape).astype(np.float32)
    return old, new, adv, m


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo(name):
    old, new, adv, m = loss_case(4)
    p, po = np.exp(new), np.exp(old)
    ratio = np.exp(new - old)
    if name == "dppo_tv":
        keep = np.where(adv > 0, p - po <= 0.3, p - po >= -0.1)
    else:
        d = po * (old - new) + (1 - po) * np.log((1 - po + 1e-8) / (1 - p + 1e-8))
        keep = np.where(adv > 0, (d <= 0.3) | (p <= po), (d <= 0.1) | (p >= po))
    w = np.minimum(ratio, 1.5)
    token = -adv * w * new * keep
    loss, metrics = run_loss(
        name, old, new, adv, m, clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=1.5
    )
    close(loss, (token * m).sum() / m.sum())
    close(metrics["actor/pg_clipfrac"], ((1 - keep) * m).sum() / m.sum())
    close(metrics["actor/pg_clipfrac_lower"], ((ratio > 1.5) * keep * m).sum() / m.sum())
    assert 0 < metrics["actor/pg_clipfrac"] < 1  # both branches are exercised
    grad = jax.grad(
        lambda lp: run_loss(
            name, old, lp, adv, m, clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=1.5
        )[0]
    )(jnp.asarray(new))
    close(grad, -adv * w * keep * m / m.sum())  # the weight and the test carry no gradient


def test_dro():
    old, new, adv, m = loss_case(5)
    token = -(new * adv - 0.5 * 0.7 * (new - old) ** 2)
    loss, metrics = run_loss("dro", old, new, adv, m, "seq-mean-token-mean", dro_beta=0.7)
    close(loss, np.mean((token * m).sum(1) / m.sum(1)))
    close(metrics["actor/ppo_kl"], ((old - new) * m).sum() / m.sum())
    with pytest.raises(ValueError, match="dro_beta"):
        run_loss("dro", old, new, adv, m)


RC = dict(
    rollout_is="token",
    rollout_is_threshold="1.5",
    rollout_rs="token_k1",
    rollout_rs_threshold="0.6_1.6",
)


@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
def test_bypass_mode(loss_type):
    rollout, new, adv, m = loss_case(6)  # in bypass mode old_log_prob is the rollout's
    lr = new - rollout
    keep = (-lr >= np.log(0.6)) & (-lr <= np.log(1.6))  # token_k1 on k1 = -log ratio
    assert 0 < keep[m > 0].mean() < 1
    kept = m * keep
    cfg = dict(rollout_correction=dict(RC, loss_type=loss_type))
    loss, metrics = run_loss("bypass_mode", rollout, new, adv, m, **cfg)
    if loss_type == "reinforce":
        w = np.minimum(np.exp(lr), 1.5)
        expected = (
            -adv * new * w * kept
        ).sum() / m.sum()  # verl: the batch's tokens before rejection
        close(metrics["actor/ppo_kl"], ((rollout - new) * kept).sum() / kept.sum())
    else:
        ratio = np.exp(lr)
        l1, l2 = -adv * ratio, -adv * np.clip(ratio, 0.8, 1.2)
        c = np.maximum(l1, l2)
        token = np.where(adv < 0, np.minimum(-adv * 3.0, c), c)
        expected = (token * kept).sum() / m.sum()
        close(metrics["actor/pg_clipfrac"], ((l2 > l1) * kept).sum() / kept.sum())
    close(loss, expected)
    close(metrics["rollout_corr/rollout_rs_masked_fraction"], ((1 - keep) * m).sum() / m.sum())
    close(metrics["rollout_corr/kl"], ((rollout - new) * m).sum() / m.sum())


# ----------------------------------------------------------------------------- rollout correction


def test_token_tis_and_sequence_icepop_weights():
    m = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
    lr = np.array([[0.5, -0.2, 0.1], [1.0, 0.3, 9.0]], np.float32)
    parsed = rollout_corr.settings(fx.rc_cfg(rollout_is="token", rollout_is_threshold="1.5"))
    w, mask, metrics = rollout_corr.correct(lr, np.zeros_like(lr), m, parsed)
    expected = np.minimum(np.exp(lr), 1.5) * m
    close(w, expected)
    close(mask, m)
    close(metrics["rollout_corr/rollout_is_mean"], expected.sum() / 5)
    close(metrics["rollout_corr/rollout_is_ratio_fraction_high"], 2 / 5)  # e^0.5, e^1.0 > 1.5
    close(metrics["rollout_corr/rollout_is_ratio_fraction_low"], 0.0)  # none below 1/1.5
    close(metrics["rollout_corr/rollout_is_max"], 1.5)
    close(metrics["rollout_corr/rollout_is_min"], np.exp(-0.2))
    # sequence-level IcePop [0.5, 2]: row sums 0.4 (kept, w = e^0.4) and 1.3 (e^1.3 > 2: zeroed)
    parsed = rollout_corr.settings(fx.rc_cfg(rollout_is="sequence", rollout_is_threshold="0.5_2.0"))
    w, _, metrics = rollout_corr.correct(lr, np.zeros_like(lr), m, parsed)
    close(w, [[np.exp(0.4)] * 3, [0, 0, 0]])
    close(metrics["rollout_corr/rollout_is_oob_ratio"], 2 / 5)
    close(metrics["rollout_corr/rollout_is_max"], np.exp(1.3))
    close(metrics["rollout_corr/chi2_seq"], np.mean(np.exp(2 * np.array([0.4, 1.3]))) - 1)


def test_rejection_sampling_options():
    m = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0]], np.float32)
    lr = np.array([[0.05, -0.1, 0.0], [0.6, 0.0, 0.0], [-0.02, 0.0, 0.0]], np.float32)
    k3 = np.exp(lr) - 1 - lr
    # seq_mean_k3 <= 0.05: row 1's mean k3 = (0.2221 + 0) / 2 = 0.111 is rejected
    parsed = rollout_corr.settings(
        fx.rc_cfg(rollout_is="", rollout_rs="seq_mean_k3", rollout_rs_threshold="0.05")
    )
    w, mask, metrics = rollout_corr.correct(lr, np.zeros_like(lr), m, parsed)
    assert w is None
    close(mask, m * np.array([[1], [0], [1]]))
    seq_mean = (k3 * m).sum(1) / m.sum(1)
    close(metrics["rollout_corr/rollout_rs_seq_mean_k3_seq_max"], seq_mean.max())
    close(metrics["rollout_corr/rollout_rs_seq_mean_k3_masked_fraction"], 2 / 6)
    close(metrics["rollout_corr/rollout_rs_seq_masked_fraction"], 1 / 3)
    # two options, both must pass; a single k1 bound U means [1/U, U] on the ratio
    parsed = rollout_corr.settings(
        fx.rc_cfg(rollout_is="", rollout_rs="token_k1,seq_max_k2", rollout_rs_threshold="1.08,0.1")
    )
    _, mask, _ = rollout_corr.correct(lr, np.zeros_like(lr), m, parsed)
    token_ok = (-lr >= -np.log(1.08)) & (-lr <= np.log(1.08))  # |lr| <= 0.077
    row_ok = (0.5 * lr**2 * m).max(1) <= 0.1  # row 1: 0.18 > 0.1
    close(mask, m * token_ok * row_ok[:, None])


@pytest.mark.parametrize(
    "field, value",
    [
        ("rollout_is", "tokens"),
        ("rollout_is_threshold", "2_1"),
        ("rollout_rs", "seq_max_k1"),
        ("rollout_rs_threshold", "0.5_2"),
        ("loss_type", "ppo"),
    ],
)
def test_bad_rollout_correction_settings(field, value):
    rc = dict(rollout_is="token", rollout_rs="seq_max_k2", rollout_rs_threshold="0.1")
    rc[field] = value
    with pytest.raises(ValueError):
        rollout_corr.settings(fx.rc_cfg(**rc))


# ----------------------------------------------------------------------------- KL


@pytest.mark.parametrize("kind", ["k1", "k3", "low_var_kl", "abs"])
def test_straight_through_kl_kinds(kind):
    logp = jnp.array([-1.0, -0.5, -2.0])
    ref = jnp.array([-1.3, -0.4, -1.0])
    close(kl_lib.kl_penalty(logp, ref, kind + "+"), kl_lib.kl_penalty(logp, ref, kind))
    grad = jax.grad(lambda x: jnp.sum(kl_lib.kl_penalty(x, ref, kind + "+")))(logp)
    close(grad, logp - ref)  # d/dlogp of 0.5 (logp - ref)^2


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"actor.policy_loss": "dro"}, "dro_beta"),
        ({"actor.policy_loss": "bypass_mode"}, "bypass_mode"),
        (
            {
                "algorithm.rollout_correction.enable": True,
                "algorithm.rollout_correction.rollout_is": "",
            },
            "corrects nothing",
        ),
        (
            {
                "algorithm.rollout_correction.enable": True,
                "algorithm.rollout_correction.rollout_rs": "seq_k9",
            },
            "rollout_correction.rollout_rs option 'seq_k9'",
        ),
        (
            {
                "algorithm.rollout_correction.enable": True,
                "algorithm.rollout_correction.rollout_is_threshold": "x",
            },
            "rollout_correction.rollout_is_threshold",
        ),
        ({"actor.loss_agg_mode": "token_sum"}, "did you mean 'token-sum'"),
    ],
)
def test_config_errors(overrides, message):
    from jrl import config as config_lib

    cfg = config_lib.base_config()
    for path, value in overrides.items():
        section, *rest = path.split(".")
        node = cfg[section]
        for part in rest[:-1]:
            node = node[part]
        node[rest[-1]] = value
    with pytest.raises(config_lib.ConfigError, match=message):
        config_lib.validate(cfg)
