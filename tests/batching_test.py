"""How the step's forwards run over their rows (jrl/batching.py): each role's description from the
config, how rows are split and joined, each micro-batch's own key, and the sizes that must divide
the rows each device holds. (That micro-batches give the whole mini-batch's update inside the
step: lean_step_test; buckets: buckets_test; shared prompts: shared_prompt_test.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import config as config_lib
from jrl import batching, sharding

from conftest import tiny_config


def test_split_rows_keeps_each_group_together_and_join_rows_undoes_it():
    rows = jnp.arange(12)
    split = batching.split_rows(rows, 2, group=3)
    np.testing.assert_array_equal(split, [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 11]])
    np.testing.assert_array_equal(batching.join_rows(split, group=3), rows)
    plain = batching.split_rows(rows, 2)  # group 1: rows i, i + k, ...
    np.testing.assert_array_equal(plain, [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]])
    np.testing.assert_array_equal(batching.join_rows(plain), rows)


def test_accumulate_grads_gives_each_micro_batch_its_own_key():
    """With a key, micro-batch i of k sees split(key, k)[i] (fresh dropout masks per
    micro-batch)."""

    def loss_fn(w, mb, key):
        u = jax.random.uniform(key, w.shape)
        return jnp.sum(w * u) * jnp.sum(mb["x"]), {"n": jnp.sum(mb["x"])}

    w, key = jnp.ones(3), jax.random.key(9)
    batch = {"x": jnp.ones((4, 1))}
    two = batching.Batching(micro=2)
    grads, metrics = batching.accumulate_grads(loss_fn, w, batch, two, key=key)
    u0, u1 = (jax.random.uniform(k, (3,)) for k in jax.random.split(key, 2))
    assert np.abs(np.asarray(u0 - u1)).min() > 0
    np.testing.assert_allclose(grads, 2 * u0 + 2 * u1, rtol=1e-6)
    assert float(metrics["n"]) == 4
    grads, _ = batching.accumulate_grads(loss_fn, w, batch, batching.Batching(), key=key)
    np.testing.assert_allclose(grads, 4 * jax.random.uniform(jax.random.split(key, 1)[0], (3,)))


def test_micro_batch_sizes_must_divide_each_devices_rows():
    cfg = tiny_config(**{"actor.ppo_micro_batch_size_per_device": 3})  # mini-batch: 2 x 4 = 8 rows
    with pytest.raises(
        config_lib.ConfigError, match="actor.ppo_micro_batch_size_per_device=3"
    ) as e:
        batching.micro_batch_counts(cfg)
    assert "\n" not in str(e.value)
    mesh = sharding.make_mesh(("data", "fsdp", "tensor"), (4, 1, 1), jax.devices()[:4])
    ok = tiny_config(**{"actor.ppo_micro_batch_size_per_device": 1})
    assert batching.micro_batch_counts(ok, mesh) == {"log_prob": 1, "actor": 2, "critic": 1}
    # 16 rows, 4 per device
    bad = tiny_config(**{"rollout.log_prob_micro_batch_size_per_device": 3})
    with pytest.raises(config_lib.ConfigError, match="4 rows each device holds"):
        batching.micro_batch_counts(bad, mesh)


def test_plan_describes_each_role():
    """The tiny preset (4 prompts x 4 samples, mini-batches of 2 prompts) with micro-batches of 2
    rows in the update: the scoring forward in one micro-batch of whole groups, the update's in
    4 (rows drawn at random: no shared prompt); buckets (8,) below R = 16 reach every role."""
    cfg = tiny_config(**{"actor.ppo_micro_batch_size_per_device": 2})
    plan = batching.plan(cfg, None, 16)
    assert plan == {
        "log_prob": batching.Batching(micro=1, group=4),
        "actor": batching.Batching(micro=4, group=1),
        "critic": batching.Batching(micro=1, group=1),
    }
    cfg = tiny_config(**{"model.response_buckets": (8, 32)})
    assert {b.buckets for b in batching.plan(cfg, None, 16).values()} == {(8, 16)}
