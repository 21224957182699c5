"""NaN / Inf guard: a step with a non-finite reward is not applied, is counted, and K such steps in
a row stop the run with a message naming the quantity."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import rewards
from jrl import step as step_lib
from jrl import train_state
from jrl.run import trainer
from conftest import tiny_config


def nan_reward(batch, response_ids, response_mask, *, eos_id):
    return jnp.full(response_ids.shape[:1], jnp.nan, jnp.float32)


@pytest.fixture
def cfg(monkeypatch):
    monkeypatch.setitem(rewards.REWARDS, "nan_reward", nan_reward)
    c = tiny_config()
    c.task.reward = "nan_reward"
    c.warmup.sft_steps = 0
    c.total_steps = 6
    c.nan_guard.max_consecutive = 3
    return c


def test_nan_reward_steps_are_skipped_counted_and_stop_the_run(cfg, tmp_path):
    with pytest.raises(
        trainer.NonFiniteError, match=r"stopped at step 3: 3 steps in a row .*critic/score/mean"
    ):
        trainer.run(cfg, str(tmp_path))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")][1:]
    assert [r["training/skipped_steps"] for r in rows] == [1, 2, 3]
    assert all(r["training/step_skipped"] == 1 for r in rows)
    assert all(r["training/finite/critic/score/mean"] == 0 for r in rows)


def test_skipped_step_leaves_params_and_optimizer_unchanged(cfg):
    built = trainer.build(cfg)
    tok, task, reward_fn, model_cfg = built.tokenizer, built.task, built.reward_fn, built.model_cfg
    params = trainer.initial_params(cfg, model_cfg, jax.random.key(0))
    state = train_state.init_state(cfg, model_cfg, params, jax.random.key(1))
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    step = jax.jit(step_lib.make_step(cfg, model_cfg, reward_fn, **trainer.sampling_ids(tok, task)))
    new, metrics = step(state, task.train_batch(0, cfg.data.train_batch_size))
    assert int(metrics["training/step_skipped"]) == 1 and int(new.step) == 1
    after = jax.tree.map(np.asarray, (new.params, new.opt_state))
    jax.tree.map(np.testing.assert_array_equal, before, after)


def test_guard_off_stops_at_the_first_bad_step(cfg, tmp_path):
    cfg.nan_guard.enable = False
    with pytest.raises(trainer.NonFiniteError, match=r"step 1: critic/score/mean is not finite"):
        trainer.run(cfg, str(tmp_path))


def test_a_non_finite_loss_applies_no_update(monkeypatch):
    """The reward and advantages are finite, the policy loss is not: the guard inside the
    optimizer update keeps parameters and optimizer state, and the step counts as skipped."""
    from jrl.algos import losses

    def nan_loss(x, **_):
        return x.aggregate(x.log_prob * jnp.nan), {}

    monkeypatch.setitem(losses.POLICY_LOSSES, "nan_loss", nan_loss)
    cfg = tiny_config()
    cfg.actor.policy_loss = "nan_loss"
    built = trainer.build(cfg)
    tok, task, reward_fn, model_cfg = built.tokenizer, built.task, built.reward_fn, built.model_cfg
    state = train_state.init_state(
        cfg, model_cfg, trainer.initial_params(cfg, model_cfg, jax.random.key(0)), jax.random.key(1)
    )
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    step = jax.jit(step_lib.make_step(cfg, model_cfg, reward_fn, **trainer.sampling_ids(tok, task)))
    new, metrics = step(state, task.train_batch(0, cfg.data.train_batch_size))
    assert int(metrics["training/finite/critic/score/mean"]) == 1
    assert int(metrics["training/finite/actor/pg_loss"]) == 0
    assert int(metrics["training/step_skipped"]) == 1
    jax.tree.map(np.testing.assert_array_equal, before, (new.params, new.opt_state))
