"""The train state and its optimizers: what changes across RL steps, and how it starts.

`TrainState` holds everything a checkpoint needs to resume a run exactly; `init_state` makes the
first one from the policy's parameters. The models a config trains (`model_configs`: the policy,
with a value head when the critic shares its backbone, and a separate critic), the optimizers
(`make_optimizer`: verl's AdamW with a linear warm-up and global-norm clipping;
`policy_optimizer`: a shared value head with the critic's settings) and their learning-rate
schedules live here too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import optax

from jrl.algos import advantages as adv_lib
from jrl.algos import group_ppo as group_lib
from jrl.models import lora as lora_lib
from jrl.models import transformer


@flax.struct.dataclass
class TrainState:
    """Everything that changes across steps (so a checkpoint of it resumes a run exactly)."""

    step: jax.Array  # int32 scalar: RL steps taken
    params: Any  # policy parameters (with the value head when the critic shares the backbone)
    opt_state: Any  # policy optimizer state (`policy_optimizer`: a shared value head's too)
    critic_params: Any  # separate critic (None without a critic or with a shared backbone)
    critic_opt_state: Any  # its optimizer state (None likewise)
    ref_params: Any  # frozen reference policy (None when neither KL loss nor KL reward is
    # used); with LoRA the frozen base, which is also the reference (adapters off)
    kl_coef: jax.Array  # float32 scalar: beta of KL-in-reward (its controller's state)
    group_threshold: jax.Array  # float32 scalar: GROUP-PPO's adaptive threshold tau
    skipped_steps: jax.Array  # int32 scalar: steps not applied because something was not finite
    key: jax.Array  # PRNG key


def needs_reference(cfg: ml_collections.ConfigDict) -> bool:
    return bool(cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


def needs_critic(cfg: ml_collections.ConfigDict) -> bool:
    """Whether the estimator's registry entry trains a critic (gae, group_ppo)."""
    return adv_lib.trains_critic(cfg.algorithm.adv_estimator)


def model_configs(cfg, model_cfg: transformer.ModelConfig):
    """(policy model config, separate critic model config or None). With
    `critic.share_backbone` the policy network carries the value head itself."""
    if not needs_critic(cfg):
        return model_cfg, None
    if cfg.critic.share_backbone:
        return dataclasses.replace(model_cfg, value_head=True), None
    return model_cfg, dataclasses.replace(model_cfg, lm_head=False, value_head=True)


def lr_schedule(opt_cfg) -> optax.Schedule:
    """Learning rate per optimizer update: linear warm-up over `lr_warmup_steps`, then constant."""
    if opt_cfg.lr_warmup_steps <= 0:
        return optax.constant_schedule(opt_cfg.lr)
    return optax.linear_schedule(0.0, opt_cfg.lr, opt_cfg.lr_warmup_steps)


def make_optimizer(opt_cfg) -> optax.GradientTransformation:
    """AdamW with linear warm-up to a constant rate and global-norm clipping (verl's defaults);
    `opt_cfg` is the `actor` or the `critic` section."""
    return optax.chain(
        optax.clip_by_global_norm(opt_cfg.grad_clip),
        optax.adamw(
            lr_schedule(opt_cfg),
            b1=opt_cfg.betas[0],
            b2=opt_cfg.betas[1],
            weight_decay=opt_cfg.weight_decay,
        ),
    )


def policy_optimizer(cfg) -> optax.GradientTransformation:
    """The optimizer of `TrainState.params`: `make_optimizer(cfg.actor)`; with a value head on the
    policy's backbone (critic.share_backbone) the head (`lora.HEAD_KEYS`) trains with the critic's
    settings (critic.lr and its warm-up, betas, weight decay, grad_clip of the head's own
    gradient), the rest with the actor's (`optax.partition`)."""
    actor = make_optimizer(cfg.actor)
    if not (needs_critic(cfg) and cfg.critic.share_backbone):
        return actor
    label = lambda params: {k: "critic" if k in lora_lib.HEAD_KEYS else "actor" for k in params}
    return optax.partition({"actor": actor, "critic": make_optimizer(cfg.critic)}, label)


def init_state(cfg, model_cfg: transformer.ModelConfig, params, key) -> TrainState:
    """The first train state. `model_cfg` and `params` are the policy's (see `model_configs`); a
    separate critic starts from the policy's weights plus a fresh value head."""
    _, critic_cfg = model_configs(cfg, model_cfg)
    key, key_critic = jax.random.split(key)
    critic_params = critic_opt_state = None
    if lora_lib.lora_on(cfg):
        params, critic_params, ref = lora_lib.init_lora(cfg, critic_cfg, params, key_critic)
    else:
        if critic_cfg is not None:
            head = transformer.init_params(critic_cfg, key_critic)
            critic_params = {k: params.get(k, v) for k, v in head.items()}  # backbone from policy
            critic_params = jax.tree_util.tree_map(jnp.copy, critic_params)
        ref = jax.tree_util.tree_map(jnp.copy, params) if needs_reference(cfg) else None
    if critic_params is not None:
        critic_opt_state = make_optimizer(cfg.critic).init(critic_params)
    return TrainState(
        step=jnp.int32(0),
        params=params,
        opt_state=policy_optimizer(cfg).init(params),
        critic_params=critic_params,
        critic_opt_state=critic_opt_state,
        ref_params=ref,
        kl_coef=jnp.float32(cfg.algorithm.kl_ctrl.kl_coef),
        group_threshold=group_lib.init_threshold(cfg.algorithm),
        skipped_steps=jnp.int32(0),
        key=key,
    )


def schedule_count(opt_state) -> jax.Array:
    """Optimizer updates applied so far: the count of the learning-rate schedule's state (it
    does not advance on an update the NaN guard or critic warm-up left out)."""
    is_count = lambda x: isinstance(x, optax.ScaleByScheduleState)
    (found,) = [s for s in jax.tree.leaves(opt_state, is_leaf=is_count) if is_count(s)]
    return found.count


def learning_rates(cfg, state: TrainState, shared: bool, with_critic: bool) -> dict:
    """`actor/lr` (and `critic/lr` when `with_critic`): the learning rate of the next update of
    `state` (the optimizers' own counts). A shared backbone's optimizer (`shared`) holds both, the
    value head's with critic.* (`policy_optimizer`)."""
    actor_opt, critic_opt = state.opt_state, state.critic_opt_state
    if shared:
        actor_opt, critic_opt = (state.opt_state.inner_states[k] for k in ("actor", "critic"))
    rates = {"actor/lr": lr_schedule(cfg.actor)(schedule_count(actor_opt))}
    if with_critic:
        rates["critic/lr"] = lr_schedule(cfg.critic)(schedule_count(critic_opt))
    return rates
