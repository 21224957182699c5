"""Every advantage estimator and policy loss inside the fused step: 3 steps, one compile, finite
metrics; and the ppo_math / dapo_math / group_ppo_math configs."""

import math

import jax
import jax.numpy as jnp
import pytest

from jrl import rewards
from jrl import step as step_lib
from jrl import train_state
from jrl.run import trainer
from jrl.algos import advantages, losses
from configs import dapo_math, group_ppo_math, ppo_math
from conftest import tiny_config


def divisible_by_3(batch, response_ids, response_mask, *, eos_id):
    """A reward with signal for an untrained model: the share of response tokens divisible by 3."""
    hits = ((response_ids % 3) == 0) * response_mask
    return jnp.sum(hits, -1) / jnp.maximum(jnp.sum(response_mask, -1), 1)


def _small(cfg):
    cfg.model.hidden_size, cfg.model.intermediate_size, cfg.model.num_layers = 16, 32, 1
    cfg.warmup.sft_steps = 0
    cfg.task.reward = "divisible_by_3"
    return cfg


def _run_three_steps(cfg):
    built = trainer.build(cfg)
    tok, task, reward_fn, model_cfg = built.tokenizer, built.task, built.reward_fn, built.model_cfg
    params = trainer.initial_params(cfg, model_cfg, jax.random.key(0))
    state = train_state.init_state(cfg, model_cfg, params, jax.random.key(1))
    traces = []
    inner = step_lib.make_step(cfg, model_cfg, reward_fn, **trainer.sampling_ids(tok, task))

    def counted(state, batch):
        traces.append(1)
        return inner(state, batch)

    step = jax.jit(counted, donate_argnums=0)
    for i in range(3):
        state, metrics = step(state, task.train_batch(i, step_lib.prompts_per_step(cfg)))
    assert len(traces) == 1
    metrics = jax.device_get(metrics)
    bad = {k: float(v) for k, v in metrics.items() if not math.isfinite(float(v))}
    assert not bad, bad
    assert int(metrics["training/skipped_steps"]) == 0
    return metrics


@pytest.fixture(autouse=True)
def reward(monkeypatch):
    monkeypatch.setitem(rewards.REWARDS, "divisible_by_3", divisible_by_3)


# Names verl 0.9.1 added, each run once, paired (estimator, policy loss, rollout correction) so
# that one compile covers three things; the plain parametrisations below skip them.
PAIRED = [
    ("gdpo", "dppo_tv", None),
    ("optimal_token_baseline", "dppo_kl", "token"),
    ("tir_optimal_token_baseline", "dro", "sequence"),
    ("grpo_vectorized", "bypass_mode", "bypass"),
    ("rloo_vectorized", "vanilla", "rejection"),
]
PAIRED_NAMES = {name for pair in PAIRED for name in pair[:2]} - {"vanilla"}


def _rollout_correction(cfg, kind):
    rc = cfg.algorithm.rollout_correction
    rc.enable = kind is not None
    if kind in ("token", "sequence"):
        rc.rollout_is, rc.rollout_is_threshold = kind, "2.0" if kind == "token" else "0.5_2.0"
        rc.rollout_is_batch_normalize = kind == "token"
    elif kind == "rejection":  # no IS weights: token and sequence rejection only
        rc.rollout_is, rc.rollout_rs, rc.rollout_rs_threshold = (
            "",
            "token_k1,seq_mean_k3",
            "1.5,0.5",
        )
    elif kind == "bypass":
        rc.bypass_mode, rc.loss_type, rc.rollout_is = True, "reinforce", "token"
        rc.rollout_rs, rc.rollout_rs_threshold = "token_k3", "1.0"


@pytest.mark.parametrize("estimator, loss, correction", PAIRED, ids=[p[0] for p in PAIRED])
def test_verl_names_in_the_fused_step(estimator, loss, correction):
    cfg = _small(tiny_config())
    cfg.algorithm.adv_estimator, cfg.actor.policy_loss = estimator, loss
    cfg.actor.dro_beta = 0.1
    _rollout_correction(cfg, correction)
    assert step_lib.on_policy_update(cfg) is False or correction is None
    metrics = _run_three_steps(cfg)
    if correction is not None:
        assert "rollout_corr/kl" in metrics and "rollout_corr/chi2_token" in metrics
    if correction in ("token", "sequence"):
        assert metrics["rollout_corr/rollout_is_mean"] > 0
    if correction == "rejection":
        assert 0 <= metrics["rollout_corr/rollout_rs_masked_fraction"] <= 1
        assert "rollout_corr/rollout_rs_seq_mean_k3_max" in metrics


def _estimators_and_losses():
    """The other estimators and policy losses, one compile for two: each loss (but vanilla) with
    an estimator without a critic, in name order; the estimators left over with vanilla (the
    critic ones among them), the losses left over (if any) with grpo."""
    estimators = sorted(set(advantages.names()) - PAIRED_NAMES)
    loss_names = sorted(set(losses.policy_loss_names()) - PAIRED_NAMES - {"vanilla"})
    actor_only = [e for e in estimators if not advantages.ESTIMATORS[e].critic]
    pairs = list(zip(actor_only, loss_names))
    paired = {name for pair in pairs for name in pair}
    pairs += [(e, "vanilla") for e in estimators if e not in paired]
    pairs += [("grpo", loss) for loss in loss_names if loss not in paired]
    return pairs


@pytest.mark.parametrize("estimator, loss", _estimators_and_losses(), ids=lambda name: name)
def test_each_estimator_and_policy_loss_in_the_fused_step(estimator, loss):
    cfg = _small(tiny_config())
    cfg.algorithm.adv_estimator, cfg.actor.policy_loss = estimator, loss
    metrics = _run_three_steps(cfg)
    if estimator in ("gae", "group_ppo"):
        assert "critic/vf_loss" in metrics and "critic/values/mean" in metrics
    if estimator == "group_ppo":
        assert metrics["group/total_endpoints"] >= 16  # at least one segment per row


@pytest.mark.parametrize(
    "get_config",
    [ppo_math.get_config, dapo_math.get_config, group_ppo_math.get_config],
    ids=["ppo_math", "dapo_math", "group_ppo_math"],
)
def test_algorithm_configs(get_config):
    cfg = _small(get_config("tiny"))
    cfg.actor.use_kl_loss = get_config is ppo_math.get_config  # also the KL-loss path
    cfg.algorithm.use_kl_in_reward = get_config is group_ppo_math.get_config  # and KL in reward
    metrics = _run_three_steps(cfg)
    if get_config is dapo_math.get_config:
        assert 1 <= metrics["training/num_gen_batches"] <= 3
    if cfg.algorithm.use_kl_in_reward:
        assert "actor/reward_kl_penalty" in metrics
