"""The step's own contract (jrl/step.py): its optimizer bookkeeping (critic warm-up leaves the
policy and its optimizer untouched, as verl skips the actor's update; the logged learning rate
follows the optimizer's own count of applied updates, and a step skipped by the NaN guard applies
none; a value head on the policy trains with the critic's optimizer settings), the policy loss's
randomness, DAPO's dynamic sampling by either of verl's metric names, ReMax's greedy baseline
shaped as the samples' scores, and what an estimator's registry entry asks of the step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jrl import rollout
from jrl import step as step_lib
from jrl import train_state
from jrl.run import trainer
from conftest import tiny_config
from configs import grpo_math, ppo_math


def setup(cfg, reward_fn=None):
    built = trainer.build(cfg)
    tok, task = built.tokenizer, built.task
    task_reward, model_cfg = built.reward_fn, built.model_cfg
    params = trainer.initial_params(cfg, model_cfg, jax.random.key(0))
    state = train_state.init_state(cfg, model_cfg, params, jax.random.key(1))
    ids = trainer.sampling_ids(tok, task)
    step = jax.jit(step_lib.make_step(cfg, model_cfg, reward_fn or task_reward, **ids))
    return state, step, task.train_batch(0, step_lib.prompts_per_step(cfg))


def test_critic_warmup_skips_the_policy_update_entirely():
    """PPO with a separate critic, critic_warmup=1 and AdamW weight decay: after step 1 the policy
    and its optimizer state (Adam's count, moments) are exactly as they were, the critic moved;
    at step 2 the policy updates. (Multiplying the policy loss by 0 still let weight decay shrink
    the policy and advanced Adam's count and the warm-up of the learning rate.)"""
    cfg = tiny_config("ppo_math")
    cfg.warmup.sft_steps = 0
    cfg.critic.critic_warmup = 1
    cfg.actor.weight_decay = 0.1
    state, step, batch = setup(cfg)
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    critic_before = jax.tree.map(np.asarray, state.critic_params)
    state, _ = step(state, batch)
    jax.tree.map(np.testing.assert_array_equal, before, (state.params, state.opt_state))
    assert int(train_state.schedule_count(state.opt_state)) == 0
    moved = jax.tree.map(
        lambda a, b: np.any(a != np.asarray(b)), critic_before, state.critic_params
    )
    assert any(jax.tree.leaves(moved))
    state, _ = step(state, batch)  # past the warm-up: the policy trains
    updates = cfg.actor.ppo_epochs * cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size
    assert int(train_state.schedule_count(state.opt_state)) == updates
    assert any(jax.tree.leaves(jax.tree.map(lambda a, b: np.any(a != b), before[0], state.params)))


def test_a_value_head_on_the_policy_trains_with_the_critics_optimizer_settings():
    """critic.share_backbone with actor.lr 1e-5 and critic.lr 1e-2 (no weight decay, one update
    per step): Adam's first update moves each parameter by its rate (lr * g / |g|), so the value
    head moves by 1e-2 per entry and the backbone by 1e-5; the logged rates are those. (The head
    trained with the actor's optimizer, 1e-5, while critic/lr said 1e-2.)"""
    cfg = ppo_math.get_config("tiny,shared")
    cfg.warmup.sft_steps = 0
    cfg.actor.ppo_mini_batch_size = cfg.data.train_batch_size
    cfg.actor.lr, cfg.critic.lr = 1e-5, 1e-2
    cfg.actor.weight_decay = cfg.critic.weight_decay = 0.0
    state, step, batch = setup(cfg)
    new, metrics = step(state, batch)
    assert float(metrics["actor/lr"]) == pytest.approx(1e-5)
    assert float(metrics["critic/lr"]) == pytest.approx(1e-2)
    moved = jax.tree.map(
        lambda a, b: np.abs(np.asarray(b) - np.asarray(a)), state.params, new.params
    )
    head = [moved.pop(k) for k in ("value_head", "value_head_bias")]
    np.testing.assert_allclose(np.concatenate([x.ravel() for x in head]), 1e-2, rtol=1e-3)
    backbone = np.concatenate([x.ravel() for x in jax.tree.leaves(moved)])
    assert backbone.max() <= 1.01e-5 and np.median(backbone) > 0.9e-5


def nan_reward(batch, response_ids, response_mask, *, eos_id):
    return jnp.full(response_ids.shape[:1], jnp.nan, jnp.float32)


def test_logged_lr_follows_applied_updates_after_a_skipped_step():
    """lr warm-up over 4 updates of lr 1e-3, u = 2 updates per step. Step 1 has a NaN reward and
    is skipped (no update applied); step 2's first update is then the optimizer's first: lr 0
    (warm-up from 0), not 1e-3 * 2 / 4 as state.step * u would say; step 3's is the
    third update: 1e-3 * 2 / 4."""
    cfg = tiny_config()
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
    tx = train_state.make_optimizer(tiny_config().actor)
    params = {"w": jnp.ones(3)}
    opt_state = tx.init(params)
    for _ in range(3):
        _, opt_state = tx.update({"w": jnp.ones(3)}, opt_state, params)
    assert int(train_state.schedule_count(opt_state)) == 3
    assert isinstance(optax.ScaleByScheduleState(count=jnp.int32(0)), optax.ScaleByScheduleState)


def test_the_update_gives_clip_cov_its_random_choice_of_tokens():
    """clip_cov detaches n_clip = 0.25 * 32 = 8 of its candidate tokens, chosen at random (verl)
    when the step passes its key: two micro-batch keys pick different tokens, so the policy
    terms differ; the same key gives the same terms. (The step passed no key, so the choice was
    the deterministic top-covariance one whatever the key.)"""
    cfg = tiny_config()
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


def zero_reward(batch, response_ids, response_mask, *, eos_id):
    return jnp.zeros(response_ids.shape[:1], jnp.float32)


def eos_often(params, eos_id: int, weight: float = 4.5):
    """The tiny model's params changed so that EOS is likely at some positions and not at others
    (responses of every length): the final norm keeps only hidden dimension 0, which only EOS's
    (tied) embedding reads, so EOS's logit is `weight * h_0` and every other token's is 0."""
    scale = jnp.zeros_like(params["final_norm"]["scale"]).at[0].set(1.0)
    embed = params["embed"].at[:, 0].set(0.0).at[eos_id, 0].set(weight)
    return {**params, "embed": embed, "final_norm": {"scale": scale}}


def test_dynamic_sampling_filters_by_score_the_overlong_shaped_reward():
    """filter_groups.metric="score" (verl's name; the experience calls it `scores`): a reward of 0
    everywhere gives no group an `acc` signal, but the overlong penalty over the whole response
    (buffer = R = 4, factor 1: score = -len / 4) does wherever a group's lengths differ. The
    kept groups come first and are exactly those; each row's score is -len / 4. (The step
    indexed the experience with "score": a KeyError while tracing.)"""
    cfg = grpo_math.get_config("tiny")
    cfg.algorithm.filter_groups.enable = True
    cfg.algorithm.filter_groups.metric = "score"
    cfg.algorithm.filter_groups.max_num_gen_batches = 2
    cfg.reward.overlong_buffer.enable = True
    cfg.reward.overlong_buffer.len = 4
    cfg.reward.overlong_buffer.penalty_factor = 1.0
    built = trainer.build(cfg)
    tok, task, model_cfg = built.tokenizer, built.task, built.model_cfg
    ids = trainer.sampling_ids(tok, task)
    assert ids["max_new_tokens"] == 4
    params = eos_often(trainer.initial_params(cfg, model_cfg, jax.random.key(0)), ids["eos_id"])
    state = train_state.init_state(cfg, model_cfg, params, jax.random.key(1))
    generate, _, _ = step_lib.make_phases(cfg, model_cfg, zero_reward, **ids)
    pool = task.train_batch(0, step_lib.prompts_per_step(cfg))
    exp, metrics = jax.jit(generate)(state, pool, jax.random.key(2))
    length = np.asarray(exp["response_mask"]).sum(-1)
    np.testing.assert_array_equal(exp["acc"], 0.0)
    np.testing.assert_allclose(exp["scores"], -length / 4.0)
    differ = [len(set(g)) > 1 for g in length.reshape(-1, cfg.rollout.n)]
    filled = round(float(metrics["training/filled_groups_ratio"]) * cfg.data.train_batch_size)
    assert 0 < filled < cfg.data.train_batch_size  # (2 of 4 here)
    assert differ == [True] * filled + [False] * (cfg.data.train_batch_size - filled)


def test_remax_baseline_is_the_greedy_answers_shaped_score():
    """ReMax with DAPO's overlong penalty over the whole response (buffer = R = 4, factor 1) and
    a reward of 0: each row's baseline is its prompt's greedy answer's score, -len / 4 with the
    greedy answer's length, the reward the sampled rows' scores (-len / 4) are; verl takes both
    from the same reward manager. (The baseline was the greedy answer's `acc`, 0.)"""
    cfg = grpo_math.get_config("tiny")
    cfg.algorithm.adv_estimator = "remax"
    cfg.reward.overlong_buffer.enable = True
    cfg.reward.overlong_buffer.len = 4
    cfg.reward.overlong_buffer.penalty_factor = 1.0
    built = trainer.build(cfg)
    tok, task, model_cfg = built.tokenizer, built.task, built.model_cfg
    ids = trainer.sampling_ids(tok, task)
    params = trainer.initial_params(cfg, model_cfg, jax.random.key(0))
    state = train_state.init_state(cfg, model_cfg, params, jax.random.key(1))
    generate, _, _ = step_lib.make_phases(cfg, model_cfg, zero_reward, **ids)
    prompts = task.train_batch(0, cfg.data.train_batch_size)
    exp, _ = jax.jit(generate)(state, prompts, jax.random.key(2))

    def greedy_answer(p, x, m):
        return rollout.generate(model_cfg, p, x, m, jax.random.key(0), greedy=True, **ids)

    greedy = jax.jit(greedy_answer)(params, prompts["input_ids"], prompts["attention_mask"])
    greedy_length = np.asarray(greedy.response_mask).sum(-1)
    np.testing.assert_allclose(exp["scores"], -np.asarray(exp["response_mask"]).sum(-1) / 4.0)
    want = np.repeat(-greedy_length / 4.0, cfg.rollout.n)
    np.testing.assert_allclose(exp["reward_baselines"], want)
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
    assert train_state.needs_critic(cfg)
    built = trainer.build(cfg)
    tok, task, reward_fn, model_cfg = built.tokenizer, built.task, built.reward_fn, built.model_cfg
    assert model_cfg.value_head is False
    assert train_state.model_configs(cfg, model_cfg)[1].value_head
    init = lambda: train_state.init_state(
        cfg, model_cfg, trainer.initial_params(cfg, model_cfg, jax.random.key(0)), jax.random.key(1)
    )
    state = jax.eval_shape(init)
    assert state.critic_params is not None
    step = step_lib.make_step(cfg, model_cfg, reward_fn, **trainer.sampling_ids(tok, task))
    jax.eval_shape(step, state, task.train_batch(0, step_lib.prompts_per_step(cfg)))
    assert given == [{"values", "index", "old_log_prob", "threshold"}]
    with pytest.raises(ValueError, match="critic=True goes with needs=\\('values'"):
        adv_lib.register("no_values", needs=("index",), critic=True)
