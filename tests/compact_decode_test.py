"""Decode compaction (rollout.compact_decode): the stages' sizes, and the same tokens, masks and
log-probs as the plain decode on skewed response lengths."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import config as config_lib
from jrl import rollout, sharding
from jrl.models import transformer as tfm
from conftest import tiny_model

CFG = tiny_model(11)
EOS, PAD, R = 2, 0, 12
# 8 prompts (some left-padded, pad id 0 in their padding), each sampled twice: B = 16 rows
PMASK = (np.arange(5)[None] >= np.array([[2], [0], [1], [0], [3], [0], [0], [1]])).astype(np.int32)
PROMPTS = np.random.default_rng(0).integers(3, 11, (8, 5)).astype(np.int32) * PMASK
# skewed: most rows end within 3 tokens, two run to the budget, one to 9
LENGTHS = np.array([1, 2, 3, 1, 12, 2, 1, 3, 2, 9, 1, 2, 3, 1, 12, 2], np.int32)


def test_decode_stages():
    assert rollout.decode_stages(128) == (128, 64, 32, 16)  # at most 4 sizes
    assert rollout.decode_stages(1024, 8, 16) == (1024, 512, 256, 128)
    assert rollout.decode_stages(48, 1, 16) == (48, 24)  # 12 < 16
    assert rollout.decode_stages(24, 1, 16) == (24,)  # too few rows: the plain decode
    assert rollout.decode_stages(96, 32, 1) == (96,)  # 48 rows would not split over 32 shards
    assert rollout.decode_stages(16, 4, 2) == (16, 8, 4)  # 2 rows would not split over 4
    assert rollout.decode_stages(12, 1, 2) == (12, 6, 3)  # 3 is odd: no further halving


@pytest.fixture(scope="module")
def params():
    return tfm.init_params(CFG, jax.random.key(1))


def generate(params, key, min_rows, forced=True, **sampling):
    return rollout.generate(
        CFG,
        params,
        jnp.asarray(PROMPTS[::2]),  # 4 prompts x 2 samples ...
        jnp.asarray(PMASK[::2]),
        key,
        max_new_tokens=R,
        eos_id=EOS,
        pad_id=PAD,
        samples=2,
        forced_length=jnp.asarray(LENGTHS[:8]) if forced else None,
        compact_min_rows=min_rows,
        **sampling,
    )


def assert_same(a, b):
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    np.testing.assert_array_equal(a.response_mask, b.response_mask)
    np.testing.assert_allclose(a.log_probs, b.log_probs, rtol=0, atol=1e-6)


SAMPLING = [
    dict(forced=True, temperature=0.8),  # forced lengths 1..12 over 8 rows
    dict(forced=False, temperature=1.0, top_k=6, top_p=0.9),  # natural EOS (frequent here)
    dict(forced=False, temperature=1.3, stop_ids=(5,)),
]


@pytest.mark.parametrize("sampling", SAMPLING)
def test_compacted_decode_samples_what_the_plain_one_does(params, sampling):
    """8 rows in stages of 8, 4, 2 (compact_min_rows=2) against 8 rows throughout: the same
    response ids, masks and log-probs, for several keys; the rows' lengths are skewed, so the
    stages do run (the check below: some rows end early, some go long)."""
    run = jax.jit(
        generate,
        static_argnames=("min_rows", "forced", "temperature", "top_k", "top_p", "stop_ids"),
    )
    ends = []
    for seed in range(3):
        key = jax.random.key(seed)
        plain, compact = run(params, key, 0, **sampling), run(params, key, 2, **sampling)
        assert_same(compact, plain)
        ends.append(np.asarray(plain.response_mask).sum(1))
    ends = np.concatenate(ends)
    assert ends.min() <= 3 and ends.max() >= 6  # skewed: rows leave the stages early


def decode_loops(jaxpr) -> int:
    """The decode loops (`while` under the "decode" name scope) in a jaxpr and its sub-jaxprs: a
    later stage's loop sits in the `rollout.when` that skips it when no row is live."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "while" and str(eqn.source_info.name_stack) == "decode"
        count += sum(decode_loops(sub) for sub in jax.extend.core.jaxprs_in_params(eqn.params))
    return count


def test_compaction_runs_one_loop_per_stage(params):
    """Three stages for 8 rows at compact_min_rows=2 (8, 4, 2): three decode loops in the
    program; one without compaction."""
    loops = lambda m: decode_loops(jax.make_jaxpr(lambda k: generate(params, k, m))(K0).jaxpr)
    assert loops(2) == 3 and loops(0) == 1


K0 = jax.random.key(0)


def test_compacted_decode_under_a_mesh(params):
    """16 rows over 4 data shards (and 2 tensor shards), stages 16, 8, 4: what one device's plain
    decode samples."""
    run = lambda min_rows: rollout.generate(
        CFG,
        params,
        jnp.asarray(PROMPTS),
        jnp.asarray(PMASK),
        jax.random.key(4),
        max_new_tokens=R,
        eos_id=EOS,
        pad_id=PAD,
        samples=2,
        temperature=0.9,
        forced_length=jnp.asarray(LENGTHS),
        compact_min_rows=min_rows,
    )
    plain = jax.jit(run, static_argnums=0)(0)
    mesh = sharding.make_mesh(shape=(4, 1, 2))
    with jax.set_mesh(mesh):
        assert rollout.decode_stages(16, 4, 2) == (16, 8, 4)
        compact = jax.jit(run, static_argnums=0)(2)
    assert_same(compact, plain)


def test_config_checks_the_smallest_stage():
    cfg = config_lib.base_config()
    cfg.rollout.compact_min_rows = 0
    with pytest.raises(config_lib.ConfigError, match="compact_min_rows"):
        config_lib.validate(cfg)
