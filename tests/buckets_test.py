"""Response buckets (jrl/buckets.py): the bucket a micro-batch runs at, the length order of the
micro-batches, and a few steps with buckets on equal to the padded path (PPO with a critic) on
skewed response lengths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import batching, buckets
from conftest import assert_same_run, run_steps, tiny_config


def test_trimmed_runs_at_the_smallest_length_holding_the_longest_response():
    mask = np.zeros((3, 16), np.int32)
    mask[0, :2], mask[1, :6], mask[2, :1] = 1, 1, 1  # ends 2, 6, 1
    rows = {"input_ids": jnp.ones((3, 16)), "response_mask": jnp.asarray(mask)}
    fn = lambda r: {"width": jnp.int32(r["response_mask"].shape[1]), "m": r["response_mask"] * 2}
    out = jax.jit(lambda r: buckets.trimmed(fn, r, (4, 8, 16)))(rows)
    assert int(out["width"]) == 8  # 6 fits 8, not 4
    np.testing.assert_array_equal(out["m"], 2 * mask)  # padded back to 16
    assert out["m"].shape == (3, 16)
    assert buckets.bucket_sizes((8, 4, 16, 32, 0), 16) == (4, 8, 16)


def test_length_order_gives_each_micro_batch_a_quantile_of_lengths():
    """8 rows in blocks of 2 (ends 7, 1, 3, 2 per block), 2 micro-batches: the two shortest
    blocks (1, 2) in micro-batch 0, the two longest (3, 7) in micro-batch 1."""
    ends = np.array([7, 7, 1, 0, 3, 1, 2, 2])
    mask = (np.arange(8)[None] < ends[:, None]).astype(np.int32)
    order = buckets.length_order({"response_mask": jnp.asarray(mask)}, 2, group=2)
    split = batching.split_rows(jnp.asarray(ends)[order], 2, group=2)
    np.testing.assert_array_equal(split, [[1, 0, 2, 2], [3, 1, 7, 7]])


# skewed: most responses 1-3 tokens, two of 16 rows at the budget
LENGTHS = np.array([2, 1, 3, 2, 16, 1, 2, 3, 1, 2, 11, 1, 3, 2, 1, 2])


def test_buckets_change_no_metric_and_no_parameter(monkeypatch):
    """PPO with a critic (its scoring, policy and critic forwards all run in buckets; GRPO's
    are the same policy forwards): two steps with buckets (8, 16) equal the padded ones, and
    both buckets ran (the widths of the branches that ran, seen from inside them; none without
    buckets)."""
    changes = {
        "data.max_response_length": 16,
        "actor.ppo_micro_batch_size_per_device": 2,
        "critic.ppo_micro_batch_size_per_device": 2,
        "rollout.log_prob_micro_batch_size_per_device": 4,
    }
    widths, trimmed = set(), buckets.trimmed

    def seen(fn, rows, sizes):
        def run(cut):
            width = cut["response_mask"].shape[1]
            jax.debug.callback(lambda: widths.add(width))
            return fn(cut)

        return trimmed(run, rows, sizes)

    monkeypatch.setattr(buckets, "trimmed", seen)
    results = []
    for sizes in ((), (8,)):
        widths.clear()
        cfg = tiny_config("ppo_math", **changes, **{"model.response_buckets": sizes})
        state, metrics = run_steps(cfg, 2, forced_length=LENGTHS)
        results.append((jax.device_get((state.params, state.critic_params)), metrics))
        assert widths == ({8, 16} if sizes else set()), (sizes, widths)
    want_params, want_metrics = results[0]
    assert "critic/vf_loss" in want_metrics[0] and want_params[1] is not None
    assert float(want_metrics[0]["response_length/mean"]) == LENGTHS.mean()
    assert_same_run(results[1], results[0], rtol=1e-5)


def test_buckets_refuse_what_depends_on_the_response_width():
    from jrl import config as config_lib

    cases = [
        ({"model.response_buckets": (0, 4)}, "positive response lengths"),
        ({"actor.loss_agg_mode": "seq-mean-token-sum-norm"}, "actor.loss_scale_factor"),
        ({"actor.policy_loss": "clip_cov"}, "clip_cov"),
    ]
    for changes, message in cases:
        cfg = tiny_config(**{"model.response_buckets": (4,), **changes})
        with pytest.raises(config_lib.ConfigError, match=message) as e:
            config_lib.validate(cfg)
        assert "\n" not in str(e.value)
    cfg = tiny_config(
        **{
            "model.response_buckets": (4,),
            "actor.loss_agg_mode": "seq-mean-token-sum-norm",
            "actor.loss_scale_factor": 16.0,
        }
    )
    config_lib.validate(cfg)
