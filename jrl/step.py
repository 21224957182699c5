"""The fused RL step: rollout -> reward -> old / reference log-probs -> advantages -> PPO updates.

`state, metrics = step(state, prompts)` is ONE function for `jax.jit` (with the state donated):
every shape is static (P prompt length, R response length, B_p prompts, n samples per prompt,
B = B_p * n rows), every variant is picked by name from the config at trace time, and nothing
leaves the device until the host reads `metrics`.

Alignment (DESIGN.md): response position t is action y_t; `log_probs[:, t]` is read from the
logits at the position before y_t (the last prompt token for t = 0).
"""

from __future__ import annotations

from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import ml_collections
import optax

from jrl import rollout
from jrl.algos import advantages as adv_lib
from jrl.algos import kl as kl_lib
from jrl.algos import losses
from jrl.models import transformer

Batch = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
    """Everything that changes across steps (so a checkpoint of it resumes a run exactly)."""

    step: jax.Array  # int32 scalar: RL steps taken
    params: Any  # policy parameters
    opt_state: Any  # policy optimizer state
    ref_params: Any  # frozen reference policy (None when neither KL loss nor KL reward is used)
    kl_coef: jax.Array  # float32 scalar: beta of KL-in-reward (its controller's state)
    key: jax.Array  # PRNG key


