"""The step's own contract (jrl/step.py): its optimizer bookkeeping (critic warm-up leaves the
policy and its optimizer untouched, as verl skips the actor's update; the logged learning rate
follows the optimizer's own count of applied updates, and a step skipped by the NaN guard applies
none), the policy loss's randomness, and what an estimator's registry entry asks of the step."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jrl import step as step_lib
from jrl import trainer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import grpo_math, ppo_math  # noqa: E402


def setup(cfg, reward_fn=None):
    tok, task, task_reward, model_cfg = trainer.build(cfg)
    params = trainer.initial_params(cfg, model_cfg, jax.random.key(0))
    state = step_lib.init_state(cfg, model_cfg, params, jax.random.key(1))
    ids = trainer.sampling_ids(tok, task)
    step = jax.jit(step_lib.make_step(cfg, model_cfg, reward_fn or task_reward, **ids))
    return state, step, task.train_batch(0, step_lib.prompts_per_step(cfg))


def test_critic_warmup_skips_the_policy_update_entirely():
    """PPO with a separate critic, critic_warmup=1 and AdamW weight decay: after step 1 the policy
    and its optimizer state (Adam's count, moments) are exactly as they were, the critic moved;
    at step 2 the policy updates. (Multiplying the policy loss by 0 still let weight decay shrink
    the policy and advanced Adam's count and the warm-up of the learning rate.)"""
    cfg = ppo_math.get_config("tiny")
    cfg.warmup.sft_steps = 0
    cfg.critic.critic_warmup = 1
    cfg.actor.weight_decay = 0.1
    state, step, batch = setup(cfg)
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    critic_before = jax.tree.map(np.asarray, state.critic_params)
    state, _ = step(state, batch)
    jax.tree.map(np.testing.assert_array_equal, before, (state.params, state.opt_state))
    assert int(step_lib.schedule_count(state.opt_state)) == 0
    moved = jax.tree.map(
        lambda a, b: np.any(a != np.asarray(b)), critic_before, state.critic_params
    )
    assert any(jax.tree.leaves(moved))
    state, _ = step(state, batch)  # past the warm-up: the policy trains
    updates = cfg.actor.ppo_epochs * cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size
    assert int(step_lib.schedule_count(state.opt_state)) == updates
    assert any(jax.tree.leaves(jax.tree.map(lambda a, b: np.any(a != b), before[0], state.params)))


def nan_reward(batch, response_ids, response_mask, *, eos_id):
    return jnp.full(response_ids.shape[:1], jnp.nan, jnp.float32)


def test_logged_lr_follows_applied_updates_after_a_skipped_step():
    """lr warm-up over 4 updates of lr 1e-3, u = 2 updates per step. Step 1 has a NaN reward and
    is skipped (no update applied); step 2's first update is then the optimizer's first: lr 0
    (warm-up from 0), not 1e-3 * 2 / 4 as state.step * u would say; step 3's is the
    third update: 1e-3 * 2 / 4."""
    cfg = grpo_math.get_config("tiny")
    cfg.warmup.sft_steps = 0
    cfg.actor.lr = 1e-3
    cfg.actor.lr_warmup_steps = 4
    # u = 2 updates per step: one epoch of 4 prompts in mini-batches of 2
    actor = cfg.actor
    assert (actor.ppo_epochs, cfg.data.train_batch_size, actor.ppo_mini_batch_size) == (1, 4, 2)
    state, step, batch = setup(cfg)
    _, skip_step, _ = setup(cfg, nan_reward)
    state, metrics = skip_step(state, batch)
    assert int(metrics["training/step_skipped"]) == 1 and float(metrics["actor/lr"]) == 0.0
    state, metrics = step(state, batch)
    assert int(metrics["training/step_skipped"]) == 0
    assert float(metrics["actor/lr"]) == 0.0  # the schedule at count 0
    state, metrics = step(state, batch)
    assert float(metrics["actor/lr"]) == pytest.approx(1e-3 * 2 / 4)


def test_schedule_count_reads_the_learning_rate_schedules_count():
    tx = step_lib.make_optimizer(grpo_math.get_config("tiny").actor)
    params = {"w": jnp.ones(3)}
    opt_state = tx.init(params)
    for _ in range(3):
        _, opt_state = tx.update({"w": jnp.ones(3)}, opt_state, params)
    assert int(step_lib.schedule_count(opt_state)) == 3
    assert isinstance(optax.ScaleByScheduleState(count=jnp.int32(0)), optax.ScaleByScheduleState)


def test_the_update_gives_clip_cov_its_random_choice_of_tokens():
    """clip_cov detaches n_clip = 0.25 * 32 = 8 of its candidate tokens, chosen at random (verl)
    when the step passes its key: two micro-batch keys pick different tokens, so the policy
    terms differ; the same key gives the same terms. (The step passed no key, so the choice was
    the deterministic top-covariance one whatever the key.)"""
    cfg = grpo_math.get_config("tiny")
    cfg.actor.policy_loss = "clip_cov"
    cfg.actor.clip_cov_ratio = 0.25
    cfg.actor.clip_cov_lb, cfg.actor.clip_cov_ub = -1e9, 1e9  # every token is a candidate
    spec = step_lib.make_spec(cfg, None, None, eos_id=1, pad_id=0, max_new_tokens=8)
    rng = np.random.default_rng(0)
    mask = jnp.ones((4, 8), jnp.float32)
    out = {"log_prob": jnp.asarray(rng.normal(size=(4, 8)) - 2.0, jnp.float32)}
    out["entropy"] = jnp.zeros((4, 8))
    mb = {"response_mask": mask, "advantages": jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)}
    mb["old_log_prob"] = out["log_prob"] + 0.01 * jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
    counts = step_lib.losses.batch_counts(mask)
    terms = lambda key: step_lib.policy_terms(spec, out, mb, counts, jax.random.key(key))[0]
    assert float(terms(1)) == float(terms(1))
    assert len({float(terms(k)) for k in range(4)}) > 1


def test_the_step_reads_an_estimators_entry_for_its_critic_and_inputs(monkeypatch):
    """A new estimator registered with needs=("values", "index") and critic=True gets a critic
    and, when the step traces (`jax.eval_shape`: nothing compiles), exactly the inputs the
    experience holds: the critic's values, the rows' groups, the old log-probs and the
    threshold, and no greedy baseline or sum_pi_squared it does not read."""
    from jrl.algos import advantages as adv_lib

    given = []

    def toy(*, token_level_rewards, response_mask, **inputs):
        given.append({k for k, v in inputs.items() if k in adv_lib.INPUTS and v is not None})
        return token_level_rewards, token_level_rewards

    monkeypatch.setitem(adv_lib.ESTIMATORS, "toy", adv_lib.Entry(toy, ("values", "index"), True))
    cfg = grpo_math.get_config("tiny")
    cfg.warmup.sft_steps = 0
    cfg.algorithm.adv_estimator = "toy"
    assert step_lib.needs_critic(cfg)
    tok, task, reward_fn, model_cfg = trainer.build(cfg)
    assert model_cfg.value_head is False
    assert step_lib.model_configs(cfg, model_cfg)[1].value_head
    init = lambda: step_lib.init_state(
        cfg, model_cfg, trainer.initial_params(cfg, model_cfg, jax.random.key(0)), jax.random.key(1)
    )
    state = jax.eval_shape(init)
    assert state.critic_params is not None
    step = step_lib.make_step(cfg, model_cfg, reward_fn, **trainer.sampling_ids(tok, task))
    jax.eval_shape(step, state, task.train_batch(0, step_lib.prompts_per_step(cfg)))
    assert given == [{"values", "index", "old_log_prob", "threshold"}]
    with pytest.raises(ValueError, match="critic=True goes with needs=\\('values'"):
        adv_lib.register("no_values", needs=("index",), critic=True)
