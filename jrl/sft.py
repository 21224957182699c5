"""Supervised warm-up of the small demo model: a few steps of next-token likelihood on the task's
reference answers, so that RL starts from a policy that is sometimes right (`warmup.*`).
`jrl.run.trainer` runs it before the first RL step of a fresh run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax

from jrl import logprobs
from jrl.models import transformer


def make_sft_step(cfg: ml_collections.ConfigDict, model_cfg: transformer.ModelConfig):
    """Supervised warm-up: `(params, opt_state, batch) -> (params, opt_state, loss)` on the task's
    reference answers (`answer_ids`, answer plus EOS), mean negative log-likelihood per token.
    A batch with its own warm-up targets (`sft_ids`, `sft_mask` the tokens the forward reads,
    `sft_loss_mask` those trained: jrl/data/tool_arith.py, whose tool answers are read, not
    trained) is trained on those instead."""
    tx = optax.adam(cfg.warmup.sft_lr)

    def loss_fn(params, batch):
        if "sft_ids" in batch:
            target, mask, trained = batch["sft_ids"], batch["sft_mask"], batch["sft_loss_mask"]
        else:
            target = batch["answer_ids"]
            t = jnp.arange(target.shape[1])[None]
            mask = trained = (t <= batch["answer_len"][:, None]).astype(jnp.int32)
        out = logprobs.response_outputs(
            model_cfg, params, batch["input_ids"], batch["attention_mask"], target, mask
        )
        return -jnp.sum(out["log_prob"] * trained) / jnp.sum(trained)

    def sft_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return tx, sft_step


def sft_warmup(cfg, model_cfg, task, params, accuracy_fn):
    """Supervised steps on the task's reference answers until the greedy accuracy on a fixed batch
    of train problems reaches `warmup.target_accuracy` or `warmup.sft_steps` steps are done.
    Accuracy is checked every `warmup.check_every` steps and, once it is past half the target,
    after every step: the warm-up stops at the first step at or above the target (the accuracy
    moves by up to 0.1 in one step), not at a later check that overshot it. Stopping at an
    accuracy, not a step count, leaves RL a policy that is partly right whatever the seed or
    machine. Returns (params, steps, accuracy)."""
    tx, sft_step = make_sft_step(cfg, model_cfg)
    sft_step = jax.jit(sft_step, donate_argnums=(0, 1))
    opt_state = tx.init(params)
    probe = task.train_batch(0, 256, stream=2)  # fixed train problems for the stopping test
    accuracy, steps = float(accuracy_fn(params, probe)["val/accuracy"]), 0
    while steps < cfg.warmup.sft_steps and accuracy < cfg.warmup.target_accuracy:
        batch = task.train_batch(steps, cfg.warmup.sft_batch_size, stream=1)  # not RL's data
        params, opt_state, _ = sft_step(params, opt_state, batch)
        steps += 1
        near = accuracy >= cfg.warmup.target_accuracy / 2  # then check after every step
        if near or steps % cfg.warmup.check_every == 0 or steps == cfg.warmup.sft_steps:
            accuracy = float(accuracy_fn(params, probe)["val/accuracy"])
    return params, steps, accuracy