def needs_reference(cfg: ml_collections.ConfigDict) -> bool:
    return bool(cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


def make_optimizer(cfg: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """AdamW with linear warm-up to a constant rate and global-norm clipping (verl's defaults)."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.actor.grad_clip),
        optax.adamw(
            lr_schedule(cfg),
            b1=cfg.actor.betas[0],
            b2=cfg.actor.betas[1],
            weight_decay=cfg.actor.weight_decay,
        ),
    )


def lr_schedule(cfg: ml_collections.ConfigDict) -> optax.Schedule:
    """Learning rate per optimizer update: linear warm-up over `actor.lr_warmup_steps`, then constant."""
    if cfg.actor.lr_warmup_steps <= 0:
        return optax.constant_schedule(cfg.actor.lr)
    return optax.linear_schedule(0.0, cfg.actor.lr, cfg.actor.lr_warmup_steps)


def updates_per_step(cfg: ml_collections.ConfigDict) -> int:
    return cfg.actor.ppo_epochs * (cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size)


def init_state(cfg, model_cfg: transformer.ModelConfig, params, key) -> TrainState:
    ref = jax.tree_util.tree_map(jnp.copy, params) if needs_reference(cfg) else None
    return TrainState(
        step=jnp.int32(0),
        params=params,
        opt_state=make_optimizer(cfg).init(params),
        ref_params=ref,
        kl_coef=jnp.float32(cfg.algorithm.kl_ctrl.kl_coef),
        key=key,
    )


def response_logprobs(
    model_cfg,
    params,
    prompt_ids_BP,
    prompt_mask_BP,
    response_ids_BR,
    response_mask_BR,
    temperature: float = 1.0,
    with_entropy: bool = False,
):
    """log pi(y_t | prompt, y_<t) [B, R] under softmax(logits / T), and optionally the entropy [B, R]."""
    p = prompt_ids_BP.shape[1]
    ids = jnp.concatenate([prompt_ids_BP, response_ids_BR], axis=1)
    mask = jnp.concatenate([prompt_mask_BP, response_mask_BR], axis=1)
    logits, _ = transformer.apply_full(model_cfg, params, ids, mask)
    logits_BRV = logits[:, p - 1 : -1] / temperature
    logp_BR = jnp.take_along_axis(
        jax.nn.log_softmax(logits_BRV, -1), response_ids_BR[..., None], -1
    )[..., 0]
    entropy_BR = losses.entropy_from_logits(logits_BRV) if with_entropy else None
    return logp_BR, entropy_BR


def last_token_scores(scores_B, response_mask_BR):
    """token_level_scores [B, R]: the sequence score placed on the last valid response token."""
    last = jnp.sum(response_mask_BR, -1) - 1
    return jax.nn.one_hot(last, response_mask_BR.shape[1], dtype=jnp.float32) * scores_B[:, None]


def _stats(name, x, mask=None):
    """verl-style mean / max / min of x over valid entries."""
    if mask is None:
        mask = jnp.ones_like(x)
    mask = mask.astype(bool)
    big = jnp.finfo(jnp.float32).max
    return {
        f"{name}/mean": jnp.sum(jnp.where(mask, x, 0)) / jnp.maximum(jnp.sum(mask), 1),
        f"{name}/max": jnp.max(jnp.where(mask, x, -big)),
        f"{name}/min": jnp.min(jnp.where(mask, x, big)),
    }


def make_phases(
    cfg: ml_collections.ConfigDict,
    model_cfg: transformer.ModelConfig,
    reward_fn: Callable,
    *,
    eos_id: int,
    pad_id: int,
    max_new_tokens: int,
):
    """The three phases of a step as pure functions (the fused step chains them; the benchmark
    also jits them one by one to time each):

      generate(params, prompts, key) -> experience          rollout of B = B_p * n rows
      score(state, experience) -> (experience, metrics, kl_coef)
                                    reward, old / ref log-probs, KL in reward, advantages
      update(params, opt_state, experience, key) -> (params, opt_state, metrics)
                                    ppo_epochs x shuffled minibatches of optax updates
    """
    actor, algo, roll_cfg = cfg.actor, cfg.algorithm, cfg.rollout
    n = roll_cfg.n
    tx = make_optimizer(cfg)
    use_ref = needs_reference(cfg)

    def generate(params, prompts: Batch, key) -> Batch:
        rows = jax.tree_util.tree_map(lambda x: jnp.repeat(x, n, axis=0), prompts)
        out = rollout.generate(
            model_cfg,
            params,
            rows["input_ids"],
            rows["attention_mask"],
            key,
            max_new_tokens=max_new_tokens,
            eos_id=eos_id,
            pad_id=pad_id,
            temperature=roll_cfg.temperature,
            top_k=roll_cfg.top_k,
            top_p=roll_cfg.top_p,
        )
        return {**rows, "response_ids": out.response_ids, "response_mask": out.response_mask}

    def score(state: TrainState, exp: Batch):
        mask = exp["response_mask"]
        b = mask.shape[0]
        index = jnp.arange(b, dtype=jnp.int32) // n  # the prompt (group) of each row
        scores = reward_fn(exp, exp["response_ids"], mask, eos_id=eos_id)
        token_level_scores = last_token_scores(scores, mask)
        logprob = lambda p: jax.lax.stop_gradient(
            response_logprobs(
                model_cfg,
                p,
                exp["input_ids"],
                exp["attention_mask"],
                exp["response_ids"],
                mask,
                roll_cfg.temperature,
            )[0]
        )
        exp = {**exp, "scores": scores, "old_log_prob": logprob(state.params)}
        if use_ref:
            exp["ref_log_prob"] = logprob(state.ref_params)
        metrics = {}
        token_level_rewards, kl_coef = token_level_scores, state.kl_coef
        if algo.use_kl_in_reward:
            token_level_rewards, kl_metrics = kl_lib.apply_kl_penalty(
                token_level_scores,
                exp["old_log_prob"],
                exp["ref_log_prob"],
                mask,
                state.kl_coef,
                algo.kl_penalty,
            )
            metrics.update(kl_metrics)
            kl_coef = kl_lib.kl_ctrl_update(
                state.kl_coef, kl_metrics["actor/reward_kl_penalty"], b, algo
            )
        advantages, returns = adv_lib.compute(
            algo.adv_estimator,
            token_level_rewards=token_level_rewards,
            response_mask=mask,
            index=index,
            config=algo,
        )
        exp.update(token_level_rewards=token_level_rewards, advantages=advantages, returns=returns)
        return exp, metrics, kl_coef

    def actor_loss(params, mb):
        logp, entropy = response_logprobs(
            model_cfg,
            params,
            mb["input_ids"],
            mb["attention_mask"],
            mb["response_ids"],
            mb["response_mask"],
            roll_cfg.temperature,
            with_entropy=True,
        )
        mask = mb["response_mask"]
        pg_loss, metrics = losses.policy_loss(
            actor.policy_loss,
            old_log_prob=mb["old_log_prob"],
            log_prob=logp,
            advantages=mb["advantages"],
            response_mask=mask,
            loss_agg_mode=actor.loss_agg_mode,
            config=actor,
        )
        entropy = losses.agg_loss(entropy, mask, actor.loss_agg_mode)
        loss = pg_loss - actor.entropy_coeff * entropy
        metrics = {**metrics, "actor/pg_loss": pg_loss, "actor/entropy": entropy}
        if actor.use_kl_loss:
            kl = kl_lib.kl_penalty(logp, mb["ref_log_prob"], actor.kl_loss_type)
            kl_loss = losses.agg_loss(kl, mask, actor.loss_agg_mode)
            loss = loss + actor.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss
        return loss, metrics

    def update_minibatch(carry, mb):
        params, opt_state = carry
        grads, metrics = jax.grad(actor_loss, has_aux=True)(params, mb)
        updates, opt_state = tx.update(grads, opt_state, params)
        metrics["actor/grad_norm"] = optax.tree.norm(grads)
        return (optax.apply_updates(params, updates), opt_state), metrics

    def update(params, opt_state, exp: Batch, key):
        keys = (
            "input_ids",
            "attention_mask",
            "response_ids",
            "response_mask",
            "old_log_prob",
            "advantages",
        ) + (("ref_log_prob",) if use_ref else ())
        data = {k: exp[k] for k in keys}
        b = exp["response_mask"].shape[0]
        mb_rows = actor.ppo_mini_batch_size * n
        num_mb = b // mb_rows

        def epoch(carry, key):
            perm = jax.random.permutation(key, b)
            mbs = jax.tree_util.tree_map(
                lambda x: x[perm].reshape(num_mb, mb_rows, *x.shape[1:]), data
            )
            return jax.lax.scan(update_minibatch, carry, mbs)

        (params, opt_state), metrics = jax.lax.scan(
            epoch, (params, opt_state), jax.random.split(key, actor.ppo_epochs)
        )
        return params, opt_state, jax.tree_util.tree_map(jnp.mean, metrics)

    return generate, score, update


def make_step(
    cfg: ml_collections.ConfigDict,
    model_cfg: transformer.ModelConfig,
    reward_fn: Callable,
    *,
    eos_id: int,
    pad_id: int,
    max_new_tokens: int,
):
    """Builds `step(state, prompts) -> (state, metrics)`; `prompts` holds B_p rows of the task batch."""
    generate, score, update = make_phases(
        cfg, model_cfg, reward_fn, eos_id=eos_id, pad_id=pad_id, max_new_tokens=max_new_tokens
    )
    schedule = lr_schedule(cfg)

    def step(state: TrainState, prompts: Batch):
        key, k_roll, k_shuffle = jax.random.split(state.key, 3)
        exp = generate(state.params, prompts, k_roll)
        exp, metrics, kl_coef = score(state, exp)
        params, opt_state, update_metrics = update(state.params, state.opt_state, exp, k_shuffle)
        metrics.update(update_metrics)
        metrics.update(experience_metrics(exp, max_new_tokens))
        metrics["actor/lr"] = schedule(
            state.step * updates_per_step(cfg)
        )  # at this step's 1st update
        new_state = state.replace(
            step=state.step + 1, params=params, opt_state=opt_state, kl_coef=kl_coef, key=key
        )
        return new_state, metrics

    return step


def experience_metrics(exp: Batch, max_new_tokens: int) -> dict[str, jax.Array]:
    """verl's data metrics of a scored batch: scores, rewards, advantages, returns, lengths."""
    mask = exp["response_mask"]
    length = jnp.sum(mask, -1)
    prompt_length = jnp.sum(exp["attention_mask"], -1)
    metrics = {}
    metrics.update(_stats("critic/score", exp["scores"]))
    metrics.update(_stats("critic/rewards", jnp.sum(exp["token_level_rewards"] * mask, -1)))
    metrics.update(_stats("critic/advantages", exp["advantages"], mask))
    metrics.update(_stats("critic/returns", exp["returns"], mask))
    metrics.update(_stats("response_length", length.astype(jnp.float32)))
    metrics.update(_stats("prompt_length", prompt_length.astype(jnp.float32)))
    metrics["response_length/clip_ratio"] = jnp.mean(length >= max_new_tokens)
    metrics["perf/total_num_tokens"] = jnp.sum(length) + jnp.sum(prompt_length)
    return metrics


def make_eval(
    model_cfg: transformer.ModelConfig,
    reward_fn: Callable,
    *,
    eos_id: int,
    pad_id: int,
    max_new_tokens: int,
):
    """`evaluate(params, batch) -> {"val/accuracy", "val/response_length"}` with greedy decoding."""

    def evaluate(params, batch: Batch):
        out = rollout.generate(
            model_cfg,
            params,
            batch["input_ids"],
            batch["attention_mask"],
            jax.random.key(0),
            max_new_tokens=max_new_tokens,
            eos_id=eos_id,
            pad_id=pad_id,
            greedy=True,
        )
        scores = reward_fn(batch, out.response_ids, out.response_mask, eos_id=eos_id)
        return {
            "val/accuracy": jnp.mean(scores),
            "val/response_length": jnp.mean(jnp.sum(out.response_mask, -1).astype(jnp.float32)),
        }

    return evaluate


def make_sft_step(cfg: ml_collections.ConfigDict, model_cfg: transformer.ModelConfig):
    """Supervised warm-up: `(params, opt_state, batch) -> (params, opt_state, loss)` on the task's
    reference answers (`answer_ids`, answer plus EOS), mean negative log-likelihood per token."""
    tx = optax.adam(cfg.warmup.sft_lr)

    def loss_fn(params, batch):
        target = batch["answer_ids"]
        mask = (jnp.arange(target.shape[1])[None] <= batch["answer_len"][:, None]).astype(jnp.int32)
        logp, _ = response_logprobs(
            model_cfg, params, batch["input_ids"], batch["attention_mask"], target, mask
        )
        return -jnp.sum(logp * mask) / jnp.sum(mask)

    def sft_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return tx, sft_step
